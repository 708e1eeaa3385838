"""The request head's and body's deadlines (changefeed.http_timeouts) on real uvicorn
servers on 127.0.0.1, for both of uvicorn's HTTP protocols, with raw sockets.

Plain uvicorn never closes a connection that sends nothing or half a request
(half its head, or half its body): each of the tests of those fails without
the deadlines (the bounded wait for the server to close the socket runs out).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import orjson
import pytest
from helpers import LogRecords, free_port, wait_until
from servers import RunningServer, serve_app
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import PlainTextResponse
from starlette.routing import Route
from test_deploy_support import ChangefeedServer, stopping, toml_document
from websockets.asyncio.client import connect

from changefeed.example.vmapi import create_app
from changefeed.http_timeouts import (
    DEFAULT_HEAD_TIMEOUT,
    DEFAULT_MAX_HEAD_BYTES,
    LOG_BURST,
    head_timeout_protocol,
)
from changefeed.log_budget import LogBudget
from changefeed.publisher.config import ServerConfig

PROTOCOLS = ("httptools", "h11")
CLOSE_BOUND = 10.0
"""Seconds past the deadline allowed for the server to close a connection (a loaded machine)."""


async def echo(request: Request) -> PlainTextResponse:
    body = await request.body()
    return PlainTextResponse(f"{request.method} {len(body)}")


APP = Starlette(routes=[Route("/echo", echo, methods=["GET", "POST"])])


@contextlib.asynccontextmanager
async def serving(timeout: float, http: str) -> AsyncIterator[RunningServer]:
    async with serve_app(APP, http=head_timeout_protocol(timeout, http)) as server:
        yield server


async def closed_after(reader: asyncio.StreamReader, bound: float) -> tuple[bytes, float]:
    """Everything the server sends until it closes the connection, and when it closed."""
    started = time.monotonic()
    data = await asyncio.wait_for(reader.read(), bound)  # read() returns at EOF only
    return data, time.monotonic() - started


async def flood_until_closed(port: int, start: bytes, piece: bytes) -> tuple[bytes | None, int]:
    """Send ``start``, then ``piece`` again and again (up to 64 MiB) until the server
    closes: what it answered (None when the connection was reset before the
    answer could be read) and how many bytes were sent."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    sent = 0

    async def flood() -> None:
        nonlocal sent
        with contextlib.suppress(ConnectionError):
            while sent < 64 << 20:
                writer.write(piece)
                sent += len(piece)
                await writer.drain()

    writer.write(start)
    sent = len(start)
    flooding = asyncio.create_task(flood())
    try:
        data, _ = await closed_after(reader, CLOSE_BOUND)
        return data, sent
    except ConnectionResetError:
        return None, sent
    finally:
        flooding.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await flooding
        writer.close()


@pytest.mark.parametrize("http", PROTOCOLS)
async def test_a_connection_that_sends_nothing_is_closed(http: str) -> None:
    async with serving(0.5, http) as server:
        connecting = time.monotonic()  # the deadline starts once the server accepts
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        try:
            data, _ = await closed_after(reader, 0.5 + CLOSE_BOUND)
        finally:
            writer.close()
        after = time.monotonic() - connecting
        assert data == b""  # nothing asked, nothing answered
        assert after >= 0.45, f"closed after {after:.2f}s, before its deadline"


@pytest.mark.parametrize("http", PROTOCOLS)
@pytest.mark.parametrize("part", [b"GET /ec", b"GET /echo HTTP/1.1\r\nHost: x\r\nAccept: */"])
async def test_half_a_request_head_gets_408_and_is_closed(http: str, part: bytes) -> None:
    async with serving(0.5, http) as server:
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        try:
            writer.write(part)
            data, _ = await closed_after(reader, 0.5 + CLOSE_BOUND)
        finally:
            writer.close()
        assert data.startswith(b"HTTP/1.1 408 "), data


