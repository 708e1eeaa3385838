"""Shared parts of the benchmarks (and of the scale tests): a database, a fleet of
websocket clients in another process, and how figures are printed.

The fleet is many listener connections driven from one child process, so that
client load never shares an event loop (or a core's time slice) with the
server under test. Each client is a small RFC 6455 client on a plain asyncio
Protocol: a real handshake, a registration frame, masked frames upstream,
pongs for pings, and a close handshake. Downstream it parses frame headers
and counts change items in each text frame by counting the
``"changedResourceId"`` key (one per item, batched or not), which costs far
less than decoding JSON: the point is to measure the server, not the client.
In ``latency`` mode it also records when each item arrived, finding the
sequence number in each item's ``"changedResourceId":"lat-<seq>-..."`` with one
regular-expression scan: 100 clients in one process handle a flush one after
another, so whatever a client spends per frame is added to the measured
latency of every client after it, which remote listeners would not pay.

What it must never do: talk to anything but the URL it is given, or outlive
its parent (the process is a daemon; ``stop`` joins it, then kills it).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import json
import math
import multiprocessing
import os
import re
import resource
import socket
import statistics
import struct
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from array import array
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, cast
from urllib.parse import urlsplit

from websockets.frames import Frame, Opcode

__all__ = [
    "MARKER",
    "ClientFleet",
    "cpu_seconds",
    "database",
    "percentile",
    "raise_nofile",
    "rss_bytes",
    "say",
    "until",
]

MARKER = b'"changedResourceId"'
"""Occurs exactly once in every change item, whatever the framing."""

_LATENCY_SEQ = re.compile(rb'"changedResourceId":"lat-(\d+)-')
"""In latency mode, the sequence number of each item (ids are ``lat-<seq>-<anything>``)."""

_GUID = b"258EAFA5-E914-47DA-95CA-C5AB0DC85B11"


def raise_nofile(want: int) -> int:
    """Raise this process's soft RLIMIT_NOFILE towards ``want`` (up to the hard limit)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = want if hard == resource.RLIM_INFINITY else min(want, hard)
    if target > soft:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        return target
    return soft


def rss_bytes(pid: int | None = None) -> int:
    """Resident set size of ``pid`` (default: this process), from /proc."""
    with open(f"/proc/{pid or os.getpid()}/statm") as f:
        pages = int(f.read().split()[1])
    return pages * os.sysconf("SC_PAGE_SIZE")


async def readable(conn: Connection, timeout: float, message: str = "") -> None:
    """Wait until the pipe end ``conn`` has something to read (or is closed).

    In a thread, a second at a time: a poll loop like ``until`` would wake the
    measured process's event loop 200 times a second, and on this kind of
    machine each wake-up from idle costs more than a change's whole fan-out.

    Raises:
        TimeoutError: nothing within ``timeout`` seconds.
    """
    deadline = time.monotonic() + timeout

    def poll() -> bool:
        while True:
            left = deadline - time.monotonic()
            if conn.poll(max(0.0, min(left, 1.0))):
                return True
            if left <= 1.0:
                return False

    if not await asyncio.to_thread(poll):
        raise TimeoutError(message or f"no answer within {timeout}s")


async def until(predicate: Callable[[], bool], timeout: float, message: str = "") -> None:
    """Wait (polling, bounded) until ``predicate()`` holds.

    Raises:
        TimeoutError: it did not within ``timeout`` seconds.
    """
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(message or f"condition not met within {timeout}s")
        await asyncio.sleep(0.005)


