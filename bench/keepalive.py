"""Pong latency under catch-up: how long a listener that reads waits for the answer to its ping.

    python bench/keepalive.py [--dsn DSN] [--quick] [--rounds 3] [--listeners 20]
                              [--backlog 10000] [--pause 5] [--read-seconds 15]
                              [--rates 500,100] [--pong-wait 60] [--notsent-lowat 8192]
                              [--servers direct,asgi,asgi-host-default,raw-websockets]

A websocket pong is written behind every byte sent before it, so a listener
catching up on a backlog gets the answer to its ping only once it has read
that far. ``--listeners`` listeners (another process, bench/keepalive.py's
own client on websockets' sans-I/O protocol, which reads its socket 4 KiB
at a time only when it wants the next frame) register, stop reading for
``--pause`` seconds while a ``--backlog``-entry burst is written, then read
one item per frame at a steady RATE items/s for ``--read-seconds``, sending a
ping every second (then reading on at that pace, for up to ``--pong-wait``
seconds, until the last pong came). For each ping the client notes:

* the pong's latency;
* its own receive buffer then: what its kernel holds unread (FIONREAD) and
  the frames it has read from the socket but not yet taken;
* the bytes it read between the ping and the pong: everything ahead of the
  pong. What of that was not in its own buffer was held on the server's side
  (the transport, the kernel's send queue): divided by the bytes per second
  the client reads, that is what the server added to the pong's latency.

Servers, each in every round, in turn:

* ``direct``: the publisher as ``changefeed serve`` runs it (uvicorn,
  changefeed.serving's protocol, ``TCP_NOTSENT_LOWAT`` set on the listening
  socket by DrainingServer, ``--notsent-lowat`` bytes, the default
  ``[server] notsent_lowat`` unless given);
* ``asgi``: the publisher through plain ASGI sends (uvicorn's own
  ``websockets-sansio`` protocol) on a plain ``uvicorn.Server``, as an API
  that embeds it runs it: the publisher sets the same bound on the port's
  sockets itself (its ``notsent_lowat``, changefeed.port_sockets);
* ``asgi-host-default``: the same with the publisher's ``notsent_lowat = 0``
  (the host's ``net.ipv4.tcp_notsent_lowat``, unlimited by default): what a
  server gets where the publisher cannot reach its sockets and the host is
  not tuned;
* ``raw-websockets``: the baseline, a ``websockets`` server that sends each
  listener the same item frames with ``await connection.send`` (its default
  write limit), as a plain broadcast service would.

Printed per server and rate: the median and p99 of the pong latency, of the
client's own-buffer time, and of the server-added seconds; the median of
the bytes held server-side ahead of a pong. Target: the publisher adds at
most 2 s to a reading client's pong, beyond what that client's own receive
buffer holds. Figures are medians over ``--rounds`` rounds.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import fcntl
import math
import multiprocessing
import socket
import statistics
import struct
import termios
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator, Sequence
from multiprocessing.connection import Connection
from typing import Any
from urllib.parse import urlsplit

import asyncpg
import orjson
from common import database, fresh_schema, percentile, say, until
from websockets.client import ClientProtocol
from websockets.frames import Frame, Opcode
from websockets.uri import parse_uri

from changefeed.publisher import Publisher, PublisherConfig, ResourceConfig, publish_many
from changefeed.tcp_liveness import NOTSENT_LOWAT

SCHEMA = "changefeed_bench"
VM = ResourceConfig("vm", "/vms", ("nic", "alias"))
READ_CHUNK = 4096
PING_EVERY = 1.0
SERVERS = ("direct", "asgi", "asgi-host-default", "raw-websockets")


# --------------------------------------------------------------------------- the client


def _own_bytes(sock: socket.socket, taken: deque[bytes]) -> int:
    """What the client holds unread: its kernel's receive queue, and frames parsed
    but not taken yet."""
    unread = struct.unpack("i", fcntl.ioctl(sock.fileno(), termios.FIONREAD, b"\0\0\0\0"))[0]
    return int(unread) + sum(len(f) for f in taken)


class _Listener:
    """One listener: handshake, registration, a pause, then reading at ``rate`` items/s."""

    def __init__(self, url: str, rate: float) -> None:
        self.url = url
        self.rate = rate
        self.protocol = ClientProtocol(parse_uri(url))
        self.sock = socket.socket()
        self.frames: deque[bytes] = deque()
        self.consumed = 0
        """Bytes of frames taken (pings and pongs included)."""
        self.pings: list[dict[str, float]] = []
        self._pending: dict[bytes, dict[str, float]] = {}

    async def _send(self) -> None:
        loop = asyncio.get_running_loop()
        for data in self.protocol.data_to_send():
            if data:
                await loop.sock_sendall(self.sock, data)

    async def _read_some(self) -> None:
        loop = asyncio.get_running_loop()
        data = await loop.sock_recv(self.sock, READ_CHUNK)
        if not data:
            raise ConnectionError("closed by the server")
        self.protocol.receive_data(data)
        now = time.monotonic()
        for event in self.protocol.events_received():
            if isinstance(event, Frame):
                size = len(event.data) + (2 if len(event.data) < 126 else 4)
                if event.opcode is Opcode.PONG and bytes(event.data) in self._pending:
                    ping = self._pending.pop(bytes(event.data))
                    ping["latency"] = now - ping["sent"]
                    ping["ahead"] = self.consumed + sum(len(f) for f in self.frames) - ping["at"]
                    self.pings.append(ping)
                elif event.opcode is Opcode.TEXT:
                    self.frames.append(bytes(event.data))
                self.consumed += 0 if event.opcode is Opcode.TEXT else size
        await self._send()  # pongs to the server's pings

    async def next_frame(self) -> bytes:
        while not self.frames:
            await self._read_some()
        frame = self.frames.popleft()
        self.consumed += len(frame) + (2 if len(frame) < 126 else 4)
        return frame

    async def register(self) -> None:
        loop = asyncio.get_running_loop()
        parts = urlsplit(self.url)
        self.sock.setblocking(False)
        await loop.sock_connect(self.sock, (parts.hostname, parts.port))
        self.protocol.send_request(self.protocol.connect())
        await self._send()
        while self.protocol.handshake_exc is None and self.protocol.state.name == "CONNECTING":
            await self._read_some()
        registration = {
            "instance": str(uuid.uuid4()),
            "service": "bench",
            "changeKind": {"resource": "vm", "subResources": []},
        }
        self.protocol.send_text(orjson.dumps(registration))
        await self._send()
        await self.next_frame()  # the ack

    async def ping(self) -> None:
        payload = uuid.uuid4().bytes[:4]
        own = _own_bytes(self.sock, self.frames)
        self._pending[payload] = {
            "sent": time.monotonic(),
            "own": float(own),
            "at": float(self.consumed),
        }
        self.protocol.send_ping(payload)
        await self._send()

    async def read(self, seconds: float, wait: float) -> float:
        """Read at ``rate`` items/s for ``seconds``, pinging every PING_EVERY s, then
        on, without pinging, until every ping has its pong or ``wait`` more seconds
        have passed (a pong still missing then counts with the time waited so far);
        returns the bytes per second of its pace."""
        started = time.monotonic()
        first = self.consumed
        taken = 0
        next_ping = started
        while (now := time.monotonic()) - started < seconds + wait:
            if now - started < seconds:
                if now >= next_ping:
                    await self.ping()
                    next_ping += PING_EVERY
            elif not self._pending:
                break
            try:
                async with asyncio.timeout(max(0.01, started + seconds + wait - now)):
                    await self.next_frame()
            except TimeoutError:
                break
            taken += 1
            await asyncio.sleep(max(0.0, started + taken / self.rate - time.monotonic()))
        now = time.monotonic()
        for ping in self._pending.values():
            ping["latency"] = now - ping["sent"]
            ping["ahead"] = ping["own"]  # unknown: counted as all the client's own
            ping["censored"] = 1.0
            self.pings.append(ping)
        # Bytes a second at the pace it reads (not counting the wait once the
        # backlog is read): what turns bytes ahead of a pong into seconds.
        return self.rate * (self.consumed - first) / max(1, taken)


async def _clients(
    conn: Connection, url: str, plan: tuple[int, float, float, float, float]
) -> None:
    count, rate, pause, seconds, waiting = plan
    listeners = [_Listener(url, rate) for _ in range(count)]
    await asyncio.gather(*(listener.register() for listener in listeners))
    conn.send("registered")
    conn.recv()  # the burst was written
    await asyncio.sleep(pause)
    speeds = await asyncio.gather(*(listener.read(seconds, waiting) for listener in listeners))
    pings = []
    for listener, speed in zip(listeners, speeds, strict=True):
        for ping in listener.pings:
            if ping["latency"] < 0.001:
                continue  # a ping written while nothing was ahead of it
            own = ping["own"] / speed
            server = max(0.0, ping["ahead"] - ping["own"])
            censored = ping.get("censored", 0.0)
            # A pong that never came: its wait is a lower bound, and what was ahead unknown.
            added = math.nan if censored else server / speed
            pings.append((ping["latency"], own, added, math.nan if censored else server, censored))
        listener.sock.close()
    conn.send(pings)


def _client_main(conn: Connection, *args: Any) -> None:
    asyncio.run(_clients(conn, *args))


# --------------------------------------------------------------------------- the servers


@contextlib.asynccontextmanager
async def changefeed_server(dsn: str, server: str, notsent_lowat: int) -> AsyncIterator[str]:
    import uvicorn
    from starlette.applications import Starlette

    from changefeed.serving import DrainingServer, server_config

    config = PublisherConfig(
        dsn=dsn,
        schema=SCHEMA,
        resources=(VM,),
        retention=False,
        create_schema=False,
        notsent_lowat=0 if server == "asgi-host-default" else notsent_lowat,
    )
    publisher = Publisher(config)
    app = Starlette(routes=publisher.routes, lifespan=publisher.lifespan)
    settings = server_config(app, "127.0.0.1", 0, fast_path=server == "direct")
    runner: uvicorn.Server
    if server == "direct":
        runner = DrainingServer(settings, [publisher], notsent_lowat=notsent_lowat)
    else:
        runner = uvicorn.Server(settings)
    runner.capture_signals = contextlib.nullcontext  # type: ignore[method-assign,assignment]
    task = asyncio.create_task(runner.serve())
    await until(lambda: runner.started, 30)
    port = runner.servers[0].sockets[0].getsockname()[1]
    await asyncio.wait_for(publisher.tailer.ready.wait(), 30)
    try:
        yield f"ws://127.0.0.1:{port}/changefeeds"
    finally:
        runner.should_exit = True
        await asyncio.wait_for(task, 30)


@contextlib.asynccontextmanager
async def raw_websockets_server(texts: Sequence[str], burst: asyncio.Event) -> AsyncIterator[str]:
    """The baseline: each connection, once registered and the burst written, is
    sent every item frame with ``await send``."""
    from websockets.asyncio.server import ServerConnection, serve

    async def handler(ws: ServerConnection) -> None:
        await ws.recv()
        ack = {"bootstrapRoute": "/vms", "cursor": "", "resumed": False}
        await ws.send(orjson.dumps(ack).decode())
        await burst.wait()
        for text in texts:
            await ws.send(text)
        await ws.wait_closed()

    async with serve(handler, "127.0.0.1", 0, compression=None) as server:
        port = next(iter(server.sockets)).getsockname()[1]
        yield f"ws://127.0.0.1:{port}/changefeeds"


# --------------------------------------------------------------------------- a measurement


async def write_burst(dsn: str, count: int) -> None:
    conn = await asyncpg.connect(dsn)
    try:
        async with conn.transaction():
            ids = [("vm", ["nic"], str(uuid.uuid4())) for _ in range(count)]
            await publish_many(conn, ids, schema=SCHEMA)
    finally:
        await conn.close()


def item_texts(count: int) -> list[str]:
    """Change items shaped like the publisher's (for the raw baseline)."""
    return [
        orjson.dumps(
            {
                "changeKind": {"resource": "vm", "subResources": ["nic"]},
                "changedResourceId": str(uuid.uuid4()),
                "cursor": "2.AAAAAAAAAAA." + "x" * 40,
                "published": "2026-11-26T09:00:00.000Z",
            }
        ).decode()
        for _ in range(count)
    ]


