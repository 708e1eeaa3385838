"""Soak: a long, bounded run at steady load with listener churn, watching for slow leaks.

    python bench/soak.py [--minutes 20] [--rate 20] [--dsn DSN] [--out DIR]

What runs, all on 127.0.0.1:

* ``changefeed example-api`` (a subprocess): the VM API that owns the VMs and
  appends the feed entries, and serves the bootstrap route;
* ``changefeed serve`` (a subprocess): the publisher under test, a standalone
  one with inline retention on a short ``max_age`` (30 s), so the feed table
  must stay bounded; its bootstrap route is the API's absolute URL;
* in this process: a writer at a steady ``--rate`` of creates, renames,
  renumbers and deletes through the API (the population stays near
  ``--population``); ``--mirrors`` controllers that stay connected for the
  whole run; ``--churners`` listeners that connect, stay a few seconds,
  disconnect and come back with their cursor (resume), now and then after
  longer than ``max_age`` (the cursor has expired: bootstrap).

Every ``--sample-every`` seconds it records the publisher's RSS, descriptors
and threads (psutil on the subprocess), this process's RSS and asyncio
tasks (the listener side), the feed table's rows, size
(``pg_total_relation_size``) and oldest entry, the database's connections
(``pg_stat_activity``), and the publisher's own view (``/changefeeds/stats``:
connections, listeners, tailer lag). It writes ``soak.csv``, ``soak.json``
and ``soak.png`` (matplotlib, when installed) to ``--out``, and reports the
trend of each series as the slope of a least-squares line over the second
half of the run, where start-up effects are over.

The checks (exit status 1 if one fails):

* memory flat: neither RSS grows faster than ``--rss-slope`` MB/min over the
  second half;
* feed bounded by retention: rows never exceed what ``rate x (max_age +
  retention_interval)`` allows (x 1.5), the oldest entry is never much older
  than ``max_age``, and the table's size does not keep growing;
* nothing leaks: database connections, publisher descriptors and this
  process's tasks do not grow; at the end the publisher counts exactly the
  listeners still connected, and this process is back to its task count from
  before the listeners started;
* nothing lost: after the writes stop, every mirror equals the API's data.

Without ``--dsn`` an embedded PostgreSQL is started (changefeed.embedded).
tests/test_soak.py runs the same code for about a minute with looser limits.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import csv
import dataclasses
import json
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import asyncpg
import httpx
import orjson
import psutil
from common import free_port, say

from changefeed.listener import BackoffPolicy, Controller, Listener, ListenerConfig, Resynced
from changefeed.schemas import ChangeItem, ChangeKind

__all__ = ["SoakOptions", "SoakReport", "main", "run"]

MB = 1024 * 1024
# Connections this run may hold: the example API's pool (10) and its publisher's
# (4) and tailer (1), the standalone publisher's pool (4) and tailer (1), the
# sampler (1).
PG_CEILING = 10 + 4 + 1 + 4 + 1 + 1
VM = ChangeKind("vm", ("nic", "alias"))


@dataclass(frozen=True)
class SoakOptions:
    """One soak run: the load, the churn, the retention, the sampling and the limits."""

    minutes: float = 20.0
    rate: float = 20.0  # writes per second
    population: int = 300  # VMs the writer keeps around
    mirrors: int = 2  # controllers connected for the whole run
    churners: int = 6  # listeners that come and go
    churn_every: float = 5.0  # mean seconds a churner stays connected
    expire_share: float = 0.1  # share of churner absences longer than max_age
    max_age: float = 30.0
    retention_interval: float = 5.0
    sample_every: float = 10.0
    rss_slope: float = 0.25  # MB per minute, publisher and listener side
    size_growth: float = 0.25  # allowed growth of the feed's size over the second half
    dsn: str | None = None
    out: Path = Path("bench/out/soak")
    plot: bool = True
    seed: int = 5


@dataclass
class Sample:
    """One row of soak.csv."""

    t: float
    publisher_rss_mb: float
    publisher_fds: int
    publisher_threads: int
    publisher_cpu_s: float
    listener_rss_mb: float
    listener_tasks: int
    feed_rows: int
    feed_mb: float
    feed_oldest_s: float
    pg_connections: int
    publisher_connections: int
    publisher_listeners: int
    tailer_lag_s: float
    writes: int
    write_errors: int
    items: int
    reconnects: int
    resumes: int
    bootstraps: int


@dataclass
class Check:
    name: str
    ok: bool
    detail: str


@dataclass
class SoakReport:
    """What a run measured and concluded."""

    options: dict[str, Any]
    samples: list[Sample] = field(default_factory=list)
    trends: dict[str, float] = field(default_factory=dict)  # per minute, second half
    checks: list[Check] = field(default_factory=list)
    figures: dict[str, Any] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return bool(self.checks) and all(c.ok for c in self.checks)

    def failed(self) -> list[Check]:
        return [c for c in self.checks if not c.ok]

    def to_json(self) -> dict[str, Any]:
        return {
            "options": self.options,
            "ok": self.ok,
            "trends_per_minute": self.trends,
            "figures": self.figures,
            "checks": [dataclasses.asdict(c) for c in self.checks],
        }


# -- the database -----------------------------------------------------------------------------

DEPLOY = Path(__file__).resolve().parent.parent / "deploy" / "postgresql"
_SETTING = re.compile(r"^\s*([a-z_]+)\s*=\s*('[^']*'|[^#\s]+)")


def deploy_settings() -> dict[str, str]:
    """The server settings of deploy/postgresql/changefeed.conf."""
    settings = {}
    for line in (DEPLOY / "changefeed.conf").read_text().splitlines():
        if (match := _SETTING.match(line)) is not None:
            settings[match.group(1)] = match.group(2).strip("'")
    return settings


@contextlib.contextmanager
def database(dsn: str | None) -> Iterator[str]:
    """``dsn`` as given, or a throwaway embedded PostgreSQL with deploy/'s settings."""
    if dsn:
        yield dsn
        return
    from changefeed.embedded import temporary

    server = temporary(settings=deploy_settings())
    server.start()
    try:
        yield server.dsn
    finally:
        server.close()


