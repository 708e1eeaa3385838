"""Killing the Spark job part-way and running it again ends in the same feed as one clean run.

The job runs in a child process with a failpoint: its progress reporter
SIGKILLs the child's own process at a chosen place (when the apply step
begins, after a few garbage / keeper / merge batches), so the kill lands at
an exact place without any timing. The child gets its own session (process group), which
is killed as a whole afterwards so that no Spark JVM outlives it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import signal
import sys
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import asyncpg
import pytest
from helpers import fresh_database

from changefeed.compaction import notifications, run_compaction, uncovered
from changefeed.publisher.feed import FeedReader
from changefeed.schemas import ORIGIN, Position

pytestmark = pytest.mark.spark

MAX_AGE = 24 * 3600.0
LAG = 3600.0
BATCH = 100
ENTRIES = 3000

CHILD = r"""
import json, os, signal, sys
from changefeed.compaction import NullProgress, run_compaction

dsn, failpoint = sys.argv[1], json.loads(sys.argv[2])

class Failpoint(NullProgress):
    # Dies when phase failpoint["phase"] has begun and seen failpoint["batches"] batches.
    def __init__(self):
        self.current, self.batches = None, 0

    def phase(self, name, total=None, unit=None):
        self.current, self.batches = name, 0
        self.check()

    def advance(self, n):
        self.batches += 1
        self.check()

    def check(self):
        if [self.current, self.batches] == [failpoint["phase"], failpoint["batches"]]:
            print("FAILPOINT", self.current, self.batches, flush=True)
            os.kill(os.getpid(), signal.SIGKILL)

run_compaction(dsn, max_age=float(sys.argv[3]), compaction_lag=float(sys.argv[4]),
               master="local[1]", batch_size=int(sys.argv[5]), progress=Failpoint())
print("FINISHED", flush=True)
"""


@pytest.fixture
async def second_feed_dsn(pg_server: Any) -> AsyncIterator[str]:
    async with fresh_database(pg_server, feed_schema=True) as dsn:
        yield dsn


def fixed_rows(top_txid: int) -> list[tuple[int, int, str, str, str, datetime]]:
    """The same feed every time: ids 1..ENTRIES, txids rising with id (a few out of
    order), ages falling with id from 72h to minutes, 200 resource ids."""
    rng = random.Random(7)
    base = datetime(2030, 1, 1, tzinfo=UTC)  # replaced by "now" at insert time
    rows = []
    for i in range(1, ENTRIES + 1):
        txid = 3 + (i // 5) * (top_txid - 10) // (ENTRIES // 5 + 1)
        if rng.random() < 0.05:
            txid = rng.randint(3, top_txid - 1)
        age = 72 * 3600 * (1 - i / ENTRIES) + rng.uniform(0, 600)
        for threshold in (LAG, MAX_AGE):  # nothing crosses a cutoff while the test runs
            if abs(age - threshold) < 1800:
                age = threshold + (1800 if age >= threshold else -1800)
        subs = rng.choice(["", "nic", "alias", "alias,nic", "disk"])
        rows.append(
            (
                i,
                txid,
                rng.choice(["vm", "net"]),
                subs,
                f"r{rng.randint(1, 200)}",
                base - timedelta(seconds=age),
            )
        )
    return rows


async def seed(
    dsn: str, rows: list[tuple[int, int, str, str, str, datetime]], now: datetime
) -> None:
    shift = now - datetime(2030, 1, 1, tzinfo=UTC)
    conn = await asyncpg.connect(dsn)
    try:
        await conn.execute(
            """
            INSERT INTO changefeed.feed
                (id, txid, resource, sub_resources, changed_resource_id, published)
            OVERRIDING SYSTEM VALUE
            SELECT i, t::text::xid8, r,
                   CASE WHEN s = '' THEN '{}'::text[] ELSE string_to_array(s, ',') END, c, p
            FROM unnest($1::bigint[], $2::bigint[], $3::text[], $4::text[], $5::text[],
                        $6::timestamptz[]) AS u(i, t, r, s, c, p)
            """,
            [r[0] for r in rows],
            [r[1] for r in rows],
            [r[2] for r in rows],
            [r[3] for r in rows],
            [r[4] for r in rows],
            [r[5] + shift for r in rows],
        )
    finally:
        await conn.close()


async def snapshot(dsn: str) -> tuple[list[tuple[Any, ...]], Position]:
    conn = await asyncpg.connect(dsn)
    try:
        rows = await conn.fetch(
            "SELECT txid::text::bigint, id, resource, changed_resource_id, sub_resources,"
            " published FROM changefeed.feed ORDER BY txid, id"
        )
        return [tuple(r) for r in rows], await FeedReader().low_water(conn)
    finally:
        await conn.close()


def resumes(
    rows: list[tuple[Any, ...]], cursors: list[Position]
) -> dict[Position, set[tuple[str, str, str | None]]]:
    return {
        c: notifications((r[2], r[3], r[4]) for r in rows if Position(r[0], r[1]) > c)
        for c in cursors
    }


async def run_child(dsn: str, failpoint: dict[str, Any], scratch: Path) -> str:
    """Run the job in a child killed at ``failpoint``; its temporary files go under
    ``scratch`` (a SIGKILL leaves the session's scratch space behind)."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        CHILD,
        dsn,
        json.dumps(failpoint),
        str(MAX_AGE),
        str(LAG),
        str(BATCH),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        start_new_session=True,
        env={**os.environ, "TMPDIR": str(scratch)},
    )
    try:
        out, err = await asyncio.wait_for(proc.communicate(), 240)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # the child's Spark JVM, if still there
        if proc.returncode is None:
            await proc.wait()
    text = out.decode()
    assert proc.returncode == -signal.SIGKILL, (proc.returncode, text, err.decode()[-2000:])
    assert "FAILPOINT" in text and "FINISHED" not in text, text
    return text


