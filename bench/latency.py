"""End-to-end latency: commit -> listener receives, at a steady rate of changes.

    python bench/latency.py [--dsn DSN] [--quick] [--rate 1000] [--seconds 10] [--listeners 100]
                            [--history 100000]
                            [--servers uvicorn-fast,uvicorn,uvicorn-0.35,hypercorn,granian]
    python bench/latency.py --sweep 1,10,25,50,100 [--rate 1000] [--seconds 10]

A writer process commits one change per transaction at ``--rate`` per second
(its own process, so that its round trips never share an event loop with
what is measured), each change one statement in its own transaction. For
each change it notes the time just before it sends that statement; latency
is the time the change reaches the other side minus that, so it includes the
INSERT and the COMMIT themselves.

* floor: the writer INSERTs a row and NOTIFYs in one statement; a LISTENing
  asyncpg connection in this process receives the notification. Nothing can
  be faster than this: it is what wakes the publisher's tailer.
* raw fan-out: no database; a ``websockets`` server in this process calls
  ``websockets.broadcast`` with each change at the same rate, to the same
  listeners: what one frame per change per listener costs on this machine,
  whatever the framework (latency from the broadcast call).
* publisher: the writer calls ``changefeed.publish`` (the same INSERT +
  NOTIFY); the publisher in this process tails the entry and
  fans it out to ``--listeners`` websocket listeners in a third process
  (bench/common.py), which note when each item arrives. Measured with batch
  listeners (what changefeed.listener negotiates) and with RFD 5 listeners.
  Beside it, where the time goes inside the publisher: commit to the start of
  the change's fan-out (against the floor), and how long one flush to every
  listener takes. The feed holds ``--history`` older entries, analysed, as a
  feed in service does.

* per server: the same publisher on each server of ``--servers``
  (bench/served_app.py, in a process of its own): uvicorn with the fast path
  (direct frame writes), and uvicorn (the one installed here, and the oldest
  supported, 0.35, from a venv of its own made on first use), hypercorn and
  granian through plain ASGI sends; batch and RFD 5 listeners, with the server's CPU (all its
  processes) per change.

``--sweep`` measures, for each listener count, the raw fan-out and the
publisher with batch listeners at the same rate (the floor once), and prints a
sizing table: how many listeners one publisher process serves within the
targets on this machine.

Clocks: CLOCK_MONOTONIC, shared by all processes of the machine. The first
5% of changes are a warm-up and not counted. Targets (2-core machine): p50 <=
2 ms, p99 <= 10 ms.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import multiprocessing
import os
import time
import uuid
from collections.abc import AsyncIterator
from multiprocessing.connection import Connection
from typing import Any

import asyncpg
import msgspec
import orjson
from common import (
    SERVERS,
    ClientFleet,
    PublisherProcess,
    cpu_seconds,
    database,
    percentile,
    publisher_process,
    raise_nofile,
    readable,
    say,
    serve_publisher,
    until,
)

from changefeed.publisher import Publisher, PublisherConfig, ResourceConfig
from changefeed.schemas import apply_schema, quote_schema

SCHEMA = "changefeed_bench"
VM = ResourceConfig("vm", "/vms", ("nic", "alias"))
FLOOR_CHANNEL = "changefeed_bench_floor"
WARMUP = 0.05


# --------------------------------------------------------------------------- the writer process


async def _write(dsn: str, kind: str, rate: float, count: int, start_at: float) -> list[float]:
    conn = await asyncpg.connect(dsn)
    q = quote_schema(SCHEMA)
    # One statement per change, its own transaction: a single round trip, so
    # that the writer (the API in this picture) takes as little of the
    # machine's two cores as it can, away from what is measured.
    if kind == "floor":
        statement = (
            f"WITH row AS (INSERT INTO {q}.floor (v) VALUES ($1) RETURNING id)"
            " SELECT pg_notify($2, $3) FROM row"
        )
    else:
        statement = f"SELECT {q}.publish('vm', ARRAY['nic'], $1)"
    sent_at: list[float] = []
    pad = uuid.uuid4().hex
    try:
        await asyncio.sleep(max(0.0, start_at - time.monotonic()))
        for seq in range(count):
            due = start_at + seq / rate
            delay = due - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            value = f"lat-{seq}-{pad}"
            sent_at.append(time.monotonic())
            if kind == "floor":
                await conn.execute(statement, value, FLOOR_CHANNEL, str(seq))
            else:
                await conn.execute(statement, value)
    finally:
        await conn.close()
    return sent_at


def _writer_main(conn: Connection, dsn: str, kind: str, rate: float, count: int) -> None:
    import uvloop

    start_at = conn.recv()
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        conn.send(runner.run(_write(dsn, kind, rate, count, start_at)))


async def run_writer(dsn: str, kind: str, rate: float, count: int) -> list[float]:
    """Run the paced writer in its own process; the times just before each COMMIT."""
    context = multiprocessing.get_context("spawn")
    here, there = context.Pipe()
    process = context.Process(target=_writer_main, args=(there, dsn, kind, rate, count))
    process.start()
    there.close()
    try:
        here.send(time.monotonic() + 1.5)  # the child needs a moment to import and connect
        await readable(here, 30 + 2 * count / rate, "the writer did not finish")
        sent_at: list[float] = here.recv()
        return sent_at
    finally:
        process.join(10)
        if process.is_alive():
            process.kill()


def busy_cpus() -> tuple[float, float]:
    """CPU seconds the whole machine has spent busy so far (every process, the
    kernel, PostgreSQL), and the seconds the hypervisor gave its CPUs to other
    guests (steal: on a shared host, the noise in every figure), from /proc/stat."""
    with open("/proc/stat") as f:
        user, nice, system, _idle, _iowait, irq, softirq, steal = map(
            int, f.readline().split()[1:9]
        )
    tick = os.sysconf("SC_CLK_TCK")
    return (user + nice + system + irq + softirq) / tick, steal / tick


async def prepare_database(conn: asyncpg.Connection, history: int) -> None:
    """A fresh feed schema with ``history`` older entries, and the floor's table."""
    await conn.execute(f"DROP SCHEMA IF EXISTS {SCHEMA} CASCADE")
    await apply_schema(conn, SCHEMA)
    await fill_history(conn, history)
    await conn.execute(f"CREATE TABLE {SCHEMA}.floor (id bigserial PRIMARY KEY, v text)")


