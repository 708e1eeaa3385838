"""changefeed.schemas: registration frames, cursors, and the feed-table SQL."""

from __future__ import annotations

import asyncio
import string
import uuid
from datetime import UTC, datetime, timedelta
from typing import Any

import asyncpg
import orjson
import pytest
from helpers import wait_until
from hypothesis import given
from hypothesis import strategies as st

from changefeed.publisher import install_trigger
from changefeed.schemas import (
    ORIGIN,
    ChangeKind,
    Cursor,
    CursorCodec,
    CursorError,
    ForeignCursor,
    Position,
    ProtocolError,
    Registration,
    apply_schema,
    notify_channel,
    schema_version,
    stamp_of,
)
from changefeed.schemas.migrations import load_migrations

# --------------------------------------------------------------------------- registration

V1 = {
    "instance": "de1aac97-6f85-4ba9-b51e-514f48a6a46c",
    "service": "tcns",
    "changeKind": {"resource": "vm", "subResources": ["nic", "alias"]},
}

V2 = {
    "instance": "de1aac97-6f85-4ba9-b51e-514f48a6a46c",
    "service": "tcns",
    "resources": [
        {"resource": "vm", "subResources": ["nic"]},
        {"resource": "network", "subResources": []},
    ],
}


def test_registration_v1_decodes() -> None:
    reg = Registration.decode(orjson.dumps(V1))
    assert reg.instance == V1["instance"]
    assert reg.service == "tcns"
    assert reg.change_kinds == (ChangeKind("vm", ("nic", "alias")),)
    assert reg.since is None
    assert not reg.multi
    assert not reg.batch
    assert reg.to_json() == V1
    assert Registration.decode(reg.encode()) == reg


def test_registration_v1_with_since_and_batch() -> None:
    doc = {**V1, "since": CODEC.encode(Position(7, 8)), "batch": True}
    reg = Registration.decode(orjson.dumps(doc).decode())
    assert reg.since == doc["since"]
    assert reg.batch
    assert reg.to_json() == doc


def test_registration_v2_decodes() -> None:
    reg = Registration.decode(orjson.dumps(V2))
    assert reg.multi
    assert reg.change_kinds == (ChangeKind("vm", ("nic",)), ChangeKind("network", ()))
    assert reg.to_json() == V2
    assert Registration.decode(reg.encode()) == reg


def test_a_registration_names_its_service() -> None:
    """RFD 5's registration has ``service``, and node-sdc-changefeed always sends
    it (its listener asserts ``options.service`` is a string): without it, stats
    could not say who is listening."""
    doc = {k: v for k, v in V1.items() if k != "service"}
    with pytest.raises(ProtocolError) as refused:
        Registration.decode(orjson.dumps(doc))
    assert refused.value.code == "invalid_registration"


@pytest.mark.parametrize(
    ("document", "names"),
    [
        ({**V1, "changeKind": {"resource": "vm"}}, ["changeKind", "subResources"]),
        ({**V1, "changeKind": {"resource": "vm", "subResources": [1]}}, ["subResources/0"]),
        ({**V1, "changeKind": {"resource": "", "subResources": []}}, ["changeKind/resource"]),
        ({**V1, "changeKind": {"resource": "v m", "subResources": []}}, ["changeKind/resource"]),
        ({**V1, "since": ""}, ["since"]),
        ({**V1, "batch": "yes"}, ["batch"]),
        ({**V1, "instance": 5}, ["instance"]),
        ({**V1, "bogus": 1}, ["bogus"]),
        ({**V2, "resources": []}, ["resources"]),
        ({**V2, "resources": [{"resource": "vm", "subResources": ["nic", 2]}]}, ["resources/0"]),
        ({"service": "tcns", "changeKind": V1["changeKind"]}, ["instance"]),
    ],
)
def test_registration_errors_name_the_field(document: dict[str, Any], names: list[str]) -> None:
    with pytest.raises(ProtocolError) as info:
        Registration.decode(orjson.dumps(document))
    assert info.value.code == "invalid_registration"
    for name in names:
        assert name in info.value.message, info.value.message


