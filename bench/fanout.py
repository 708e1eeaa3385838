"""Fan-out throughput: deliveries per second to 100 listeners, end to end, beside raw websockets.

    python bench/fanout.py [--dsn DSN] [--quick] [--listeners 100] [--items 10000] [--rounds 3]

Five measurements in one run, with the same client fleet (another process,
see bench/common.py) and the same number of ~200-byte change items:

* raw: a ``websockets`` asyncio server that only calls ``websockets.broadcast``
  for each item (no database, no queues: the floor of per-frame cost);
* publisher, batch listeners: entries committed with ``publish_many`` (1,000
  per transaction), tailed, encoded once, queued per listener, sent as JSON
  arrays to listeners that registered with ``"batch": true``;
* publisher, RFD 5 listeners: the same, one item per frame;
* the same two through ASGI sends: uvicorn's own websocket protocol, as on any
  server without changefeed's direct frame writes (``FanoutWebSocketProtocol``).

Each figure is deliveries/s = listeners x items / (time the last listener got
its last item - time the first item was written or broadcast), the median of
``--rounds`` rounds, printed with its ratio to the raw figure.

Without ``--dsn`` an embedded PostgreSQL is started (changefeed.embedded). With
``--dsn`` the bench works in its own schema, ``changefeed_bench``, and drops it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import statistics
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import asyncpg
import orjson
from common import ClientFleet, cpu_seconds, database, raise_nofile, say, serve_publisher, until
from websockets.asyncio.server import ServerConnection, broadcast, serve

from changefeed.publisher import Publisher, PublisherConfig, ResourceConfig, publish_many
from changefeed.publisher.feed import FeedEntry, FeedState
from changefeed.schemas import ORIGIN, Position, apply_schema

SCHEMA = "changefeed_bench"
VM = ResourceConfig("vm", "/vms", ("nic", "alias"))
WRITE_CHUNK = 1000


def registration(batch: bool) -> str:
    doc: dict[str, Any] = {
        "instance": str(uuid.uuid4()),
        "service": "bench",
        "changeKind": {"resource": "vm", "subResources": []},
    }
    if batch:
        doc["batch"] = True
    return orjson.dumps(doc).decode()


@dataclass
class Figure:
    rate: float
    server_cpu: float
    client_cpu: float


class Meter:
    """CPU seconds of this process (the server) and of the fleet over one round."""

    def __init__(self, fleet: ClientFleet) -> None:
        self.fleet = fleet
        self.server = cpu_seconds()
        self.client = cpu_seconds(fleet.pid)
        self.started = time.monotonic()

    def figure(self, report: dict[str, Any], listeners: int, items: int) -> Figure:
        server = cpu_seconds() - self.server
        client = cpu_seconds(self.fleet.pid) - self.client
        if not report["complete"]:
            got = sum(report["items"])
            raise RuntimeError(f"incomplete: {got} of {listeners * items} deliveries")
        deliveries = listeners * items
        elapsed = max(report["done_at"]) - self.started
        return Figure(deliveries / elapsed, server / deliveries * 1e6, client / deliveries * 1e6)


# --------------------------------------------------------------------------- raw websockets


@contextlib.asynccontextmanager
async def raw_server() -> AsyncIterator[tuple[str, set[ServerConnection]]]:
    """A websockets server that acks a registration and keeps the connection."""
    connections: set[ServerConnection] = set()
    ack = orjson.dumps({"bootstrapRoute": "/vms", "cursor": "-", "resumed": False}).decode()

    async def handler(ws: ServerConnection) -> None:
        await ws.recv()
        await ws.send(ack)
        connections.add(ws)
        try:
            await ws.wait_closed()
        finally:
            connections.discard(ws)

    async with serve(
        handler, "127.0.0.1", 0, compression=None, ping_interval=None, max_queue=4
    ) as server:
        port = next(iter(server.sockets)).getsockname()[1]
        yield f"ws://127.0.0.1:{port}/changefeeds", connections


async def measure_raw(fleet: ClientFleet, listeners: int, frames: list[str]) -> Figure:
    async with raw_server() as (url, connections):
        await fleet.connect(url, listeners, registration(False))
        await until(lambda: len(connections) >= listeners, 30)
        await fleet.reset(len(frames))
        meter = Meter(fleet)
        for i in range(0, len(frames), WRITE_CHUNK):
            for frame in frames[i : i + WRITE_CHUNK]:
                broadcast(connections, frame)
            await asyncio.sleep(0)
        report = await fleet.wait(120)
        figure = meter.figure(report, listeners, len(frames))
        await fleet.close_all()
    return figure


# --------------------------------------------------------------------------- publisher


@contextlib.asynccontextmanager
async def running_publisher(
    dsn: str, queue_size: int, asgi: bool = False
) -> AsyncIterator[tuple[str, Publisher]]:
    config = PublisherConfig(
        dsn=dsn,
        schema=SCHEMA,
        resources=(VM,),
        retention=False,
        queue_size=queue_size,
        create_schema=False,
    )
    async with serve_publisher(config, fast_path=not asgi) as served:
        yield served


async def measure_publisher(
    fleet: ClientFleet,
    dsn: str,
    listeners: int,
    ids: list[str],
    *,
    batch: bool,
    queue_size: int,
    asgi: bool = False,
) -> Figure:
    writer = await asyncpg.connect(dsn)
    try:
        async with running_publisher(dsn, queue_size, asgi) as (url, publisher):
            await fleet.connect(url, listeners, registration(batch))
            await until(lambda: len(publisher.registry) >= listeners, 30)
            await fleet.reset(len(ids))
            meter = Meter(fleet)
            for i in range(0, len(ids), WRITE_CHUNK):
                async with writer.transaction():
                    chunk = [("vm", ["nic"], x) for x in ids[i : i + WRITE_CHUNK]]
                    await publish_many(writer, chunk, schema=SCHEMA)
            report = await fleet.wait(120)
            figure = meter.figure(report, listeners, len(ids))
            evicted = publisher.stats()["counters"]["evictions"]
            await fleet.close_all()
        if evicted:
            raise RuntimeError(f"{evicted} listeners were evicted: raise --queue-size")
    finally:
        await writer.close()
    return figure


def sample_frames(ids: list[str]) -> list[str]:
    """Change items exactly as the publisher encodes them (same bytes on the wire).

    A publisher learns its feed's identity and cursor key from the database when
    its tailer connects; this one, never started, is given a made-up feed's."""
    publisher = Publisher(PublisherConfig(dsn="postgresql://unused", resources=(VM,)))
    publisher.identity.adopt(FeedState(uuid.uuid4(), os.urandom(32), ORIGIN, ORIGIN))
    now = datetime.now(UTC)
    return [
        publisher.broadcast.encode(FeedEntry(Position(10_000_000 + i, i), "vm", ("nic",), x, now))
        for i, x in enumerate(ids)
    ]