async def fill_history(conn: asyncpg.Connection, entries: int) -> None:
    """A feed that has been running: ``entries`` older entries, analysed (as
    autovacuum would have done), so that the tailer's reads meet the table, its
    index and its statistics as they are in service, not an empty table."""
    q = quote_schema(SCHEMA)
    for start in range(0, entries, 10_000):
        n = min(10_000, entries - start)
        await conn.execute(
            f"SELECT {q}.publish_many(array_fill('vm'::text, ARRAY[$1::int]),"
            " array_fill('nic'::text, ARRAY[$1::int]),"
            " ARRAY(SELECT 'history-' || g FROM generate_series($2::int, $2::int + $1 - 1) g))",
            n,
            start,
        )
    await conn.execute(f"ANALYZE {q}.feed")


def summary(latencies: list[float]) -> dict[str, float]:
    latencies = sorted(latencies)
    return {
        "count": len(latencies),
        "p50": percentile(latencies, 0.5),
        "p90": percentile(latencies, 0.9),
        "p99": percentile(latencies, 0.99),
        "max": latencies[-1] if latencies else float("nan"),
    }


def line(label: str, figures: dict[str, Any]) -> str:
    return (
        f"  {label:<34} p50 {figures['p50'] * 1e3:6.2f} ms  p90 {figures['p90'] * 1e3:6.2f} ms  "
        f"p99 {figures['p99'] * 1e3:6.2f} ms  max {figures['max'] * 1e3:7.2f} ms  "
        f"({figures['count']:,} deliveries)"
    )


