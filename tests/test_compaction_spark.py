"""The Spark compaction job against real PostgreSQL and real Spark on ``local[2]``.

One SparkSession (``conftest.spark``) serves every test: starting the JVM is the slow part.
The property test is a seeded random loop rather than hypothesis: every
example is a full Spark run, so shrinking would cost minutes; the seed of a
failing example is in the assertion message.
"""

from __future__ import annotations

import asyncio
import random
import statistics
import time
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

import asyncpg
import pytest
from helpers import wait_until

from changefeed.compaction import (
    CompactionError,
    Notification,
    NullProgress,
    PlanEntry,
    frames,
    notifications,
    plan_feed,
    run_compaction,
    simulate,
    uncovered,
)
from changefeed.publisher.feed import FeedReader, publish
from changefeed.publisher.registration import plan_resume
from changefeed.schemas import ORIGIN, Cursor, Position, stamp_of

pytestmark = pytest.mark.spark

MAX_AGE = 24 * 3600.0
LAG = 3600.0
RESOURCES = ("net", "vm")
SUBS: list[list[str]] = [[], ["nic"], ["alias"], ["alias", "nic"], ["disk", "nic"], ["nic", "nic"]]


# --------------------------------------------------------------------------- helpers


async def reset_feed(conn: asyncpg.Connection) -> None:
    """An empty feed, and no run the next one could follow incrementally."""
    await conn.execute("TRUNCATE changefeed.feed")
    await conn.execute("UPDATE changefeed.feed_state SET low_water_txid = '0', low_water_id = 0")
    await conn.execute(
        "DROP TABLE IF EXISTS changefeed.compaction_runs, changefeed.compaction_keys"
    )


AGES = {  # seconds, far from the cutoffs of MAX_AGE and LAG
    "garbage": (25 * 3600, 72 * 3600),
    "candidate": (2 * 3600, 20 * 3600),
    "young": (0, 1800),
}


