"""Catch-up: listeners that fall behind, or start behind, beside live fan-out in the same run.

    python bench/catchup.py [--dsn DSN] [--quick] [--rounds 3] [--burst 20000]
                            [--burst-listeners 10] [--behind 100000] [--listeners 100]
                            [--small-window-mib 8] [--no-rfd5]

A listener whose queue cannot take the next batch is not evicted: it falls
behind, catches up from the window of recent entries (``window_bytes``) or
from pages of the feed table, paced by its own socket, and rejoins live
delivery (docs/fanout.md). Two measurements, each printed beside its baseline
from the same run, with the same client fleet (another process, see
bench/common.py) and ~200-byte change items; every publisher runs with its
default settings but for ``window_bytes`` where said:

* burst drain: ``--burst`` entries committed in ONE transaction
  (``publish_many``) reach ``--burst-listeners`` RFD 5 listeners (one item
  per frame, no ``batch``). The tailer reads them 1,000 at a time
  (``tail_batch``); a listener whose queue (``queue_size``, 4,096 items)
  cannot take the next read falls behind and catches up from the window.
  Whether the default queue overflows depends on how fast the listeners
  read, so a third configuration gives them the smallest queue allowed (one
  read): most of the burst then goes through catch-up. Figure: seconds from
  the COMMIT returning to the last listener having the last entry, against
  the same burst to as many ``batch`` listeners (a separate publisher); with
  the evictions (``counters.evictions``: must be 0) and how the listeners
  were served (fellBehind, rejoined, caughtUpFromWindow/Feed).
* catch-up rate: ``--listeners`` listeners register with ``since`` = a
  cursor from before ``--behind`` entries, which the publisher has already
  tailed, so they catch up all of them. Figure: deliveries/s = listeners x
  entries / (time the last one has the last entry - time the first
  registration was sent; the later registrations wait behind the turns of
  the listeners already catching up, and the bench prints when the last ack
  came), against the **live** rate: the same listeners
  registered live while the same entries are written (``publish_many``, 1,000
  per transaction, by a connection in this process, as bench/fanout.py does),
  until the last one has the last entry. Live delivery cannot outrun the
  writer: the bench prints how long the writes took and how long after the
  last COMMIT the last delivery came. Three windows: one large enough to
  hold every entry (everything from memory); the default 64 MiB, which at
  the memory ``entries.entry_bytes`` charges for one of these entries holds
  fewer than 100,000 of them, so the oldest come from the feed table; and
  ``--small-window-mib``, where most come from pages of the feed table,
  shared by listeners at nearby positions (pageReads against pagesShared).
  The bench prints how many entries each window held. ``batch`` listeners, and RFD 5 listeners
  against their own live rate unless ``--no-rfd5``. Target: catch-up >= 0.8x
  live.

Each figure is the median of ``--rounds`` rounds; a round runs every
configuration once, in turn, so that a change in the machine's load reaches
them all. Every measurement has its own publisher and a fresh feed schema.
Without ``--dsn`` an embedded PostgreSQL is started (changefeed.embedded);
with ``--dsn`` the bench works in its own schema, ``changefeed_bench``, and
drops it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import statistics
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import asyncpg
import orjson
from common import (
    ClientFleet,
    cpu_seconds,
    database,
    fresh_schema,
    raise_nofile,
    say,
    serve_publisher,
    until,
)

from changefeed.publisher import Publisher, PublisherConfig, ResourceConfig, publish_many
from changefeed.publisher.entries import entry_bytes
from changefeed.publisher.feed import FeedEntry
from changefeed.schemas import Position

SCHEMA = "changefeed_bench"
VM = ResourceConfig("vm", "/vms", ("nic", "alias"))
WRITE_CHUNK = 1000
DEFAULT_WINDOW = PublisherConfig().window_bytes
SMALL_QUEUE = 1000
NOW = datetime.now(UTC)


def registration(batch: bool, since: str | None = None) -> str:
    doc: dict[str, Any] = {
        "instance": str(uuid.uuid4()),
        "service": "bench",
        "changeKind": {"resource": "vm", "subResources": []},
    }
    if batch:
        doc["batch"] = True
    if since is not None:
        doc["since"] = since
    return orjson.dumps(doc).decode()


@dataclass
class Run:
    """One measurement: its figure (seconds or deliveries/s), the publisher's
    counters at the end, and the publisher's CPU per delivery."""

    value: float
    counters: dict[str, Any]
    server_cpu: float
    client_cpu: float
    window: dict[str, Any] = field(default_factory=dict)
    registered: float = 0.0
    """Seconds until every catching-up listener had its ack."""
    written: float = 0.0
    """Live: seconds the writer took to commit every entry."""
    after_commit: float = 0.0
    """Live: seconds from the last COMMIT to the last listener having the last entry."""