@pytest.mark.parametrize("http", PROTOCOLS)
async def test_the_next_request_on_a_kept_alive_connection_has_its_own_deadline(
    http: str,
) -> None:
    # Longer than the deadline, so that the keep-alive timer (5 s) is not what closes it.
    async with serve_app(
        APP, http=head_timeout_protocol(0.5, http), timeout_keep_alive=60
    ) as server:
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        try:
            writer.write(b"GET /echo HTTP/1.1\r\nHost: x\r\n\r\n")
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
            assert head.startswith(b"HTTP/1.1 200 ")
            assert await asyncio.wait_for(reader.readexactly(5), 10) == b"GET 0"
            writer.write(b"GET /echo HTTP/1.1\r\nHo")  # the next request, half sent
            data, _ = await closed_after(reader, 0.5 + CLOSE_BOUND)
        finally:
            writer.close()
        assert data.startswith(b"HTTP/1.1 408 "), data


@pytest.mark.parametrize("http", PROTOCOLS)
@pytest.mark.parametrize("where", ["header", "url"])
async def test_an_endless_request_head_gets_431_and_is_closed_at_its_size_limit(
    http: str, where: str
) -> None:
    """A peer sending one endless header (or request line) is answered once its head
    passes the limit, long before its deadline: the server stops parsing it. A head
    within the limit, and a body far larger, are served."""
    limit = 4096
    protocol = head_timeout_protocol(60.0, http, max_head_bytes=limit)
    async with serve_app(APP, http=protocol) as server:
        start = b"GET /echo HTTP/1.1\r\nHost: x\r\nX-Pad: " if where == "header" else b"GET /"
        data, sent = await flood_until_closed(server.port, start, b"a" * 1024)
        if data is None:
            # h11's own limit on an incomplete event (16 KiB) can come first, in the
            # same read: uvicorn then closes at once, and the peer's unread bytes
            # reset the connection before its 400 is read.
            assert http == "h11"
            data = b""
        if http == "h11" and not data.startswith(b"HTTP/1.1 431 "):
            assert data == b"" or data.startswith(b"HTTP/1.1 400 "), data
        else:
            assert data.startswith(b"HTTP/1.1 431 "), data
            assert data.endswith(b"the request line and headers are too large\n"), data
        assert sent < 16 << 20, f"{sent:,} bytes of head were read"
        async with httpx.AsyncClient(base_url=server.url, timeout=10) as client:
            fits = await client.get("/echo", headers={"X-Pad": "a" * (limit // 2)})
            assert fits.status_code == 200
            body = await client.post("/echo", content=b"b" * (1 << 20))
            assert body.text == f"POST {1 << 20}"


@pytest.mark.parametrize("http", PROTOCOLS)
@pytest.mark.parametrize("trailer", ["one-endless-value", "many-fields"])
async def test_endless_trailers_are_an_endless_head_and_get_431(http: str, trailer: str) -> None:
    """A chunked body's trailer section is header fields after the body: one that
    never ends is refused as an endless head is, long before the body's deadline
    (httptools alone parses it for as long as the deadline allows, holding the
    event loop and growing the process). A body sent in one-byte chunks is
    served."""
    limit = 4096
    protocol = head_timeout_protocol(60.0, http, max_head_bytes=limit)
    async with serve_app(APP, http=protocol) as server:
        start = b"POST /echo HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
        start += b"5\r\nhello\r\n0\r\n"
        if trailer == "one-endless-value":
            start, piece = start + b"X-Trailer: ", b"a" * 1024
        else:
            piece = b"X-T: a\r\n" * 128
        data, sent = await flood_until_closed(server.port, start, piece)
        assert data is not None or http == "h11"  # h11's own limit may reset it
        if http == "httptools":
            assert data is not None and data.startswith(b"HTTP/1.1 431 "), data
        assert sent < 16 << 20, f"{sent:,} bytes of trailers were read"
        async with httpx.AsyncClient(base_url=server.url, timeout=10) as client:

            async def one_byte_chunks() -> AsyncIterator[bytes]:
                for _ in range(20_000):
                    yield b"b"

            body = await client.post("/echo", content=one_byte_chunks())
            assert body.text == "POST 20000"


@pytest.mark.parametrize("http", PROTOCOLS)
async def test_a_request_body_that_stops_arriving_gets_408_and_is_closed(http: str) -> None:
    async with serving(0.5, http) as server:
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        try:
            writer.write(b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n")
            writer.write(b'{"alias"')  # 8 of its 100 bytes, and no more
            data, _ = await closed_after(reader, 0.5 + CLOSE_BOUND)
        finally:
            writer.close()
        assert data.startswith(b"HTTP/1.1 408 "), data
        assert data.endswith(b"the request body stopped arriving\n"), data


@pytest.mark.parametrize("http", PROTOCOLS)
async def test_a_slow_but_complete_request_is_served(http: str) -> None:
    # The head trickles in well within its deadline; the body takes longer than the
    # deadline in all, but no pause between two of its parts is that long.
    timeout = 3.0
    async with serving(timeout, http) as server:
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        try:
            for piece in (b"POST /ec", b"ho HTTP/1.1\r\nHost: x\r\n", b"Content-Length: 4\r\n\r\n"):
                writer.write(piece)
                await writer.drain()
                await asyncio.sleep(0.1)
            for byte in b"body":
                writer.write(bytes([byte]))
                await writer.drain()
                await asyncio.sleep(timeout / 3)
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
            assert head.startswith(b"HTTP/1.1 200 "), head
            assert await asyncio.wait_for(reader.readexactly(6), 10) == b"POST 4"
        finally:
            writer.close()
        async with httpx.AsyncClient(base_url=server.url) as client:  # keep-alive, many requests
            for _ in range(3):
                assert (await client.get("/echo")).text == "GET 0"


async def test_a_registered_websocket_is_never_closed_by_the_deadline(dsn: str) -> None:
    app = create_app(dsn, poll_interval=0.05)
    async with (
        serve_app(app, http=head_timeout_protocol(0.5)) as server,
        connect(f"{server.ws_url}/changefeeds", open_timeout=10) as ws,
    ):
        registration = {
            "instance": str(uuid.uuid4()),
            "service": "test",
            "changeKind": {"resource": "vm", "subResources": []},
        }
        await ws.send(orjson.dumps(registration).decode())
        ack = orjson.loads(await asyncio.wait_for(ws.recv(), 10))
        assert ack["bootstrapRoute"] == "/vms"
        # A silent connection accepted after the websocket is closed by its deadline:
        # the websocket's own would have passed by then, had it one.
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        try:
            assert (await closed_after(reader, 0.5 + CLOSE_BOUND))[0] == b""
        finally:
            writer.close()
        async with httpx.AsyncClient(base_url=server.url) as client:
            created = await client.post("/vms", json={"alias": "a", "nics": []})
        item = orjson.loads(await asyncio.wait_for(ws.recv(), 10))
        assert item["changedResourceId"] == created.json()["uuid"]


@pytest.mark.parametrize("http", PROTOCOLS)
async def test_many_idle_sockets_write_a_bounded_number_of_log_lines(http: str) -> None:
    """300 sockets that send nothing (half of them half a head) time out together: the
    first ``LOG_BURST`` are logged one by one, the rest are counted in one line at the
    end of the window, so the peers do not choose the log's volume (one line each, and
    a few more, before)."""
    sockets = 300
    timeouts = LogRecords()
    logger = logging.getLogger("changefeed.http_timeouts")
    logger.addHandler(timeouts)
    old_level, logger.level = logger.level, logging.INFO
    protocol = head_timeout_protocol(0.5, http, log_window=2.0)
    writers: list[asyncio.StreamWriter] = []
    try:
        async with serve_app(APP, http=protocol) as server:
            for n in range(sockets):
                _, writer = await asyncio.open_connection("127.0.0.1", server.port)
                if n % 2:
                    writer.write(b"GET /echo HTTP/1.1\r\nHost: x\r\n")
                writers.append(writer)

            def counted() -> tuple[list[logging.LogRecord], int]:
                lines = [r for r in timeouts.records if r.getMessage() == "http.head_timeout"]
                held = [r for r in timeouts.records if r.getMessage() == "http.timeouts_held"]
                total = sum(r.cf_fields["held"].get("http.head_timeout", 0) for r in held)  # type: ignore[attr-defined]
                return lines, len(lines) + total

            await wait_until(lambda: counted()[1] == sockets, timeout=30, message="all counted")
        lines, _ = counted()
        assert len(lines) == LOG_BURST
        assert len(timeouts.records) <= LOG_BURST + 2, [r.getMessage() for r in timeouts.records]
    finally:
        logger.removeHandler(timeouts)
        logger.level = old_level
        for writer in writers:
            writer.close()


async def test_changefeed_serve_takes_the_deadline_and_the_head_limit_from_its_config(
    feed_dsn: str, tmp_path: Path
) -> None:
    port = free_port()
    config = tmp_path / "changefeed.toml"
    config.write_text(
        toml_document(
            {"dsn": feed_dsn},
            [{"name": "vm", "bootstrap_route": "/vms"}],
            {"port": port, "header_timeout": "500ms", "header_max_bytes": 2048},
        )
    )
    publisher = ChangefeedServer.standalone("serve", config, port, tmp_path)
    async with stopping(publisher):
        publisher.start()
        await publisher.wait_ready()
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            writer.write(b"GET /readyz HTTP/1.1\r\n")
            data, _ = await closed_after(reader, 0.5 + CLOSE_BOUND)
        finally:
            writer.close()
        assert data.startswith(b"HTTP/1.1 408 "), data
        assert '"event":"http.head_timeout"' in publisher.log()
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            writer.write(b"GET /readyz HTTP/1.1\r\nHost: x\r\nX-Pad: " + b"a" * 4096)
            data, after = await closed_after(reader, CLOSE_BOUND)
        finally:
            writer.close()
        assert data.startswith(b"HTTP/1.1 431 "), data
        assert after < 0.5  # refused for its size, not at its deadline
        assert '"event":"http.head_too_large"' in publisher.log()


@contextlib.asynccontextmanager
async def example_api_connection(
    dsn: str, tmp_path: Path, header_timeout: str
) -> AsyncIterator[tuple[ChangefeedServer, asyncio.StreamReader, asyncio.StreamWriter]]:
    """``changefeed example-api --header-timeout ...``, ready, and a connection to it."""
    port = free_port()
    args = ["example-api", "--dsn", dsn, "--port", str(port), "--header-timeout", header_timeout]
    api = ChangefeedServer("example-api", args, port, tmp_path)
    async with stopping(api):
        api.start()
        await api.wait_ready()
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            yield api, reader, writer
        finally:
            writer.close()


async def test_changefeed_example_api_takes_the_deadline_from_its_flag(
    dsn: str, tmp_path: Path
) -> None:
    async with example_api_connection(dsn, tmp_path, "0.5") as (api, reader, _):
        data, _ = await closed_after(reader, 0.5 + CLOSE_BOUND)
        assert data == b""
        assert '"event":"serving.deadlines"' in api.log()  # the layer's verdict: it runs


async def test_a_write_whose_client_goes_away_mid_body_is_no_error(
    dsn: str, tmp_path: Path
) -> None:
    """Half a body, then the body deadline, from the flag (408): the write's read
    of its body ends with ClientDisconnect (as it does when the client closes
    mid-body), which is the client's doing, not the server's. It is logged as
    ``vmapi.client_gone``, never as an error with a traceback, and however many
    clients do it, at most ``GONE_LINES`` lines a window and one summary of the
    rest: any client could otherwise set the log's volume."""
    from changefeed.example.rest import GONE_LINES, GONE_WINDOW

    half = (
        b"POST /vms HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b'Content-Length: 100\r\n\r\n{"alias"'
    )
    clients = 3 * GONE_LINES
    async with example_api_connection(dsn, tmp_path, "0.5") as (api, reader, writer):
        others = [await asyncio.open_connection("127.0.0.1", api.port) for _ in range(clients - 1)]
        try:
            for _, sending in [(reader, writer), *others]:
                sending.write(half)
            closed = await asyncio.gather(
                *(closed_after(r, 0.5 + CLOSE_BOUND) for r, _ in [(reader, writer), *others])
            )
        finally:
            for _, other in others:
                other.close()
        for data, _ in closed:
            assert data.startswith(b"HTTP/1.1 408 "), data

        def logged() -> tuple[int, int]:
            """Clients gone: logged one by one, and counted in summaries."""
            events = [
                orjson.loads(line)
                for line in api.log(limit=1_000_000).splitlines()
                if line.startswith("{")
            ]
            one_by_one = sum(e.get("event") == "vmapi.client_gone" for e in events)
            held = sum(
                e["held"].get("vmapi.client_gone", 0)
                for e in events
                if e.get("event") == "vmapi.clients_gone_held"
            )
            return one_by_one, held

        # Every client is accounted for once its window's summary is out.
        await wait_until(
            lambda: sum(logged()) == clients,
            timeout=GONE_WINDOW + CLOSE_BOUND,
            message=f"{clients} clients gone, logged or counted\n{api.log()}",
        )
        one_by_one, held = logged()
        # They go within about a second, so within one window: GONE_LINES lines (that
        # many a window, should a slow machine spread them over two), the rest counted.
        assert GONE_LINES <= one_by_one < clients and held > 0, (one_by_one, held)
        log = api.log(limit=1_000_000)
        assert '"level":"error"' not in log, log
        assert "Traceback" not in log, log


async def test_a_header_timeout_of_0_turns_the_deadlines_off(dsn: str, tmp_path: Path) -> None:
    """For a server behind a proxy that bounds request heads itself: the layer is not
    installed at all (no verdict line; a 0 taken for the 15 s default would log
    one), and half a head, finished later, is answered."""
    async with example_api_connection(dsn, tmp_path, "0") as (api, reader, writer):
        writer.write(b"GET /readyz HTTP/1.1\r\n")
        await writer.drain()  # the half head goes out on its own
        writer.write(b"Host: x\r\n\r\n")
        async with asyncio.timeout(CLOSE_BOUND):
            head = await reader.readuntil(b"\r\n")
        assert head.startswith(b"HTTP/1.1 200 "), head
        assert '"event":"serving.deadlines"' not in api.log()
        assert "http.head_timeout" not in api.log()


def test_example_api_refuses_a_negative_header_timeout() -> None:
    refused = subprocess.run(
        [sys.executable, "-m", "changefeed.cli", "example-api", "--header-timeout", "-1"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert refused.returncode == 2 and "--header-timeout" in refused.stderr, refused.stderr


def test_the_protocol_class_and_its_default() -> None:
    assert ServerConfig().header_timeout == DEFAULT_HEAD_TIMEOUT
    assert head_timeout_protocol(2.0) is head_timeout_protocol(2.0)  # one class per setting
    assert head_timeout_protocol(2.0, "h11").head_timeout == 2.0  # type: ignore[attr-defined]
    for bad in (0.0, -1.0):
        with pytest.raises(ValueError, match="positive"):
            head_timeout_protocol(bad)
    with pytest.raises(ValueError, match="unknown"):
        head_timeout_protocol(1.0, "zttp")
    assert ServerConfig().header_max_bytes == DEFAULT_MAX_HEAD_BYTES == 65536
    assert head_timeout_protocol(2.0).max_head_bytes == DEFAULT_MAX_HEAD_BYTES  # type: ignore[attr-defined]
    with pytest.raises(ValueError, match="at least 1024"):
        head_timeout_protocol(1.0, max_head_bytes=100)


def test_the_log_budget_writes_a_burst_then_counts_until_the_window_ends() -> None:
    budget = LogBudget(burst=2, window=10.0)
    assert [budget.note(t, "a")[0] for t in (0.0, 1.0, 2.0, 3.0)] == [True, True, False, False]
    assert budget.note(4.0, "b") == (False, None)
    assert budget.close(9.9) is None  # not over yet
    assert budget.note(10.0, "a") == (True, {"a": 2, "b": 1})  # the summary, then a new window
    assert budget.close(20.0) is None  # nothing held in that one
    assert budget.ends is None
    with pytest.raises(ValueError, match="burst"):
        LogBudget(burst=0, window=1.0)
