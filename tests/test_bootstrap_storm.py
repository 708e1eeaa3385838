"""Issue 5's storm: 500 listeners re-bootstrap at once against the example VM API.

500 Pagers (standing in for 500 listeners re-bootstrapping after a publisher
restart) walk ``GET /vms`` at the same moment, with admission control on.
The test prints a timeline of the walks admitted over time, checks that
every walk completes with the full data, and compares the p99 latency of
ordinary API requests (``GET /vms/{uuid}``) before and during the storm.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import ssl
import time
from typing import Any

import asyncpg
import httpx
from servers import serve_app

from changefeed.bootstrap import Admission, Pager
from changefeed.example.vmapi import create_app

WALKERS = 500
VMS = 1000
PAGE = 200
MAX_WALKS = 25
BASELINE_REQUESTS = 100


def quantile(latencies: list[float], q: float) -> float:
    ordered = sorted(latencies)
    return ordered[min(len(ordered) - 1, int(len(ordered) * q))]


def p99(latencies: list[float]) -> float:
    return quantile(latencies, 0.99)


def summary(latencies: list[float]) -> str:
    return " ".join(
        f"{name} {quantile(latencies, q) * 1000:.0f}"
        for name, q in (("p50", 0.5), ("p90", 0.9), ("p99", 0.99), ("max", 1.0))
    )


async def test_storm_of_500_walkers(dsn: str) -> None:
    admission = Admission(max_walks=MAX_WALKS, max_queries=4, queue_timeout=2.0, retry_after=1)
    app = create_app(dsn, admission=admission, pool_size=10, poll_interval=0.05)
    # Each walker has its own client, as each listener would: one httpx client
    # shared by 500 concurrent requests spends its time in httpcore's pool
    # bookkeeping (quadratic in connections x requests), not on the network.
    # They share one TLS context only to skip loading the CA bundle 500 times.
    tls = ssl.create_default_context()
    async with (
        serve_app(app, backlog=2048) as server,
        httpx.AsyncClient(base_url=server.url, timeout=30.0) as probe_client,
        contextlib.AsyncExitStack() as stack,
    ):
        conn = await asyncpg.connect(dsn)
        try:
            await conn.execute(
                "INSERT INTO vmapi.vms (uuid, alias, nics)"
                " SELECT gen_random_uuid(), 'vm-' || i, '[{\"ip\": \"10.1.2.3\"}]'"
                " FROM generate_series(1, $1) AS i",
                VMS,
            )
            ids = [
                str(r["uuid"]) for r in await conn.fetch("SELECT uuid FROM vmapi.vms ORDER BY 1")
            ]
        finally:
            await conn.close()
        expected = hashlib.sha256("".join(ids).encode()).hexdigest()

        async def probe() -> float:
            started = time.perf_counter()
            response = await probe_client.get(f"/vms/{ids[len(ids) // 2]}")
            assert response.status_code == 200
            return time.perf_counter() - started

        before = [await probe() for _ in range(BASELINE_REQUESTS)]

        # The listeners' clients exist before the storm (their processes were
        # running); building 500 of them is test-harness work, not server load.
        clients = [
            await stack.enter_async_context(
                httpx.AsyncClient(base_url=server.url, verify=tls, timeout=30.0)
            )
            for _ in range(WALKERS)
        ]

        async def walk(client: httpx.AsyncClient) -> tuple[int, str]:
            digest = hashlib.sha256()
            count = 0
            async for vm in Pager(client, "/vms", limit=PAGE, max_wait=120.0):
                digest.update(vm["uuid"].encode())
                count += 1
            return count, digest.hexdigest()

        storm_started = time.monotonic()
        timeline: list[dict[str, Any]] = []
        storm = asyncio.gather(*(walk(client) for client in clients))

        async def sample() -> None:
            # Observation only (nothing waits on it): one snapshot a second.
            while not storm.done():
                stats = admission.stats()
                timeline.append({"t": time.monotonic() - storm_started, **stats})
                await asyncio.sleep(1.0)

        sampler = asyncio.create_task(sample())
        during: list[float] = []
        when: list[float] = []
        try:
            while not storm.done() and len(during) < 100_000:
                when.append(time.monotonic() - storm_started)
                during.append(await probe())
            results = await asyncio.wait_for(storm, 180)
            elapsed = time.monotonic() - storm_started
            await asyncio.wait_for(sampler, 5)
        finally:
            storm.cancel()
            sampler.cancel()
            await asyncio.gather(storm, sampler, return_exceptions=True)

    print(f"\nstorm: {WALKERS} walks of {VMS} VMs (pages of {PAGE}) in {elapsed:.1f}s")
    print("    t  active  started  finished  pages  refused")
    for snap in timeline:
        print(
            f"{snap['t']:5.1f}  {snap['walksActive']:6d}  {snap['walksStarted']:7d}"
            f"  {snap['walksFinished']:8d}  {snap['pagesServed']:5d}  {snap['pagesRefused']:7d}"
        )
    stats = admission.stats()
    print(f"final: {stats}")
    print(
        f"GET /vms/{{uuid}} p99: before {p99(before) * 1000:.1f} ms ({len(before)} requests),"
        f" during {p99(during) * 1000:.1f} ms ({len(during)} requests)"
    )
    print(f"  before (ms): {summary(before)}")
    print(f"  during (ms): {summary(during)}")
    slowest = sorted(zip(during, when, strict=True), reverse=True)[:5]
    print("  slowest during: " + ", ".join(f"{d * 1000:.0f} ms at t={t:.1f}s" for d, t in slowest))

    assert all(result == (VMS, expected) for result in results)  # complete, in order, once each
    assert stats["walksFinished"] == WALKERS and stats["walksActive"] == 0
    assert max(snap["walksActive"] for snap in timeline) <= MAX_WALKS
    assert stats["pagesRefused"] > 0  # admission control really turned walks away
    assert len(during) >= 20
    assert p99(during) < 1.0
