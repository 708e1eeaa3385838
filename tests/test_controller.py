"""The controller and the example DNS controller end to end: the example VM API with its
publisher on a real uvicorn, real PostgreSQL, real websockets and HTTP fetches."""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections import Counter
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Any

import asyncpg
import httpx
import pytest
from helpers import wait_until
from prometheus_client import CollectorRegistry, generate_latest
from test_listener_shared import publisher_stats
from test_listener_support import VmApiServer, api_servers, api_state, burst, create_vms

from changefeed.bootstrap import fetch_many
from changefeed.example.dns import (
    DnsController,
    Record,
    derive_records,
    ensure_schema,
    host_name,
    render_records,
)
from changefeed.listener import (
    BackoffPolicy,
    Controller,
    Listener,
    ListenerConfig,
    RegistrationRefused,
)
from changefeed.schemas import ChangeKind

FAST = ListenerConfig(backoff=BackoffPolicy(initial=0.02, maximum=0.2), page_limit=100)


def make_listener(url: str, **kwargs: Any) -> Listener:
    return Listener(
        url,
        instance="0b9e7c6e-27c4-4f0a-8d53-7a3a2f5a1c11",
        service="test",
        change_kind=ChangeKind("vm", ("nic", "alias")),
        config=kwargs.pop("config", FAST),
        rng=random.Random(11),
        **kwargs,
    )


async def test_controller_mirrors_the_api_and_calls_back(dsn: str) -> None:
    registry = CollectorRegistry()
    added: list[str] = []
    updated: list[tuple[str, str, str]] = []
    deleted: list[str] = []

    async def on_add(vm: str, new: dict[str, Any]) -> None:
        added.append(vm)

    async def on_update(vm: str, old: dict[str, Any], new: dict[str, Any]) -> None:
        updated.append((vm, old["alias"], new["alias"]))

    async def on_delete(vm: str, old: dict[str, Any]) -> None:
        deleted.append(vm)

    async with VmApiServer(dsn) as api, httpx.AsyncClient(base_url=api.url) as client:
        ids = await create_vms(client, 250)
        controller = Controller(
            make_listener(api.ws_url),
            on_add=on_add,
            on_update=on_update,
            on_delete=on_delete,
            concurrency=2,
            fetch_batch=20,
            registry=registry,
        )
        async with controller:
            await controller.wait_synced(20)
            assert sorted(added) == sorted(ids)
            assert dict(controller.mirror) == await api_state(dsn)
            # Many changes at once: fetched in batches.
            await burst(dsn, ids[:100], 3, per_transaction=100)
            await client.delete(f"/vms/{ids[-1]}")
            (new,) = await create_vms(client, 1, "late")
            expected = await api_state(dsn)
            await wait_until(lambda: dict(controller.mirror) == expected, 20, message="mirror")
            await wait_until(lambda: deleted == [ids[-1]] and new in added, 10)
            stats = controller.stats()
            metrics = generate_latest(registry).decode()
    assert {vm for vm, _, _ in updated} == set(ids[:100])
    last = {vm: new_alias for vm, _, new_alias in updated}  # intermediate states may show
    assert set(last.values()) == {"burst-2"}
    assert stats.fetch_requests < stats.fetches  # batched (?ids=a,b,c)
    assert stats.coalesced > 0 and stats.items >= 302
    assert stats.resyncs == 1 and stats.synced and stats.mirror_items == 250
    assert 'changefeed_workqueue_adds_total{controller="test:vm"}' in metrics
    assert 'changefeed_controller_fetches_total{controller="test:vm"}' in metrics
    assert 'changefeed_listener_state{listener="test:vm",state="live"} 1.0' not in metrics