# --------------------------------------------------------------------------- measurements


async def measure_floor(dsn: str, rate: float, count: int) -> dict[str, float]:
    received: dict[int, float] = {}
    listener = await asyncpg.connect(dsn)

    def notified(_conn: object, _pid: int, _channel: str, payload: object) -> None:
        received[int(str(payload))] = time.monotonic()

    try:
        await listener.add_listener(FLOOR_CHANNEL, notified)
        sent_at = await run_writer(dsn, "floor", rate, count)
        await until(lambda: len(received) >= count, 10)
    finally:
        await listener.close()
    skip = int(count * WARMUP)
    return summary([received[i] - sent_at[i] for i in range(skip, count) if i in received])


async def measure_broadcast(
    fleet: ClientFleet, listeners: int, *, rate: float, count: int
) -> dict[str, Any]:
    from fanout import raw_server, sample_frames
    from websockets.asyncio.server import broadcast

    pad = uuid.uuid4().hex
    frames = sample_frames([f"lat-{seq}-{pad}" for seq in range(count)])
    async with raw_server() as (url, connections):
        registration = orjson.dumps({"instance": "i", "service": "bench"}).decode()
        await fleet.connect(url, listeners, registration, latency_slots=count)
        await until(lambda: len(connections) >= listeners, 30)
        await fleet.reset(count)
        sent_at: list[float] = []
        start = time.monotonic() + 0.1
        for seq, frame in enumerate(frames):
            delay = start + seq / rate - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            sent_at.append(time.monotonic())
            broadcast(connections, frame)
        report = await fleet.wait(60)
        if not report["complete"]:
            raise RuntimeError(f"incomplete: {sum(report['items'])} of {listeners * count}")
        skip = int(count * WARMUP)
        figures: dict[str, Any] = await fleet.latencies([float("inf")] * skip + sent_at[skip:])
        figures["count"] = listeners * (count - skip)
        await fleet.close_all()
    return figures


@contextlib.asynccontextmanager
async def running_publisher(
    dsn: str, send_interval: float | None = None
) -> AsyncIterator[tuple[str, Publisher]]:
    config = PublisherConfig(
        dsn=dsn, schema=SCHEMA, resources=(VM,), retention=False, create_schema=False
    )
    if send_interval is not None:
        config = msgspec.structs.replace(config, send_interval=send_interval)
    async with serve_publisher(config) as served:
        yield served


async def measure_publisher(
    fleet: ClientFleet,
    dsn: str,
    listeners: int,
    *,
    rate: float,
    count: int,
    batch: bool,
    send_interval: float | None = None,
) -> dict[str, Any]:
    registration: dict[str, Any] = {
        "instance": str(uuid.uuid4()),
        "service": "bench",
        "changeKind": {"resource": "vm", "subResources": ["nic"]},
    }
    if batch:
        registration["batch"] = True
    async with running_publisher(dsn, send_interval) as (url, publisher):
        frame = orjson.dumps(registration).decode()
        await fleet.connect(url, listeners, frame, latency_slots=count)
        await until(lambda: len(publisher.registry) >= listeners, 30)
        await fleet.reset(count)
        dispatched_at, flush_seconds = _instrument(publisher)
        server_cpu, client_cpu = cpu_seconds(), cpu_seconds(fleet.pid)
        machine_cpu, steal = busy_cpus()
        sent_at = await run_writer(dsn, "publish", rate, count)
        report = await fleet.wait(30)
        server_cpu = cpu_seconds() - server_cpu
        client_cpu = cpu_seconds(fleet.pid) - client_cpu
        machine_after, steal_after = busy_cpus()
        machine_cpu, steal = machine_after - machine_cpu, steal_after - steal
        if not report["complete"]:
            raise RuntimeError(f"incomplete: {sum(report['items'])} of {listeners * count} items")
        skip = int(count * WARMUP)
        figures: dict[str, Any] = await fleet.latencies([float("inf")] * skip + sent_at[skip:])
        figures["count"] = listeners * (count - skip)
        figures["tailer"] = publisher.tailer.stats()
        figures["frames"] = publisher.stats()["counters"]["frames"]
        figures["server_cpu"] = server_cpu / count
        figures["client_cpu"] = client_cpu / count
        figures["machine_cpu"] = machine_cpu / count
        figures["steal"] = steal / count
        figures["to_dispatch"] = summary(
            [dispatched_at[i] - sent_at[i] for i in range(skip, count) if i in dispatched_at]
        )
        figures["flush"] = summary(flush_seconds)
        await fleet.close_all()
    return figures


