"""Listener and controller throughput, each beside a baseline measured in the same run.

    python bench/listener.py [--baseline REF] [--dsn DSN] [--quick] [--items 200000]
                             [--rounds 5] [--vms 5000] [--no-reconcile]

1. **Socket to application.** A feed server in another process (a raw
   ``websockets`` server speaking the /changefeeds protocol: an ack, an empty
   bootstrap page at ``GET /vms``, then ``--items`` change items in
   JSON-array frames of 256, as a publisher sends to a ``batch`` listener)
   streams to, each in a fresh process:

   * raw: a bare ``websockets`` client that only ``orjson.loads`` each frame
     (the floor: socket, websocket framing, JSON);
   * listener: ``async for event in Listener(...)``: decoding into
     ChangeItems, the buffer, the hand-out;
   * listener + controller: ``Controller(listener)`` taking the items into its
     work queue (ids from a pool of 10,000, so repeats coalesce) while its
     workers drain it with a fetch that returns at once.

   Figures: items/s from the first item handed out to the last (the
   controller's ``items`` counter, read every 0.5 ms) and the ratio to raw,
   and the CPU time of the measuring process per item over the same window
   (steadier than items/s on a busy machine); medians of ``--rounds``
   rounds, and the medians of the ratios within each round (which cancel
   the load other processes put on a shared machine from round to round).
   With ``--baseline REF`` (a commit, branch or tag) the listener of that
   commit is measured the same way in the same run: ``git worktree add`` of
   REF in a temporary directory, whose ``changefeed`` package a child process
   imports first, rounds interleaved with this tree's (raw, this tree, REF,
   ...), and the worktree removed at the end.

2. **Reconcile throughput** (this tree only; ``--no-reconcile`` skips it).
   The example VM API (publisher mounted) on uvicorn with ``--vms`` VMs in
   PostgreSQL; a Controller synced from its bootstrap; then one change for
   every VM in one transaction. Figure: VMs fetched and reconciled per
   second until the controller is idle, for ``fetch_batch=1`` (one
   ``GET /vms/{id}`` each: the baseline) and batched ``GET /vms?ids=...`` of
   20 and 100, with 4 workers. Without ``--dsn`` an embedded PostgreSQL is
   started (changefeed.embedded); with ``--dsn`` the bench makes and drops
   its own database ``cf_bench_listener``.

The measuring code imports only names both this tree and older commits
export (``Listener``, ``Controller``, ``ListenerConfig``, ``BackoffPolicy``,
and ``ChangeItem`` from ``changefeed.schemas``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import json
import multiprocessing
import os
import socket
import statistics
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from http import HTTPStatus
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import orjson
from common import baseline_tree, database, paired, say, this_commit, tree_env
from websockets.asyncio.client import connect
from websockets.asyncio.server import ServerConnection, serve
from websockets.http11 import Request, Response

FRAME_ITEMS = 256
ID_POOL = 10_000
VM = {"resource": "vm", "subResources": ["nic", "alias"]}
EMPTY_PAGE = '{"items": [], "next": null}'


# --------------------------------------------------------------------------- feed server


def _frames(items: int) -> list[str]:
    ids = [str(uuid.UUID(int=n)) for n in range(ID_POOL)]
    docs = [
        {
            "changeKind": {"resource": "vm", "subResources": ["nic"]},
            "changedResourceId": ids[n % ID_POOL],
            "cursor": f"c{n:012d}",
            "published": "2026-11-21T23:00:00.123Z",
        }
        for n in range(items)
    ]
    return [orjson.dumps(docs[i : i + FRAME_ITEMS]).decode() for i in range(0, items, FRAME_ITEMS)]


async def _feed_server(conn: Connection, items: int) -> None:
    frames = _frames(items)
    bootstrapped: list[asyncio.Event] = []  # connections waiting for their bootstrap page

    def page(connection: ServerConnection, request: Request) -> Response | None:
        if not request.path.startswith("/vms"):
            return None  # the websocket
        for event in bootstrapped:
            event.set()
        return connection.respond(HTTPStatus.OK, EMPTY_PAGE)

    async def handler(ws: ServerConnection) -> None:
        registration = orjson.loads(await ws.recv())
        since = registration.get("since")
        ack = {"bootstrapRoute": "/vms", "cursor": since or "c0", "resumed": since is not None}
        paged = asyncio.Event()
        if since is None:  # stream once the listener has its (empty) bootstrap page
            bootstrapped.append(paged)
        await ws.send(orjson.dumps(ack).decode())
        if since is None:
            await paged.wait()
            bootstrapped.remove(paged)
        for frame in frames:
            await ws.send(frame)
        await ws.wait_closed()

    async with serve(
        handler, "127.0.0.1", 0, compression=None, max_size=None, process_request=page
    ) as server:
        conn.send(server.sockets[0].getsockname()[1])
        await asyncio.get_running_loop().run_in_executor(None, conn.recv)


def _feed_main(conn: Connection, items: int) -> None:
    asyncio.run(_feed_server(conn, items))


@contextlib.contextmanager
def feed_process(items: int) -> Iterator[str]:
    parent, child = multiprocessing.Pipe()
    process = multiprocessing.get_context("spawn").Process(
        target=_feed_main, args=(child, items), daemon=True
    )
    process.start()
    try:
        if not parent.poll(60):
            raise RuntimeError("feed server did not start")
        yield f"ws://127.0.0.1:{parent.recv()}/changefeeds"
    finally:
        with contextlib.suppress(OSError):
            parent.send("stop")
        process.join(10)
        if process.is_alive():
            process.kill()


# --------------------------------------------------------------------------- part 1: workers


async def raw_client(url: str, items: int) -> dict[str, float]:
    registration = {"instance": "bench", "service": "bench", "changeKind": VM, "since": "c0"}
    async with connect(url, compression=None, max_size=None) as ws:
        await ws.send(orjson.dumps({**registration, "batch": True}).decode())
        await ws.recv()  # ack
        seen = 0
        started = cpu = 0.0
        while seen < items:
            doc = orjson.loads(await ws.recv())
            if not seen:
                started, cpu = time.perf_counter(), time.process_time()
            seen += len(doc)
        return _figures(items, started, cpu)


def _figures(items: int, started: float, cpu: float) -> dict[str, float]:
    """Items per second, and CPU microseconds per item of this process, since then."""
    elapsed, used = time.perf_counter() - started, time.process_time() - cpu
    return {"rate": items / elapsed, "cpu_us": used / items * 1e6}


def _listener(url: str, items: int) -> Any:
    from changefeed.listener import BackoffPolicy, Listener, ListenerConfig
    from changefeed.schemas import ChangeKind

    config = ListenerConfig(buffer_size=items + 1, backoff=BackoffPolicy(initial=0.05))
    kind = ChangeKind("vm", ("nic", "alias"))
    return Listener(url, instance="bench", service="bench", change_kind=kind, config=config)


async def listener_only(url: str, items: int) -> dict[str, float]:
    from changefeed.schemas import ChangeItem

    async with _listener(url, items) as listener:
        seen = 0
        started = cpu = 0.0
        async for event in listener:
            if isinstance(event, ChangeItem):
                if not seen:
                    started, cpu = time.perf_counter(), time.process_time()
                seen += 1
                if seen == items:
                    break
        return _figures(items, started, cpu)


async def listener_controller(url: str, items: int) -> dict[str, float]:
    from changefeed.listener import Controller

    async def fetch(ids: Sequence[str]) -> Mapping[str, Any]:
        return {}

    controller = Controller(_listener(url, items), fetch=fetch, concurrency=4, fetch_batch=100)
    async with controller:
        async with asyncio.timeout(300):
            while controller.items == 0:  # noqa: ASYNC110 (the controller offers no event)
                await asyncio.sleep(0.0005)
            started, cpu = time.perf_counter(), time.process_time()
            while controller.items < items:  # noqa: ASYNC110
                await asyncio.sleep(0.0005)
            figures = _figures(items, started, cpu)
            await controller.wait_idle(60)
    stats = controller.stats()
    return {**figures, "fetches": stats.fetches, "coalesced": stats.coalesced}


WORKERS = {"raw": raw_client, "listener": listener_only, "controller": listener_controller}


def run_worker(mode: str, url: str, items: int, tree: Path | None) -> dict[str, float]:
    """One measurement in a fresh process; with ``tree``, that tree's ``changefeed``."""
    env = tree_env(tree)
    out = subprocess.run(
        [
            sys.executable,
            str(Path(__file__)),
            "--worker",
            mode,
            "--url",
            url,
            "--items",
            str(items),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    if out.returncode != 0:
        raise RuntimeError(f"{mode} worker failed ({tree or 'this tree'}):\n{out.stderr[-3000:]}")
    result: dict[str, float] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def _worker_main(args: argparse.Namespace) -> None:
    import changefeed

    result = asyncio.run(WORKERS[args.worker](args.url, args.items))
    result["tree"] = str(Path(changefeed.__file__).resolve().parent.parent)  # type: ignore[assignment]
    print(json.dumps(result), flush=True)


def _rate(values: list[float]) -> float:
    return statistics.median(values)


def part1(items: int, rounds: int, baseline: tuple[Path, str] | None, ref: str | None) -> None:
    here = this_commit()
    trees: list[tuple[str, Path | None]] = [("new", None)]
    if baseline is not None:
        trees.append(("base", baseline[0]))
    rates: dict[tuple[str, str], list[float]] = {}
    cpus: dict[tuple[str, str], list[float]] = {}
    extra: dict[str, dict[str, float]] = {}
    with feed_process(items) as url:
        for n in range(rounds):
            plan = [("raw", "new", None)] + [
                (mode, label, tree) for mode in ("listener", "controller") for label, tree in trees
            ]
            for mode, label, tree in plan:
                result = run_worker(mode, url, items, tree)
                rates.setdefault((mode, label), []).append(result["rate"])
                cpus.setdefault((mode, label), []).append(result["cpu_us"])
                extra[f"{mode}/{label}"] = result
            say(
                f"  round {n + 1}/{rounds}: "
                + "  ".join(f"{m}/{lab} {r[-1]:,.0f}" for (m, lab), r in rates.items())
            )
    raw = _rate(rates[("raw", "new")])
    raw_cpu = _rate(cpus[("raw", "new")])
    base_head = f"baseline {ref} ({baseline[1]})" if baseline else ""
    say(f"{'':24}{'this tree (' + here + ')':>34}   {base_head}")
    say(f"{'raw websockets + orjson':24}{raw:12,.0f} items/s 1.00x {raw_cpu:5.2f} us/item")
    for mode, title in (("listener", "Listener"), ("controller", "Listener + Controller")):
        new, cpu = _rate(rates[(mode, "new")]), _rate(cpus[(mode, "new")])
        line = f"{title:24}{new:12,.0f} items/s {new / raw:.2f}x {cpu:5.2f} us/item"
        if baseline is not None:
            base, base_cpu = _rate(rates[(mode, "base")]), _rate(cpus[(mode, "base")])
            line += (
                f"   {base:10,.0f} items/s {base / raw:.2f}x {base_cpu:5.2f} us/item"
                f"   (this tree {new / base:.2f}x)"
            )
        say(line)
    say("(us/item: CPU time of the measuring process per item, median; steadier than")
    say(" items/s on a busy machine)")
    # Each round measures every tree within seconds of the others: the ratios within a
    # round cancel the load other processes put on the machine from round to round.
    say("medians of the ratios within each round (items/s):")
    for mode in ("listener", "controller"):
        news = rates[(mode, "new")]
        line = f"  {mode:<11} this tree / raw {paired(news, rates[('raw', 'new')]):.2f}x"
        if baseline is not None:
            bases = rates[(mode, "base")]
            line += (
                f"   baseline / raw {paired(bases, rates[('raw', 'new')]):.2f}x"
                f"   this tree / baseline {paired(news, bases):.2f}x"
            )
        say(line)
    ctrl = extra["controller/new"]
    fetched, coalesced = ctrl["fetches"], ctrl["coalesced"]
    say(f"(controller, last round: {fetched:,.0f} ids fetched, {coalesced:,.0f} coalesced)")


# --------------------------------------------------------------------------- part 2


@contextlib.asynccontextmanager
async def vm_api(dsn: str) -> AsyncIterator[str]:
    import uvicorn

    from changefeed.example.vmapi import create_app
    from changefeed.serving import server_config

    app = create_app(dsn, poll_interval=0.05, retention=False, max_limit=1000)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(server_config(app, "127.0.0.1", 0, fast_path=True))
    server.capture_signals = contextlib.nullcontext  # type: ignore[method-assign,assignment]
    task = asyncio.create_task(server.serve(sockets=[sock]))
    async with asyncio.timeout(30):
        while not server.started:  # noqa: ASYNC110 (uvicorn offers no event for it)
            await asyncio.sleep(0.01)
    try:
        yield f"127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        await asyncio.wait_for(task, 30)
        sock.close()


async def seed_vms(dsn: str, count: int) -> list[str]:
    import asyncpg

    conn = await asyncpg.connect(dsn)
    try:
        ids = [uuid.uuid4() for _ in range(count)]
        await conn.execute(
            "INSERT INTO vmapi.vms (uuid, alias, nics) SELECT id, 'vm-' || n,"
            " jsonb_build_array(jsonb_build_object('ip', '10.0.0.' || (n % 250)))"
            " FROM unnest($1::uuid[]) WITH ORDINALITY AS u(id, n)",
            ids,
        )
        return [str(i) for i in ids]
    finally:
        await conn.close()


async def touch_all(dsn: str, ids: list[str]) -> None:
    import asyncpg

    conn = await asyncpg.connect(dsn)
    try:
        async with conn.transaction():
            await conn.execute("UPDATE vmapi.vms SET alias = alias || '.', updated = now()")
            await conn.execute(
                "SELECT changefeed.publish('vm', ARRAY['alias'], x) FROM unnest($1::text[]) x", ids
            )
    finally:
        await conn.close()


async def reconcile_rate(host: str, dsn: str, ids: list[str], batch: int) -> dict[str, float]:
    from changefeed.listener import ChangeKind, Controller, Listener, ListenerConfig

    reconciled = 0
    target = 0
    done = asyncio.Event()

    async def reconcile(vm: str, old: Any, new: Any) -> None:
        nonlocal reconciled
        reconciled += 1
        if reconciled == target:
            done.set()

    listener = Listener(
        f"ws://{host}/changefeeds",
        instance=str(uuid.uuid4()),
        service="bench",
        change_kind=ChangeKind("vm", ("nic", "alias")),
        config=ListenerConfig(buffer_size=len(ids) + 1, page_limit=1000),
    )
    controller = Controller(listener, reconcile=reconcile, concurrency=4, fetch_batch=batch)
    async with controller:
        await controller.wait_synced(120)
        target = reconciled + len(ids)
        await touch_all(dsn, ids)
        started = time.perf_counter()
        await asyncio.wait_for(done.wait(), 300)
        elapsed = time.perf_counter() - started
        stats = controller.stats()
    return {
        "rate": len(ids) / elapsed,
        "requests": stats.fetch_requests,
        "reconciled": reconciled,
    }


def _with_database(dsn: str, name: str) -> str:
    parts = urlsplit(dsn)
    return urlunsplit(parts._replace(path="/" + name))


async def part2(dsn_arg: str | None, vms: int) -> None:
    import asyncpg

    with database(dsn_arg) as server_dsn:
        admin = await asyncpg.connect(server_dsn)
        await admin.execute("DROP DATABASE IF EXISTS cf_bench_listener WITH (FORCE)")
        await admin.execute("CREATE DATABASE cf_bench_listener")
        await admin.close()
        dsn = _with_database(server_dsn, "cf_bench_listener")
        try:
            async with vm_api(dsn) as host:
                ids = await seed_vms(dsn, vms)
                base: float | None = None
                for batch in (1, 20, 100):
                    result = await reconcile_rate(host, dsn, ids, batch)
                    base = base or result["rate"]
                    say(
                        f"fetch_batch={batch:<4}  {result['rate']:10,.0f} VMs/s  "
                        f"{result['rate'] / base:6.2f}x  {result['requests']:,.0f} requests"
                    )
        finally:
            admin = await asyncpg.connect(server_dsn)
            await admin.execute("DROP DATABASE IF EXISTS cf_bench_listener WITH (FORCE)")
            await admin.close()


# --------------------------------------------------------------------------- main


def main(args: argparse.Namespace) -> None:
    items = args.items // 10 if args.quick else args.items
    vms = args.vms // 5 if args.quick else args.vms
    rounds = 1 if args.quick else args.rounds
    today = datetime.date.today().isoformat()
    say(f"# listener bench, {today}: {items} items, {rounds} round(s), pid {os.getpid()}")
    say("## 1. socket -> listener -> controller queue (items/s, median of interleaved rounds)")
    with contextlib.ExitStack() as stack:
        baseline = stack.enter_context(baseline_tree(args.baseline)) if args.baseline else None
        part1(items, rounds, baseline, args.baseline)
    if not args.no_reconcile:
        say(f"## 2. reconcile throughput, {vms} VMs changed at once, 4 workers (VMs/s)")
        asyncio.run(part2(args.dsn, vms))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline", metavar="REF", help="also measure this commit's listener")
    parser.add_argument("--dsn", help="PostgreSQL server DSN (default: an embedded one)")
    parser.add_argument("--quick", action="store_true", help="a tenth of the work, one round")
    parser.add_argument("--items", type=int, default=200_000)
    parser.add_argument("--vms", type=int, default=5_000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--no-reconcile", action="store_true", help="skip part 2")
    parser.add_argument("--worker", choices=sorted(WORKERS), help=argparse.SUPPRESS)
    parser.add_argument("--url", help=argparse.SUPPRESS)
    parsed = parser.parse_args()
    try:
        if parsed.worker:
            _worker_main(parsed)
        else:
            main(parsed)
    except KeyboardInterrupt:
        sys.exit(130)
