"""One Listener, two resources, one websocket, one Controller per resource.

The example VM API (real uvicorn, real PostgreSQL) publishes a second
resource here, ``network``: rows in ``nets.networks``, served by a keyset
bootstrap route ``/networks`` (changefeed.bootstrap) on the same app, and
written with ``changefeed.publish`` in each write's transaction. The listener
registers ``vm`` and ``network`` in one v2 registration; the publisher's
``/changefeeds/stats`` must show one connection with two registrations, and
each controller must see only its own resource.

``test_shared_listener_convergence`` is invariant I4 for a shared listener:
seeded schedules of writes to both resources while the TCP connection is
dropped, the publisher restarts, and a controller falls behind until the
buffer overflows (which re-bootstraps both resources); after writes stop,
both mirrors equal the API's tables.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
import uuid
from datetime import timedelta
from typing import Any

import asyncpg
import httpx
import pytest
from helpers import wait_until
from test_convergence import SlowTransport, Writer
from test_listener_support import Proxy, VmApiServer, api_state, burst, create_vms

from changefeed.bootstrap import BootstrapRoute, KeysetQuery
from changefeed.example.vmapi import VM_RESOURCE
from changefeed.listener import (
    BackoffPolicy,
    ChangeKind,
    ConnectionState,
    Controller,
    Listener,
    ListenerConfig,
)
from changefeed.publisher import ResourceConfig
from changefeed.publisher.retention import trim_expired

NETWORK = ResourceConfig("network", "/networks", ("subnet",))
KINDS = (ChangeKind("vm", ("nic", "alias")), ChangeKind("network", ("subnet",)))
INSTANCE = "5e0c3c9a-8d1f-4a55-9d43-1b6a0e3f2c77"
FAST = ListenerConfig(backoff=BackoffPolicy(initial=0.02, maximum=0.2), page_limit=7)
NETWORKS_SQL = """
CREATE SCHEMA IF NOT EXISTS nets;
CREATE TABLE IF NOT EXISTS nets.networks (
    uuid uuid PRIMARY KEY,
    name text NOT NULL,
    subnet text NOT NULL
);
"""


class VmAndNetworkApi(VmApiServer):
    """The example VM API, also publishing ``network`` (bootstrap route ``/networks``)."""

    def __init__(self, dsn: str, **overrides: Any) -> None:
        super().__init__(dsn, resources=(VM_RESOURCE, NETWORK), **overrides)

    def make_app(self) -> Any:
        app = super().make_app()
        networks = BootstrapRoute(
            "/networks",
            KeysetQuery(
                "networks",
                table="nets.networks",
                key="uuid",
                columns=("uuid", "name", "subnet"),
                parse_id=uuid.UUID,
            ),
            app.state.vmapi.pool,
        )
        app.router.routes[:0] = networks.routes()
        return app

    async def start(self) -> None:
        conn = await asyncpg.connect(self.dsn)
        try:
            await conn.execute(NETWORKS_SQL)
        finally:
            await conn.close()
        await super().start()


async def put_network(db: str | asyncpg.Connection, net: str, name: str, subnet: str) -> None:
    """Create or change a network and publish it, in one transaction."""
    conn = await asyncpg.connect(db) if isinstance(db, str) else db
    try:
        async with conn.transaction():
            await conn.execute(
                "INSERT INTO nets.networks VALUES ($1, $2, $3) ON CONFLICT (uuid)"
                " DO UPDATE SET name = EXCLUDED.name, subnet = EXCLUDED.subnet",
                uuid.UUID(net),
                name,
                subnet,
            )
            await conn.execute("SELECT changefeed.publish('network', ARRAY['subnet'], $1)", net)
    finally:
        if isinstance(db, str):
            await conn.close()


async def delete_network(db: str | asyncpg.Connection, net: str) -> None:
    conn = await asyncpg.connect(db) if isinstance(db, str) else db
    try:
        async with conn.transaction():
            await conn.execute("DELETE FROM nets.networks WHERE uuid = $1", uuid.UUID(net))
            await conn.execute("SELECT changefeed.publish('network', ARRAY[]::text[], $1)", net)
    finally:
        if isinstance(db, str):
            await conn.close()


async def network_state(dsn: str) -> dict[str, dict[str, Any]]:
    """Every network the API holds, as its route serves it."""
    conn = await asyncpg.connect(dsn, timeout=10)
    try:
        rows = await conn.fetch("SELECT uuid, name, subnet FROM nets.networks")
    finally:
        await conn.close()
    return {
        str(r["uuid"]): {"uuid": str(r["uuid"]), "name": r["name"], "subnet": r["subnet"]}
        for r in rows
    }


async def publisher_stats(api: VmApiServer) -> dict[str, Any]:
    async with httpx.AsyncClient(base_url=api.url, timeout=10) as http:
        response = await http.get("/changefeeds/stats")
    response.raise_for_status()
    stats: dict[str, Any] = response.json()
    return stats


def shared_listener(url: str, **kwargs: Any) -> Listener:
    return Listener(
        url,
        instance=INSTANCE,
        service="tcns",
        change_kinds=KINDS,
        config=kwargs.pop("config", FAST),
        rng=random.Random(3),
        **kwargs,
    )


async def test_two_controllers_share_one_listener_on_one_connection(dsn: str) -> None:
    async with VmAndNetworkApi(dsn) as api, httpx.AsyncClient(base_url=api.url) as client:
        vm_ids = await create_vms(client, 30)
        net_ids = [str(uuid.uuid4()) for _ in range(12)]
        for n, net in enumerate(net_ids):
            await put_network(dsn, net, f"net-{n}", f"10.{n}.0.0/24")
        listener = shared_listener(api.ws_url)
        called: dict[str, list[str]] = {"vm": [], "network": [], "vm-too": []}

        def recorder(what: str) -> Any:
            async def reconcile(key: str, old: Any, new: Any) -> None:
                called[what].append(key)

            return reconcile

        vms = Controller(listener, resource="vm", reconcile=recorder("vm"))
        networks = Controller(listener, resource="network", reconcile=recorder("network"))
        vms_too = Controller(listener, resource="vm", reconcile=recorder("vm-too"), name="again")
        async with vms, networks, vms_too:
            await asyncio.gather(*(c.wait_synced(20) for c in (vms, networks, vms_too)))
            assert dict(vms.mirror) == dict(vms_too.mirror) == await api_state(dsn)
            assert dict(networks.mirror) == await network_state(dsn)
            stats = await publisher_stats(api)
            assert stats["listeners"] == 1  # one websocket ...
            registrations = stats["registrations"]  # ... with two registrations
            assert sorted(r["changeKind"]["resource"] for r in registrations) == ["network", "vm"]
            assert {r["instance"] for r in registrations} == {INSTANCE}
            status = listener.status()
            assert status.resources == ("vm", "network") and status.bootstraps == 1
            assert [(p.resource, p.items, p.done) for p in status.bootstrap] == [
                ("vm", 30, True),
                ("network", 12, True),
            ]
            assert set(listener.routes) == {"vm", "network"}

            # Changes to both resources: each controller sees only its own.
            await client.patch(f"/vms/{vm_ids[0]}", json={"alias": "renamed"})
            await put_network(dsn, net_ids[0], "net-0", "10.99.0.0/24")
            await delete_network(dsn, net_ids[1])
            (late,) = await create_vms(client, 1, "late")
            await wait_until(
                lambda: vms.stats().items >= 2 and networks.stats().items >= 2, 10, message="items"
            )

            async def converged() -> bool:
                return dict(vms.mirror) == dict(vms_too.mirror) == await api_state(dsn) and dict(
                    networks.mirror
                ) == await network_state(dsn)

            await wait_until(converged, 10, message="both mirrors")
            assert vms.stats().items == vms_too.stats().items == 2
            assert networks.stats().items == 2

            # A publisher restart: one connection again, both resumed from one cursor.
            await api.restart()
            await put_network(dsn, net_ids[2], "net-2", "10.98.0.0/24")
            await client.patch(f"/vms/{late}", json={"alias": "later"})
            await wait_until(converged, 15, message="after the restart")
            stats = await publisher_stats(api)
            assert stats["listeners"] == 1 and len(stats["registrations"]) == 2
            status = listener.status()
            assert status.registrations >= 2 and status.resumes >= 1 and status.bootstraps == 1
    assert set(called["vm"]) <= {*vm_ids, late} and set(called["network"]) <= set(net_ids)
    assert called["vm"] and called["network"] and sorted(called["vm"]) == sorted(called["vm-too"])
    assert listener.state is ConnectionState.STOPPED  # the last controller closed it


async def test_a_cursor_that_cannot_be_resumed_rebootstraps_every_controller(dsn: str) -> None:
    async with VmAndNetworkApi(dsn) as api, httpx.AsyncClient(base_url=api.url) as client:
        vm_ids = await create_vms(client, 6)
        nets = [str(uuid.uuid4()) for _ in range(4)]
        for n, net in enumerate(nets):
            await put_network(dsn, net, f"net-{n}", "10.0.0.0/24")
        async with Proxy(api.port or 0) as proxy:
            listener = shared_listener(proxy.ws_url)
            vms = Controller(listener, resource="vm")
            networks = Controller(listener, resource="network")
            async with vms, networks:
                await vms.wait_synced(20)
                await networks.wait_synced(20)
                with proxy.refuse():
                    proxy.cut()
                    await wait_until(lambda: listener.status().aborts >= 1, 10)
                    # Missed while away, then trimmed: the cursor is no longer resumable.
                    await burst(dsn, vm_ids[:3], 2)
                    await delete_network(dsn, nets[0])
                    await put_network(dsn, str(uuid.uuid4()), "new", "10.1.0.0/24")
                    conn = await asyncpg.connect(dsn)
                    try:
                        await trim_expired(conn, "changefeed", timedelta(0))
                    finally:
                        await conn.close()

                async def converged() -> bool:
                    return dict(vms.mirror) == await api_state(dsn) and dict(
                        networks.mirror
                    ) == await network_state(dsn)

                await wait_until(converged, 15, message="re-bootstrapped")
                status = listener.status()
    assert status.bootstraps == 2 and status.resumes == 0
    assert sum(status.not_resumed.values()) == 1  # counted (with the ack's reason, if any)
    assert vms.stats().resyncs == networks.stats().resyncs == 2  # both, from one bootstrap


async def test_one_failed_walk_aborts_the_bootstrap_of_every_resource(dsn: str) -> None:
    """The ``/networks`` route fails (its table is gone) while ``/vms`` walks fine: the
    connection's bootstrap fails as a whole, nothing is handed out, the listener
    backs off and registers again; once the route works, both controllers sync."""
    async with VmAndNetworkApi(dsn) as api, httpx.AsyncClient(base_url=api.url) as client:
        await create_vms(client, 5)
        conn = await asyncpg.connect(dsn)
        try:
            await conn.execute("ALTER TABLE nets.networks RENAME TO networks_away")
            config = ListenerConfig(backoff=FAST.backoff, page_limit=2, page_attempts=1)
            listener = shared_listener(api.ws_url, config=config)
            vms = Controller(listener, resource="vm")
            networks = Controller(listener, resource="network")
            async with vms, networks:
                await wait_until(lambda: listener.status().aborts >= 2, 15, message="aborts")
                status = listener.status()
                assert status.bootstraps == 0 and vms.stats().resyncs == 0
                assert "bootstrap walk of network failed" in (status.last_error or "")
                await conn.execute("ALTER TABLE nets.networks_away RENAME TO networks")
                await vms.wait_synced(20)
                await networks.wait_synced(20)
                assert len(vms.mirror) == 5 and vms.stats().resyncs == 1
        finally:
            await conn.close()


# -- I4 for a shared listener ---------------------------------------------------------

SCHEDULES = 8
WRITE_SECONDS = 2.5
FAULTS = ("cut", "publisher", "slow")


class NetworkWriter:
    """Random network writes (creates, changes, deletes) in SQL, as an API would."""

    def __init__(self, rng: random.Random, dsn: str) -> None:
        self.rng = rng
        self.dsn = dsn
        self.ids: list[str] = []
        self.ok = 0

    async def step(self, conn: asyncpg.Connection) -> None:
        rng = self.rng
        op = rng.choices(("create", "change", "delete"), (3, 4, 1))[0]
        if op == "create" or not self.ids:
            net = str(uuid.uuid4())
            self.ids.append(net)
            await put_network(conn, net, f"net-{rng.randrange(100)}", "10.0.0.0/16")
        elif op == "change":
            await put_network(conn, rng.choice(self.ids), "x", f"10.{rng.randrange(250)}.0.0/16")
        else:
            net = rng.choice(self.ids)
            self.ids.remove(net)
            await delete_network(conn, net)

    async def run(self, until: float) -> None:
        conn: asyncpg.Connection | None = None
        while time.monotonic() < until:
            try:
                conn = conn or await asyncpg.connect(self.dsn, timeout=5)
                await self.step(conn)
                self.ok += 1
                await asyncio.sleep(0.005)  # pacing, not a synchronisation
            except (OSError, asyncpg.PostgresError, asyncpg.InterfaceError):
                conn = None
                await asyncio.sleep(0.05)
        if conn is not None:
            await conn.close()


def plan(seed: int) -> list[tuple[float, str]]:
    rng = random.Random(f"shared-faults-{seed}")
    kinds = [FAULTS[seed % len(FAULTS)], *rng.sample(FAULTS, rng.randint(1, 2))]
    times = sorted(rng.uniform(0.2, WRITE_SECONDS - 0.4) for _ in kinds)
    rng.shuffle(kinds)
    return list(zip(times, kinds, strict=True))


@pytest.mark.slow
@pytest.mark.parametrize("seed", [pytest.param(s, id=f"seed-{s}") for s in range(SCHEDULES)])
async def test_shared_listener_convergence(seed: int, dsn: str) -> None:
    rng = random.Random(f"shared-setup-{seed}")
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
        api = await stack.enter_async_context(VmAndNetworkApi(dsn))
        proxy = await stack.enter_async_context(Proxy(api.port or 0))
        client = await stack.enter_async_context(httpx.AsyncClient(base_url=api.url, timeout=5))
        http = await stack.enter_async_context(
            httpx.AsyncClient(transport=SlowTransport(slow), timeout=5)
        )
        vm_writer = Writer(random.Random(f"shared-vms-{seed}"), client, dsn)
        net_writer = NetworkWriter(random.Random(f"shared-nets-{seed}"), dsn)
        for _ in range(rng.randint(5, 12)):
            await vm_writer.create()
        conn = await asyncpg.connect(dsn)
        for _ in range(rng.randint(3, 8)):
            await net_writer.step(conn)
        await conn.close()
        listener = Listener(
            proxy.ws_url,
            instance=str(uuid.uuid4()),
            service="tcns",
            change_kinds=KINDS,
            config=config,
            http=http,
            rng=random.Random(seed),
        )
        settings: dict[str, Any] = {
            "concurrency": rng.choice((1, 2, 4)),
            "fetch_batch": rng.choice((1, 5, 20)),
            "max_pending": 8,
            "retry": BackoffPolicy(initial=0.02, maximum=0.5),
        }
        vms = Controller(listener, resource="vm", **settings)
        networks = Controller(listener, resource="network", **settings)
        await stack.enter_async_context(vms)
        await stack.enter_async_context(networks)
        await vms.wait_synced(20)
        await networks.wait_synced(20)
        stats = await publisher_stats(api)
        assert stats["listeners"] == 1 and len(stats["registrations"]) == 2

        async def inject(kind: str) -> None:
            if kind == "cut":
                await wait_until(lambda: listener.state is ConnectionState.LIVE, 15)
                before = listener.status().aborts
                proxy.cut()
                await wait_until(lambda: listener.status().aborts > before, 10, message="cut")
            elif kind == "publisher":
                await api.restart()
            else:  # slow: a controller falls behind until the buffer overflows
                await wait_until(lambda: listener.state is ConnectionState.LIVE, 15)
                before = listener.status().overflows
                slow.set()
                try:
                    ids = vm_writer.ids or [str(uuid.uuid4()) for _ in range(10)]
                    sample = [vm_writer.rng.choice(ids) for _ in range(40)]
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
        until = started + WRITE_SECONDS
        await asyncio.gather(vm_writer.run(until), net_writer.run(until), faults(started))
        assert sorted(happened) == sorted(kind for _, kind in plan(seed))

        # Writes have stopped: both mirrors must converge, exactly.
        expected_vms = await api_state(dsn)
        expected_networks = await network_state(dsn)

        def converged() -> bool:
            return dict(vms.mirror) == expected_vms and dict(networks.mirror) == expected_networks

        try:
            await wait_until(converged, 30, interval=0.05, message=f"schedule {seed}")
        except AssertionError:
            raise AssertionError(
                f"schedule {seed} did not converge: faults={happened} "
                f"vms missing={len(set(expected_vms) - set(vms.mirror))} "
                f"extra={len(set(vms.mirror) - set(expected_vms))}; networks "
                f"missing={len(set(expected_networks) - set(networks.mirror))} "
                f"extra={len(set(networks.mirror) - set(expected_networks))}; "
                f"listener={listener.status()} vms={vms.stats()} networks={networks.stats()}"
            ) from None
        await wait_until(lambda: listener.state is ConnectionState.LIVE, 15)
        stats = await publisher_stats(api)
        assert stats["listeners"] == 1 and len(stats["registrations"]) == 2
        status = listener.status()
        assert vm_writer.ok > 0 and net_writer.ok > 0
        # Every bootstrap handed out reached both controllers (one whose connection
        # ended before it was handed out reached neither).
        assert vms.stats().resyncs == networks.stats().resyncs <= status.bootstraps
        if "slow" in happened:
            assert status.overflows >= 1 and status.bootstraps >= 2
        if "cut" in happened or "publisher" in happened:
            assert status.aborts >= 1 and status.registrations >= 2
