"""Listener and controller throughput, each beside a baseline measured in the same run.

    python bench/listener.py [--dsn DSN] [--quick] [--items 200000] [--vms 5000]

1. **Socket to queue.** A feed server in another process (a raw ``websockets``
   server speaking the /changefeeds protocol: ack with ``resumed: true``, then
   ``--items`` change items in JSON-array frames of 256, as a publisher sends
   to a ``batch`` listener) streams to:

   * raw: a bare ``websockets`` client that only ``orjson.loads`` each frame
     (the floor: socket, websocket framing, JSON);
   * listener: ``async for event in Listener(...)``: decoding into ChangeItems,
     the buffer, the hand-out;
   * listener + controller: a Controller taking those events into its work
     queue (ids from a pool of 10,000, so repeats coalesce) and its workers
     draining it with a fetch that returns at once.

   Figure: items/s from the first item to the last, and the ratio to raw.

2. **Reconcile throughput.** The example VM API (publisher mounted) on uvicorn
   with ``--vms`` VMs in PostgreSQL; a Controller synced from its bootstrap;
   then one change for every VM in one transaction. Figure: VMs fetched and
   reconciled per second until the controller is idle, for
   ``fetch_batch=1`` (one ``GET /vms/{id}`` each: the baseline) and batched
   ``GET /vms?ids=...`` of 20 and 100, with 4 workers.

Without ``--dsn`` an embedded PostgreSQL is started (changefeed.embedded);
with ``--dsn`` the bench makes and drops its own database ``cf_bench_listener``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import multiprocessing
import os
import socket
import statistics
import sys
import time
import uuid
from collections.abc import AsyncIterator, Mapping, Sequence
from multiprocessing.connection import Connection
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import asyncpg
import orjson
import uvicorn
from common import database, say
from websockets.asyncio.client import connect
from websockets.asyncio.server import ServerConnection, serve

from changefeed.example.vmapi import create_app
from changefeed.listener import BackoffPolicy, Controller, Event, Listener, ListenerConfig
from changefeed.schemas import Ack, ChangeItem, ChangeKind, Registration, ResourceRoute
from changefeed.serving import server_config

VM = ChangeKind("vm", ("nic", "alias"))
FRAME_ITEMS = 256
ID_POOL = 10_000


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

    async def handler(ws: ServerConnection) -> None:
        registration = Registration.decode(await ws.recv())
        route = ResourceRoute("vm", VM.sub_resources, "/vms")
        ack = Ack((route,), registration.since or "c0", resumed=registration.since is not None)
        await ws.send(ack.encode())
        for frame in frames:
            await ws.send(frame)
        await ws.wait_closed()

    async with serve(handler, "127.0.0.1", 0, compression=None, max_size=None) as server:
        conn.send(server.sockets[0].getsockname()[1])
        await asyncio.get_running_loop().run_in_executor(None, conn.recv)


def _feed_main(conn: Connection, items: int) -> None:
    asyncio.run(_feed_server(conn, items))


@contextlib.contextmanager
def feed_process(items: int) -> Any:
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


# --------------------------------------------------------------------------- part 1


async def raw_client(url: str, items: int) -> float:
    registration = Registration("bench", "bench", (VM,), since="c0", batch=True).encode()
    async with connect(url, compression=None, max_size=None) as ws:
        await ws.send(registration)
        await ws.recv()  # ack
        seen = 0
        started = 0.0
        while seen < items:
            doc = orjson.loads(await ws.recv())
            if not seen:
                started = time.perf_counter()
            seen += len(doc)
        return items / (time.perf_counter() - started)


def _listener(url: str, items: int) -> Listener:
    config = ListenerConfig(buffer_size=items + 1, backoff=BackoffPolicy(initial=0.05))
    return Listener(
        url, instance="bench", service="bench", change_kind=VM, config=config, cursor="c0"
    )


async def listener_only(url: str, items: int) -> float:
    async with _listener(url, items) as listener:
        seen = 0
        started = 0.0
        async for event in listener:
            if isinstance(event, ChangeItem):
                if not seen:
                    started = time.perf_counter()
                seen += 1
                if seen == items:
                    break
        return items / (time.perf_counter() - started)


class _Timed:
    """The listener's events, timed from the first change item to the ``items``-th."""

    def __init__(self, listener: Listener, items: int) -> None:
        self.listener = listener
        self.items = items
        self.seen = 0
        self.started = 0.0
        self.elapsed = 0.0
        self.done = asyncio.Event()

    def __aiter__(self) -> _Timed:
        return self

    async def __anext__(self) -> Event:
        event = await anext(self.listener)
        if isinstance(event, ChangeItem):
            self.seen += 1
            if self.seen == 1:
                self.started = time.perf_counter()
            if self.seen == self.items:
                # The controller queues this item before it asks for the next one.
                self.elapsed = time.perf_counter() - self.started
                self.done.set()
        return event


