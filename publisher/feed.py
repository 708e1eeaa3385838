"""The feed table, seen from Python: append entries, read them in feed order, trim them.

``publish`` / ``publish_many`` run on the *caller's* asyncpg connection, so the
entry commits or rolls back with the caller's own write. ``FeedReader`` reads
only entries that are final (their transaction is below the snapshot horizon,
invariant I1), in ``(txid, id)`` order from a position, and never waits on
listeners. Every read works the same on a hot standby: its snapshot's horizon
is as safe as the primary's (docs/design.md, "Reading from a standby").
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime

import asyncpg

from changefeed.schemas import ORIGIN, PgConnection, Position, quote_schema, stamp_of

__all__ = [
    "DB_ERRORS",
    "NO_REWRITES",
    "FeedEntry",
    "FeedHealth",
    "FeedReader",
    "FeedState",
    "FeedTrimmed",
    "PageOfFeed",
    "ReplicaBehind",
    "ResumeFacts",
    "Rewrites",
    "install_trigger",
    "publish",
    "publish_many",
]


class ReplicaBehind(Exception):
    """The server asked has not replayed what this publisher already read elsewhere
    (a standby catching up after a restart, or another standby behind the same
    address): retried, like an unreachable database, until it has."""


DB_ERRORS: tuple[type[BaseException], ...] = (
    ReplicaBehind,
    OSError,
    TimeoutError,
    asyncpg.PostgresError,
    asyncpg.InterfaceError,
    # A connection left mid-operation (a query cancelled by a timeout while the
    # server went away): retried on a new connection, like the others.
    asyncpg.InternalClientError,
)
"""Failures that mean "the database is unreachable, restarting, failing over or behind":
retried. A read a standby cancelled because it conflicted with replay (SQLSTATE
40001) is an ``asyncpg.PostgresError`` too."""


class FeedTrimmed(Exception):
    """Entries after a reader's position were deleted before it read them."""


@dataclass(frozen=True, slots=True)
class FeedEntry:
    """One row of the feed table."""

    position: Position
    resource: str
    sub_resources: tuple[str, ...]
    changed_resource_id: str
    published: datetime


@dataclass(frozen=True, slots=True)
class Rewrites:
    """What the compaction job has announced it rewrites (schema migration 6).

    A run announces itself before it widens any entry; publishers serve nothing
    at or before ``through`` from memory to a listener that reads the table past
    a run's changes (see ``pages``, ``catchup``; docs/compaction.md).
    """

    generation: int
    """Grows by one with each run: a page of the table read under an older one
    may hold entries as they were before a run's changes."""
    through: Position
    """The newest entry any run has widened or is about to (never lowered)."""


NO_REWRITES = Rewrites(0, ORIGIN)
"""A feed the compaction job never ran on."""


@dataclass(frozen=True, slots=True)
class FeedState:
    """Who the feed is (schema migration 5), and what has been taken out of it."""

    feed_id: uuid.UUID
    """The feed's identity, made when the feed was created; cursors carry it."""
    cursor_key: bytes
    """The key cursors are signed with, made with the feed."""
    low_water: Position
    """The oldest resumable position: everything after it is still held."""
    compacted_through: Position
    """The newest entry compaction merged away into a later one."""
    rewrites: Rewrites = NO_REWRITES
    """What the compaction job has announced it rewrites."""


@dataclass(frozen=True, slots=True)
class ResumeFacts:
    """What the feed says about a resume cursor's position, read in one snapshot."""

    state: FeedState
    """The feed's identity, key and marks, in the same snapshot."""
    newest: Position
    """The newest entry's position, final or not (ORIGIN: the feed is empty)."""
    next_txid: int
    """The transaction id the database gives out next: no entry can be at or past it."""
    stamp: int | None
    """The stamp of the entry at the position (None: the feed holds no entry there)."""
    in_recovery: bool = False
    """Read on a standby: a "no such entry" may only mean it has not replayed it yet."""


@dataclass(frozen=True, slots=True)
class PageOfFeed:
    """A catch-up page of the feed table and the feed's marks, from one snapshot."""

    entries: list[FeedEntry]
    low_water: Position
    rewrites: Rewrites = NO_REWRITES


