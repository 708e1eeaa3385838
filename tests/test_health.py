"""Health and drain: ``/healthz``, ``/readyz``, and what SIGTERM does to a publisher process.

* ``/healthz`` answers while the process is alive, whatever the database does
  (liveness must never restart every instance during a database outage).
* ``/readyz`` is 200 only while the tailer is connected *and* reading: a
  tailer whose query is blocked (here: a real ACCESS EXCLUSIVE lock on the
  feed table) is "stuck", and an instance without its database is not ready.
* SIGTERM to ``changefeed serve``: the listening socket closes first, every
  listener gets close code 1001 ("going away": register elsewhere), and the
  process exits within drain_grace + uvicorn's 10 s shutdown, even when a
  listener never reads its socket again.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import os
import signal
import struct
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import asyncpg
import httpx
import orjson
import pytest
from helpers import free_port, wait_until
from servers import serve_app
from test_deploy_support import ChangefeedServer, stopping, toml_document
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed

from changefeed.embedded import EmbeddedPostgres
from changefeed.example.vmapi import create_app

REGISTRATION = {
    "instance": "",
    "service": "health",
    "changeKind": {"resource": "vm", "subResources": []},
}
UVICORN_SHUTDOWN = 10.0  # changefeed.serving.server_config: timeout_graceful_shutdown


def registration() -> str:
    return orjson.dumps({**REGISTRATION, "instance": str(uuid.uuid4())}).decode()


async def status(client: httpx.AsyncClient, path: str) -> tuple[int, dict[str, Any]]:
    response = await client.get(path)
    body: dict[str, Any] = response.json()
    return response.status_code, body


@contextlib.asynccontextmanager
async def vm_api(dsn: str) -> AsyncIterator[httpx.AsyncClient]:
    app = create_app(dsn, poll_interval=0.05, retention=False)
    async with serve_app(app) as server, httpx.AsyncClient(base_url=server.url, timeout=5) as c:
        await asyncio.wait_for(app.state.publisher.tailer.ready.wait(), 15)
        yield c


async def test_readyz_reports_a_stuck_tailer(dsn: str) -> None:
    async with vm_api(dsn) as client:
        await wait_until(lambda: _ready(client), 10, message="ready at start")
        locker = await asyncpg.connect(dsn)
        try:
            # A migration or VACUUM FULL holding the feed: the tailer's next read waits.
            transaction = locker.transaction()
            await transaction.start()
            await locker.execute("LOCK TABLE changefeed.feed IN ACCESS EXCLUSIVE MODE")
            code, body = 0, dict[str, Any]()

            async def not_ready() -> bool:
                nonlocal code, body
                code, body = await status(client, "/readyz")
                return code == 503

            await wait_until(not_ready, 15, interval=0.1, message="readyz 503 while stuck")
            assert body["stuck"] is True and body["tailer"] == "running", body
            assert body["lastReadSecondsAgo"] > 5.0, body
            assert (await status(client, "/healthz"))[0] == 200
            await transaction.rollback()
        finally:
            await locker.close()
        await wait_until(lambda: _ready(client), 10, message="ready once the lock is gone")


async def _ready(client: httpx.AsyncClient) -> bool:
    code, body = await status(client, "/readyz")
    return code == 200 and body["stuck"] is False


async def test_readyz_follows_the_database(
    dsn: str, restartable_pg_server: EmbeddedPostgres
) -> None:
    pg = restartable_pg_server
    async with vm_api(dsn) as client:
        await wait_until(lambda: _ready(client), 10, message="ready at start")
        await asyncio.to_thread(pg.stop)
        try:

            async def not_ready() -> bool:
                return (await status(client, "/readyz"))[0] == 503

            await wait_until(not_ready, 15, interval=0.1, message="readyz 503 without database")
            _, body = await status(client, "/readyz")
            assert body["tailer"] in ("reconnecting", "unavailable"), body
            assert body["lastError"], body
            assert (await status(client, "/healthz")) == (200, {"status": "ok"})
        finally:
            await asyncio.to_thread(pg.start)
        await wait_until(lambda: _ready(client), 20, message="ready once the database is back")


# -- SIGTERM ---------------------------------------------------------------------------


def serve_config(path: Path, dsn: str, port: int, drain_grace: str) -> Path:
    path.write_text(
        toml_document(
            {"dsn": dsn, "poll_interval": "100ms"},
            [{"name": "vm", "sub_resources": ["nic", "alias"], "bootstrap_route": "/vms"}],
            {"port": port, "drain_grace": drain_grace},
        )
    )
    return path


async def register(url: str) -> ClientConnection:
    ws = await connect(url, open_timeout=5)
    await ws.send(registration())
    ack = orjson.loads(await asyncio.wait_for(ws.recv(), 5))
    assert ack["resumed"] is False, ack
    return ws


async def closed_with(ws: ClientConnection, timeout: float) -> tuple[int | None, float]:
    """Read until the publisher closes; the close code and when it came."""
    with contextlib.suppress(ConnectionClosed):
        async with asyncio.timeout(timeout):
            async for _ in ws:
                pass
    return ws.close_code, time.monotonic()


async def deaf_listener(port: int) -> asyncio.StreamWriter:
    """A listener that registers and then never reads its socket again: it will
    never answer the publisher's close frame (a hung process, a full buffer)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    key = base64.b64encode(os.urandom(16)).decode()
    writer.write(
        (
            f"GET /changefeeds HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nUpgrade: websocket\r\n"
            f"Connection: Upgrade\r\nSec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n\r\n"
        ).encode()
    )
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
    assert head.startswith(b"HTTP/1.1 101"), head
    payload = registration().encode()
    mask = os.urandom(4)
    masked = bytes(b ^ mask[i % 4] for i, b in enumerate(payload))
    size = len(payload)
    length = bytes([0x80 | size]) if size < 126 else bytes([0x80 | 126]) + struct.pack(">H", size)
    writer.write(b"\x81" + length + mask + masked)  # FIN + text, masked as a client must
    await writer.drain()
    return writer