# -- processes ---------------------------------------------------------------------------------


class Child:
    """A ``changefeed`` sub-command; output to ``<out>/<name>.log``; stopped in a finally."""

    def __init__(self, name: str, args: Sequence[str], port: int, out: Path) -> None:
        self.name = name
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self.log = out / f"{name}.log"
        argv = [sys.executable, "-m", "changefeed.cli", "--log-json", "--log-level", "warning"]
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(
                [*argv, *args],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self.ps = psutil.Process(self.proc.pid)

    async def ready(self, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        async with httpx.AsyncClient(timeout=2) as client:
            while True:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"{self.name} exited: {self.log.read_text()[-3000:]}")
                with contextlib.suppress(httpx.HTTPError):
                    if (await client.get(self.url + "/readyz")).status_code == 200:
                        return
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{self.name} not ready within {timeout}s")
                await asyncio.sleep(0.1)

    async def stop(self, timeout: float = 20.0) -> None:
        if self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            await asyncio.to_thread(self.proc.wait, timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            await asyncio.to_thread(self.proc.wait, 10)


@contextlib.asynccontextmanager
async def children(out: Path, dsn: str, options: SoakOptions) -> AsyncIterator[tuple[Child, Child]]:
    """The example API and the standalone publisher under test, ready."""
    api_port, port = free_port(), free_port()
    config = out / "changefeed.toml"
    config.write_text(
        "\n".join(
            [
                "[publisher]",
                f'dsn = "{dsn}"',
                f"max_age = {options.max_age}",
                f"retention_interval = {options.retention_interval}",
                "",
                "[[resources]]",
                'name = "vm"',
                'sub_resources = ["nic", "alias"]',
                f'bootstrap_route = "http://127.0.0.1:{api_port}/vms"',
                "",
                "[server]",
                f"port = {port}",
                'drain_grace = "2s"',
                "",
            ]
        )
    )
    started: list[Child] = []
    try:
        api = Child(
            "example-api", ["example-api", "--dsn", dsn, "--port", str(api_port)], api_port, out
        )
        started.append(api)
        await api.ready()  # it creates the feed schema
        publisher = Child("publisher", ["serve", "--config", str(config)], port, out)
        started.append(publisher)
        await publisher.ready()
        yield api, publisher
    finally:
        for child in reversed(started):
            await child.stop()


# -- load -------------------------------------------------------------------------------------


class Writer:
    """Writes at a steady rate through the API; the population stays near its target."""

    def __init__(self, client: httpx.AsyncClient, options: SoakOptions) -> None:
        self.client = client
        self.options = options
        self.rng = random.Random(options.seed)
        self.ids: list[str] = []
        self.writes = 0
        self.errors = 0

    def _vm(self) -> dict[str, Any]:
        n = self.rng.randrange(1000)
        nics = [{"ip": f"10.{n % 7}.{n % 250}.{self.rng.randrange(1, 250)}"}]
        return {"alias": f"soak-{n}", "nics": nics}

    async def step(self) -> None:
        rng = self.rng
        fill = len(self.ids) / self.options.population
        op = (
            "create"
            if fill < 0.9
            else rng.choices(("create", "alias", "nics", "delete"), (2, 5, 3, 2))[0]
        )
        if op == "delete" or (op == "create" and fill > 1.1):
            vm = self.ids.pop(rng.randrange(len(self.ids)))
            response = await self.client.delete(f"/vms/{vm}")
        elif op == "create":
            response = await self.client.post("/vms", json=self._vm())
            if response.status_code == 201:
                self.ids.append(response.json()["uuid"])
        else:
            vm = rng.choice(self.ids)
            body = self._vm()
            patch = {"alias": body["alias"]} if op == "alias" else {"nics": body["nics"]}
            response = await self.client.patch(f"/vms/{vm}", json=patch)
        if response.status_code >= 300:
            self.errors += 1
        self.writes += 1

    async def run(self, stop: asyncio.Event) -> None:
        period = 1.0 / self.options.rate
        next_at = time.monotonic()
        while not stop.is_set():
            try:
                await self.step()
            except httpx.HTTPError:
                self.errors += 1
            next_at += period
            delay = next_at - time.monotonic()
            if delay < -1.0:  # fell behind by a second: do not burst to catch up
                next_at = time.monotonic()
            elif delay > 0:
                await asyncio.sleep(delay)  # pacing the load


def listener_config() -> ListenerConfig:
    return ListenerConfig(
        backoff=BackoffPolicy(initial=0.1, maximum=2.0, reset_after=10.0),
        ping_interval=5.0,
        ping_timeout=5.0,
        http_timeout=10.0,
    )


class Churner:
    """A listener that connects, stays a while, leaves, and comes back with its cursor."""

    def __init__(self, ws_url: str, n: int, options: SoakOptions) -> None:
        self.ws_url = ws_url
        self.options = options
        self.rng = random.Random(f"{options.seed}-{n}")
        self.instance = str(uuid.uuid4())
        self.name = f"churn-{n}"
        self.cursor: str | None = None
        self.connected = False
        self.items = 0
        self.sessions = 0
        self.resumes = 0
        self.bootstraps = 0

    async def _session(self) -> None:
        listener = Listener(
            self.ws_url,
            instance=self.instance,
            service="soak-churn",
            change_kind=VM,
            config=listener_config(),
            cursor=self.cursor,
            name=self.name,
        )
        stay = self.rng.uniform(0.5, 1.5) * self.options.churn_every
        async with listener:
            self.connected = True
            try:
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(stay):
                        async for event in listener:
                            if isinstance(event, Resynced):
                                self.items += len(event.items)
                            elif isinstance(event, ChangeItem):
                                self.items += 1
            finally:
                self.connected = False
                status = listener.status()
                self.cursor = listener.cursor
                self.sessions += 1
                self.resumes += status.resumes
                self.bootstraps += status.bootstraps

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            await self._session()
            if self.rng.random() < self.options.expire_share:
                away = self.options.max_age + 2 * self.options.retention_interval + 1
            else:
                away = self.rng.uniform(0.2, 2.0)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), away)


