"""Resume you can trust: a cursor resumes only the feed that issued it, as that feed was.

A cursor carries its feed's identity and a stamp of its entry, and is signed
with a key made with the feed. A cursor of another feed, one ahead of
everything the feed holds, or one naming an entry the feed does not hold (a
feed restored from a backup hands out the same positions again) is answered
``resumed: false`` with its ``reason``. A publisher that sees the feed go back
under it (a restore while it runs) gives the feed a new identity and closes
its listeners with 4011, so that they bootstrap. The restores here are real:
a PostgreSQL data directory copied while stopped and put back, so that the
server's transaction ids and the feed's entry ids go back for real.
"""

from __future__ import annotations

import asyncio
import logging
import shutil
import time
import uuid
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import asyncpg
import orjson
import pytest
from helpers import terminate_tailer, wait_until
from publisher_fixtures import receive_items, register, registration, running_publisher, write
from websockets.exceptions import ConnectionClosed

from changefeed.embedded import EmbeddedPostgres, temporary
from changefeed.publisher.retention import trim_expired
from changefeed.schemas import CloseCode, CursorCodec, Position, apply_schema


async def _new_feed(server: Any) -> str:
    name = f"feed_{uuid.uuid4().hex}"
    admin = await asyncpg.connect(server.dsn)
    try:
        await admin.execute(f'CREATE DATABASE "{name}"')
    finally:
        await admin.close()
    dsn: str = server.dsn_for(name)
    conn = await asyncpg.connect(dsn)
    try:
        await apply_schema(conn)
    finally:
        await conn.close()
    return dsn


async def _codec(dsn: str) -> CursorCodec:
    """The feed's own codec (read from feed_state, as a publisher does)."""
    conn = await asyncpg.connect(dsn)
    try:
        row = await conn.fetchrow("SELECT feed_id, cursor_key FROM changefeed.feed_state")
    finally:
        await conn.close()
    assert row is not None
    return CursorCodec(bytes(row["cursor_key"]), row["feed_id"].bytes)


async def _resume(url: str, since: str) -> dict[str, object]:
    ws, ack = await register(url, registration(subs=[], since=since))
    await ws.close()
    return ack


async def test_a_cursor_of_another_feed_is_not_resumed(pg_server: Any, feed_dsn: str) -> None:
    other = await _new_feed(pg_server)
    async with running_publisher(feed_dsn) as pub:
        ws, _ = await register(pub.ws_url, registration(subs=[]))
        await write(feed_dsn, [("vm", [], "in-feed-a")])
        (item,) = await receive_items(ws, 1)
        await ws.close()
        # The same cursor resumes the feed that issued it...
        assert (await _resume(pub.ws_url, item["cursor"]))["resumed"] is True
    # ...but not another feed, though the entry positions may well coincide.
    async with running_publisher(other) as pub:
        await write(other, [("vm", [], "in-feed-b")])
        ack = await _resume(pub.ws_url, item["cursor"])
        assert ack["resumed"] is False and ack["reason"] == "other_feed"


async def test_cursors_ahead_of_the_feed_or_naming_no_entry_of_it_are_not_resumed(
    feed_dsn: str,
) -> None:
    """Signed with the feed's own key, so only the position can give them away."""
    codec = await _codec(feed_dsn)
    async with running_publisher(feed_dsn) as pub:
        ws, _ = await register(pub.ws_url, registration(subs=[]))
        await write(feed_dsn, [("vm", [], f"e{i}") for i in range(3)])
        items = await receive_items(ws, 3)
        await ws.close()
        real = codec.decode(items[1]["cursor"])
        ahead = codec.encode(Position(real.position.txid + 1000, real.position.id + 1000), 1)
        assert (await _resume(pub.ws_url, ahead))["reason"] == "cursor_ahead"
        # The right position with another entry's stamp: what a restored feed shows.
        wrong = codec.encode(real.position, (real.stamp + 1) % 2**32)
        assert (await _resume(pub.ws_url, wrong))["reason"] == "unknown_position"
        # A position between two entries, which no cursor ever named.
        between = codec.encode(Position(real.position.txid, real.position.id + 500), 0)
        assert (await _resume(pub.ws_url, between))["reason"] == "unknown_position"
        # The genuine one resumes, and only what came after it is sent.
        ws, ack = await register(pub.ws_url, registration(subs=[], since=items[1]["cursor"]))
        assert ack["resumed"] is True and "reason" not in ack
        (after,) = await receive_items(ws, 1)
        assert after["changedResourceId"] == "e2"
        await ws.close()


# --------------------------------------------------------------------------- restores


