"""Bootstrap walks: page latency by depth, and items/s beside a raw server-side cursor.

    python bench/bootstrap.py [--dsn DSN] [--rows 1000000] [--page 100] [--walk-limits 1000,5000]

Two measurements against the example VM API (``changefeed.example.vmapi``),
served by uvicorn in a child process (uvloop/httptools when installed, as in
production) over ``--rows`` VMs:

* **page latency by depth**: the same ``GET /vms?limit=<page>&after=...``
  request at depth 1 (the first page) and at depth 1,000 (the 1,000th page,
  reached by following ``next``), ``--samples`` times each, interleaved. Keyset
  pagination should make them cost the same: target p50 ratio <= 1.5
  (OFFSET would make page 1,000 scan 100,000 rows first).
* **walk throughput**: items/s of a ``Pager`` walking every VM through the
  HTTP route, beside a raw asyncpg server-side cursor streaming
  ``SELECT uuid, alias, nics FROM vmapi.vms ORDER BY uuid`` in this process
  (the floor: no HTTP, no JSON). Target: route >= 0.5x raw. Median of ``--rounds``,
  for each page size in ``--walk-limits`` (the raw cursor prefetches as many
  rows): 5,000 is what a listener asks for (``ListenerConfig.page_limit``).
  Both run on uvloop when it is installed, like the server, and the API runs
  as ``changefeed example-api`` does (collector tuned once started). CPU
  microseconds per item of this process and of the API process are printed
  too: on a busy machine they are steadier than wall-clock rates. Each HTTP
  request costs a few milliseconds of fixed work at both ends, so bigger pages
  walk faster; the VM API's ``max_limit`` is raised for the bench.

Without ``--dsn`` an embedded PostgreSQL is started (changefeed.embedded).
With ``--dsn`` (a server the user may create databases on) the bench creates
its own database ``changefeed_bench_<hex>`` there and drops it at the end.
The default is the issue's 1,000,000 VMs (about a minute in all); ``--quick``
takes 100,000.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import multiprocessing
import os
import statistics
import time
import uuid
from collections.abc import AsyncIterator
from urllib.parse import urlsplit, urlunsplit

import asyncpg
import httpx
from common import cpu_seconds, database, free_port, percentile, say

from changefeed.bootstrap import Admission, Pager
from changefeed.example.vmapi import create_app, ensure_schema
from changefeed.listener import ListenerConfig
from changefeed.serving import DrainingServer, server_config

DEPTH = 1000
LISTENER_PAGE = ListenerConfig().page_limit
MAX_LIMIT = 10_000  # the VM API's default is 1,000; the bench lets --walk-limit go higher
FILL_CHUNK = 100_000
RAW_SQL = "SELECT uuid, alias, nics FROM vmapi.vms ORDER BY uuid"


def with_database(dsn: str, name: str) -> str:
    return urlunsplit(urlsplit(dsn)._replace(path="/" + name))


@contextlib.asynccontextmanager
async def scratch_database(server_dsn: str) -> AsyncIterator[str]:
    """A fresh database on ``server_dsn``'s server, dropped on exit."""
    name = f"changefeed_bench_{uuid.uuid4().hex[:12]}"
    admin = await asyncpg.connect(server_dsn)
    try:
        await admin.execute(f'CREATE DATABASE "{name}"')
    finally:
        await admin.close()
    try:
        yield with_database(server_dsn, name)
    finally:
        admin = await asyncpg.connect(server_dsn)
        try:
            await admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        finally:
            await admin.close()


async def fill(dsn: str, rows: int) -> None:
    conn = await asyncpg.connect(dsn)
    try:
        await ensure_schema(conn)
        started = time.monotonic()
        for low in range(0, rows, FILL_CHUNK):
            high = min(rows, low + FILL_CHUNK)
            await conn.execute(
                "INSERT INTO vmapi.vms (uuid, alias, nics)"
                " SELECT gen_random_uuid(), 'vm-' || i, jsonb_build_array("
                "  jsonb_build_object('ip', '10.' || (i / 65536) || '.' || (i / 256 % 256)"
                "   || '.' || (i % 256)))"
                " FROM generate_series($1::int, $2::int) AS i",
                low + 1,
                high,
            )
        await conn.execute("VACUUM (ANALYZE) vmapi.vms")
        say(f"filled {rows:,} VMs in {time.monotonic() - started:.1f}s")
    finally:
        await conn.close()


def _serve(dsn: str, port: int) -> None:
    """Child process: the VM API on uvicorn until SIGTERM."""
    app = create_app(dsn, admission=Admission(max_walks=None), max_limit=MAX_LIMIT)
    # Served as ``changefeed example-api`` serves it (collector tuned once started).
    DrainingServer(
        server_config(app, "127.0.0.1", port, fast_path=True), [], owns_process=True
    ).run()


@contextlib.asynccontextmanager
async def vm_api(dsn: str) -> AsyncIterator[tuple[str, int]]:
    """The VM API in a child process; yields its base URL and pid."""
    port = free_port()
    process = multiprocessing.get_context("spawn").Process(
        target=_serve, args=(dsn, port), name="vmapi-bench", daemon=True
    )
    process.start()
    url = f"http://127.0.0.1:{port}"
    try:
        async with httpx.AsyncClient(base_url=url) as client, asyncio.timeout(60):
            while True:
                if not process.is_alive():
                    raise RuntimeError("the VM API process exited during start-up")
                with contextlib.suppress(httpx.TransportError):
                    if (await client.get("/healthz")).status_code == 200:
                        break
                await asyncio.sleep(0.1)  # polling a child process's start-up, bounded above
        assert process.pid is not None
        yield url, process.pid
    finally:
        process.terminate()
        process.join(15)
        if process.is_alive():
            process.kill()
            process.join(5)