@contextlib.asynccontextmanager
async def running_publisher(dsn: str, **tuning: Any) -> AsyncIterator[tuple[str, Publisher]]:
    config = PublisherConfig(
        dsn=dsn, schema=SCHEMA, resources=(VM,), retention=False, create_schema=False, **tuning
    )
    async with serve_publisher(config) as served:
        yield served


async def write(conn: asyncpg.Connection, ids: Sequence[str], per_transaction: int) -> None:
    for i in range(0, len(ids), per_transaction):
        async with conn.transaction():
            chunk = [("vm", ["nic"], x) for x in ids[i : i + per_transaction]]
            await publish_many(conn, chunk, schema=SCHEMA)


def check(report: dict[str, Any], listeners: int, items: int) -> None:
    """Every listener got every item (a client that is gone counts as done: not here)."""
    if not report["complete"] or sum(n >= items for n in report["items"]) < listeners:
        got = sum(report["items"])
        codes = sorted({c for c in report["close_codes"] if c is not None})
        raise RuntimeError(
            f"incomplete: {got:,} of {listeners * items:,} deliveries (close codes {codes})"
        )


def counters_of(publisher: Publisher) -> dict[str, Any]:
    counters: dict[str, Any] = publisher.stats()["counters"]
    if counters["evictions"]:
        raise RuntimeError(f"{counters['evictionsByCode']} listeners were evicted")
    return counters


# --------------------------------------------------------------------------- burst drain


class Meter:
    """CPU seconds of this process (the publisher) and of the fleet, per delivery."""

    def __init__(self, fleet: ClientFleet) -> None:
        self.fleet = fleet
        self.server = cpu_seconds()
        self.client = cpu_seconds(fleet.pid)

    def per_delivery(self, deliveries: int) -> tuple[float, float]:
        server = cpu_seconds() - self.server
        client = cpu_seconds(self.fleet.pid) - self.client
        return server / deliveries * 1e6, client / deliveries * 1e6


async def burst_drain(
    fleet: ClientFleet,
    dsn: str,
    ids: list[str],
    listeners: int,
    *,
    batch: bool,
    queue_size: int | None = None,
) -> Run:
    """Seconds from the burst's COMMIT to the last listener having its last entry."""
    await fresh_schema(dsn, SCHEMA)
    writer = await asyncpg.connect(dsn)
    tuning = {} if queue_size is None else {"queue_size": queue_size}
    try:
        async with running_publisher(dsn, **tuning) as (url, publisher):
            await fleet.connect(url, listeners, registration(batch))
            await until(lambda: len(publisher.registry) >= listeners, 30)
            await fleet.reset(len(ids))
            meter = Meter(fleet)
            await write(writer, ids, len(ids))
            committed = time.monotonic()
            report = await fleet.wait(300)
            check(report, listeners, len(ids))
            cpu = meter.per_delivery(listeners * len(ids))
            counters = counters_of(publisher)
            await fleet.close_all()
    finally:
        await writer.close()
    return Run(max(report["done_at"]) - committed, counters, *cpu)


# --------------------------------------------------------------------------- catch-up against live