@pytest.fixture
def own_server(tmp_path: Path) -> Iterator[EmbeddedPostgres]:
    """A PostgreSQL of this test's own, whose data directory it may put back."""
    server = temporary()
    try:
        server.start()
        yield server
    finally:
        server.close()


def _back_up(server: EmbeddedPostgres, to: Path) -> None:
    """A cold backup: the data directory, copied while the server is stopped."""
    server.stop()
    shutil.copytree(server.data_dir, to, symlinks=True)
    server.restart()


def _restore(server: EmbeddedPostgres, backup: Path) -> None:
    server.stop()
    shutil.rmtree(server.data_dir)
    shutil.copytree(backup, server.data_dir, symlinks=True)
    server.restart()


async def _feed_on(server: EmbeddedPostgres) -> str:
    conn = await asyncpg.connect(server.dsn)
    try:
        await conn.execute("CREATE DATABASE feed")
    finally:
        await conn.close()
    dsn = server.dsn_for("feed")
    conn = await asyncpg.connect(dsn)
    try:
        await apply_schema(conn)
    finally:
        await conn.close()
    return dsn


async def test_a_feed_restored_under_a_running_publisher_is_noticed_and_its_listeners_bootstrap(
    own_server: EmbeddedPostgres, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="changefeed")
    dsn = await _feed_on(own_server)
    async with running_publisher(dsn, poll_interval=0.05) as pub:
        listener, _ = await register(pub.ws_url, registration(subs=[]))
        await write(dsn, [("vm", [], f"kept-{i}") for i in range(10)])
        await receive_items(listener, 10)
        _back_up(own_server, tmp_path / "backup")
        await write(dsn, [("vm", [], f"lost-{i}") for i in range(20)])
        items = await receive_items(listener, 20, timeout=30)
        last_cursor = items[-1]["cursor"]

        # The database is restored from the backup: the twenty are gone, and the
        # server's transaction ids and the feed's ids are back where they were.
        _restore(own_server, tmp_path / "backup")
        codes: list[str] = []
        with pytest.raises(ConnectionClosed) as closed:
            async with asyncio.timeout(30):
                while True:
                    doc = orjson.loads(await listener.recv())
                    if "error" in doc:
                        codes.append(doc["error"]["code"])
        assert closed.value.rcvd is not None
        assert closed.value.rcvd.code == CloseCode.CURSOR_EXPIRED and codes == ["cursor_expired"]
        rewound = [r for r in caplog.records if r.getMessage() == "feed.rewound"]
        assert rewound and rewound[0].levelno == logging.CRITICAL

        # Cursors of the feed as it was are another feed's now.
        ack = await _resume(pub.ws_url, last_cursor)
        assert ack["resumed"] is False and ack["reason"] == "other_feed"
        # New listeners are served from the restored feed's head on.
        fresh, ack = await register(pub.ws_url, registration(subs=[]))
        assert ack["resumed"] is False
        await write(dsn, [("vm", [], "after-restore")])
        (item,) = await receive_items(fresh, 1, timeout=30)
        assert item["changedResourceId"] == "after-restore"
        assert (await _resume(pub.ws_url, item["cursor"]))["resumed"] is True
        await fresh.close()


async def test_a_cursor_from_before_a_restore_is_not_resumed_by_a_publisher_started_after(
    own_server: EmbeddedPostgres, tmp_path: Path
) -> None:
    """No publisher ran across the restore, so none could notice it: the cursors
    give it away. The restored feed writes again, and its transaction ids and
    entry ids run through the same values as the lost entries did."""
    dsn = await _feed_on(own_server)
    async with running_publisher(dsn) as pub:
        listener, _ = await register(pub.ws_url, registration(subs=[]))
        await write(dsn, [("vm", [], f"kept-{i}") for i in range(10)])
        await receive_items(listener, 10)
        _back_up(own_server, tmp_path / "backup")
        await wait_until(lambda: pub.publisher.tailer.status == "running", timeout=30)
        await write(dsn, [("vm", [], f"lost-{i}") for i in range(10)])
        lost = await receive_items(listener, 10, timeout=30)
        await listener.close()
    _restore(own_server, tmp_path / "backup")
    await write(dsn, [("vm", [], f"rewritten-{i}") for i in range(5)])
    codec = await _codec(dsn)
    replaced = codec.decode(lost[2]["cursor"]).position
    async with running_publisher(dsn) as pub:
        # Entries at the lost ones' positions, or nearby ones: not what the cursor saw.
        ack = await _resume(pub.ws_url, lost[2]["cursor"])
        assert ack["resumed"] is False and ack["reason"] == "unknown_position", replaced
        # Beyond what the restored feed has written again.
        ack = await _resume(pub.ws_url, lost[9]["cursor"])
        assert ack["resumed"] is False and ack["reason"] in ("cursor_ahead", "unknown_position")