@pytest.mark.parametrize(
    ("data", "code"),
    [
        (b"{not json", "bad_frame"),
        (b"", "bad_frame"),
        (b"[1, 2]", "invalid_registration"),
        (b'"vm"', "invalid_registration"),
        (orjson.dumps({"instance": "x"}), "invalid_registration"),
        (orjson.dumps({**V1, "resources": V2["resources"]}), "invalid_registration"),
    ],
)
def test_registration_refuses_malformed_frames(data: bytes, code: str) -> None:
    with pytest.raises(ProtocolError) as info:
        Registration.decode(data)
    assert info.value.code == code
    assert info.value.message


# --------------------------------------------------------------------------- cursors

U64 = st.integers(min_value=0, max_value=2**64 - 1)
FEED = uuid.UUID("6f1c0a52-8f7e-4a83-9c1e-2b9d3a7f5e10").bytes
CODEC = CursorCodec(b"this feed's key", FEED)
CURSOR_ALPHABET = set(string.ascii_letters + string.digits + "-_")


U32 = st.integers(min_value=0, max_value=2**32 - 1)


@given(txid=U64, entry_id=U64, stamp=U32)
def test_cursor_round_trip(txid: int, entry_id: int, stamp: int) -> None:
    cursor = CODEC.encode(Position(txid, entry_id), stamp)
    assert set(cursor) <= CURSOR_ALPHABET and len(cursor) == 50
    assert CODEC.decode(cursor) == Cursor(Position(txid, entry_id), stamp)
    assert CODEC.decode(CODEC.encode(ORIGIN)) == Cursor(ORIGIN, 0)


def test_a_stamp_is_the_low_32_bits_of_the_published_microseconds() -> None:
    published = datetime(2026, 11, 24, 12, 0, 0, 123456, tzinfo=UTC)
    assert stamp_of(published) == int(published.timestamp() * 1e6) % 2**32
    assert stamp_of(published) != stamp_of(published + timedelta(microseconds=1))


def test_positions_compare_in_feed_order() -> None:
    assert ORIGIN < Position(1, 0) < Position(1, 5) < Position(2, 1)


@pytest.mark.parametrize(
    "garbage",
    ["", "x", "not a cursor", "A" * 34, "!" * 34, "é" * 34, "A" * 35, "=" * 34, None, 42],
)
def test_cursor_garbage_is_refused(garbage: Any) -> None:
    with pytest.raises(CursorError) as info:
        CODEC.decode(garbage)
    assert info.value.code == "bad_cursor"
    assert "cursor" in info.value.message


def test_cursor_any_edited_char_is_refused() -> None:
    codec = CODEC
    cursor = codec.encode(Position(123_456, 789), 42)
    for index, original in enumerate(cursor):
        for replacement in sorted(CURSOR_ALPHABET - {original}):
            edited = cursor[:index] + replacement + cursor[index + 1 :]
            with pytest.raises(CursorError):
                codec.decode(edited)


def test_cursor_from_another_key_is_refused() -> None:
    cursor = CursorCodec(b"key A", FEED).encode(Position(1, 2))
    with pytest.raises(CursorError, match="checksum") as info:
        CursorCodec(b"key B", FEED).decode(cursor)
    assert not isinstance(info.value, ForeignCursor)


def test_a_cursor_of_another_feed_is_told_apart_from_garbage() -> None:
    other = CursorCodec(b"their key", uuid.uuid4().bytes).encode(Position(1, 2), 7)
    with pytest.raises(ForeignCursor):
        CODEC.decode(other)
    # A cursor from before feeds had an identity (version 1, 34 characters).
    with pytest.raises(ForeignCursor):
        CODEC.decode("AQAAAAAAAAAHAAAAAAAAAAjqT0l68WJ1ow")


# --------------------------------------------------------------------------- feed SQL


