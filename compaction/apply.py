"""The PostgreSQL side of the compaction job: snapshot, staging, and the batched apply step.

Everything here runs on one asyncpg *control* connection, which also holds the
job's session-level advisory lock (one job per feed at a time; the lock goes
away with the connection if the job dies).

Each statement of the apply step is safe on its own, whatever plan it is given:

* a **garbage** step walks ``batch_size`` entries along the primary key and
  deletes those still older than the run's cutoff, raising the low-water mark
  to the newest position it deleted in the same transaction (never lowering it);
* the **announcement** raises the feed's rewrite generation and horizon
  before any entry is widened (publishers then serve nothing at or before the
  horizon from memory to a listener reading past the table's changes);
* a **keeper** batch only ever adds sub-resources to an entry (or makes it
  "whole resource"), in place, at its own position;
* a **drop** batch deletes an entry only if a *later* entry of the same
  ``(resource, changed_resource_id)`` is in the feed right now and covers its
  sub-resources;
* the **index of kept entries** (``compaction_keys``) only steers which
  entries the next run reads; it is never trusted for a deletion.

So I5 holds after every committed batch, a job killed anywhere leaves a valid
feed, and a rerun (which plans again from the feed as it is) converges to what
one clean run would have produced. Batches are short transactions that lock
only the rows they delete or update (and, for garbage and the announcement,
the single ``feed_state`` row): writers (``INSERT``) and tailers (``SELECT``)
never wait on them.
"""

from __future__ import annotations

import asyncio
import random
import re
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import asyncpg
from tenacity import retry_if_exception_type, stop_after_attempt

from changefeed.backoff import Backoff, retrying
from changefeed.schemas import ORIGIN, PgConnection, Position, quote_schema, schema_version
from changefeed.wal import insert_target

from .errors import CompactionError
from .plan import GcRegion
from .scope import Cutoffs, Scope

__all__ = [
    "COMPACTION_LOCK_KEY",
    "KEEPER_HASH",
    "KIND_DROP",
    "KIND_KEEP",
    "KIND_KEY",
    "SCHEMA_VERSION",
    "STAGING_COLUMNS",
    "TID_RANGE_SCAN_VERSION",
    "BatchReport",
    "CompactionStore",
    "FeedSnapshot",
    "SharedWalk",
]

COMPACTION_LOCK_KEY = 0x6366_636D_7000  # "cfcmp": one compaction job per database
"""Session-level advisory lock held for the whole run."""

KIND_KEEP = 2
"""Staging row kind: a keeper whose sub-resources become the union (and, like a
``KIND_KEY`` row, its group's keeper after this run)."""
KIND_DROP = 3
"""Staging row kind: an entry merged into its keeper and then deleted."""
KIND_KEY = 4
"""Staging row kind: a group's keeper after this run whose sub-resources stay as they
are, for the index of kept entries."""

KEEPER_HASH = (
    "hashtextextended(length({table}.resource) || ':' || {table}.resource"
    " || {table}.changed_resource_id, 0)"
)
"""SQL: the key of a group in the index of kept entries (``{table}``: a relation with
``resource`` and ``changed_resource_id``). 64 bits; length-prefixed, so that no two
pairs make the same text; a group whose hash another's took is only not looked up
(the entry found is checked to be of the group)."""

STAGING_COLUMNS = (
    "kind",
    "txid",
    "id",
    "keep_txid",
    "keep_id",
    "sub_resources",
    "resource",
    "changed_resource_id",
)
"""Columns of a run's staging table, in the order the Spark job writes them."""

SCHEMA_VERSION = 6
"""The feed schema the job needs: migration 6 adds the rewrite horizon it announces."""

TID_RANGE_SCAN_VERSION = 140000
"""``server_version_num`` from which ``ctid`` ranges are TID range scans."""

_LAST_PAGE = (4294967295, 0)  # above every heap page: the open end of the last range
_STAGING_NAME = re.compile(r"^compaction_(plan|touched|hot)_[0-9]+$")
_STANDBY_POLL = Backoff(initial=0.01, maximum=0.5, jitter=0.0)
"""Waits between two looks at the standbys' replay (changefeed.backoff's policy,
without jitter: one job asking one server): 10 ms doubling to half a second."""
_RETRIES = 3
_LOCK_WAIT = Backoff(initial=0.05, maximum=1.0, jitter=1.0)
"""Waits before a batch that waited for locks (or deadlocked) runs again
(changefeed.backoff's policy): the writers holding them get to finish, and two
jobs that deadlocked do not retry in step."""
_RETRYABLE = (asyncpg.exceptions.LockNotAvailableError, asyncpg.exceptions.DeadlockDetectedError)