def cpu_seconds(pid: int | None = None) -> float:
    """User + system CPU time of ``pid`` (default: this process) so far, from /proc."""
    with open(f"/proc/{pid or os.getpid()}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def percentile(sorted_values: Sequence[float], q: float) -> float:
    """The ``q`` quantile (0..1) of already sorted values, nearest rank."""
    if not sorted_values:
        return math.nan
    rank = min(len(sorted_values) - 1, max(0, math.ceil(q * len(sorted_values)) - 1))
    return sorted_values[rank]


@contextlib.contextmanager
def database(dsn: str | None) -> Iterator[str]:
    """``dsn`` as given, or a throwaway embedded PostgreSQL for the run."""
    if dsn:
        yield dsn
        return
    from changefeed.embedded import temporary

    server = temporary()
    server.start()
    try:
        yield server.dsn
    finally:
        server.close()


# --------------------------------------------------------------------------- the client


def _client_frame(opcode: Opcode, data: bytes) -> bytes:
    return Frame(opcode, data).serialize(mask=True)


@dataclass
class _Totals:
    target: int = 0
    remaining: int = 0
    done: asyncio.Event = field(default_factory=asyncio.Event)


class _Client(asyncio.Protocol):
    """One listener connection (see the module docstring)."""

    def __init__(
        self,
        fleet: _Fleet,
        index: int,
        *,
        target: str,
        headers: Sequence[tuple[str, str]],
        registration: str | None,
        latency_slots: int,
    ) -> None:
        self.fleet = fleet
        self.index = index
        self.target = target
        self.headers = headers
        self.registration = registration
        self.transport: asyncio.Transport | None = None
        self.buffer = bytearray()
        self.handshaken = False
        self.key = base64.b64encode(os.urandom(16))
        self.opened: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        self.ack: bytes | None = None
        self.items = 0
        self.frames = 0
        self.first_at = 0.0
        self.done_at = 0.0
        self.close_code: int | None = None
        self.lost = asyncio.get_running_loop().create_future()
        self.paused = False
        self.recv_at: array[float] | None = (
            array("d", bytes(8 * latency_slots)) if latency_slots else None
        )

    # -- asyncio.Protocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)
        lines = [
            f"GET {self.target} HTTP/1.1",
            f"Host: {self.fleet.host}:{self.fleet.port}",
            "Upgrade: websocket",
            "Connection: Upgrade",
            f"Sec-WebSocket-Key: {self.key.decode()}",
            "Sec-WebSocket-Version: 13",
            *(f"{name}: {value}" for name, value in self.headers),
        ]
        self.transport.write(("\r\n".join(lines) + "\r\n\r\n").encode())

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.opened.done():
            self.opened.set_exception(ConnectionError(f"connection lost: {exc!r}"))
        if not self.lost.done():
            self.lost.set_result(None)
        self.fleet.client_gone(self)

    def data_received(self, data: bytes) -> None:
        buffer = self.buffer
        buffer += data
        if not self.handshaken and not self._handshake():
            return
        now = time.monotonic() if self.recv_at is not None else 0.0
        pos = 0
        end = len(buffer)
        items_before = self.items
        while end - pos >= 2:
            b0 = buffer[pos]
            length = buffer[pos + 1] & 0x7F
            head = 2
            if length == 126:
                if end - pos < 4:
                    break
                length = (buffer[pos + 2] << 8) | buffer[pos + 3]
                head = 4
            elif length == 127:
                if end - pos < 10:
                    break
                length = struct.unpack_from("!Q", buffer, pos + 2)[0]
                head = 10
            if end - pos < head + length:
                break
            start = pos + head
            pos = start + length
            opcode = b0 & 0x0F
            if opcode in {0, 1}:
                self.frames += 1
                if self.ack is None:
                    self.ack = bytes(buffer[start:pos])
                    if not self.opened.done():
                        self.opened.set_result(self.index)
                    continue
                if self.recv_at is not None:
                    self._record(buffer, start, pos, now)
                else:
                    self.items += buffer.count(MARKER, start, pos)
            elif opcode == 9:
                assert self.transport is not None
                self.transport.write(_client_frame(Opcode.PONG, bytes(buffer[start:pos])))
            elif opcode == 8:
                self.close_code = (buffer[start] << 8) | buffer[start + 1] if length >= 2 else 1005
                if self.transport is not None and not self.transport.is_closing():
                    self.transport.write(_client_frame(Opcode.CLOSE, bytes(buffer[start:pos])))
                    self.transport.close()
        del buffer[:pos]
        if self.items != items_before:
            self.fleet.progress(self)

    # -- helpers

    def _handshake(self) -> bool:
        head_end = self.buffer.find(b"\r\n\r\n")
        if head_end < 0:
            return False
        head = bytes(self.buffer[:head_end]).decode("latin-1")
        del self.buffer[: head_end + 4]
        status = head.split("\r\n", 1)[0]
        expected = base64.b64encode(hashlib.sha1(self.key + _GUID).digest()).decode()
        if " 101 " not in status + " " or expected not in head:
            if not self.opened.done():
                self.opened.set_exception(ConnectionRefusedError(status))
            assert self.transport is not None
            self.transport.close()
            return False
        self.handshaken = True
        if self.registration is None:
            self.ack = b""
            self.opened.set_result(self.index)
        else:
            self.send_text(self.registration)
        return True

    def _record(self, buffer: bytearray, start: int, end: int, now: float) -> None:
        recv_at = self.recv_at
        assert recv_at is not None
        slots = len(recv_at)
        for digits in _LATENCY_SEQ.findall(buffer, start, end):
            self.items += 1
            seq = int(digits)
            if seq < slots:
                recv_at[seq] = now
        if self.first_at == 0.0 and self.items:
            self.first_at = now

    def send_text(self, text: str) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.write(_client_frame(Opcode.TEXT, text.encode()))

    async def close(self, timeout: float) -> None:
        if self.transport is None or self.transport.is_closing():
            return
        if self.paused:
            self.transport.resume_reading()
        self.transport.write(_client_frame(Opcode.CLOSE, struct.pack("!H", 1000)))
        try:
            await asyncio.wait_for(asyncio.shield(self.lost), timeout)
        except TimeoutError:
            self.transport.abort()


# --------------------------------------------------------------------------- the child process


class _Fleet:
    """The child side: owns the clients and answers the parent's commands."""

    def __init__(self) -> None:
        self.clients: list[_Client] = []
        self.host = ""
        self.port = 0
        self.totals = _Totals()
        self.latency_slots = 0

    def progress(self, client: _Client) -> None:
        if client.first_at == 0.0:
            client.first_at = time.monotonic()
        if client.done_at == 0.0 and self.totals.target and client.items >= self.totals.target:
            client.done_at = time.monotonic()
            self.totals.remaining -= 1
            if self.totals.remaining <= 0:
                self.totals.done.set()

    def client_gone(self, client: _Client) -> None:
        if client.done_at == 0.0 and self.totals.target:
            # A client that is gone will never finish: stop waiting for it.
            client.done_at = -1.0
            self.totals.remaining -= 1
            if self.totals.remaining <= 0:
                self.totals.done.set()

    async def connect(
        self,
        url: str,
        count: int,
        *,
        registration: str | None,
        headers: Sequence[tuple[str, str]],
        latency_slots: int,
        concurrency: int,
        timeout: float,
    ) -> dict[str, Any]:
        parts = urlsplit(url)
        self.host = parts.hostname or "127.0.0.1"
        self.port = parts.port or 80
        target = parts.path + (f"?{parts.query}" if parts.query else "")
        self.latency_slots = latency_slots
        loop = asyncio.get_running_loop()
        gate = asyncio.Semaphore(concurrency)
        refused: dict[str, int] = {}
        base = len(self.clients)

        async def one(i: int) -> None:
            async with gate:
                client = _Client(
                    self,
                    base + i,
                    target=target,
                    headers=headers,
                    registration=registration,
                    latency_slots=latency_slots,
                )
                try:
                    async with asyncio.timeout(timeout):
                        await loop.create_connection(lambda: client, self.host, self.port)
                        await client.opened
                except (OSError, TimeoutError) as exc:
                    key = type(exc).__name__ + (f": {exc}" if str(exc) else "")
                    refused[key] = refused.get(key, 0) + 1
                    if client.transport is not None:
                        client.transport.abort()
                    return
                self.clients.append(client)

        await asyncio.gather(*(one(i) for i in range(count)))
        acks = [c.ack for c in self.clients[base:] if c.ack]
        return {
            "connected": len(self.clients) - base,
            "refused": refused,
            "ack": acks[0].decode() if acks else None,
        }

    def reset(self, target: int, clients: int | None = None) -> None:
        live = [c for c in self.clients if c.transport and not c.transport.is_closing()]
        for client in self.clients:
            client.items = 0
            client.frames = 0
            client.first_at = 0.0
            client.done_at = 0.0
            if client.recv_at is not None:
                client.recv_at = array("d", bytes(8 * self.latency_slots))
        self.totals = _Totals(target, len(live) if clients is None else clients)
        if self.totals.remaining <= 0:
            self.totals.done.set()

    async def wait(self, timeout: float) -> dict[str, Any]:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.totals.done.wait(), timeout)
        return self.report()

    def report(self) -> dict[str, Any]:
        clients = self.clients
        return {
            "complete": self.totals.done.is_set(),
            "items": [c.items for c in clients],
            "frames": [c.frames for c in clients],
            "first_at": [c.first_at for c in clients],
            "done_at": [c.done_at for c in clients],
            "close_codes": [c.close_code for c in clients],
            "open": sum(1 for c in clients if c.transport and not c.transport.is_closing()),
        }

    def latencies(self, sent_at: Sequence[float]) -> dict[str, Any]:
        values: list[float] = []
        missing = 0
        for client in self.clients:
            if client.recv_at is None:
                continue
            for seq, t0 in enumerate(sent_at):
                if not math.isfinite(t0):
                    continue  # not measured (warm-up)
                received = client.recv_at[seq]
                if received == 0.0:
                    missing += 1
                else:
                    values.append(received - t0)
        values.sort()
        return {
            "count": len(values),
            "missing": missing,
            "p50": percentile(values, 0.50),
            "p90": percentile(values, 0.90),
            "p99": percentile(values, 0.99),
            "p999": percentile(values, 0.999),
            "max": values[-1] if values else math.nan,
            "mean": statistics.fmean(values) if values else math.nan,
        }

    async def close(self, timeout: float) -> int:
        clients, self.clients = self.clients, []
        await asyncio.gather(*(c.close(timeout) for c in clients))
        return len(clients)

    def pause(self, indexes: Sequence[int], paused: bool) -> None:
        for i in indexes:
            client = self.clients[i]
            client.paused = paused
            if client.transport is not None and not client.transport.is_closing():
                if paused:
                    client.transport.pause_reading()
                else:
                    client.transport.resume_reading()

    async def handle(self, name: str, kwargs: dict[str, Any]) -> Any:
        if name == "ping":
            return os.getpid()
        if name == "connect":
            return await self.connect(**kwargs)
        if name == "reset":
            return self.reset(**kwargs)
        if name == "wait":
            return await self.wait(**kwargs)
        if name == "report":
            return self.report()
        if name == "latencies":
            return self.latencies(**kwargs)
        if name == "close":
            return await self.close(**kwargs)
        if name == "pause":
            return self.pause(**kwargs)
        raise ValueError(f"unknown fleet command {name!r}")