async def test_apply_schema_is_idempotent(dsn: str) -> None:
    versions = [m.version for m in load_migrations()]
    assert versions
    conn = await asyncpg.connect(dsn)
    try:
        assert await schema_version(conn) == 0
        assert await apply_schema(conn) == versions
        assert await apply_schema(conn) == []
        assert await schema_version(conn) == max(versions)
        assert await conn.fetchval("SELECT count(*) FROM changefeed.feed_state") == 1
    finally:
        await conn.close()


async def test_apply_schema_concurrently(dsn: str) -> None:
    versions = [m.version for m in load_migrations()]
    first, second = await asyncpg.connect(dsn), await asyncpg.connect(dsn)
    try:
        results = await asyncio.gather(apply_schema(first), apply_schema(second))
        assert sorted(results) == [[], versions]
        assert await first.fetchval("SELECT count(*) FROM changefeed.schema_migrations") == len(
            versions
        )
    finally:
        await first.close()
        await second.close()


async def test_apply_schema_in_another_schema(dsn: str) -> None:
    conn = await asyncpg.connect(dsn)
    try:
        await apply_schema(conn, "other_feed")
        await conn.execute("SELECT other_feed.publish('vm', ARRAY[]::text[], 'x')")
        assert await conn.fetchval("SELECT count(*) FROM other_feed.feed") == 1
        assert await schema_version(conn) == 0  # "changefeed" untouched
    finally:
        await conn.close()


async def test_publish_inside_transaction_records_txid(feed_dsn: str) -> None:
    conn = await asyncpg.connect(feed_dsn)
    try:
        async with conn.transaction():
            txid = await conn.fetchval("SELECT pg_current_xact_id()::text")
            await conn.execute("SELECT changefeed.publish('vm', ARRAY['nic'], 'id1')")
        rows = await conn.fetch(
            "SELECT id, txid::text AS txid, resource, sub_resources, changed_resource_id,"
            " published FROM changefeed.feed"
        )
        assert len(rows) == 1
        row = rows[0]
        assert row["txid"] == txid
        assert (row["resource"], row["sub_resources"], row["changed_resource_id"]) == (
            "vm",
            ["nic"],
            "id1",
        )
        assert row["id"] is not None
        assert row["published"] is not None
    finally:
        await conn.close()


async def test_null_sub_resources_mean_the_whole_resource_and_null_names_are_refused(
    feed_dsn: str,
) -> None:
    conn = await asyncpg.connect(feed_dsn)
    try:
        await conn.execute("SELECT changefeed.publish('vm', NULL, 'id1')")
        assert await conn.fetchval("SELECT sub_resources FROM changefeed.feed") == []
        with pytest.raises(asyncpg.CheckViolationError):
            await conn.execute("SELECT changefeed.publish('', NULL, 'id1')")
        with pytest.raises(asyncpg.CheckViolationError):
            await conn.execute("SELECT changefeed.publish('vm', NULL, '')")
        # A NULL or empty sub-resource is a writer's bug: refused, however it comes in.
        for subs in ("ARRAY[NULL]::text[]", "ARRAY['nic', NULL]", "ARRAY['']"):
            with pytest.raises(asyncpg.CheckViolationError, match="sub_resources_are_names"):
                await conn.execute(f"SELECT changefeed.publish('vm', {subs}, 'id2')")
        with pytest.raises(asyncpg.CheckViolationError):
            await conn.execute(
                "SELECT changefeed.publish_many(ARRAY['vm'], ARRAY[','], ARRAY['x'])"
            )
        assert await conn.fetchval("SELECT count(*) FROM changefeed.feed") == 1
    finally:
        await conn.close()


async def test_rolled_back_publish_leaves_nothing(feed_dsn: str) -> None:
    conn = await asyncpg.connect(feed_dsn)
    try:
        tx = conn.transaction()
        await tx.start()
        await conn.execute("SELECT changefeed.publish('vm', ARRAY['nic'], 'id1')")
        await tx.rollback()
        assert await conn.fetchval("SELECT count(*) FROM changefeed.feed") == 0
    finally:
        await conn.close()


