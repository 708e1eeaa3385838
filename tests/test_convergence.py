"""Invariant I4, convergence: after writes stop, the mirror and the DNS records derived from
it equal the API's data exactly, whatever happened meanwhile.

Each schedule is seeded: its writes (creates, renames, renumbers, deletes,
bursts, migrations between servers, servers created and renamed) and its
faults (which, and when) come from ``random.Random`` seeded with the
schedule number, so a failing schedule is rerun by its test id
(``test_convergence[seed-7]``). Thread timing still varies from run to run;
the invariant must hold for every interleaving.

Faults, each a real one:

* ``cut``: the TCP proxy between the DNS service's listener and the publisher
  drops every connection (both ends see a reset);
* ``publisher``: the API's uvicorn server stops and a new app starts on the
  same port (a publisher restart; the feed lives on in PostgreSQL);
* ``postgres``: the PostgreSQL server restarts (API, publisher, tailer and
  DNS storage all lose their connections);
* ``slow``: the DNS service's HTTP fetches take 0.3 s while a burst of
  changes arrives, so its controller falls behind, stops reading the
  listener, and the listener's small buffer overflows (abort, clear,
  back off, re-bootstrap).

Every schedule has the fault ``KINDS[seed % 4]`` plus one or two random ones,
so each kind runs in a quarter of the schedules at least.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections.abc import Mapping
from typing import Any

import httpx
import pytest
from helpers import wait_until
from test_listener_support import Proxy, VmApiServer, api_servers, api_state, burst

from changefeed.embedded import EmbeddedPostgres
from changefeed.example.dns import DnsController, derive_records
from changefeed.listener import BackoffPolicy, ConnectionState, ListenerConfig

SCHEDULES = 24
WRITE_SECONDS = 2.5
KINDS = ("cut", "publisher", "postgres", "slow")
ALIASES = ("web", "db", "Web", "cache", "api", "queue", "not a label", "x" * 70)
HOSTNAMES = ("cn-1", "CN-2", "cn-3.rack-1", "web", "cn-1")  # "web": also an alias; cn-1 twice

pytestmark = pytest.mark.slow


class SlowTransport(httpx.AsyncBaseTransport):
    """The real HTTP transport, made slow while ``slow`` is set: the application falling
    behind, not a synchronisation."""

    def __init__(self, slow: asyncio.Event, delay: float = 0.3) -> None:
        self._inner = httpx.AsyncHTTPTransport()
        self._slow = slow
        self._delay = delay

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if self._slow.is_set():
            await asyncio.sleep(self._delay)
        return await self._inner.handle_async_request(request)

    async def aclose(self) -> None:
        await self._inner.aclose()


def vm_body(rng: random.Random) -> dict[str, Any]:
    alias = rng.choice(ALIASES)
    if rng.random() < 0.5:
        alias = f"{alias}-{rng.randrange(5)}"
    nics = [
        {"ip": f"10.1.{rng.randrange(4)}.{rng.randrange(1, 250)}"} for _ in range(rng.randrange(4))
    ]
    return {"alias": alias, "nics": nics}


class Writer:
    """Random writes through the API's routes; failures during faults are expected."""

    def __init__(self, rng: random.Random, client: httpx.AsyncClient, dsn: str) -> None:
        self.rng = rng
        self.client = client
        self.dsn = dsn
        self.ids: list[str] = []
        self.servers: list[str] = []
        self.ok = 0
        self.failed = 0

    async def create(self) -> None:
        body = vm_body(self.rng)
        if self.servers and self.rng.random() < 0.8:
            body["server_uuid"] = self.rng.choice(self.servers)
        response = await self.client.post("/vms", json=body)
        if response.status_code == 201:
            self.ids.append(response.json()["uuid"])

    async def create_server(self) -> None:
        body = {"hostname": self.rng.choice(HOSTNAMES), "ram": 65536, "datacenter": "dc-1"}
        response = await self.client.post("/servers", json=body)
        if response.status_code == 201:
            self.servers.append(response.json()["uuid"])

    async def step(self) -> None:
        rng = self.rng
        op = rng.choices(
            ("create", "alias", "nics", "delete", "burst", "migrate", "server"),
            (3, 3, 2, 2, 1, 1, 1),
        )[0]
        if op == "create" or not self.ids:
            await self.create()
            return
        if op == "server":  # a new server, or a server's new host name
            if not self.servers or rng.random() < 0.3:
                await self.create_server()
            else:
                hostname = rng.choice(HOSTNAMES)
                server = rng.choice(self.servers)
                await self.client.patch(f"/servers/{server}", json={"hostname": hostname})
            return
        vm = rng.choice(self.ids)
        body = vm_body(rng)
        if op == "migrate":
            if self.servers:
                target = rng.choice(self.servers)
                await self.client.patch(f"/vms/{vm}", json={"server_uuid": target})
        elif op == "alias":
            await self.client.patch(f"/vms/{vm}", json={"alias": body["alias"]})
        elif op == "nics":
            await self.client.patch(f"/vms/{vm}", json={"nics": body["nics"]})
        elif op == "delete":
            await self.client.delete(f"/vms/{vm}")
        else:
            await burst(self.dsn, rng.sample(self.ids, min(5, len(self.ids))), 3)

    async def run(self, until: float) -> None:
        while time.monotonic() < until:
            try:
                await self.step()
                self.ok += 1
            except (httpx.HTTPError, OSError) as exc:
                self.failed += 1
                await asyncio.sleep(0.02 if isinstance(exc, httpx.HTTPError) else 0.05)
            except Exception:  # the database is restarting under a direct SQL burst
                self.failed += 1
                await asyncio.sleep(0.05)