async def _serve(conn: Connection) -> None:
    loop = asyncio.get_running_loop()
    commands: asyncio.Queue[tuple[int, tuple[str, dict[str, Any]]]] = asyncio.Queue()

    # A thread reads the pipe: multiprocessing's Connection needs a blocking file
    # descriptor, and an event loop's add_reader would make it non-blocking.
    def read_commands() -> None:
        while True:
            try:
                item = conn.recv()
            except (EOFError, OSError):
                item = (-1, ("exit", {}))
            loop.call_soon_threadsafe(commands.put_nowait, item)
            if item[1][0] == "exit":
                return

    threading.Thread(target=read_commands, name="fleet-commands", daemon=True).start()
    fleet = _Fleet()
    while True:
        number, (name, kwargs) = await commands.get()
        if name == "exit":
            await fleet.close(2.0)
            with contextlib.suppress(OSError):
                conn.send((number, "ok", None))
            return
        try:
            conn.send((number, "ok", await fleet.handle(name, kwargs)))
        except Exception as exc:
            conn.send((number, "error", f"{exc!r}\n{traceback.format_exc()}"))


def _fleet_main(conn: Connection, nofile: int) -> None:
    import faulthandler

    faulthandler.enable()
    raise_nofile(nofile)
    loop_factory: Callable[[], asyncio.AbstractEventLoop]
    try:
        import uvloop

        loop_factory = uvloop.new_event_loop
    except ImportError:  # pragma: no cover
        loop_factory = asyncio.new_event_loop
    with asyncio.Runner(loop_factory=loop_factory) as runner:
        runner.run(_serve(conn))


