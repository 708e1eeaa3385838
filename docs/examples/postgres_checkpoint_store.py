"""A checkpoint store of your own: a listener's checkpoint in the application's PostgreSQL.

``changefeed.listener.SqliteCheckpointStore`` keeps checkpoints in a local
file. A service that already has a database (and may move between hosts)
can keep them there instead: a store is any object with the two coroutines
of ``changefeed.listener.CheckpointStore``, ``load`` and ``save``. This one
keeps one row per resource (``jsonb``), so an incremental save writes the
changed rows only, and each save is one transaction::

    pool = await asyncpg.create_pool(DSN)
    store = PostgresCheckpointStore(pool, name="tcns-1")
    await store.setup()
    listener = Listener(url, instance=..., service="tcns", change_kinds=[...], checkpoint=store)

One listener writes a checkpoint name: from its first load until it closes,
the store holds a session advisory lock on the name, on one connection of
the pool that it keeps and does all its reads and writes on, so that no
save goes out without the lock; a second store of the same name, in any
process, is refused with ``CheckpointRefused``. A process that dies, or a
connection that drops, lets go of the lock with its session (the next save
takes it again, or is refused). The listener closes the store when it
closes; a ``load()`` of your own needs a ``close()`` after it, and the pool
closes only once the store has let go of its connection.

The application may write its own tables in the same database; the
checkpoint does not take part in their transactions (a restart replays what
the checkpoint had not caught up with, and the callbacks are idempotent).
``mypy --strict`` checks this file; ``tests/test_checkpoint.py`` runs a
restart, and a refused second store, through it.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping
from typing import Any

import asyncpg
import orjson

from changefeed.listener import (
    ChangeKind,
    Checkpoint,
    CheckpointError,
    CheckpointRefused,
    JsonItems,
    MirrorCheckpoint,
)

_LOCK_KEY = "SELECT hashtextextended('changefeed checkpoint ' || $1, 0)"
"""The advisory lock key of a checkpoint name (64 bits of its hash)."""

SCHEMA = """
CREATE TABLE IF NOT EXISTS listener_checkpoint (
    name         text PRIMARY KEY,
    sequence     bigint NOT NULL,
    cursor       text,
    change_kinds jsonb NOT NULL,
    saved_at     double precision NOT NULL
);
CREATE TABLE IF NOT EXISTS listener_checkpoint_mirror (
    name       text NOT NULL,
    controller text NOT NULL,
    resource   text NOT NULL,
    pending    text[] NOT NULL,
    PRIMARY KEY (name, controller)
);
CREATE TABLE IF NOT EXISTS listener_checkpoint_item (
    name       text NOT NULL,
    controller text NOT NULL,
    id         text NOT NULL,
    item       jsonb NOT NULL,
    PRIMARY KEY (name, controller, id)
);
"""


def _documents(items: Mapping[str, Any]) -> Iterator[tuple[str, str]]:
    """``(id, JSON text)`` of each resource; a ``JsonItems`` (what a controller hands
    over) gives the ones it holds encoded as they are."""
    if isinstance(items, JsonItems):
        return ((key, document.decode()) for key, document in items.encoded_items())
    return ((key, orjson.dumps(value).decode()) for key, value in items.items())


class PostgresCheckpointStore:
    """Keeps one listener's checkpoint in PostgreSQL tables (``CheckpointStore``).

    Args:
        pool: the application's connection pool.
        name: this checkpoint's name (one per listener).
    """

    def __init__(self, pool: asyncpg.Pool[asyncpg.Record], name: str = "default") -> None:
        self.pool = pool
        self.name = name
        self._holder: asyncpg.pool.PoolConnectionProxy[asyncpg.Record] | None = None

    async def setup(self) -> None:
        """Create the tables (idempotent)."""
        async with self.pool.acquire() as conn:
            await conn.execute(SCHEMA)

    async def _hold(self) -> asyncpg.pool.PoolConnectionProxy[asyncpg.Record]:
        """The connection holding the name's lock, taken once (again after it dropped).

        Raises:
            CheckpointRefused: another store holds it.
        """
        if self._holder is not None:
            if not self._holder.is_closed():
                return self._holder
            dropped, self._holder = self._holder, None  # and the lock with its session
            await self.pool.release(dropped)
        conn = await self.pool.acquire()
        try:
            key = await conn.fetchval(_LOCK_KEY, self.name)
            taken = await conn.fetchval("SELECT pg_try_advisory_lock($1)", key)
        except BaseException:
            await self.pool.release(conn)
            raise
        if not taken:
            await self.pool.release(conn)
            raise CheckpointRefused(
                f"checkpoint {self.name!r} is in use by another listener (its advisory"
                " lock is held): two listeners must not share a checkpoint"
            )
        self._holder = conn
        return conn

    async def close(self) -> None:
        """Let go of the name's lock and its connection (a later load takes them again)."""
        holder, self._holder = self._holder, None
        if holder is not None:
            try:
                await holder.execute("SELECT pg_advisory_unlock_all()")
            finally:
                await self.pool.release(holder)

    async def load(self) -> Checkpoint | None:
        conn = await self._hold()
        async with conn.transaction(isolation="repeatable_read"):
            head = await conn.fetchrow(
                "SELECT sequence, cursor, change_kinds::text, saved_at"
                " FROM listener_checkpoint WHERE name = $1",
                self.name,
            )
            if head is None:
                return None
            mirrors = await conn.fetch(
                "SELECT controller, resource, pending FROM listener_checkpoint_mirror"
                " WHERE name = $1",
                self.name,
            )
            rows = await conn.fetch(
                "SELECT controller, id, item::text FROM listener_checkpoint_item WHERE name = $1",
                self.name,
            )
        # Handed over still encoded: the controller decodes each when it is first read.
        items: dict[str, dict[str, bytes]] = {row["controller"]: {} for row in mirrors}
        for row in rows:
            items[row["controller"]][row["id"]] = row["item"].encode()
        kinds = tuple(ChangeKind.from_json(doc) for doc in orjson.loads(head["change_kinds"]))
        parts = {
            row["controller"]: MirrorCheckpoint(
                row["resource"],
                JsonItems(encoded=items[row["controller"]]),
                (),
                frozenset(row["pending"]),
            )
            for row in mirrors
        }
        return Checkpoint(
            head["cursor"], kinds, parts, sequence=head["sequence"], saved_at=head["saved_at"]
        )

    async def save(self, checkpoint: Checkpoint) -> None:
        conn = await self._hold()
        name = self.name
        async with conn.transaction():
            held = await conn.fetchval(
                "SELECT sequence FROM listener_checkpoint WHERE name = $1 FOR UPDATE", name
            )
            if checkpoint.whole:
                await conn.execute("DELETE FROM listener_checkpoint_item WHERE name = $1", name)
                await conn.execute("DELETE FROM listener_checkpoint_mirror WHERE name = $1", name)
            else:
                base = checkpoint.base
                if held is None or base is None or not base <= held < checkpoint.sequence:
                    raise CheckpointError(
                        f"incremental checkpoint {checkpoint.sequence} goes on save {base}, "
                        f"but {name!r} holds save {held}"
                    )
            for controller, part in checkpoint.mirrors.items():
                await conn.execute(
                    "INSERT INTO listener_checkpoint_mirror (name, controller, resource, pending)"
                    " VALUES ($1, $2, $3, $4) ON CONFLICT (name, controller)"
                    " DO UPDATE SET resource = excluded.resource, pending = excluded.pending",
                    name,
                    controller,
                    part.resource,
                    sorted(part.pending),
                )
                await conn.executemany(
                    "INSERT INTO listener_checkpoint_item (name, controller, id, item)"
                    " VALUES ($1, $2, $3, $4::jsonb) ON CONFLICT (name, controller, id)"
                    " DO UPDATE SET item = excluded.item",
                    [(name, controller, key, text) for key, text in _documents(part.items)],
                )
                if part.deleted:
                    await conn.execute(
                        "DELETE FROM listener_checkpoint_item"
                        " WHERE name = $1 AND controller = $2 AND id = ANY($3::text[])",
                        name,
                        controller,
                        list(part.deleted),
                    )
            await conn.execute(
                "INSERT INTO listener_checkpoint (name, sequence, cursor, change_kinds, saved_at)"
                " VALUES ($1, $2, $3, $4::jsonb, $5) ON CONFLICT (name) DO UPDATE SET"
                " sequence = excluded.sequence, cursor = excluded.cursor,"
                " change_kinds = excluded.change_kinds, saved_at = excluded.saved_at",
                name,
                checkpoint.sequence,
                checkpoint.cursor,
                orjson.dumps([kind.to_json() for kind in checkpoint.change_kinds]).decode(),
                checkpoint.saved_at or time.time(),
            )
