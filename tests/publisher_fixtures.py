"""A publisher embedded in a tiny Starlette app on a real uvicorn, and a raw websocket listener."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any

import asyncpg
import orjson
from servers import RunningServer, serve_app
from starlette.applications import Starlette
from websockets.asyncio.client import ClientConnection, connect

from changefeed.publisher import Publisher, PublisherConfig, ResourceConfig, publish
from changefeed.serving import FanoutWebSocketProtocol

VM = ResourceConfig("vm", "/vms", ("nic", "alias"))
NETWORK = ResourceConfig("network", "/networks", ("subnet",))


@dataclass
class PublisherUnderTest:
    server: RunningServer
    publisher: Publisher
    dsn: str

    @property
    def ws_url(self) -> str:
        return self.server.ws_url + "/changefeeds"


WS_PROTOCOLS = {"direct": FanoutWebSocketProtocol, "asgi": "websockets-sansio"}
"""uvicorn ``ws`` settings: changefeed's (direct frame writes, what ``changefeed serve``
runs) and uvicorn's own (every frame an ASGI send, as on any other server)."""


@contextlib.asynccontextmanager
async def running_publisher(
    dsn: str, *, ws: str = "direct", **overrides: Any
) -> AsyncIterator[PublisherUnderTest]:
    settings: dict[str, Any] = {
        "dsn": dsn,
        "resources": (VM, NETWORK),
        "poll_interval": 0.2,
        "retention": False,
    }
    settings.update(overrides)
    publisher = Publisher(PublisherConfig(**settings))
    app = Starlette(routes=publisher.routes, lifespan=publisher.lifespan)
    # No per-message deflate, as in production (server_config): compressed frames
    # differ per connection, so a deflate connection never gets direct writes.
    async with serve_app(app, ws=WS_PROTOCOLS[ws], ws_per_message_deflate=False) as server:
        await asyncio.wait_for(publisher.tailer.ready.wait(), 10)
        yield PublisherUnderTest(server, publisher, dsn)


def registration(resource: str = "vm", subs: Sequence[str] = ("nic", "alias"), **extra: Any) -> str:
    doc: dict[str, Any] = {
        "instance": "de1aac97-6f85-4ba9-b51e-514f48a6a46c",
        "service": "tcns",
        "changeKind": {"resource": resource, "subResources": list(subs)},
    }
    doc.update(extra)
    return orjson.dumps(doc).decode()


async def register(
    url: str, frame: str, **connect_kwargs: Any
) -> tuple[ClientConnection, dict[str, Any]]:
    ws = await connect(url, open_timeout=10, **connect_kwargs)
    await ws.send(frame)
    ack = orjson.loads(await asyncio.wait_for(ws.recv(), 10))
    return ws, ack


async def receive_items(
    ws: ClientConnection, count: int, timeout: float = 10.0
) -> list[dict[str, Any]]:
    """Receive exactly ``count`` change items (unpacking batch frames)."""
    items: list[dict[str, Any]] = []
    async with asyncio.timeout(timeout):
        while len(items) < count:
            doc = orjson.loads(await ws.recv())
            items.extend(doc if isinstance(doc, list) else [doc])
    return items


async def write(dsn: str, entries: Sequence[tuple[str, Sequence[str], str]]) -> None:
    """Commit one transaction per entry, the way an API would."""
    conn = await asyncpg.connect(dsn)
    try:
        for resource, subs, changed_id in entries:
            async with conn.transaction():
                await publish(conn, resource, subs, changed_id)
    finally:
        await conn.close()