async def page_latency(url: str, page: int, samples: int) -> None:
    async with httpx.AsyncClient(base_url=url, timeout=30.0) as client:
        first = f"/vms?limit={page}"
        link: str | None = first
        depth = 0
        deep = first
        while link is not None and depth < DEPTH:
            response = await client.get(link)
            response.raise_for_status()
            depth += 1
            deep = link
            link = response.json()["next"]
        if depth < DEPTH:
            say(f"(only {depth} pages of {page}: measuring the deepest one)")
        timings: dict[str, list[float]] = {first: [], deep: []}
        for _ in range(10):  # warm both paths up (connections, statement caches)
            for target in timings:
                await client.get(target)
        for _ in range(samples):
            for target, values in timings.items():
                started = time.perf_counter()
                response = await client.get(target)
                values.append(time.perf_counter() - started)
                assert response.status_code == 200
        shallow = sorted(timings[first])
        deepest = sorted(timings[deep])
    ratio = percentile(deepest, 0.5) / percentile(shallow, 0.5)
    for label, values in (("depth 1", shallow), (f"depth {depth:,}", deepest)):
        say(
            f"  page latency {label:>12}: p50 {percentile(values, 0.5) * 1000:6.2f} ms"
            f"  p90 {percentile(values, 0.9) * 1000:6.2f} ms  ({page} items per page)"
        )
    verdict = "ok" if ratio <= 1.5 else "MISSED"
    say(f"  ratio depth {depth:,} / depth 1 (p50): {ratio:.2f}  (target <= 1.5: {verdict})")


async def walk_route(url: str, limit: int) -> tuple[int, float]:
    async with httpx.AsyncClient(base_url=url, timeout=60.0) as client:
        pager = Pager(client, "/vms", limit=limit)
        started = time.perf_counter()
        count = 0
        async for page in pager.pages():
            count += len(page)
        return count, time.perf_counter() - started


async def walk_raw(dsn: str, prefetch: int) -> tuple[int, float]:
    conn = await asyncpg.connect(dsn)
    try:
        started = time.perf_counter()
        count = 0
        async with conn.transaction():
            async for _ in conn.cursor(RAW_SQL, prefetch=prefetch):
                count += 1
        return count, time.perf_counter() - started
    finally:
        await conn.close()


async def throughput(url: str, server_pid: int, dsn: str, limit: int, rounds: int) -> None:
    route: list[float] = []
    raw: list[float] = []
    route_cpu: list[tuple[float, float]] = []
    raw_cpu: list[float] = []
    for _ in range(rounds):
        before = cpu_seconds()
        count, seconds = await walk_raw(dsn, limit)
        raw_cpu.append((cpu_seconds() - before) / count * 1e6)
        raw.append(count / seconds)
        before, server_before = cpu_seconds(), cpu_seconds(server_pid)
        walked, seconds = await walk_route(url, limit)
        route_cpu.append(
            (
                (cpu_seconds() - before) / walked * 1e6,
                (cpu_seconds(server_pid) - server_before) / walked * 1e6,
            )
        )
        assert walked == count, (walked, count)
        route.append(walked / seconds)
    route_rate, raw_rate = statistics.median(route), statistics.median(raw)
    client_us = statistics.median(c for c, _ in route_cpu)
    server_us = statistics.median(s for _, s in route_cpu)
    say(
        f"  raw server-side cursor: {raw_rate:12,.0f} items/s  (prefetch {limit});"
        f" client CPU {statistics.median(raw_cpu):.1f} us/item"
    )
    say(
        f"  GET /vms walk (Pager):  {route_rate:12,.0f} items/s  (limit {limit});"
        f" client CPU {client_us:.1f} us/item, API process {server_us:.1f} us/item"
    )
    ratio = route_rate / raw_rate
    verdict = "ok" if ratio >= 0.5 else "MISSED"
    if limit != LISTENER_PAGE:
        verdict += f"; for comparison: listeners ask for pages of {LISTENER_PAGE:,}"
    say(f"  ratio route / raw: {ratio:.2f}  (target >= 0.5: {verdict})")
    say("  (PostgreSQL's own CPU is not counted in either; both walks read the same rows)")


async def main(args: argparse.Namespace) -> None:
    with database(args.dsn) as server_dsn:
        async with scratch_database(server_dsn) as dsn:
            await fill(dsn, args.rows)
            async with vm_api(dsn) as (url, pid):
                say(f"bootstrap bench: {args.rows:,} VMs, VM API at {url} (child process)")
                say(f"  load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
                await page_latency(url, args.page, args.samples)
                for limit in args.walk_limits:
                    await throughput(url, pid, dsn, limit, args.rounds)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--dsn", help="PostgreSQL server DSN (default: an embedded server)")
    parser.add_argument("--rows", type=int, default=1_000_000, help="VMs to create")
    parser.add_argument("--quick", action="store_true", help="100,000 VMs, one round")
    parser.add_argument("--page", type=int, default=100, help="page size of the depth test")
    parser.add_argument("--samples", type=int, default=300, help="requests per depth")
    parser.add_argument(
        "--walk-limits",
        type=lambda text: [int(v) for v in text.split(",")],
        default=[5000, 1000],
        help="page sizes of the walk, comma-separated (at most 10000)",
    )
    parser.add_argument("--rounds", type=int, default=3, help="walks to take the median of")
    return parser.parse_args()


def run(args: argparse.Namespace) -> None:
    if args.quick:
        args.rows, args.rounds, args.samples = min(args.rows, 100_000), 1, 100
    try:
        import uvloop  # the client side gets the loop the server has
    except ImportError:  # pragma: no cover
        asyncio.run(main(args))
    else:
        uvloop.run(main(args))


if __name__ == "__main__":
    run(parse_args())
