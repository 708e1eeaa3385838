"""A database outage costs no bootstrap: 200 listeners that reconnect while PostgreSQL is
down for 10 s all resume once it is back, and none loses or repeats an item.

The publisher (the example API on uvicorn) cannot ask the feed whether a
cursor is still held while the database is down, so it answers every
registration with ``since`` with ``unavailable`` (4010) and a
``retryAfter``, never ``resumed: false``. The listeners (real ``Listener``s,
200 of them in a process of their own, connected through a TCP proxy that
drops all their connections at once) keep their cursors, back off at least
that long, and register again until the database is back; then every one
resumes. Checked from both ends: each listener's ids and status, and the
publisher's ``/metrics`` (registrations by ``resumed``, refusals by code).
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
import time
from pathlib import Path
from typing import Any

import asyncpg
import httpx
import orjson
import pytest
from helpers import metric_value
from test_listener_support import Proxy, VmApiServer

from changefeed.embedded import EmbeddedPostgres

CHILD = Path(__file__).with_name("outage_listeners.py")
LISTENERS = 200
OUTAGE = 10.0

pytestmark = pytest.mark.slow


async def publish(dsn: str, ids: list[str]) -> None:
    """One feed entry per id, each in its own transaction (as API writes are)."""
    conn = await asyncpg.connect(dsn, timeout=10)
    try:
        for rid in ids:
            await conn.execute("SELECT changefeed.publish('vm', ARRAY[]::text[], $1)", rid)
    finally:
        await conn.close()


class Listeners:
    """The child process and its JSON lines."""

    def __init__(self, process: asyncio.subprocess.Process) -> None:
        self.process = process

    async def line(self, timeout: float) -> dict[str, Any]:
        assert self.process.stdout is not None
        async with asyncio.timeout(timeout):
            raw = await self.process.stdout.readline()
        if not raw:
            raise AssertionError("the listeners' process exited")
        doc: dict[str, Any] = orjson.loads(raw)
        return doc

    async def report(self) -> list[dict[str, Any]]:
        assert self.process.stdin is not None
        self.process.stdin.write(b"report\n")
        await self.process.stdin.drain()
        doc = await self.line(30)
        assert doc["event"] == "report"
        listeners: list[dict[str, Any]] = doc["listeners"]
        return listeners

    async def wait_for(self, ids: list[str], timeout: float, what: str) -> list[dict[str, Any]]:
        """Reports until every listener was handed at least ``ids``' count of items."""
        deadline = time.monotonic() + timeout
        while True:
            listeners = await self.report()
            if all(len(li["ids"]) >= len(ids) for li in listeners):
                return listeners
            if time.monotonic() > deadline:
                behind = [li for li in listeners if len(li["ids"]) < len(ids)]
                raise AssertionError(f"{what}: {len(behind)} listeners behind, e.g. {behind[:2]}")
            await asyncio.sleep(0.5)


async def test_listeners_reconnecting_during_a_database_outage_all_resume(
    dsn: str, restartable_pg_server: EmbeddedPostgres
) -> None:
    pg = restartable_pg_server
    async with contextlib.AsyncExitStack() as stack:
        # max_connections above 200 listeners plus the reconnections in flight.
        api = await stack.enter_async_context(VmApiServer(dsn, max_connections=1000))
        proxy = await stack.enter_async_context(Proxy(api.port or 0))
        client = await stack.enter_async_context(httpx.AsyncClient(base_url=api.url, timeout=10))
        process = await asyncio.create_subprocess_exec(
            sys.executable,
            str(CHILD),
            proxy.ws_url,
            str(LISTENERS),
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            limit=2**24,  # a report holds every listener's ids on one line
        )
        try:
            listeners = Listeners(process)
            assert (await listeners.line(120))["event"] == "ready"
            before = [f"before-{n}" for n in range(10)]
            await publish(dsn, before)
            await listeners.wait_for(before, 60, "before the outage")
            # Written as the database goes down: delivered before or after, never twice.
            edge = [f"edge-{n}" for n in range(5)]
            await publish(dsn, edge)
            await asyncio.to_thread(pg.stop)
            down = time.monotonic()
            proxy.cut()  # every listener reconnects while the database is down
            await asyncio.sleep(OUTAGE)
            metrics = (await client.get("/metrics")).text
            refused = metric_value(
                metrics, "changefeed_refusals_total", code="unavailable", endpoint="websocket"
            )
            await asyncio.to_thread(pg.start)
            outage = time.monotonic() - down
            after = [f"after-{n}" for n in range(10)]
            await publish(dsn, after)
            expected = before + edge + after
            reports = await listeners.wait_for(expected, 120, "after the outage")
            metrics = (await client.get("/metrics")).text
        finally:
            if process.stdin is not None:
                process.stdin.close()
            try:
                await asyncio.wait_for(process.wait(), 30)
            except TimeoutError:
                process.kill()
                await process.wait()
    assert outage >= OUTAGE
    # While the database was down, registrations with a cursor were turned away (4010).
    assert refused >= LISTENERS
    for report in reports:
        assert report["ids"] == expected  # nothing lost, nothing repeated, in feed order
        assert report["bootstraps"] == 1  # the first start's, none after the outage
        assert report["resumes"] >= 1 and report["not_resumed"] == {}
        assert report["state"] == "live"
    resumed = metric_value(metrics, "changefeed_registrations_total", resource="vm", resumed="true")
    fresh = metric_value(metrics, "changefeed_registrations_total", resource="vm", resumed="false")
    assert fresh == LISTENERS  # one bootstrap each, at the start
    assert resumed >= LISTENERS