# --------------------------------------------------------------------------- its own faults


async def _feed_id(dsn: str) -> uuid.UUID:
    conn = await asyncpg.connect(dsn)
    try:
        value: uuid.UUID = await conn.fetchval("SELECT feed_id FROM changefeed.feed_state")
        return value
    finally:
        await conn.close()


async def test_a_batch_that_failed_to_reach_the_listeners_is_not_taken_for_a_restore(
    feed_dsn: str,
) -> None:
    """A bug raises in live dispatch, after the batch went into the window: the
    tailer reads it again. The feed is the same feed (no new identity), and its
    listeners are told to resume (4010, with ``retryAfter`` as every 4010 has),
    so that none keeps a gap."""
    async with running_publisher(feed_dsn, poll_interval=0.05) as pub:
        ws, _ = await register(pub.ws_url, registration(subs=[]))
        await write(feed_dsn, [("vm", [], "first")])
        (first,) = await receive_items(ws, 1)
        before = await _feed_id(feed_dsn)
        fanout = pub.publisher.broadcast.fanout
        original = fanout.dispatch
        calls = {"n": 0}

        def fails_once(chunk: Any, start: int) -> Any:
            calls["n"] += 1
            if calls["n"] == 1:
                raise RuntimeError("a programming error, once")
            return original(chunk, start)

        fanout.dispatch = fails_once  # type: ignore[method-assign]
        await write(feed_dsn, [("vm", [], "second")])
        errors: list[dict[str, Any]] = []
        with pytest.raises(ConnectionClosed) as closed:
            async with asyncio.timeout(30):
                while True:
                    doc = orjson.loads(await ws.recv())
                    if isinstance(doc, dict) and "error" in doc:
                        errors.append(doc["error"])
        assert closed.value.rcvd is not None and closed.value.rcvd.code == CloseCode.UNAVAILABLE
        assert [(e["code"], e.get("retryAfter")) for e in errors] == [("unavailable", 1.0)]
        assert await _feed_id(feed_dsn) == before
        # Resuming from what it had, it gets the batch that failed, once.
        again, ack = await register(pub.ws_url, registration(subs=[], since=first["cursor"]))
        assert ack["resumed"] is True
        (second,) = await receive_items(again, 1)
        assert second["changedResourceId"] == "second"
        await again.close()


async def test_an_identity_another_instance_gave_the_feed_is_taken_at_once(
    feed_dsn: str,
) -> None:
    """Another instance found the feed restored and gave it a new identity just as
    this one reconnected: this one reads the identity and its check in one
    snapshot, closes its listeners, and signs with the new identity from then on."""
    async with running_publisher(feed_dsn, poll_interval=0.05) as pub:
        reader = pub.publisher.reader
        original = reader.resume_facts
        armed = {"on": True}

        async def rotated_meanwhile(conn: Any, position: Any) -> Any:
            if armed["on"]:
                armed["on"] = False
                other = await asyncpg.connect(feed_dsn)  # the other instance
                try:
                    await other.execute(
                        "UPDATE changefeed.feed_state SET feed_id = gen_random_uuid(),"
                        " cursor_key = uuid_send(gen_random_uuid())"
                        " || uuid_send(gen_random_uuid())"
                    )
                finally:
                    await other.close()
            return await original(conn, position)

        reader.resume_facts = rotated_meanwhile  # type: ignore[method-assign]
        await write(feed_dsn, [("vm", [], "before")])
        await wait_until(lambda: pub.publisher.tailer.entries_total >= 1, 30)
        await terminate_tailer(feed_dsn)
        tailer = pub.publisher.tailer
        await wait_until(lambda: not armed["on"] and tailer.status == "running", 30)
        ws, _ = await register(pub.ws_url, registration(subs=[]))
        await write(feed_dsn, [("vm", [], "after")])
        (item,) = await receive_items(ws, 1)
        await ws.close()
        assert pub.publisher.identity.feed_id == await _feed_id(feed_dsn)
        assert (await _resume(pub.ws_url, item["cursor"]))["resumed"] is True


