"""A restart from a checkpoint beside a full bootstrap, and what a checkpoint costs to keep.

    python bench/checkpoint.py [--dsn DSN] [--vms 1000000] [--missed 1000] [--quick]

One run against the example VM API (``changefeed.example.vmapi``), served by
uvicorn in a child process with its default ``max_limit`` (5,000: the
listener asks for pages that size), over ``--vms`` VMs seeded with
``generate_series`` straight into ``vmapi.vms``. Each controller runs in a
fresh process of its own (a ``Listener`` of ``vm`` and a ``Controller`` with
a ``reconcile`` callback that counts, and a ``SqliteCheckpointStore``), in
this order:

1. **first start**: an empty checkpoint file; it bootstraps, and stops
   cleanly, which saves the whole mirror (the first save is whole).
2. ``--missed`` VMs are renamed while it is down (one transaction each, a feed
   entry each, as the API writes them).
3. **restart from the checkpoint**: it loads the mirror, registers with the
   saved cursor, is resumed, fetches and calls back the missed changes.
4. **restart without one** (what a restart costs otherwise): a full bootstrap
   of the same VMs into an empty mirror, every VM called back as an add.

Each restart's time runs from the moment the process has imported the
package until its mirror equals the API's table: for (3) the controller is
synced (resumed, pending ids done) and the missed changes have been called
back; for (4) the controller is synced (walked, every add called back).
Target: (3) <= 0.1x (4). Then the cost of keeping the checkpoint: the whole
save at the end of (1), an incremental save of the missed changes after (3),
the file's size, and the SQLite store alone at 10,000, 100,000 and
1,000,000 VMs (whole save, incremental save of 1,000 changed VMs, load), so
that how a save grows with the mirror is seen at one glance.

Without ``--dsn`` an embedded PostgreSQL is started; with it, the bench
creates its own database there and drops it at the end. ``--quick`` takes
100,000 VMs.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import multiprocessing
import os
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Callable
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import asyncpg
import httpx
from common import database, free_port, say, until

from changefeed.bootstrap import Admission
from changefeed.example.vmapi import create_app, ensure_schema
from changefeed.serving import DrainingServer, server_config

INSTANCE = "7d3f5c1e-2b8a-4c6d-9e0f-1a2b3c4d5e6f"
SIZES = (10_000, 100_000, 1_000_000)
CHANGED = 1_000


@contextlib.asynccontextmanager
async def scratch_database(server_dsn: str) -> AsyncIterator[str]:
    """A fresh database on ``server_dsn``'s server, dropped on exit."""
    name = f"changefeed_bench_{uuid.uuid4().hex[:12]}"
    admin = await asyncpg.connect(server_dsn)
    try:
        await admin.execute(f'CREATE DATABASE "{name}"')
    finally:
        await admin.close()
    try:
        yield urlunsplit(urlsplit(server_dsn)._replace(path="/" + name))
    finally:
        admin = await asyncpg.connect(server_dsn)
        try:
            await admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        finally:
            await admin.close()


async def seed(dsn: str, count: int) -> None:
    """``count`` VMs straight into ``vmapi.vms`` with ``generate_series``."""
    conn = await asyncpg.connect(dsn)
    try:
        await ensure_schema(conn)
        started = time.monotonic()
        for low in range(0, count, 100_000):
            await conn.execute(
                "INSERT INTO vmapi.vms (uuid, alias, nics)"
                " SELECT gen_random_uuid(), 'vm-' || i, jsonb_build_array("
                "  jsonb_build_object('ip', '10.' || (i / 65536) || '.' || (i / 256 % 256)"
                "   || '.' || (i % 256)))"
                " FROM generate_series($1::int, $2::int) AS i",
                low + 1,
                min(count, low + 100_000),
            )
        await conn.execute("VACUUM (ANALYZE) vmapi.vms")
        say(f"seeded {count:,} VMs with generate_series in {time.monotonic() - started:.1f}s")
    finally:
        await conn.close()


def _serve(dsn: str, port: int) -> None:
    """Child process: the VM API on uvicorn until SIGTERM (its default ``max_limit``)."""
    app = create_app(dsn, admission=Admission(max_walks=None))
    DrainingServer(
        server_config(app, "127.0.0.1", port, fast_path=True), [], owns_process=True
    ).run()


@contextlib.asynccontextmanager
async def vm_api(dsn: str) -> AsyncIterator[str]:
    """The VM API in a child process; yields its base URL."""
    port = free_port()
    process = multiprocessing.get_context("spawn").Process(
        target=_serve, args=(dsn, port), name="vmapi-bench", daemon=True
    )
    process.start()
    url = f"http://127.0.0.1:{port}"
    try:
        async with httpx.AsyncClient(base_url=url) as client, asyncio.timeout(120):
            while True:
                if not process.is_alive():
                    raise RuntimeError("the VM API process exited during start-up")
                with contextlib.suppress(httpx.TransportError):
                    if (await client.get("/healthz")).status_code == 200:
                        break
                await asyncio.sleep(0.1)  # polling a child process's start-up, bounded above
        yield url
    finally:
        process.terminate()
        process.join(15)
        if process.is_alive():
            process.kill()
            process.join(5)


