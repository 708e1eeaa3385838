"""The example API's servers (changefeed.example.servers): CRUD over real HTTP on real
PostgreSQL, on the same feed as the VMs.

Each write must commit its feed entry in its own transaction (the feed row's
transaction id is the server row's ``xmin``), name exactly the fields that
changed, and a server that still hosts VMs must not be deletable.
"""

from __future__ import annotations

import contextlib
import random
import uuid
from collections.abc import AsyncIterator
from typing import Any

import asyncpg
import httpx
import pytest
from helpers import wait_until
from servers import serve_app

from changefeed.bootstrap import Pager, fetch_many
from changefeed.example.servers import (
    MAX_RAM_MIB,
    NewServer,
    ServerChange,
    changed_server_fields,
    parse_server_create,
    parse_server_patch,
)
from changefeed.example.vmapi import create_app
from changefeed.listener import BackoffPolicy, Controller, Listener, ListenerConfig
from changefeed.schemas import ChangeKind

SERVER = {"hostname": "cn-1", "ram": 262144, "datacenter": "us-east-1"}

# --------------------------------------------------------------------------- pure


def test_parse_server_bodies() -> None:
    assert parse_server_create(SERVER) == NewServer("cn-1", 262144, "us-east-1")
    given = str(uuid.uuid4())
    full = parse_server_create({**SERVER, "status": "running", "uuid": given})
    assert full == NewServer("cn-1", 262144, "us-east-1", "running", uuid.UUID(given))
    assert parse_server_patch({}) == ServerChange()
    assert parse_server_patch({"status": "unavailable", "ram": 1}) == ServerChange(
        status="unavailable", ram=1
    )
    bad_creates: list[Any] = [
        [],
        {"hostname": "cn-1", "ram": 1},
        {**SERVER, "hostname": "-cn"},
        {**SERVER, "hostname": "cn_1"},
        {**SERVER, "hostname": "a" * 64},
        {**SERVER, "hostname": 5},
        {**SERVER, "ram": 0},
        {**SERVER, "ram": MAX_RAM_MIB + 1},
        {**SERVER, "ram": 1.5},
        {**SERVER, "ram": True},
        {**SERVER, "ram": "1024"},
        {**SERVER, "datacenter": "US-East"},
        {**SERVER, "status": "on fire"},
        {**SERVER, "uuid": "cn-1"},
        {**SERVER, "vms": []},
    ]
    for doc in bad_creates:
        with pytest.raises(ValueError):
            parse_server_create(doc)
    for doc in ({"datacenter": "eu"}, {"uuid": given}, {"status": None}, {"owner": "x"}):
        with pytest.raises(ValueError):
            parse_server_patch(doc)


def test_changed_server_fields() -> None:
    current = {"hostname": "cn-1", "status": "running", "ram": 1024}
    assert changed_server_fields(current, ServerChange()) == []
    assert changed_server_fields(current, ServerChange("cn-1", "running", 1024)) == []
    assert changed_server_fields(current, ServerChange(status="unavailable")) == ["status"]
    assert changed_server_fields(current, ServerChange("cn-2", ram=2048)) == ["hostname", "ram"]


# --------------------------------------------------------------------------- over HTTP


@contextlib.asynccontextmanager
async def example_api(dsn: str, **options: Any) -> AsyncIterator[tuple[httpx.AsyncClient, Any]]:
    app = create_app(dsn, poll_interval=0.05, **options)
    async with serve_app(app) as server, httpx.AsyncClient(base_url=server.url) as client:
        yield client, app


async def feed_rows(conn: asyncpg.Connection) -> list[tuple[str, list[str], str, int]]:
    rows = await conn.fetch(
        "SELECT resource, sub_resources, changed_resource_id, txid::text::bigint AS txid"
        " FROM changefeed.feed ORDER BY txid, id"
    )
    return [(r["resource"], r["sub_resources"], r["changed_resource_id"], r["txid"]) for r in rows]


async def server_xmin(conn: asyncpg.Connection, server: str) -> int:
    return int(
        await conn.fetchval("SELECT xmin::text::bigint FROM vmapi.servers WHERE uuid = $1", server)
    )


