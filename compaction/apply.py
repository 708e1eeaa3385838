"""The PostgreSQL side of the compaction job: snapshot, staging, and the batched apply step.

Everything here runs on one asyncpg *control* connection, which also holds the
job's session-level advisory lock (one job per feed at a time; the lock goes
away with the connection if the job dies).

Each statement of the apply step is safe on its own, whatever plan it is given:

* a **garbage** batch deletes, by primary-key range, only entries still older
  than the run's cutoff, and raises the low-water mark to the newest position
  it deleted in the same transaction (never lowers it);
* a **keeper** batch only ever adds sub-resources to an entry (or makes it
  "whole resource"), in place, at its own position;
* a **drop** batch deletes an entry only if a *later* entry of the same
  ``(resource, changed_resource_id)`` is in the feed right now and covers its
  sub-resources.

So I5 holds after every committed batch, a job killed anywhere leaves a valid
feed, and a rerun (which plans again from the feed as it is) converges to what
one clean run would have produced. Batches are short transactions that lock
only the rows they delete or update (and, for garbage, the single
``feed_state`` row): writers (``INSERT``) and tailers (``SELECT``) never wait
on them.
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import asyncpg
from tenacity import retry_if_exception_type, stop_after_attempt

from changefeed.backoff import Backoff, retrying
from changefeed.schemas import ORIGIN, PgConnection, Position, quote_schema

from .errors import CompactionError
from .plan import GcChunk

__all__ = [
    "COMPACTION_LOCK_KEY",
    "KIND_DROP",
    "KIND_KEEP",
    "STAGING_COLUMNS",
    "TID_RANGE_SCAN_VERSION",
    "BatchReport",
    "CompactionStore",
    "FeedSnapshot",
]

COMPACTION_LOCK_KEY = 0x6366_636D_7000  # "cfcmp": one compaction job per database
"""Session-level advisory lock held for the whole run."""

KIND_KEEP = 2
"""Staging row kind: a keeper whose sub-resources become the union."""
KIND_DROP = 3
"""Staging row kind: an entry merged into its keeper and then deleted."""

STAGING_COLUMNS = ("kind", "txid", "id", "keep_txid", "keep_id", "sub_resources")
"""Columns of a run's staging table, in the order the Spark job writes them."""

TID_RANGE_SCAN_VERSION = 140000
"""``server_version_num`` from which ``ctid`` ranges are TID range scans."""

_LAST_PAGE = (4294967295, 0)  # above every heap page: the open end of the last range
_STAGING_NAME = re.compile(r"^compaction_plan_[0-9]+$")
_RETRIES = 3
_LOCK_WAIT = Backoff(initial=0.05, maximum=1.0, jitter=1.0)
"""Waits before a batch that waited for locks (or deadlocked) runs again
(changefeed.backoff's policy): the writers holding them get to finish, and two
jobs that deadlocked do not retry in step."""
_RETRYABLE = (asyncpg.exceptions.LockNotAvailableError, asyncpg.exceptions.DeadlockDetectedError)

