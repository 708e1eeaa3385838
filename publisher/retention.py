"""Inline retention: RFD 5's max age, enforced cheaply by the publishers themselves.

Each round deletes old entries in short batches under a transaction-scoped
advisory lock, so only one publisher instance trims at a time and no batch
holds locks long enough to stall writers or tailers. The feed's low-water mark
(the oldest resumable position) rises in the same transaction as each delete,
so a cursor older than what is held is answered with ``resumed: false``,
never with a silent gap. Only entries below the snapshot horizon (every
transaction before them has ended) are trimmed: the tailers read nothing
above it, so an entry committed behind a transaction held open for longer
than ``max_age`` is kept until they have had it. Switch it off
(``retention = false``) when the Spark job owns garbage collection.
"""

from __future__ import annotations

from datetime import timedelta

from changefeed.schemas import PgConnection, quote_schema

__all__ = ["RETENTION_LOCK_KEY", "trim_batch", "trim_expired"]

RETENTION_LOCK_KEY = 0x6366_7274_6E00  # "cfrtn"


async def trim_batch(
    conn: PgConnection, schema: str, max_age: timedelta, batch_size: int
) -> int | None:
    """Delete up to ``batch_size`` entries older than ``max_age`` in one short transaction.

    Returns:
        how many entries were deleted, or None when another instance holds the lock.
    """
    q = quote_schema(schema)
    async with conn.transaction():
        if not await conn.fetchval("SELECT pg_try_advisory_xact_lock($1)", RETENTION_LOCK_KEY):
            return None
        row = await conn.fetchrow(
            f"""
            WITH doomed AS (
                SELECT txid, id FROM {q}.feed
                WHERE published < statement_timestamp() - $1::interval
                  AND txid < pg_snapshot_xmin(pg_current_snapshot())
                ORDER BY published LIMIT $2
            ), deleted AS (
                DELETE FROM {q}.feed f USING doomed d
                WHERE f.txid = d.txid AND f.id = d.id
                RETURNING f.txid, f.id
            ), newest AS (
                SELECT txid, id FROM deleted ORDER BY txid DESC, id DESC LIMIT 1
            ), raised AS (
                UPDATE {q}.feed_state s SET low_water_txid = n.txid, low_water_id = n.id,
                    updated = now()
                FROM newest n
                WHERE (n.txid, n.id) > (s.low_water_txid, s.low_water_id)
                RETURNING 1
            )
            SELECT (SELECT count(*) FROM deleted) AS deleted,
                   (SELECT count(*) FROM raised) AS raised
            """,
            max_age,
            batch_size,
        )
        assert row is not None
        return int(row["deleted"])


async def trim_expired(
    conn: PgConnection,
    schema: str,
    max_age: timedelta,
    batch_size: int = 5000,
    max_batches: int = 100,
) -> int:
    """Trim in batches until nothing is older than ``max_age`` (or ``max_batches`` ran)."""
    total = 0
    for _ in range(max_batches):
        deleted = await trim_batch(conn, schema, max_age, batch_size)
        if not deleted:
            break
        total += deleted
    return total
