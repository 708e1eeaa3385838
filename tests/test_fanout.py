"""Fan-out: fairness, slow listeners, memory, recovery, shutdown, observability.

The pure parts are tested in test_delivery_core.py. These scenarios run a
publisher on real uvicorn and real PostgreSQL; the many-listener sides come
from a ClientFleet (bench/common.py) in another process, so that their load
never shares this process's event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import socket
import statistics
import sys
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import asyncpg
import httpx
import orjson
import pytest
import uvicorn
from helpers import LogRecords, metric_value, wait_until
from publisher_fixtures import (
    NETWORK,
    VM,
    WS_PROTOCOLS,
    PublisherUnderTest,
    connect_not_reading,
    receive_items,
    register,
    registration,
    running_publisher,
    write,
)
from servers import RunningServer, leave_signals_to_pytest
from starlette.applications import Starlette
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed

from changefeed.publisher import Publisher, PublisherConfig, publish_many
from changefeed.publisher.delivery import Delivery
from changefeed.publisher.matching import Interest
from changefeed.publisher.scheduler import FlushScheduler, LoopClock
from changefeed.schemas import ChangeKind, CloseCode, Position

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
from common import ClientFleet, rss_bytes

# --------------------------------------------------------------------------- scheduling


def _spin(seconds: float) -> None:
    """Hold the event loop's thread for ``seconds``: stands in for socket writes."""
    until = time.perf_counter() + seconds
    while time.perf_counter() < until:
        pass


def test_a_doorbell_mid_flush_wakes_the_tailer_before_the_next_slice() -> None:
    """A doorbell that rings while a flush is being written wakes the tailer
    before the flush writes its next slice: the tailer's two steps (asyncpg's
    notification callback, then the tailer task it wakes) run ahead of the
    slice, so a read never queues behind the rest of the flush. Pure
    scheduling on uvloop, the loop publishers run on; a socket pair stands in
    for the tailer's connection."""
    import uvloop

    async def scenario() -> list[object]:
        scheduler = FlushScheduler(LoopClock(), send_interval=0.002, report=lambda *_: None)
        loop = asyncio.get_running_loop()
        order: list[object] = []
        bell, ring_it = socket.socketpair()
        bell.setblocking(False)
        woken = asyncio.Event()

        async def tailer() -> None:
            await woken.wait()
            order.append("tailer woke")

        task = asyncio.create_task(tailer())
        await asyncio.sleep(0)

        def on_notification() -> None:  # asyncpg: call_soon(listener callback)
            bell.recv(1)
            loop.call_soon(woken.set)  # Tailer.ring: wakes the tailer task

        loop.add_reader(bell.fileno(), on_notification)

        def writer(index: int) -> Callable[[], bool]:
            def send_now() -> bool:
                _spin(0.0001)
                order.append(index)
                if index == 5:
                    ring_it.send(b"x")  # the doorbell rings mid-flush
                return True

            return send_now

        interest = Interest([ChangeKind("vm", ())])
        deliveries = [
            Delivery(interest, Position(0, 0), Position(0, 0), capacity=10) for _ in range(40)
        ]
        for index, delivery in enumerate(deliveries):
            delivery.send_now = writer(index)
        flush_slice = scheduler._slice

        def traced_slice(flush: Any) -> None:
            order.append("slice")
            flush_slice(flush)

        scheduler._slice = traced_slice  # type: ignore[method-assign]
        scheduler.add(deliveries)
        try:
            await asyncio.wait_for(scheduler.idle.wait(), 5)
            await asyncio.wait_for(task, 5)
        finally:
            loop.remove_reader(bell.fileno())
            bell.close()
            ring_it.close()
        return order

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        order = runner.run(scenario())
    assert sorted(x for x in order if isinstance(x, int)) == list(range(40))
    rang = order.index(5)
    next_slice = order.index("slice", rang)
    assert rang < order.index("tailer woke") < next_slice, order


# --------------------------------------------------------------------------- scenarios


async def _publish(dsn: str, ids: list[str], chunk: int = 1000) -> None:
    conn = await asyncpg.connect(dsn)
    try:
        for i in range(0, len(ids), chunk):
            await publish_many(conn, [("vm", ["nic"], x) for x in ids[i : i + chunk]])
    finally:
        await conn.close()