# --------------------------------------------------------------------------- the parent side


class ClientFleet:
    """Listener connections driven from a child process.

    Args:
        nofile: RLIMIT_NOFILE to ask for in the child (one descriptor per client).
    """

    def __init__(self, nofile: int = 8192) -> None:
        context = multiprocessing.get_context("spawn")
        self._conn, child = context.Pipe()
        self._process = context.Process(
            target=_fleet_main, args=(child, nofile), name="changefeed-fleet", daemon=True
        )
        self._child = child
        self._calls = 0
        self.pid = 0

    async def __aenter__(self) -> ClientFleet:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    async def start(self, timeout: float = 60.0) -> None:
        self._process.start()
        self._child.close()
        self.pid = await self.call("ping", timeout)

    async def call(self, name: str, within: float = 60.0, /, **kwargs: Any) -> Any:
        """Send one command and return its answer (bounded by ``within`` seconds)."""
        self._calls += 1
        number = self._calls
        self._conn.send((number, (name, kwargs)))
        deadline = time.monotonic() + within
        while True:
            await readable(self._conn, deadline - time.monotonic(), f"fleet: no answer to {name}")
            try:
                answer, status, value = self._conn.recv()
            except EOFError:
                self._process.join(5)
                raise RuntimeError(
                    f"fleet process ended (exit code {self._process.exitcode}) during {name!r}"
                ) from None
            if answer == number:
                break
            # The answer to an earlier call that timed out: not ours.
        if status != "ok":
            raise RuntimeError(f"fleet: {name} failed: {value}")
        return value

    async def connect(
        self,
        url: str,
        count: int,
        registration: str | None,
        *,
        headers: Sequence[tuple[str, str]] = (),
        latency_slots: int = 0,
        concurrency: int = 100,
        timeout: float = 60.0,
    ) -> dict[str, Any]:
        """Open ``count`` connections, register each, and wait for every ack."""
        result: dict[str, Any] = await self.call(
            "connect",
            timeout + 30 + count / 100,
            url=url,
            count=count,
            registration=registration,
            headers=list(headers),
            latency_slots=latency_slots,
            concurrency=concurrency,
            timeout=timeout,
        )
        return result

    async def reset(self, target: int, clients: int | None = None) -> None:
        """Zero the counters; ``wait`` then waits until every client counted ``target`` items.

        Args:
            target: items each client is to count.
            clients: how many clients to wait for (default: those open now). Give it to
                count clients that ``connect`` opens after this call, from their first
                item on (listeners that start receiving as soon as they register).
        """
        await self.call("reset", target=target, clients=clients)

    async def wait(self, timeout: float) -> dict[str, Any]:
        """Wait (bounded) until every open client counted its target; the per-client report."""
        result: dict[str, Any] = await self.call("wait", timeout + 30, timeout=timeout)
        return result

    async def latencies(self, sent_at: Sequence[float]) -> dict[str, Any]:
        result: dict[str, Any] = await self.call("latencies", 120, sent_at=list(sent_at))
        return result

    async def pause(self, indexes: Sequence[int], paused: bool = True) -> None:
        """Stop (or resume) reading the sockets of the given clients."""
        await self.call("pause", indexes=list(indexes), paused=paused)

    async def close_all(self, timeout: float = 5.0) -> int:
        closed: int = await self.call("close", timeout + 60, timeout=timeout)
        return closed

    def rss(self) -> int:
        return rss_bytes(self.pid)

    async def stop(self, timeout: float = 30.0) -> None:
        if self._process.is_alive():
            with contextlib.suppress(Exception):
                await self.call("exit", timeout)
        self._process.join(timeout=5)
        if self._process.is_alive():
            self._process.kill()
            self._process.join(timeout=5)
        self._conn.close()


