"""``changefeed demo``: the whole system on one machine, in one command.

It starts PostgreSQL (embedded unless a DSN is given), the example VM API with
its publisher on 127.0.0.1 (VMs and the servers they run on, one feed), the
example DNS controller (a listener that mirrors VMs into DNS records in its
own database) and a small load generator that creates, updates, migrates and
deletes VMs and creates, updates and retires servers. It prints what the DNS
service learns and a live status line, and when it stops (Ctrl-C, SIGTERM or
--duration) it checks that the mirror equals the API's data in what the DNS
service follows, then stops everything it started: no process is left behind.

With ``--standby`` it also starts an embedded hot standby of the embedded
PostgreSQL (``pg_basebackup -R``, streaming replication, a throwaway data
directory) and the publisher reads its feed there (``read_dsn``), its
doorbell ringing from the primary: the shape of a fleet, on one machine.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import random
import signal
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import asyncpg
import httpx

from changefeed.bootstrap import Pager
from changefeed.embedded import EmbeddedPostgres, default_data_dir, standby_of
from changefeed.example.dns import DnsController, Record
from changefeed.example.vmapi import create_app
from changefeed.listener import ListenerConfig
from changefeed.publisher.config import ServerConfig
from changefeed.publisher.standby import wait_replayed
from changefeed.serving import DrainingServer, server_config
from changefeed.wal import insert_target

__all__ = ["run_demo"]

_WORDS = ("web", "db", "cache", "queue", "api", "search", "auth", "media", "mail", "build")
_TARGET_VMS = 40
_TARGET_SERVERS = 4
_FOLLOWED_SERVER = ("uuid", "hostname")
"""What the DNS service follows of a server: it registers for ``hostname`` only, so a
status or RAM change is not sent to it, and its mirror keeps the ones it last fetched.
It follows everything of a VM (``nic``, ``alias`` and ``server``, a migration)."""


async def _ensure_database(dsn: str, name: str) -> str:
    """DSN of database ``name`` on the server of ``dsn``, created if absent."""
    conn = await asyncpg.connect(dsn, timeout=10)
    try:
        exists = await conn.fetchval("SELECT 1 FROM pg_database WHERE datname = $1", name)
        if not exists:
            # Identifiers cannot be parameters; the name is one of ours, not input.
            await conn.execute(f'CREATE DATABASE "{name}"')
    finally:
        await conn.close()
    base, _, _ = dsn.rpartition("/")
    return f"{base}/{name}"


class LoadGenerator:
    """Creates, renames, re-addresses, migrates and deletes VMs, and creates, updates and
    retires the servers they run on, through the public API."""

    def __init__(self, client: httpx.AsyncClient, rate: float, rng: random.Random) -> None:
        self.client = client
        self.rate = rate
        self.rng = rng
        self.known: list[str] = []
        self.servers: list[str] = []
        self.writes = 0
        self.errors = 0

    def _nics(self) -> list[dict[str, str]]:
        return [
            {
                "ip": f"10.{self.rng.randint(0, 255)}.{self.rng.randint(0, 255)}."
                f"{self.rng.randint(1, 254)}"
            }
            for _ in range(self.rng.randint(1, 2))
        ]

    async def _add_server(self) -> None:
        body = {
            "hostname": f"cn-{self.rng.randint(1, 999):03d}",
            "ram": self.rng.choice((65536, 131072, 262144)),
            "datacenter": "demo-1",
            "status": "running",
        }
        response = await self.client.post("/servers", json=body)
        response.raise_for_status()
        self.servers.append(response.json()["uuid"])

    async def _server_write(self) -> None:
        """Flip a server's status, or retire one: refused (409) while it hosts VMs."""
        server = self.rng.choice(self.servers)
        if len(self.servers) > 1 and self.rng.random() < 0.2:
            response = await self.client.delete(f"/servers/{server}")
            if response.status_code == 204:
                self.servers.remove(server)
            elif response.status_code != 409:
                response.raise_for_status()
            return
        status = self.rng.choice(("running", "running", "unavailable"))
        response = await self.client.patch(f"/servers/{server}", json={"status": status})
        if response.status_code != 404:
            response.raise_for_status()

    async def _migrate(self) -> None:
        vm = self.rng.choice(self.known)
        target = self.rng.choice(self.servers)
        response = await self.client.patch(f"/vms/{vm}", json={"server_uuid": target})
        if response.status_code not in (404, 422):  # VM gone, or the server just retired
            response.raise_for_status()

    async def _one(self) -> None:
        if len(self.servers) < _TARGET_SERVERS:
            await self._add_server()
            self.writes += 1
            return
        choice = self.rng.random()
        if not self.known or (len(self.known) < _TARGET_VMS and choice < 0.5):
            alias = f"{self.rng.choice(_WORDS)}-{self.rng.randint(1, 99)}"
            new = {
                "alias": alias,
                "nics": self._nics(),
                "server_uuid": self.rng.choice(self.servers),
            }
            response = await self.client.post("/vms", json=new)
            if response.status_code == 422:  # the server just retired
                return
            response.raise_for_status()
            self.known.append(response.json()["uuid"])
        elif (choice := self.rng.random()) < 0.15:
            await self._migrate()
        elif choice < 0.25:
            await self._server_write()
        elif choice < 0.8:
            vm = self.rng.choice(self.known)
            body: dict[str, Any] = (
                {"alias": f"{self.rng.choice(_WORDS)}-{self.rng.randint(1, 99)}"}
                if self.rng.random() < 0.5
                else {"nics": self._nics()}
            )
            response = await self.client.patch(f"/vms/{vm}", json=body)
            if response.status_code != 404:
                response.raise_for_status()
        else:
            vm = self.known.pop(self.rng.randrange(len(self.known)))
            response = await self.client.delete(f"/vms/{vm}")
            if response.status_code != 404:
                response.raise_for_status()
        self.writes += 1

    async def run(self) -> None:
        async for vm in Pager(self.client, "/vms"):
            self.known.append(vm["uuid"])
        async for server in Pager(self.client, "/servers"):
            self.servers.append(server["uuid"])
        while True:
            try:
                await self._one()
            except httpx.HTTPError:
                self.errors += 1
            await asyncio.sleep(1.0 / self.rate)