def plan(seed: int) -> list[tuple[float, str]]:
    rng = random.Random(f"faults-{seed}")
    kinds = [KINDS[seed % len(KINDS)], *rng.sample(KINDS, rng.randint(1, 2))]
    times = sorted(rng.uniform(0.2, WRITE_SECONDS - 0.4) for _ in kinds)
    rng.shuffle(kinds)
    return list(zip(times, kinds, strict=True))


@pytest.mark.parametrize("seed", [pytest.param(s, id=f"seed-{s}") for s in range(SCHEDULES)])
async def test_convergence(seed: int, dsn: str, restartable_pg_server: EmbeddedPostgres) -> None:
    pg = restartable_pg_server
    rng = random.Random(f"setup-{seed}")
    slow = asyncio.Event()
    config = ListenerConfig(
        buffer_size=rng.choice((40, 60, 100)),
        backoff=BackoffPolicy(initial=0.02, maximum=0.3, reset_after=5.0),
        page_limit=rng.choice((7, 25, 100)),
        ping_interval=1.0,
        ping_timeout=1.0,
        open_timeout=3.0,
        ack_timeout=3.0,
        close_timeout=0.5,
        http_timeout=5.0,
    )
    happened: list[str] = []
    async with contextlib.AsyncExitStack() as stack:
        api = await stack.enter_async_context(VmApiServer(dsn))
        proxy = await stack.enter_async_context(Proxy(api.port or 0))
        client = await stack.enter_async_context(httpx.AsyncClient(base_url=api.url, timeout=5))
        dns_http = await stack.enter_async_context(
            httpx.AsyncClient(transport=SlowTransport(slow), timeout=5)
        )
        writer = Writer(random.Random(f"writes-{seed}"), client, dsn)
        for _ in range(rng.randint(1, 3)):
            await writer.create_server()
        for _ in range(rng.randint(8, 20)):
            await writer.create()
        dns = DnsController(
            proxy.ws_url,
            dsn,
            listener_config=config,
            http=dns_http,
            concurrency=rng.choice((1, 2, 4)),
            fetch_batch=rng.choice((1, 5, 20)),
            max_pending=8,
            retry=BackoffPolicy(initial=0.02, maximum=0.5),
            name=f"dns-{seed}",
        )
        await stack.enter_async_context(dns)
        await dns.wait_synced(20)
        listener = dns.listener
        stats = (await client.get("/changefeeds/stats")).json()
        assert stats["listeners"] == 1 and len(stats["registrations"]) == 2  # vm and server

        async def live() -> None:
            await wait_until(lambda: listener.state is ConnectionState.LIVE, 15, message="live")

        async def inject(kind: str) -> None:
            if kind == "cut":
                await live()
                before = listener.status().aborts
                proxy.cut()
                await wait_until(lambda: listener.status().aborts > before, 10, message="cut")
            elif kind == "publisher":
                await api.restart()
            elif kind == "postgres":
                await asyncio.to_thread(pg.restart)
            else:  # slow
                await live()
                before = listener.status().overflows
                slow.set()
                try:
                    ids = writer.ids or [str(n) for n in range(40)]
                    sample = [writer.rng.choice(ids) for _ in range(40)]
                    await burst(dsn, sample, 6, per_transaction=80)
                    await wait_until(
                        lambda: listener.status().overflows > before, 15, message="overflow"
                    )
                finally:
                    slow.clear()
            happened.append(kind)

        async def faults(started: float) -> None:
            for at, kind in plan(seed):
                delay = started + at - time.monotonic()
                if delay > 0:
                    await asyncio.sleep(delay)  # the schedule's moment, not a synchronisation
                await inject(kind)

        started = time.monotonic()
        await asyncio.gather(writer.run(started + WRITE_SECONDS), faults(started))
        assert sorted(happened) == sorted(kind for _, kind in plan(seed))

        # Writes have stopped: everything must converge, exactly.
        expected = await api_state(dsn)
        servers = await api_servers(dsn)
        records = derive_records(expected.values(), dns.zone, servers.values())

        def hostnames(mirror: Mapping[str, Any]) -> dict[str, Any]:
            return {server: item["hostname"] for server, item in mirror.items()}

        async def converged() -> bool:
            return (
                dict(dns.vms.mirror) == expected
                and hostnames(dns.servers.mirror) == hostnames(servers)  # what it follows
                and dns.records() == records
                and await dns.stored_records() == records
            )

        try:
            await wait_until(converged, 30, interval=0.05, message=f"schedule {seed} converged")
        except AssertionError:
            mirror = dict(dns.controller.mirror)
            missing = set(expected) - set(mirror)
            extra = set(mirror) - set(expected)
            stale = [k for k in expected if k in mirror and mirror[k] != expected[k]]

            def differing(have: dict[str, Any]) -> dict[str, tuple[Any, Any]]:
                names = set(have) | set(records)
                return {
                    n: (have.get(n), records.get(n)) for n in names if have.get(n) != records.get(n)
                }

            detail = (
                f"faults={happened} missing={len(missing)} extra={len(extra)} "
                f"stale={len(stale)} records (have, want): in memory {differing(dns.records())}, "
                f"stored {differing(await dns.stored_records())} listener={listener.status()} "
                f"vms={dns.vms.stats()} servers={dns.servers.stats()}"
            )
            raise AssertionError(f"schedule {seed} did not converge: {detail}") from None
        status = listener.status()
        assert status.state is ConnectionState.LIVE
        assert writer.ok > 0
        if "slow" in happened:
            assert status.overflows >= 1 and status.bootstraps >= 2
        if "cut" in happened or "publisher" in happened:
            assert status.aborts >= 1 and status.registrations >= 2
