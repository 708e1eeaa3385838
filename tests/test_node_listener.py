"""Joyent's own listener, node-sdc-changefeed 1.5.2 (npm ``changefeed``), against the
example API's publisher on a real uvicorn with the production server settings.

The listener runs unchanged, as Triton's services run it (tests/node/listener.js):
it checks the publisher's ``GET /changefeeds``, upgrades with its own websocket
client (watershed), registers the v1 way (one ``changeKind``) or the v2 way
(several ``resources``, answered with ``bootstrapRoutes``), and yields change
items. Every change it is registered for must reach it exactly once, in the
feed's order.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import random
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

import asyncpg
import httpx
import pytest
from node_listener import NODE_MISSING, NodeListener
from servers import serve_app

from changefeed.example.vmapi import create_app
from changefeed.http_timeouts import head_timeout_protocol
from changefeed.publisher import publish_many
from changefeed.serving import FanoutWebSocketProtocol

pytestmark = pytest.mark.skipif(NODE_MISSING is not None, reason=str(NODE_MISSING))

Change = tuple[str, tuple[str, ...], str]
"""(resource, sorted sub-resources, changed resource id)"""

WAIT = 60.0


@contextlib.asynccontextmanager
async def example_api(dsn: str) -> AsyncIterator[tuple[str, httpx.AsyncClient]]:
    """The example API, served as changefeed.serving.server_config serves it."""
    app = create_app(dsn, poll_interval=0.05, retention=False)
    async with (
        serve_app(
            app,
            ws=FanoutWebSocketProtocol,
            ws_per_message_deflate=False,
            ws_max_size=1 << 20,
            http=head_timeout_protocol(),
        ) as server,
        httpx.AsyncClient(base_url=server.url, timeout=10) as client,
    ):
        await asyncio.wait_for(app.state.publisher.tailer.ready.wait(), 15)
        yield server.url, client


async def feed(dsn: str) -> list[Change]:
    """Every entry of the feed, in the order the publisher sends them."""
    conn = await asyncpg.connect(dsn)
    try:
        rows = await conn.fetch(
            "SELECT resource, sub_resources, changed_resource_id FROM changefeed.feed"
            " ORDER BY txid, id"
        )
    finally:
        await conn.close()
    return [
        (r["resource"], tuple(sorted(r["sub_resources"])), r["changed_resource_id"]) for r in rows
    ]


def received(listener: NodeListener) -> list[Change]:
    return [
        (
            item["changeKind"]["resource"],
            tuple(sorted(item["changeKind"]["subResources"])),
            item["changedResourceId"],
        )
        for item in listener.changes
    ]


async def concurrently(calls: Sequence[Callable[[], Awaitable[httpx.Response]]]) -> None:
    """Run the writes four at a time (their feed order is the database's, not ours)."""
    gate = asyncio.Semaphore(4)

    async def one(call: Callable[[], Awaitable[httpx.Response]]) -> None:
        async with gate:
            response = await call()
            assert response.status_code < 300, response.text

    await asyncio.gather(*(one(call) for call in calls))


async def test_v1_listener_gets_every_vm_change_once_in_feed_order(
    dsn: str, tmp_path: Path
) -> None:
    rng = random.Random(1)
    async with (
        example_api(dsn) as (url, client),
        NodeListener(url, {"vm": ["nic", "alias"]}, tmp_path / "node.log") as node,
    ):
        await node.wait_for(lambda n: bool(n.of("bootstrap")), WAIT, "the bootstrap event")
        (bootstrap,) = node.of("bootstrap")
        assert bootstrap["route"]["bootstrapRoute"] == "/vms"

        def create(n: int) -> Callable[[], Awaitable[httpx.Response]]:
            body = {"alias": f"vm-{n}", "nics": [{"ip": f"10.1.{n // 250}.{n % 250 + 1}"}]}
            return lambda: client.post("/vms", json=body)

        await concurrently([create(n) for n in range(120)])
        vms = [vm["uuid"] for vm in (await client.get("/vms?limit=500")).json()["items"]]
        patches: list[Callable[[], Awaitable[httpx.Response]]] = []
        for n in range(130):
            vm = rng.choice(vms)
            body: dict[str, Any] = (
                {"alias": f"renamed-{n}"} if n % 2 else {"nics": [{"ip": f"10.2.0.{n + 1}"}]}
            )
            patches.append(functools.partial(client.patch, f"/vms/{vm}", json=body))
        await concurrently(patches)
        doomed = vms[:50]
        await concurrently([functools.partial(client.delete, f"/vms/{vm}") for vm in doomed])

        expected = await feed(dsn)
        assert len(expected) == 300
        await node.wait_for(lambda n: len(n.changes) >= len(expected), WAIT, "300 changes")
        assert received(node) == expected  # each once, in feed order
        assert not node.of("error") and not node.of("connection-end"), node.events[-5:]


async def test_v2_listener_gets_every_vm_and_server_change_once_in_feed_order(
    dsn: str, tmp_path: Path
) -> None:
    rng = random.Random(2)
    resources = {"vm": ["nic", "alias", "server"], "server": ["hostname", "status", "ram"]}
    async with (
        example_api(dsn) as (url, client),
        NodeListener(url, resources, tmp_path / "node.log") as node,
    ):
        await node.wait_for(lambda n: len(n.of("bootstrap")) == 2, WAIT, "two bootstrap events")
        routes = {
            e["route"]["resource"]: e["route"]["bootstrapRoute"] for e in node.of("bootstrap")
        }
        assert routes == {"vm": "/vms", "server": "/servers"}

        servers = []
        for n in range(5):
            body = {"hostname": f"cn-{n}", "ram": 65536, "datacenter": "dc-1"}
            servers.append((await client.post("/servers", json=body)).json()["uuid"])

        def create(n: int) -> Callable[[], Awaitable[httpx.Response]]:
            body = {"alias": f"vm-{n}", "nics": [], "server_uuid": servers[n % 4]}
            return lambda: client.post("/vms", json=body)

        await concurrently([create(n) for n in range(60)])
        vms = [vm["uuid"] for vm in (await client.get("/vms?limit=500")).json()["items"]]
        writes: list[Callable[[], Awaitable[httpx.Response]]] = []
        for n in range(120):
            vm, server = rng.choice(vms), rng.choice(servers[:4])
            kind = n % 3
            if kind == 0:
                writes.append(
                    functools.partial(client.patch, f"/vms/{vm}", json={"alias": f"r{n}"})
                )
            elif kind == 1:
                body = {"server_uuid": server}
                writes.append(functools.partial(client.patch, f"/vms/{vm}", json=body))
            else:
                body = {"status": rng.choice(("running", "unavailable")), "ram": 65536 + n}
                writes.append(functools.partial(client.patch, f"/servers/{server}", json=body))
        await concurrently(writes)
        await concurrently([functools.partial(client.delete, f"/vms/{vm}") for vm in vms[:20]])
        assert (await client.delete(f"/servers/{servers[4]}")).status_code == 204  # hosts none

        expected = await feed(dsn)
        assert {change[0] for change in expected} == {"vm", "server"}
        await node.wait_for(
            lambda n: len(n.changes) >= len(expected), WAIT, f"{len(expected)} changes"
        )
        assert received(node) == expected  # each once, in feed order, both resources
        assert not node.of("error") and not node.of("connection-end"), node.events[-5:]


async def test_a_40000_entry_burst_never_cuts_joyents_listener_off(
    dsn: str, tmp_path: Path
) -> None:
    """One transaction of 40,000 entries: Joyent's listener, which cannot resume
    and would bootstrap again from scratch if it were cut off, reads it at its
    own pace and gets every item once, in feed order, on its first connection."""
    ids = [f"burst-{i:05d}" for i in range(40_000)]
    async with (
        example_api(dsn) as (url, client),
        NodeListener(url, {"vm": []}, tmp_path / "node.log") as node,
    ):
        await node.wait_for(lambda n: bool(n.of("bootstrap")), WAIT, "the bootstrap event")
        conn = await asyncpg.connect(dsn)
        try:
            async with conn.transaction():
                await publish_many(conn, [("vm", ["nic"], x) for x in ids])
        finally:
            await conn.close()
        await node.wait_for(lambda n: len(n.changes) >= len(ids), 180, "40,000 changes")
        assert [c["changedResourceId"] for c in node.changes] == ids
        assert not node.of("error") and not node.of("connection-end"), node.events[-5:]
        assert len(node.of("bootstrap")) == 1  # never registered again
        stats = (await client.get("/changefeeds/stats")).json()
        assert stats["counters"]["evictions"] == 0