@contextlib.asynccontextmanager
async def fleet(nofile: int = 8192) -> AsyncIterator[ClientFleet]:
    """A started ClientFleet, stopped on exit."""
    clients = ClientFleet(nofile)
    await clients.start()
    try:
        yield clients
    finally:
        await clients.stop()


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
    return port


async def fresh_schema(dsn: str, schema: str) -> None:
    """Drop ``schema`` and create the feed schema there again: every round starts on an
    empty feed."""
    import asyncpg

    from changefeed.schemas import apply_schema, quote_schema

    conn = await asyncpg.connect(dsn)
    try:
        await conn.execute(f"DROP SCHEMA IF EXISTS {quote_schema(schema)} CASCADE")
        await apply_schema(conn, schema)
    finally:
        await conn.close()


def say(*parts: object) -> None:
    """Print a figure line now (benchmarks run long; nothing waits in a buffer)."""
    print(*parts, flush=True, file=sys.stdout)


@contextlib.asynccontextmanager
async def serve_publisher(
    config: Any, *, fast_path: bool = True, **server: Any
) -> AsyncIterator[tuple[str, Any]]:
    """Run ``Publisher(config)`` in a Starlette app on uvicorn (the publisher's own
    server settings, ``server`` overriding them) on a free loopback port; yield its
    websocket URL and the publisher. The garbage collector is tuned once the
    server has started, as ``changefeed serve`` does."""
    import uvicorn
    from starlette.applications import Starlette

    from changefeed.collector import tune_collector
    from changefeed.publisher import Publisher
    from changefeed.serving import server_config

    publisher = Publisher(config)
    app = Starlette(routes=publisher.routes, lifespan=publisher.lifespan)
    runner = uvicorn.Server(server_config(app, "127.0.0.1", 0, fast_path=fast_path, **server))
    task = asyncio.create_task(runner.serve())
    await until(lambda: runner.started, 30)
    port = runner.servers[0].sockets[0].getsockname()[1]
    await asyncio.wait_for(publisher.tailer.ready.wait(), 30)
    tune_collector()
    try:
        yield f"ws://127.0.0.1:{port}/changefeeds", publisher
    finally:
        runner.should_exit = True
        await asyncio.wait_for(task, 30)