async def measure_served(
    fleet: ClientFleet,
    served: PublisherProcess,
    dsn: str,
    listeners: int,
    *,
    rate: float,
    count: int,
    batch: bool,
) -> dict[str, Any]:
    """End-to-end latency through a publisher served by another process."""
    registration: dict[str, Any] = {
        "instance": str(uuid.uuid4()),
        "service": "bench",
        "changeKind": {"resource": "vm", "subResources": ["nic"]},
        "batch": batch,
    }
    await fleet.connect(served.ws_url, listeners, orjson.dumps(registration).decode(),
                        latency_slots=count)  # fmt: skip
    async with asyncio.timeout(30):
        # Another process: its stats are what there is to poll.
        while await served.listeners() < listeners:  # noqa: ASYNC110
            await asyncio.sleep(0.05)
    await fleet.reset(count)
    server_cpu = served.cpu_seconds()
    sent_at = await run_writer(dsn, "publish", rate, count)
    report = await fleet.wait(30)
    server_cpu = served.cpu_seconds() - server_cpu
    if not report["complete"]:
        raise RuntimeError(f"incomplete: {sum(report['items'])} of {listeners * count} items")
    skip = int(count * WARMUP)
    figures: dict[str, Any] = await fleet.latencies([float("inf")] * skip + sent_at[skip:])
    figures["count"] = listeners * (count - skip)
    figures["server_cpu"] = server_cpu / count
    await fleet.close_all()
    async with asyncio.timeout(30):
        while await served.listeners():  # noqa: ASYNC110
            await asyncio.sleep(0.05)
    return figures


async def measure_servers(
    args: argparse.Namespace, fleet: ClientFleet, dsn: str, count: int
) -> dict[tuple[str, bool], dict[str, Any]]:
    """Each server of ``--servers``, batch and RFD 5 listeners."""
    settings = {"schema": SCHEMA, "retention": False, "create_schema": False}
    if args.send_interval is not None:
        settings["send_interval"] = args.send_interval
    results = {}
    for server in args.servers.split(","):
        async with publisher_process(server, dsn, settings) as served:
            for label, batch in (("batch", True), ("RFD 5", False)):
                figures = await measure_served(
                    fleet, served, dsn, args.listeners, rate=args.rate, count=count, batch=batch
                )
                results[server, batch] = figures
                say(
                    line(f"{SERVERS[server]}, {label}", figures)
                    + f"  server cpu/change {figures['server_cpu'] * 1e6:.0f} us"
                )
    return results


def _instrument(publisher: Publisher) -> tuple[dict[int, float], list[float]]:
    """Where a change's time goes inside the publisher: when the tailer hands each
    entry to the fan-out, and what each flush (one frame per listener, in slices)
    cost. Wraps the tailer's sink and the flush histogram's ``observe``: bench
    instrumentation only."""
    dispatched_at: dict[int, float] = {}
    flush_seconds: list[float] = []
    tailer: Any = publisher.tailer
    sink = tailer._sink
    histogram: Any = publisher.broadcast.flush_seconds
    observe = histogram.observe

    def timed_sink(entries: Any) -> None:
        now = time.monotonic()
        for entry in entries:
            dispatched_at[int(entry.changed_resource_id.split("-")[1])] = now
        sink(entries)

    def timed_flush(seconds: float) -> None:
        flush_seconds.append(seconds)
        observe(seconds)

    tailer._sink = timed_sink
    histogram.observe = timed_flush
    return dispatched_at, flush_seconds


