"""The example VM API (changefeed.example.vmapi): CRUD over real HTTP on real PostgreSQL.

Each write must commit its feed entry in its own transaction (the tests
compare the feed row's transaction id with the VM row's ``xmin``), name
exactly the sub-resources that changed, and leave nothing behind when it
rolls back.
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import AsyncIterator
from typing import Any

import asyncpg
import httpx
import pytest
from servers import serve_app

from changefeed.bootstrap import Pager, fetch_many, fetch_one
from changefeed.embedded import EmbeddedPostgres
from changefeed.example.vmapi import (
    InvalidBody,
    VmChange,
    changed_sub_resources,
    create_app,
    parse_create,
    parse_patch,
)

NICS = [{"ip": "10.0.0.1"}]

# --------------------------------------------------------------------------- pure


def test_parse_create_and_patch() -> None:
    assert parse_create({"alias": "web", "nics": [{"ip": "::1"}]}) == ("web", [{"ip": "::1"}])
    assert parse_create({"alias": "web", "nics": [{"ip": "::0001"}]})[1] == [{"ip": "::1"}]
    assert parse_patch({}) == VmChange()
    assert parse_patch({"nics": []}) == VmChange(nics=[])
    bad = [
        [],
        {"alias": "x"},
        {"nics": []},
        {"alias": 5, "nics": []},
        {"alias": "", "nics": []},
        {"alias": "x" * 256, "nics": []},
        {"alias": "x", "nics": {}},
        {"alias": "x", "nics": [{"ip": "300.1.1.1"}]},
        {"alias": "x", "nics": [{"ip": 1}]},
        {"alias": "x", "nics": [{"ip": "10.0.0.1", "mac": "x"}]},
        {"alias": "x", "nics": [], "uuid": str(uuid.uuid4())},
    ]
    for doc in bad:
        with pytest.raises(InvalidBody):
            parse_create(doc)
    with pytest.raises(InvalidBody):
        parse_patch({"owner": "x"})


def test_changed_sub_resources() -> None:
    assert changed_sub_resources("a", NICS, VmChange()) == []
    assert changed_sub_resources("a", NICS, VmChange(alias="a", nics=NICS)) == []
    assert changed_sub_resources("a", NICS, VmChange(alias="b")) == ["alias"]
    assert changed_sub_resources("a", NICS, VmChange(nics=[])) == ["nic"]
    assert changed_sub_resources("a", NICS, VmChange(alias="b", nics=[])) == ["alias", "nic"]


# --------------------------------------------------------------------------- over HTTP


@contextlib.asynccontextmanager
async def vmapi(dsn: str, **options: Any) -> AsyncIterator[tuple[httpx.AsyncClient, Any]]:
    app = create_app(dsn, poll_interval=0.05, **options)
    async with serve_app(app) as server, httpx.AsyncClient(base_url=server.url) as client:
        yield client, app


async def feed_rows(conn: asyncpg.Connection) -> list[tuple[str, list[str], str, int]]:
    rows = await conn.fetch(
        "SELECT resource, sub_resources, changed_resource_id, txid::text::bigint AS txid"
        " FROM changefeed.feed ORDER BY txid, id"
    )
    return [(r["resource"], r["sub_resources"], r["changed_resource_id"], r["txid"]) for r in rows]


async def row_xmin(conn: asyncpg.Connection, vm: str) -> int:
    return int(await conn.fetchval("SELECT xmin::text::bigint FROM vmapi.vms WHERE uuid = $1", vm))


async def test_crud_publishes_each_change_in_its_transaction(dsn: str) -> None:
    async with vmapi(dsn) as (client, _):
        conn = await asyncpg.connect(dsn)
        try:
            created = await client.post("/vms", json={"alias": "web", "nics": NICS})
            assert created.status_code == 201
            vm = created.json()
            assert set(vm) == {"uuid", "alias", "nics"} and vm["alias"] == "web"
            vm_id = vm["uuid"]
            assert (await client.get(f"/vms/{vm_id}")).json() == vm
            rows = await feed_rows(conn)
            assert [r[:3] for r in rows] == [("vm", [], vm_id)]
            # Same transaction: the feed row's xid8 is the VM row's xmin (mod 2^32).
            assert rows[-1][3] % 2**32 == await row_xmin(conn, vm_id)

            async def patch(body: dict[str, Any]) -> list[str] | None:
                before = len(await feed_rows(conn))
                response = await client.patch(f"/vms/{vm_id}", json=body)
                assert response.status_code == 200, response.text
                after = await feed_rows(conn)
                assert len(after) in (before, before + 1)
                if len(after) == before:
                    return None
                resource, subs, changed, txid = after[-1]
                assert (resource, changed) == ("vm", vm_id)
                assert txid % 2**32 == await row_xmin(conn, vm_id)
                return sorted(subs)

            assert await patch({"alias": "web-1"}) == ["alias"]
            assert await patch({"nics": [{"ip": "10.0.0.2"}]}) == ["nic"]
            assert await patch({"alias": "web-2", "nics": []}) == ["alias", "nic"]
            assert await patch({"alias": "web-2"}) is None  # no-op: nothing published
            assert await patch({"alias": "web-2", "nics": []}) is None
            assert await patch({}) is None
            current = (await client.get(f"/vms/{vm_id}")).json()
            assert current == {"uuid": vm_id, "alias": "web-2", "nics": []}

            deleted = await client.delete(f"/vms/{vm_id}")
            assert deleted.status_code == 204
            assert (await feed_rows(conn))[-1][:3] == ("vm", [], vm_id)
            gone = await client.get(f"/vms/{vm_id}")
            assert gone.status_code == 404 and gone.json()["error"]["code"] == "not_found"
            for method in ("PATCH", "DELETE"):
                response = await client.request(method, f"/vms/{vm_id}", json={"alias": "x"})
                assert response.status_code == 404, method
            assert len(await feed_rows(conn)) == 5
        finally:
            await conn.close()


async def test_rolled_back_write_leaves_no_feed_entry(dsn: str) -> None:
    async with vmapi(dsn) as (client, _):
        conn = await asyncpg.connect(dsn)
        try:
            vm = (await client.post("/vms", json={"alias": "keep", "nics": NICS})).json()
            # Fail every feed append, i.e. *after* the VM row was written.
            await conn.execute(
                """
                CREATE FUNCTION public.refuse() RETURNS trigger LANGUAGE plpgsql AS
                $$ BEGIN RAISE EXCEPTION 'injected failure'; END $$;
                CREATE TRIGGER refuse BEFORE INSERT ON changefeed.feed
                    FOR EACH ROW EXECUTE FUNCTION public.refuse();
                """
            )
            failed = await client.post("/vms", json={"alias": "lost", "nics": NICS})
            assert failed.status_code == 500
            assert failed.json()["error"]["code"] == "internal"
            patched = await client.patch(f"/vms/{vm['uuid']}", json={"alias": "renamed"})
            assert patched.status_code == 500
            assert (await client.delete(f"/vms/{vm['uuid']}")).status_code == 500

            assert await conn.fetchval("SELECT count(*) FROM vmapi.vms WHERE alias = 'lost'") == 0
            assert (await client.get(f"/vms/{vm['uuid']}")).json() == vm  # unchanged, present
            assert [r[:3] for r in await feed_rows(conn)] == [("vm", [], vm["uuid"])]

            await conn.execute("DROP TRIGGER refuse ON changefeed.feed")
            assert (await client.post("/vms", json={"alias": "ok", "nics": []})).status_code == 201
            assert len(await feed_rows(conn)) == 2
        finally:
            await conn.close()


async def test_bad_requests_are_refused_clearly(dsn: str) -> None:
    async with vmapi(dsn, max_body_bytes=1024) as (client, _):
        vm = (await client.post("/vms", json={"alias": "a", "nics": NICS})).json()
        cases: list[tuple[str, str, Any]] = [
            ("POST", "/vms", {"alias": 1, "nics": []}),
            ("POST", "/vms", {"alias": "a"}),
            ("POST", "/vms", {"alias": "a", "nics": [], "color": "red"}),
            ("POST", "/vms", {"alias": "a", "nics": [{"ip": "nope"}]}),
            ("POST", "/vms", ["alias"]),
            ("PATCH", f"/vms/{vm['uuid']}", {"nics": "10.0.0.1"}),
            ("PATCH", f"/vms/{vm['uuid']}", {"uuid": str(uuid.uuid4())}),
            ("PATCH", "/vms/not-a-uuid", {"alias": "b"}),
            ("DELETE", "/vms/not-a-uuid", None),
            ("GET", "/vms/not-a-uuid", None),
            ("GET", "/vms?limit=0", None),
            ("GET", "/vms?after=forged", None),
            ("GET", "/vms?ids=nope", None),
        ]
        for method, path, body in cases:
            response = await client.request(method, path, json=body)
            assert response.status_code == 400, (method, path, response.text)
            assert response.json()["error"]["code"] == "bad_request", (method, path)
        broken = await client.post("/vms", content=b'{"alias": ', headers={"content-type": "x"})
        assert broken.status_code == 400 and "JSON" in broken.json()["error"]["message"]
        large = {"alias": "a", "nics": [{"ip": "10.0.0.1"}] * 30, "pad": "x" * 2000}
        too_large = await client.post("/vms", json=large)
        assert too_large.status_code == 413
        assert too_large.json()["error"]["code"] == "too_large"

        async def chunks() -> AsyncIterator[bytes]:
            for _ in range(10):
                yield b" " * 200  # no Content-Length: counted while read

        streamed = await client.post("/vms", content=chunks())
        assert streamed.status_code == 413
        assert (await client.put("/vms", json={})).status_code == 405


async def test_bearer_token_guards_every_route(dsn: str) -> None:
    async with vmapi(dsn, auth_tokens=("s3cret",)) as (client, _):
        for method, path in (("GET", "/vms"), ("POST", "/vms"), ("GET", f"/vms/{uuid.uuid4()}")):
            response = await client.request(method, path, json={"alias": "a", "nics": []})
            assert response.status_code == 401, (method, path)
            assert response.json()["error"]["code"] == "unauthorized"
        auth = {"Authorization": "Bearer s3cret"}
        created = await client.post("/vms", json={"alias": "a", "nics": []}, headers=auth)
        assert created.status_code == 201
        items = [vm async for vm in Pager(client, "/vms", token="s3cret")]
        assert items == [created.json()]
        assert await fetch_one(client, "/vms", created.json()["uuid"], token="s3cret")
        resources = await client.get("/changefeeds", headers=auth)
        assert resources.json()["resources"] == [
            {"resource": "vm", "subResources": ["nic", "alias"], "bootstrapRoute": "/vms"}
        ]


async def test_database_down_is_a_clean_503(
    dsn: str, restartable_pg_server: EmbeddedPostgres
) -> None:
    async with vmapi(dsn) as (client, _):
        vm = (await client.post("/vms", json={"alias": "a", "nics": NICS})).json()
        restartable_pg_server.stop()
        try:
            for method, path, body in (
                ("GET", "/vms", None),
                ("GET", f"/vms/{vm['uuid']}", None),
                ("GET", f"/vms?ids={vm['uuid']}", None),
                ("POST", "/vms", {"alias": "b", "nics": []}),
                ("PATCH", f"/vms/{vm['uuid']}", {"alias": "c"}),
                ("DELETE", f"/vms/{vm['uuid']}", None),
            ):
                response = await client.request(method, path, json=body)
                assert response.status_code == 503, (method, path, response.text)
                assert response.json()["error"]["code"] == "unavailable"
                assert response.headers["retry-after"] == "1"
        finally:
            restartable_pg_server.start()
        # Back: the pool reconnects by itself.
        assert (await client.get(f"/vms/{vm['uuid']}")).json() == vm


async def test_thousand_vms_walk_through_the_bootstrap_route(dsn: str) -> None:
    async with vmapi(dsn) as (client, app):
        conn = await asyncpg.connect(dsn)
        try:
            await conn.execute(
                "INSERT INTO vmapi.vms (uuid, alias, nics)"
                " SELECT gen_random_uuid(), 'vm-' || i, jsonb_build_array("
                "  jsonb_build_object('ip', '10.0.' || (i / 256) || '.' || (i % 256)))"
                " FROM generate_series(1, 1000) AS i"
            )
            expected = {
                str(r["uuid"]): r["alias"]
                for r in await conn.fetch("SELECT uuid, alias FROM vmapi.vms")
            }
        finally:
            await conn.close()
        pager = Pager(client, "/vms", limit=100)
        walked = [vm async for vm in pager]
        assert [vm["uuid"] for vm in walked] == sorted(expected)  # key order, once each
        assert {vm["uuid"]: vm["alias"] for vm in walked} == expected
        assert pager.progress.pages == 10 and pager.progress.items == 1000
        first = walked[0]
        assert first["nics"][0]["ip"].startswith("10.0.")
        # Filters, the batch form and the per-id route agree with the walk.
        same_alias = [vm async for vm in Pager(client, f"/vms?alias={first['alias']}")]
        assert same_alias == [first]
        wanted = [vm["uuid"] for vm in walked[::4]]
        found = await fetch_many(client, "/vms", [*wanted, str(uuid.uuid4())])
        assert found == {vm["uuid"]: vm for vm in walked[::4]}
        assert await fetch_one(client, "/vms", first["uuid"]) == first
        await client.delete(f"/vms/{first['uuid']}")
        assert await fetch_one(client, "/vms", first["uuid"]) is None
        stats = app.state.vmapi.vms.stats()
        assert stats["walksFinished"] == 2 and stats["walksActive"] == 0