# -- sampling ---------------------------------------------------------------------------------


async def feed_figures(conn: asyncpg.Connection) -> tuple[int, float, float, int]:
    row = await conn.fetchrow(
        "SELECT count(*) AS n, pg_total_relation_size('changefeed.feed') AS size,"
        " coalesce(extract(epoch FROM now() - min(published)), 0)::float8 AS oldest"
        " FROM changefeed.feed"
    )
    connections = await conn.fetchval(
        "SELECT count(*) FROM pg_stat_activity"
        " WHERE datname = current_database() AND backend_type = 'client backend'"
    )
    assert row is not None
    return int(row["n"]), row["size"] / MB, float(row["oldest"]), int(connections)


class Sampler:
    """Takes a Sample every so often (and one at the end)."""

    def __init__(
        self,
        *,
        publisher: Child,
        conn: asyncpg.Connection,
        http: httpx.AsyncClient,
        writer: Writer,
        churners: list[Churner],
        mirrors: list[Controller],
    ) -> None:
        self.publisher = publisher
        self.conn = conn
        self.http = http
        self.writer = writer
        self.churners = churners
        self.mirrors = mirrors
        self.me = psutil.Process()
        self.t0 = time.monotonic()
        self.samples: list[Sample] = []

    async def sample(self) -> Sample:
        ps = self.publisher.ps
        cpu = ps.cpu_times()
        rows, size, oldest, connections = await feed_figures(self.conn)
        stats = (await self.http.get(self.publisher.url + "/changefeeds/stats")).json()
        items = sum(c.items for c in self.churners) + sum(m.stats().items for m in self.mirrors)
        sample = Sample(
            t=round(time.monotonic() - self.t0, 2),
            publisher_rss_mb=round(ps.memory_info().rss / MB, 2),
            publisher_fds=ps.num_fds(),
            publisher_threads=ps.num_threads(),
            publisher_cpu_s=round(cpu.user + cpu.system, 2),
            listener_rss_mb=round(self.me.memory_info().rss / MB, 2),
            listener_tasks=len(asyncio.all_tasks()),
            feed_rows=rows,
            feed_mb=round(size, 3),
            feed_oldest_s=round(oldest, 2),
            pg_connections=connections,
            publisher_connections=int(stats.get("connections", -1)),
            publisher_listeners=int(stats["listeners"]),
            tailer_lag_s=float(stats["tailer"]["lagSeconds"]),
            writes=self.writer.writes,
            write_errors=self.writer.errors,
            items=items,
            reconnects=sum(c.sessions for c in self.churners),
            resumes=sum(c.resumes for c in self.churners),
            bootstraps=sum(c.bootstraps for c in self.churners),
        )
        self.samples.append(sample)
        return sample

    async def run(self, stop: asyncio.Event, every: float) -> None:
        next_at = time.monotonic()
        while not stop.is_set():
            sample = await self.sample()
            say(
                f"  t={sample.t:7.1f}s publisher rss={sample.publisher_rss_mb:6.1f}MB "
                f"fds={sample.publisher_fds:3d} listeners={sample.publisher_listeners:2d} | "
                f"feed rows={sample.feed_rows:5d} {sample.feed_mb:5.2f}MB "
                f"oldest={sample.feed_oldest_s:5.1f}s | pg conns={sample.pg_connections:2d} | "
                f"side rss={sample.listener_rss_mb:6.1f}MB tasks={sample.listener_tasks:3d} | "
                f"writes={sample.writes} sessions={sample.reconnects}"
            )
            next_at += every
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), max(0.0, next_at - time.monotonic()))


