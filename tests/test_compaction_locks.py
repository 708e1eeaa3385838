"""The compaction job's batches against real PostgreSQL row locks: a batch that waits too
long for a lock is tried again after the back-off policy's wait, and after a few tries the
job stops with a clear error, having changed nothing."""

from __future__ import annotations

import asyncio
import random
import time

import asyncpg
import pytest

from changefeed.compaction.apply import CompactionStore
from changefeed.compaction.errors import CompactionError

SQL = "UPDATE locked SET n = n + 1 WHERE id = 1 RETURNING n"


async def _setup(dsn: str) -> tuple[asyncpg.Connection, asyncpg.Connection]:
    holder = await asyncpg.connect(dsn)
    await holder.execute("CREATE TABLE locked (id int PRIMARY KEY, n int NOT NULL)")
    await holder.execute("INSERT INTO locked VALUES (1, 0)")
    job = await asyncpg.connect(dsn)
    await job.execute("SET lock_timeout = '50ms'")
    return holder, job


class _Retried(random.Random):
    """A seeded source that says when the back-off first draws a wait: a try failed."""

    def __init__(self, seed: int) -> None:
        super().__init__(seed)
        self.drawn = asyncio.Event()

    def uniform(self, a: float, b: float) -> float:
        self.drawn.set()
        return super().uniform(a, b)


async def test_a_batch_waiting_for_a_lock_is_tried_again_and_then_runs(dsn: str) -> None:
    holder, job = await _setup(dsn)
    try:
        rng = _Retried(1)
        store = CompactionStore(job, "changefeed", rng=rng)
        held = holder.transaction()
        await held.start()
        await holder.execute("SELECT * FROM locked WHERE id = 1 FOR UPDATE")
        batch = asyncio.create_task(store._batch(SQL))
        await asyncio.wait_for(rng.drawn.wait(), 10)  # the first try timed out on the lock
        await held.rollback()
        row = await asyncio.wait_for(batch, 10)
        assert row["n"] == 1
    finally:
        await holder.close()
        await job.close()


async def test_a_batch_that_keeps_waiting_stops_the_job_after_a_few_tries(dsn: str) -> None:
    holder, job = await _setup(dsn)
    try:
        store = CompactionStore(job, "changefeed", rng=random.Random(1))
        async with holder.transaction():
            await holder.execute("SELECT * FROM locked WHERE id = 1 FOR UPDATE")
            started = time.monotonic()
            with pytest.raises(CompactionError, match="kept waiting for locks"):
                await store._batch(SQL)
            # Three tries of 50 ms each, and between them the policy's waits, which
            # this seed draws as 6.7 ms and 84.7 ms (they were none).
            assert time.monotonic() - started >= 0.15 + 0.09
        assert await holder.fetchval("SELECT n FROM locked") == 0
    finally:
        await holder.close()
        await job.close()