async def live_rate(
    fleet: ClientFleet, dsn: str, ids: list[str], listeners: int, *, batch: bool
) -> Run:
    """Deliveries/s to listeners registered live while ``ids`` are written."""
    await fresh_schema(dsn, SCHEMA)
    writer = await asyncpg.connect(dsn)
    try:
        async with running_publisher(dsn) as (url, publisher):
            await fleet.connect(url, listeners, registration(batch))
            await until(lambda: len(publisher.registry) >= listeners, 30)
            await fleet.reset(len(ids))
            meter = Meter(fleet)
            started = time.monotonic()
            await write(writer, ids, WRITE_CHUNK)
            committed = time.monotonic()
            report = await fleet.wait(600)
            deliveries = listeners * len(ids)
            check(report, listeners, len(ids))
            cpu = meter.per_delivery(deliveries)
            counters = counters_of(publisher)
            await fleet.close_all()
    finally:
        await writer.close()
    done = max(report["done_at"])
    return Run(
        deliveries / (done - started),
        counters,
        *cpu,
        written=committed - started,
        after_commit=done - committed,
    )


async def catch_up_rate(
    fleet: ClientFleet,
    dsn: str,
    ids: list[str],
    listeners: int,
    *,
    batch: bool,
    window_bytes: int,
) -> Run:
    """Deliveries/s to listeners that register ``len(ids)`` entries behind."""
    await fresh_schema(dsn, SCHEMA)
    writer = await asyncpg.connect(dsn)
    try:
        async with running_publisher(dsn, window_bytes=window_bytes) as (url, publisher):
            # A cursor from before the burst, as a listener that was cut off holds
            # one: the ack of a listener registered at the head (one entry in, so
            # that the head is a real position of the feed).
            await write(writer, ["before"], 1)
            await until(lambda: publisher.tailer.entries_total >= 1, 30)
            since = orjson.loads((await fleet.connect(url, 1, registration(batch)))["ack"])
            await fleet.close_all()
            tailed = publisher.tailer.entries_total + len(ids)
            await write(writer, ids, WRITE_CHUNK)
            await until(lambda: publisher.tailer.entries_total >= tailed, 120)
            window = dict(publisher.stats()["window"])
            await fleet.reset(len(ids), clients=listeners)
            meter = Meter(fleet)
            started = time.monotonic()
            await fleet.connect(url, listeners, registration(batch, since["cursor"]))
            registered = time.monotonic() - started
            report = await fleet.wait(600)
            deliveries = listeners * len(ids)
            check(report, listeners, len(ids))
            cpu = meter.per_delivery(deliveries)
            counters = counters_of(publisher)
            await fleet.close_all()
    finally:
        await writer.close()
    elapsed = max(report["done_at"]) - started
    return Run(deliveries / elapsed, counters, *cpu, window=window, registered=registered)


# --------------------------------------------------------------------------- the run


@dataclass
class Config:
    """One configuration: how to measure it once, and its runs so far."""

    label: str
    measure: Callable[[], Awaitable[Run]]
    runs: list[Run] = field(default_factory=list)

    @property
    def median(self) -> float:
        return statistics.median(r.value for r in self.runs)

    def every(self, unit: str) -> str:
        fmt = "{:.3f}" if unit == "s" else "{:,.0f}"
        return "[" + ", ".join(fmt.format(r.value) for r in self.runs) + "]"

    def counter(self, name: str) -> float:
        return float(statistics.median(r.counters[name] for r in self.runs))

    @property
    def cpu(self) -> str:
        server = statistics.median(r.server_cpu for r in self.runs)
        client = statistics.median(r.client_cpu for r in self.runs)
        return f"cpu/delivery: publisher {server:5.2f} us, listeners {client:5.2f} us"

    def served(self, deliveries: int) -> str:
        """How the listeners were served: live, or caught up from the window or the feed."""
        window, feed = self.counter("caughtUpFromWindow"), self.counter("caughtUpFromFeed")
        return (
            f"fell behind {self.counter('fellBehind'):,.0f}, rejoined "
            f"{self.counter('rejoined'):,.0f}; from window {window:,.0f} "
            f"({window / deliveries:.0%}), from feed {feed:,.0f} ({feed / deliveries:.0%}), "
            f"page reads {self.counter('pageReads'):,.0f}, shared "
            f"{self.counter('pagesShared'):,.0f}; evictions {self.counter('evictions'):,.0f}"
        )


