"""A fleet: N publisher processes, each with L listeners, tailing the primary and then a standby.

    python bench/fleet.py [--quick] [--publishers 1,2,4] [--listeners 20] [--rate 1000]
                          [--seconds 10] [--idle 10000] [--history 100000]

An embedded primary and a hot standby of it (``pg_basebackup -R``, streaming
replication) on this machine; the publishers are ``changefeed serve``
processes, the listeners are a client fleet in one more process
(bench/common.py), and a writer process commits one change per transaction
at ``--rate`` (bench/latency.py's), the INSERT and COMMIT inside the measured
time. For each configuration (no publisher at all: the baseline; then 1, 2, 4
publishers reading the primary; then the same reading the standby, with
``read_dsn``) it prints:

* deliveries/s per publisher and in total, and each publisher's CPU per
  delivery;
* commit -> listener latency p50 / p99 over every listener;
* the primary's CPU (its processes, from /proc, in cores, and above the
  writer-only baseline: the WAL sender, background processes and the
  publishers' connections; the writer's own backend, the same in every
  configuration, connects for each run and is not among them) and its feed
  reads per second (scans of the feed table and its state,
  pg_stat_user_tables, above the baseline); the CPU of the publishers' own
  connections to the primary (by application name: the tailer, the doorbell
  and the pool) and of the WAL sender; the standby's CPU and feed reads.

Beside them, what a doorbell that never rested would cost the primary: bare
LISTEN connections on the feed's channel, per commit, against the writer
alone.

Then memory: one publisher process holding ``--idle`` idle listeners, RSS per
listener, beside a bare ``websockets`` server holding as many idle
connections in a process of the same kind (the floor of what a websocket
costs in a Python process here).

Targets: on a standby each added publisher costs the primary at most 1 % of a
core more and no feed reads; through a standby, p50 at most 2 ms above the
primary-tailing p50 of the same run at 1,000 changes/s; one publisher
process holds 10,000 idle listeners at <= 20 KiB each.

The primary runs with ``synchronous_commit = on`` (``fsync`` stays off): a
standby receives only WAL that has been written, and an asynchronous commit
waits up to ``wal_writer_delay`` (200 ms) for that.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import asyncpg
import httpx
import orjson
from common import ClientFleet, free_port, raise_nofile, rss_bytes, say
from latency import SCHEMA, WARMUP, fill_history, run_writer

from changefeed.embedded import EmbeddedPostgres, standby_of, temporary
from changefeed.schemas import apply_schema, notify_channel
from changefeed.wal import insert_target

PUBLISHER_APPS = ("changefeed-tailer", "changefeed-doorbell", "changefeed-pool")
"""Application names of the publishers' connections (the pool's comes with the DSN)."""
WALSENDER = ("walsender",)


# --------------------------------------------------------------------------- the servers


def _children(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if fields[1] == str(pid):
                found.append(int(entry.name))
    return found


def cpu_time(pid: int) -> float:
    """CPU seconds ``pid`` has run so far, to the nanosecond (/proc/PID/schedstat): the
    clock ticks of /proc/PID/stat are 10 ms, too coarse for a backend's few ms."""
    with open(f"/proc/{pid}/schedstat") as f:
        return int(f.read().split()[0]) / 1e9


def cluster_cpu(server: EmbeddedPostgres) -> float:
    """CPU seconds so far of every process of ``server`` running now (postmaster,
    backends, walsender or walreceiver, background workers), from /proc."""
    pid = int((server.data_dir / "postmaster.pid").read_text().split("\n", 1)[0])
    total = 0.0
    for process in (pid, *_children(pid)):
        with contextlib.suppress(OSError, IndexError):
            total += cpu_time(process)
    return total


async def feed_reads(dsn: str) -> int:
    """Scans of the feed table and its state on ``dsn``'s server so far (sequential and
    index scans, pg_stat_user_tables; a backend reports its counts when it exits)."""
    conn = await asyncpg.connect(dsn)
    try:
        await conn.execute("SELECT pg_stat_clear_snapshot()")
        reads = await conn.fetchval(
            "SELECT coalesce(sum(seq_scan + coalesce(idx_scan, 0)), 0)"
            " FROM pg_stat_user_tables WHERE schemaname = $1 AND relname IN ('feed', 'feed_state')",
            SCHEMA,
        )
    finally:
        await conn.close()
    return int(reads)