_BENCH = Path(__file__).resolve().parent

OLDEST_UVICORN = "0.35.0"
"""The oldest uvicorn the publisher supports (``changefeed.fast_path.OLDEST_UVICORN``,
which tests/test_bench_smoke.py holds this to; not imported, since a benchmark's
workers may import an older tree's package): measured from a venv of its own
(``oldest_uvicorn_python``)."""

SERVERS = {
    "uvicorn-fast": "uvicorn, fast path",
    "uvicorn": "uvicorn, plain ASGI",
    "uvicorn-0.35": f"uvicorn {OLDEST_UVICORN}, plain ASGI",
    "hypercorn": "hypercorn, plain ASGI",
    "granian": "granian, plain ASGI",
}
"""The servers the benchmarks run the publisher on (``publisher_process``), as labelled:
``uvicorn`` is the one installed beside the benchmark, ``uvicorn-0.35`` the oldest."""

_VENVS = _BENCH / "out" / "venvs"
_REPO = _BENCH.parent


def oldest_uvicorn_python() -> str:
    """The Python of a venv holding this tree (editable, with the ``publisher`` extra)
    and uvicorn ``OLDEST_UVICORN``, made on first use and again when pyproject.toml
    changes; everything else is whatever pip resolves beside that uvicorn."""
    venv = _VENVS / f"uvicorn-{OLDEST_UVICORN}"
    python, stamp = venv / "bin" / "python", venv / ".installed"
    if stamp.exists() and stamp.stat().st_mtime >= (_REPO / "pyproject.toml").stat().st_mtime:
        return str(python)
    say(f"making {venv} (uvicorn {OLDEST_UVICORN} and this tree) ...")
    make = [sys.executable, "-m", "venv", "--clear", "--without-pip", str(venv)]
    subprocess.run(make, check=True, timeout=120)
    done = subprocess.run(
        [
            *(sys.executable, "-m", "pip", "--python", str(python), "install", "--quiet"),
            *("--disable-pip-version-check", "-e", f"{_REPO}[publisher]"),
            f"uvicorn[standard]=={OLDEST_UVICORN}",
        ],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    if done.returncode != 0:
        raise RuntimeError(f"installing into {venv} failed:\n{done.stderr[-3000:]}")
    stamp.touch()
    return str(python)


# --------------------------------------------------------------------------- baseline tree


def _git(*args: str) -> str:
    return subprocess.run(
        ["git", "-C", str(_REPO), *args], capture_output=True, text=True, check=True
    ).stdout.strip()


def this_commit() -> str:
    """This tree's commit, short, with ``+`` when it has uncommitted changes."""
    return _git("rev-parse", "--short", "HEAD") + ("+" if _git("status", "--porcelain") else "")


def tree_env(tree: Path | None) -> dict[str, str]:
    """This process's environment for a child that imports ``tree``'s ``changefeed``
    (None: this tree's): the tree ahead of the editable install's finder."""
    env = dict(os.environ)
    if tree is not None:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(tree), env.get("PYTHONPATH")]))
    return env


