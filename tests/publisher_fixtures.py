"""A publisher embedded in a tiny Starlette app on a real uvicorn, and a raw websocket listener."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any

import asyncpg
import orjson
from helpers import wait_until
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


WS_PROTOCOLS: dict[str, type[asyncio.Protocol] | str] = {
    "direct": FanoutWebSocketProtocol,
    "asgi": "websockets-sansio",
}
"""uvicorn ``ws`` settings: changefeed's (direct frame writes, what ``changefeed serve``
runs) and uvicorn's own (every frame an ASGI send, as on any other server)."""


@contextlib.asynccontextmanager
async def running_publisher(
    dsn: str, *, ws: str = "direct", server: dict[str, Any] | None = None, **overrides: Any
) -> AsyncIterator[PublisherUnderTest]:
    """A publisher (``overrides``: PublisherConfig fields) on uvicorn (``server``:
    extra uvicorn.Config settings) on a free loopback port."""
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
    uvicorn_settings = {"ws": WS_PROTOCOLS[ws], "ws_per_message_deflate": False, **(server or {})}
    async with serve_app(app, **uvicorn_settings) as running:
        await asyncio.wait_for(publisher.tailer.ready.wait(), 10)
        yield PublisherUnderTest(running, publisher, dsn)


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


async def cursor_before(
    pub: PublisherUnderTest,
    missed: Sequence[tuple[str, Sequence[str], str]],
    subs: Sequence[str] = ("nic",),
) -> str:
    """A listener of ``vm`` (``subs``) sees one change and disconnects; then
    ``missed`` is written and tailed. Returns the cursor it would resume from."""
    tailed = pub.publisher.tailer.entries_total + 1 + len(missed)
    ws, _ = await register(pub.ws_url, registration(subs=subs))
    await write(pub.dsn, [("vm", subs, "before")])
    (seen,) = await receive_items(ws, 1)
    await ws.close()
    await write(pub.dsn, missed)
    await wait_until(lambda: pub.publisher.tailer.entries_total >= tailed, timeout=30)
    cursor: str = seen["cursor"]
    return cursor


async def connect_not_reading(url: str, **connect_kwargs: Any) -> ClientConnection:
    """A websocket client that stops reading its socket once one frame waits
    unread (max_queue=1), with a small receive buffer: the kernel absorbs
    little, so the publisher's sends to it soon block."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 16384)
    sock.setblocking(False)
    port = int(url.split(":")[2].split("/", maxsplit=1)[0])
    await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", port))
    return await connect(url, max_queue=1, sock=sock, compression=None, **connect_kwargs)
