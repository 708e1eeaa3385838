"""The job's own state in the feed's database: the run log and the index of kept entries.

* ``<schema>.compaction_runs`` logs every run: its head and cutoffs (where
  the next incremental run starts), whether it was full, the feed it ran on,
  when it started and finished, and its summary as JSON. A run without
  ``finished`` died.
* ``<schema>.compaction_keys`` holds each ``(resource, changed_resource_id)``'s
  keeper after the last run: the one entry of the group that run left
  among the entries old enough to merge. Unlogged (rewritten wholesale by
  every full run; no WAL, not replicated); a crash or a failover empties it,
  which a marker row (``resource = ''``, ``id`` = the run that wrote the index)
  lets the next run notice. It is never trusted for a deletion: an entry it
  names that is no longer in the feed is simply not read.

The job creates both itself (its role owns them), as it creates its staging
tables; the feed's own tables come from the schema migrations. Runs on the
control connection, like ``apply``.
"""

from __future__ import annotations

import uuid

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
            " ADD COLUMN IF NOT EXISTS feed_id uuid"
        )
        # Half-full pages: an incremental run moves a group's keeper by updating
        # its row, which then stays on its page (a HOT update, no new index entry).
        await self.conn.execute(
            f"CREATE UNLOGGED TABLE IF NOT EXISTS {self.q}.compaction_keys ("
            " resource text NOT NULL, changed_resource_id text NOT NULL,"
            " txid bigint NOT NULL, id bigint NOT NULL,"
            " PRIMARY KEY (resource, changed_resource_id)) WITH (fillfactor = 50)"
        )

    async def previous(self) -> PreviousRun | None:
        """The last run logged (None: none yet, or only runs from before run state
        was recorded)."""
        row = await self.conn.fetchrow(
            f"SELECT r.run_id, r.finished IS NOT NULL AS finished, r.feed_id,"
            " r.head_txid::text::bigint AS head_txid, r.head_id, r.gc_cutoff, r.lag_cutoff,"
            " r.horizon,"
            f" (SELECT max(started) FROM {self.q}.compaction_runs"
            "  WHERE full_run AND finished IS NOT NULL) AS last_full,"
            f" (SELECT id FROM {self.q}.compaction_keys"
            "  WHERE resource = '' AND changed_resource_id = '') AS keys_run"
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
            keys_run=None if row["keys_run"] is None else int(row["keys_run"]),
            last_full=row["last_full"],
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

    async def finish(self, run_id: int, summary: str) -> None:
        """Mark the run finished with its summary (JSON text)."""
        await self.conn.execute(
            f"UPDATE {self.q}.compaction_runs SET finished = now(), summary = $2::jsonb"
            " WHERE run_id = $1",
            run_id,
            summary,
        )
