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
    NewVm,
    VmChange,
    changed_sub_resources,
    create_app,
    parse_create,
    parse_patch,
)
from changefeed.schemas.validation import MESSAGE_LIMIT

NICS = [{"ip": "10.0.0.1"}]

# --------------------------------------------------------------------------- pure


def test_parse_create_and_patch() -> None:
    assert parse_create({"alias": "web", "nics": [{"ip": "::1"}]}) == NewVm("web", [{"ip": "::1"}])
    assert parse_create({"alias": "web", "nics": [{"ip": "::0001"}]}).nics == [{"ip": "::1"}]
    server = str(uuid.uuid4())
    placed = parse_create({"alias": "a", "nics": [], "server_uuid": server.upper()})
    assert placed == NewVm("a", [], server)
    assert parse_create({"alias": "a", "nics": [], "server_uuid": None}).server_uuid is None
    assert parse_patch({}) == VmChange()
    assert parse_patch({"nics": []}) == VmChange(nics=[])
    assert parse_patch({"server_uuid": server}) == VmChange(server_uuid=server)
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
        {"alias": "x", "nics": [], "server_uuid": "cn-1"},
        {"alias": "x", "nics": [], "server_uuid": 7},
    ]
    for doc in bad:
        with pytest.raises(InvalidBody):
            parse_create(doc)
    for doc in ({"owner": "x"}, {"server_uuid": None}, {"server_uuid": "nope"}):
        with pytest.raises(InvalidBody):
            parse_patch(doc)


def test_changed_sub_resources() -> None:
    assert changed_sub_resources("a", NICS, VmChange()) == []
    assert changed_sub_resources("a", NICS, VmChange(alias="a", nics=NICS)) == []
    assert changed_sub_resources("a", NICS, VmChange(alias="b")) == ["alias"]
    assert changed_sub_resources("a", NICS, VmChange(nics=[])) == ["nic"]
    assert changed_sub_resources("a", NICS, VmChange(alias="b", nics=[])) == ["alias", "nic"]
    server, other = str(uuid.uuid4()), str(uuid.uuid4())
    assert changed_sub_resources("a", NICS, VmChange(server_uuid=server), server) == []
    assert changed_sub_resources("a", NICS, VmChange(server_uuid=server), other) == ["server"]
    assert changed_sub_resources("a", NICS, VmChange(server_uuid=server)) == ["server"]


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
            assert vm["alias"] == "web" and vm["server_uuid"] is None
            assert set(vm) == {"uuid", "alias", "nics", "server_uuid"}
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
            assert current == {"uuid": vm_id, "alias": "web-2", "nics": [], "server_uuid": None}

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
        broken = await client.post(
            "/vms", content=b'{"alias": ', headers={"content-type": "application/json"}
        )
        assert broken.status_code == 400 and "JSON" in broken.json()["error"]["message"]
        large = {"alias": "a", "nics": [{"ip": "10.0.0.1"}] * 30, "pad": "x" * 2000}
        too_large = await client.post("/vms", json=large)
        assert too_large.status_code == 413
        assert too_large.json()["error"]["code"] == "too_large"

        async def chunks() -> AsyncIterator[bytes]:
            for _ in range(10):
                yield b" " * 200  # no Content-Length: counted while read

        streamed = await client.post(
            "/vms", content=chunks(), headers={"content-type": "application/json"}
        )
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
            {
                "resource": "vm",
                "subResources": ["nic", "alias", "server"],
                "bootstrapRoute": "/vms",
            },
            {
                "resource": "server",
                "subResources": ["hostname", "status", "ram"],
                "bootstrapRoute": "/servers",
            },
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