async def backends_cpu(dsn: str, names: tuple[str, ...]) -> dict[int, float]:
    """CPU seconds so far of the backends on ``dsn``'s server serving connections named
    ``names`` (their ``application_name``, or their ``backend_type``), by pid."""
    conn = await asyncpg.connect(dsn)
    try:
        pids = await conn.fetch(
            "SELECT pid FROM pg_stat_activity"
            " WHERE application_name = ANY($1::text[]) OR backend_type = ANY($1::text[])",
            list(names),
        )
    finally:
        await conn.close()
    found = {}
    for row in pids:
        with contextlib.suppress(OSError, IndexError):
            found[row["pid"]] = cpu_time(row["pid"])
    return found


async def replayed(primary: str, standby: str) -> None:
    """Wait until the standby has replayed everything the primary has written."""
    conn = await asyncpg.connect(primary)
    try:
        target = await insert_target(conn)
    finally:
        await conn.close()
    conn = await asyncpg.connect(standby)
    try:
        deadline = time.monotonic() + 60
        query = "SELECT pg_last_wal_replay_lsn() >= $1::text::pg_lsn"
        while not await conn.fetchval(query, target):
            if time.monotonic() > deadline:
                raise TimeoutError("the standby did not catch up")
            await asyncio.sleep(0.01)
    finally:
        await conn.close()


@contextlib.contextmanager
def primary_and_standby() -> Iterator[tuple[EmbeddedPostgres, EmbeddedPostgres]]:
    primary = temporary(settings={"synchronous_commit": "on", "max_connections": "500"})
    primary.start()
    try:
        standby = standby_of(primary)
        standby.start()
        try:
            yield primary, standby
        finally:
            standby.close()
    finally:
        primary.close()


# --------------------------------------------------------------------------- the publishers


@dataclass
class Publishers:
    """``changefeed serve`` processes, one port each."""

    processes: list[asyncio.subprocess.Process] = field(default_factory=list)
    urls: list[str] = field(default_factory=list)

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.processes]


def _config(dsn: str, read_dsn: str | None, port: int, connections: int) -> str:
    lines = [
        "[publisher]",
        f'dsn = "{dsn}"',
        *([f'read_dsn = "{read_dsn}"'] if read_dsn else []),
        f'schema = "{SCHEMA}"',
        "create_schema = false",
        "retention = false",
        f"max_connections = {connections}",
        "",
        "[[resources]]",
        'name = "vm"',
        'sub_resources = ["nic", "alias"]',
        'bootstrap_route = "/vms"',
        "",
        "[server]",
        f"port = {port}",
    ]
    return "\n".join(lines) + "\n"


@contextlib.asynccontextmanager
async def publishers(
    count: int, dsn: str, read_dsn: str | None, *, connections: int = 1000
) -> AsyncIterator[Publishers]:
    """``count`` publisher processes, ready (``/readyz``), stopped (SIGTERM) on exit."""
    fleet = Publishers()
    with (
        tempfile.TemporaryDirectory(prefix="changefeed-fleet-") as tmp,
        contextlib.ExitStack() as stack,
    ):
        try:
            for i in range(count):
                port = free_port()
                path = Path(tmp) / f"publisher-{i}.toml"
                named = f"{dsn}?application_name=changefeed-pool"
                path.write_text(_config(named, read_dsn, port, connections))
                log = stack.enter_context((Path(tmp) / f"publisher-{i}.log").open("wb"))
                process = await asyncio.create_subprocess_exec(
                    *(sys.executable, "-m", "changefeed.cli", "--log-level", "warning"),
                    *("serve", "--config", str(path)),
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=log,
                )
                fleet.processes.append(process)
                fleet.urls.append(f"127.0.0.1:{port}")
            async with httpx.AsyncClient(timeout=2) as client:
                for i, (url, process) in enumerate(zip(fleet.urls, fleet.processes, strict=True)):
                    deadline = time.monotonic() + 60
                    while True:
                        if process.returncode is not None:
                            said = (Path(tmp) / f"publisher-{i}.log").read_bytes()
                            raise RuntimeError(
                                f"publisher on {url} exited ({process.returncode}):\n"
                                + said.decode(errors="replace")[-2000:]
                            )
                        with contextlib.suppress(httpx.HTTPError):
                            if (await client.get(f"http://{url}/readyz")).status_code == 200:
                                break
                        if time.monotonic() > deadline:
                            raise TimeoutError(f"publisher on {url} not ready")
                        await asyncio.sleep(0.1)
            yield fleet
        finally:
            for process in fleet.processes:
                if process.returncode is None:
                    process.terminate()
            for process in fleet.processes:
                try:
                    async with asyncio.timeout(30):
                        await process.wait()
                except TimeoutError:
                    process.kill()
                    await process.wait()


