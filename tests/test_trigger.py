"""publish_row: a table that publishes its own changes (schema migration 3).

Real PostgreSQL; the end-to-end test adds a real publisher and listener.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import asyncpg
import pytest
from publisher_fixtures import receive_items, register, registration, running_publisher

from changefeed.publisher import FeedReader, install_trigger
from changefeed.schemas import ORIGIN

VMS = (
    "CREATE TABLE vms (uuid text PRIMARY KEY, alias text, state text NOT NULL DEFAULT 'running');"
    " CREATE TABLE nics (mac text PRIMARY KEY, vm_uuid text NOT NULL REFERENCES vms, ip text)"
)


async def _entries(conn: asyncpg.Connection) -> list[tuple[str, list[str], str]]:
    rows = await conn.fetch(
        "SELECT resource, sub_resources, changed_resource_id FROM changefeed.feed ORDER BY txid, id"
    )
    return [(r["resource"], list(r["sub_resources"]), r["changed_resource_id"]) for r in rows]


@pytest.fixture
async def vms(feed_dsn: str) -> AsyncIterator[asyncpg.Connection]:
    """An API's tables that publish their rows as "vm" entries: a VM's own row is
    the whole VM, its alias column the "alias" sub-resource, a NIC row "nic"."""
    conn = await asyncpg.connect(feed_dsn)
    await conn.execute(VMS)
    await install_trigger(conn, "vms", "vm", "uuid")
    await install_trigger(conn, "vms", "vm", "uuid", ["alias"], columns=["alias"])
    await install_trigger(conn, "public.nics", "vm", "vm_uuid", ["nic"])
    yield conn
    await conn.close()


async def test_each_row_change_appends_its_entry_in_the_writers_transaction(
    vms: asyncpg.Connection,
) -> None:
    await vms.execute("INSERT INTO vms (uuid) VALUES ('a'), ('b')")
    await vms.execute("UPDATE vms SET state = 'stopped' WHERE uuid = 'a'")
    await vms.execute("UPDATE vms SET alias = 'web' WHERE uuid = 'b'")
    await vms.execute("UPDATE vms SET state = state")  # changes nothing: publishes nothing
    await vms.execute("INSERT INTO nics VALUES ('m1', 'a', '10.0.0.1'), ('m2', 'a', NULL)")
    await vms.execute("UPDATE nics SET ip = '10.0.0.9' WHERE mac = 'm2'")
    await vms.execute("DELETE FROM nics WHERE mac = 'm1'")
    with pytest.raises(RuntimeError):
        async with vms.transaction():
            await vms.execute("UPDATE vms SET state = 'gone' WHERE uuid = 'b'")
            raise RuntimeError("the API's write failed")
    async with vms.transaction():
        savepoint = vms.transaction()
        await savepoint.start()
        await vms.execute("DELETE FROM nics")
        await savepoint.rollback()
        await vms.execute("DELETE FROM vms WHERE uuid = 'b'")

    assert await _entries(vms) == [
        ("vm", [], "a"),
        ("vm", [], "b"),
        ("vm", [], "a"),
        # Both of vms's triggers fire for an UPDATE that sets alias, in name order.
        ("vm", ["alias"], "b"),
        ("vm", [], "b"),
        ("vm", ["nic"], "a"),
        ("vm", ["nic"], "a"),
        ("vm", ["nic"], "a"),
        ("vm", ["nic"], "a"),
        ("vm", [], "b"),  # what the savepoint's rollback left committed
    ]


async def test_the_entry_is_final_and_read_in_feed_order(
    feed_dsn: str, vms: asyncpg.Connection
) -> None:
    """Entries a trigger appends are ordinary feed entries: the tailer's read sees
    none of them while the API's transaction is open, then all, in feed order."""
    reader = await asyncpg.connect(feed_dsn)
    try:
        async with vms.transaction():
            await vms.execute(
                "INSERT INTO vms (uuid) SELECT 'vm-' || n FROM generate_series(1, 50) n"
            )
            await vms.execute("UPDATE vms SET alias = 'x' WHERE uuid IN ('vm-3', 'vm-7')")
            assert await FeedReader().read_after(reader, ORIGIN, 1000) == []
        entries = await FeedReader().read_after(reader, ORIGIN, 1000)
    finally:
        await reader.close()
    assert [e.changed_resource_id for e in entries[:50]] == [f"vm-{n}" for n in range(1, 51)]
    assert [(e.changed_resource_id, e.sub_resources) for e in entries[50:]] == [
        ("vm-3", ("alias",)),
        ("vm-3", ()),
        ("vm-7", ("alias",)),
        ("vm-7", ()),
    ]


async def test_bad_trigger_setups_are_clear_errors(feed_dsn: str) -> None:
    conn = await asyncpg.connect(feed_dsn)
    try:
        await conn.execute(VMS)
        with pytest.raises(asyncpg.UndefinedTableError):
            await install_trigger(conn, "no_such_table", "vm", "uuid")
        with pytest.raises(asyncpg.UndefinedColumnError):
            await install_trigger(conn, "vms", "vm", "uuid", ["alias"], columns=["no_such_column"])
        with pytest.raises(ValueError, match="must not be empty"):
            await install_trigger(conn, "vms", "", "uuid")
        # A table name is never spliced into SQL as given.
        with pytest.raises(asyncpg.PostgresError):
            await install_trigger(conn, "vms; DROP TABLE vms", "vm", "uuid")
        assert await conn.fetchval("SELECT to_regclass('vms') IS NOT NULL")

        await install_trigger(conn, "vms", "vm", "no_such_column")
        with pytest.raises(asyncpg.RaiseError, match="no id in column no_such_column"):
            await conn.execute("INSERT INTO vms (uuid) VALUES ('a')")
        # The failed write left nothing behind, and the table takes writes again
        # once the trigger is right (replaced under the same name).
        await install_trigger(conn, "vms", "vm", "uuid")
        await conn.execute("INSERT INTO vms (uuid) VALUES ('a')")
        assert await _entries(conn) == [("vm", [], "a")]
    finally:
        await conn.close()


async def test_a_listener_gets_what_the_api_table_publishes(
    feed_dsn: str, vms: asyncpg.Connection
) -> None:
    """End to end: the API only writes its own tables; the listener of vm/nic gets
    the new VM, its NIC, and the VM's deletion, and not the alias change."""
    async with running_publisher(feed_dsn) as pub:
        ws, ack = await register(pub.ws_url, registration(subs=["nic"]))
        assert ack["resumed"] is False
        try:
            await vms.execute("INSERT INTO vms (uuid) VALUES ('vm-1')")
            await vms.execute("UPDATE vms SET alias = 'web' WHERE uuid = 'vm-1'")
            await vms.execute("INSERT INTO nics VALUES ('m1', 'vm-1', '10.0.0.2')")
            await vms.execute("DELETE FROM nics; DELETE FROM vms")
            items = await receive_items(ws, 5)
        finally:
            await ws.close()
    assert [(i["changedResourceId"], i["changeKind"]["subResources"]) for i in items] == [
        ("vm-1", []),
        ("vm-1", []),  # the whole-row trigger's entry for the alias UPDATE
        ("vm-1", ["nic"]),
        ("vm-1", ["nic"]),
        ("vm-1", []),
    ]