def _fleet_registration(batch: bool) -> str:
    doc = {
        "instance": str(uuid.uuid4()),
        "service": "fleet",
        "changeKind": {"resource": "vm", "subResources": []},
        "batch": batch,
    }
    return orjson.dumps(doc).decode()


@pytest.mark.parametrize("ws", ["direct", "asgi"])
@pytest.mark.parametrize("batch", [True, False], ids=["batch", "rfd5"])
async def test_a_burst_reaches_100_listeners_fairly(feed_dsn: str, batch: bool, ws: str) -> None:
    """100 listeners, one burst: every one gets every item, none is starved: the
    first items reach every listener early, and the last ones reach all of them
    within a short spread (the send loops take turns), whether frames go out as
    direct writes or as ASGI sends."""
    items = 3000 if batch else 1000
    async with (
        running_publisher(feed_dsn, ws=ws, queue_size=items + 1000) as pub,
        ClientFleet() as fleet,
    ):
        result = await fleet.connect(pub.ws_url, 100, _fleet_registration(batch))
        assert result["connected"] == 100
        await wait_until(lambda: len(pub.publisher.registry) == 100)
        await fleet.reset(items)
        with frozen_heap():
            await _publish(feed_dsn, [f"burst-{i}" for i in range(items)])
            report = await fleet.wait(120)
        assert report["complete"] and report["items"] == [items] * 100
        # Times from the first delivery to anyone: the fan-out's own, not the
        # INSERT's and COMMIT's before it (on a busy machine they take longer
        # than the whole fan-out).
        began = min(report["first_at"])
        done = sorted(t - began for t in report["done_at"])
        first = sorted(t - began for t in report["first_at"])
        total = done[-1]
        spread = done[-1] - done[0]
        print(
            f"\n{'batch' if batch else 'RFD 5'}: {items} items x 100 listeners in "
            f"{total:.2f}s ({100 * items / total:,.0f} deliveries/s); completion spread "
            f"{spread * 1000:.0f} ms ({spread / total:.0%}), first item: median "
            f"{statistics.median(first) * 1000:.0f} ms, last listener {first[-1] * 1000:.0f} ms"
        )
        # Nobody waits for everybody else to finish first: the last listener to
        # get its first item gets it before half of the burst's time, and
        # everyone finishes close together.
        assert first[-1] <= 0.5 * total + 0.05
        assert spread <= 0.5 * total + 0.05
        assert pub.publisher.stats()["counters"]["evictions"] == 0


async def test_the_tailer_reads_on_only_once_every_listener_had_its_turn(feed_dsn: str) -> None:
    """In a burst of several tail batches, the tailer reads (and encodes) the next
    batch only once the flush of the last one has reached every listener: reading
    ahead between the flush's slices would leave the listeners at the end of that
    flush waiting for it, and fill every queue faster than it is written out."""
    async with (
        running_publisher(feed_dsn, tail_batch=500, queue_size=5000) as pub,
        ClientFleet() as fleet,
    ):
        result = await fleet.connect(pub.ws_url, 50, _fleet_registration(True))
        assert result["connected"] == 50
        registry = pub.publisher.registry
        await wait_until(lambda: len(registry) == 50)
        # Listeners not yet written to, each time the tailer hands over a batch.
        unserved: list[int] = []
        tailer: Any = pub.publisher.tailer
        sink = tailer._sink

        def counting_sink(entries: Any) -> None:
            unserved.append(sum(1 for session in registry if session.delivery.sent == 0))
            sink(entries)

        tailer._sink = counting_sink
        await fleet.reset(2000)
        await _publish(feed_dsn, [f"ahead-{i}" for i in range(2000)], chunk=2000)
        report = await fleet.wait(60)
        assert report["complete"] and report["items"] == [2000] * 50
        assert len(unserved) >= 4 and unserved[0] == 50
        assert unserved[1:] == [0] * (len(unserved) - 1)
        # Operators see the tailer being paced by the fan-out.
        waited = pub.publisher.tailer.stats()["fanoutWaitSeconds"]
        assert waited > 0
        async with httpx.AsyncClient(base_url=pub.server.url) as http:
            metrics = (await http.get("/metrics")).text
        total = metric_value(metrics, "changefeed_tailer_fanout_wait_seconds_total")
        assert total == pytest.approx(waited, abs=1e-6)