async def test_nul_in_any_text_is_a_400_and_writes_nothing(dsn: str) -> None:
    # PostgreSQL text cannot hold U+0000: without the check the write fails with a 500.
    async with vmapi(dsn) as (client, _):
        vm = (await client.post("/vms", json={"alias": "a", "nics": NICS})).json()
        server = {"hostname": "cn-1", "ram": 1024, "datacenter": "dc-1"}
        cases: list[tuple[str, str, Any]] = [
            ("POST", "/vms", {"alias": "web\u0000", "nics": []}),
            ("POST", "/vms", {"alias": "web", "nics": [], "x\u0000": 1}),
            ("PATCH", f"/vms/{vm['uuid']}", {"alias": "\u0000"}),
            ("PATCH", f"/vms/{vm['uuid']}", {"nics": [{"ip": "10.0.0.1\u0000"}]}),
            ("POST", "/servers", {**server, "hostname": "cn\u00001"}),
            ("POST", "/servers", {**server, "datacenter": "\u0000"}),
            ("GET", "/vms?alias=web%00", None),
            ("GET", f"/vms?ids={vm['uuid']}%00", None),
            ("GET", "/servers?hostname=cn%00", None),
        ]
        for method, path, body in cases:
            response = await client.request(method, path, json=body)
            assert response.status_code == 400, (method, path, response.text)
            error = response.json()["error"]
            assert error["code"] == "bad_request" and "NUL" in error["message"], (path, error)
        conn = await asyncpg.connect(dsn)
        try:
            assert [r[:3] for r in await feed_rows(conn)] == [("vm", [], vm["uuid"])]
        finally:
            await conn.close()
        assert (await client.get(f"/vms/{vm['uuid']}")).json() == vm


async def test_writes_take_only_json_so_a_browser_form_cannot_make_them(dsn: str) -> None:
    body = b'{"alias": "csrf", "nics": []}'
    async with vmapi(dsn) as (client, _):
        vm = (await client.post("/vms", json={"alias": "a", "nics": NICS})).json()
        refused = [
            "text/plain",
            "text/plain; charset=utf-8",
            "application/x-www-form-urlencoded",
            "multipart/form-data; boundary=x",
            "application/json; charset=latin-1",
            "application/jsonp",
            None,
        ]
        for content_type in refused:
            headers = {"content-type": content_type} if content_type else {}
            for method, path in (("POST", "/vms"), ("PATCH", f"/vms/{vm['uuid']}")):
                response = await client.request(method, path, content=body, headers=headers)
                assert response.status_code == 415, (method, content_type, response.text)
                assert response.json()["error"]["code"] == "unsupported_media_type"
            response = await client.post("/servers", content=b"{}", headers=headers)
            assert response.status_code == 415, content_type
        aliases = [v["alias"] async for v in Pager(client, "/vms")]
        assert aliases == ["a"]
        for content_type in ("application/json", "Application/JSON; charset=UTF-8"):
            headers = {"content-type": content_type}
            created = await client.post("/vms", content=body, headers=headers)
            assert created.status_code == 201, (content_type, created.text)
        # DELETE has no body: it needs no Content-Type (no form can send one).
        assert (await client.delete(f"/vms/{vm['uuid']}")).status_code == 204
    async with vmapi(dsn, auth_tokens=("s3cret",)) as (client, _):
        # The token is checked first: no hint about the API to an unauthenticated caller.
        response = await client.post("/vms", content=body, headers={"content-type": "text/plain"})
        assert response.status_code == 401


async def test_refusals_echo_a_bounded_part_of_the_input(dsn: str) -> None:
    """A 60 KB value, key, header or query parameter is refused without being sent
    back whole in the error body (at most MESSAGE_LIMIT characters of message)."""
    huge = "q" * 60_000
    async with vmapi(dsn) as (client, _):
        vm = (await client.post("/vms", json={"alias": "a", "nics": NICS})).json()
        json_bodies = [
            ("POST", "/vms", {"alias": "a", "nics": [{"ip": huge}]}),
            ("POST", "/vms", {"alias": "a", "nics": [], huge: 1}),
            ("PATCH", f"/vms/{vm['uuid']}", {"server_uuid": huge}),
            ("POST", "/servers", {"hostname": "h", "ram": 1, "datacenter": "x", "status": huge}),
        ]
        refusals = [await client.request(m, path, json=body) for m, path, body in json_bodies]
        refusals += [
            await client.get(f"/vms?limit={'9' * 6_000}"),
            await client.get(f"/vms/{'q' * 6_000}"),
            await client.get(f"/vms?{'q' * 6_000}=1"),
            await client.post("/vms", content=b"{}", headers={"content-type": "text/" + huge}),
        ]
        for response in refusals:
            assert response.status_code in (400, 415), response.text[:200]
            message = response.json()["error"]["message"]
            assert len(message) <= MESSAGE_LIMIT, (response.request.url, len(message))