async def test_publish_rings_the_doorbell_only_at_commit(feed_dsn: str) -> None:
    listener, writer = await asyncpg.connect(feed_dsn), await asyncpg.connect(feed_dsn)
    rings: list[str] = []
    try:
        await listener.add_listener(
            notify_channel("changefeed"), lambda _c, _pid, _chan, payload: rings.append(payload)
        )
        tx = writer.transaction()
        await tx.start()
        await writer.execute("SELECT changefeed.publish('vm', ARRAY['nic'], 'gone')")
        await tx.rollback()
        async with writer.transaction():
            await writer.execute("SELECT changefeed.publish('vm', ARRAY['nic'], 'a')")
            await writer.execute("SELECT changefeed.publish('vm', ARRAY['alias'], 'b')")
            txid = await writer.fetchval("SELECT pg_current_xact_id()::text")
        await wait_until(lambda: len(rings) >= 1, message="doorbell after commit")
        await listener.fetchval("SELECT 1")  # anything pending has arrived by now
        # One per committed transaction, none for the rollback; it names the
        # transaction (what a tailer on a standby waits to see replayed).
        assert rings == [txid]
    finally:
        await listener.close()
        await writer.close()


async def test_bulk_and_trigger_writes_ring_once_naming_their_transaction(feed_dsn: str) -> None:
    """publish_many and the publish_row trigger ring as publish does: once per
    committed transaction, naming it; a publish_many of nothing rings nothing."""
    listener, writer = await asyncpg.connect(feed_dsn), await asyncpg.connect(feed_dsn)
    rings: list[str] = []
    try:
        await listener.add_listener(
            notify_channel("changefeed"), lambda _c, _pid, _chan, payload: rings.append(payload)
        )
        await writer.execute("CREATE TABLE vms (uuid text PRIMARY KEY, alias text)")
        await install_trigger(writer, "vms", "vm", "uuid")
        await writer.fetchval("SELECT changefeed.publish_many($1, $2, $3)", [], [], [])
        expected = []
        async with writer.transaction():
            await writer.fetchval(
                "SELECT changefeed.publish_many($1, $2, $3)", ["vm", "vm"], ["", ""], ["a", "b"]
            )
            expected.append(await writer.fetchval("SELECT pg_current_xact_id()::text"))
        async with writer.transaction():
            await writer.execute("INSERT INTO vms VALUES ('c', 'x'), ('d', 'y')")
            expected.append(await writer.fetchval("SELECT pg_current_xact_id()::text"))
        await wait_until(lambda: len(rings) >= 2, message="two doorbells")
        await listener.fetchval("SELECT 1")
        assert rings == expected
    finally:
        await listener.close()
        await writer.close()


async def test_publish_many_inserts_n_rows(feed_dsn: str) -> None:
    conn = await asyncpg.connect(feed_dsn)
    try:
        resources = ["vm"] * 4
        subs = ["nic", "", "nic,alias", None]
        ids = ["a", "b", "c", "d"]
        async with conn.transaction():
            txid = await conn.fetchval("SELECT pg_current_xact_id()::text")
            count = await conn.fetchval(
                "SELECT changefeed.publish_many($1, $2, $3)", resources, subs, ids
            )
        assert count == 4
        rows = await conn.fetch(
            "SELECT txid::text AS txid, changed_resource_id, sub_resources"
            " FROM changefeed.feed ORDER BY txid, id"
        )
        assert [r["changed_resource_id"] for r in rows] == ids
        assert [r["sub_resources"] for r in rows] == [["nic"], [], ["nic", "alias"], []]
        assert {r["txid"] for r in rows} == {txid}
        assert await conn.fetchval("SELECT changefeed.publish_many($1, $2, $3)", [], [], []) == 0
    finally:
        await conn.close()
