"""Benchmark: the Spark compaction job against the same work done as plain SQL inside PostgreSQL.

For each ``--rows N`` the feed is generated in SQL (``generate_series``, two
connections taking million-entry chunks in turn, indexes built afterwards):
``N/5`` resource ids (``N/E`` with ``--entries-per-id E``) plus one hot id
holding 1 % of the entries, sub-resource sets drawn from five shapes (one of
them "whole resource"), publication times spread evenly over 48 hours ending
4.8 hours ago. The database is then copied (``CREATE DATABASE ...
TEMPLATE``) so that both sides start from the identical feed:

* **job, full**: ``run_compaction`` on ``--master`` (default ``local[2]``),
  one SparkSession for all sizes (its start-up is reported once), with the
  durations as they were 4.8 hours ago (max age 28.8 h, lag 4 h 58 min):
  about half the feed is garbage and a little under half is merged;
* **sql**: the same garbage collection and compaction as four plain SQL
  statements (one ``DELETE`` raising the low-water mark, a window plan into a
  temp table, one ``UPDATE``, one ``DELETE``): as fast as PostgreSQL does it,
  and holding its locks for the whole statement, which the job never does.

Then 10 % more entries arrive (published over the last 4.8 hours, as in the
4.8 hours since) on both copies, and time moves on: the durations are 24 h and
10 min again.

* **job, incremental**: the second run reads only what changed since the first
  (``--keepers both``: once finding the previous keepers by a scan of the feed,
  then on a copy of the same state by looking them up, each checked against
  plain SQL);
* **sql**: the same work as plain SQL on the other copy (SQL has no
  incremental form: the same four statements over the whole table).

Both sides must end in the same feed after each step (checked). Prints time by
phase, seconds per million entries of the feed, the ratios job / sql, and the
incremental run's time over the full run's.

    python bench/compaction.py --rows 1000000 --rows 10000000 --rows 30000000
    python bench/compaction.py --rows 10000000 --entries-per-id 50   # ids that change often
    python bench/compaction.py --rows 1000000 --standalone       # on a 2-worker cluster
    python bench/compaction.py --rows 10000000 --keepers both    # look-up against scan
    python bench/compaction.py --rows 1000000 --dsn postgresql://postgres@127.0.0.1:5432/postgres

Without ``--dsn`` an embedded PostgreSQL is started on a throwaway directory.
``--standalone`` starts a Spark standalone master and two workers (one core,
1 GiB each) on 127.0.0.1 (``sparkcluster``) and runs the job there.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import statistics
import sys
import time
import uuid
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import asyncpg

from changefeed.compaction import CompactionSummary, run_compaction, spark_session
from changefeed.embedded import temporary
from changefeed.schemas import apply_schema

MAX_AGE = 24 * 3600.0
LAG = 600.0
SPAN = 48 * 3600.0
LATER = SPAN / 10  # the second run comes this much later, after 10 % more entries
SERVER_SETTINGS = {
    "shared_buffers": "1GB",
    "work_mem": "128MB",
    "maintenance_work_mem": "512MB",
    "max_wal_size": "8GB",
    "checkpoint_timeout": "30min",
}
_GENERATE = """
    INSERT INTO changefeed.feed (resource, sub_resources, changed_resource_id, published)
    SELECT CASE WHEN abs(hashint8(g)) % 10 = 0 THEN 'net' ELSE 'vm' END,
           CASE abs(hashint8(g * 31)) % 5
                WHEN 0 THEN '{}'::text[] WHEN 1 THEN ARRAY['nic']
                WHEN 2 THEN ARRAY['alias'] WHEN 3 THEN ARRAY['alias', 'nic']
                ELSE ARRAY['disk'] END,
           CASE WHEN abs(hashint8(g * 13)) % 100 = 0 THEN 'hot'
                ELSE 'id-' || (abs(hashint8(g * 7)) % $3) END,
           $4::timestamptz + ((g - $5)::float8 / $6) * $7::interval
    FROM generate_series($1::bigint, $2::bigint) AS g