@contextlib.contextmanager
def frozen_heap() -> Iterator[None]:
    """Take everything alive now out of the garbage collector's view, as a served
    publisher process does (changefeed.collector.tune_collector). In this test
    process a full collection walks pytest's whole heap: 40-150 ms on the CI
    machine, a stop of the publisher in the middle of a burst that looks
    exactly like one listener being served before the others."""
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


class SlowListener:
    """A minimal RFD 5 listener that can stop reading, then reconnects and resumes
    from the last cursor it saw, the way a listener recovers from eviction."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.ws: ClientConnection | None = None
        self.cursor: str | None = None
        self.ids: list[str] = []

    async def connect(self, *, batch: bool = False) -> None:
        self.ws = await connect_not_reading(self.url)
        await self.ws.send(registration(subs=[], batch=batch))
        ack = orjson.loads(await asyncio.wait_for(self.ws.recv(), 10))
        self.cursor = ack["cursor"]

    async def read(self, expected: int, timeout: float) -> None:
        """Read again until ``expected`` items in all, checking feed order as it goes."""
        assert self.ws is not None
        async with asyncio.timeout(timeout):
            while len(self.ids) < expected:
                for doc in _items_in(await self.ws.recv()):
                    self.ids.append(doc["changedResourceId"])
                    self.cursor = doc["cursor"]

    async def read_until_closed(self, timeout: float) -> tuple[list[str], int | None]:
        """Read again: what is buffered, then the error frame and the close."""
        assert self.ws is not None
        errors: list[str] = []
        with pytest.raises(ConnectionClosed) as closed:
            async with asyncio.timeout(timeout):
                while True:
                    doc = orjson.loads(await self.ws.recv())
                    if "error" in doc:
                        errors.append(doc["error"]["code"])
                    else:
                        self.ids.append(doc["changedResourceId"])
                        self.cursor = doc["cursor"]
        rcvd = closed.value.rcvd
        return errors, rcvd.code if rcvd is not None else None

    async def resume(self, expected: int, timeout: float) -> bool:
        """Register again from the last cursor; read until ``expected`` ids in all."""
        ws, ack = await register(self.url, registration(subs=[], since=self.cursor))
        try:
            async with asyncio.timeout(timeout):
                while len(self.ids) < expected:
                    for item in await receive_items(ws, 1, timeout):
                        self.ids.append(item["changedResourceId"])
        finally:
            await ws.close()
        resumed: bool = ack["resumed"]
        return resumed


async def _paced_round(
    dsn: str, fleet: ClientFleet, seq_base: str, *, chunks: int, chunk: int, pause: float
) -> dict[str, Any]:
    """Commit ``chunks`` transactions of ``chunk`` items every ``pause`` seconds; the
    fleet notes when each item arrives. Returns throughput and latency of the fleet."""
    count = chunks * chunk
    await fleet.reset(count)
    conn = await asyncpg.connect(dsn)
    sent_at: list[float] = []
    published: list[str] = []
    pad = "x" * 150  # bigger items fill the slow listener's buffers sooner
    peak_rss = 0
    try:
        start = time.monotonic()
        for c in range(chunks):
            due = start + c * pause
            await asyncio.sleep(max(0.0, due - time.monotonic()))
            ids = [f"lat-{c * chunk + i}-{seq_base}{pad}" for i in range(chunk)]
            published.extend(ids)
            await publish_many(conn, [("vm", [], x) for x in ids])
            sent_at.extend([time.monotonic()] * chunk)
            peak_rss = max(peak_rss, rss_bytes())
    finally:
        await conn.close()
    report = await fleet.wait(60)
    assert report["complete"], f"{sum(report['items'])} items of {99 * count}"
    figures = await fleet.latencies(sent_at)
    last = max(report["done_at"])
    return {
        "throughput": count / (last - start),
        "p50": figures["p50"],
        "p99": figures["p99"],
        "peak_rss": peak_rss,
        "ids": published,
    }


@contextlib.asynccontextmanager
async def small_buffer_publisher(
    dsn: str, *, ws: str = "direct", **overrides: Any
) -> AsyncIterator[PublisherUnderTest]:
    """Like ``running_publisher``, on a listening socket whose accepted connections
    have a fixed 64 KiB send buffer: the kernel then absorbs ~128 KiB for a listener
    that does not read, not the several MiB of send-buffer autotuning, so that
    eviction (not the kernel) is what bounds a slow listener in a short test."""
    publisher = Publisher(
        PublisherConfig(
            dsn=dsn, resources=(VM, NETWORK), poll_interval=0.2, retention=False, **overrides
        )
    )
    app = Starlette(routes=publisher.routes, lifespan=publisher.lifespan)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 65536)
    sock.bind(("127.0.0.1", 0))
    # No keepalive pings: a listener that stops reading would also stop answering
    # them and be dropped with 1011; this test wants to see the eviction's 4009.
    server = uvicorn.Server(
        uvicorn.Config(
            app,
            log_level="warning",
            ws_ping_interval=None,
            ws=WS_PROTOCOLS[ws],
            ws_per_message_deflate=False,
        )
    )
    leave_signals_to_pytest(server)
    task = asyncio.create_task(server.serve(sockets=[sock]))
    running = RunningServer(server, task, sock.getsockname()[1])
    try:
        await wait_until(lambda: server.started or task.done(), timeout=15)
        await asyncio.wait_for(publisher.tailer.ready.wait(), 10)
        yield PublisherUnderTest(running, publisher, dsn)
    finally:
        await running.stop()
        sock.close()


async def test_a_listener_that_stops_reading_slows_nobody_and_catches_up_later(
    feed_dsn: str,
) -> None:
    """99 listeners read, one stops: the 99 keep their throughput and latency, the
    publisher's memory stays bounded, the slow one falls behind instead of being
    evicted, and when it reads again it gets everything it missed, exactly once
    and in feed order, on the same connection."""
    chunks, chunk, pause = 10, 150, 0.1
    pacing: dict[str, Any] = {"chunks": chunks, "chunk": chunk, "pause": pause}
    async with (
        small_buffer_publisher(
            feed_dsn, queue_size=400, tail_batch=100, max_batch=100, stall_timeout=600.0
        ) as pub,
        ClientFleet() as fleet,
    ):
        publisher = pub.publisher
        result = await fleet.connect(
            pub.ws_url, 99, _fleet_registration(True), latency_slots=chunks * chunk
        )
        assert result["connected"] == 99
        await wait_until(lambda: len(publisher.registry) == 99)
        await _paced_round(feed_dsn, fleet, "warm", **pacing)
        baseline_rss = rss_bytes()

        without: list[dict[str, Any]] = []
        with_slow: list[dict[str, Any]] = []
        slow_ones: list[tuple[SlowListener, int]] = []
        written: list[str] = []
        for pair in range(5):
            without.append(await _paced_round(feed_dsn, fleet, f"a{pair}", **pacing))
            written += without[-1]["ids"]
            slow = SlowListener(pub.ws_url)
            await slow.connect()
            slow_ones.append((slow, len(written)))
            with_slow.append(await _paced_round(feed_dsn, fleet, f"b{pair}", **pacing))
            written += with_slow[-1]["ids"]

            def catching_up(n: int = pair + 1) -> bool:
                caught: int = publisher.stats()["catchingUp"]
                return caught == n

            await wait_until(catching_up)

        def median(rounds: list[dict[str, Any]], key: str) -> float:
            value: float = statistics.median(r[key] for r in rounds)
            return value

        for key in ("throughput", "p50", "p99"):
            print(
                f"\n{key}: without a slow listener {[round(r[key], 4) for r in without]}, "
                f"with one {[round(r[key], 4) for r in with_slow]}"
            )
        # Within 20% (plus 2 ms of timer jitter) of the rounds without a slow listener,
        # or at worst within their own range: on a shared machine those rounds vary
        # by more than 20% among themselves, and a slow listener that really slowed
        # the others would push the median past the worst of them.
        assert median(with_slow, "throughput") >= min(
            0.8 * median(without, "throughput"), *(r["throughput"] for r in without)
        )
        assert median(with_slow, "p50") <= max(
            1.2 * median(without, "p50") + 0.002, *(r["p50"] for r in without)
        )
        # The p99 of a ~1 s round is a handful of deliveries: one scheduler hiccup on
        # a shared machine doubles it (measured: 18-65 ms in rounds without a slow
        # listener). What this test must catch is the others waiting on the slow
        # socket, which holds them for a pause (100 ms) or more; bench/catchup.py
        # measures the tail itself.
        assert median(with_slow, "p99") <= max(
            2 * median(without, "p99") + 0.02, *(r["p99"] for r in without)
        )
        peak = max(r["peak_rss"] for r in with_slow)
        print(f"publisher RSS: {baseline_rss / 2**20:.0f} MiB, peak {peak / 2**20:.0f} MiB")
        # Each slow listener costs at most its queue (400 shared items) and its
        # transport buffer: nothing like the ~1.5 MB it was sent per round.
        assert peak - baseline_rss < 24 * 2**20
        assert all(len(s.delivery.queue) <= 400 for s in publisher.registry)
        stats = publisher.stats()
        assert stats["counters"]["evictions"] == 0 and stats["counters"]["fellBehind"] >= 5
        behind = [r for r in stats["registrations"] if r["state"] == "catching_up"]
        assert len(behind) == 5 and all(r["lagEntries"] > 0 for r in behind)

        # Each slow listener reads again, on the same connection: everything since
        # it registered, exactly once, in feed order; then it is live again.
        for slow, start in slow_ones:
            await slow.read(len(written) - start, timeout=60)
            assert slow.ids == written[start:]
        await wait_until(lambda: publisher.stats()["catchingUp"] == 0, timeout=10)
        assert publisher.stats()["counters"]["evictions"] == 0
        await fleet.close_all()


@pytest.mark.parametrize("ws", ["direct", "asgi"])
@pytest.mark.parametrize("batch", [True, False], ids=["batch", "rfd5"])
async def test_a_listener_that_pauses_gets_everything_in_feed_order(
    feed_dsn: str, batch: bool, ws: str
) -> None:
    """A listener stops reading until its socket backs up, then reads again. Its
    items go out directly, then (transport paused) wait in its queue, which
    overflows: it falls behind and catches up from the window, then goes live
    again. It must still get every item exactly once, in feed order."""
    pad = "x" * 200
    ids = [f"pause-{i:05d}-{pad}" for i in range(4000)]
    async with small_buffer_publisher(feed_dsn, ws=ws, queue_size=500, tail_batch=100) as pub:
        publisher = pub.publisher
        slow = SlowListener(pub.ws_url)
        await slow.connect(batch=batch)
        assert slow.ws is not None
        await wait_until(lambda: len(publisher.registry) == 1)
        (session,) = publisher.registry
        await _publish(feed_dsn, ids[:3000], chunk=100)
        # The socket is full, the queue overflowed: it is behind.
        await wait_until(lambda: publisher.stats()["catchingUp"] == 1, timeout=20)
        assert session.delivery.sent < 3000
        await _publish(feed_dsn, ids[3000:3900], chunk=100)
        received: list[str] = []
        async with asyncio.timeout(30):
            while len(received) < 3900:
                received.extend(_ids_in(await slow.ws.recv()))
            # Caught up: the next items come live again.
            await wait_until(lambda: session.delivery.live, timeout=10)
            await _publish(feed_dsn, ids[3900:], chunk=50)
            while len(received) < len(ids):
                received.extend(_ids_in(await slow.ws.recv()))
        assert received == ids
        assert session.delivery.sent == len(ids) and len(session.delivery.queue) == 0
        counters = publisher.stats()["counters"]
        assert counters["fellBehind"] >= 1 and counters["rejoined"] >= 1
        assert counters["evictions"] == 0
        await slow.ws.close()


@pytest.mark.parametrize("ws", ["direct", "asgi"])
async def test_a_cheap_flush_does_not_hold_the_next_change_back(feed_dsn: str, ws: str) -> None:
    """The flush interval follows the flush's cost: with direct writes to one
    listener a flush costs microseconds, so a change right after another goes
    out at once, even with a long send_interval. A flush that woke sender tasks
    (ASGI sends) cannot know its cost and waits the whole interval."""
    interval = 0.5
    async with running_publisher(
        feed_dsn, ws=ws, send_interval=interval, poll_interval=0.05
    ) as pub:
        listener, _ = await register(pub.ws_url, registration(subs=[], batch=True))
        await write(feed_dsn, [("vm", ["nic"], "first")])
        (first,) = await receive_items(listener, 1)
        started = time.monotonic()
        await write(feed_dsn, [("vm", ["nic"], "second")])
        (second,) = await receive_items(listener, 1)
        waited = time.monotonic() - started
        assert (first["changedResourceId"], second["changedResourceId"]) == ("first", "second")
        if ws == "direct":
            assert waited < interval / 2, waited
        else:
            assert waited > interval / 2, waited
        await listener.close()


def _items_in(frame: str | bytes) -> list[dict[str, Any]]:
    doc = orjson.loads(frame)
    return doc if isinstance(doc, list) else [doc]


def _ids_in(frame: str | bytes) -> list[str]:
    return [item["changedResourceId"] for item in _items_in(frame)]


async def test_drain_closes_every_listener_with_1001_and_stop_ends_the_tailer(
    feed_dsn: str,
) -> None:
    async with running_publisher(feed_dsn) as pub:
        publisher = pub.publisher
        listeners = [(await register(pub.ws_url, registration()))[0] for _ in range(5)]
        await publisher.drain(grace=5)
        for ws in listeners:
            with pytest.raises(ConnectionClosed) as closed:
                await asyncio.wait_for(ws.recv(), 5)
            assert closed.value.rcvd is not None
            assert closed.value.rcvd.code == CloseCode.GOING_AWAY
        assert len(publisher.registry) == 0 and publisher.draining
        # While draining, a new listener is told to go elsewhere.
        late = await connect(pub.ws_url)
        error = orjson.loads(await asyncio.wait_for(late.recv(), 5))
        assert error["error"]["code"] == "unavailable"
        with pytest.raises(ConnectionClosed) as closed:
            await asyncio.wait_for(late.recv(), 5)
        assert closed.value.rcvd is not None and closed.value.rcvd.code == CloseCode.UNAVAILABLE
        tasks = list(publisher._tasks)
        assert tasks and not any(t.done() for t in tasks)
        await publisher.stop(grace=1)
        assert all(t.done() for t in tasks)
        assert publisher.stats()["counters"]["disconnects"] == 5


async def test_draining_server_shutdown_sends_1001_before_uvicorn_closes(feed_dsn: str) -> None:
    """``changefeed serve`` runs a DrainingServer: on shutdown every listener gets
    1001 (not uvicorn's 1012), then the lifespan stops the publisher and its tailer."""
    from changefeed.serving import DrainingServer, server_config

    publisher = Publisher(
        PublisherConfig(dsn=feed_dsn, resources=(VM, NETWORK), retention=False, poll_interval=0.2)
    )
    app = Starlette(routes=publisher.routes, lifespan=publisher.lifespan)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = DrainingServer(server_config(app, "127.0.0.1", port, loop="asyncio"), [publisher])
    leave_signals_to_pytest(server)
    task = asyncio.create_task(server.serve(sockets=[sock]))
    try:
        await wait_until(lambda: server.started, timeout=15)
        url = f"ws://127.0.0.1:{port}/changefeeds"
        listeners = [(await register(url, registration()))[0] for _ in range(3)]
        tailer_task = publisher._tasks[0]
        server.should_exit = True
        for ws in listeners:
            with pytest.raises(ConnectionClosed) as closed:
                await asyncio.wait_for(ws.recv(), 10)
            assert closed.value.rcvd is not None
            assert closed.value.rcvd.code == CloseCode.GOING_AWAY
        await asyncio.wait_for(task, 20)
        assert tailer_task.done() and not publisher._tasks
    finally:
        server.should_exit = True
        with contextlib.suppress(Exception):
            await asyncio.wait_for(task, 20)
        sock.close()


async def test_metrics_render_and_move_and_events_are_logged(feed_dsn: str) -> None:
    """Invariant I7: the Prometheus names render and their values move with the
    traffic; registration, disconnect and eviction are structured log events."""
    from prometheus_client.parser import text_string_to_metric_families

    def values(text: str) -> dict[str, float]:
        found = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()))
                found[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
        return found

    records = LogRecords(logging.INFO)
    logger = logging.getLogger("changefeed")
    level = logger.level
    logger.addHandler(records)
    logger.setLevel(logging.INFO)
    try:
        await _observe(feed_dsn, records, values)
    finally:
        logger.removeHandler(records)
        logger.setLevel(level)


async def _observe(
    feed_dsn: str, records: LogRecords, values: Callable[[str], dict[str, float]]
) -> None:
    import httpx

    async with (
        small_buffer_publisher(feed_dsn, queue_size=200, tail_batch=100, stall_timeout=1.0) as pub,
        httpx.AsyncClient(base_url=pub.server.url) as http,
    ):
        before = values((await http.get("/metrics")).text)
        # max_queue=None: this listener keeps up (its client reads whatever arrives).
        ws, _ = await register(pub.ws_url, registration(subs=["nic"]), max_queue=None)
        slow = SlowListener(pub.ws_url)
        await slow.connect()
        ids = [f"metric-{i}-{'x' * 400}" for i in range(1500)]
        await _publish(feed_dsn, ids, chunk=100)
        got = 0
        async with asyncio.timeout(30):
            while got < len(ids):
                got += len(await receive_items(ws, 1))
        await wait_until(lambda: pub.publisher.stats()["counters"]["evictions"] == 1)
        after = values((await http.get("/metrics")).text)
        for name in (
            "changefeed_entries_tailed_total",
            "changefeed_queued_total",
            "changefeed_deliveries_total",
            "changefeed_frames_total",
            "changefeed_connections_total",
            "changefeed_evictions_total{code=slow_listener}",
            "changefeed_fell_behind_total",
            "changefeed_disconnects_total",
            "changefeed_dropped_total",
            "changefeed_registrations_total{resource=vm,resumed=false}",
            "changefeed_flush_seconds_count",
            "changefeed_flush_seconds_sum",
            "changefeed_entry_age_seconds_count",
        ):
            assert after[name] > before.get(name, 0.0), name
        assert after["changefeed_listeners"] == 1.0
        assert after["changefeed_active_registrations{resource=vm}"] == 1.0
        assert after["changefeed_open_connections"] == 2.0  # the evicted one is still closing
        assert after["changefeed_tailer_up"] == 1.0
        for gauge in (
            "changefeed_catching_up",
            "changefeed_lag_seconds_max",
            "changefeed_window_bytes",
            "changefeed_window_entries",
            "changefeed_queue_depth_max",
            "changefeed_queued_items",
            "changefeed_tailer_lag_seconds",
            "changefeed_tailer_position",
            "changefeed_oldest_open_transaction_seconds",
            "changefeed_feed_oldest_entry_seconds",
            "changefeed_feed_bytes",
        ):
            assert gauge in after, gauge
        assert after["changefeed_tailer_position"] > before["changefeed_tailer_position"]
        # The process's own figures, for leaks the changefeed_* ones would not show.
        assert after["process_resident_memory_bytes"] > 10e6
        assert after["process_open_fds"] >= 4  # listening socket, 2 listeners, the tailer
        await ws.close()
        await wait_until(lambda: len(pub.publisher.registry) == 0)
        events = {r.getMessage(): r for r in records.records}
        for event in ("registration", "listener.evicted", "listener.disconnected"):
            assert event in events, event
        fields = events["listener.evicted"].cf_fields  # type: ignore[attr-defined]
        assert fields["code"] == "slow_listener" and "no progress" in fields["reason"]
        assert "listeners" in fields
        errors, code = await slow.read_until_closed(30)
        assert errors == ["slow_listener"] and code == CloseCode.SLOW_LISTENER


async def test_an_evicted_listener_that_never_reads_is_let_go_after_close_timeout(
    feed_dsn: str,
) -> None:
    """A listener that takes nothing for stall_timeout is evicted; the publisher then
    waits at most close_timeout (twice: for the frame being written, then for the
    error and close frames) on it; then the connection is dropped with what its
    buffers still held, and the listener can still come back."""
    async with small_buffer_publisher(
        feed_dsn, queue_size=100, tail_batch=100, close_timeout=0.5, stall_timeout=1.0
    ) as pub:
        publisher = pub.publisher
        slow = SlowListener(pub.ws_url)
        await slow.connect()
        ids = [f"stuck-{i}-{'x' * 400}" for i in range(1500)]
        await _publish(feed_dsn, ids, chunk=100)
        await wait_until(lambda: publisher.stats()["counters"]["evictions"] == 1)
        await wait_until(lambda: publisher.connections == 0, timeout=5)
        assert len(publisher.registry) == 0
        # The server lets the socket go too: a graceful close would wait for good
        # for its write buffer to drain (changefeed.serving.FanoutWebSocketProtocol).
        connections = pub.server.server.server_state.connections
        await wait_until(lambda: not connections, timeout=5, message="socket dropped")
        # Reading again: whatever was buffered, then the end of the connection.
        await slow.read_until_closed(30)
        assert 0 < len(slow.ids) < len(ids)
        assert await slow.resume(len(ids), 30) is True
        assert slow.ids == ids


def test_the_entry_age_histogram_counts_each_value_in_its_prometheus_bucket() -> None:
    """Bucket ``le=x`` holds values <= x, cumulatively; negative ages (clock skew) are 0."""
    from prometheus_client import CollectorRegistry, generate_latest

    from changefeed.publisher.metrics import FastHistogram

    histogram = FastHistogram("age_seconds", "ages", buckets=(0.01, 1))
    registry = CollectorRegistry()
    registry.register(histogram)
    for value in (-0.5, 0.01, 0.5, 1.0, 7.0):
        histogram.observe(value)
    text = generate_latest(registry).decode()
    assert metric_value(text, "age_seconds_bucket", le="0.01") == 2
    assert metric_value(text, "age_seconds_bucket", le="1.0") == 4
    assert metric_value(text, "age_seconds_bucket", le="+Inf") == 5
    assert metric_value(text, "age_seconds_count") == 5 == histogram.count
    assert metric_value(text, "age_seconds_sum") == 0.01 + 0.5 + 1.0 + 7.0


async def test_a_broadcast_can_be_followed_step_by_step_in_debug_logs(
    feed_dsn: str, caplog: pytest.LogCaptureFixture
) -> None:
    """At DEBUG, every step of a broadcast is a structured event: the tailer's read
    (naming the changed ids), the dispatch to the matching listeners, and the flush
    that wrote them out, each naming the feed positions it covers."""
    caplog.set_level(logging.DEBUG, logger="changefeed")
    async with running_publisher(feed_dsn) as pub:
        nic, _ = await register(pub.ws_url, registration(subs=["nic"]))
        alias, _ = await register(pub.ws_url, registration(subs=["alias"]))
        await _publish(feed_dsn, ["traced-1", "traced-2"])
        assert [i["changedResourceId"] for i in await receive_items(nic, 2)] == [
            "traced-1",
            "traced-2",
        ]
        await nic.close()
        await alias.close()
    events: list[tuple[str, dict[str, Any]]] = [
        (r.getMessage(), r.cf_fields)  # type: ignore[attr-defined]
        for r in caplog.records
        if r.name.startswith("changefeed.publisher")
    ]
    steps = [name for name, _ in events]

    def step(name: str, found: Callable[[dict[str, Any]], bool]) -> tuple[int, dict[str, Any]]:
        return next((i, f) for i, (n, f) in enumerate(events) if n == name and found(f))

    at_read, read = step("tailer.read", lambda f: "traced-1" in f["ids"])
    assert read["entries"] == 2 and read["ids"] == ["traced-1", "traced-2"]
    assert read["read_ms"] >= 0
    at_dispatch, dispatched = step("fanout.dispatched", lambda f: f["last"] == read["last"])
    assert dispatched["queued"] == 2 and dispatched["listeners"] == 1  # not the alias listener
    at_flush, flushed = step(
        "fanout.flushed", lambda f: f["through"] is not None and f["through"] >= read["last"]
    )
    assert flushed["listeners"] == 1 and flushed["written"] == 1 and flushed["to_senders"] == 0
    assert at_read < at_dispatch < at_flush, steps
