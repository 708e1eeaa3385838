"""A checkpoint store in one SQLite file: Python's own ``sqlite3``, nothing to run beside it.

Layout (tables prefixed ``changefeed_``, so the file may hold the
application's own tables too; several listeners share one file under
different ``name``s):

* ``changefeed_checkpoint``: one row per name: format version, save number,
  cursor, change kinds, when it was taken.
* ``changefeed_checkpoint_mirror``: one row per controller: its resource and
  its pending ids (a JSON array).
* ``changefeed_checkpoint_chunk``: a whole save's resources, ``chunk_items``
  to a row: their ids as one JSON array, and their JSON documents one to a
  line. Loading splits them without decoding them: the mirror decodes each
  resource when it is first read (``JsonItems``), so a restart does not wait
  for a million objects to be built.
* ``changefeed_checkpoint_change``: what incremental saves changed since,
  one row per id (NULL: deleted), replaced in place, so it never holds an id
  twice; loading applies it on top of the chunks. A whole save empties it,
  and so does an incremental save that finds a controller's change rows
  past ``FOLD_RATIO`` of its chunks: it folds them into new chunks in the
  same transaction. A listener decides on whole saves by its own count of
  changes, which starts again at each restart, so without the fold a service
  restarted often would only ever add rows (every id created and deleted
  since stays, as a row or a tombstone): the fold keeps the file about the
  size of the mirrors, however many saves and restarts there were.

Every save is one transaction, so a process killed at any moment (SIGKILL
included) leaves the previous checkpoint or the new one, never a mix; the
file is in WAL mode, and with ``synchronous=NORMAL`` a power loss may take
the last saves back but never tears one. Blocking SQLite calls run in a
worker thread, on the store's one connection (opened at the first load or
save, closed by ``close``); loading splits the chunks on the event loop one
at a time, with the garbage collector paused meanwhile (as the bootstrap
pager does), so the loop is never held for long.

The file itself (claimed under the store's name, checked, created, moved
aside when it cannot be used) is ``_sqlite_file``'s.

It must never apply an incremental save to a checkpoint it was not made
for (another listener's, or an older one: ``CheckpointError``), never
write a file another store holds, and never leave a save half-written.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import sqlite3
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import orjson

from changefeed.collector import collector_paused
from changefeed.schemas import ChangeKind

from ._checkpoint import Checkpoint, JsonItems, MirrorCheckpoint
from ._errors import CheckpointError
from ._sqlite_file import FORMAT_VERSION, CheckpointFile

__all__ = ["FOLD_FLOOR", "FOLD_RATIO", "FORMAT_VERSION", "SqliteCheckpointStore"]

FOLD_RATIO = 0.25
"""An incremental save folds a controller's change rows into its chunks once they
outnumber this fraction of the resources the chunks hold: the file then holds at
most about that much beside one copy of the mirror, and a fold (a rewrite of the
mirror) comes at most once per that many changed ids."""

FOLD_FLOOR = 1_000
"""... but never for fewer change rows than this (a small mirror is not rewritten
at every save)."""

_Raw = tuple[
    tuple[int, int, str | None, str, float],
    dict[str, tuple[str, bytes, list[tuple[bytes, bytes]], list[tuple[str, bytes | None]]]],
]
"""What a load reads: the checkpoint's row, and each controller's rows."""


class SqliteCheckpointStore:
    """Keeps a listener's checkpoint in a SQLite file (``CheckpointStore``).

    Args:
        path: the file; created with its tables when missing.
        name: this checkpoint's name in the file (one per listener).
        chunk_items: resources per stored chunk of a whole save.
        timeout: seconds to wait for another connection's lock on the file.

    Raises:
        ValueError: ``chunk_items`` < 1, or an empty ``name``.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        name: str = "default",
        chunk_items: int = 10_000,
        timeout: float = 30.0,
    ) -> None:
        if chunk_items < 1:
            raise ValueError(f"chunk_items must be at least 1, got {chunk_items!r}")
        if not name:
            raise ValueError("name must not be empty")
        self.path = Path(path)
        self.name = name
        self.chunk_items = chunk_items
        self._file = CheckpointFile(self.path, name, timeout)
        self.lock_path = self._file.lock_path
        """The file whose lock says this store holds the checkpoint."""
        self.moved_aside = self._file.moved_aside
        """Where files this store could not use were moved (newest last)."""

    @property
    def timeout(self) -> float:
        """Seconds to wait for another connection's lock on the file."""
        return self._file.timeout

    def __repr__(self) -> str:
        return f"SqliteCheckpointStore({str(self.path)!r}, name={self.name!r})"

    async def close(self) -> None:
        """Close the connection and let go of the file (a later load or save opens it
        again). The listener calls it when it closes."""
        await asyncio.to_thread(self._file.close)

    def size_on_disk(self) -> int:
        """Bytes of the file and its write-ahead log."""
        return self._file.size_on_disk()

    # -- load ----------------------------------------------------------------------

    async def load(self) -> Checkpoint | None:
        """The checkpoint last saved under ``name``, or None (also when the file could
        not be used and was moved aside).

        Raises:
            CheckpointRefused: another store holds the file under this name, or a
                newer-layout file holds the application's tables too.
            CheckpointError: the checkpoint has an older layout version.
            sqlite3.Error: the file cannot be read.
        """
        raw = await asyncio.to_thread(self._read)
        if raw is None:
            return None
        head, mirrors = raw
        version, sequence, cursor, kinds_json, saved_at = head
        if version != FORMAT_VERSION:
            raise CheckpointError(
                f"{self.path}: checkpoint {self.name!r} has layout version {version}, "
                f"this store reads {FORMAT_VERSION}"
            )
        try:
            kinds = tuple(ChangeKind.from_json(doc) for doc in orjson.loads(kinds_json))
            parts = {}
            for controller, (resource, pending, chunks, changes) in mirrors.items():
                items = JsonItems(encoded=await self._split_items(chunks, changes))
                parts[controller] = MirrorCheckpoint(
                    resource, items, (), frozenset(orjson.loads(pending))
                )
        except (orjson.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
            why = f"checkpoint {self.name!r}: {exc}"
            await asyncio.to_thread(self._file.copy_aside, "undecodable", why, exc)
            return None
        return Checkpoint(cursor, kinds, parts, whole=True, sequence=sequence, saved_at=saved_at)

    @staticmethod
    async def _split_items(
        chunks: list[tuple[bytes, bytes]], changes: list[tuple[str, bytes | None]]
    ) -> dict[str, bytes]:
        """id -> JSON document, from the chunks and the changes on top of them."""
        items: dict[str, bytes] = {}
        for ids, body in chunks:
            with collector_paused():
                _add_chunk(items, ids, body)
            await asyncio.sleep(0)  # the loop runs between chunks
        _apply_changes(items, changes)
        return items

    def _read(self) -> _Raw | None:
        # A file found damaged is moved aside: nothing to load from the new one.
        return self._file.use(self._read_from, lambda _conn, _exc: None)

    def _read_from(self, conn: sqlite3.Connection) -> _Raw | None:
        conn.execute("BEGIN")  # one read snapshot: a save in between is seen whole or not
        try:
            head = conn.execute(
                "SELECT version, sequence, cursor, change_kinds, saved_at"
                " FROM changefeed_checkpoint WHERE name = ?",
                (self.name,),
            ).fetchone()
            if head is None:
                return None
            mirrors = {}
            for controller, resource, pending in conn.execute(
                "SELECT controller, resource, pending FROM changefeed_checkpoint_mirror"
                " WHERE name = ? ORDER BY controller",
                (self.name,),
            ).fetchall():
                chunks = conn.execute(
                    "SELECT ids, items FROM changefeed_checkpoint_chunk"
                    " WHERE name = ? AND controller = ? ORDER BY seq",
                    (self.name, controller),
                ).fetchall()
                changes = conn.execute(
                    "SELECT id, item FROM changefeed_checkpoint_change"
                    " WHERE name = ? AND controller = ?",
                    (self.name, controller),
                ).fetchall()
                mirrors[controller] = (resource, pending, chunks, changes)
            return head, mirrors
        finally:
            if conn.in_transaction:
                with contextlib.suppress(sqlite3.Error):  # it only read
                    conn.execute("ROLLBACK")

    # -- save ------------------------------------------------------------------------

    async def save(self, checkpoint: Checkpoint) -> None:
        """Keep ``checkpoint`` (one transaction, in a worker thread).

        Raises:
            CheckpointRefused: as ``load``.
            CheckpointError: an incremental checkpoint whose ``base`` this file does
                not hold (the file changed under the listener, or was damaged and
                moved aside), or whose fold finds a chunk that does not decode.
            sqlite3.Error: the file cannot be written (disk full, read-only, ...).
        """
        await asyncio.to_thread(self._write, checkpoint)

    def _write(self, checkpoint: Checkpoint) -> None:
        def again(conn: sqlite3.Connection, exc: sqlite3.DatabaseError) -> None:
            """The file was found damaged and moved aside: a whole save goes into the
            new one; an incremental one has nothing to go on top of."""
            if not checkpoint.whole:
                raise CheckpointError(
                    f"{self.path} was damaged and has been moved aside: an incremental"
                    " checkpoint has nothing to go on top of (the next save is whole)"
                ) from exc
            self._write_to(conn, checkpoint)

        self._file.use(lambda conn: self._write_to(conn, checkpoint), again)

    def _write_to(self, conn: sqlite3.Connection, checkpoint: Checkpoint) -> None:
        name = self.name
        conn.execute("BEGIN IMMEDIATE")
        try:
            if checkpoint.whole:
                self._write_whole(conn, checkpoint)
            else:
                self._write_changes(conn, checkpoint)
            kinds = orjson.dumps([kind.to_json() for kind in checkpoint.change_kinds])
            conn.execute(
                "INSERT INTO changefeed_checkpoint"
                " (name, version, sequence, cursor, change_kinds, saved_at)"
                " VALUES (?, ?, ?, ?, ?, ?) ON CONFLICT (name) DO UPDATE SET"
                " version = excluded.version, sequence = excluded.sequence,"
                " cursor = excluded.cursor, change_kinds = excluded.change_kinds,"
                " saved_at = excluded.saved_at",
                (
                    name,
                    FORMAT_VERSION,
                    checkpoint.sequence,
                    checkpoint.cursor,
                    kinds.decode(),
                    checkpoint.saved_at or time.time(),
                ),
            )
        except BaseException:
            if conn.in_transaction:
                with contextlib.suppress(sqlite3.Error):  # the error that ended it goes on
                    conn.execute("ROLLBACK")
            raise
        conn.execute("COMMIT")

    def _write_whole(self, conn: sqlite3.Connection, checkpoint: Checkpoint) -> None:
        name = self.name
        for table in ("chunk", "change", "mirror"):
            conn.execute(f"DELETE FROM changefeed_checkpoint_{table} WHERE name = ?", (name,))
        for controller, part in checkpoint.mirrors.items():
            conn.execute(
                "INSERT INTO changefeed_checkpoint_mirror (name, controller, resource, pending)"
                " VALUES (?, ?, ?, ?)",
                (name, controller, part.resource, orjson.dumps(sorted(part.pending))),
            )
            self._write_chunks(conn, controller, part.items)

    def _write_chunks(
        self, conn: sqlite3.Connection, controller: str, items: Mapping[str, Any]
    ) -> None:
        """``items`` as the controller's chunks (it has none when this is called)."""
        for seq, (ids, documents) in enumerate(_chunks(items, self.chunk_items)):
            conn.execute(
                "INSERT INTO changefeed_checkpoint_chunk"
                " (name, controller, seq, ids, items) VALUES (?, ?, ?, ?, ?)",
                (self.name, controller, seq, orjson.dumps(ids), b"\n".join(documents)),
            )

    def _write_changes(self, conn: sqlite3.Connection, checkpoint: Checkpoint) -> None:
        name = self.name
        row = conn.execute(
            "SELECT sequence FROM changefeed_checkpoint WHERE name = ?", (name,)
        ).fetchone()
        held = None if row is None else row[0]
        base = checkpoint.base
        if held is None or base is None or not base <= held < checkpoint.sequence:
            raise CheckpointError(
                f"{self.path}: incremental checkpoint {checkpoint.sequence} of {name!r} goes "
                f"on save {base}, but the file holds save {held}: another listener may be "
                "writing under this name"
            )
        for controller, part in checkpoint.mirrors.items():
            updated = conn.execute(
                "UPDATE changefeed_checkpoint_mirror SET pending = ?"
                " WHERE name = ? AND controller = ? AND resource = ?",
                (orjson.dumps(sorted(part.pending)), name, controller, part.resource),
            )
            if updated.rowcount != 1:
                raise CheckpointError(
                    f"{self.path}: incremental checkpoint of {name!r} names controller "
                    f"{controller!r} ({part.resource}), which the file does not hold"
                )
            rows = itertools.chain(
                ((name, controller, key, item) for key, item in _encoded(part.items)),
                ((name, controller, key, None) for key in part.deleted),
            )
            conn.executemany(
                "INSERT INTO changefeed_checkpoint_change (name, controller, id, item)"
                " VALUES (?, ?, ?, ?) ON CONFLICT (name, controller, id)"
                " DO UPDATE SET item = excluded.item",
                rows,
            )
            self._fold_when_due(conn, controller)

    def _fold_when_due(self, conn: sqlite3.Connection, controller: str) -> None:
        """Rewrite the controller's chunks with its change rows applied, and drop those
        rows, once there are more of them than ``FOLD_RATIO`` of the chunks' resources
        (``FOLD_FLOOR`` at least). Part of the save's transaction: a save that is
        killed leaves the file as it was."""
        key = (self.name, controller)
        (changes,) = conn.execute(
            "SELECT count(*) FROM changefeed_checkpoint_change WHERE name = ? AND controller = ?",
            key,
        ).fetchone()
        if changes <= FOLD_FLOOR:
            return
        items: dict[str, bytes] = {}
        try:
            if changes <= FOLD_RATIO * _chunked_items(conn, key):
                return
            for ids, body in conn.execute(
                "SELECT ids, items FROM changefeed_checkpoint_chunk"
                " WHERE name = ? AND controller = ? ORDER BY seq",
                key,
            ):
                _add_chunk(items, ids, body)
        except (orjson.JSONDecodeError, TypeError, ValueError) as exc:
            # As a save that does not go on top of the file: the listener's next one is whole.
            raise CheckpointError(
                f"{self.path}: checkpoint {self.name!r}, controller {controller!r}: {exc}"
            ) from exc
        _apply_changes(
            items,
            conn.execute(
                "SELECT id, item FROM changefeed_checkpoint_change"
                " WHERE name = ? AND controller = ?",
                key,
            ).fetchall(),
        )
        for table in ("chunk", "change"):
            conn.execute(
                f"DELETE FROM changefeed_checkpoint_{table} WHERE name = ? AND controller = ?",
                key,
            )
        self._write_chunks(conn, controller, JsonItems(encoded=items))


def _chunked_items(conn: sqlite3.Connection, key: tuple[str, str]) -> int:
    """Resources in one controller's chunks. A save cuts them to one size, all but the
    last: the first and the last tell, without reading the others."""
    count, first, last = conn.execute(
        "SELECT count(*), min(seq), max(seq) FROM changefeed_checkpoint_chunk"
        " WHERE name = ? AND controller = ?",
        key,
    ).fetchone()
    if not count:
        return 0
    sizes = [
        len(orjson.loads(ids))
        for (ids,) in conn.execute(
            "SELECT ids FROM changefeed_checkpoint_chunk"
            " WHERE name = ? AND controller = ? AND seq IN (?, ?)",
            (*key, first, last),
        )
    ]
    return int((count - 1) * max(sizes) + min(sizes))


def _add_chunk(items: dict[str, bytes], ids: bytes, body: bytes) -> None:
    """Add one chunk's resources to ``items`` (id -> JSON document).

    Raises:
        ValueError: the chunk holds another number of documents than ids.
    """
    keys = orjson.loads(ids)
    documents = body.split(b"\n")
    if len(keys) != len(documents):
        raise ValueError(f"a chunk of {len(keys)} ids holds {len(documents)} items")
    items.update(zip(keys, documents, strict=True))


def _apply_changes(items: dict[str, bytes], changes: list[tuple[str, bytes | None]]) -> None:
    """Apply change rows to ``items``: a document replaces the id's, None deletes it."""
    for key, item in changes:
        if item is None:
            items.pop(key, None)
        else:
            items[key] = item


def _encoded(items: Mapping[str, Any]) -> Iterator[tuple[str, bytes]]:
    """Every ``(id, JSON document)`` of ``items`` (those already encoded as they are)."""
    if isinstance(items, JsonItems):
        return items.encoded_items()
    return ((key, orjson.dumps(value)) for key, value in items.items())


def _chunks(items: Mapping[str, Any], size: int) -> Iterator[tuple[list[str], list[bytes]]]:
    """``items`` as (ids, JSON documents) of at most ``size`` each. A document of orjson
    holds no line break (it escapes those in strings), so one to a line splits back."""
    ids: list[str] = []
    documents: list[bytes] = []
    for key, document in _encoded(items):
        ids.append(key)
        documents.append(document)
        if len(ids) >= size:
            yield ids, documents
            ids, documents = [], []
    if ids:
        yield ids, documents