async def sweep(args: argparse.Namespace, counts: list[int], seconds: float) -> None:
    """The publisher (batch listeners) and the raw fan-out at each listener count."""
    count = int(args.rate * seconds)
    say(f"latency sweep: {args.rate:g} changes/s for {seconds:g} s at each of {counts} listeners")
    rows: list[tuple[int, dict[str, Any], dict[str, Any]]] = []
    with database(args.dsn) as dsn:
        admin = await asyncpg.connect(dsn)
        try:
            await prepare_database(admin, args.history)
            floor = await measure_floor(dsn, args.rate, count)
            say(line("floor: INSERT+NOTIFY -> LISTEN", floor))
            async with ClientFleet() as fleet:
                for listeners in counts:
                    raw = await measure_broadcast(fleet, listeners, rate=args.rate, count=count)
                    figures = await measure_publisher(
                        fleet, dsn, listeners, rate=args.rate, count=count, batch=True
                    )
                    rows.append((listeners, raw, figures))
                    say(line(f"{listeners} listeners: raw fan-out", raw))
                    say(line(f"{listeners} listeners: publisher", figures))
        finally:
            with contextlib.suppress(Exception):
                await admin.execute(f"DROP SCHEMA IF EXISTS {SCHEMA} CASCADE")
            await admin.close()
    say("")
    say(
        "  listeners | raw p50 / p99 (ms) | publisher p50 / p99 (ms) "
        "| cpu per change (us): publisher / machine"
    )
    within = []
    for listeners, raw, figures in rows:
        ok = figures["p50"] <= 0.002 and figures["p99"] <= 0.010
        if ok:
            within.append(listeners)
        say(
            f"  {listeners:>9} | {raw['p50'] * 1e3:6.2f} / {raw['p99'] * 1e3:6.2f}   "
            f"| {figures['p50'] * 1e3:6.2f} / {figures['p99'] * 1e3:6.2f}{' ok' if ok else '   '}"
            f"      | {figures['server_cpu'] * 1e6:5.0f} / {figures['machine_cpu'] * 1e6:5.0f}"
            f" (steal {figures['steal'] * 1e6:.0f})"
        )
    say(
        f"result: floor p50 {floor['p50'] * 1e3:.2f} ms; within p50 <= 2 ms and p99 <= 10 ms at "
        f"{args.rate:g} changes/s: {', '.join(map(str, within)) or 'none'} listeners"
    )