def registration() -> str:
    return orjson.dumps(
        {
            "instance": str(uuid.uuid4()),
            "service": "fleet",
            "changeKind": {"resource": "vm", "subResources": ["nic"]},
            "batch": True,
        }
    ).decode()


# --------------------------------------------------------------------------- one configuration


@dataclass
class Figures:
    label: str
    publishers: int
    seconds: float
    per_publisher: list[float]
    """Deliveries/s of each publisher."""
    cpu_per_delivery: list[float]
    """Each publisher process's CPU seconds per delivery."""
    p50: float
    p99: float
    primary_cpu: float
    """Cores: the primary cluster's CPU over the window."""
    primary_reads: float
    """Feed reads/s on the primary over the window (counted when the backends exit)."""
    publisher_backends_cpu: float
    """Cores: the primary's backends serving the publishers' connections."""
    standby_cpu: float
    standby_reads: float
    walsender_cpu: float
    """Cores: the primary's WAL sender streaming to the standby."""

    @property
    def total(self) -> float:
        return sum(self.per_publisher)


async def measure(
    args: argparse.Namespace,
    primary: EmbeddedPostgres,
    standby: EmbeddedPostgres,
    count: int,
    *,
    read_standby: bool | None,
) -> Figures:
    """One configuration: ``count`` publishers (0: the writer alone) reading the primary
    (``read_standby`` False) or the standby."""
    changes = int(args.rate * args.seconds)
    label = "writer alone" if not count else "standby" if read_standby else "primary"
    reads_before = await feed_reads(primary.dsn), await feed_reads(standby.dsn)
    async with contextlib.AsyncExitStack() as stack:
        pubs = Publishers()
        if count:
            read_dsn = standby.dsn if read_standby else None
            pubs = await stack.enter_async_context(publishers(count, primary.dsn, read_dsn))
        # Entered after the publishers, so left first: they stop with no listener to drain.
        fleet = await stack.enter_async_context(ClientFleet(nofile=count * args.listeners + 1024))
        if count:
            frame = registration()
            for url in pubs.urls:
                done = await fleet.connect(
                    f"ws://{url}/changefeeds", args.listeners, frame, latency_slots=changes
                )
                if done["connected"] != args.listeners:
                    raise RuntimeError(f"{url}: {done}")
            await fleet.reset(changes)
        await asyncio.sleep(1.0)  # connections settle; pools fill
        backends = await backends_cpu(primary.dsn, PUBLISHER_APPS)
        walsender = await backends_cpu(primary.dsn, WALSENDER)
        publisher_cpu = [cpu_time(pid) for pid in pubs.pids]
        primary_cpu, standby_cpu = cluster_cpu(primary), cluster_cpu(standby)
        started = time.monotonic()
        sent_at = await run_writer(primary.dsn, "publish", args.rate, changes)
        report: dict[str, Any] = {"items": [], "complete": True}
        if count:
            report = await fleet.wait(30)
        window = time.monotonic() - started
        primary_cpu = cluster_cpu(primary) - primary_cpu
        standby_cpu = cluster_cpu(standby) - standby_cpu
        after = await backends_cpu(primary.dsn, PUBLISHER_APPS)
        sent = await backends_cpu(primary.dsn, WALSENDER)
        walsender_used = sum(cpu - walsender.get(pid, 0.0) for pid, cpu in sent.items())
        backends_used = sum(cpu - backends.get(pid, 0.0) for pid, cpu in after.items())
        publisher_cpu = [
            cpu_time(pid) - was for pid, was in zip(pubs.pids, publisher_cpu, strict=True)
        ]
        if not report["complete"]:
            raise RuntimeError(f"incomplete: {sum(report['items'])} items")
        p50 = p99 = float("nan")
        if count:
            skip = int(changes * WARMUP)
            latencies = await fleet.latencies([float("inf")] * skip + sent_at[skip:])
            p50, p99 = latencies["p50"], latencies["p99"]
    # Every publisher's backends have exited by now: their scans are counted.
    reads_after = await feed_reads(primary.dsn), await feed_reads(standby.dsn)
    items = report["items"]
    per_publisher = [
        sum(items[i * args.listeners : (i + 1) * args.listeners]) / args.seconds
        for i in range(count)
    ]
    delivered = [rate * args.seconds for rate in per_publisher]
    return Figures(
        label=label,
        publishers=count,
        seconds=window,
        per_publisher=per_publisher,
        cpu_per_delivery=[
            cpu / max(1.0, n) for cpu, n in zip(publisher_cpu, delivered, strict=True)
        ],
        p50=p50,
        p99=p99,
        primary_cpu=primary_cpu / window,
        primary_reads=(reads_after[0] - reads_before[0]) / window,
        publisher_backends_cpu=backends_used / window,
        standby_cpu=standby_cpu / window,
        standby_reads=(reads_after[1] - reads_before[1]) / window,
        walsender_cpu=walsender_used / window,
    )