BatchReport = Callable[[int], None]
"""Called after each committed batch with the planned entries it covered: the
garbage a step deleted (the last step of a region makes up the rest of the
region's planned garbage), or the staging rows of a batch. They add up to the
planned total (whether or not a guard left some entry alone), so they measure
progress; the applied counts are what the apply methods return."""


@dataclass(frozen=True, slots=True)
class FeedSnapshot:
    """What the feed looked like when the run started.

    Attributes:
        horizon: ``pg_snapshot_xmin`` then: every transaction below it had ended.
        taken: the database's clock then; the age cutoffs are computed from it.
        head: the newest final entry (at or below the horizon); the run reads
            and changes nothing after it.
        low_water: the low-water mark then.
        blocks: the feed table's size in pages then (partitions split it).
        server_version: ``server_version_num`` (TID range scans need 140000).
        feed_id: the feed's identity (a restored or recreated feed has another).
    """

    horizon: int
    taken: datetime
    head: Position
    low_water: Position
    blocks: int
    server_version: int = 150000
    feed_id: uuid.UUID | None = None


class CompactionStore:
    """The job's SQL on one control connection.

    Args:
        conn: the control connection (keep it for the whole run).
        schema: the feed's schema (from configuration; validated).
        lock_timeout: seconds any statement may wait for a lock before the
            batch is retried (and, after a few tries, the job fails).
        rng: random source of the waits between those tries.
    """

    def __init__(
        self,
        conn: PgConnection,
        schema: str,
        lock_timeout: float = 5.0,
        rng: random.Random | None = None,
    ) -> None:
        self.conn = conn
        self._rng = rng or random.Random()
        self.schema = schema
        self.q = quote_schema(schema)
        self.lock_timeout = lock_timeout
        self.server_version = TID_RANGE_SCAN_VERSION  # until prepare() asks the server
        self._surveyed: tuple[int, dict[int, tuple[int, int, int]]] | None = None

    # -- run bookkeeping -----------------------------------------------------

    async def lock(self, wait: float) -> None:
        """Take the job's advisory lock, waiting at most ``wait`` seconds.

        Raises:
            CompactionError: another job holds it.
        """
        await self.conn.execute(f"SET lock_timeout = '{int(max(wait, 0.001) * 1000)}ms'")
        try:
            await self.conn.execute("SELECT pg_advisory_lock($1)", COMPACTION_LOCK_KEY)
        except asyncpg.exceptions.LockNotAvailableError:
            raise CompactionError(
                f"another compaction job is running on this database (waited {wait:g}s)"
            ) from None
        finally:
            await self.conn.execute(f"SET lock_timeout = '{int(self.lock_timeout * 1000)}ms'")

    async def unlock(self) -> None:
        """Release the advisory lock (closing the connection also does)."""
        await self.conn.execute("SELECT pg_advisory_unlock($1)", COMPACTION_LOCK_KEY)

    async def prepare(self) -> None:
        """Set the control session up.

        Raises:
            CompactionError: the feed table is missing, or its schema older than
                the job needs.
        """
        # Batches are small index walks: JIT compilation (triggered by the cost
        # penalty enable_seqscan=off puts on scanning the one-row feed_state)
        # would cost far more than the statements themselves.
        await self.conn.execute("SET jit = off")
        await self.conn.execute(f"SET lock_timeout = '{int(self.lock_timeout * 1000)}ms'")
        self.server_version = int(await self.conn.fetchval("SHOW server_version_num"))
        found = await self.conn.fetchval("SELECT to_regclass($1) IS NOT NULL", f"{self.q}.feed")
        if not found:
            raise CompactionError(f"no feed table {self.schema}.feed in this database")
        version = await schema_version(self.conn, self.schema)
        if version < SCHEMA_VERSION:
            raise CompactionError(
                f"the feed schema {self.schema!r} is at version {version}; the job needs"
                f" {SCHEMA_VERSION}: upgrade it with 'changefeed db init --dsn DSN' (as its"
                " owner), and the publishers with it"
            )

    async def snapshot(self) -> FeedSnapshot:
        """Capture the horizon, the clock, the head, the low-water mark and the table size."""
        row = await self.conn.fetchrow(
            "SELECT pg_snapshot_xmin(pg_current_snapshot())::text::bigint AS horizon,"
            " statement_timestamp() AS taken,"
            " pg_relation_size($1::regclass) / current_setting('block_size')::bigint AS blocks,"
            " current_setting('server_version_num')::int AS version",
            f"{self.q}.feed",
        )
        assert row is not None
        head = await self.conn.fetchrow(
            # Qualified: a bare "txid" in ORDER BY would name the bigint output
            # column, and sorting by it cannot use the primary key (a full scan).
            f"SELECT f.txid::text::bigint AS txid, f.id FROM {self.q}.feed f"
            " WHERE f.txid < $1::bigint::text::xid8 ORDER BY f.txid DESC, f.id DESC LIMIT 1",
            row["horizon"],
        )
        return FeedSnapshot(
            horizon=int(row["horizon"]),
            taken=row["taken"],
            head=Position(int(head["txid"]), int(head["id"])) if head else ORIGIN,
            low_water=await self.low_water(),
            blocks=int(row["blocks"]),
            server_version=int(row["version"]),
            feed_id=await self.conn.fetchval(f"SELECT feed_id FROM {self.q}.feed_state"),
        )

    async def low_water(self) -> Position:
        """The feed's low-water mark."""
        row = await self.conn.fetchrow(
            f"SELECT low_water_txid::text::bigint AS txid, low_water_id AS id"
            f" FROM {self.q}.feed_state"
        )
        return Position(int(row["txid"]), int(row["id"])) if row else ORIGIN

    async def drop_stale_staging(self) -> None:
        """Drop the staging tables runs that died left behind."""
        for name in await self.conn.fetch(
            "SELECT tablename FROM pg_tables WHERE schemaname = $1"
            " AND tablename LIKE 'compaction\\_%'",
            self.schema,
        ):
            table = name["tablename"]
            if _STAGING_NAME.match(table):
                await self.conn.execute(f'DROP TABLE IF EXISTS {self.q}."{table}"')

    def staging_table(self, run_id: int) -> str:
        """The qualified name of run ``run_id``'s staging table (for JDBC and SQL)."""
        return f'{self.q}."compaction_plan_{int(run_id)}"'

    async def create_staging(self, run_id: int) -> str:
        """Create the run's staging table (unlogged, no index until it is loaded)."""
        table = self.staging_table(run_id)
        await self.conn.execute(
            f"CREATE UNLOGGED TABLE {table} (kind smallint NOT NULL, txid bigint NOT NULL,"
            " id bigint NOT NULL, keep_txid bigint, keep_id bigint, sub_resources text[],"
            " resource text, changed_resource_id text)"
        )
        return table

    def hot_table(self, run_id: int) -> str:
        """The qualified name of the table of a full run's hot groups."""
        return f'{self.q}."compaction_hot_{int(run_id)}"'

    async def hot_groups(
        self, snapshot: FeedSnapshot, gc: datetime, lag: datetime, *, hot_min: int, most: int
    ) -> list[tuple[str, str]]:
        """The groups of at least about ``hot_min`` merge candidates (the largest
        ``most``), estimated from a sample of about 2,000 pages of the feed: bounded
        metadata, read before the merge so that it can keep their members apart.
        An estimate only decides where a group is merged, never how."""
        share = min(1.0, 2000 / max(snapshot.blocks, 1))
        rows = await self.conn.fetch(
            f"SELECT resource, changed_resource_id FROM {self.q}.feed"
            " TABLESAMPLE SYSTEM ($1)"
            " WHERE published >= $2 AND published < $3"
            " AND (txid, id) <= ($4::bigint::text::xid8, $5::bigint)"
            " GROUP BY resource, changed_resource_id HAVING count(*) >= $6"
            " ORDER BY count(*) DESC LIMIT $7",
            100 * share,
            gc,
            lag,
            *snapshot.head,
            max(1, int(hot_min * share / 2)),
            most,
        )
        return [(str(r["resource"]), str(r["changed_resource_id"])) for r in rows]

    async def create_hot(self, run_id: int, groups: Sequence[tuple[str, str]]) -> str:
        """Write a full run's hot groups to their table (the reads filter on it)."""
        table = self.hot_table(run_id)
        await self.conn.execute(
            f"CREATE UNLOGGED TABLE {table} (resource text NOT NULL,"
            " changed_resource_id text NOT NULL, PRIMARY KEY (resource, changed_resource_id))"
        )
        await self.conn.executemany(
            f"INSERT INTO {table} (resource, changed_resource_id) VALUES ($1, $2)", groups
        )
        return table

    def touched_table(self, run_id: int) -> str:
        """The qualified name of an incremental run's table of touched resource ids."""
        return f'{self.q}."compaction_touched_{int(run_id)}"'

    async def create_touched(self, run_id: int) -> str:
        """Create the table an incremental run writes the ids its changes touch to
        (unlogged, no index: it is read by page ranges and hashed)."""
        table = self.touched_table(run_id)
        await self.conn.execute(
            f"CREATE UNLOGGED TABLE {table} (resource text NOT NULL,"
            " changed_resource_id text NOT NULL)"
        )
        return table

    async def delta_garbage(self, scope: Scope, now: Cutoffs) -> list[GcRegion]:
        """The stretches holding the garbage an incremental run finds (``scope``): at
        or before the previous head, what aged into garbage since (a range of the
        ``published`` index); after it, what is already older than the cutoff (a
        range of the primary key). Two stretches, not one: they may be far apart,
        and a walk over the gap would look at every entry in it.

        Each stretch is ``[(lowest txid, 0), (highest txid, highest id)]`` (it holds
        all of its garbage; the walk takes the few others at its ends in its
        stride), ended no later than the bound of its side.
        """
        assert scope.since is not None
        bounds = (
            "SELECT min(txid::text::bigint) AS lo, max(txid::text::bigint) AS hi,"
            f" max(id) AS top, count(*) AS n FROM {self.q}.feed WHERE "
        )
        reads: list[tuple[str, tuple[Any, ...], Position]] = [
            (
                # The bare txid bounds make it a range scan of the primary key.
                "txid >= $1::bigint::text::xid8 AND txid <= $3::bigint::text::xid8"
                " AND (txid, id) > ($1::bigint::text::xid8, $2::bigint)"
                " AND (txid, id) <= ($3::bigint::text::xid8, $4::bigint) AND published < $5",
                (*scope.since, *now.head, now.gc),
                now.head,
            )
        ]
        if scope.gc_band is not None:
            reads.append(
                (
                    "published >= $1 AND published < $2"
                    " AND (txid, id) <= ($3::bigint::text::xid8, $4::bigint)",
                    (*scope.gc_band, *scope.since),
                    scope.since,
                )
            )
        regions = []
        for where, args, end in reads:
            row = await self.conn.fetchrow(bounds + where, *args)
            if row is not None and row["n"]:
                last = min(Position(int(row["hi"]), int(row["top"])), end)
                regions.append(GcRegion(Position(int(row["lo"]), 0), last, int(row["n"])))
        return sorted(regions, key=lambda r: r.first)

    async def delta_names(self, changed: Sequence[str]) -> list[str]:
        """The sub-resource names among an incremental run's changes (``changed``:
        the conditions that select them, ``frames.delta_conditions``), sorted."""
        if not changed:
            return []
        reads = " UNION ALL ".join(
            f"SELECT sub_resources FROM {self.q}.feed WHERE {condition}" for condition in changed
        )
        rows = await self.conn.fetch(
            f"SELECT DISTINCT u.s FROM ({reads}) AS c, unnest(c.sub_resources) AS u(s) ORDER BY 1"
        )
        return [str(r["s"]) for r in rows]

    async def table_pages(self, table: str) -> int:
        """A table's size in pages (to split its reads)."""
        return int(
            await self.conn.fetchval(
                "SELECT pg_relation_size($1::regclass) / current_setting('block_size')::bigint",
                table,
            )
        )

    @property
    def page_walk(self) -> bool:
        """Whether the apply step walks the staging table by page ranges (PostgreSQL >= 14)."""
        return self.server_version >= TID_RANGE_SCAN_VERSION

    async def index_staging(self, run_id: int) -> None:
        """Before PostgreSQL 14 only: index the loaded staging table for a keyset walk.

        From 14 on the walk goes by page ranges (TID range scans) and needs no
        index. Building one would be a write transaction as long as the build,
        and an open write transaction holds every tailer's horizon
        (``pg_snapshot_xmin``) back.
        """
        if self.page_walk:
            return
        table = self.staging_table(run_id)
        await self.conn.execute(f"CREATE INDEX ON {table} (kind, id)")
        await self.conn.execute(f"ANALYZE {table}")

    async def drop_staging(self, run_id: int) -> None:
        """Drop the run's staging tables."""
        for table in (self.staging_table, self.touched_table, self.hot_table):
            await self.conn.execute(f"DROP TABLE IF EXISTS {table(run_id)}")

    # -- the apply step ------------------------------------------------------

    async def _batch(self, sql: str, *args: Any) -> asyncpg.Record:
        """Run one batch statement in its own short transaction, retrying lock waits."""
        attempts = retrying(
            _LOCK_WAIT,
            retry=retry_if_exception_type(_RETRYABLE),
            stop=stop_after_attempt(_RETRIES),
            rng=self._rng,
        )
        try:
            async for attempt in attempts:
                with attempt:
                    async with self.conn.transaction():
                        # The batch statements are index walks by construction; an
                        # estimate skewed by one huge transaction must not turn one
                        # of them into a full scan of the feed.
                        await self.conn.execute("SET LOCAL enable_seqscan = off")
                        row: asyncpg.Record | None = await self.conn.fetchrow(sql, *args)
                        assert row is not None
                        return row
        except _RETRYABLE as exc:
            raise CompactionError(
                f"a batch kept waiting for locks ({type(exc).__name__}); "
                "nothing is lost: run the job again"
            ) from exc
        raise AssertionError("unreachable: tenacity either returns or raises")  # pragma: no cover

    async def apply_gc(
        self,
        regions: Sequence[GcRegion],
        cutoff: datetime,
        batch_size: int,
        report: BatchReport | None = None,
    ) -> tuple[int, int]:
        """Delete the garbage of ``regions``; return (entries deleted, transactions).

        Each region is walked along the primary key, ``batch_size`` entries at a
        time (garbage or not), one short transaction each: the step deletes the
        entries it looked at that are still older than ``cutoff`` and raises the
        low-water mark to the newest one it deleted.
        """
        sql = f"""
            WITH step AS MATERIALIZED (
                SELECT f.ctid AS tid, f.txid, f.id, f.published FROM {self.q}.feed f
                WHERE (f.txid, f.id) > ($1::bigint::text::xid8, $2::bigint)
                  AND (f.txid, f.id) <= ($3::bigint::text::xid8, $4::bigint)
                ORDER BY f.txid, f.id LIMIT $5
            ), deleted AS (
                DELETE FROM {self.q}.feed f
                WHERE f.ctid = ANY(ARRAY(SELECT tid FROM step WHERE published < $6))
                RETURNING f.txid, f.id
            ), newest AS (
                SELECT txid, id FROM deleted ORDER BY txid DESC, id DESC LIMIT 1
            ), raised AS (
                UPDATE {self.q}.feed_state s
                SET low_water_txid = n.txid, low_water_id = n.id, updated = now()
                FROM newest n
                WHERE (n.txid, n.id) > (s.low_water_txid, s.low_water_id)
                RETURNING 1
            ), last AS (
                SELECT txid::text::bigint AS txid, id FROM step ORDER BY txid DESC, id DESC LIMIT 1
            )
            SELECT (SELECT count(*) FROM step) AS looked, (SELECT count(*) FROM deleted) AS done,
                   (SELECT txid FROM last) AS last_txid, (SELECT id FROM last) AS last_id
        """
        total = steps = 0
        for region in regions:
            after = Position(region.first.txid, region.first.id - 1)  # just before first
            deleted = 0
            while True:
                row = await self._batch(sql, *after, *region.last, batch_size, cutoff)
                steps += 1
                deleted += int(row["done"])
                total += int(row["done"])
                looked = int(row["looked"])
                if looked:
                    after = Position(int(row["last_txid"]), int(row["last_id"]))
                end = looked < batch_size or after >= region.last
                if report is not None:
                    report(int(row["done"]) + (max(0, region.rows - deleted) if end else 0))
                if end:
                    break
        return total, steps

    async def announce(self, through: Position) -> tuple[int, Position]:
        """Tell the publishers a run is about to widen entries up to ``through``,
        before it does: raise the rewrite generation, and the horizon to at least
        ``through``, in one committed statement. Returns both as they are now."""
        row = await self._batch(
            f"""
            UPDATE {self.q}.feed_state s SET
                rewrite_generation = s.rewrite_generation + 1,
                (rewritten_through_txid, rewritten_through_id) = (
                    SELECT t.txid, t.id FROM (VALUES
                        (s.rewritten_through_txid, s.rewritten_through_id),
                        ($1::bigint::text::xid8, $2::bigint)) AS t(txid, id)
                    ORDER BY t.txid DESC, t.id DESC LIMIT 1),
                updated = now()
            RETURNING rewrite_generation,
                rewritten_through_txid::text::bigint AS txid, rewritten_through_id AS id
            """,
            *through,
        )
        return int(row["rewrite_generation"]), Position(int(row["txid"]), int(row["id"]))

    async def wait_for_standbys(self, wait: float) -> list[str]:
        """Wait until every streaming standby has replayed what this connection's
        session wrote so far (the widened keepers), before any drop; return the
        standbys waited for. The target is the primary's WAL insert position
        (``changefeed.wal.insert_target``): with ``synchronous_commit`` off, the
        write position may still be short of the keepers' records.

        A listener that read a stretch of the table after the drops on one
        server must find the keepers widened on any other it resumes from: on
        a standby that has not replayed them, a publisher would serve them as
        they were. What counts:

        * every physical walsender whose client reports a replay position (a
          hot standby); one that reports none yet (just connected) is behind;
        * not logical walsenders (a subscriber, a CDC tool: no publisher reads
          them), nor WAL receivers that write and never replay
          (``pg_receivewal``, ``pg_basebackup -X stream``, an archiver), nor a
          base backup's own connection: waiting for them would hold the drops
          back for good;
        * an inactive physical replication slot: its standby is away and comes
          back where it stopped. The slot tells only what it had *flushed*, not
          replayed, so it counts as behind until its standby is back and shows
          its replay (or the slot of a standby gone for good is dropped).

        Raises:
            CompactionError: a standby is still behind after ``wait`` seconds
                (nothing is lost: the drops wait for the next run), or the job's
                role may not see the standbys' positions.
        """
        target = await insert_target(self.conn)
        deadline = time.monotonic() + wait
        looks = 0
        while True:
            behind = await self.conn.fetch(
                """
                SELECT coalesce(r.application_name, r.client_addr::text, r.pid::text) AS name,
                       r.state, coalesce(r.replay_lsn >= $1::text::pg_lsn, false) AS caught_up
                FROM pg_stat_replication AS r
                WHERE NOT (r.replay_lsn IS NULL AND r.write_lsn IS NOT NULL)
                  AND r.state IS DISTINCT FROM 'backup'
                  AND r.pid NOT IN (
                      SELECT active_pid FROM pg_replication_slots
                      WHERE slot_type = 'logical' AND active_pid IS NOT NULL)
                UNION ALL
                SELECT 'slot ' || slot_name || ' (its standby is away)', 'slot', false
                FROM pg_replication_slots WHERE slot_type = 'physical' AND NOT active
                """,
                target,
            )
            if any(r["state"] is None for r in behind):
                raise CompactionError(
                    "cannot see how far the standbys have replayed: grant pg_read_all_stats"
                    " to the job's role (the drops wait for the next run; nothing is lost)"
                )
            late = [r["name"] for r in behind if not r["caught_up"]]
            names = [r["name"] for r in behind]
            if not late:
                return names
            if time.monotonic() >= deadline:
                raise CompactionError(
                    f"standby {', '.join(late)} has not replayed the widened entries within"
                    f" {wait:g}s: the drops wait for the next run (nothing is lost). A"
                    " standby that is gone for good: drop its replication slot"
                )
            looks += 1
            left = deadline - time.monotonic()
            await asyncio.sleep(min(_STANDBY_POLL.delay(looks, self._rng), max(left, 0.0)))

    def share_survey(self, other: CompactionStore) -> None:
        """Use ``other``'s survey of the staging table (a second connection's store)."""
        self._surveyed = other._surveyed

    async def survey_staging(self, run_id: int) -> None:
        """Find each kind's pages in the loaded staging table, in one scan, for the
        walks that follow (without it, each walk looks for its own kind's). Only the
        page walk (PostgreSQL >= 14) needs it."""
        if self.page_walk:
            self._surveyed = (run_id, await self._spans(run_id, None))

    async def _spans(self, run_id: int, kind: int | None) -> dict[int, tuple[int, int, int]]:
        """First page, last page and rows of ``kind`` (None: every kind) in the staging table."""
        if kind is not None and self._surveyed is not None and self._surveyed[0] == run_id:
            return self._surveyed[1]
        rows = await self.conn.fetch(
            "SELECT kind, count(*) AS n,"
            " min((ctid::text::point)[0])::bigint AS first,"
            " max((ctid::text::point)[0])::bigint AS last"
            f" FROM {self.staging_table(run_id)} WHERE $1::smallint IS NULL OR kind = $1"
            " GROUP BY kind",
            kind,
        )
        return {int(r["kind"]): (int(r["first"]), int(r["last"]), int(r["n"])) for r in rows}

    def _walk_sql(self, run_id: int, columns: str, action: str, after: str = "") -> str:
        """One batch: pick staging rows of kind ``$1`` (by page range or keyset), apply
        ``action`` (a data-modifying statement named ``done``), then ``after`` (more
        CTEs that may read ``done``), all in one statement."""
        table = self.staging_table(run_id)
        if self.page_walk:
            pick = (
                f"SELECT {columns} FROM {table}"
                " WHERE ctid >= $2::tid AND ctid < $3::tid AND kind = $1"
            )
        else:
            pick = f"SELECT {columns} FROM {table} WHERE kind = $1 AND id > $2 ORDER BY id LIMIT $3"
        return (
            f"WITH b AS ({pick}), done AS ({action}){after}"
            " SELECT (SELECT count(*) FROM b) AS batch, (SELECT max(id) FROM b) AS last,"
            " (SELECT count(*) FROM done) AS done"
        )

    async def _walk(
        self,
        kind: int,
        *,
        run_id: int,
        sql: str,
        batch_size: int,
        report: BatchReport | None,
        shared: SharedWalk | None = None,
    ) -> int:
        """Run ``sql`` over the staging rows of ``kind``, about ``batch_size`` at a time
        (with ``shared``, only the page ranges no other connection has taken)."""
        total = 0

        def done(row: asyncpg.Record) -> None:
            nonlocal total
            total += int(row["done"])
            if report is not None:
                report(int(row["batch"]))

        if self.page_walk:
            span = (await self._spans(run_id, kind)).get(kind)
            if span is None:
                return total
            ranges = _page_ranges(span, batch_size)
            if shared is not None:
                ranges = shared.take(kind, ranges)
            for lo, hi in ranges:
                row = await self._batch(sql, kind, lo, hi)
                if row["batch"]:
                    done(row)
            return total
        last = -1
        while True:
            row = await self._batch(sql, kind, last, batch_size)
            if not row["batch"]:
                return total
            done(row)
            last = int(row["last"])
            if row["batch"] < batch_size:
                return total

    async def apply_keepers(
        self, run_id: int, batch_size: int, report: BatchReport | None = None
    ) -> int:
        """Give every keeper the union of its group; return entries rewritten.

        The new value is the union of what the entry carries *now* and the
        planned union, so a rerun (or a stale plan) can only widen it.
        """
        action = f"""
            UPDATE {self.q}.feed f
            SET sub_resources = CASE
                WHEN cardinality(f.sub_resources) = 0 OR cardinality(b.sub_resources) = 0
                    THEN '{{}}'::text[]
                ELSE ARRAY(SELECT DISTINCT s FROM unnest(f.sub_resources || b.sub_resources)
                           AS u(s) ORDER BY s)
                END
            FROM b
            WHERE f.txid = b.txid::text::xid8 AND f.id = b.id
            RETURNING 1
        """
        sql = self._walk_sql(run_id, "txid, id, sub_resources", action)
        return await self._walk(
            KIND_KEEP, run_id=run_id, sql=sql, batch_size=batch_size, report=report
        )

    async def apply_drops(
        self,
        run_id: int,
        batch_size: int,
        report: BatchReport | None = None,
        shared: SharedWalk | None = None,
    ) -> int:
        """Delete the entries merged into their keepers; return entries deleted.

        An entry goes only if its keeper -- a later entry of the same resource
        id -- is in the feed now and covers its sub-resources. The feed's
        compaction mark rises to the newest entry dropped, in the same
        statement: a cursor at or before it may name an entry merged away, which
        a publisher must not take for a sign of a restored feed.
        """
        action = f"""
            DELETE FROM {self.q}.feed f
            USING b, {self.q}.feed k
            WHERE f.txid = b.txid::text::xid8 AND f.id = b.id
              AND k.txid = b.keep_txid::text::xid8 AND k.id = b.keep_id
              AND (k.txid, k.id) > (f.txid, f.id)
              AND k.resource = f.resource
              AND k.changed_resource_id = f.changed_resource_id
              AND (cardinality(k.sub_resources) = 0
                   OR (cardinality(f.sub_resources) > 0
                       AND k.sub_resources @> f.sub_resources))
            RETURNING f.txid, f.id
        """
        raise_mark = f""",
            newest AS (SELECT txid, id FROM done ORDER BY txid DESC, id DESC LIMIT 1),
            marked AS (
                UPDATE {self.q}.feed_state s
                SET compacted_through_txid = n.txid, compacted_through_id = n.id
                FROM newest n
                WHERE (n.txid, n.id) > (s.compacted_through_txid, s.compacted_through_id)
                RETURNING 1
            )"""
        sql = self._walk_sql(run_id, "txid, id, keep_txid, keep_id", action, raise_mark)
        return await self._walk(
            KIND_DROP, run_id=run_id, sql=sql, batch_size=batch_size, report=report, shared=shared
        )

    async def apply_keys(
        self, run_id: int, *, full: bool, batch_size: int, report: BatchReport | None = None
    ) -> int:
        """Record the run's groups' keepers (its ``KIND_KEY`` and ``KIND_KEEP`` rows) in
        the index of kept entries, a batch at a time (a full run empties it first), then mark the
        index as this run's. Returns the rows recorded.

        The unique index is in place while they go in. (Building it afterwards
        would hold a transaction id as long as the build -- and every tailer's
        horizon with it -- or, concurrently, wait for every writer that keeps a
        transaction open.) The index only tells the next run which earlier entry
        to merge with the ids its changes touch; an entry it names that is gone is
        simply not read.
        """
        keys = f"{self.q}.compaction_keys"
        if full:
            await self.conn.execute(f"TRUNCATE {keys}")
        # A retried Spark task may have staged a group twice: one row per key.
        action = f"""
            INSERT INTO {keys} (h, txid, id)
            SELECT DISTINCT ON (h) h, txid, id FROM (
                SELECT {KEEPER_HASH.format(table="b")} AS h, txid, id FROM b) AS hashed
            ORDER BY h, txid DESC, id DESC
            ON CONFLICT (h) DO UPDATE SET txid = EXCLUDED.txid, id = EXCLUDED.id
            RETURNING 1
        """
        sql = self._walk_sql(run_id, "txid, id, resource, changed_resource_id", action)
        recorded = 0
        for kind in (KIND_KEY, KIND_KEEP):
            recorded += await self._walk(
                kind, run_id=run_id, sql=sql, batch_size=batch_size, report=report
            )
        return recorded


PageRange = tuple[tuple[int, int], tuple[int, int]]
"""A batch's ``[lo, hi)`` range of the staging table's tuple ids."""


def _page_ranges(span: tuple[int, int, int], batch_size: int) -> Iterator[PageRange]:
    """Page ranges that hold about ``batch_size`` rows of one kind each, over the pages
    that hold any (``span``: first page, last page, rows). Spark's tasks write the
    kinds apart, or interleaved: either way the density is even enough."""
    first, last, rows = span
    step = max(1, batch_size * (last - first + 1) // rows)
    for lo in range(first, last + 1, step):
        yield (lo, 0), ((lo + step, 0) if lo + step <= last else _LAST_PAGE)


class SharedWalk:
    """One walk of a kind of staging rows by several connections: each batch's page
    range goes to whichever connection asks next, and to it alone. (One event loop:
    taking the next range never yields to another task.)"""

    def __init__(self) -> None:
        self._walks: dict[int, Iterator[PageRange]] = {}

    def take(self, kind: int, ranges: Iterator[PageRange]) -> Iterator[PageRange]:
        """The walk of ``kind``: ``ranges`` for the first connection to ask, the same
        iterator, as far as it has gone, for the others."""
        return self._walks.setdefault(kind, ranges)