# -------------------------------------------------------------- one controller's run


async def _controller_run(url: str, checkpoint: str, missed: int) -> dict[str, Any]:
    from changefeed.listener import (
        ChangeKind,
        Controller,
        Listener,
        ListenerConfig,
        SqliteCheckpointStore,
    )

    started = time.perf_counter()
    store = SqliteCheckpointStore(checkpoint)
    listener = Listener(
        url.replace("http://", "ws://") + "/changefeeds",
        instance=INSTANCE,
        service="bench",
        change_kind=ChangeKind("vm"),
        config=ListenerConfig(checkpoint_interval=3600.0, http_timeout=60.0),
        checkpoint=store,
    )
    calls = 0

    def reconcile(key: str, old: Any, new: Any) -> None:
        nonlocal calls
        calls += 1

    controller = Controller(listener, reconcile=reconcile, max_pending=20_000)
    result: dict[str, Any] = {}
    async with controller:
        await controller.wait_synced(1800)
        synced = time.perf_counter() - started
        # The changes made while it was down: items are replayed after the resume.
        await until(lambda: controller.stats().items >= missed and controller.queue.idle, 600)
        converged = time.perf_counter() - started
        status = listener.status()
        result.update(
            synced=synced,
            converged=converged,
            calls=calls,
            mirror=len(controller.mirror),
            resumes=status.resumes,
            bootstraps=status.bootstraps,
            checkpoint=status.checkpoint and status.checkpoint.to_json(),
        )
        if status.resumes:
            before = time.perf_counter()
            assert await listener.save_checkpoint()
            result["incremental_save"] = time.perf_counter() - before
            checkpoint_status = listener.status().checkpoint
            assert checkpoint_status is not None
            result["incremental_items"] = checkpoint_status.last_save_items
        closing = time.perf_counter()
    result["close"] = time.perf_counter() - closing
    final = listener.status().checkpoint
    result["final_save"] = final and final.to_json()
    result["file_bytes"] = store.size_on_disk()
    return result


def _controller_child(url: str, checkpoint: str, missed: int, out: Connection) -> None:
    runner: Callable[..., Any]
    try:
        import uvloop

        runner = uvloop.run
    except ImportError:
        runner = asyncio.run
    try:
        out.send(runner(_controller_run(url, checkpoint, missed)))
    except BaseException as exc:
        out.send({"error": repr(exc)})
        raise


async def controller(url: str, checkpoint: Path, missed: int = 0) -> dict[str, Any]:
    """One controller run in a fresh process; its figures."""
    context = multiprocessing.get_context("spawn")
    receive, send = context.Pipe(duplex=False)
    process = context.Process(
        target=_controller_child, args=(url, str(checkpoint), missed, send), daemon=True
    )
    process.start()
    try:
        if not await asyncio.to_thread(receive.poll, 3600):
            raise TimeoutError("the controller did not finish within an hour")
        result: dict[str, Any] = receive.recv()
    finally:
        process.join(60)
        if process.is_alive():
            process.kill()
    if "error" in result:
        raise RuntimeError(f"controller run failed: {result['error']}")
    return result


async def rename(dsn: str, count: int) -> None:
    """``count`` VMs renamed, each in its own transaction with its feed entry."""
    conn = await asyncpg.connect(dsn)
    try:
        ids = await conn.fetch("SELECT uuid FROM vmapi.vms ORDER BY random() LIMIT $1", count)
        for row in ids:
            async with conn.transaction():
                await conn.execute(
                    "UPDATE vmapi.vms SET alias = 'renamed-' || alias WHERE uuid = $1", row[0]
                )
                await conn.execute(
                    "SELECT changefeed.publish('vm', ARRAY['alias'], $1)", str(row[0])
                )
    finally:
        await conn.close()


# -------------------------------------------------------------- the store alone


def _vms(count: int, tag: str = "") -> dict[str, Any]:
    items = {}
    for n in range(count):
        key = str(uuid.UUID(int=n))
        ip = f"10.{n // 65536}.{n // 256 % 256}.{n % 256}"
        items[key] = {
            "uuid": key,
            "alias": f"vm-{n}{tag}",
            "nics": [{"ip": ip}],
            "server_uuid": None,
        }
    return items


