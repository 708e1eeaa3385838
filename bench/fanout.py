"""Fan-out throughput: deliveries per second to 100 listeners, end to end, beside raw websockets.

    python bench/fanout.py [--dsn DSN] [--quick] [--listeners 100] [--items 10000] [--rounds 3]
                           [--servers uvicorn-fast,uvicorn,uvicorn-0.35,hypercorn,granian]
                           [--baseline REF]

Measurements in one run, with the same client fleet (another process, see
bench/common.py) and the same number of ~200-byte change items:

* raw: a ``websockets`` asyncio server in this process that only calls
  ``websockets.broadcast`` for each item (no database, no queues: the floor
  of per-frame cost);
* the publisher on each server of ``--servers`` (bench/served_app.py, in a
  process of its own): uvicorn with the fast path (direct frame writes,
  ``changefeed.serving.FanoutWebSocketProtocol``), and uvicorn (the one
  installed here, and the oldest supported, 0.35, from a venv of its own made
  on first use), hypercorn and granian through plain ASGI sends. On each,
  batch listeners (entries committed with ``publish_many``, 1,000 per
  transaction, tailed, encoded once, queued per listener, sent as JSON arrays
  to listeners that registered with ``"batch": true``) and RFD 5 listeners
  (the same, one item per frame).

Each figure is deliveries/s = listeners x items / (time the last listener got
its last item - time the first item was written or broadcast), the median of
``--rounds`` rounds, printed with its ratio to the raw figure, and the server's
CPU (all its processes) per delivery. Every round starts each server's
publisher afresh.

With ``--baseline REF`` (a commit, branch or tag) every round also runs the
publisher of REF (a worktree of it, its served app and its package) on the
same server, in turn with this tree's, alternating which goes first; each
line of this tree then also prints ``this tree / baseline``, the median of
the round-by-round ratios (an interleaved A/B: the pairs cancel the load
other processes put on the machine).

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
from pathlib import Path
from typing import Any

import asyncpg
import orjson
from common import (
    SERVERS,
    ClientFleet,
    PublisherProcess,
    baseline_tree,
    cpu_seconds,
    database,
    paired,
    publisher_process,
    raise_nofile,
    say,
    this_commit,
    until,
)
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
    """CPU seconds of the server and of the fleet over one round."""

    def __init__(self, fleet: ClientFleet, server_cpu: Callable[[], float] = cpu_seconds) -> None:
        self.fleet = fleet
        self.server_cpu = server_cpu
        self.server = server_cpu()
        self.client = cpu_seconds(fleet.pid)
        self.started = time.monotonic()

    def figure(self, report: dict[str, Any], listeners: int, items: int) -> Figure:
        server = self.server_cpu() - self.server
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


def publisher_settings(queue_size: int) -> dict[str, Any]:
    return {
        "schema": SCHEMA,
        "retention": False,
        "queue_size": queue_size,
        "create_schema": False,
    }


async def measure_publisher(
    fleet: ClientFleet,
    served: PublisherProcess,
    dsn: str,
    listeners: int,
    ids: list[str],
    *,
    batch: bool,
) -> Figure:
    writer = await asyncpg.connect(dsn)
    try:
        await fleet.connect(served.ws_url, listeners, registration(batch))
        await until_served(served, listeners)
        await fleet.reset(len(ids))
        meter = Meter(fleet, served.cpu_seconds)
        for i in range(0, len(ids), WRITE_CHUNK):
            async with writer.transaction():
                chunk = [("vm", ["nic"], x) for x in ids[i : i + WRITE_CHUNK]]
                await publish_many(writer, chunk, schema=SCHEMA)
        report = await fleet.wait(120)
        figure = meter.figure(report, listeners, len(ids))
        evicted = (await served.stats())["counters"]["evictions"]
        await fleet.close_all()
        await until_served(served, 0)
        if evicted:
            raise RuntimeError(f"{evicted} listeners were evicted: raise --queue-size")
    finally:
        await writer.close()
    return figure


async def until_served(served: PublisherProcess, listeners: int, timeout: float = 30) -> None:
    """Wait until the publisher has ``listeners`` registered listeners."""
    async with asyncio.timeout(timeout):
        # Another process: its stats are what there is to poll.
        while await served.listeners() != listeners:  # noqa: ASYNC110
            await asyncio.sleep(0.05)


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
    every = "[" + ", ".join(f"{f.rate:,.0f}" for f in figures) + "]"
    return median(figures), every


Key = tuple[str, bool, str]
"""A measured configuration: server, batch listeners or not, and which tree."""

TREES = ("this tree", "baseline")


async def main(args: argparse.Namespace) -> None:
    raise_nofile(4096)
    listeners = args.listeners
    items = args.items if args.items else (2000 if args.quick else 10000)
    rounds = args.rounds if args.rounds else (1 if args.quick else 3)
    ids = [str(uuid.uuid4()) for _ in range(items)]
    frames = sample_frames(ids)
    size = statistics.mean(len(f) for f in frames)
    say(f"fanout: {listeners} listeners, {items} items of {size:.0f} bytes, {rounds} round(s)")
    with contextlib.ExitStack() as stack:
        base = stack.enter_context(baseline_tree(args.baseline)) if args.baseline else None
        trees: list[tuple[str, Path | None]] = [(TREES[0], None)]
        if base is not None:
            trees.append((TREES[1], base[0]))
            say(f"  this tree {this_commit()}, baseline {args.baseline} ({base[1]}), in turn")
        with database(args.dsn) as dsn:
            admin = await asyncpg.connect(dsn)
            try:
                await admin.execute(f"DROP SCHEMA IF EXISTS {SCHEMA} CASCADE")
                await apply_schema(admin, SCHEMA)
                async with ClientFleet() as fleet:
                    raw, every = await median_of(
                        rounds, lambda: measure_raw(fleet, listeners, frames)
                    )
                    say(
                        f"  raw websockets.broadcast   {raw.rate:>10,.0f} deliveries/s         "
                        f"{cpu(raw)}  {every}"
                    )
                    results = await measure_servers(
                        fleet,
                        dsn,
                        servers=args.servers.split(","),
                        trees=trees,
                        rounds=rounds,
                        listeners=listeners,
                        ids=ids,
                        raw=raw,
                    )
            finally:
                with contextlib.suppress(Exception):
                    await admin.execute(f"DROP SCHEMA IF EXISTS {SCHEMA} CASCADE")
                await admin.close()
    summary(results, raw, base is not None)


async def measure_servers(
    fleet: ClientFleet,
    dsn: str,
    *,
    servers: list[str],
    trees: list[tuple[str, Path | None]],
    rounds: int,
    listeners: int,
    ids: list[str],
    raw: Figure,
) -> dict[Key, list[Figure]]:
    """Each server's rounds, every tree once a round, each in a publisher process
    of its own; each server's figures printed once its rounds are done."""
    settings = publisher_settings(max(len(ids) + 1000, 4096))
    results: dict[Key, list[Figure]] = {}
    for server in servers:
        for n in range(rounds):
            # Alternate which tree goes first, so that neither always follows the
            # other's load.
            for label, tree in trees if n % 2 == 0 else trees[::-1]:
                async with publisher_process(server, dsn, settings, tree) as served:
                    for batch in (True, False):
                        figure = await measure_publisher(
                            fleet, served, dsn, listeners, ids, batch=batch
                        )
                        results.setdefault((server, batch, label), []).append(figure)
        for batch in (True, False):
            for label, _ in trees:
                report(results, (server, batch, label), raw=raw, ab=len(trees) > 1)
    return results