"""


def with_database(dsn: str, database: str) -> str:
    return urlunsplit(urlsplit(dsn)._replace(path="/" + database))


async def generate(dsn: str, rows: int, newest: datetime, ids: int) -> float:
    """Create the feed of ``rows`` entries over ``ids`` resource ids in ``dsn``, the
    newest published at ``newest``; return seconds taken. Bulk: the indexes are
    built afterwards."""
    t0 = time.monotonic()
    conn = await asyncpg.connect(dsn)
    try:
        await apply_schema(conn)
        await conn.execute("ALTER TABLE changefeed.feed DROP CONSTRAINT feed_pkey")
        await conn.execute("DROP INDEX changefeed.feed_published_idx")
        oldest = newest - timedelta(seconds=SPAN)
        # Two connections take the chunks (a million entries each, oldest first)
        # in turn, so that transaction ids follow publication times, as in life.
        chunks = [(lo, min(lo + _CHUNK - 1, rows)) for lo in range(1, rows + 1, _CHUNK)]
        await asyncio.gather(
            *(_insert(dsn, chunks[k::2], rows=rows, ids=ids, oldest=oldest) for k in range(2))
        )
        await conn.execute("SET maintenance_work_mem = '512MB'")
        await conn.execute("ALTER TABLE changefeed.feed ADD PRIMARY KEY (txid, id)")
        await conn.execute("CREATE INDEX feed_published_idx ON changefeed.feed (published)")
        await conn.execute("VACUUM ANALYZE changefeed.feed")
    finally:
        await conn.close()
    return time.monotonic() - t0


_CHUNK = 1_000_000


async def _insert(
    dsn: str, chunks: list[tuple[int, int]], *, rows: int, ids: int, oldest: datetime
) -> None:
    """Insert the entries of ``chunks`` (ranges of the series), one transaction each."""
    conn = await asyncpg.connect(dsn)
    try:
        for lo, hi in chunks:
            await conn.execute(
                _GENERATE,
                lo,
                hi,
                ids,
                oldest,
                1,
                rows,
                timedelta(seconds=SPAN),
            )
    finally:
        await conn.close()


async def append(dsn: str, rows: int, newest: datetime, ids: int) -> float:
    """``rows`` more entries (over the same ``ids``), published over the ``LATER``
    seconds before ``newest``, in transactions of 100,000 (indexes in place, as in
    life)."""
    t0 = time.monotonic()
    conn = await asyncpg.connect(dsn)
    try:
        oldest = newest - timedelta(seconds=LATER)
        for start in range(1, rows + 1, 100_000):
            await conn.execute(
                _GENERATE,
                10**12 + start,
                10**12 + min(start + 99_999, rows),
                ids,
                oldest,
                10**12 + 1,
                rows,
                timedelta(seconds=LATER),
            )
        await conn.execute("VACUUM ANALYZE changefeed.feed")
    finally:
        await conn.close()
    return time.monotonic() - t0


async def copy_database(admin_dsn: str, source: str, target: str) -> float:
    t0 = time.monotonic()
    conn = await asyncpg.connect(admin_dsn)
    try:
        await conn.execute(f'CREATE DATABASE "{target}" TEMPLATE "{source}"')
    finally:
        await conn.close()
    return time.monotonic() - t0


async def drop_database(admin_dsn: str, name: str) -> None:
    conn = await asyncpg.connect(admin_dsn)
    try:
        await conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    finally:
        await conn.close()


async def sql_baseline(dsn: str, as_of: datetime, max_age: float, lag: float) -> dict[str, float]:
    """The same GC and compaction as plain SQL statements; seconds by phase.

    The cutoffs count from ``as_of``, the job's own snapshot clock, so that both
    sides do exactly the same work (nobody writes meanwhile: every entry is in).
    """
    phases: dict[str, float] = {}
    conn = await asyncpg.connect(dsn)
    try:
        await conn.execute("SET jit = off")

        @contextlib.asynccontextmanager
        async def phase(name: str) -> Any:
            t0 = time.monotonic()
            yield
            phases[name] = time.monotonic() - t0

        gc = as_of - timedelta(seconds=max_age)
        cut = as_of - timedelta(seconds=lag)
        async with phase("gc"):
            await conn.execute(
                """
                WITH deleted AS (
                    DELETE FROM changefeed.feed WHERE published < $1 RETURNING txid, id
                ), newest AS (
                    SELECT txid, id FROM deleted ORDER BY txid DESC, id DESC LIMIT 1
                )
                UPDATE changefeed.feed_state s
                SET low_water_txid = n.txid, low_water_id = n.id, updated = now()
                FROM newest n WHERE (n.txid, n.id) > (s.low_water_txid, s.low_water_id)
                """,
                gc,
            )
        async with phase("plan"):
            await conn.execute(
                """
                CREATE TEMP TABLE plan AS
                SELECT txid, id, resource, changed_resource_id, sub_resources,
                       row_number() OVER (PARTITION BY resource, changed_resource_id
                                          ORDER BY txid DESC, id DESC) AS rn,
                       count(*) OVER (PARTITION BY resource, changed_resource_id) AS n
                FROM changefeed.feed
                WHERE published >= $1 AND published < $2
                """,
                gc,
                cut,
            )
            await conn.execute("DELETE FROM plan WHERE n = 1")
            await conn.execute(
                """
                CREATE TEMP TABLE unions AS
                SELECT p.resource, p.changed_resource_id,
                       CASE WHEN bool_or(cardinality(p.sub_resources) = 0) THEN '{}'::text[]
                            ELSE array_agg(DISTINCT s ORDER BY s) FILTER (WHERE s IS NOT NULL)
                       END AS subs
                FROM plan p LEFT JOIN LATERAL unnest(p.sub_resources) AS s ON true
                GROUP BY 1, 2
                """
            )
        async with phase("update"):
            await conn.execute(
                """
                UPDATE changefeed.feed f SET sub_resources = u.subs
                FROM plan p JOIN unions u USING (resource, changed_resource_id)
                WHERE p.rn = 1 AND f.txid = p.txid AND f.id = p.id
                  AND f.sub_resources IS DISTINCT FROM u.subs
                """
            )
        async with phase("delete"):
            await conn.execute(
                "DELETE FROM changefeed.feed f USING plan p"
                " WHERE p.rn > 1 AND f.txid = p.txid AND f.id = p.id"
            )
    finally:
        await conn.close()
    return phases


async def fingerprint(dsn: str) -> tuple[Any, ...]:
    """The feed's entries and low-water mark, by id (the copies' transaction ids differ
    once both have been written to: they share the cluster's counter)."""
    conn = await asyncpg.connect(dsn)
    try:
        row = await conn.fetchrow(
            "SELECT count(*) AS n, sum(hashtext(id || ':'"
            " || array_to_string(sub_resources, ',') || ':' || changed_resource_id)::bigint) AS h"
            " FROM changefeed.feed"
        )
        low = await conn.fetchval("SELECT low_water_id FROM changefeed.feed_state")
        assert row is not None
        return (row["n"], row["h"], low)
    finally:
        await conn.close()