async def test_crud_publishes_each_change_in_its_transaction(dsn: str) -> None:
    async with example_api(dsn) as (client, _):
        conn = await asyncpg.connect(dsn)
        try:
            created = await client.post("/servers", json=SERVER)
            assert created.status_code == 201, created.text
            server = created.json()
            assert server == {**SERVER, "uuid": server["uuid"], "status": "unknown"}
            server_id = server["uuid"]
            assert (await client.get(f"/servers/{server_id}")).json() == server
            rows = await feed_rows(conn)
            assert [r[:3] for r in rows] == [("server", [], server_id)]
            assert rows[-1][3] % 2**32 == await server_xmin(conn, server_id)

            async def patch(body: dict[str, Any]) -> list[str] | None:
                before = len(await feed_rows(conn))
                response = await client.patch(f"/servers/{server_id}", json=body)
                assert response.status_code == 200, response.text
                after = await feed_rows(conn)
                if len(after) == before:
                    return None
                assert len(after) == before + 1
                resource, subs, changed, txid = after[-1]
                assert (resource, changed) == ("server", server_id)
                assert txid % 2**32 == await server_xmin(conn, server_id)
                return sorted(subs)

            assert await patch({"status": "running"}) == ["status"]
            assert await patch({"hostname": "cn-1b"}) == ["hostname"]
            assert await patch({"ram": 131072, "status": "unavailable"}) == ["ram", "status"]
            assert await patch({"ram": 131072, "status": "unavailable"}) is None
            assert await patch({}) is None
            current = (await client.get(f"/servers/{server_id}")).json()
            expected = {"hostname": "cn-1b", "status": "unavailable", "ram": 131072}
            assert current == {**server, **expected}

            assert (await client.delete(f"/servers/{server_id}")).status_code == 204
            assert (await feed_rows(conn))[-1][:3] == ("server", [], server_id)
            assert (await client.get(f"/servers/{server_id}")).status_code == 404
            for method in ("PATCH", "DELETE"):
                response = await client.request(method, f"/servers/{server_id}", json={})
                assert response.status_code == 404, method
                assert response.json()["error"]["code"] == "not_found"
            assert len(await feed_rows(conn)) == 5
        finally:
            await conn.close()


async def test_a_server_is_created_with_its_hardware_uuid_once(dsn: str) -> None:
    async with example_api(dsn) as (client, _):
        given = str(uuid.uuid4())
        first = await client.post("/servers", json={**SERVER, "uuid": given})
        assert first.status_code == 201 and first.json()["uuid"] == given
        again = await client.post("/servers", json={**SERVER, "uuid": given.upper()})
        assert again.status_code == 409 and again.json()["error"]["code"] == "conflict"
        assert [s["uuid"] async for s in Pager(client, "/servers")] == [given]


async def test_a_server_hosting_vms_cannot_be_deleted(dsn: str) -> None:
    async with example_api(dsn) as (client, _):
        conn = await asyncpg.connect(dsn)
        try:
            cn1 = (await client.post("/servers", json=SERVER)).json()["uuid"]
            cn2 = (await client.post("/servers", json={**SERVER, "hostname": "cn-2"})).json()
            vms = [
                (
                    await client.post(
                        "/vms", json={"alias": f"vm-{n}", "nics": [], "server_uuid": cn1}
                    )
                ).json()["uuid"]
                for n in range(2)
            ]
            before = await feed_rows(conn)
            refused = await client.delete(f"/servers/{cn1}")
            assert refused.status_code == 409, refused.text
            error = refused.json()["error"]
            assert error["code"] == "conflict" and "2 VM" in error["message"]
            assert await feed_rows(conn) == before  # nothing published, nothing deleted
            assert (await client.get(f"/servers/{cn1}")).status_code == 200

            await client.patch(f"/vms/{vms[0]}", json={"server_uuid": cn2["uuid"]})
            await client.delete(f"/vms/{vms[1]}")
            assert (await client.delete(f"/servers/{cn1}")).status_code == 204
            assert (await feed_rows(conn))[-1][:3] == ("server", [], cn1)
            hosted = await client.delete(f"/servers/{cn2['uuid']}")
            assert hosted.status_code == 409
        finally:
            await conn.close()