async def store_costs(folder: Path) -> None:
    from changefeed.listener import ChangeKind, Checkpoint, MirrorCheckpoint, SqliteCheckpointStore

    kinds = (ChangeKind("vm"),)
    say("  the SQLite store alone (VMs as the API serves them, one mirror):")
    say(
        "    VMs        snapshot (on the loop)  whole save  incremental save (1,000 changed)"
        "  load     file"
    )
    for size in SIZES:
        store = SqliteCheckpointStore(folder / f"store-{size}.sqlite")
        items = _vms(size)
        started = time.perf_counter()
        snapshot = dict(items)  # what taking a whole checkpoint does on the event loop
        snapshot_seconds = time.perf_counter() - started
        del snapshot
        whole = Checkpoint("c1", kinds, {"vms": MirrorCheckpoint("vm", items)}, sequence=1)
        started = time.perf_counter()
        await store.save(whole)
        whole_seconds = time.perf_counter() - started
        changed = {key: {**items[key], "alias": "changed"} for key in list(items)[:CHANGED]}
        part = MirrorCheckpoint("vm", changed)
        incremental = Checkpoint("c2", kinds, {"vms": part}, whole=False, sequence=2, base=1)
        started = time.perf_counter()
        await store.save(incremental)
        incremental_seconds = time.perf_counter() - started
        del items, changed
        started = time.perf_counter()
        loaded = await store.load()
        load_seconds = time.perf_counter() - started
        assert loaded is not None and len(loaded.mirrors["vms"].items) == size
        del loaded
        megabytes = store.size_on_disk() / 1e6
        say(
            f"    {size:>9,}  {snapshot_seconds * 1000:10.1f} ms{'':12}"
            f"{whole_seconds * 1000:8.0f} ms  {incremental_seconds * 1000:10.1f} ms"
            f"{'':22}{load_seconds * 1000:6.0f} ms  {megabytes:6.1f} MB"
        )


# -------------------------------------------------------------- the run


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:,.0f} ms"


async def main(args: argparse.Namespace) -> None:
    with (
        database(args.dsn) as server_dsn,
        tempfile.TemporaryDirectory(prefix="checkpoint-bench-") as tmp,
    ):
        folder = Path(tmp)
        async with scratch_database(server_dsn) as dsn:
            await seed(dsn, args.vms)
            async with vm_api(dsn) as url:
                say(f"checkpoint bench: {args.vms:,} VMs, VM API at {url} (child process)")
                say(f"  load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
                checkpoint = folder / "controller.sqlite"
                first = await controller(url, checkpoint)
                assert first["bootstraps"] == 1 and first["mirror"] == args.vms, first
                say(
                    f"  1. first start (bootstrap into an empty checkpoint): synced in "
                    f"{_ms(first['synced'])}, {first['calls']:,} callbacks"
                )
                final = first["final_save"]
                say(
                    f"     whole save on stop: {_ms(final['last_save_seconds'])} for "
                    f"{final['last_save_items']:,} VMs; file {first['file_bytes'] / 1e6:.1f} MB"
                )
                await rename(dsn, args.missed)
                say(f"  2. {args.missed:,} VMs renamed while it was down")
                resumed = await controller(url, checkpoint, args.missed)
                assert resumed["bootstraps"] == 0 and resumed["resumes"] == 1, resumed
                loaded = resumed["checkpoint"]
                say(
                    f"  3. restart from the checkpoint: converged in {_ms(resumed['converged'])}"
                    f" (loading {loaded['loaded_items']:,} VMs: {_ms(loaded['load_seconds'])};"
                    f" synced at {_ms(resumed['synced'])}); {resumed['calls']:,} callbacks"
                )
                say(
                    f"     incremental save after it: {_ms(resumed['incremental_save'])} for "
                    f"{resumed['incremental_items']:,} VMs;"
                    f" file {resumed['file_bytes'] / 1e6:.1f} MB"
                )
                empty = folder / "empty.sqlite"
                fresh = await controller(url, empty)
                assert fresh["bootstraps"] == 1 and fresh["mirror"] == args.vms, fresh
                say(
                    f"  4. restart without a checkpoint (full bootstrap, pages of 5,000): "
                    f"converged in {_ms(fresh['converged'])}; {fresh['calls']:,} callbacks"
                )
                ratio = resumed["converged"] / fresh["converged"]
                verdict = "ok" if ratio <= 0.1 else "MISSED"
                say(
                    f"  ratio restart from checkpoint / full bootstrap: {ratio:.3f}x"
                    f"  (target <= 0.1: {verdict})"
                )
        await store_costs(folder)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dsn", help="a PostgreSQL server to use (default: embedded)")
    parser.add_argument("--vms", type=int, default=1_000_000)
    parser.add_argument("--missed", type=int, default=1_000, help="changes made while down")
    parser.add_argument("--quick", action="store_true", help="100,000 VMs")
    arguments = parser.parse_args()
    if arguments.quick:
        arguments.vms = 100_000
    asyncio.run(main(arguments))