async def listener_controller(url: str, items: int) -> tuple[float, int, int]:
    async def fetch(ids: Sequence[str]) -> Mapping[str, Any]:
        return {}

    async with _listener(url, items) as listener:
        timed = _Timed(listener, items)
        controller = Controller(timed, fetch=fetch, concurrency=4, fetch_batch=100)
        async with controller:
            await asyncio.wait_for(timed.done.wait(), 300)
            await controller.wait_idle(60)
    stats = controller.stats()
    return items / timed.elapsed, stats.fetches, stats.coalesced


# --------------------------------------------------------------------------- part 2


@contextlib.asynccontextmanager
async def vm_api(dsn: str) -> AsyncIterator[str]:
    app = create_app(dsn, poll_interval=0.05, retention=False, max_limit=1000)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(server_config(app, "127.0.0.1", 0))
    server.capture_signals = contextlib.nullcontext  # type: ignore[method-assign]
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
        change_kind=VM,
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


# --------------------------------------------------------------------------- main


def _with_database(dsn: str, name: str) -> str:
    parts = urlsplit(dsn)
    return urlunsplit(parts._replace(path="/" + name))


async def main(args: argparse.Namespace) -> None:
    items = args.items // 10 if args.quick else args.items
    vms = args.vms // 5 if args.quick else args.vms
    rounds = 1 if args.quick else args.rounds
    say(f"# listener bench: {items} items, {vms} VMs, {rounds} round(s), pid {os.getpid()}")

    say("## 1. socket -> listener -> controller queue (items/s, median)")
    with feed_process(items) as url:
        raw = statistics.median([await raw_client(url, items) for _ in range(rounds)])
        only = statistics.median([await listener_only(url, items) for _ in range(rounds)])
        runs = [await listener_controller(url, items) for _ in range(rounds)]
        ctrl = statistics.median(r for r, _, _ in runs)
    say(f"raw websockets + orjson   {raw:12,.0f} items/s   1.00x")
    say(f"Listener                  {only:12,.0f} items/s   {only / raw:.2f}x")
    say(
        f"Listener + Controller     {ctrl:12,.0f} items/s   {ctrl / raw:.2f}x   "
        f"({runs[-1][1]:,} ids fetched, {runs[-1][2]:,} repeats coalesced)"
    )

    say(f"## 2. reconcile throughput, {vms} VMs changed at once, 4 workers (VMs/s)")
    with database(args.dsn) as server_dsn:
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


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dsn", help="PostgreSQL server DSN (default: an embedded one)")
    parser.add_argument("--quick", action="store_true", help="a tenth of the work, one round")
    parser.add_argument("--items", type=int, default=200_000)
    parser.add_argument("--vms", type=int, default=5_000)
    parser.add_argument("--rounds", type=int, default=3)
    try:
        asyncio.run(main(parser.parse_args()))
    except KeyboardInterrupt:
        sys.exit(130)