def median(figures: list[Figure]) -> Figure:
    return Figure(
        statistics.median(f.rate for f in figures),
        statistics.median(f.server_cpu for f in figures),
        statistics.median(f.client_cpu for f in figures),
    )


def report(results: dict[Key, list[Figure]], key: Key, *, raw: Figure, ab: bool) -> None:
    server, batch, label = key
    figures = results[key]
    figure = median(figures)
    every = "[" + ", ".join(f"{f.rate:,.0f}" for f in figures) + "]"
    kind = "batch listeners" if batch else "RFD 5 listeners"
    title = f"{SERVERS[server]} ({label})" if ab else SERVERS[server]
    line = (
        f"  {title:<{40 if ab else 28}} {kind:<16} {figure.rate:>10,.0f} "
        f"deliveries/s  {figure.rate / raw.rate:5.2f}x raw  {cpu(figure)}  {every}"
    )
    if ab and label == TREES[0]:
        bases = [f.rate for f in results[server, batch, TREES[1]]]
        line += f"  this tree / baseline {paired([f.rate for f in figures], bases):.2f}x by pair"
    say(line)


def summary(results: dict[Key, list[Figure]], raw: Figure, ab: bool) -> None:
    parts = [f"raw {raw.rate:,.0f}/s"]
    for (server, batch, label), figures in results.items():
        if label != TREES[0]:
            continue
        figure = median(figures)
        part = (
            f"{SERVERS[server]}, {'batch' if batch else 'RFD 5'}: {figure.rate:,.0f}/s "
            f"({figure.rate / raw.rate:.2f}x raw, {figure.server_cpu:.2f} us/delivery"
        )
        if ab:
            bases = [f.rate for f in results[server, batch, TREES[1]]]
            part += f", {paired([f.rate for f in figures], bases):.2f}x baseline by pair"
        parts.append(part + ")")
    fast, plain = ("uvicorn-fast", False, TREES[0]), ("uvicorn", False, TREES[0])
    if fast in results and plain in results:
        parts.append(
            "RFD 5 listeners on uvicorn: plain ASGI costs "
            f"{median(results[plain]).server_cpu / median(results[fast]).server_cpu:.1f}x "
            "the fast path's CPU"
        )
    say("result: " + "; ".join(parts))


def cpu(figure: Figure) -> str:
    return f"cpu/delivery: server {figure.server_cpu:5.2f} us, clients {figure.client_cpu:5.2f} us"


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--dsn", help="PostgreSQL DSN (default: an embedded server)")
    parser.add_argument("--quick", action="store_true", help="small run, under 30 s")
    parser.add_argument("--listeners", type=int, default=100)
    parser.add_argument("--items", type=int, default=0, help="items per round")
    parser.add_argument("--rounds", type=int, default=0)
    parser.add_argument(
        "--servers", default=",".join(SERVERS), help="servers to run the publisher on, in order"
    )
    parser.add_argument(
        "--baseline",
        metavar="REF",
        help="also measure this commit's publisher, in turn with this tree's",
    )
    return parser.parse_args()


if __name__ == "__main__":
    import uvloop

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        runner.run(main(parse_args()))