@contextlib.contextmanager
def server(dsn: str | None) -> Iterator[str]:
    if dsn:
        yield dsn
        return
    pg = temporary(settings=SERVER_SETTINGS)
    try:
        yield pg.start()
    finally:
        pg.close()


@contextlib.contextmanager
def spark_master(args: argparse.Namespace) -> Iterator[str]:
    if not args.standalone:
        yield args.master
        return
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from sparkcluster import standalone_cluster

    with standalone_cluster(workers=2, cores=1, memory="1g", port=args.cluster_port) as url:
        yield url


@dataclass
class Step:
    """One side-by-side step: the job and plain SQL on copies of one feed."""

    name: str
    rows: int
    summary: CompactionSummary
    job: float
    sql: dict[str, float]

    @property
    def sql_total(self) -> float:
        return sum(self.sql.values())


def median_step(steps: Iterable[Step]) -> Step:
    """One step whose times are the medians of ``steps`` (each phase on its own)."""
    done = list(steps)
    sql = {k: statistics.median(s.sql[k] for s in done) for k in done[0].sql}
    job = statistics.median(s.job for s in done)
    return Step(done[0].name, done[0].rows, done[0].summary, job, sql)


def show(step: Step) -> None:
    print(step.summary.to_text(), flush=True)
    sql = "  ".join(f"{k} {v:.1f}s" for k, v in step.sql.items())
    print(f"sql: {sql}  total {step.sql_total:.1f}s", flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, action="append", help="feed size (repeatable)")
    parser.add_argument("--dsn", help="admin DSN of a PostgreSQL to use (default: embedded)")
    parser.add_argument("--master", default="local[2]")
    parser.add_argument("--standalone", action="store_true", help="a 2-worker cluster")
    parser.add_argument("--cluster-port", type=int, default=18270)
    parser.add_argument("--batch-size", type=int, default=5000)
    parser.add_argument(
        "--entries-per-id",
        type=int,
        default=5,
        help="entries per resource id over the 48 hours generated (default 5: --rows / 5 ids)",
    )
    parser.add_argument(
        "--keepers",
        choices=("auto", "lookup", "scan", "both"),
        default="auto",
        help="how the incremental run finds previous keepers; both: each, on copies of one"
        " state (default auto: the job picks)",
    )
    parser.add_argument("--keep", action="store_true", help="keep the benchmark databases")
    parser.add_argument(
        "--repeat", type=int, default=1, help="runs per size (medians are shown), default 1"
    )
    parser.add_argument(
        "--warm-up",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="warm the JVM up before measuring (default; --no-warm-up for a smoke run)",
    )
    args = parser.parse_args(argv)
    sizes = args.rows or [1_000_000]
    results: list[tuple[Step, Step]] = []
    with server(args.dsn) as admin, spark_master(args) as master:
        t0 = time.monotonic()
        with spark_session(master) as spark:
            spark_start = time.monotonic() - t0
            print(f"spark session ({master}) started in {spark_start:.1f}s", flush=True)
            if args.warm_up:
                warm = asyncio.run(warm_up(admin, spark))
                print(
                    f"JVM warm-up (a full and an incremental run on a 10,000-entry feed)"
                    f" took {warm:.1f}s",
                    flush=True,
                )
            for rows in sizes:
                runs = [one_size(admin, rows, spark, args) for _ in range(args.repeat)]
                results.append((median_step(r[0] for r in runs), median_step(r[1] for r in runs)))
    print(f"\n{os.cpu_count()} cores, load average {os.getloadavg()[0]:.2f} at the end;"
          f" Spark start-up ({spark_start:.1f}s) and the JVM warm-up not included;"
          f" medians of {args.repeat} run(s) per size")  # fmt: skip
    print("      rows  run          job s   sql s  job/sql  job s/M  sql s/M  incr/full")
    for full, incremental in results:
        for step in (full, incremental):
            ratio = f"{incremental.job / full.job:9.3f}" if step is incremental else ""
            print(
                f"{step.rows:>10,}  {step.name:<11} {step.job:6.1f} {step.sql_total:7.1f}"
                f" {step.job / step.sql_total:8.2f} {step.job / step.rows * 1e6:8.2f}"
                f" {step.sql_total / step.rows * 1e6:8.2f}{ratio}"
            )
    if len(results) > 1:
        big = [full.job / full.rows * 1e6 for full, _ in results if full.rows >= 10_000_000]
        if len(big) > 1:
            spread = (max(big) - min(big)) / statistics.median(big)
            print(f"full run s/M from 10M up: {', '.join(f'{b:.2f}' for b in big)}"
                  f" (spread {spread:.0%} of the median)")  # fmt: skip
    return 0


