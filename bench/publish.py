"""Publish overhead: what a feed entry adds to an API's write, one row and in bulk.

    python bench/publish.py [--dsn DSN] [--quick]

1. A single-row API write transaction (``UPDATE vms SET alias = ... WHERE uuid = ...``,
   one transaction each, sequentially on one connection), three ways:

   * baseline: BEGIN; UPDATE; COMMIT (three round trips);
   * publish: BEGIN; UPDATE; ``SELECT changefeed.publish(...)``; COMMIT: the
     documented ``publish(conn, ...)`` call, one more round trip;
   * one statement: BEGIN; ``WITH w AS (UPDATE ... RETURNING uuid) SELECT
     changefeed.publish('vm', ..., uuid) FROM w``; COMMIT: the write and its
     entry in one statement, so no extra round trip;
   * publish, PL/pgSQL and one statement, PL/pgSQL: the same two with a PL/pgSQL
     twin of ``publish``
     (same INSERT and NOTIFY). ``publish`` is a multi-statement ``LANGUAGE sql``
     function, which PostgreSQL (before 18) plans again on every call; a
     PL/pgSQL function keeps its plans for the session. This is the form the
     feed SQL should take (docs/fanout.md, "Publish overhead").

   Each figure is the median time per transaction over interleaved blocks; the
   ratio is to the baseline. Target: <= 1.3x.

2. Bulk: entries/s appended by ``publish_many`` (1,000 per call, one transaction
   each) beside plain asyncpg ``executemany`` of the same rows into a table
   with the feed table's columns, defaults and indexes. Target: >= 0.7x.
   ``copy_records_to_table`` (COPY) is printed as a reference.

Without ``--dsn`` an embedded PostgreSQL is started (durability off:
commits are cheap, so round trips dominate and the ratios are the worst
case). With ``--dsn`` the bench works in schemas ``changefeed_bench`` and
``changefeed_bench_app`` and drops them.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
import uuid
from collections.abc import Awaitable, Callable

import asyncpg
from common import database, say

from changefeed.publisher import publish, publish_many
from changefeed.schemas import apply_schema, notify_channel

SCHEMA = "changefeed_bench"
APP = "changefeed_bench_app"


async def setup(conn: asyncpg.Connection, rows: int) -> list[str]:
    await conn.execute(f"DROP SCHEMA IF EXISTS {SCHEMA} CASCADE")
    await conn.execute(f"DROP SCHEMA IF EXISTS {APP} CASCADE")
    await apply_schema(conn, SCHEMA)
    await conn.execute(f"CREATE SCHEMA {APP}")
    await conn.execute(
        f"CREATE TABLE {APP}.vms (uuid text PRIMARY KEY, alias text NOT NULL, "
        "updated timestamptz NOT NULL DEFAULT now())"
    )
    # The feed table's twin, for the bulk baseline: same columns, defaults, indexes.
    await conn.execute(
        f"""CREATE TABLE {APP}.plain_feed (
            id bigint GENERATED ALWAYS AS IDENTITY,
            txid xid8 NOT NULL DEFAULT pg_current_xact_id(),
            resource text NOT NULL CHECK (resource <> ''),
            sub_resources text[] NOT NULL DEFAULT '{{}}',
            changed_resource_id text NOT NULL CHECK (changed_resource_id <> ''),
            published timestamptz NOT NULL DEFAULT statement_timestamp(),
            PRIMARY KEY (txid, id)
        ) WITH (fillfactor = 100)"""
    )
    await conn.execute(f"CREATE INDEX ON {APP}.plain_feed (published)")
    channel = notify_channel(SCHEMA).replace("'", "''")
    await conn.execute(
        f"""CREATE FUNCTION {APP}.publish_plpgsql(
            resource text, sub_resources text[], changed_resource_id text)
        RETURNS void LANGUAGE plpgsql AS $fn$
        BEGIN
            INSERT INTO {SCHEMA}.feed (resource, sub_resources, changed_resource_id)
            VALUES (resource, coalesce(sub_resources, '{{}}'), changed_resource_id);
            PERFORM pg_notify('{channel}', '');
        END
        $fn$"""
    )
    ids = [str(uuid.uuid4()) for _ in range(rows)]
    await conn.executemany(
        f"INSERT INTO {APP}.vms (uuid, alias) VALUES ($1, 'a')", [(i,) for i in ids]
    )
    await conn.execute(f"ANALYZE {APP}.vms")
    return ids


# --------------------------------------------------------------------------- single-row writes

UPDATE = f"UPDATE {APP}.vms SET alias = $1, updated = now() WHERE uuid = $2"
UPDATE_AND_PUBLISH = (
    f"WITH w AS (UPDATE {APP}.vms SET alias = $1, updated = now() WHERE uuid = $2 "
    f"RETURNING uuid) SELECT {SCHEMA}.publish('vm', ARRAY['alias'], w.uuid) FROM w"
)
UPDATE_AND_PUBLISH_PLPGSQL = UPDATE_AND_PUBLISH.replace(
    f"{SCHEMA}.publish(", f"{APP}.publish_plpgsql("
)


async def write_baseline(conn: asyncpg.Connection, vm: str, n: int) -> None:
    async with conn.transaction():
        await conn.execute(UPDATE, f"alias-{n}", vm)


async def write_with_publish(conn: asyncpg.Connection, vm: str, n: int) -> None:
    async with conn.transaction():
        await conn.execute(UPDATE, f"alias-{n}", vm)
        await publish(conn, "vm", ["alias"], vm, schema=SCHEMA)


async def write_with_publish_plpgsql(conn: asyncpg.Connection, vm: str, n: int) -> None:
    async with conn.transaction():
        await conn.execute(UPDATE, f"alias-{n}", vm)
        await conn.execute(f"SELECT {APP}.publish_plpgsql('vm', ARRAY['alias'], $1)", vm)


async def write_in_one_statement(conn: asyncpg.Connection, vm: str, n: int) -> None:
    async with conn.transaction():
        await conn.execute(UPDATE_AND_PUBLISH, f"alias-{n}", vm)


async def write_in_one_statement_plpgsql(conn: asyncpg.Connection, vm: str, n: int) -> None:
    async with conn.transaction():
        await conn.execute(UPDATE_AND_PUBLISH_PLPGSQL, f"alias-{n}", vm)


Writer = Callable[[asyncpg.Connection, str, int], Awaitable[None]]


async def single_row(
    conn: asyncpg.Connection, ids: list[str], blocks: int, per_block: int
) -> dict[str, float]:
    """Median seconds per transaction for each way, over interleaved blocks."""
    ways: dict[str, Writer] = {
        "baseline": write_baseline,
        "publish": write_with_publish,
        "publish, PL/pgSQL": write_with_publish_plpgsql,
        "one statement": write_in_one_statement,
        "one statement, PL/pgSQL": write_in_one_statement_plpgsql,
    }
    times: dict[str, list[float]] = {name: [] for name in ways}
    n = 0
    for _ in range(blocks):
        for name, write in ways.items():
            started = time.perf_counter()
            for _ in range(per_block):
                await write(conn, ids[n % len(ids)], n)
                n += 1
            times[name].append((time.perf_counter() - started) / per_block)
    return {name: statistics.median(values) for name, values in times.items()}


# --------------------------------------------------------------------------- bulk


async def bulk(conn: asyncpg.Connection, total: int, chunk: int, rounds: int) -> dict[str, float]:
    """Median rows per second for publish_many, executemany and COPY."""
    rows = [("vm", ["nic", "alias"], str(uuid.uuid4())) for _ in range(total)]
    plain = [(r, s, i) for r, s, i in rows]
    copy_rows = [(r, s, i) for r, s, i in rows]
    insert = (
        f"INSERT INTO {APP}.plain_feed (resource, sub_resources, changed_resource_id) "
        "VALUES ($1, $2, $3)"
    )

    async def with_publish_many() -> None:
        for i in range(0, total, chunk):
            async with conn.transaction():
                await publish_many(conn, rows[i : i + chunk], schema=SCHEMA)

    async def with_executemany() -> None:
        for i in range(0, total, chunk):
            async with conn.transaction():
                await conn.executemany(insert, plain[i : i + chunk])

    async def with_copy() -> None:
        for i in range(0, total, chunk):
            async with conn.transaction():
                await conn.copy_records_to_table(
                    "plain_feed",
                    schema_name=APP,
                    records=copy_rows[i : i + chunk],
                    columns=["resource", "sub_resources", "changed_resource_id"],
                )

    ways = {
        "publish_many": with_publish_many,
        "executemany": with_executemany,
        "COPY": with_copy,
    }
    rates: dict[str, list[float]] = {name: [] for name in ways}
    for _ in range(rounds):
        for name, run in ways.items():
            await conn.execute(f"TRUNCATE {SCHEMA}.feed, {APP}.plain_feed")
            started = time.perf_counter()
            await run()
            rates[name].append(total / (time.perf_counter() - started))
    return {name: statistics.median(values) for name, values in rates.items()}


async def main(args: argparse.Namespace) -> None:
    blocks, per_block = (6, 200) if args.quick else (10, 1000)
    total, rounds = (20_000, 3) if args.quick else (100_000, 5)
    say(
        f"publish: single-row transactions, {blocks} interleaved blocks of {per_block}; "
        f"bulk: {total:,} rows in chunks of 1,000, {rounds} rounds"
    )
    with database(args.dsn) as dsn:
        conn = await asyncpg.connect(dsn)
        try:
            ids = await setup(conn, 1000)
            for _ in range(200):  # warm up plans and caches
                await write_in_one_statement(conn, ids[0], 0)
                await write_in_one_statement_plpgsql(conn, ids[0], 0)
                await write_with_publish(conn, ids[0], 0)
            single = await single_row(conn, ids, blocks, per_block)
            base = single["baseline"]
            for name, seconds in single.items():
                say(
                    f"  single-row write, {name:<23} {seconds * 1e6:6.0f} us/transaction  "
                    f"{seconds / base:.2f}x baseline"
                )
            rates = await bulk(conn, total, 1000, rounds)
            plain = rates["executemany"]
            for name, rate in rates.items():
                say(f"  bulk, {name:<13} {rate:>10,.0f} rows/s  {rate / plain:.2f}x executemany")
        finally:
            await conn.execute(f"DROP SCHEMA IF EXISTS {SCHEMA} CASCADE")
            await conn.execute(f"DROP SCHEMA IF EXISTS {APP} CASCADE")
            await conn.close()
    say(
        f"result: publish() {single['publish'] / base:.2f}x a plain write (target <= 1.3x), "
        f"write+publish in one statement {single['one statement'] / base:.2f}x, "
        f"with a PL/pgSQL publish {single['one statement, PL/pgSQL'] / base:.2f}x; "
        f"publish_many {rates['publish_many'] / plain:.2f}x executemany (target >= 0.7x)"
    )


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--dsn", help="PostgreSQL DSN (default: an embedded server)")
    parser.add_argument("--quick", action="store_true", help="small run, under 30 s")
    return parser.parse_args()


if __name__ == "__main__":
    import uvloop

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        runner.run(main(parse_args()))