def show(figures: Figures, base: Figures) -> None:
    if figures.publishers:
        each = ", ".join(f"{r:,.0f}" for r in figures.per_publisher)
        cpu = statistics.median(figures.cpu_per_delivery) * 1e6
        say(
            f"  {figures.label:<8} {figures.publishers} publisher(s): deliveries/s {each} "
            f"(total {figures.total:,.0f}); p50 {figures.p50 * 1e3:.2f} ms "
            f"p99 {figures.p99 * 1e3:.2f} ms; publisher CPU {cpu:.1f} us per delivery"
        )
    else:
        say(f"  {figures.label}: the baseline of the primary's and the standby's figures")
    say(
        f"    primary: {figures.primary_cpu * 100:.1f} % of a core "
        f"(+{(figures.primary_cpu - base.primary_cpu) * 100:.1f} over the writer alone), "
        f"feed reads {figures.primary_reads:,.1f}/s "
        f"(+{figures.primary_reads - base.primary_reads:,.1f}); the publishers' connections "
        f"there {figures.publisher_backends_cpu * 100:.2f} % of a core; "
        f"standby: {figures.standby_cpu * 100:.1f} % of a core, "
        f"feed reads {figures.standby_reads:,.1f}/s; the WAL sender to it "
        f"{figures.walsender_cpu * 100:.2f} % of a core"
    )


# --------------------------------------------------------------------------- the doorbell's cost


async def listen_cost(args: argparse.Namespace, primary: EmbeddedPostgres, listeners: int) -> float:
    """Primary CPU seconds per commit of each of ``listeners`` bare LISTEN connections
    on the feed's channel (what a doorbell that never rested would cost), against the
    writer alone, in the same run."""
    changes = int(args.rate * args.seconds)

    async def cluster_per_commit(count: int) -> float:
        conns = [await asyncpg.connect(primary.dsn) for _ in range(count)]
        try:
            for conn in conns:
                await conn.add_listener(notify_channel(SCHEMA), lambda *_: None)
            before = cluster_cpu(primary)
            await run_writer(primary.dsn, "publish", args.rate, changes)
            return (cluster_cpu(primary) - before) / changes
        finally:
            for conn in conns:
                await conn.close()

    alone = await cluster_per_commit(0)
    return (await cluster_per_commit(listeners) - alone) / listeners


# --------------------------------------------------------------------------- idle memory