# -- analysis -----------------------------------------------------------------------------------


def slope_per_minute(samples: Sequence[Sample], name: str) -> float:
    """Least-squares slope of ``name`` against time, per minute."""
    xs = [s.t / 60 for s in samples]
    ys = [float(getattr(s, name)) for s in samples]
    if len(xs) < 3 or len(set(xs)) < 2:
        return 0.0
    return statistics.linear_regression(xs, ys).slope


def analyse(report: SoakReport, options: SoakOptions, end: dict[str, Any]) -> None:
    samples = report.samples
    duration = samples[-1].t
    second = [s for s in samples if s.t >= duration / 2]
    warm = options.max_age + 2 * options.retention_interval
    settled = [s for s in samples if s.t >= warm] or second
    first = [s for s in settled if s.t < duration / 2] or settled
    for name in (
        "publisher_rss_mb",
        "listener_rss_mb",
        "feed_rows",
        "feed_mb",
        "pg_connections",
        "publisher_fds",
        "listener_tasks",
    ):
        report.trends[name] = round(slope_per_minute(second, name), 4)
    checks = report.checks

    def check(name: str, ok: bool, detail: str) -> None:
        checks.append(Check(name, bool(ok), detail))

    for name, label in (("publisher_rss_mb", "publisher"), ("listener_rss_mb", "listener side")):
        slope = report.trends[name]
        check(
            f"memory flat ({label})",
            slope <= options.rss_slope,
            f"{slope:+.3f} MB/min over the second half (limit {options.rss_slope}); "
            f"{second[0].__dict__[name]:.1f} -> {second[-1].__dict__[name]:.1f} MB",
        )
    bound = options.rate * (options.max_age + options.retention_interval) * 1.5 + 50
    most = max(s.feed_rows for s in settled)
    check("feed rows bounded", most <= bound, f"max {most} rows after warm-up (bound {bound:.0f})")
    oldest = max(s.feed_oldest_s for s in settled)
    limit = options.max_age + options.retention_interval + options.sample_every + 5
    check("oldest entry bounded", oldest <= limit, f"max {oldest:.1f}s (limit {limit:.0f}s)")
    sizes_first = max(s.feed_mb for s in first)
    sizes_second = max(s.feed_mb for s in second)
    check(
        "feed size bounded",
        sizes_second <= sizes_first * (1 + options.size_growth) + 0.5,
        f"max {sizes_first:.2f} MB before the second half, {sizes_second:.2f} MB in it",
    )
    # Pools grow under load up to their maxima; a leaked connection is one more
    # than every pool and tailer together, and a trend that does not stop.
    most = max(s.pg_connections for s in samples)
    trend = report.trends["pg_connections"]
    # Over a short run the second half holds a handful of samples of a count that
    # moves by one or two as pools breathe: only the ceiling means anything there.
    trend_ok = trend <= 1.0 or options.minutes < 5
    check(
        "database connections bounded",
        most <= PG_CEILING and trend_ok,
        f"max {most} (pools and tailers allow {PG_CEILING}), {trend:+.2f}/min over the second half",
    )
    churn = options.churners + 2
    check(
        "publisher descriptors flat",
        max(s.publisher_fds for s in second) <= max(s.publisher_fds for s in first) + churn,
        f"max {max(s.publisher_fds for s in first)} then {max(s.publisher_fds for s in second)}",
    )
    check(
        "listener-side tasks flat",
        max(s.listener_tasks for s in second) <= max(s.listener_tasks for s in first) + 5,
        f"max {max(s.listener_tasks for s in first)} then {max(s.listener_tasks for s in second)}",
    )
    check(
        "publisher counts only live listeners at the end",
        end["publisher_connections"] == end["publisher_listeners"] == options.mirrors,
        f"{end['publisher_connections']} connections, {end['publisher_listeners']} listeners, "
        f"{options.mirrors} mirrors connected",
    )
    check(
        "listener-side tasks back to baseline",
        end["tasks_after"] <= end["tasks_before"],
        f"{end['tasks_before']} before the listeners, {end['tasks_after']} after",
    )
    check("mirrors converged", end["converged"], end["convergence"])
    writes, errors = end["writes"], end["write_errors"]
    check(
        "writes kept their rate",
        writes >= 0.9 * options.rate * duration and errors <= 0.01 * writes,
        f"{writes} writes in {duration:.0f}s ({writes / duration:.1f}/s, target "
        f"{options.rate:g}/s), {errors} failed",
    )
    last = samples[-1]
    check(
        "churn exercised resume and bootstrap",
        last.reconnects >= options.churners and last.resumes > 0 and last.bootstraps > 0,
        f"{last.reconnects} sessions, {last.resumes} resumed, {last.bootstraps} bootstrapped",
    )
    report.figures = {
        "duration_s": duration,
        "writes": last.writes,
        "write_errors": last.write_errors,
        "writes_per_s": round(last.writes / duration, 2) if duration else 0,
        "items_received": last.items,
        "sessions": last.reconnects,
        "resumed": last.resumes,
        "bootstrapped": last.bootstraps,
        "publisher_rss_mb": {
            "start": samples[0].publisher_rss_mb,
            "end": last.publisher_rss_mb,
            "max": max(s.publisher_rss_mb for s in samples),
        },
        "listener_rss_mb": {
            "start": samples[0].listener_rss_mb,
            "end": last.listener_rss_mb,
            "max": max(s.listener_rss_mb for s in samples),
        },
        "feed_rows_max": max(s.feed_rows for s in samples),
        "feed_mb_max": max(s.feed_mb for s in samples),
        "feed_oldest_s_max": max(s.feed_oldest_s for s in settled),
        "publisher_cpu_s": last.publisher_cpu_s,
        "tailer_lag_s_max": max(s.tailer_lag_s for s in samples),
        "pg_connections_max": max(s.pg_connections for s in samples),
        **end,
    }