async def test_a_registration_while_the_tailer_joins_a_restored_feed_is_told_to_retry(
    own_server: EmbeddedPostgres, tmp_path: Path
) -> None:
    """While the tailer checks the feed after reconnecting (here: held on the
    restored feed's head), a registration is answered 4010 with retryAfter, not
    admitted at the lost feed's head, where it would skip the positions the
    restored feed hands out again; registering again afterwards works."""
    dsn = await _feed_on(own_server)
    async with running_publisher(dsn, poll_interval=0.05) as pub:
        listener, _ = await register(pub.ws_url, registration(subs=[]))
        await write(dsn, [("vm", [], f"kept-{i}") for i in range(10)])
        await receive_items(listener, 10)
        await listener.close()
        _back_up(own_server, tmp_path / "backup")
        await wait_until(lambda: pub.publisher.tailer.status == "running", timeout=30)
        await write(dsn, [("vm", [], f"lost-{i}") for i in range(20)])
        await wait_until(lambda: pub.publisher.tailer.entries_total >= 30, timeout=30)

        reader = pub.publisher.reader
        original = reader.head_entry
        entered, release = asyncio.Event(), asyncio.Event()

        async def held(conn: Any) -> Any:
            found = await original(conn)
            entered.set()
            await asyncio.wait_for(release.wait(), 30)
            return found

        reader.head_entry = held  # type: ignore[method-assign]
        _restore(own_server, tmp_path / "backup")
        await asyncio.wait_for(entered.wait(), 60)
        during, answer = await register(pub.ws_url, registration(subs=[]))
        assert answer["error"]["code"] == "unavailable" and answer["error"]["retryAfter"] > 0
        await during.close()
        release.set()
        await wait_until(lambda: pub.publisher.tailer.status == "running", timeout=30)
        after, _ = await register(pub.ws_url, registration(subs=[]))
        await write(dsn, [("vm", [], f"after-restore-{i}") for i in range(5)])
        (item,) = await receive_items(after, 1, timeout=10)
        assert item["changedResourceId"] == "after-restore-0"
        await after.close()


async def test_database_restarts_on_a_quiet_feed_do_not_fail_the_publisher(
    own_server: EmbeddedPostgres,
) -> None:
    """What a restart leaves on a connection is the database's weather, not a bug
    of the publisher's: however many restarts, it keeps tailing."""
    dsn = await _feed_on(own_server)
    async with running_publisher(dsn, poll_interval=0.05) as pub:
        tailer = pub.publisher.tailer
        for _ in range(4):
            await asyncio.to_thread(own_server.restart)
            since = time.monotonic()

            def read_since(since: float = since) -> bool:
                return tailer.status in ("running", "failed") and (tailer.last_read_at or 0) > since

            await wait_until(read_since, timeout=60)
            assert tailer.status == "running", tailer.last_error
        assert pub.publisher.failed == {}


async def _trim_everything(dsn: str) -> None:
    """Two entries written long ago, and retention trimmed both: the feed is empty,
    its low-water mark is at the newer one."""
    await write(dsn, [("vm", [], "old1"), ("vm", [], "old2")])
    conn = await asyncpg.connect(dsn)
    try:
        await conn.execute("UPDATE changefeed.feed SET published = now() - interval '2 days'")
        assert await trim_expired(conn, "changefeed", timedelta(days=1)) == 2
    finally:
        await conn.close()


async def test_the_ack_cursor_of_a_fully_trimmed_feed_resumes(feed_dsn: str) -> None:
    """A quiet feed whose entries all aged out (max_age, 24 h by default): the ack's
    cursor is the feed's position; a listener that reconnects with it before any
    change has missed nothing, so it resumes instead of bootstrapping."""
    await _trim_everything(feed_dsn)
    async with running_publisher(feed_dsn) as pub:
        ws, ack = await register(pub.ws_url, registration(subs=[]))
        await ws.close()
        ws, again = await register(pub.ws_url, registration(subs=[], since=ack["cursor"]))
        await ws.close()
        assert again["resumed"] is True, again.get("reason")


async def test_a_tailer_reconnect_on_a_fully_trimmed_feed_keeps_its_listeners(
    feed_dsn: str,
) -> None:
    """The same quiet feed, and the tailer's connection drops (a database restart,
    a failover): its listeners are caught up and nothing was trimmed past them, so
    none may be closed with cursor_expired (4011) and sent to bootstrap."""
    await _trim_everything(feed_dsn)
    async with running_publisher(feed_dsn, poll_interval=0.05) as pub:
        ws, _ = await register(pub.ws_url, registration(subs=[]))
        tailer = pub.publisher.tailer
        reconnects = tailer.reconnects_total
        await terminate_tailer(feed_dsn)
        await wait_until(
            lambda: tailer.reconnects_total > reconnects and tailer.status == "running",
            timeout=20,
        )
        evictions = pub.publisher.stats()["counters"]["evictionsByCode"]
        assert evictions == {}, evictions
        await write(feed_dsn, [("vm", [], "after")])
        (item,) = await receive_items(ws, 1)
        assert item.get("changedResourceId") == "after", item
        await ws.close()