async def measure(args: argparse.Namespace, dsn: str, server: str, rate: float) -> list[Any]:
    await fresh_schema(dsn, SCHEMA)
    burst = asyncio.Event()
    if server == "raw-websockets":
        context = raw_websockets_server(item_texts(args.backlog), burst)
    else:
        context = changefeed_server(dsn, server, args.notsent_lowat)
    async with context as url:
        parent, child = multiprocessing.Pipe()
        proc = multiprocessing.get_context("spawn").Process(
            target=_client_main,
            args=(
                child,
                url,
                (args.listeners, rate, args.pause, args.read_seconds, args.pong_wait),
            ),
            daemon=True,
        )
        proc.start()
        try:
            loop = asyncio.get_running_loop()
            assert await loop.run_in_executor(None, parent.recv) == "registered"
            if server == "raw-websockets":
                burst.set()
            else:
                await write_burst(dsn, args.backlog)
            parent.send("written")
            pings: list[Any] = await loop.run_in_executor(None, parent.recv)
        finally:
            proc.join(10)
            if proc.is_alive():
                proc.kill()
    return pings


def summary(pings: list[Any]) -> dict[str, float]:
    columns: list[Sequence[Any]] = list(zip(*pings, strict=True)) if pings else [[]] * 5
    latency, own, added, held, censored = (
        sorted(x for x in column if not math.isnan(x)) for column in columns
    )
    return {
        "censored": float(sum(censored)),
        "p50": percentile(latency, 0.5),
        "p99": percentile(latency, 0.99),
        "own50": percentile(own, 0.5),
        "added50": percentile(added, 0.5),
        "added99": percentile(added, 0.99),
        "held50": percentile(held, 0.5),
        "pings": float(len(latency)),
    }