async def median_of(rounds: int, run: Callable[[], Awaitable[Figure]]) -> tuple[Figure, str]:
    figures = [await run() for _ in range(rounds)]
    median = Figure(
        statistics.median(f.rate for f in figures),
        statistics.median(f.server_cpu for f in figures),
        statistics.median(f.client_cpu for f in figures),
    )
    every = "[" + ", ".join(f"{f.rate:,.0f}" for f in figures) + "]"
    return median, every


async def main(args: argparse.Namespace) -> None:
    raise_nofile(4096)
    listeners = args.listeners
    items = args.items if args.items else (2000 if args.quick else 10000)
    rounds = args.rounds if args.rounds else (1 if args.quick else 3)
    queue_size = max(items + 1000, 4096)
    ids = [str(uuid.uuid4()) for _ in range(items)]
    frames = sample_frames(ids)
    size = statistics.mean(len(f) for f in frames)
    say(f"fanout: {listeners} listeners, {items} items of {size:.0f} bytes, {rounds} round(s)")
    with database(args.dsn) as dsn:
        admin = await asyncpg.connect(dsn)
        try:
            await admin.execute(f"DROP SCHEMA IF EXISTS {SCHEMA} CASCADE")
            await apply_schema(admin, SCHEMA)
            async with ClientFleet() as fleet:
                raw, every = await median_of(rounds, lambda: measure_raw(fleet, listeners, frames))
                say(
                    f"  raw websockets.broadcast   {raw.rate:>10,.0f} deliveries/s         "
                    f"{cpu(raw)}  {every}"
                )
                results = {}
                for label, batch, asgi in (
                    ("batch listeners", True, False),
                    ("RFD 5 listeners", False, False),
                    ("batch, ASGI sends", True, True),
                    ("RFD 5, ASGI sends", False, True),
                ):
                    figure, every = await median_of(
                        rounds,
                        lambda batch=batch, asgi=asgi: measure_publisher(
                            fleet,
                            dsn,
                            listeners,
                            ids,
                            batch=batch,
                            queue_size=queue_size,
                            asgi=asgi,
                        ),
                    )
                    results[label] = figure.rate
                    say(
                        f"  publisher, {label:<17} {figure.rate:>10,.0f} deliveries/s  "
                        f"{figure.rate / raw.rate:5.2f}x raw  {cpu(figure)}  {every}"
                    )
        finally:
            with contextlib.suppress(Exception):
                await admin.execute(f"DROP SCHEMA IF EXISTS {SCHEMA} CASCADE")
            await admin.close()
    batch, single = results["batch listeners"], results["RFD 5 listeners"]
    say(
        f"result: raw {raw.rate:,.0f}/s; publisher with batch listeners {batch:,.0f}/s "
        f"({batch / raw.rate:.2f}x raw, target >= 0.8x); "
        f"with RFD 5 listeners {single:,.0f}/s ({single / raw.rate:.2f}x raw); through ASGI "
        f"sends {results['batch, ASGI sends'] / raw.rate:.2f}x and "
        f"{results['RFD 5, ASGI sends'] / raw.rate:.2f}x raw"
    )


def cpu(figure: Figure) -> str:
    return f"cpu/delivery: server {figure.server_cpu:5.2f} us, clients {figure.client_cpu:5.2f} us"


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--dsn", help="PostgreSQL DSN (default: an embedded server)")
    parser.add_argument("--quick", action="store_true", help="small run, under 30 s")
    parser.add_argument("--listeners", type=int, default=100)
    parser.add_argument("--items", type=int, default=0, help="items per round")
    parser.add_argument("--rounds", type=int, default=0)
    return parser.parse_args()


if __name__ == "__main__":
    import uvloop

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        runner.run(main(parse_args()))
