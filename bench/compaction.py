"""Benchmark: the Spark compaction job against the same work done as plain SQL inside PostgreSQL.

For each ``--rows N`` the feed is generated in SQL (``generate_series``, in
transactions of 100,000 entries): ``N/5`` resource ids, sub-resource sets
drawn from five shapes (one of them "whole resource"), ages spread evenly over
48 hours, so about half is garbage (older than 24 h), a little under half is
compacted (older than 10 min) and the newest few percent are left alone. The
database is then copied (``CREATE DATABASE ... TEMPLATE``) so that both sides
start from the identical feed:

* **job**: ``run_compaction`` with Spark on ``--master`` (default ``local[2]``),
  one SparkSession for all sizes (its start-up is reported once);
* **sql**: the same garbage collection and compaction as four plain SQL
  statements (one ``DELETE`` raising the low-water mark, a window plan into a
  temp table, one ``UPDATE``, one ``DELETE``): as fast as PostgreSQL does it,
  and holding its locks for the whole statement, which the job never does.

Both results are checked to be the same feed. Prints time by phase, ratios
(job / sql) and seconds per million entries (linear growth means a constant).

    python bench/compaction.py --rows 1000000 --rows 10000000
    python bench/compaction.py --rows 1000000 --dsn postgresql://postgres@127.0.0.1:5432/postgres

Without ``--dsn`` an embedded PostgreSQL is started on a throwaway directory.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import sys
import time
import uuid
from collections.abc import Iterator
from datetime import datetime, timedelta
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import asyncpg

from changefeed.compaction import CompactionSummary, run_compaction, spark_session
from changefeed.embedded import temporary
from changefeed.schemas import apply_schema

MAX_AGE = 24 * 3600.0
LAG = 600.0
CHUNK = 100_000
SERVER_SETTINGS = {
    "shared_buffers": "1GB",
    "work_mem": "128MB",
    "maintenance_work_mem": "512MB",
    "max_wal_size": "8GB",
    "checkpoint_timeout": "30min",
}


def with_database(dsn: str, database: str) -> str:
    return urlunsplit(urlsplit(dsn)._replace(path="/" + database))


async def generate(dsn: str, rows: int) -> float:
    """Create the feed of ``rows`` entries in ``dsn``; return seconds taken."""
    t0 = time.monotonic()
    conn = await asyncpg.connect(dsn)
    try:
        await apply_schema(conn)
        base: datetime = await conn.fetchval("SELECT now()")
        for start in range(1, rows + 1, CHUNK):
            await conn.execute(
                """
                INSERT INTO changefeed.feed (resource, sub_resources, changed_resource_id,
                                             published)
                SELECT CASE WHEN abs(hashint8(g)) % 10 = 0 THEN 'net' ELSE 'vm' END,
                       CASE abs(hashint8(g * 31)) % 5
                            WHEN 0 THEN '{}'::text[] WHEN 1 THEN ARRAY['nic']
                            WHEN 2 THEN ARRAY['alias'] WHEN 3 THEN ARRAY['alias', 'nic']
                            ELSE ARRAY['disk'] END,
                       'id-' || (abs(hashint8(g * 7)) % $3),
                       $4::timestamptz - interval '48 hours'
                           + (g::float8 / $5) * interval '48 hours'
                FROM generate_series($1::bigint, $2::bigint) AS g
                """,
                start,
                min(start + CHUNK - 1, rows),
                max(1, rows // 5),
                base,
                rows,
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


async def sql_baseline(dsn: str, as_of: datetime, head_txid: int, head_id: int) -> dict[str, float]:
    """The same GC and compaction as plain SQL statements; seconds by phase.

    The cutoffs count from ``as_of`` and nothing after the head is touched: the
    job's own snapshot, so that both sides do exactly the same work.
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

        gc = as_of - timedelta(seconds=MAX_AGE)
        lag = as_of - timedelta(seconds=LAG)
        async with phase("gc"):
            await conn.execute(
                """
                WITH deleted AS (
                    DELETE FROM changefeed.feed
                    WHERE published < $1 AND (txid, id) <= ($2::bigint::text::xid8, $3)
                    RETURNING txid, id
                ), newest AS (
                    SELECT txid, id FROM deleted ORDER BY txid DESC, id DESC LIMIT 1
                )
                UPDATE changefeed.feed_state s
                SET low_water_txid = n.txid, low_water_id = n.id, updated = now()
                FROM newest n WHERE (n.txid, n.id) > (s.low_water_txid, s.low_water_id)
                """,
                gc,
                head_txid,
                head_id,
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
                  AND (txid, id) <= ($3::bigint::text::xid8, $4)
                """,
                gc,
                lag,
                head_txid,
                head_id,
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
    conn = await asyncpg.connect(dsn)
    try:
        row = await conn.fetchrow(
            "SELECT count(*) AS n, sum(hashtext(txid::text || ':' || id || ':'"
            " || array_to_string(sub_resources, ',') || ':' || changed_resource_id)::bigint) AS h"
            " FROM changefeed.feed"
        )
        low = await conn.fetchrow(
            "SELECT low_water_txid::text, low_water_id FROM changefeed.feed_state"
        )
        assert row is not None and low is not None
        return (row["n"], row["h"], tuple(low))
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, action="append", help="feed size (repeatable)")
    parser.add_argument("--dsn", help="admin DSN of a PostgreSQL to use (default: embedded)")
    parser.add_argument("--master", default="local[2]")
    parser.add_argument("--batch-size", type=int, default=5000)
    parser.add_argument("--keep", action="store_true", help="keep the benchmark databases")
    args = parser.parse_args(argv)
    sizes = args.rows or [1_000_000]
    results: list[tuple[int, CompactionSummary, float, dict[str, float]]] = []
    with server(args.dsn) as admin:
        t0 = time.monotonic()
        with spark_session(args.master) as spark:
            spark_start = time.monotonic() - t0
            print(f"spark session ({args.master}) started in {spark_start:.1f}s", flush=True)
            warm = asyncio.run(warm_up(admin, spark))
            print(f"JVM warm-up (one run on a 10,000-entry feed) took {warm:.1f}s", flush=True)
            for rows in sizes:
                tag = uuid.uuid4().hex[:8]
                job_db, sql_db = f"cfbench_job_{tag}", f"cfbench_sql_{tag}"
                job_dsn, sql_dsn = with_database(admin, job_db), with_database(admin, sql_db)
                try:
                    asyncio.run(_create(admin, job_db))
                    made = asyncio.run(generate(job_dsn, rows))
                    copied = asyncio.run(copy_database(admin, job_db, sql_db))
                    print(
                        f"\n{rows:,} entries: generated in {made:.1f}s, copied in {copied:.1f}s",
                        flush=True,
                    )
                    t1 = time.monotonic()
                    summary = run_compaction(
                        job_dsn,
                        max_age=MAX_AGE,
                        compaction_lag=LAG,
                        spark=spark,
                        batch_size=args.batch_size,
                    )
                    job_total = time.monotonic() - t1
                    print(summary.to_text(), flush=True)
                    assert summary.as_of is not None
                    sql = asyncio.run(
                        sql_baseline(sql_dsn, summary.as_of, summary.head.txid, summary.head.id)
                    )
                    print(
                        "sql: "
                        + "  ".join(f"{k} {v:.1f}s" for k, v in sql.items())
                        + f"  total {sum(sql.values()):.1f}s",
                        flush=True,
                    )
                    same = asyncio.run(fingerprint(job_dsn)) == asyncio.run(fingerprint(sql_dsn))
                    print(f"same feed after both: {same}", flush=True)
                    if not same:
                        return 1
                    results.append((rows, summary, job_total, sql))
                finally:
                    if not args.keep:
                        asyncio.run(drop_database(admin, job_db))
                        asyncio.run(drop_database(admin, sql_db))
    print(
        "\n      rows   job s   sql s  job/sql  job s/M rows  sql s/M rows"
        f"  (Spark start-up {spark_start:.1f}s and JVM warm-up not included)"
    )
    for rows, _summary, job_total, sql in results:
        sql_total = sum(sql.values())
        print(
            f"{rows:>10,} {job_total:7.1f} {sql_total:7.1f} {job_total / sql_total:8.2f}"
            f" {job_total / rows * 1e6:13.2f} {sql_total / rows * 1e6:13.2f}"
        )
    return 0


async def warm_up(admin: str, spark: Any) -> float:
    """One job on a small feed: class loading and code generation happen once per JVM
    and would otherwise be charged to the first size measured."""
    name = f"cfbench_warm_{uuid.uuid4().hex[:8]}"
    await _create(admin, name)
    try:
        dsn = with_database(admin, name)
        await generate(dsn, 10_000)
        t0 = time.monotonic()
        await asyncio.to_thread(
            run_compaction, dsn, max_age=MAX_AGE, compaction_lag=LAG, spark=spark
        )
        return time.monotonic() - t0
    finally:
        await drop_database(admin, name)


async def _create(admin: str, name: str) -> None:
    conn = await asyncpg.connect(admin)
    try:
        await conn.execute(f'CREATE DATABASE "{name}"')
    finally:
        await conn.close()


if __name__ == "__main__":
    sys.exit(main())