async def test_bad_server_requests_are_refused_clearly(dsn: str) -> None:
    async with example_api(dsn) as (client, _):
        server = (await client.post("/servers", json=SERVER)).json()
        cases: list[tuple[str, str, Any]] = [
            ("POST", "/servers", {**SERVER, "ram": -1}),
            ("POST", "/servers", {"hostname": "cn-2"}),
            ("POST", "/servers", {**SERVER, "status": "gone"}),
            ("POST", "/servers", ["cn-2"]),
            ("PATCH", f"/servers/{server['uuid']}", {"datacenter": "eu-1"}),
            ("PATCH", f"/servers/{server['uuid']}", {"hostname": "bad host"}),
            ("PATCH", "/servers/not-a-uuid", {"status": "running"}),
            ("DELETE", "/servers/not-a-uuid", None),
            ("GET", "/servers/not-a-uuid", None),
            ("GET", "/servers?status=gone", None),
            ("GET", "/servers?owner=me", None),
        ]
        for method, path, body in cases:
            response = await client.request(method, path, json=body)
            assert response.status_code == 400, (method, path, response.text)
            assert response.json()["error"]["code"] == "bad_request", (method, path)
        assert (await client.get(f"/servers/{server['uuid']}")).json() == server


async def test_servers_walk_through_their_bootstrap_route(dsn: str) -> None:
    async with example_api(dsn) as (client, app):
        conn = await asyncpg.connect(dsn)
        try:
            await conn.execute(
                "INSERT INTO vmapi.servers (uuid, hostname, status, ram, datacenter)"
                " SELECT gen_random_uuid(), 'cn-' || i,"
                "  (ARRAY['running', 'unavailable', 'unknown'])[i % 3 + 1], 1024 * i,"
                "  'dc-' || (i % 2)"
                " FROM generate_series(1, 50) AS i"
            )
        finally:
            await conn.close()
        pager = Pager(client, "/servers", limit=7)
        walked = [server async for server in pager]
        assert [s["uuid"] for s in walked] == sorted(s["uuid"] for s in walked)
        assert len(walked) == 50 and pager.progress.pages == 8
        dc0 = [s async for s in Pager(client, "/servers?datacenter=dc-0&status=running")]
        assert dc0 == [s for s in walked if s["datacenter"] == "dc-0" and s["status"] == "running"]
        assert dc0
        wanted = [s["uuid"] for s in walked[::5]]
        assert await fetch_many(client, "/servers", wanted) == {s["uuid"]: s for s in walked[::5]}
        assert app.state.servers.servers.stats()["walksFinished"] >= 2


async def test_the_server_feed_and_the_vm_feed_are_one_feed(dsn: str) -> None:
    """A listener of ``server`` mirrors the servers from the same publisher the VM
    listeners use; changes to VMs are not sent to it."""
    async with example_api(dsn) as (client, _):
        resources = (await client.get("/changefeeds")).json()["resources"]
        assert [r["resource"] for r in resources] == ["vm", "server"]
        ids = [
            (await client.post("/servers", json={**SERVER, "hostname": f"cn-{n}"})).json()["uuid"]
            for n in range(5)
        ]
        items: list[str] = []
        ws_url = client.base_url.copy_with(scheme="ws", path="/changefeeds")
        listener = Listener(
            str(ws_url),
            instance=str(uuid.uuid4()),
            service="test",
            change_kind=ChangeKind("server", ("status",)),
            config=ListenerConfig(backoff=BackoffPolicy(initial=0.02, maximum=0.2)),
            rng=random.Random(5),
        )

        async def reconcile(server: str, old: Any, new: Any) -> None:
            items.append(server)

        controller = Controller(listener, reconcile=reconcile)
        async with controller:
            await controller.wait_synced(20)
            assert set(controller.mirror) == set(ids)
            await client.post("/vms", json={"alias": "a", "nics": [], "server_uuid": ids[0]})
            await client.patch(f"/servers/{ids[1]}", json={"status": "running"})
            await client.patch(f"/servers/{ids[2]}", json={"ram": 1})  # not a status change
            await client.delete(f"/servers/{ids[3]}")
            expected = {s["uuid"]: s async for s in Pager(client, "/servers")}
            expected[ids[2]]["ram"] = SERVER["ram"]  # the listener did not ask for ram
            await wait_until(lambda: dict(controller.mirror) == expected, 20, message="mirror")
            assert controller.mirror[ids[1]]["status"] == "running"