@contextlib.contextmanager
def baseline_tree(ref: str) -> Iterator[tuple[Path, str]]:
    """A detached worktree of ``ref`` in a temporary directory, removed afterwards;
    checked to be what a child given ``tree_env`` imports."""
    commit = _git("rev-parse", "--short", f"{ref}^{{commit}}")
    with tempfile.TemporaryDirectory(prefix="cf-bench-baseline-") as tmp:
        tree = Path(tmp) / "tree"
        _git("worktree", "add", "--detach", "--quiet", str(tree), commit)
        try:
            probe = "import changefeed; print(changefeed.__file__)"
            imported = subprocess.run(
                [sys.executable, "-c", probe],
                env=tree_env(tree),
                cwd=tmp,  # not this tree's root, which ``-c`` would put first on sys.path
                capture_output=True,
                text=True,
                check=True,
                timeout=60,
            ).stdout.strip()
            if not Path(imported).resolve().is_relative_to(tree.resolve()):
                raise RuntimeError(f"a child given {tree} imports {imported} instead")
            yield tree, commit
        finally:
            _git("worktree", "remove", "--force", str(tree))


def paired(values: Sequence[float], against: Sequence[float]) -> float:
    """The median of the pair-by-pair ratios ``values[i] / against[i]``: each pair
    was measured within seconds, so the ratio cancels the load other processes put
    on the machine from pair to pair."""
    return statistics.median(v / a for v, a in zip(values, against, strict=True))