def write_outputs(report: SoakReport, out: Path, plot: bool) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    written = [out / "soak.csv", out / "soak.json"]
    with open(written[0], "w", newline="") as f:
        names = [f.name for f in dataclasses.fields(Sample)]
        writer = csv.DictWriter(f, fieldnames=names)
        writer.writeheader()
        for sample in report.samples:
            writer.writerow(dataclasses.asdict(sample))
    written[1].write_text(json.dumps(report.to_json(), indent=2) + "\n")
    if plot:
        png = plot_samples(report, out / "soak.png")
        if png is not None:
            written.append(png)
    return written


def plot_samples(report: SoakReport, path: Path) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        say("  (matplotlib is not installed: no plot)")
        return None
    samples = report.samples
    minutes = [s.t / 60 for s in samples]
    fig, (mem, feed, conns) = plt.subplots(3, 1, figsize=(9, 9), sharex=True)
    mem.plot(minutes, [s.publisher_rss_mb for s in samples], label="publisher RSS")
    mem.plot(minutes, [s.listener_rss_mb for s in samples], label="listener side RSS")
    mem.set_ylabel("MB")
    mem.set_ylim(bottom=0)
    mem.legend(loc="lower right")
    mem.set_title(
        f"changefeed soak: {report.options['rate']:g} writes/s, "
        f"{report.options['churners']} churning + {report.options['mirrors']} steady listeners, "
        f"max_age {report.options['max_age']:g}s"
    )
    feed.plot(minutes, [s.feed_rows for s in samples], color="tab:green", label="feed rows")
    feed.set_ylabel("rows")
    feed.set_ylim(bottom=0)
    size = feed.twinx()
    size.plot(minutes, [s.feed_mb for s in samples], color="tab:red", label="feed size (MB)")
    size.set_ylabel("MB")
    size.set_ylim(bottom=0)
    lines = feed.get_legend_handles_labels()[0] + size.get_legend_handles_labels()[0]
    feed.legend(lines, [str(line.get_label()) for line in lines], loc="lower right")
    conns.plot(minutes, [s.pg_connections for s in samples], label="database connections")
    conns.plot(minutes, [s.publisher_fds for s in samples], label="publisher descriptors")
    conns.plot(minutes, [s.listener_tasks for s in samples], label="listener-side tasks")
    conns.plot(minutes, [s.publisher_listeners for s in samples], label="publisher listeners")
    conns.set_ylabel("count")
    conns.set_xlabel("minutes")
    conns.set_ylim(bottom=0)
    conns.legend(loc="upper right", fontsize="small")
    half = minutes[-1] / 2
    for axis in (mem, feed, conns):
        axis.axvline(half, color="grey", linestyle=":", linewidth=1)
        axis.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