BatchReport = Callable[[int], None]
"""Called after each committed batch with the planned entries it covered: a
garbage chunk's entries, or the staging rows of a batch. They add up to the
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
    """

    horizon: int
    taken: datetime
    head: Position
    low_water: Position
    blocks: int
    server_version: int = 150000


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
        """Set the control session up; raises CompactionError when the feed table is missing."""
        # Batches are small index walks: JIT compilation (triggered by the cost
        # penalty enable_seqscan=off puts on scanning the one-row feed_state)
        # would cost far more than the statements themselves.
        await self.conn.execute("SET jit = off")
        await self.conn.execute(f"SET lock_timeout = '{int(self.lock_timeout * 1000)}ms'")
        self.server_version = int(await self.conn.fetchval("SHOW server_version_num"))
        found = await self.conn.fetchval("SELECT to_regclass($1) IS NOT NULL", f"{self.q}.feed")
        if not found:
            raise CompactionError(f"no feed table {self.schema}.feed in this database")

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
        )

    async def low_water(self) -> Position:
        """The feed's low-water mark."""
        row = await self.conn.fetchrow(
            f"SELECT low_water_txid::text::bigint AS txid, low_water_id AS id"
            f" FROM {self.q}.feed_state"
        )
        return Position(int(row["txid"]), int(row["id"])) if row else ORIGIN

    async def begin_run(self, snapshot: FeedSnapshot) -> int:
        """Record a new run, drop staging tables left by runs that died; return the run id."""
        await self.conn.execute(
            f"CREATE TABLE IF NOT EXISTS {self.q}.compaction_runs ("
            " run_id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,"
            " started timestamptz NOT NULL DEFAULT now(),"
            " finished timestamptz,"
            " head_txid xid8 NOT NULL, head_id bigint NOT NULL,"
            " summary jsonb)"
        )
        for name in await self.conn.fetch(
            "SELECT tablename FROM pg_tables WHERE schemaname = $1"
            " AND tablename LIKE 'compaction\\_plan\\_%'",
            self.schema,
        ):
            table = name["tablename"]
            if _STAGING_NAME.match(table):
                await self.conn.execute(f'DROP TABLE IF EXISTS {self.q}."{table}"')
        run_id = await self.conn.fetchval(
            f"INSERT INTO {self.q}.compaction_runs (head_txid, head_id)"
            " VALUES ($1::bigint::text::xid8, $2) RETURNING run_id",
            snapshot.head.txid,
            snapshot.head.id,
        )
        return int(run_id)

    def staging_table(self, run_id: int) -> str:
        """The qualified name of run ``run_id``'s staging table (for JDBC and SQL)."""
        return f'{self.q}."compaction_plan_{int(run_id)}"'

    async def create_staging(self, run_id: int) -> str:
        """Create the run's staging table (unlogged, no index until it is loaded)."""
        table = self.staging_table(run_id)
        await self.conn.execute(
            f"CREATE UNLOGGED TABLE {table} (kind smallint NOT NULL, txid bigint NOT NULL,"
            " id bigint NOT NULL, keep_txid bigint, keep_id bigint, sub_resources text[])"
        )
        return table

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

    async def staging_counts(self, run_id: int) -> tuple[int, int, int]:
        """(groups, keeper updates, drops) planned in a loaded staging table.

        Every group of two or more has at least one drop, so the groups are
        the drops' distinct keepers. (A retried Spark task may have staged a
        row twice; these planned counts then include it twice. The summary's
        applied counts come from the apply step itself.)
        """
        table = self.staging_table(run_id)
        row = await self.conn.fetchrow(
            f"SELECT (SELECT count(*) FROM (SELECT DISTINCT keep_txid, keep_id FROM {table}"
            f"         WHERE kind = $2) AS keepers) AS groups,"
            f" (SELECT count(*) FROM {table} WHERE kind = $1) AS updates,"
            f" (SELECT count(*) FROM {table} WHERE kind = $2) AS drops",
            KIND_KEEP,
            KIND_DROP,
        )
        assert row is not None
        return (int(row["groups"]), int(row["updates"]), int(row["drops"]))

    async def drop_staging(self, run_id: int) -> None:
        await self.conn.execute(f"DROP TABLE IF EXISTS {self.staging_table(run_id)}")

    async def finish_run(self, run_id: int, summary: str) -> None:
        """Mark the run finished with its summary (JSON text)."""
        await self.conn.execute(
            f"UPDATE {self.q}.compaction_runs SET finished = now(), summary = $2::jsonb"
            " WHERE run_id = $1",
            run_id,
            summary,
        )

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
        chunks: Sequence[GcChunk],
        cutoff: datetime,
        report: BatchReport | None = None,
    ) -> int:
        """Delete the garbage chunks, one short transaction each; return rows deleted.

        Each transaction deletes the chunk's entries still older than ``cutoff``
        and raises the low-water mark to the newest one it deleted.
        """
        sql = f"""
            WITH deleted AS (
                DELETE FROM {self.q}.feed f
                WHERE (f.txid, f.id) >= ($1::bigint::text::xid8, $2::bigint)
                  AND (f.txid, f.id) <= ($3::bigint::text::xid8, $4::bigint)
                  AND f.id >= $5 AND f.id < $6
                  AND f.published < $7
                RETURNING f.txid, f.id
            ), newest AS (
                SELECT txid, id FROM deleted ORDER BY txid DESC, id DESC LIMIT 1
            ), raised AS (
                UPDATE {self.q}.feed_state s
                SET low_water_txid = n.txid, low_water_id = n.id, updated = now()
                FROM newest n
                WHERE (n.txid, n.id) > (s.low_water_txid, s.low_water_id)
                RETURNING 1
            )
            SELECT (SELECT count(*) FROM deleted) AS done, (SELECT count(*) FROM raised) AS raised
        """
        total = 0
        for chunk in chunks:
            row = await self._batch(
                sql,
                chunk.first.txid,
                chunk.first.id,
                chunk.last.txid,
                chunk.last.id,
                chunk.id_from,
                chunk.id_to,
                cutoff,
            )
            total += int(row["done"])
            if report is not None:
                report(chunk.rows)
        return total

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
    ) -> int:
        """Run ``sql`` over the staging rows of ``kind``, about ``batch_size`` at a time."""
        total = 0

        def done(row: asyncpg.Record) -> None:
            nonlocal total
            total += int(row["done"])
            if report is not None:
                report(int(row["batch"]))

        if self.page_walk:
            table = self.staging_table(run_id)
            shape = await self.conn.fetchrow(
                f"SELECT pg_relation_size($1::regclass) / current_setting('block_size')::bigint"
                f" AS pages, (SELECT count(*) FROM {table}) AS rows",
                table,
            )
            assert shape is not None
            pages, rows = int(shape["pages"]), int(shape["rows"])
            step = max(1, batch_size * pages // max(rows, 1))
            for lo in range(0, pages, step):
                hi = (lo + step, 0) if lo + step < pages else _LAST_PAGE
                row = await self._batch(sql, kind, (lo, 0), hi)
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
        self, run_id: int, batch_size: int, report: BatchReport | None = None
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
            KIND_DROP, run_id=run_id, sql=sql, batch_size=batch_size, report=report
        )