@dataclass(frozen=True, slots=True)
class FeedHealth:
    """What the feed table looks like from outside the tailer (FeedReader.health)."""

    oldest_writer_seconds: float
    """Age of the oldest open or prepared write transaction, cluster-wide: it holds
    the snapshot horizon back, and with it delivery of everything committed after."""
    oldest_entry_seconds: float
    """Age of the oldest entry still in the table (0 when it is empty): retention,
    or the Spark job, keeps it near ``max_age``."""
    feed_bytes: int
    """The table's size on disk, indexes and TOAST included."""
    low_water: Position
    """The oldest resumable position (whoever deletes entries raises it)."""


async def publish(
    conn: PgConnection,
    resource: str,
    sub_resources: Sequence[str],
    changed_resource_id: str,
    *,
    schema: str = "changefeed",
) -> None:
    """Append one feed entry on ``conn``, inside whatever transaction it is in.

    Call it in the same transaction as the write it describes; the entry is
    delivered only if that transaction commits.
    """
    await conn.execute(
        f"SELECT {quote_schema(schema)}.publish($1, $2::text[], $3)",
        resource,
        list(sub_resources),
        changed_resource_id,
    )


async def publish_many(
    conn: PgConnection,
    entries: Iterable[tuple[str, Sequence[str], str]],
    *,
    schema: str = "changefeed",
) -> int:
    """Append many ``(resource, sub_resources, changed_resource_id)`` entries in one round trip.

    Returns:
        the number of entries appended.

    Raises:
        ValueError: a sub-resource name contains a comma (the batch encoding's separator).
    """
    resources: list[str] = []
    subs: list[str] = []
    ids: list[str] = []
    for resource, sub_resources, changed_id in entries:
        if any("," in s for s in sub_resources):
            raise ValueError(f"sub-resource names may not contain ',': {sub_resources!r}")
        resources.append(resource)
        subs.append(",".join(sub_resources))
        ids.append(changed_id)
    if not resources:
        return 0
    count = await conn.fetchval(
        f"SELECT {quote_schema(schema)}.publish_many($1::text[], $2::text[], $3::text[])",
        resources,
        subs,
        ids,
    )
    return int(count)


_CREATE_TRIGGER = (
    "SELECT format('CREATE OR REPLACE TRIGGER %I AFTER %s ON %s"
    " FOR EACH ROW EXECUTE FUNCTION %I.publish_row(%s)',"
    " $1::text,"
    " CASE WHEN cardinality($5::text[]) = 0 THEN 'INSERT OR UPDATE OR DELETE'"
    " ELSE 'UPDATE OF ' || (SELECT string_agg(quote_ident(c), ', ') FROM unnest($5::text[]) c)"
    " END,"
    " $2::text::regclass, $3::text,"
    " (SELECT string_agg(quote_literal(a), ', ') FROM unnest($4::text[]) a))"
)


async def install_trigger(
    conn: PgConnection,
    table: str,
    resource: str,
    id_column: str,
    sub_resources: Sequence[str] = (),
    *,
    columns: Sequence[str] = (),
    schema: str = "changefeed",
    name: str | None = None,
) -> None:
    """Let ``table`` publish its own changes: a trigger (``publish_row``, schema
    migration 3) appends a feed entry for each row the API's own INSERT, UPDATE
    or DELETE changes, in its transaction, with no statement of its own; no
    write path can forget it. An UPDATE that leaves a row as it was publishes
    nothing. Replaces a trigger of the same name on ``table``.

    Args:
        table: the API's table, optionally schema-qualified (``"public.vms"``).
        resource: the resource its rows belong to (``"vm"``).
        id_column: the column holding that resource's id (``"uuid"``; for a
            table of sub-resource rows, the owner's id, e.g. ``"vm_uuid"``).
        sub_resources: what each entry names as changed; none: the whole resource.
        columns: only UPDATEs that set one of these columns publish (``UPDATE
            OF``); none: every INSERT, UPDATE and DELETE does.
        schema: the feed's schema.
        name: the trigger's name; default ``changefeed_publish``, or
            ``changefeed_<columns>`` for a trigger on some columns.

    Raises:
        ValueError: an empty resource, column or sub-resource name.
        asyncpg.PostgresError: e.g. the table or a column does not exist.
    """
    quote_schema(schema)  # validates it; the server quotes every name in the DDL
    for value in (resource, id_column, *sub_resources, *columns):
        if not value:
            raise ValueError("install_trigger: names must not be empty")
    if name is None:
        name = "changefeed_" + "_".join(columns) if columns else "changefeed_publish"
    ddl = await conn.fetchval(
        _CREATE_TRIGGER, name, table, schema, [resource, id_column, *sub_resources], list(columns)
    )
    await conn.execute(ddl)


