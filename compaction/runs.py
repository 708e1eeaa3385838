"""The job's own state in the feed's database: the run log and the index of kept entries.

* ``<schema>.compaction_runs`` logs every run: its head and cutoffs (where
  the next incremental run starts), whether it was full, the feed it ran on,
  when it started and finished, the sub-resource names its merge knew (every
  keeper it leaves names none other), and its summary as JSON. A run without
  ``finished`` died.
* ``<schema>.compaction_keys`` holds each ``(resource, changed_resource_id)``'s
  keeper after the last run: the one entry of the group that run left
  among the entries old enough to merge, keyed by a 64-bit hash of the pair
  (a bigint index costs a fraction of one on two strings; the entry it names
  is checked to be of the group it was looked up for). Unlogged (rewritten
  wholesale by every full run; no WAL, not replicated); a crash or a failover
  empties it, which the next run notices (the run log says how many it held).
  It is never trusted for a deletion: an entry it names that is no longer in
  the feed, or of another group, is simply not read.

The job creates both itself (its role owns them), as it creates its staging
tables; the feed's own tables come from the schema migrations. Runs on the
control connection, like ``apply``.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence

from changefeed.schemas import PgConnection, Position, quote_schema

from .scope import Cutoffs, PreviousRun, Scope

__all__ = ["RunLog"]


class RunLog:
    """The run log and the index of kept entries of one feed.

    Args:
        conn: the control connection.
        schema: the feed's schema (from configuration; validated).
    """

    def __init__(self, conn: PgConnection, schema: str) -> None:
        self.conn = conn
        self.q = quote_schema(schema)

    async def ensure(self) -> None:
        """Create the run log and the index of kept entries, or bring an older run
        log up to date (columns added since)."""
        runs = f"{self.q}.compaction_runs"
        await self.conn.execute(
            f"CREATE TABLE IF NOT EXISTS {runs} ("
            " run_id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,"
            " started timestamptz NOT NULL DEFAULT now(),"
            " finished timestamptz,"
            " head_txid xid8 NOT NULL, head_id bigint NOT NULL,"
            " summary jsonb)"
        )
        await self.conn.execute(
            f"ALTER TABLE {runs}"
            " ADD COLUMN IF NOT EXISTS full_run boolean,"
            " ADD COLUMN IF NOT EXISTS gc_cutoff timestamptz,"
            " ADD COLUMN IF NOT EXISTS lag_cutoff timestamptz,"
            " ADD COLUMN IF NOT EXISTS horizon bigint,"
            " ADD COLUMN IF NOT EXISTS feed_id uuid,"
            " ADD COLUMN IF NOT EXISTS kept bigint,"
            " ADD COLUMN IF NOT EXISTS names text[]"
        )
        # Half-full pages: an incremental run moves a group's keeper by updating
        # its row, which then stays on its page (a HOT update, no new index entry).
        await self.conn.execute(
            f"CREATE UNLOGGED TABLE IF NOT EXISTS {self.q}.compaction_keys ("
            " h bigint PRIMARY KEY, txid bigint NOT NULL, id bigint NOT NULL)"
            " WITH (fillfactor = 50)"
        )

    async def previous(self) -> PreviousRun | None:
        """The last run logged (None: none yet, or only runs from before run state
        was recorded)."""
        row = await self.conn.fetchrow(
            f"SELECT r.run_id, r.finished IS NOT NULL AS finished, r.feed_id,"
            " r.head_txid::text::bigint AS head_txid, r.head_id, r.gc_cutoff, r.lag_cutoff,"
            " r.horizon, r.kept, r.names,"
            f" (SELECT max(started) FROM {self.q}.compaction_runs"
            "  WHERE full_run AND finished IS NOT NULL) AS last_full,"
            f" EXISTS (SELECT 1 FROM {self.q}.compaction_keys) AS indexed"
            f" FROM {self.q}.compaction_runs r ORDER BY r.run_id DESC LIMIT 1"
        )
        if row is None or row["horizon"] is None:
            return None  # none, or logged before runs recorded their state
        return PreviousRun(
            run_id=int(row["run_id"]),
            finished=bool(row["finished"]),
            cutoffs=Cutoffs(
                Position(int(row["head_txid"]), int(row["head_id"])),
                row["gc_cutoff"],
                row["lag_cutoff"],
            ),
            horizon=int(row["horizon"]),
            feed_id=row["feed_id"],
            # A crash or failover empties the unlogged index, not some of it.
            index_intact=not row["kept"] or bool(row["indexed"]),
            last_full=row["last_full"],
            names=None if row["names"] is None else tuple(row["names"]),
        )

    async def begin(
        self, cutoffs: Cutoffs, scope: Scope, *, horizon: int, feed_id: uuid.UUID | None
    ) -> int:
        """Log a new run; return its id."""
        run_id = await self.conn.fetchval(
            f"INSERT INTO {self.q}.compaction_runs"
            " (head_txid, head_id, gc_cutoff, lag_cutoff, horizon, full_run, feed_id)"
            " VALUES ($1::bigint::text::xid8, $2, $3, $4, $5, $6, $7) RETURNING run_id",
            cutoffs.head.txid,
            cutoffs.head.id,
            cutoffs.gc,
            cutoffs.lag,
            horizon,
            scope.full,
            feed_id,
        )
        return int(run_id)

    async def finish(self, run_id: int, summary: str, *, kept: int, names: Sequence[str]) -> None:
        """Mark the run finished with its summary (JSON text), the sub-resource names
        its merge knew (``names``), and how many groups the index of kept entries
        has been given since it was last emptied (``kept``: this run's; an
        incremental run adds them to the previous run's, so that a run with no
        changes still tells the next one that the index must not be empty)."""
        await self.conn.execute(
            f"UPDATE {self.q}.compaction_runs r SET finished = now(), summary = $2::jsonb,"
            " names = $4::text[],"
            " kept = $3 + CASE WHEN r.full_run THEN 0 ELSE coalesce(("
            f"  SELECT p.kept FROM {self.q}.compaction_runs p WHERE p.run_id < r.run_id"
            "   ORDER BY p.run_id DESC LIMIT 1), 0) END"
            " WHERE r.run_id = $1",
            run_id,
            summary,
            kept,
            list(names),
        )