_RAW_SERVER = """
import asyncio, sys
from websockets.asyncio.server import serve

async def hold(ws):
    await ws.wait_closed()

async def main():
    async with serve(
        hold, "127.0.0.1", int(sys.argv[1]), ping_interval=20, compression=None, backlog=4096
    ):
        print("ready", flush=True)
        await asyncio.Future()

import uvloop
uvloop.run(main())
"""


async def idle_rss(
    fleet: ClientFleet, url: str, pid: int, listeners: int, frame: str | None
) -> float:
    """Bytes of ``pid``'s RSS per idle connection, for ``listeners`` more of them."""
    await fleet.connect(url, 50, frame)  # warm: first connections allocate shared state
    await asyncio.sleep(1.0)
    before = rss_bytes(pid)
    done = await fleet.connect(url, listeners, frame, concurrency=100, timeout=120)
    if done["connected"] != listeners:
        raise RuntimeError(f"{done['connected']} of {listeners} connected: {done['refused']}")
    await asyncio.sleep(2.0)
    per = (rss_bytes(pid) - before) / listeners
    await fleet.close_all()
    return per


async def measure_idle(dsn: str, listeners: int) -> tuple[float, float]:
    """RSS per idle listener of a publisher process, and per idle connection of a bare
    websockets server process."""
    nofile = listeners + 2048
    raise_nofile(nofile)  # inherited by the server processes started below
    async with ClientFleet(nofile=nofile) as fleet:
        async with publishers(1, dsn, None, connections=listeners + 1000) as pubs:
            url = f"ws://{pubs.urls[0]}/changefeeds"
            publisher = await idle_rss(fleet, url, pubs.pids[0], listeners, registration())
        port = free_port()
        raw = await asyncio.create_subprocess_exec(
            sys.executable, "-c", _RAW_SERVER, str(port), stdout=subprocess.PIPE
        )
        try:
            assert raw.stdout is not None
            async with asyncio.timeout(60):
                await raw.stdout.readline()
            bare = await idle_rss(fleet, f"ws://127.0.0.1:{port}/", raw.pid, listeners, None)
        finally:
            raw.terminate()
            await raw.wait()
    return publisher, bare


# --------------------------------------------------------------------------- main


def _medians(columns: list[list[float]]) -> list[float]:
    return [statistics.median(c) for c in zip(*columns, strict=True)]


def median_of(runs: list[Figures]) -> Figures:
    """Each figure's median over the runs of one configuration."""

    def med(name: str) -> float:
        return float(statistics.median(getattr(r, name) for r in runs))

    first = runs[0]
    return Figures(
        label=first.label,
        publishers=first.publishers,
        seconds=med("seconds"),
        per_publisher=_medians([r.per_publisher for r in runs]),
        cpu_per_delivery=_medians([r.cpu_per_delivery for r in runs]),
        p50=med("p50"),
        p99=med("p99"),
        primary_cpu=med("primary_cpu"),
        primary_reads=med("primary_reads"),
        publisher_backends_cpu=med("publisher_backends_cpu"),
        standby_cpu=med("standby_cpu"),
        standby_reads=med("standby_reads"),
        walsender_cpu=med("walsender_cpu"),
    )