def one_size(admin: str, rows: int, spark: Any, args: argparse.Namespace) -> tuple[Step, Step]:
    tag = uuid.uuid4().hex[:8]
    job_db, sql_db = f"cfbench_job_{tag}", f"cfbench_sql_{tag}"
    lookup_db, sql_lookup_db = f"cfbench_lookup_{tag}", f"cfbench_sql_lookup_{tag}"
    job_dsn, sql_dsn = with_database(admin, job_db), with_database(admin, sql_db)
    try:
        asyncio.run(_create(admin, job_db))
        now = asyncio.run(_now(admin))
        ids = max(1, rows // args.entries_per_id)
        made = asyncio.run(generate(job_dsn, rows, now - timedelta(seconds=LATER), ids))
        copied = asyncio.run(copy_database(admin, job_db, sql_db))
        print(
            f"\n{rows:,} entries over {ids:,} resource ids: generated in {made:.1f}s,"
            f" copied in {copied:.1f}s",
            flush=True,
        )
        # First run: the durations as they were LATER seconds ago.
        full = side_by_side(
            "full",
            rows,
            job_dsn=job_dsn,
            sql_dsn=sql_dsn,
            spark=spark,
            max_age=MAX_AGE + LATER,
            lag=LAG + LATER,
            args=args,
        )
        more = rows // 10
        took = [asyncio.run(append(dsn, more, now, ids)) for dsn in (job_dsn, sql_dsn)]
        print(f"\n{more:,} more entries, appended in {took[0]:.1f}s", flush=True)
        if args.keepers == "both":
            # The same state for the other way of finding the previous keepers (the
            # copy holds the unlogged index of kept entries too), and for the plain
            # SQL it is checked against (its cutoffs are that run's own).
            asyncio.run(copy_database(admin, job_db, lookup_db))
            asyncio.run(copy_database(admin, sql_db, sql_lookup_db))
        incremental = side_by_side(
            "incremental",
            rows,
            job_dsn=job_dsn,
            sql_dsn=sql_dsn,
            spark=spark,
            max_age=MAX_AGE,
            lag=LAG,
            args=args,
            keepers="scan" if args.keepers == "both" else args.keepers,
        )
        if incremental.summary.full:
            raise SystemExit(f"the second run was not incremental: {incremental.summary.scope}")
        if args.keepers == "both":
            compare_keeper_reads(
                incremental,
                with_database(admin, lookup_db),
                sql_dsn=with_database(admin, sql_lookup_db),
                spark=spark,
                args=args,
            )
        return full, incremental
    finally:
        if not args.keep:
            asyncio.run(drop_database(admin, job_db))
            asyncio.run(drop_database(admin, sql_db))
            asyncio.run(drop_database(admin, lookup_db))
            asyncio.run(drop_database(admin, sql_lookup_db))


def compare_keeper_reads(
    scanned: Step, dsn: str, *, sql_dsn: str, spark: Any, args: argparse.Namespace
) -> None:
    """The incremental run again, on a copy of the same state, with its previous keepers
    looked up by the index of kept entries instead of found by a scan of the feed;
    it must end in the feed plain SQL makes with its cutoffs (on its own copy)."""
    print(f"[incremental run, keepers looked up: load average {os.getloadavg()[0]:.2f}]")
    summary, took = timed_job(
        dsn, max_age=MAX_AGE, lag=LAG, spark=spark, args=args, keepers="lookup"
    )
    print(summary.to_text(), flush=True)
    assert summary.as_of is not None
    asyncio.run(sql_baseline(sql_dsn, summary.as_of, MAX_AGE, LAG))
    if asyncio.run(fingerprint(dsn)) != asyncio.run(fingerprint(sql_dsn)):
        raise SystemExit("the job with keepers looked up and plain SQL disagree")
    print(
        f"previous keepers: scanned {scanned.job:.1f}s"
        f" (scan-delta {scanned.summary.phases.get('scan-delta', 0.0):.1f}s),"
        f" looked up {took:.1f}s (scan-delta {summary.phases.get('scan-delta', 0.0):.1f}s):"
        f" looked up / scanned {took / scanned.job:.2f}",
        flush=True,
    )


def timed_job(
    dsn: str, *, max_age: float, lag: float, spark: Any, args: argparse.Namespace, keepers: str
) -> tuple[CompactionSummary, float]:
    """One run of the job, and the seconds it took."""
    t1 = time.monotonic()
    summary = run_compaction(
        dsn,
        max_age=max_age,
        compaction_lag=lag,
        spark=spark,
        batch_size=args.batch_size,
        keepers=keepers,
    )
    return summary, time.monotonic() - t1


def side_by_side(
    name: str,
    rows: int,
    *,
    job_dsn: str,
    sql_dsn: str,
    spark: Any,
    max_age: float,
    lag: float,
    args: argparse.Namespace,
    keepers: str = "auto",
) -> Step:
    print(f"[{name} run: load average {os.getloadavg()[0]:.2f}]", flush=True)
    summary, job = timed_job(
        job_dsn, max_age=max_age, lag=lag, spark=spark, args=args, keepers=keepers
    )
    assert summary.as_of is not None
    sql = asyncio.run(sql_baseline(sql_dsn, summary.as_of, max_age, lag))
    step = Step(name, rows, summary, job, sql)
    show(step)
    same = asyncio.run(fingerprint(job_dsn)) == asyncio.run(fingerprint(sql_dsn))
    print(f"same feed after both: {same}", flush=True)
    if not same:
        raise SystemExit(f"the job and plain SQL disagree after the {name} run")
    return step


async def warm_up(admin: str, spark: Any) -> float:
    """A full and an incremental job on a small feed, as the sizes measured run them:
    class loading and code generation happen once per JVM and would otherwise be
    charged to the first size measured (the incremental run's steps, its own)."""
    name = f"cfbench_warm_{uuid.uuid4().hex[:8]}"
    await _create(admin, name)
    try:
        dsn = with_database(admin, name)
        rows, now = 10_000, await _now(admin)
        ids = rows // 5
        await generate(dsn, rows, now - timedelta(seconds=LATER), ids)
        t0 = time.monotonic()
        await asyncio.to_thread(
            run_compaction, dsn, max_age=MAX_AGE + LATER, compaction_lag=LAG + LATER, spark=spark
        )
        await append(dsn, rows // 10, now, ids)
        await asyncio.to_thread(
            run_compaction, dsn, max_age=MAX_AGE, compaction_lag=LAG, spark=spark
        )
        return time.monotonic() - t0
    finally:
        await drop_database(admin, name)


async def _now(admin: str) -> datetime:
    conn = await asyncpg.connect(admin)
    try:
        value: datetime = await conn.fetchval("SELECT now()")
        return value
    finally:
        await conn.close()


async def _create(admin: str, name: str) -> None:
    conn = await asyncpg.connect(admin)
    try:
        await conn.execute(f'CREATE DATABASE "{name}"')
    finally:
        await conn.close()


if __name__ == "__main__":
    sys.exit(main())