async def test_1000_changes_to_one_id_during_its_fetch_cost_at_most_two_fetches(dsn: str) -> None:
    async with VmApiServer(dsn) as api, httpx.AsyncClient(base_url=api.url) as client:
        (target,) = await create_vms(client, 1)
        listener = make_listener(api.ws_url)
        gate = asyncio.Event()
        gate.set()
        in_flight = asyncio.Event()
        fetched: Counter[str] = Counter()

        async def fetch(ids: Sequence[str]) -> Mapping[str, Any]:
            """The real batched HTTP fetch, held at the gate once it started."""
            fetched.update(ids)
            in_flight.set()
            await gate.wait()
            assert listener.route is not None
            return await fetch_many(listener.http, listener.route, ids)

        controller = Controller(listener, fetch=fetch, concurrency=4)
        async with controller:
            await controller.wait_synced(20)
            gate.clear()
            await burst(dsn, [target], 1)
            await asyncio.wait_for(in_flight.wait(), 10)
            conn = await asyncpg.connect(dsn)
            try:
                await burst(conn, [target], 999)  # 999 more transactions, one change each
            finally:
                await conn.close()
            await wait_until(lambda: controller.items == 1000, 20, message="all items arrived")
            assert fetched[target] == 1
            gate.set()
            await wait_until(lambda: controller.mirror[target]["alias"] == "burst-998", 10)
            await controller.wait_idle(10)
    assert fetched[target] <= 2
    assert controller.stats().coalesced >= 998


async def test_a_periodic_resync_hands_a_dropped_update_again_within_one_period(
    dsn: str,
) -> None:
    """The application drops one update (it returns without applying it, as a bug or
    a lost write would). The next periodic resync calls it again with the mirror's
    state, ``old == new``, and it catches up, without a bootstrap or a fetch."""
    async with VmApiServer(dsn) as api, httpx.AsyncClient(base_url=api.url) as client:
        ids = await create_vms(client, 3)
        target = ids[0]
        applied: dict[str, str] = {}  # the application's state: vm -> alias
        dropped_at: list[int] = []  # the resync passes done when it dropped the update
        redelivered: list[tuple[int, bool]] = []  # (passes done, old == new)

        def on_add(vm: str, new: dict[str, Any]) -> None:
            applied[vm] = new["alias"]

        def on_update(vm: str, old: dict[str, Any], new: dict[str, Any]) -> None:
            if vm == target and new["alias"] == "renamed":
                passes = controller.stats().periodic_resyncs
                if not dropped_at:
                    dropped_at.append(passes)
                    return  # dropped: never applied
                redelivered.append((passes, old == new))
            applied[vm] = new["alias"]

        controller = Controller(
            make_listener(api.ws_url), on_add=on_add, on_update=on_update, resync_period=0.3
        )
        async with controller:
            await controller.wait_synced(20)
            response = await client.patch(f"/vms/{target}", json={"alias": "renamed"})
            response.raise_for_status()
            await wait_until(lambda: bool(dropped_at), 10, message="the update was dropped")
            assert applied[target] != "renamed"
            await wait_until(lambda: applied[target] == "renamed", 10, message="handed again")
            stats = controller.stats()
    assert redelivered[0] == (dropped_at[0] + 1, True)  # the very next pass, old == new
    assert stats.resyncs == 1 and stats.fetches == 1  # no list again, no second fetch
    assert applied == {vm: "renamed" if vm == target else applied[vm] for vm in ids}


async def dns_state(dns: DnsController, dsn: str) -> tuple[dict[str, Record], ...]:
    vms, servers = await api_state(dsn), await api_servers(dsn)
    expected = derive_records(vms.values(), dns.zone, servers.values())
    return expected, await dns.stored_records(), dns.records()