async def main(args: argparse.Namespace) -> None:
    raise_nofile(4096)
    seconds = args.seconds or (1.5 if args.quick else 10.0)
    if args.sweep:
        await sweep(args, [int(n) for n in args.sweep.split(",")], seconds)
        return
    count = int(args.rate * seconds)
    say(
        f"latency: {args.rate:g} changes/s for {seconds:g} s ({count} changes), "
        f"{args.listeners} listeners"
    )
    with database(args.dsn) as dsn:
        admin = await asyncpg.connect(dsn)
        try:
            await prepare_database(admin, args.history)
            floor = await measure_floor(dsn, args.rate, count)
            say(line("floor: INSERT+NOTIFY -> LISTEN", floor))
            async with ClientFleet() as fleet:
                raw = await measure_broadcast(fleet, args.listeners, rate=args.rate, count=count)
                say(line("raw fan-out: broadcast", raw))
                results = {}
                for label, batch in (("batch listeners", True), ("RFD 5 listeners", False)):
                    figures = await measure_publisher(
                        fleet,
                        dsn,
                        args.listeners,
                        rate=args.rate,
                        count=count,
                        batch=batch,
                        send_interval=args.send_interval,
                    )
                    results[label] = figures
                    say(line(f"publisher, {label}", figures))
                    tailer = figures["tailer"]
                    say(
                        f"    tailer: {tailer['doorbells']} doorbells, {tailer['polls']} reads, "
                        f"{figures['frames']:,} websocket frames; cpu per change: server "
                        f"{figures['server_cpu'] * 1e6:.0f} us, "
                        f"listeners {figures['client_cpu'] * 1e6:.0f} us, whole machine "
                        f"{figures['machine_cpu'] * 1e6:.0f} us (of {os.cpu_count()} cores; "
                        f"stolen by the host: {figures['steal'] * 1e6:.0f} us)"
                    )
                    to_dispatch, flush = figures["to_dispatch"], figures["flush"]
                    say(
                        f"    sent -> fan-out starts: p50 {to_dispatch['p50'] * 1e3:.2f} ms "
                        f"p99 {to_dispatch['p99'] * 1e3:.2f} ms (floor p50 "
                        f"{floor['p50'] * 1e3:.2f} ms); one flush to {args.listeners} listeners: "
                        f"p50 {flush['p50'] * 1e3:.2f} ms p99 {flush['p99'] * 1e3:.2f} ms "
                        f"({flush['count']:,} flushes)"
                    )
                say("  per server (the publisher in a process of its own):")
                # --quick: a quarter of a second on each, enough to see that each runs.
                each = int(args.rate // 4) if args.quick else count
                servers = await measure_servers(args, fleet, dsn, each)
        finally:
            with contextlib.suppress(Exception):
                await admin.execute(f"DROP SCHEMA IF EXISTS {SCHEMA} CASCADE")
            await admin.close()
    best = results["batch listeners"]
    say(
        f"result: floor p50 {floor['p50'] * 1e3:.2f} ms p99 {floor['p99'] * 1e3:.2f} ms; "
        f"publisher (batch) p50 {best['p50'] * 1e3:.2f} ms "
        f"({best['p50'] / floor['p50']:.1f}x floor, target <= 2 ms), "
        f"p99 {best['p99'] * 1e3:.2f} ms "
        f"({best['p99'] / floor['p99']:.1f}x floor, target <= 10 ms); "
        f"raw broadcast p50 {raw['p50'] * 1e3:.2f} ms p99 {raw['p99'] * 1e3:.2f} ms"
    )
    say(
        "result per server (p50 / p99 ms, batch; RFD 5): "
        + "; ".join(
            f"{SERVERS[server]} {figures['p50'] * 1e3:.2f} / {figures['p99'] * 1e3:.2f}"
            f"{'' if batch else ' (RFD 5)'}"
            for (server, batch), figures in servers.items()
        )
    )


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--dsn", help="PostgreSQL DSN (default: an embedded server)")
    parser.add_argument("--quick", action="store_true", help="short run, under 30 s")
    parser.add_argument("--rate", type=float, default=1000.0, help="changes per second")
    parser.add_argument("--seconds", type=float, default=0.0)
    parser.add_argument("--listeners", type=int, help="default: 100 (--quick: 20)")
    parser.add_argument(
        "--history",
        type=int,
        help="older entries in the feed, analysed (default: 100,000; --quick: 10,000)",
    )
    parser.add_argument(
        "--sweep", metavar="N,N,...", help="listener counts: a sizing table instead"
    )
    parser.add_argument(
        "--send-interval", type=float, help="publisher send_interval, seconds (default: config)"
    )
    parser.add_argument(
        "--servers", default=",".join(SERVERS), help="servers to run the publisher on, in order"
    )
    args = parser.parse_args()
    if args.listeners is None:
        args.listeners = 20 if args.quick else 100
    if args.history is None:
        args.history = 10_000 if args.quick else 100_000
    return args


if __name__ == "__main__":
    import uvloop

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        runner.run(main(parse_args()))