async def main(args: argparse.Namespace) -> None:
    counts = [int(n) for n in args.publishers.split(",")]
    say(
        f"fleet: {args.rate:g} changes/s for {args.seconds:g} s, {args.listeners} listeners "
        f"per publisher, publishers {counts}, {args.rounds} round(s), on {os.cpu_count()} "
        f"cores (load {os.getloadavg()[0]:.2f})"
    )
    runs: dict[tuple[str, int], list[Figures]] = {}
    with primary_and_standby() as (primary, standby):
        admin = await asyncpg.connect(primary.dsn)
        try:
            await admin.execute(f"DROP SCHEMA IF EXISTS {SCHEMA} CASCADE")
            await apply_schema(admin, SCHEMA)
            await fill_history(admin, args.history)
        finally:
            await admin.close()
        await replayed(primary.dsn, standby.dsn)
        for round_ in range(args.rounds):
            say(f"round {round_ + 1}:")
            base = await measure(args, primary, standby, 0, read_standby=None)
            runs.setdefault(("writer alone", 0), []).append(base)
            show(base, base)
            # Interleaved, so that the machine's other load falls on both alike.
            for count in counts:
                for read_standby in (False, True):
                    figures = await measure(
                        args, primary, standby, count, read_standby=read_standby
                    )
                    runs.setdefault((figures.label, count), []).append(figures)
                    show(figures, base)
        rings = [await listen_cost(args, primary, 4) for _ in range(args.rounds)]
        memory = await measure_idle(primary.dsn, args.idle) if args.idle else None
    medians = {key: median_of(found) for key, found in runs.items()}
    base = medians["writer alone", 0]
    say(f"result (medians of {args.rounds} round(s)):")
    show(base, base)
    for count in counts:
        on_primary, on_standby = medians["primary", count], medians["standby", count]
        show(on_primary, base)
        show(on_standby, base)
        p50s = ", ".join(f"{r.p50 * 1e3:.2f}" for r in runs["standby", count])
        say(
            f"  => {count} publisher(s): p50 via the standby {on_standby.p50 * 1e3:.2f} ms "
            f"(runs: {p50s}), {(on_standby.p50 - on_primary.p50) * 1e3:+.2f} ms against the "
            f"primary's {on_primary.p50 * 1e3:.2f} ms (target <= +2 ms); feed reads on the "
            f"primary above the writer alone: {on_primary.primary_reads - base.primary_reads:,.1f}"
            f"/s reading the primary, {on_standby.primary_reads - base.primary_reads:,.1f}/s "
            f"reading the standby (target 0)"
        )
    if len(counts) > 1:
        first, last = counts[0], counts[-1]
        for label in ("primary", "standby"):
            a, b = medians[label, first], medians[label, last]
            slope = (b.primary_cpu - a.primary_cpu) / (last - first)
            backends = (b.publisher_backends_cpu - a.publisher_backends_cpu) / (last - first)
            standby_slope = (b.standby_cpu - a.standby_cpu) / (last - first)
            say(
                f"  => each added publisher reading the {label}: the primary "
                f"{slope * 100:+.2f} % of a core (its connections there "
                f"{backends * 100:+.2f} %; target reading the standby <= 1 %), the standby "
                f"{standby_slope * 100:+.2f} %"
            )
    walsender = statistics.median(f.walsender_cpu for key, found in runs.items() for f in found)
    say(f"  => the WAL sender streaming to the standby: {walsender * 100:.2f} % of a core")
    ring = statistics.median(rings)
    say(
        f"  => a LISTEN connection that never rested would cost the primary "
        f"{ring * 1e6:.1f} us per commit ({ring * args.rate * 100:.2f} % of a core at "
        f"{args.rate:g} commits/s) per publisher (runs: "
        + ", ".join(f"{r * 1e6:.1f}" for r in rings)
        + " us)"
    )
    if memory is not None:
        publisher, bare = memory
        say(
            f"  => {args.idle:,} idle listeners on one publisher process: "
            f"{publisher / 1024:.1f} KiB each (target <= 20 KiB); a bare websockets server: "
            f"{bare / 1024:.1f} KiB per connection ({publisher / bare:.2f}x)"
        )


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--quick", action="store_true", help="a short run (for the smoke test)")
    parser.add_argument("--publishers", default="1,2,4", help="publisher counts, e.g. 1,2,4")
    parser.add_argument("--listeners", type=int, default=20, help="listeners per publisher")
    parser.add_argument("--rate", type=float, default=1000.0, help="changes per second")
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--rounds", type=int, default=3, help="rounds; medians are printed")
    parser.add_argument("--idle", type=int, default=10_000, help="idle listeners (0: skip)")
    parser.add_argument("--history", type=int, default=100_000, help="older entries in the feed")
    args = parser.parse_args()
    if args.quick:
        args.publishers, args.listeners, args.rate, args.seconds = "1,2", 3, 200.0, 1.0
        args.idle, args.history, args.rounds = 200, 1000, 1
    return args


if __name__ == "__main__":
    import uvloop

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        runner.run(main(parse_args()))