# -- the run ----------------------------------------------------------------------------------


async def api_vms(conn: asyncpg.Connection) -> dict[str, dict[str, Any]]:
    rows = await conn.fetch("SELECT uuid, alias, nics, server_uuid FROM vmapi.vms")
    return {
        str(r["uuid"]): {
            "uuid": str(r["uuid"]),
            "alias": r["alias"],
            "nics": orjson.loads(r["nics"]),
            "server_uuid": r["server_uuid"] and str(r["server_uuid"]),
        }
        for r in rows
    }


async def converge(conn: asyncpg.Connection, mirrors: Sequence[Controller]) -> tuple[bool, str]:
    """Wait (60 s at most) until every mirror equals the API's data; whether it did, and how."""
    expected = await api_vms(conn)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if all(dict(m.mirror) == expected for m in mirrors):
            return True, f"{len(mirrors)} mirrors equal the API's {len(expected)} VMs"
        await asyncio.sleep(0.1)
    differ = [
        f"{m.name}: {len(set(expected) - set(m.mirror))} missing, "
        f"{sum(1 for k, v in m.mirror.items() if expected.get(k) != v)} differ"
        for m in mirrors
    ]
    return False, "; ".join(differ)


async def settle(http: httpx.AsyncClient, publisher: Child, listeners: int) -> dict[str, Any]:
    """The publisher's stats once it counts ``listeners`` (10 s at most), or as they are then."""
    deadline = time.monotonic() + 10
    while True:
        stats: dict[str, Any] = (await http.get(publisher.url + "/changefeeds/stats")).json()
        if stats["listeners"] == stats.get("connections") == listeners:
            return stats
        if time.monotonic() > deadline:
            return stats
        await asyncio.sleep(0.1)