async def test_sigterm_closes_listeners_with_1001_and_exits(dsn: str, tmp_path: Path) -> None:
    port = free_port()
    config = serve_config(tmp_path / "changefeed.toml", dsn, port, "5s")
    publisher = ChangefeedServer.standalone("serve", config, port, tmp_path)
    async with stopping(publisher):
        publisher.start()
        await publisher.wait_ready()
        sockets = [await register(publisher.ws_url) for _ in range(3)]
        await wait_until(lambda: _listeners(publisher, 3), 10, message="three listeners registered")
        sent = time.monotonic()
        publisher.send(signal.SIGTERM)
        ends = await asyncio.gather(*(closed_with(ws, 10) for ws in sockets))
        assert [code for code, _ in ends] == [1001, 1001, 1001]
        closed_after = max(at for _, at in ends) - sent
        assert closed_after < 2.0, f"listeners closed {closed_after:.2f}s after SIGTERM"
        # Stopped accepting before the listeners were told to go elsewhere.
        with pytest.raises(OSError):
            await connect(publisher.ws_url, open_timeout=2)
        status_code = await publisher.wait_exit(5.0 + UVICORN_SHUTDOWN + 5)
        exited_after = time.monotonic() - sent
        # A drained SIGTERM is a clean stop: status 0, not uvicorn's re-raised signal.
        assert status_code == 0, publisher.log()
        assert exited_after < 5.0, f"exit {exited_after:.2f}s after SIGTERM"
        log = publisher.log()
        assert '"event":"publisher.draining"' in log and "Traceback" not in log


async def test_sigterm_exit_is_bounded_when_a_listener_never_reads(
    dsn: str, tmp_path: Path
) -> None:
    port = free_port()
    config = serve_config(tmp_path / "changefeed.toml", dsn, port, "1s")
    publisher = ChangefeedServer.standalone("serve", config, port, tmp_path)
    deaf: asyncio.StreamWriter | None = None
    async with stopping(publisher):
        publisher.start()
        await publisher.wait_ready()
        deaf = await deaf_listener(port)
        polite = await register(publisher.ws_url)
        try:
            await wait_until(lambda: _listeners(publisher, 2), 10, message="two listeners")
            sent = time.monotonic()
            publisher.send(signal.SIGTERM)
            code, at = await closed_with(polite, 10)
            assert code == 1001 and at - sent < 2.0
            bound = 1.0 + UVICORN_SHUTDOWN + 4.0
            status_code = await publisher.wait_exit(bound)
            assert status_code == 0, publisher.log()
            print(f"\nexit {time.monotonic() - sent:.2f}s after SIGTERM with a deaf listener")
        finally:
            deaf.close()


async def _listeners(publisher: ChangefeedServer, count: int) -> bool:
    return bool((await publisher.stats())["listeners"] == count)