def mib(nbytes: int) -> str:
    return f"{nbytes / 2**20:.3g} MiB"


@dataclass
class Plan:
    """What a round measures, from the command line."""

    burst: list[str]
    """The burst's ids."""
    burst_listeners: int
    behind: list[str]
    """The ids of the entries the catching-up listeners miss."""
    listeners: int
    windows: list[tuple[str, int]]
    """(label, window_bytes) of each catch-up configuration."""
    rfd5: bool
    """Measure catch-up against live for RFD 5 listeners too."""

    @classmethod
    def of(cls, args: argparse.Namespace) -> Plan:
        quick = args.quick
        behind = args.behind or (5000 if quick else 100_000)
        # What the window charges for one entry of a 36-character id (entries.entry_bytes).
        entry = entry_bytes(FeedEntry(Position(1, 1), "vm", ("nic",), str(uuid.uuid4()), NOW))
        if args.small_window_mib:
            small = int(args.small_window_mib * 2**20)
        else:
            small = behind * entry // 10 if quick else 8 << 20
        # Large enough to hold every entry, in whole MiB, with room to spare.
        whole = max(DEFAULT_WINDOW, -(-behind * entry * 5 // 4 // 2**20) * 2**20)
        windows = [
            (f"window {mib(whole)} (holds all)", whole),
            (f"window {mib(DEFAULT_WINDOW)} (default)", DEFAULT_WINDOW),
            (f"window {mib(small)} (small)", small),
        ]
        if whole == DEFAULT_WINDOW:
            windows[:2] = [(f"window {mib(DEFAULT_WINDOW)} (default, holds all)", DEFAULT_WINDOW)]
        return cls(
            burst=[str(uuid.uuid4()) for _ in range(args.burst or (6000 if quick else 20_000))],
            burst_listeners=args.burst_listeners,
            behind=[str(uuid.uuid4()) for _ in range(behind)],
            listeners=args.listeners or (20 if quick else 100),
            windows=windows,
            rfd5=not args.no_rfd5,
        )

    def drains(self, fleet: ClientFleet, dsn: str) -> list[Config]:
        """The burst drain's configurations; the first is the baseline."""
        ids, listeners = self.burst, self.burst_listeners
        return [
            Config(
                "batch listeners",
                lambda: burst_drain(fleet, dsn, ids, listeners, batch=True),
            ),
            Config(
                "RFD 5 listeners",
                lambda: burst_drain(fleet, dsn, ids, listeners, batch=False),
            ),
            # The smallest queue allowed, one tailer read (tail_batch): a full read
            # fits only an empty queue, so most of the burst goes through catch-up.
            Config(
                f"RFD 5, queue_size {SMALL_QUEUE}",
                lambda: burst_drain(
                    fleet, dsn, ids, listeners, batch=False, queue_size=SMALL_QUEUE
                ),
            ),
        ]

    def rates(self, fleet: ClientFleet, dsn: str) -> list[tuple[Config, list[Config]]]:
        """The catch-up rate's configurations: each live baseline with its catch-ups."""
        ids, listeners = self.behind, self.listeners
        kinds = [("batch", True)] + ([("RFD 5", False)] if self.rfd5 else [])
        rates = []
        for kind, batch in kinds:
            live = Config(
                f"live, {kind}",
                functools.partial(live_rate, fleet, dsn, ids, listeners, batch=batch),
            )
            # One item per frame costs more per item: RFD 5 catches up from the whole
            # window only.
            windows = self.windows if batch else self.windows[:1]
            behind = [
                Config(
                    f"catch-up, {kind}, {label}",
                    functools.partial(
                        catch_up_rate, fleet, dsn, ids, listeners, batch=batch, window_bytes=size
                    ),
                )
                for label, size in windows
            ]
            rates.append((live, behind))
        return rates


async def main(args: argparse.Namespace) -> None:
    raise_nofile(4096)
    plan = Plan.of(args)
    rounds = args.rounds or (1 if args.quick else 3)
    behind = len(plan.behind)
    say(
        f"catchup: burst of {len(plan.burst):,} entries in one transaction to "
        f"{plan.burst_listeners} listeners; {plan.listeners} listeners {behind:,} entries "
        f"behind; {rounds} round(s)"
    )
    with database(args.dsn) as dsn:
        try:
            async with ClientFleet() as fleet:
                drains, rates = plan.drains(fleet, dsn), plan.rates(fleet, dsn)
                configs = drains + [c for live, behind in rates for c in (live, *behind)]
                for round_number in range(rounds):
                    for config in configs:
                        config.runs.append(await config.measure())
                    say(f"  round {round_number + 1} of {rounds} done")
        finally:
            with contextlib.suppress(Exception):
                admin = await asyncpg.connect(dsn)
                await admin.execute(f"DROP SCHEMA IF EXISTS {SCHEMA} CASCADE")
                await admin.close()

    baseline = drains[0]
    say(
        f"burst drain: {len(plan.burst):,} entries, COMMIT -> the last of "
        f"{plan.burst_listeners} listeners has them all"
    )
    for config in drains:
        versus = f"{config.median / baseline.median:5.2f}x batch" if config is not baseline else ""
        say(f"  {config.label:<50} {config.median:8.3f} s  {versus:<11}  {config.cpu}")
        say(f"    {config.every('s')}; {config.served(len(plan.burst) * plan.burst_listeners)}")
    say(f"catch-up against live: {plan.listeners} listeners, {behind:,} entries (deliveries/s)")
    summary = []
    for live, catch_ups in rates:
        say(f"  {live.label:<50} {live.median:>12,.0f}/s              {live.cpu}")
        written = statistics.median(r.written for r in live.runs)
        after = statistics.median(r.after_commit for r in live.runs)
        say(
            f"    {live.every('/s')}; {live.served(behind * plan.listeners)}; written in "
            f"{written:.2f} s, the last delivery {after:.2f} s after the last COMMIT"
        )
        for config in catch_ups:
            ratio = config.median / live.median
            window = config.runs[-1].window
            registered = statistics.median(r.registered for r in config.runs)
            say(f"  {config.label:<50} {config.median:>12,.0f}/s  {ratio:5.2f}x live  {config.cpu}")
            say(
                f"    {config.every('/s')}; {config.served(behind * plan.listeners)}; the "
                f"window held {window['entries']:,} entries, {mib(window['bytes'])}; every "
                f"ack in {registered:.2f} s"
            )
            summary.append(f"{config.label} {ratio:.2f}x live")
    evictions = sum(r.counters["evictions"] for c in configs for r in c.runs)
    say(
        f"result: burst drain RFD 5 {drains[1].median:.3f} s against batch "
        f"{baseline.median:.3f} s ({drains[1].median / baseline.median:.2f}x), "
        f"{drains[2].label} {drains[2].median:.3f} s; evictions {evictions}; "
        f"{'; '.join(summary)} (target >= 0.8x)"
    )


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--dsn", help="PostgreSQL DSN (default: an embedded server)")
    parser.add_argument("--quick", action="store_true", help="small run, under a minute")
    parser.add_argument("--rounds", type=int, default=0)
    parser.add_argument("--burst", type=int, default=0, help="entries of the burst (20,000)")
    parser.add_argument("--burst-listeners", type=int, default=10)
    parser.add_argument(
        "--behind", type=int, default=0, help="entries the catching-up listeners miss (100,000)"
    )
    parser.add_argument("--listeners", type=int, default=0, help="catching-up listeners (100)")
    parser.add_argument(
        "--small-window-mib", type=float, default=0.0, help="the small window (8 MiB)"
    )
    parser.add_argument("--no-rfd5", action="store_true", help="batch listeners only")
    return parser.parse_args()


if __name__ == "__main__":
    import uvloop

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        runner.run(main(parse_args()))