# The garbage walk runs on a second connection from the start of apply-keep (its
# progress is told once apply-gc begins): a kill during the keepers or the drops
# also lands somewhere in the garbage walk.
FAILPOINTS = [
    pytest.param({"phase": "apply-keep", "batches": 0}, id="after-staging"),
    pytest.param({"phase": "apply-keep", "batches": 1}, id="mid-keepers-and-gc"),
    pytest.param({"phase": "apply-merge", "batches": 2}, id="mid-merge"),
    pytest.param({"phase": "apply-keys", "batches": 0}, id="before-the-index"),
]


@pytest.mark.parametrize("failpoint", FAILPOINTS)
async def test_killed_job_then_rerun_equals_one_clean_run(
    feed_dsn: str, second_feed_dsn: str, spark: Any, failpoint: dict[str, Any], tmp_path: Path
) -> None:
    conn = await asyncpg.connect(feed_dsn)
    try:
        top = int(await conn.fetchval("SELECT pg_current_xact_id()::text::bigint")) - 1
    finally:
        await conn.close()
    rows = fixed_rows(top)
    now = datetime.now(UTC)
    await seed(feed_dsn, rows, now)
    await seed(second_feed_dsn, rows, now)
    original, low0 = await snapshot(second_feed_dsn)
    cursors = [ORIGIN, *(Position(r[0], r[1]) for r in original[::7])]
    before = resumes(original, cursors)

    def clean() -> Any:
        return run_compaction(
            feed_dsn, max_age=MAX_AGE, compaction_lag=LAG, spark=spark, batch_size=BATCH
        )

    # The clean run (this process) and the killed one (a child) work on two
    # databases holding the same feed, side by side.
    clean_run = asyncio.ensure_future(asyncio.to_thread(clean))
    try:
        await run_child(second_feed_dsn, failpoint, tmp_path)
    finally:
        clean_summary = await asyncio.wait_for(clean_run, 240)
    assert clean_summary.collected > 3 * BATCH and clean_summary.merged > 2 * BATCH
    assert clean_summary.rewritten > 0

    # Killed part-way, the feed is already consistent: I5 holds for every cursor.
    halfway, low_half = await snapshot(second_feed_dsn)
    assert low_half >= low0
    now_resumes = resumes(halfway, cursors)
    for c in cursors:
        if c >= low_half:
            assert not uncovered(before[c], now_resumes[c]), c

    def rerun() -> Any:
        return run_compaction(
            second_feed_dsn, max_age=MAX_AGE, compaction_lag=LAG, spark=spark, batch_size=BATCH
        )

    await asyncio.to_thread(rerun)
    assert await snapshot(second_feed_dsn) == await snapshot(feed_dsn)

    conn = await asyncpg.connect(second_feed_dsn)
    try:
        leftovers = await conn.fetch(
            "SELECT tablename FROM pg_tables WHERE tablename LIKE 'compaction_plan_%'"
        )
        runs = await conn.fetch(
            "SELECT run_id, finished IS NOT NULL AS finished FROM changefeed.compaction_runs"
            " ORDER BY run_id"
        )
    finally:
        await conn.close()
    assert leftovers == []  # the rerun dropped the dead run's staging table
    assert [r["finished"] for r in runs] == [False, True]