async def test_dns_records_follow_the_vms_and_their_servers(dsn: str) -> None:
    async with VmApiServer(dsn) as api, httpx.AsyncClient(base_url=api.url) as client:

        async def server(hostname: str) -> str:
            body = {"hostname": hostname, "ram": 65536, "datacenter": "dc-1"}
            response = await client.post("/servers", json=body)
            response.raise_for_status()
            return str(response.json()["uuid"])

        async def vm(alias: str, *ips: str, on: str | None = None) -> str:
            body: dict[str, Any] = {"alias": alias, "nics": [{"ip": ip} for ip in ips]}
            if on is not None:
                body["server_uuid"] = on
            response = await client.post("/vms", json=body)
            response.raise_for_status()
            return str(response.json()["uuid"])

        cn1, cn2 = await server("CN-1"), await server("cn-2.rack-4")
        web1 = await vm("web", "10.0.0.2", "10.0.0.1", on=cn1)
        web2 = await vm("Web", "10.0.0.3")  # same name, any case: one record, all ips
        db = await vm("db", "10.0.1.1", on=cn2)
        await vm("no nics", on=cn1)  # not a DNS label, and no nics: no record
        await vm("lonely")  # no nics: no record

        async def converged(dns: DnsController) -> bool:
            expected, stored, memory = await dns_state(dns, dsn)
            return expected == stored == memory

        async with DnsController(api.ws_url, dsn, zone="vms.example.", listener_config=FAST) as dns:
            await dns.wait_synced(20)
            await wait_until(lambda: converged(dns), 10, message="first sync")
            stats = await publisher_stats(api)
            assert stats["listeners"] == 1  # both resources on one websocket
            assert sorted(r["changeKind"]["resource"] for r in stats["registrations"]) == [
                "server",
                "vm",
            ]
            records = dns.records()
            assert set(records) == {
                "web.vms.example",
                "db.vms.example",
                "cn-1.vms.example",  # the VMs cn-1 hosts
                "cn-2.rack-4.vms.example",
            }
            assert records["web.vms.example"].ips == ("10.0.0.1", "10.0.0.2", "10.0.0.3")
            assert records["web.vms.example"].vm == min(web1, web2)
            assert records["cn-1.vms.example"] == Record(
                "cn-1.vms.example", ("10.0.0.1", "10.0.0.2"), web1
            )
            assert "10.0.1.1" in render_records(records)

            await client.patch(f"/vms/{web1}", json={"alias": "api"})
            await client.patch(f"/vms/{db}", json={"nics": [{"ip": "10.0.1.9"}]})
            await wait_until(lambda: converged(dns), 10, message="rename and renumber")
            records = dns.records()
            assert records["web.vms.example"] == Record("web.vms.example", ("10.0.0.3",), web2)
            assert records["api.vms.example"].ips == ("10.0.0.1", "10.0.0.2")
            assert records["db.vms.example"].ips == ("10.0.1.9",)
            assert records["cn-2.rack-4.vms.example"].ips == ("10.0.1.9",)

            # A migration moves a VM's addresses to its new server's name; a server's
            # new host name renames the record of every VM it hosts.
            await client.patch(f"/vms/{db}", json={"server_uuid": cn1})
            await client.patch(f"/servers/{cn1}", json={"hostname": "cn-9"})
            await wait_until(lambda: converged(dns), 10, message="migrate and rename")
            records = dns.records()
            assert "cn-1.vms.example" not in records and "cn-2.rack-4.vms.example" not in records
            assert records["cn-9.vms.example"].ips == ("10.0.0.1", "10.0.0.2", "10.0.1.9")
            assert dict(dns.servers.mirror) == await api_servers(dsn)

        # While the DNS service is down, a VM goes away; the next run drops its records.
        await client.delete(f"/vms/{db}")
        async with DnsController(api.ws_url, dsn, zone="vms.example", listener_config=FAST) as dns:
            await dns.wait_synced(20)
            await wait_until(lambda: dns.cleaned == 1, 10, message="stale row cleaned")
            await wait_until(lambda: converged(dns), 10, message="after restart")
            stored = await dns.stored_records()
            assert "db.vms.example" not in stored
            assert stored["cn-9.vms.example"].ips == ("10.0.0.1", "10.0.0.2")