async def run(options: SoakOptions) -> SoakReport:
    """One soak run; the report (``report.ok``) and the files in ``options.out``."""
    report = SoakReport(
        options={
            k: str(v) if isinstance(v, Path) else v for k, v in dataclasses.asdict(options).items()
        }
    )
    out = options.out
    out.mkdir(parents=True, exist_ok=True)
    with database(options.dsn) as dsn:
        async with (
            children(out, dsn, options) as (api, publisher),
            contextlib.AsyncExitStack() as stack,
        ):
            conn = await asyncpg.connect(dsn)
            stack.push_async_callback(conn.close)
            await conn.execute((DEPLOY / "feed-table.sql").read_text())  # as deployed
            http = await stack.enter_async_context(httpx.AsyncClient(timeout=10))
            api_client = await stack.enter_async_context(
                httpx.AsyncClient(base_url=api.url, timeout=10)
            )
            writer = Writer(api_client, options)
            say(f"soak: {options.minutes:g} min, publisher pid {publisher.proc.pid}, out {out}")
            while len(writer.ids) < options.population * 0.9:
                await writer.step()
            tasks_before = len(asyncio.all_tasks())
            ws_url = f"ws://127.0.0.1:{publisher.port}/changefeeds"
            listeners = contextlib.AsyncExitStack()
            mirrors = [
                Controller(
                    Listener(
                        ws_url,
                        instance=str(uuid.uuid4()),
                        service="soak-mirror",
                        change_kind=VM,
                        config=listener_config(),
                        name=f"mirror-{n}",
                    ),
                    retry=BackoffPolicy(initial=0.05, maximum=1.0),
                    name=f"mirror-{n}",
                )
                for n in range(options.mirrors)
            ]
            churners = [Churner(ws_url, n, options) for n in range(options.churners)]
            stop = asyncio.Event()
            async with listeners:
                for mirror in mirrors:
                    await listeners.enter_async_context(mirror)
                for mirror in mirrors:
                    await mirror.wait_synced(60)
                sampler = Sampler(
                    publisher=publisher,
                    conn=conn,
                    http=http,
                    writer=writer,
                    churners=churners,
                    mirrors=mirrors,
                )
                work = [
                    asyncio.create_task(writer.run(stop), name="soak-writer"),
                    *(asyncio.create_task(c.run(stop), name=c.name) for c in churners),
                    asyncio.create_task(
                        sampler.run(stop, options.sample_every), name="soak-sampler"
                    ),
                ]
                try:
                    done, _ = await asyncio.wait(
                        work, timeout=options.minutes * 60, return_when=asyncio.FIRST_EXCEPTION
                    )
                    for task in done:
                        task.result()  # a failed load task fails the run, loudly
                finally:
                    stop.set()
                    await asyncio.wait_for(asyncio.gather(*work, return_exceptions=True), 60)
                report.samples = list(sampler.samples)  # the trends: the run under load
                final = await sampler.sample()
                converged, convergence = await converge(conn, mirrors)
                end_stats = await settle(http, publisher, options.mirrors)
            tasks_after = len(asyncio.all_tasks())
            end = {
                "writes": final.writes,
                "write_errors": final.write_errors,
                "publisher_connections": end_stats.get("connections"),
                "publisher_listeners": end_stats.get("listeners"),
                "tasks_before": tasks_before,
                "tasks_after": tasks_after,
                "converged": converged,
                "convergence": convergence,
            }
            analyse(report, options, end)
    written = write_outputs(report, out, options.plot)
    say("")
    for check in report.checks:
        say(f"  {'ok  ' if check.ok else 'FAIL'} {check.name}: {check.detail}")
    say(
        "  trends (per minute, second half): "
        + ", ".join(f"{k}={v:+g}" for k, v in report.trends.items())
    )
    say("  wrote " + ", ".join(str(p) for p in written))
    return report