def _print_learned(before: dict[str, Record], after: dict[str, Record]) -> None:
    for name in sorted(after.keys() - before.keys()):
        print(f"  dns learned  + {name} -> {', '.join(after[name].ips)}", flush=True)
    for name in sorted(before.keys() - after.keys()):
        print(f"  dns learned  - {name}", flush=True)
    for name in sorted(before.keys() & after.keys()):
        if before[name].ips != after[name].ips:
            print(f"  dns learned  ~ {name} -> {', '.join(after[name].ips)}", flush=True)


def _followed(server: Mapping[str, Any]) -> dict[str, Any]:
    return {name: server[name] for name in _FOLLOWED_SERVER}


async def _api_state(client: httpx.AsyncClient) -> tuple[dict[str, Any], dict[str, Any]]:
    """Every VM and server the API holds, as far as the DNS service follows them."""
    vms = {vm["uuid"]: vm async for vm in Pager(client, "/vms")}
    servers = {s["uuid"]: _followed(s) async for s in Pager(client, "/servers")}
    return vms, servers


def _mirrored(dns: DnsController) -> tuple[dict[str, Any], dict[str, Any]]:
    servers = {server: _followed(item) for server, item in dns.servers.mirror.items()}
    return dict(dns.vms.mirror), servers


async def run_demo(args: argparse.Namespace) -> int:
    """Run the demo until Ctrl-C, SIGTERM or ``args.duration``; 0 when the mirror converged."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    pg: EmbeddedPostgres | None = None
    standby: EmbeddedPostgres | None = None
    dsn: str | None = args.dsn or os.environ.get("CHANGEFEED_DSN")
    try:
        if not dsn:
            data_dir = Path(args.data_dir) if args.data_dir else default_data_dir()
            print(f"starting embedded PostgreSQL (data in {data_dir}) ...", flush=True)
            # With a standby, commits wait for their WAL to be written (fsync stays
            # off): a standby receives only written WAL, and would otherwise lag by
            # the WAL writer's 200 ms.
            settings = {"synchronous_commit": "on"} if args.standby else None
            pg = EmbeddedPostgres(data_dir, settings=settings)
            dsn = await asyncio.to_thread(pg.start)
        if args.standby:
            if pg is None:
                print(
                    "--standby starts a standby of the embedded PostgreSQL; with --dsn, "
                    "run `changefeed example-api --dsn PRIMARY --read-dsn STANDBY` instead",
                    file=sys.stderr,
                    flush=True,
                )
                return 2
            print("starting an embedded hot standby of it (pg_basebackup -R) ...", flush=True)
            standby = await asyncio.to_thread(standby_of, pg)
            await asyncio.to_thread(standby.start)
        return await _run(args, dsn, stop, standby)
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
        if standby is not None:
            print("stopping the embedded standby", flush=True)
            await asyncio.to_thread(standby.close)
        if pg is not None:
            print("stopping embedded PostgreSQL", flush=True)
            await asyncio.to_thread(pg.stop)


async def _replayed(primary_dsn: str, standby_dsn: str, within: float = 30.0) -> None:
    """Wait until the standby has replayed everything the primary has written so far."""
    conn = await asyncpg.connect(primary_dsn, timeout=10)
    try:
        target = await insert_target(conn)
    finally:
        await conn.close()
    conn = await asyncpg.connect(standby_dsn, timeout=10)
    try:
        if not await wait_replayed(conn, target, within):
            raise TimeoutError(f"the standby did not catch up with the primary within {within}s")
    finally:
        await conn.close()


async def _run(
    args: argparse.Namespace, dsn: str, stop: asyncio.Event, standby: EmbeddedPostgres | None
) -> int:
    api_dsn = await _ensure_database(dsn, "changefeed_demo_vmapi")
    dns_dsn = await _ensure_database(dsn, "changefeed_demo_cns")
    overrides: dict[str, Any] = {}
    if standby is not None:
        await _replayed(dsn, standby.dsn)
        overrides["read_dsn"] = standby.dsn_for("changefeed_demo_vmapi")
    app = create_app(api_dsn, poll_interval=0.2, **overrides)
    publisher = app.state.publisher
    config = server_config(
        publisher.listeners_first(app),
        "127.0.0.1",
        args.port,
        fast_path=True,
        head_timeout=ServerConfig().header_timeout,
    )
    server = DrainingServer(config, [publisher], grace=3.0, owns_process=True)
    serving = asyncio.create_task(server.serve(), name="demo-api")
    async with asyncio.timeout(30):
        while not server.started:
            if serving.done():
                serving.result()
                return 1
            await asyncio.sleep(0.05)
    port = server.servers[0].sockets[0].getsockname()[1]
    base = f"http://127.0.0.1:{port}"
    print(f"VM API + publisher on {base} (websocket ws://127.0.0.1:{port}/changefeeds)", flush=True)
    if standby is not None:
        print(
            f"  the publisher reads the feed from the standby on 127.0.0.1:{standby.port};"
            " its doorbell rings from the primary, where the API writes",
            flush=True,
        )
    print(
        f"  try: changefeed listen {base} --resource vm  (or server)  |  changefeed stats {base}",
        flush=True,
    )
    dns = DnsController(
        f"ws://127.0.0.1:{port}/changefeeds",
        dns_dsn,
        zone="vms.demo",
        listener_config=ListenerConfig(),
        name="demo-dns",
    )
    status = 1
    async with httpx.AsyncClient(base_url=base, timeout=10) as client:
        load = LoadGenerator(client, args.rate, random.Random())
        tasks: list[asyncio.Task[Any]] = []
        try:
            async with dns:
                await dns.wait_synced(30)
                print(
                    f"DNS service bootstrapped {len(dns.vms.mirror)} VMs and "
                    f"{len(dns.servers.mirror)} servers on one connection; "
                    f"now following the feed",
                    flush=True,
                )
                tasks.append(asyncio.create_task(load.run(), name="demo-load"))
                deadline = time.monotonic() + args.duration if args.duration else None
                started = time.monotonic()
                records = dns.records()
                while not stop.is_set():
                    if deadline is not None and time.monotonic() >= deadline:
                        break
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(stop.wait(), 1.0)
                    now = dns.records()
                    _print_learned(records, now)
                    records = now
                    st = dns.listener.status()
                    tailer = publisher.tailer
                    print(
                        f"[{time.monotonic() - started:5.1f}s] writes={load.writes} "
                        f"servers={len(load.servers)} "
                        f"mirrored={len(dns.vms.mirror)}+{len(dns.servers.mirror)} "
                        f"dns_records={len(now)} "
                        f"listener={st.state.value} buffer={st.buffer_size} "
                        f"publisher: listeners={len(publisher.registry)} "
                        f"entries={tailer.entries_total} lag={tailer.lag_seconds:.3f}s"
                        + (" (via the standby)" if standby is not None else ""),
                        flush=True,
                    )
                for task in tasks:
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
                tasks.clear()
                status = await _converge(client, dns)
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
    server.should_exit = True
    await asyncio.wait_for(serving, 30)
    return status


async def _converge(client: httpx.AsyncClient, dns: DnsController) -> int:
    """After writes stop, the mirror must equal the API's data (invariant I4), in the
    fields the DNS service follows."""
    expected = await _api_state(client)
    try:
        async with asyncio.timeout(15):
            # The API's state is not an event we can await: compare until equal.
            while _mirrored(dns) != expected:  # noqa: ASYNC110
                await asyncio.sleep(0.1)
    except TimeoutError:
        print(
            f"mirror did NOT converge: {len(dns.vms.mirror)} VMs and "
            f"{len(dns.servers.mirror)} servers mirrored, {len(expected[0])} and "
            f"{len(expected[1])} in the API",
            file=sys.stderr,
            flush=True,
        )
        return 1
    print(
        f"converged: the DNS service's mirrors equal the API ({len(expected[0])} VMs, "
        f"{len(expected[1])} servers, {len(dns.records())} DNS records)",
        flush=True,
    )
    return 0