def _server_command(server: str, port: int) -> list[str]:
    """Each server with uvloop, no per-message compression where it can be turned
    off, and its own logging at warning."""
    python, app, host = sys.executable, "served_app:app", "127.0.0.1"
    if server in ("uvicorn", "uvicorn-fast", "uvicorn-0.35"):
        if server == "uvicorn-0.35":
            python = oldest_uvicorn_python()
        ws = (
            "changefeed.serving:FanoutWebSocketProtocol"
            if server == "uvicorn-fast"
            else "websockets-sansio"
        )
        return [
            *(python, "-m", "uvicorn", app, "--host", host, "--port", str(port)),
            *("--loop", "uvloop", "--http", "httptools", "--ws", ws),
            *("--ws-per-message-deflate", "false", "--log-level", "warning"),
        ]
    if server == "hypercorn":
        return [
            *(python, "-m", "hypercorn", app, "--bind", f"{host}:{port}"),
            *("--worker-class", "uvloop", "--log-level", "warning"),
        ]
    if server == "granian":
        return [
            *(python, "-m", "granian", "--interface", "asgi", "--loop", "uvloop"),
            *("--host", host, "--port", str(port), "--log-level", "warning", app),
        ]
    raise ValueError(f"unknown server {server!r} (known: {', '.join(SERVERS)})")


@dataclass
class PublisherProcess:
    """A publisher served by one of ``SERVERS`` in a process of its own."""

    server: str
    url: str
    process: asyncio.subprocess.Process

    @property
    def ws_url(self) -> str:
        return self.url.replace("http://", "ws://", 1) + "/changefeeds"

    def cpu_seconds(self) -> float:
        """CPU time of the server's processes so far (granian's workers are children)."""
        import psutil

        root = psutil.Process(self.process.pid)
        total = 0.0
        for proc in [root, *root.children(recursive=True)]:
            with contextlib.suppress(psutil.Error):
                times = proc.cpu_times()
                total += times.user + times.system
        return total

    async def stats(self) -> dict[str, Any]:
        import httpx

        async with httpx.AsyncClient(timeout=10) as http:
            response = await http.get(self.url + "/changefeeds/stats")
            response.raise_for_status()
            doc: dict[str, Any] = response.json()
            return doc

    async def listeners(self) -> int:
        return int((await self.stats())["listeners"])


@contextlib.asynccontextmanager
async def publisher_process(
    server: str, dsn: str, settings: dict[str, Any], tree: Path | None = None
) -> AsyncIterator[PublisherProcess]:
    """The publisher (bench/served_app.py, ``settings``: PublisherConfig fields) on
    ``server`` on a free loopback port, until the block exits (SIGTERM); with
    ``tree`` (``baseline_tree``), that tree's served app and package."""
    import httpx

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    env = tree_env(tree)
    env["CHANGEFEED_DSN"] = dsn
    env["CHANGEFEED_BENCH_SETTINGS"] = json.dumps(settings)
    # In a thread: the first run of an older uvicorn makes its venv first.
    command = await asyncio.to_thread(_server_command, server, port)
    cwd = _BENCH if tree is None else tree / "bench"
    process = await asyncio.create_subprocess_exec(*command, cwd=cwd, env=env)
    served = PublisherProcess(server, f"http://127.0.0.1:{port}", process)
    try:
        async with httpx.AsyncClient(timeout=2) as http:

            async def ready() -> bool:
                if process.returncode is not None:
                    raise RuntimeError(f"{server} exited with {process.returncode}")
                with contextlib.suppress(httpx.HTTPError):
                    return (await http.get(served.url + "/readyz")).status_code == 200
                return False

            deadline = time.monotonic() + 60
            while not await ready():
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{server} not ready within 60 s")
                await asyncio.sleep(0.1)
        yield served
    finally:
        if process.returncode is None:
            process.terminate()
            try:
                await asyncio.wait_for(process.wait(), 30)
            except TimeoutError:
                process.kill()
                await process.wait()