async def test_a_vm_points_at_its_server_and_a_migration_is_its_own_change(dsn: str) -> None:
    async with vmapi(dsn) as (client, _):
        conn = await asyncpg.connect(dsn)
        try:
            servers = []
            for name in ("cn-1", "cn-2"):
                body: dict[str, Any] = {"hostname": name, "ram": 4096, "datacenter": "dc-1"}
                servers.append((await client.post("/servers", json=body)).json()["uuid"])
            cn1, cn2 = servers
            created = await client.post("/vms", json={"alias": "a", "nics": [], "server_uuid": cn1})
            assert created.status_code == 201, created.text
            vm = created.json()
            assert vm["server_uuid"] == cn1
            assert (await client.get(f"/vms/{vm['uuid']}")).json() == vm
            assert [v["uuid"] async for v in Pager(client, f"/vms?server_uuid={cn1}")] == [
                vm["uuid"]
            ]
            before = len(await feed_rows(conn))
            moved = await client.patch(f"/vms/{vm['uuid']}", json={"server_uuid": cn2})
            assert moved.status_code == 200 and moved.json()["server_uuid"] == cn2
            rows = await feed_rows(conn)
            assert len(rows) == before + 1
            assert rows[-1][:3] == ("vm", ["server"], vm["uuid"])
            assert rows[-1][3] % 2**32 == await row_xmin(conn, vm["uuid"])
            again = await client.patch(f"/vms/{vm['uuid']}", json={"server_uuid": cn2})
            assert again.status_code == 200 and len(await feed_rows(conn)) == before + 1

            # A server the API does not hold: refused by the foreign key, nothing written.
            missing = str(uuid.uuid4())
            for method, path, body in (
                ("POST", "/vms", {"alias": "b", "nics": [], "server_uuid": missing}),
                ("PATCH", f"/vms/{vm['uuid']}", {"server_uuid": missing}),
                ("PATCH", f"/vms/{vm['uuid']}", {"alias": "renamed", "server_uuid": missing}),
            ):
                response = await client.request(method, path, json=body)
                assert response.status_code == 422, (method, body, response.text)
                assert response.json()["error"]["code"] == "unknown_server"
                assert missing in response.json()["error"]["message"]
            assert len(await feed_rows(conn)) == before + 1
            assert (await client.get(f"/vms/{vm['uuid']}")).json() == moved.json()
            unplace = await client.patch(f"/vms/{vm['uuid']}", json={"server_uuid": None})
            assert unplace.status_code == 400
        finally:
            await conn.close()


async def test_an_api_made_before_servers_existed_gains_the_column(dsn: str) -> None:
    conn = await asyncpg.connect(dsn)
    try:
        await conn.execute(
            "CREATE SCHEMA vmapi; CREATE TABLE vmapi.vms (uuid uuid PRIMARY KEY,"
            " alias text NOT NULL, nics jsonb NOT NULL DEFAULT '[]',"
            " created timestamptz NOT NULL DEFAULT now(),"
            " updated timestamptz NOT NULL DEFAULT now());"
            " INSERT INTO vmapi.vms (uuid, alias) VALUES (gen_random_uuid(), 'old')"
        )
    finally:
        await conn.close()
    async with vmapi(dsn) as (client, _):
        (old,) = [vm async for vm in Pager(client, "/vms")]
        assert old["alias"] == "old" and old["server_uuid"] is None
        server = await client.post(
            "/servers", json={"hostname": "cn-1", "ram": 1, "datacenter": "dc"}
        )
        moved = await client.patch(
            f"/vms/{old['uuid']}", json={"server_uuid": server.json()["uuid"]}
        )
        assert moved.status_code == 200, moved.text