async def seed_random_feed(
    conn: asyncpg.Connection,
    rng: random.Random,
    ages: Mapping[str, tuple[float, float]] = AGES,
) -> None:
    """A random feed: entries with explicit ages (from ``ages``, by bucket) and mostly
    explicit txids, so that feed order (txid, id) differs from id order. Positions
    mostly follow age (as in life: old entries sit early in the feed), with some
    entries out of place; some younger entries come from real transactions."""
    now = datetime.now(UTC)
    top = int(await conn.fetchval("SELECT pg_current_xact_id()::text::bigint")) - 1
    txids = sorted(rng.randint(3, top) for _ in range(rng.randint(1, 12)))
    n = rng.randint(0, 80)
    items = []
    buckets = [name for name in ages for _ in range(2 if name == "candidate" else 1)]
    for _ in range(n):
        bucket = rng.choice(buckets)
        items.append((rng.uniform(*ages[bucket]), bucket))
    items.sort(reverse=True)
    for i, (age, bucket) in enumerate(items):
        values = (
            rng.choice(RESOURCES),
            rng.choice(SUBS),
            rng.choice("abcdef"),
            now - timedelta(seconds=age),
        )
        if bucket != "garbage" and rng.random() < 0.3:
            await conn.execute(
                "INSERT INTO changefeed.feed"
                " (resource, sub_resources, changed_resource_id, published)"
                " VALUES ($1, $2, $3, $4)",
                *values,
            )
            continue
        in_order = txids[i * len(txids) // len(items)]
        await conn.execute(
            "INSERT INTO changefeed.feed"
            " (txid, resource, sub_resources, changed_resource_id, published)"
            " VALUES ($1::bigint::text::xid8, $2, $3, $4, $5)",
            in_order if rng.random() < 0.85 else rng.choice(txids),
            *values,
        )
    if n and rng.random() < 0.4:  # as if an earlier collection had run
        row = await conn.fetchrow(
            "SELECT txid, id FROM changefeed.feed ORDER BY txid, id"
            " OFFSET floor(random() * 0.5 * (SELECT count(*) FROM changefeed.feed)) LIMIT 1"
        )
        assert row is not None  # n > 0: the feed has entries
        await conn.execute(
            "UPDATE changefeed.feed_state SET low_water_txid = $1, low_water_id = $2",
            row["txid"],
            row["id"],
        )


Feed = dict[Position, tuple[str, str, tuple[str, ...]]]


async def read_feed(
    conn: asyncpg.Connection, max_age: float = MAX_AGE, lag: float = LAG
) -> tuple[list[PlanEntry], Feed]:
    rows = await conn.fetch(
        "SELECT txid::text::bigint AS txid, id, resource, changed_resource_id, sub_resources,"
        " extract(epoch FROM now() - published) AS age FROM changefeed.feed"
    )
    entries = [
        PlanEntry(
            Position(r["txid"], r["id"]),
            r["resource"],
            r["changed_resource_id"],
            tuple(r["sub_resources"]),
            garbage=float(r["age"]) > max_age,
            candidate=float(r["age"]) > lag,
        )
        for r in rows
    ]
    feed = {
        e.position: (e.resource, e.changed_resource_id, tuple(sorted(set(e.sub_resources))))
        for e in entries
    }
    return entries, feed


async def resume(conn: asyncpg.Connection, cursor: Position) -> set[Notification]:
    """What a resume from ``cursor`` delivers: entries in (cursor, head], as notifications."""
    reader = FeedReader()
    head = await reader.head(conn)
    entries = (await reader.read_page(conn, cursor, head, RESOURCES, 1_000_000)).entries
    return notifications((e.resource, e.changed_resource_id, e.sub_resources) for e in entries)


async def stamps_of(conn: asyncpg.Connection) -> dict[Position, int]:
    """Each entry's stamp, as its cursors carry it."""
    rows = await conn.fetch("SELECT txid::text::bigint AS txid, id, published FROM changefeed.feed")
    return {Position(r["txid"], r["id"]): stamp_of(r["published"]) for r in rows}


def cursors_for(rng: random.Random, positions: list[Position], *extra: Position) -> set[Position]:
    found = {ORIGIN, *positions, *extra}
    for p in positions:
        found.add(Position(p.txid, p.id - 1))
    top = max((p.txid for p in positions), default=10)
    found.update(Position(rng.randint(0, top + 1), rng.randint(0, 200)) for _ in range(10))
    return found


@dataclass
class PhaseRecord:
    name: str
    unit: str | None
    total: int | None
    done: int = 0
    batches: int = 0
    ended: bool = False


class RecordedProgress(NullProgress):
    """Everything the job reported, phase by phase."""

    def __init__(self) -> None:
        self.phases: list[PhaseRecord] = []
        self.notes: dict[str, dict[str, Any]] = {}

    def phase(self, name: str, total: int | None = None, unit: str | None = None) -> None:
        self.phases.append(PhaseRecord(name, unit, total))

    def advance(self, n: int) -> None:
        self.phases[-1].done += n
        self.phases[-1].batches += 1

    def add_total(self, n: int) -> None:
        self.phases[-1].total = (self.phases[-1].total or 0) + n

    def end_phase(self) -> None:
        self.phases[-1].ended = True

    def note(self, event: str, fields: Mapping[str, Any]) -> None:
        self.notes[event] = dict(fields)

    def named(self) -> dict[str, PhaseRecord]:
        return {p.name: p for p in self.phases}


def compact(dsn: str, spark: Any, **kwargs: Any) -> Any:
    settings = {"max_age": MAX_AGE, "compaction_lag": LAG, "batch_size": 7, **kwargs}
    return run_compaction(dsn, spark=spark, **settings)


# --------------------------------------------------------------------------- I5 property


async def test_i5_property_random_feeds(feed_dsn: str, spark: Any) -> None:
    """For random feeds and cursors: every cursor at or after the low-water mark
    resumes after the job with every (resource id, sub-resource) notification it got
    before; the feed equals the reference plan's result; a second run is a no-op."""
    conn = await asyncpg.connect(feed_dsn)
    reader = FeedReader()
    checked = resumable = issued = 0
    started = time.monotonic()
    try:
        for seed in range(12):
            rng = random.Random(seed)
            await reset_feed(conn)
            await seed_random_feed(conn, rng)
            entries, feed_before = await read_feed(conn)
            low_before = await reader.low_water(conn)
            head = await reader.head(conn)
            cursors = cursors_for(rng, list(feed_before), low_before, head)
            before = {c: await resume(conn, c) for c in cursors if c >= low_before}
            stamps = await stamps_of(conn)

            summary = await asyncio.to_thread(compact, feed_dsn, spark)

            low_after = await reader.low_water(conn)
            assert low_after >= low_before, f"seed {seed}: low-water mark went down"
            for cursor, got_before in before.items():
                checked += 1
                if cursor < low_after:
                    continue  # no longer resumable: the publisher answers resumed=false
                resumable += 1
                lost = uncovered(got_before, await resume(conn, cursor))
                assert not lost, f"seed {seed}: resume from {cursor} lost {sorted(lost)}"
                if cursor not in stamps:
                    continue  # between entries: no publisher ever issued it
                # And a publisher resumes it: an entry merged away is no sign of a
                # restored feed (the job raised the feed's compaction mark).
                issued += 1
                facts = await reader.resume_facts(conn, cursor)
                resumed, reason = plan_resume(
                    Cursor(cursor, stamps.get(cursor, 0)),
                    facts,
                    feed_id=facts.state.feed_id,
                    head=head,
                    replay_limit=1 << 62,
                )
                assert resumed, f"seed {seed}: a publisher refuses {cursor}: {reason}"

            plan = plan_feed(entries, head)
            expected, expected_low = simulate(entries, plan, low_before)
            _, feed_after = await read_feed(conn)
            assert feed_after == expected, f"seed {seed}: feed differs from the reference plan"
            assert low_after == expected_low, f"seed {seed}"
            assert (summary.scanned, summary.collected, summary.merged, summary.rewritten) == (
                plan.scanned,
                len(plan.garbage),
                len(plan.drops),
                len(plan.updates),
            ), f"seed {seed}"
            assert summary.groups == plan.groups, f"seed {seed}"

            if seed % 4 == 0:
                again = await asyncio.to_thread(compact, feed_dsn, spark)
                assert (again.collected, again.merged, again.rewritten) == (0, 0, 0)
                assert (await read_feed(conn))[1] == feed_after
    finally:
        await conn.close()
    print(
        f"\nI5: {checked} cursor resumes checked, {resumable} still resumable after the job,"
        f" 12 feeds in {time.monotonic() - started:.1f}s"
    )
    assert resumable > 100 and issued > 50


async def test_dry_run_changes_nothing_and_counts_the_same(feed_dsn: str, spark: Any) -> None:
    conn = await asyncpg.connect(feed_dsn)
    try:
        for seed in range(100, 200):  # the first seed whose feed has work to do
            await reset_feed(conn)
            await seed_random_feed(conn, random.Random(seed))
            entries, feed = await read_feed(conn)
            head = await FeedReader().head(conn)
            plan = plan_feed(entries, head)
            if plan.garbage and plan.drops and plan.updates:
                break
        low_water = await FeedReader().low_water(conn)
        progress = RecordedProgress()
        summary = await asyncio.to_thread(compact, feed_dsn, spark, dry_run=True, progress=progress)
        assert (await read_feed(conn))[1] == feed
        assert await FeedReader().low_water(conn) == low_water
        assert (summary.scanned, summary.collected, summary.merged, summary.rewritten) == (
            plan.scanned,
            len(plan.garbage),
            len(plan.drops),
            len(plan.updates),
        )
        assert summary.dry_run and "dry run" in summary.to_text()
        # No lock, no apply phase; the scans counted in Spark tasks, each to the end.
        assert [p.name for p in progress.phases] == ["snapshot", "scan-gc", "scan-merge"]
        for scan in progress.phases[1:]:
            assert scan.unit == "tasks" and scan.ended
            assert scan.total is not None and scan.done == scan.total > 0, scan
        assert progress.notes["planned"]["drops"] == summary.merged
        assert progress.notes["done"]["dry_run"] is True
        tables = await conn.fetch(
            "SELECT tablename FROM pg_tables WHERE schemaname = 'changefeed'"
            " AND tablename LIKE 'compaction%'"
        )
        assert tables == []  # a dry run writes nothing, not even its bookkeeping
    finally:
        await conn.close()


# --------------------------------------------------------------------------- incremental runs

AGES_TWICE = {  # seconds, far from both runs' cutoffs: (24 h, 1 h), then (12 h, 30 min)
    "garbage": (30 * 3600, 40 * 3600),
    "becomes garbage": (14 * 3600, 20 * 3600),
    "candidate": (2 * 3600, 10 * 3600),
    "becomes candidate": (0.6 * 3600, 0.9 * 3600),
    "young": (0, 0.4 * 3600),
}


async def append_entries(conn: asyncpg.Connection, rng: random.Random, n: int) -> None:
    """``n`` entries in real transactions (after every position so far), some of them
    stamped long ago, as a writer's long transaction would."""
    now = datetime.now(UTC)
    for _ in range(n):
        low, high = AGES_TWICE[rng.choice(list(AGES_TWICE))]
        await conn.execute(
            "INSERT INTO changefeed.feed (resource, sub_resources, changed_resource_id, published)"
            " VALUES ($1, $2, $3, $4)",
            rng.choice(RESOURCES),
            rng.choice(SUBS),
            rng.choice("abcdefgh"),
            now - timedelta(seconds=rng.uniform(low, high)),
        )


async def test_incremental_runs_leave_the_feed_a_full_run_would(
    feed_dsn: str, spark: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Random feeds: a full run, entries appended (some of them already old), a second
    run with shorter durations (as if time had moved on) reading only what changed:
    the feed equals the reference plan of a full run on the whole feed, every
    resumable cursor keeps its notifications, and a third run changes nothing.
    Half the feeds have their previous keepers looked up by the index of kept
    entries, half found by a scan of the feed."""
    conn = await asyncpg.connect(feed_dsn)
    reader = FeedReader()
    try:
        for seed in range(4):
            keepers = "looked up" if seed % 2 else "scanned"
            # Each way asked for by name, and, on the last two feeds, picked by the
            # threshold (pages of touched ids against the feed's: 0 never scans,
            # 10**9 always does).
            asked = "auto" if seed >= 2 else "lookup" if seed % 2 else "scan"
            monkeypatch.setattr(frames, "LOOKUP_SHARE", 0 if seed % 2 else 10**9)
            rng = random.Random(1000 + seed)
            await reset_feed(conn)
            await seed_random_feed(conn, rng, AGES_TWICE)
            await append_entries(conn, rng, rng.randint(0, 20))
            first = await asyncio.to_thread(compact, feed_dsn, spark)
            assert first.full
            await append_entries(conn, rng, rng.randint(1, 40))
            entries, before = await read_feed(conn, 12 * 3600, 1800)
            head = await reader.head(conn)
            low_before = await reader.low_water(conn)
            cursors = cursors_for(rng, list(before), low_before, head)
            owed = {c: await resume(conn, c) for c in cursors if c >= low_before}

            second = await asyncio.to_thread(
                compact, feed_dsn, spark, max_age=12 * 3600, compaction_lag=1800, keepers=asked
            )
            assert not second.full, f"seed {seed}: {second.scope}"
            assert second.keepers == keepers, f"seed {seed}"
            plan = plan_feed(entries, head)
            expected, expected_low = simulate(entries, plan, low_before)
            _, after = await read_feed(conn, 12 * 3600, 1800)
            assert after == expected, f"seed {seed}: feed differs from a full run's"
            assert await reader.low_water(conn) == expected_low, f"seed {seed}"
            assert (second.collected, second.merged, second.rewritten) == (
                len(plan.garbage),
                len(plan.drops),
                len(plan.updates),
            ), f"seed {seed}"
            low_after = await reader.low_water(conn)
            for cursor, got in owed.items():
                if cursor >= low_after:
                    lost = uncovered(got, await resume(conn, cursor))
                    assert not lost, f"seed {seed}: resume from {cursor} lost {sorted(lost)}"

            third = await asyncio.to_thread(
                compact, feed_dsn, spark, max_age=12 * 3600, compaction_lag=1800
            )
            assert not third.full and (third.collected, third.merged) == (0, 0), f"seed {seed}"

        # The third run changed nothing, yet the index of kept entries must still be
        # there: a restart that empties it (unlogged) makes the next run a full one.
        await conn.execute("TRUNCATE changefeed.compaction_keys")
        fourth = await asyncio.to_thread(
            compact, feed_dsn, spark, max_age=12 * 3600, compaction_lag=1800
        )
        assert fourth.full and "index of kept entries is gone" in fourth.scope, fourth.scope
    finally:
        await conn.close()


async def test_an_incremental_merge_keeps_names_only_the_previous_keeper_has(
    feed_dsn: str, spark: Any
) -> None:
    """An incremental run's merge knows the names of its changes and those the run
    log recorded: a keeper's sub-resource that no change names stays in the union.
    With the recorded names incomplete, the run applies nothing and says so, and
    the next run reads the whole feed."""
    conn = await asyncpg.connect(feed_dsn)

    async def add(subs: list[str], hours_ago: float) -> None:
        await conn.execute(
            "INSERT INTO changefeed.feed (resource, sub_resources, changed_resource_id,"
            " published) VALUES ('vm', $1, 'a', now() - $2 * interval '1 hour')",
            subs,
            hours_ago,
        )

    async def feed() -> list[tuple[Any, ...]]:
        rows = await conn.fetch(
            "SELECT txid, id, sub_resources FROM changefeed.feed ORDER BY txid, id"
        )
        return [tuple(r) for r in rows]

    try:
        await reset_feed(conn)
        await add(["disk"], 5)
        await add(["alias"], 4)
        first = await asyncio.to_thread(compact, feed_dsn, spark)
        assert first.full and first.merged == 1
        await add(["nic"], 3)
        second = await asyncio.to_thread(compact, feed_dsn, spark)
        assert not second.full and second.merged == 1, second.scope
        assert [r[2] for r in await feed()] == [["alias", "disk", "nic"]]

        await add(["nic"], 2)
        await conn.execute(
            "UPDATE changefeed.compaction_runs SET names = '{nic}'"
            " WHERE run_id = (SELECT max(run_id) FROM changefeed.compaction_runs)"
        )
        before = await feed()
        with pytest.raises(CompactionError, match="1 entries name sub-resources the merge"):
            await asyncio.to_thread(compact, feed_dsn, spark)
        assert await feed() == before
        third = await asyncio.to_thread(compact, feed_dsn, spark)
        assert third.full and "did not finish" in third.scope, third.scope
        assert [r[2] for r in await feed()] == [["alias", "disk", "nic"]]
    finally:
        await conn.close()


def test_a_hot_id_is_merged_across_the_read_tasks_not_in_one(spark: Any) -> None:
    """The members of a hot id are aggregated where they were read and the totals
    broadcast back: its drops come out of every read partition, where the one
    shuffle the other ids go through puts them all in one task; both plan the
    same rows, one per member."""
    from pyspark.sql import functions as F

    from changefeed.compaction.merge import group_sizes, hot_groups, merge_rows

    members = spark.range(0, 40_000, numPartitions=4).select(
        (F.col("id") % 97).alias("txid"),
        F.col("id"),
        F.lit("vm").alias("resource"),
        F.when(F.col("id") % 4 == 0, F.lit("hot"))
        .otherwise(F.concat(F.lit("vm-"), (F.col("id") % 3000).cast("string")))
        .alias("changed_resource_id"),
        F.when(F.col("id") % 5 == 0, F.array(F.lit("alias")))
        .otherwise(F.array(F.lit("nic")))
        .alias("sub_resources"),
    )
    assert hot_groups(group_sizes(members), hot_min=5_000) == [("vm", "hot")]
    hot_id = F.col("changed_resource_id") == "hot"

    def hot_drops(split: bool) -> tuple[int, int, list[Any]]:
        if split:
            rows = merge_rows(members.where(~hot_id), members.where(hot_id), ["alias", "nic"])
        else:
            rows = merge_rows(members, None, ["alias", "nic"])
        rows = rows.withColumn("task", F.spark_partition_id())
        (keeper,) = rows.where("kind IN (2, 4) AND changed_resource_id = 'hot'").collect()
        hot = rows.where(
            (F.col("kind") == 3)
            & (F.col("keep_txid") == keeper["txid"])
            & (F.col("keep_id") == keeper["id"])
        )
        plan = sorted(rows.select("kind", "txid", "id", "keep_txid", "keep_id").collect())
        return hot.count(), hot.select("task").distinct().count(), plan

    split_drops, split_tasks, split_plan = hot_drops(True)
    plain_drops, plain_tasks, plain_plan = hot_drops(False)
    assert split_drops == plain_drops == 10_000 - 1
    assert (split_tasks, plain_tasks) == (4, 1)
    assert split_plan == plain_plan
    # One staging row per member: a widened keeper's row names its group too.
    assert len({(r["txid"], r["id"]) for r in split_plan}) == len(split_plan) == 40_000


# --------------------------------------------------------------------------- beside live writers


async def seed_bulk(conn: asyncpg.Connection, rows: int, ids: int) -> None:
    """``rows`` entries over ``ids`` resource ids, ages spread over 48 hours, in
    transactions of 1000 entries."""
    for start in range(0, rows, 1000):
        await conn.execute(
            """
            INSERT INTO changefeed.feed (resource, sub_resources, changed_resource_id, published)
            SELECT 'vm',
                   CASE abs(hashint8(g)) % 4 WHEN 0 THEN ARRAY[]::text[]
                        WHEN 1 THEN ARRAY['nic'] WHEN 2 THEN ARRAY['alias']
                        ELSE ARRAY['alias', 'nic'] END,
                   'vm-' || (abs(hashint8(g * 7)) % $3),
                   now() - interval '48 hours' + (g * interval '36 hours') / $4
            FROM generate_series($1::bigint, $2::bigint) AS g
            """,
            start,
            min(start + 1000, rows) - 1,
            ids,
            rows,
        )


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def test_job_beside_four_writers_and_a_tailer(feed_dsn: str, spark: Any) -> None:
    """Four writers publish in their own transactions and a tailer follows the feed
    while the job runs: the tailer gets every entry, in order, once; resumable
    cursors lose nothing; writers' commit latency is reported before vs during."""
    setup = await asyncpg.connect(feed_dsn)
    reader = FeedReader()
    try:
        await seed_bulk(setup, 40_000, 4_000)
        await setup.execute("ANALYZE changefeed.feed")
        start_head = await reader.head(setup)
        sample = [
            Position(r["txid"], r["id"])
            for r in await setup.fetch(
                "SELECT txid::text::bigint AS txid, id FROM changefeed.feed WHERE id % 997 = 0"
            )
        ]
        cursors = [*sample, start_head]
        before = {c: await resume(setup, c) for c in cursors}
    finally:
        await setup.close()

    received: list[tuple[Position, str]] = []
    received_at: dict[str, float] = {}
    committed_at: dict[str, float] = {}
    published: set[str] = set()
    latencies: dict[str, list[float]] = {"before": [], "during": []}
    phase = {"name": "before"}
    stop_writers = asyncio.Event()

    async def tailer() -> None:
        conn = await asyncpg.connect(feed_dsn)
        cursor = start_head
        try:
            while True:
                batch = await reader.read_after(conn, cursor, 500)
                now = time.perf_counter()
                for e in batch:
                    received.append((e.position, e.changed_resource_id))
                    received_at.setdefault(e.changed_resource_id, now)
                if batch:
                    cursor = batch[-1].position
                else:
                    await asyncio.sleep(0.005)  # poll interval (the Tailer's fallback)
        finally:
            await conn.close()

    async def writer(n: int, count: int | None) -> None:
        conn = await asyncpg.connect(feed_dsn)
        try:
            i = 0
            while (count is None and not stop_writers.is_set()) or (count and i < count):
                changed = f"w{n}-{phase['name']}-{i}"
                t0 = time.perf_counter()
                async with conn.transaction():
                    await publish(conn, "vm", ["nic"], changed)
                committed_at[changed] = time.perf_counter()
                latencies[phase["name"]].append(committed_at[changed] - t0)
                published.add(changed)
                i += 1
                await asyncio.sleep(0)
        finally:
            await conn.close()

    tail = asyncio.create_task(tailer())
    try:
        await asyncio.wait_for(asyncio.gather(*(writer(n, 150) for n in range(4))), 120)
        phase["name"] = "during"
        progress = RecordedProgress()
        writers = [asyncio.create_task(writer(n, None)) for n in range(4)]
        try:
            summary = await asyncio.wait_for(
                asyncio.to_thread(
                    compact,
                    feed_dsn,
                    spark,
                    batch_size=500,
                    progress=progress,
                ),
                240,
            )
        finally:
            stop_writers.set()
            await asyncio.wait_for(asyncio.gather(*writers), 60)
        await wait_until(
            lambda: published <= {c for _, c in received},
            timeout=60,
            message="the tailer received every published entry",
        )
    finally:
        tail.cancel()
        with pytest.raises(asyncio.CancelledError):
            await tail

    positions = [p for p, _ in received]
    assert positions == sorted(positions) and len(set(positions)) == len(positions)
    assert summary.collected > 0 and summary.merged > 0
    phases = progress.named()
    assert list(phases) == [
        "lock",
        "snapshot",
        "scan-gc",
        "scan-merge+stage",
        "survey",
        "apply-keep",
        "apply-merge",
        "apply-gc",
        "apply-keys",
    ]
    # Every phase with a count got to its total, in as many batches as the summary says.
    for record in phases.values():
        assert record.ended and (record.total is None or record.done == record.total), record
    assert phases["apply-gc"].total == summary.collected
    assert phases["apply-gc"].batches == summary.gc_batches > 1
    assert phases["apply-merge"].total >= summary.merged  # a guard may leave one alone
    assert phases["apply-merge"].batches > 1

    check = await asyncpg.connect(feed_dsn)
    try:
        low = await reader.low_water(check)
        for cursor, got in before.items():
            if cursor >= low:
                assert not uncovered(got, await resume(check, cursor)), cursor
    finally:
        await check.close()

    b, d = latencies["before"], latencies["during"]
    delivery = {
        name: [max(0.0, received_at[c] - t) for c, t in committed_at.items() if f"-{name}-" in c]
        for name in ("before", "during")
    }
    db, dd = delivery["before"], delivery["during"]
    print(
        f"\nwriters: {len(b)} commits before, {len(d)} during the job"
        f"\n  commit latency before: p50 {statistics.median(b) * 1000:.1f} ms,"
        f" p99 {percentile(b, 0.99) * 1000:.1f} ms, max {max(b) * 1000:.1f} ms"
        f"\n  commit latency during: p50 {statistics.median(d) * 1000:.1f} ms,"
        f" p99 {percentile(d, 0.99) * 1000:.1f} ms, max {max(d) * 1000:.1f} ms"
        f"\ntailer delivery (commit -> read): before p50 {statistics.median(db) * 1000:.1f} ms,"
        f" p99 {percentile(db, 0.99) * 1000:.1f} ms; during p50"
        f" {statistics.median(dd) * 1000:.1f} ms, p99 {percentile(dd, 0.99) * 1000:.1f} ms,"
        f" max {max(dd) * 1000:.1f} ms"
        f"\n{summary.to_text()}"
    )
    assert len(d) > 100
    # No writer ever waited on the job's locks: Spark competes for the same two
    # cores, so latency may grow, but nothing stalls for a lock timeout.
    assert percentile(d, 0.99) < 2.0
    # Nor does the tailer stall: the job never keeps a write transaction open
    # long enough to hold its horizon (pg_snapshot_xmin) back.
    assert percentile(dd, 0.99) < 2.0