async def main(args: argparse.Namespace) -> None:
    rates = [float(r) for r in args.rates.split(",")]
    with database(args.dsn) as dsn:
        found: dict[tuple[str, float], list[dict[str, float]]] = {}
        servers = [s for s in SERVERS if s in args.servers.split(",")]
        for round_ in range(args.rounds):
            for rate in rates:
                for server in servers:
                    result = summary(await measure(args, dsn, server, rate))
                    found.setdefault((server, rate), []).append(result)
                    say(
                        f"round {round_ + 1} {server:>20} {rate:>5g}/s: "
                        f"pong p50 {result['p50']:.2f} s, server added p50 "
                        f"{result['added50']:.2f} s"
                    )
        say()
        say(
            f"pong latency under catch-up: {args.listeners} listeners, {args.backlog:,}-entry "
            f"backlog, paused {args.pause:g} s, then reading {args.read_seconds:g} s; "
            f"TCP_NOTSENT_LOWAT {args.notsent_lowat:,} bytes; median of {args.rounds} rounds"
        )
        say(
            f"{'server':>20} {'rate':>6} {'pong p50':>9} {'pong p99':>9} {'own p50':>8} "
            f"{'added p50':>10} {'added p99':>10} {'held p50':>9} {'vs raw':>7}"
        )
        for rate in rates:
            raw = _median(found.get(("raw-websockets", rate), [{"p50": math.nan}]), "p50")
            for server in servers:
                runs = found[(server, rate)]
                p50 = _median(runs, "p50")
                missing = sum(run["censored"] for run in runs)
                say(
                    f"{server:>20} {rate:>5g}/s {p50:>8.2f}s {_median(runs, 'p99'):>8.2f}s "
                    f"{_median(runs, 'own50'):>7.2f}s {_median(runs, 'added50'):>9.2f}s "
                    f"{_median(runs, 'added99'):>9.2f}s "
                    f"{_median(runs, 'held50') / 1024:>7.0f}KiB {p50 / raw:>6.2f}x"
                    + (f"  ({missing:g} pongs never came: counted as waited)" if missing else "")
                )