def test_derive_records_names_vms_by_alias_and_by_their_servers_host_name() -> None:
    servers: list[dict[str, Any]] = [
        {"uuid": "s1", "hostname": "CN-1"},
        {"uuid": "s2", "hostname": "x" * 64},  # not a DNS label: no name
    ]
    vms: list[dict[str, Any]] = [
        {"uuid": "a", "alias": "web", "nics": [{"ip": "10.0.0.2"}], "server_uuid": "s1"},
        {"uuid": "b", "alias": "cn-1", "nics": [{"ip": "10.0.0.1"}]},  # shares the name
        {"uuid": "c", "alias": "db", "nics": [], "server_uuid": "s1"},  # no IPs: no names
        {"uuid": "d", "alias": "cache", "nics": [{"ip": "10.0.0.4"}], "server_uuid": "s2"},
        {"uuid": "e", "alias": "q", "nics": [{"ip": "10.0.0.5"}], "server_uuid": "gone"},
    ]
    assert derive_records(vms, "z", servers) == {
        "web.z": Record("web.z", ("10.0.0.2",), "a"),
        "cn-1.z": Record("cn-1.z", ("10.0.0.1", "10.0.0.2"), "a"),
        "cache.z": Record("cache.z", ("10.0.0.4",), "d"),
        "q.z": Record("q.z", ("10.0.0.5",), "e"),
    }
    assert derive_records(vms[:1], "z") == {"web.z": Record("web.z", ("10.0.0.2",), "a")}
    assert host_name("a." * 126 + "b", "z") is None  # 253 characters at most


class _DiesAfterCommit:
    """Hands out the pool's connections; the next checkout given back (after its
    transaction committed) raises as a connection lost at that moment would."""

    def __init__(self, pool: asyncpg.Pool[asyncpg.Record]) -> None:
        self.pool = pool
        self.armed = False

    def acquire(self, timeout: float | None = None) -> Any:
        @contextlib.asynccontextmanager
        async def checkout() -> AsyncIterator[asyncpg.pool.PoolConnectionProxy[asyncpg.Record]]:
            async with self.pool.acquire(timeout=timeout) as conn:
                yield conn
            if self.armed:
                self.armed = False
                raise asyncpg.ConnectionDoesNotExistError("connection lost after COMMIT")

        return checkout()


async def test_a_write_that_committed_but_reported_failure_is_not_left_behind(dsn: str) -> None:
    """The ambiguous commit: the DNS write commits, then the connection dies, so
    the controller sees a failure and memory keeps the old record. If the VM then
    changes back to what memory holds, the table must still be rewritten."""
    vm = "3f0c6f1e-58a4-4d2a-9a57-0d1f5b0f8c21"
    old = {"uuid": vm, "alias": "web", "nics": [{"ip": "10.0.0.1"}]}
    moved = {**old, "alias": "db"}
    dns = DnsController("ws://127.0.0.1:9/changefeeds", dsn, zone="vms.example")
    pool = await asyncpg.create_pool(dsn, min_size=1, max_size=2)
    try:
        async with pool.acquire() as conn:
            await ensure_schema(conn)
            await conn.execute("TRUNCATE cns.records")
        flaky = _DiesAfterCommit(pool)
        dns._pool = flaky  # type: ignore[assignment]
        await dns._vm_changed(vm, None, old)
        flaky.armed = True
        with pytest.raises(asyncpg.ConnectionDoesNotExistError):
            await dns._vm_changed(vm, old, moved)  # committed: the table says db
        assert set(await dns.stored_records()) == {"db.vms.example"}
        assert set(dns.records()) == {"web.vms.example"}  # memory follows commits it saw
        await dns._vm_changed(vm, moved, old)  # and back: memory already says so
        expected = derive_records([old], "vms.example")
        assert dns.records() == expected
        assert await dns.stored_records() == expected
    finally:
        dns._pool = None
        await pool.close()


async def test_the_dns_controller_raises_the_error_that_stopped_it_on_exit(dsn: str) -> None:
    """A DNS controller whose registration is refused for good (a wrong token) stops;
    leaving its block says so instead of ending quietly."""
    async with VmApiServer(dsn, auth_tokens=("right",)) as api:
        dns = DnsController(api.ws_url, dsn, token="wrong", name="refused")
        with pytest.raises(RegistrationRefused):
            async with dns:
                await asyncio.sleep(0)
                await wait_until(lambda: dns._task is not None and dns._task.done(), timeout=30)
