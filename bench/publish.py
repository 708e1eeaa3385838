"""Publish overhead: what a feed entry adds to an API's write, one row and in bulk.

    python bench/publish.py [--dsn DSN] [--quick]

1. A single-row API write transaction (``UPDATE vms SET alias = ... WHERE uuid = ...``,
   one transaction each, sequentially on one connection), four ways:

   * baseline: BEGIN; UPDATE; COMMIT (three round trips);
   * trigger: the same UPDATE of a twin table whose ``publish_row`` trigger
     (``install_trigger(..., ["alias"], columns=["alias"])``) appends the
     entry: the API's own statement writes it;
   * one statement: BEGIN; ``WITH w AS (UPDATE ... RETURNING uuid) SELECT
     changefeed.publish('vm', ..., uuid) FROM w``; COMMIT: the write and its
     entry in one statement, so no extra round trip;
   * publish(): BEGIN; UPDATE; ``SELECT changefeed.publish(...)``; COMMIT: the
     ``publish(conn, ...)`` call, one more round trip.

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

from changefeed.publisher import install_trigger, publish, publish_many
from changefeed.schemas import apply_schema

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
    # The same table again, publishing its own changes (schema migration 3).
    await conn.execute(f"CREATE TABLE {APP}.vms_published (LIKE {APP}.vms INCLUDING ALL)")
    await install_trigger(
        conn, f"{APP}.vms_published", "vm", "uuid", ["alias"], columns=["alias"], schema=SCHEMA
    )
    ids = [str(uuid.uuid4()) for _ in range(rows)]
    for table in ("vms", "vms_published"):
        await conn.executemany(
            f"INSERT INTO {APP}.{table} (uuid, alias) VALUES ($1, 'a')", [(i,) for i in ids]
        )
        await conn.execute(f"ANALYZE {APP}.{table}")
    await conn.execute(f"TRUNCATE {SCHEMA}.feed")
    return ids


# --------------------------------------------------------------------------- single-row writes

UPDATE = f"UPDATE {APP}.vms SET alias = $1, updated = now() WHERE uuid = $2"
UPDATE_AND_PUBLISH = (
    f"WITH w AS (UPDATE {APP}.vms SET alias = $1, updated = now() WHERE uuid = $2 "
    f"RETURNING uuid) SELECT {SCHEMA}.publish('vm', ARRAY['alias'], w.uuid) FROM w"
)
UPDATE_PUBLISHED = UPDATE.replace(f"{APP}.vms ", f"{APP}.vms_published ")


async def write_baseline(conn: asyncpg.Connection, vm: str, n: int) -> None:
    async with conn.transaction():
        await conn.execute(UPDATE, f"alias-{n}", vm)


async def write_with_publish(conn: asyncpg.Connection, vm: str, n: int) -> None:
    async with conn.transaction():
        await conn.execute(UPDATE, f"alias-{n}", vm)
        await publish(conn, "vm", ["alias"], vm, schema=SCHEMA)


async def write_with_trigger(conn: asyncpg.Connection, vm: str, n: int) -> None:
    async with conn.transaction():
        await conn.execute(UPDATE_PUBLISHED, f"alias-{n}", vm)


async def write_in_one_statement(conn: asyncpg.Connection, vm: str, n: int) -> None:
    async with conn.transaction():
        await conn.execute(UPDATE_AND_PUBLISH, f"alias-{n}", vm)


Writer = Callable[[asyncpg.Connection, str, int], Awaitable[None]]


async def single_row(
    conn: asyncpg.Connection, ids: list[str], blocks: int, per_block: int
) -> dict[str, float]:
    """Median seconds per transaction for each way, over interleaved blocks."""
    ways: dict[str, Writer] = {
        "baseline": write_baseline,
        "trigger": write_with_trigger,
        "one statement": write_in_one_statement,
        "publish()": write_with_publish,
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
            for n in range(200):  # warm up plans and caches
                await write_baseline(conn, ids[0], n)
                await write_with_trigger(conn, ids[0], n)
                await write_in_one_statement(conn, ids[0], n)
                await write_with_publish(conn, ids[0], n)
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
        f"result: a write that publishes its entry costs {single['trigger'] / base:.2f}x a plain "
        f"write through the table's trigger and {single['one statement'] / base:.2f}x in one "
        f"statement (target <= 1.3x); a separate publish() call {single['publish()'] / base:.2f}x "
        f"(one more round trip); publish_many {rates['publish_many'] / plain:.2f}x executemany "
        "(target >= 0.7x)"
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