def _median(runs: list[dict[str, float]], key: str) -> float:
    return statistics.median(run[key] for run in runs)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--dsn", help="PostgreSQL DSN (default: an embedded server)")
    parser.add_argument("--quick", action="store_true", help="short run, under a minute")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--listeners", type=int, default=20)
    parser.add_argument("--backlog", type=int, default=10_000)
    parser.add_argument("--pause", type=float, default=5.0)
    parser.add_argument("--read-seconds", type=float, default=15.0)
    parser.add_argument("--rates", default="500,100", help="items/s each listener reads")
    parser.add_argument(
        "--pong-wait", type=float, default=60.0, help="seconds to wait for late pongs"
    )
    parser.add_argument(
        "--notsent-lowat",
        type=int,
        default=NOTSENT_LOWAT,
        help="TCP_NOTSENT_LOWAT bytes on the publisher's listening socket (not for "
        "asgi-host-default); compare settings by running the bench once per value",
    )
    parser.add_argument("--servers", default=",".join(SERVERS), help="which servers to run")
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.listeners, args.backlog = 1, 5, 3_000
        args.pause, args.read_seconds, args.rates, args.pong_wait = 0.5, 2.0, "500", 1.0
    return args


if __name__ == "__main__":
    asyncio.run(main(parse_args()))
