"""One Listener, two resources, one websocket, one Controller per resource.

The example API (real uvicorn, real PostgreSQL) publishes ``vm`` and
``server`` on one feed. The listener registers both in one v2 registration;
the publisher's ``/changefeeds/stats`` must show one connection with two
registrations, and each controller must see only its own resource.

``test_shared_listener_convergence`` is invariant I4 for a shared listener:
seeded schedules of writes to both resources while the TCP connection is
dropped, the publisher restarts, and a controller falls behind until the
buffer overflows (which re-bootstraps both resources); after writes stop,
both mirrors equal the API's tables. (``tests/test_convergence.py`` runs the
DNS controller, also one listener for both, through the same and more.)
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
from test_listener_support import (
    Proxy,
    VmApiServer,
    api_servers,
    api_state,
    burst,
    capture_events,
    create_vms,
)

from changefeed.listener import (
    BackoffPolicy,
    ChangeKind,
    ConnectionState,
    Controller,
    Listener,
    ListenerConfig,
    ListenerConfigError,
    Resynced,
)
from changefeed.publisher.retention import trim_expired

KINDS = (ChangeKind("vm", ("nic", "alias", "server")), ChangeKind("server"))
INSTANCE = "5e0c3c9a-8d1f-4a55-9d43-1b6a0e3f2c77"
FAST = ListenerConfig(backoff=BackoffPolicy(initial=0.02, maximum=0.2), page_limit=7)


async def create_servers(client: httpx.AsyncClient, count: int, prefix: str = "cn") -> list[str]:
    """Create ``count`` servers through ``POST /servers``; return their uuids."""
    ids = []
    for n in range(count):
        body = {"hostname": f"{prefix}-{n}", "ram": 65536, "datacenter": "dc-1"}
        response = await client.post("/servers", json=body)
        response.raise_for_status()
        ids.append(str(response.json()["uuid"]))
    return ids


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
    async with VmApiServer(dsn) as api, httpx.AsyncClient(base_url=api.url) as client:
        vm_ids = await create_vms(client, 30)
        server_ids = await create_servers(client, 12)
        listener = shared_listener(api.ws_url)
        called: dict[str, list[str]] = {"vm": [], "server": [], "vm-too": []}

        def recorder(what: str) -> Any:
            async def reconcile(key: str, old: Any, new: Any) -> None:
                called[what].append(key)

            return reconcile

        vms = Controller(listener, resource="vm", reconcile=recorder("vm"))
        servers = Controller(listener, resource="server", reconcile=recorder("server"))
        vms_too = Controller(listener, resource="vm", reconcile=recorder("vm-too"), name="again")
        async with vms, servers, vms_too:
            await asyncio.gather(*(c.wait_synced(20) for c in (vms, servers, vms_too)))
            assert dict(vms.mirror) == dict(vms_too.mirror) == await api_state(dsn)
            assert dict(servers.mirror) == await api_servers(dsn)
            stats = await publisher_stats(api)
            assert stats["listeners"] == 1  # one websocket ...
            registrations = stats["registrations"]  # ... with two registrations
            assert sorted(r["changeKind"]["resource"] for r in registrations) == ["server", "vm"]
            assert {r["instance"] for r in registrations} == {INSTANCE}
            status = listener.status()
            assert status.resources == ("vm", "server") and status.bootstraps == 1
            assert [(p.resource, p.items, p.done) for p in status.bootstrap] == [
                ("vm", 30, True),
                ("server", 12, True),
            ]
            assert set(listener.routes) == {"vm", "server"}

            # Changes to both resources: each controller sees only its own.
            await client.patch(f"/vms/{vm_ids[0]}", json={"server_uuid": server_ids[0]})
            await client.patch(f"/servers/{server_ids[0]}", json={"hostname": "cn-renamed"})
            await client.delete(f"/servers/{server_ids[1]}")
            (late,) = await create_vms(client, 1, "late")
            await wait_until(
                lambda: vms.stats().items >= 2 and servers.stats().items >= 2, 10, message="items"
            )

            async def converged() -> bool:
                return dict(vms.mirror) == dict(vms_too.mirror) == await api_state(dsn) and dict(
                    servers.mirror
                ) == await api_servers(dsn)

            await wait_until(converged, 10, message="both mirrors")
            assert vms.stats().items == vms_too.stats().items == 2
            assert servers.stats().items == 2

            # A publisher restart: one connection again, both resumed from one cursor.
            await api.restart()
            await client.patch(f"/servers/{server_ids[2]}", json={"status": "running"})
            await client.patch(f"/vms/{late}", json={"alias": "later"})
            await wait_until(converged, 15, message="after the restart")
            stats = await publisher_stats(api)
            assert stats["listeners"] == 1 and len(stats["registrations"]) == 2
            status = listener.status()
            assert status.registrations >= 2 and status.resumes >= 1 and status.bootstraps == 1
    assert set(called["vm"]) <= {*vm_ids, late} and set(called["server"]) <= set(server_ids)
    assert called["vm"] and called["server"] and sorted(called["vm"]) == sorted(called["vm-too"])
    assert listener.state is ConnectionState.STOPPED  # the last controller closed it


async def test_a_controller_that_stops_before_the_listener_starts_does_not_hold_up_the_others(
    dsn: str,
) -> None:
    """The listener waits for every attached controller to run. One that stops before
    the others run is no longer waited for, and the listener stays open for them."""
    async with VmApiServer(dsn) as api, httpx.AsyncClient(base_url=api.url) as client:
        await create_vms(client, 5)
        await create_servers(client, 3)
        listener = shared_listener(api.ws_url)
        early = Controller(listener, resource="vm", name="early")
        vms = Controller(listener, resource="vm")
        servers = Controller(listener, resource="server")
        async with early:
            pass  # stopped before its task ever ran
        with capture_events() as events:
            async with vms:
                await wait_until(lambda: events.named("listener.waiting_for_controllers"), 5)
        assert events.named("listener.waiting_for_controllers")[0]["attached"] == 2
        assert listener.state is ConnectionState.IDLE  # it never started
        async with servers:
            await servers.wait_synced(20)
            assert dict(servers.mirror) == await api_servers(dsn)
    # The last controller closed it. (mypy still holds listener.state to the IDLE
    # asserted above, though the listener ran since: hence the ignore.)
    assert listener.state is ConnectionState.STOPPED  # type: ignore[comparison-overlap]


async def test_a_controller_joining_a_listener_that_has_bootstrapped_is_told_it_started(
    dsn: str,
) -> None:
    """Once the listener has a cursor of its own (from its bootstrap), a late
    Controller is refused because the listener started, not as if the application had
    passed a saved cursor (it passed none)."""
    async with VmApiServer(dsn) as api, httpx.AsyncClient(base_url=api.url) as client:
        await create_vms(client, 2)
        listener = shared_listener(api.ws_url)
        vms = Controller(listener, resource="vm")
        servers = Controller(listener, resource="server")
        async with vms, servers:
            await vms.wait_synced(20)
            assert listener.cursor is not None
            for resource in ("vm", "server"):
                with pytest.raises(ListenerConfigError) as refused:
                    Controller(listener, resource=resource, name=f"late-{resource}")
                assert refused.value.key == "listener", refused.value
                assert "before the listener starts" in str(refused.value)
    assert listener.state is ConnectionState.STOPPED
    with pytest.raises(ListenerConfigError, match="before the listener starts"):
        Controller(listener, resource="vm", name="after")


async def test_a_cursor_that_cannot_be_resumed_rebootstraps_every_controller(dsn: str) -> None:
    async with VmApiServer(dsn) as api, httpx.AsyncClient(base_url=api.url) as client:
        vm_ids = await create_vms(client, 6)
        server_ids = await create_servers(client, 4)
        async with Proxy(api.port or 0) as proxy:
            listener = shared_listener(proxy.ws_url)
            vms = Controller(listener, resource="vm")
            servers = Controller(listener, resource="server")
            async with vms, servers:
                await vms.wait_synced(20)
                await servers.wait_synced(20)
                with proxy.refuse():
                    proxy.cut()
                    await wait_until(lambda: listener.status().aborts >= 1, 10)
                    # Missed while away, then trimmed: the cursor is no longer resumable.
                    await burst(dsn, vm_ids[:3], 2)
                    await client.delete(f"/servers/{server_ids[0]}")
                    await create_servers(client, 1, "new")
                    conn = await asyncpg.connect(dsn)
                    try:
                        await trim_expired(conn, "changefeed", timedelta(0))
                    finally:
                        await conn.close()

                async def converged() -> bool:
                    return dict(vms.mirror) == await api_state(dsn) and dict(
                        servers.mirror
                    ) == await api_servers(dsn)

                await wait_until(converged, 15, message="re-bootstrapped")
                status = listener.status()
    assert status.bootstraps == 2 and status.resumes == 0
    assert sum(status.not_resumed.values()) == 1  # counted, with the ack's reason
    assert vms.stats().resyncs == servers.stats().resyncs == 2  # both, from one bootstrap


async def test_one_failed_walk_aborts_the_bootstrap_of_every_resource(dsn: str) -> None:
    """The ``/servers`` route fails (its table is away) while ``/vms`` walks fine: the
    connection's bootstrap fails as a whole, nothing is handed out, the listener
    backs off and registers again; once the route works, both controllers sync."""
    async with VmApiServer(dsn) as api, httpx.AsyncClient(base_url=api.url) as client:
        await create_vms(client, 5)
        conn = await asyncpg.connect(dsn)
        try:
            await conn.execute("ALTER TABLE vmapi.servers RENAME TO servers_away")
            config = ListenerConfig(backoff=FAST.backoff, page_limit=2, page_attempts=1)
            listener = shared_listener(api.ws_url, config=config)
            vms = Controller(listener, resource="vm")
            servers = Controller(listener, resource="server")
            async with vms, servers:
                await wait_until(lambda: listener.status().aborts >= 2, 15, message="aborts")
                status = listener.status()
                assert status.bootstraps == 0 and vms.stats().resyncs == 0
                assert "bootstrap walk of server failed" in (status.last_error or "")
                await conn.execute("ALTER TABLE vmapi.servers_away RENAME TO servers")
                await vms.wait_synced(20)
                await servers.wait_synced(20)
                assert len(vms.mirror) == 5 and vms.stats().resyncs == 1
        finally:
            await conn.close()


async def test_a_reconnect_between_the_resynced_events_bootstraps_every_kind_again(
    dsn: str,
) -> None:
    """``async for`` on a listener of two change kinds: the connection drops after the
    application took the first ``Resynced`` and before the second. The reconnect must
    not resume past the second one (that resource would never be bootstrapped): it
    bootstraps both again."""
    async with VmApiServer(dsn) as api, httpx.AsyncClient(base_url=api.url) as client:
        await create_vms(client, 3)
        await create_servers(client, 2)
        async with Proxy(api.port or 0) as proxy:
            listener = shared_listener(proxy.ws_url)
            async with listener:
                first = await asyncio.wait_for(anext(listener), 20)
                assert isinstance(first, Resynced) and first.resource == "vm"
                proxy.cut()
                await wait_until(lambda: listener.status().aborts >= 1, 10, message="abort")
                resynced: dict[str, Resynced] = {}
                async with asyncio.timeout(20):
                    while "server" not in resynced:
                        event = await anext(listener)
                        if isinstance(event, Resynced):
                            resynced[event.resource] = event
                status = listener.status()
    assert set(resynced) == {"vm", "server"} and len(resynced["server"].items) == 2
    assert status.bootstraps == 2 and status.resumes == 0


# -- I4 for a shared listener ---------------------------------------------------------

SCHEDULES = 8
WRITE_SECONDS = 2.5
FAULTS = ("cut", "publisher", "slow")


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
        api = await stack.enter_async_context(VmApiServer(dsn))
        proxy = await stack.enter_async_context(Proxy(api.port or 0))
        client = await stack.enter_async_context(httpx.AsyncClient(base_url=api.url, timeout=5))
        http = await stack.enter_async_context(
            httpx.AsyncClient(transport=SlowTransport(slow), timeout=5)
        )
        writer = Writer(random.Random(f"shared-writes-{seed}"), client, dsn)
        for _ in range(rng.randint(1, 4)):
            await writer.create_server()
        for _ in range(rng.randint(5, 12)):
            await writer.create()
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
        servers = Controller(listener, resource="server", **settings)
        await stack.enter_async_context(vms)
        await stack.enter_async_context(servers)
        await vms.wait_synced(20)
        await servers.wait_synced(20)
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
                    ids = writer.ids or [str(uuid.uuid4()) for _ in range(10)]
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

        # Writes have stopped: both mirrors must converge, exactly.
        expected_vms = await api_state(dsn)
        expected_servers = await api_servers(dsn)

        def converged() -> bool:
            return dict(vms.mirror) == expected_vms and dict(servers.mirror) == expected_servers

        try:
            await wait_until(converged, 30, interval=0.05, message=f"schedule {seed}")
        except AssertionError:
            raise AssertionError(
                f"schedule {seed} did not converge: faults={happened} "
                f"vms missing={len(set(expected_vms) - set(vms.mirror))} "
                f"extra={len(set(vms.mirror) - set(expected_vms))}; servers "
                f"missing={len(set(expected_servers) - set(servers.mirror))} "
                f"extra={len(set(servers.mirror) - set(expected_servers))}; "
                f"listener={listener.status()} vms={vms.stats()} servers={servers.stats()}"
            ) from None
        await wait_until(lambda: listener.state is ConnectionState.LIVE, 15)
        stats = await publisher_stats(api)
        assert stats["listeners"] == 1 and len(stats["registrations"]) == 2
        status = listener.status()
        assert writer.ok > 0 and writer.servers
        # Every bootstrap handed out reached both controllers (one whose connection
        # ended before it was handed out reached neither).
        assert vms.stats().resyncs == servers.stats().resyncs <= status.bootstraps
        if "slow" in happened:
            assert status.overflows >= 1 and status.bootstraps >= 2
        if "cut" in happened or "publisher" in happened:
            assert status.aborts >= 1 and status.registrations >= 2