def main(argv: Sequence[str] | None = None) -> int:
    defaults = SoakOptions()
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--minutes", type=float, default=defaults.minutes)
    parser.add_argument("--rate", type=float, default=defaults.rate, help="writes per second")
    parser.add_argument("--population", type=int, default=defaults.population)
    parser.add_argument("--mirrors", type=int, default=defaults.mirrors)
    parser.add_argument("--churners", type=int, default=defaults.churners)
    parser.add_argument("--churn-every", type=float, default=defaults.churn_every)
    parser.add_argument("--max-age", type=float, default=defaults.max_age)
    parser.add_argument("--retention-interval", type=float, default=defaults.retention_interval)
    parser.add_argument("--sample-every", type=float, default=defaults.sample_every)
    parser.add_argument("--rss-slope", type=float, default=defaults.rss_slope, help="MB/min")
    parser.add_argument("--dsn", default=os.environ.get("CHANGEFEED_DSN"))
    parser.add_argument("--out", type=Path, default=defaults.out)
    parser.add_argument("--no-plot", action="store_true")
    args = parser.parse_args(argv)
    options = SoakOptions(
        minutes=args.minutes,
        rate=args.rate,
        population=args.population,
        mirrors=args.mirrors,
        churners=args.churners,
        churn_every=args.churn_every,
        max_age=args.max_age,
        retention_interval=args.retention_interval,
        sample_every=args.sample_every,
        rss_slope=args.rss_slope,
        dsn=args.dsn,
        out=args.out,
        plot=not args.no_plot,
    )
    report = asyncio.run(_main(options))
    return 0 if report.ok else 1


async def _main(options: SoakOptions) -> SoakReport:
    # SIGTERM (a CI job's timeout, `kill`) unwinds like Ctrl-C: every child is stopped.
    task = asyncio.current_task()
    assert task is not None
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, task.cancel)
    return await run(options)


if __name__ == "__main__":
    sys.exit(main())