def _entry(row: asyncpg.Record) -> FeedEntry:
    return FeedEntry(
        Position(row["txid"], row["id"]),
        row["resource"],
        tuple(row["sub_resources"]),
        row["changed_resource_id"],
        row["published"],
    )


def _rewrites(row: asyncpg.Record) -> Rewrites:
    return Rewrites(row["rw_generation"], Position(row["rw_txid"], row["rw_id"]))


def _state(row: asyncpg.Record) -> FeedState:
    return FeedState(
        feed_id=row["feed_id"],
        cursor_key=bytes(row["cursor_key"]),
        low_water=Position(row["lw_txid"], row["lw_id"]),
        compacted_through=Position(row["ct_txid"], row["ct_id"]),
        rewrites=_rewrites(row),
    )


class FeedReader:
    """Reads final entries of one feed table in feed order.

    Args:
        schema: the feed's schema (from configuration).
    """

    def __init__(self, schema: str = "changefeed") -> None:
        q = quote_schema(schema)
        columns = (
            "f.txid::text::bigint AS txid, f.id, f.resource, f.sub_resources,"
            " f.changed_resource_id, f.published"
        )
        # (txid, id) > cursor is a row comparison the primary key's index serves;
        # txid < horizon keeps out transactions that are still open, whose
        # entries could otherwise commit behind the cursor and be skipped.
        # ORDER BY names the table's columns (f.txid), not the bigint output
        # alias: ordering by the alias would sort the whole feed instead of
        # walking the primary key.
        # `trimmed`, from the same snapshot: entries after the cursor were
        # deleted before this reader had them (a garbage collection with a max
        # age shorter than the reader's lag). One value for the statement.
        self._after = (
            f"SELECT {columns},"
            " (SELECT (s.low_water_txid, s.low_water_id) > ($1::bigint::text::xid8, $2)"
            f" FROM {q}.feed_state s) AS trimmed"
            f" FROM {q}.feed f"
            " WHERE (f.txid, f.id) > ($1::bigint::text::xid8, $2)"
            " AND f.txid < pg_snapshot_xmin(pg_current_snapshot())"
            " ORDER BY f.txid, f.id LIMIT $3"
        )
        # What the compaction job has announced it rewrites (migration 6).
        rewrites = (
            "s.rewrite_generation AS rw_generation,"
            " s.rewritten_through_txid::text::bigint AS rw_txid,"
            " s.rewritten_through_id AS rw_id"
        )
        # The tailer's read, with the snapshot's horizon: a tailer on a standby
        # learns from it whether the transactions the doorbell named have been
        # replayed. (`trimmed` is NULL when there are no entries.)
        self._after_horizon = (
            "SELECT h.horizon, p.* FROM (SELECT"
            " pg_snapshot_xmin(pg_current_snapshot())::text::bigint AS horizon) h"
            f" LEFT JOIN LATERAL ({self._after}) p ON true ORDER BY p.txid, p.id"
        )
        # A catch-up page, the low-water mark and the compaction job's rewrites
        # in one statement, so one snapshot: when the mark is at or before
        # `after`, nothing after it was trimmed, and the page has no hole
        # (whoever deletes raises the mark in the same transaction); a page that
        # shows any of a run's changes shows that run's announcement. The
        # page's rows come in feed order; the marks come on every row (and
        # alone, with NULL entries, when there are none).
        # `complete`: every transaction up to the page's end has ended in this
        # snapshot, so the page holds every entry of (after, upto]. Always true on
        # the primary (upto was read below its horizon, which only moves on); false
        # on a standby that has not yet replayed what the tailer read, which must
        # then not be taken for a page with no entries.
        self._page = (
            "SELECT s.low_water_txid::text::bigint AS lw_txid, s.low_water_id AS lw_id,"
            f" {rewrites},"
            " $3::bigint::text::xid8 < pg_snapshot_xmin(pg_current_snapshot()) AS complete, p.*"
            f" FROM {q}.feed_state s LEFT JOIN LATERAL ("
            f" SELECT {columns} FROM {q}.feed f"
            " WHERE (f.txid, f.id) > ($1::bigint::text::xid8, $2)"
            " AND (f.txid, f.id) <= ($3::bigint::text::xid8, $4)"
            " AND f.resource = ANY($5::text[])"
            " ORDER BY f.txid, f.id LIMIT $6) p ON true"
            " ORDER BY p.txid, p.id"
        )
        self._head = (
            f"SELECT f.txid::text::bigint AS txid, f.id FROM {q}.feed f"
            " WHERE f.txid < pg_snapshot_xmin(pg_current_snapshot())"
            " ORDER BY f.txid DESC, f.id DESC LIMIT 1"
        )
        # The write transaction that holds the horizon back (open, or prepared for
        # two-phase commit): its age is how long delivery of anything committed
        # after it has been waiting. min(published) walks the published index.
        writer = (
            "(SELECT coalesce(extract(epoch FROM clock_timestamp() - min(started)), 0)"
            " FROM (SELECT xact_start AS started FROM pg_stat_activity"
            " WHERE backend_xid IS NOT NULL"
            " UNION ALL SELECT prepared FROM pg_prepared_xacts) AS writers)::float8"
        )
        # Only the primary knows its writers (a standby's pg_stat_activity shows
        # its own sessions): a publisher reading a standby asks the primary this
        # part alone, which reads no feed table.
        self._writer = f"SELECT {writer}"
        self._health = (
            f"SELECT {writer} AS writer,"
            " coalesce((SELECT extract(epoch FROM clock_timestamp() - min(published))"
            f" FROM {q}.feed), 0)::float8 AS entry,"
            f" pg_total_relation_size('{q}.feed'::regclass) AS bytes,"
            f" (SELECT low_water_txid::text::bigint FROM {q}.feed_state) AS lw_txid,"
            f" (SELECT low_water_id FROM {q}.feed_state) AS lw_id"
        )
        self._low_water = (
            f"SELECT low_water_txid::text::bigint AS txid, low_water_id AS id FROM {q}.feed_state"
        )
        state = (
            "s.feed_id, s.cursor_key,"
            " s.low_water_txid::text::bigint AS lw_txid, s.low_water_id AS lw_id,"
            " s.compacted_through_txid::text::bigint AS ct_txid,"
            f" s.compacted_through_id AS ct_id, {rewrites}"
        )
        self._state = f"SELECT {state} FROM {q}.feed_state s"
        # The newest final entry, or the low-water mark when that is later (every
        # entry up to it trimmed: a quiet feed past max_age). The mark only once no
        # transaction older than it is open, so that no entry below it commits late.
        self._head_entry = (
            "SELECT txid, id, published FROM ("
            f"(SELECT f.txid::text::bigint AS txid, f.id, f.published FROM {q}.feed f"
            " WHERE f.txid < pg_snapshot_xmin(pg_current_snapshot())"
            " ORDER BY f.txid DESC, f.id DESC LIMIT 1)"
            " UNION ALL"
            " (SELECT s.low_water_txid::text::bigint, s.low_water_id, NULL::timestamptz"
            f" FROM {q}.feed_state s"
            " WHERE s.low_water_txid < pg_snapshot_xmin(pg_current_snapshot()))"
            ") h ORDER BY txid DESC, id DESC, published IS NULL LIMIT 1"
        )
        # Everything a resume from ($1, $2) needs to know, in one snapshot.
        self._resume_facts = (
            f"SELECT {state},"
            " pg_snapshot_xmax(pg_current_snapshot())::text::bigint AS next_txid,"
            " pg_is_in_recovery() AS in_recovery,"
            f" (SELECT published FROM {q}.feed"
            " WHERE txid = $1::bigint::text::xid8 AND id = $2) AS published,"
            " n.txid AS n_txid, n.id AS n_id"
            f" FROM {q}.feed_state s LEFT JOIN LATERAL ("
            f" SELECT f.txid::text::bigint AS txid, f.id FROM {q}.feed f"
            " ORDER BY f.txid DESC, f.id DESC LIMIT 1) n ON true"
        )
        # A new identity and key, once: a second publisher that noticed the same
        # restore finds the identity already changed and takes the new one.
        self._rotate = (
            f"UPDATE {q}.feed_state SET feed_id = gen_random_uuid(),"
            " cursor_key = uuid_send(gen_random_uuid()) || uuid_send(gen_random_uuid()),"
            " updated = now() WHERE feed_id = $1"
        )

    async def read_after(self, conn: PgConnection, after: Position, limit: int) -> list[FeedEntry]:
        """Return up to ``limit`` final entries after ``after``, in feed order.

        Raises:
            FeedTrimmed: entries after ``after`` were deleted (the low-water mark
                passed it) before they were read: what this returned would have a hole.
        """
        rows = await conn.fetch(self._after, after.txid, after.id, limit)
        if rows and rows[0]["trimmed"]:
            raise FeedTrimmed(f"the feed was trimmed past {after} before it was read")
        return [_entry(r) for r in rows]

    async def read_after_horizon(
        self, conn: PgConnection, after: Position, limit: int
    ) -> tuple[list[FeedEntry], int]:
        """``read_after``, and the horizon of the snapshot it read in: every transaction
        below it has ended (committed or not) as far as that server knows.

        Raises:
            FeedTrimmed: as ``read_after``.
        """
        rows = await conn.fetch(self._after_horizon, after.txid, after.id, limit)
        if rows[0]["trimmed"]:
            raise FeedTrimmed(f"the feed was trimmed past {after} before it was read")
        return [_entry(r) for r in rows if r["id"] is not None], int(rows[0]["horizon"])

    async def read_page(
        self,
        conn: PgConnection,
        after: Position,
        upto: Position,
        resources: Sequence[str],
        limit: int,
    ) -> PageOfFeed:
        """Up to ``limit`` entries of ``resources`` in ``(after, upto]``, in feed order,
        the feed's low-water mark and the compaction job's rewrites, from one
        snapshot (a catch-up page)."""
        rows = await conn.fetch(
            self._page, after.txid, after.id, upto.txid, upto.id, list(resources), limit
        )
        first = rows[0]  # the marks come on every row, and alone when there are no entries
        if not first["complete"]:
            raise ReplicaBehind(f"this server has not yet replayed the feed up to {upto}")
        return PageOfFeed(
            [_entry(r) for r in rows if r["id"] is not None],
            Position(first["lw_txid"], first["lw_id"]),
            _rewrites(first),
        )

    async def head(self, conn: PgConnection) -> Position:
        """Return the position of the newest final entry (ORIGIN for an empty feed)."""
        row = await conn.fetchrow(self._head)
        return Position(row["txid"], row["id"]) if row else ORIGIN

    async def state(self, conn: PgConnection) -> FeedState:
        """The feed's identity, cursor key, low-water mark and compaction mark."""
        row = await conn.fetchrow(self._state)
        assert row is not None, "feed_state has its one row"
        return _state(row)

    async def head_entry(self, conn: PgConnection) -> tuple[Position, int]:
        """The feed's head: the newest final entry's position and stamp, or the
        low-water mark and 0 when every entry up to it was trimmed ((ORIGIN, 0) for a
        feed never written)."""
        row = await conn.fetchrow(self._head_entry)
        if row is None:
            return ORIGIN, 0
        published = row["published"]
        stamp = 0 if published is None else stamp_of(published)
        return Position(row["txid"], row["id"]), stamp

    async def resume_facts(self, conn: PgConnection, position: Position) -> ResumeFacts:
        """What the feed says about a resume from ``position``, in one snapshot."""
        row = await conn.fetchrow(self._resume_facts, position.txid, position.id)
        assert row is not None, "feed_state has its one row"
        state = _state(row)
        newest = ORIGIN if row["n_txid"] is None else Position(row["n_txid"], row["n_id"])
        published = row["published"]
        return ResumeFacts(
            state=state,
            newest=newest,
            next_txid=int(row["next_txid"]),
            stamp=None if published is None else stamp_of(published),
            in_recovery=row["in_recovery"],
        )

    async def rotate_identity(self, conn: PgConnection, feed_id: uuid.UUID) -> FeedState:
        """Give the feed a new identity and cursor key (it was restored from a backup),
        unless another publisher already did; return the feed's state after."""
        await conn.execute(self._rotate, feed_id)
        return await self.state(conn)

    async def health(self, conn: PgConnection) -> FeedHealth:
        """The oldest writer, the oldest entry, the table's size and the low-water
        mark, in one query."""
        row = await conn.fetchrow(self._health)
        assert row is not None
        return FeedHealth(
            max(0.0, row["writer"]),
            max(0.0, row["entry"]),
            int(row["bytes"]),
            Position(row["lw_txid"] or 0, row["lw_id"] or 0),
        )

    async def oldest_writer_seconds(self, conn: PgConnection) -> float:
        """Age of the oldest open or prepared write transaction on ``conn``'s server
        (``health``'s first figure, alone: ask the primary)."""
        return max(0.0, float(await conn.fetchval(self._writer)))

    async def low_water(self, conn: PgConnection) -> Position:
        """Return the oldest resumable position: a cursor at or after it can resume."""
        row = await conn.fetchrow(self._low_water)
        return Position(row["txid"], row["id"]) if row else ORIGIN
