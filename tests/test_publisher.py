"""The publisher end to end: real PostgreSQL, real uvicorn, real websocket clients."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import asyncpg
import httpx
import orjson
import pytest
from helpers import metric_value, wait_until
from publisher_fixtures import (
    connect_not_reading,
    cursor_before,
    receive_items,
    register,
    registration,
    running_publisher,
    write,
)
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed

from changefeed.schemas import Ack, ChangeItem, CloseCode, validate


async def test_registration_ack_and_change_items_have_the_contract_shapes(feed_dsn: str) -> None:
    async with running_publisher(feed_dsn) as pub:
        ws, ack = await register(pub.ws_url, registration())
        validate("ack", ack)
        assert ack["bootstrapRoute"] == "/vms" and ack["resumed"] is False
        await write(feed_dsn, [("vm", ["nic"], "78615996-1a0e-40ca-974e-8b484774711a")])
        (item,) = await receive_items(ws, 1)
        validate("change_item", item)
        assert item["changeKind"] == {"resource": "vm", "subResources": ["nic"]}
        assert item["changedResourceId"] == "78615996-1a0e-40ca-974e-8b484774711a"
        assert item["published"].endswith("Z")
        await ws.close()


async def test_matching_follows_the_contract(feed_dsn: str) -> None:
    async with running_publisher(feed_dsn) as pub:
        nic_only, _ = await register(pub.ws_url, registration(subs=["nic"]))
        everything, _ = await register(pub.ws_url, registration(subs=[]))
        networks, _ = await register(pub.ws_url, registration("network", ["subnet"]))
        await write(
            feed_dsn,
            [
                ("vm", ["alias"], "a"),
                ("vm", ["nic", "alias"], "b"),
                ("vm", [], "c"),
                ("network", ["subnet"], "n"),
            ],
        )
        nic_items = await receive_items(nic_only, 2)
        assert [i["changedResourceId"] for i in nic_items] == ["b", "c"]
        all_items = await receive_items(everything, 3)
        assert [i["changedResourceId"] for i in all_items] == ["a", "b", "c"]
        (net,) = await receive_items(networks, 1)
        assert net["changedResourceId"] == "n"
        # Nothing else is pending for the nic-only listener.
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(nic_only.recv(), 0.5)
        for ws in (nic_only, everything, networks):
            await ws.close()


async def test_resources_and_stats_routes(feed_dsn: str) -> None:
    async with (
        running_publisher(feed_dsn) as pub,
        httpx.AsyncClient(base_url=pub.server.url) as http,
    ):
        resources = (await http.get("/changefeeds")).json()
        validate("resources", resources)
        assert resources == {
            "resources": [
                {"resource": "vm", "subResources": ["nic", "alias"], "bootstrapRoute": "/vms"},
                {"resource": "network", "subResources": ["subnet"], "bootstrapRoute": "/networks"},
            ]
        }
        stats = (await http.get("/changefeeds/stats")).json()
        validate("stats", stats)
        assert stats["listeners"] == 0 and stats["registrations"] == []
        first, _ = await register(pub.ws_url, registration())
        second, _ = await register(pub.ws_url, registration("network", ["subnet"]))
        stats = (await http.get("/changefeeds/stats")).json()
        validate("stats", stats)
        assert stats["listeners"] == 2
        assert sorted(r["changeKind"]["resource"] for r in stats["registrations"]) == [
            "network",
            "vm",
        ]
        assert {r["service"] for r in stats["registrations"]} == {"tcns"}
        await first.close()

        async def one_left() -> bool:
            listeners: int = (await http.get("/changefeeds/stats")).json()["listeners"]
            return listeners == 1

        await wait_until(one_left, message="stats count the disconnect")
        await second.close()
        await wait_until(lambda: len(pub.publisher.registry) == 0)
        stats = (await http.get("/changefeeds/stats")).json()
        assert stats["counters"]["registrations"] == 2 and stats["counters"]["disconnects"] == 2


@pytest.mark.parametrize(
    ("frame", "code", "close_code"),
    [
        ("not json", "bad_frame", CloseCode.BAD_FRAME),
        ("[1, 2]", "invalid_registration", CloseCode.BAD_FRAME),
        ('{"instance": "i", "service": "s"}', "invalid_registration", CloseCode.BAD_FRAME),
        (registration("vmz"), "unknown_resource", CloseCode.UNKNOWN_RESOURCE),
        (registration(since="garbage"), "bad_cursor", CloseCode.BAD_CURSOR),
        (
            registration().replace('["nic","alias"]', '"nic"'),
            "invalid_registration",
            CloseCode.BAD_FRAME,
        ),
        ("x" * 70000, "frame_too_large", CloseCode.FRAME_TOO_LARGE),
    ],
)
async def test_bad_registrations_get_an_error_frame_and_a_documented_close_code(
    feed_dsn: str, frame: str, code: str, close_code: int
) -> None:
    async with running_publisher(feed_dsn) as pub:
        ws, error = await register(pub.ws_url, frame)
        validate("error", error)
        assert error["error"]["code"] == code
        with pytest.raises(ConnectionClosed) as closed:
            await asyncio.wait_for(ws.recv(), 5)
        assert closed.value.rcvd is not None and closed.value.rcvd.code == close_code
        # The publisher keeps serving everyone else.
        good, ack = await register(pub.ws_url, registration())
        assert ack["bootstrapRoute"] == "/vms"
        await good.close()


async def test_registration_timeout_closes_silent_connections(feed_dsn: str) -> None:

    async with running_publisher(feed_dsn, registration_timeout=0.3) as pub:
        ws = await connect(pub.ws_url)
        error = orjson.loads(await asyncio.wait_for(ws.recv(), 5))
        assert error["error"]["code"] == "registration_timeout"
        with pytest.raises(ConnectionClosed) as closed:
            await asyncio.wait_for(ws.recv(), 5)
        assert closed.value.rcvd is not None
        assert closed.value.rcvd.code == CloseCode.REGISTRATION_TIMEOUT


async def test_rfd5_v2_registration_and_heartbeat_frames(feed_dsn: str) -> None:
    """node-sdc-changefeed registers several resources on one socket (v2) and sends
    'heartbeat' text frames; both must work unchanged."""
    frame = orjson.dumps(
        {
            "instance": "i1",
            "service": "cns",
            "resources": [
                {"resource": "vm", "subResources": ["nic"]},
                {"resource": "network", "subResources": ["subnet"]},
            ],
        }
    ).decode()
    async with running_publisher(feed_dsn) as pub:
        ws, ack = await register(pub.ws_url, frame)
        assert [r["bootstrapRoute"] for r in ack["bootstrapRoutes"]] == ["/vms", "/networks"]
        assert "bootstrapRoute" not in ack
        await ws.send("heartbeat")
        await write(feed_dsn, [("vm", ["nic"], "v1"), ("network", ["subnet"], "n1")])
        items = await receive_items(ws, 2)
        assert [i["changedResourceId"] for i in items] == ["v1", "n1"]
        await ws.close()


async def test_batch_mode_coalesces_items_into_arrays(feed_dsn: str) -> None:
    async with running_publisher(feed_dsn) as pub:
        ws, ack = await register(pub.ws_url, registration(batch=True))
        assert ack["batch"] is True
        conn = await asyncpg.connect(feed_dsn)
        from changefeed.publisher import publish_many

        await publish_many(conn, [("vm", ["nic"], f"id{i}") for i in range(300)])
        await conn.close()
        items = await receive_items(ws, 300)
        assert [i["changedResourceId"] for i in items] == [f"id{i}" for i in range(300)]
        for item in items:
            ChangeItem.from_json(item)
        await ws.close()


async def test_resume_replays_exactly_what_was_missed(feed_dsn: str) -> None:
    async with running_publisher(feed_dsn) as pub:
        missed = [("vm", ["nic"] if i % 2 else ["alias"], f"m{i}") for i in range(1000)]
        since = await cursor_before(pub, missed)
        ws, ack = await register(pub.ws_url, registration(subs=["nic"], since=since))
        assert Ack.decode(orjson.dumps(ack)).resumed is True
        items = await receive_items(ws, 500)
        assert [i["changedResourceId"] for i in items] == [f"m{i}" for i in range(1, 1000, 2)]
        # The seam: live items follow the replay with no gap and no duplicate.
        await write(feed_dsn, [("vm", ["nic"], "live")])
        (live,) = await receive_items(ws, 1)
        assert live["changedResourceId"] == "live"
        await ws.close()


@pytest.mark.parametrize("rejoins", [1, 1000])
async def test_a_registration_the_tailer_rejoin_overtook_is_decided_again(
    feed_dsn: str, monkeypatch: pytest.MonkeyPatch, rejoins: int
) -> None:
    """The tailer begins to join the feed again while a resume is decided (what a
    standby's restart or a feed identity change does): the registration is decided
    again once it has joined, and resumes. Only a feed that keeps changing under
    every decision gets the 4010 to retry, within the listener's wait for its ack."""
    async with running_publisher(feed_dsn) as pub:
        since = await cursor_before(pub, [("vm", ["nic"], "missed")])
        queries = pub.publisher.sessions._resume_queries
        plan, left = queries.plan, [rejoins]

        async def overtaken(*args: Any, **kwargs: Any) -> Any:
            decided = await plan(*args, **kwargs)
            if left[0]:
                left[0] -= 1
                pub.publisher.tailer.rejoin()
                pub.publisher.tailer.ready.clear()  # joining: as after a reconnect
            return decided

        monkeypatch.setattr(queries, "plan", overtaken)
        asked = time.monotonic()
        ws, first = await register(pub.ws_url, registration(since=since))
        if rejoins == 1:
            assert first.get("resumed") is True, first
            (item,) = await receive_items(ws, 1)
            assert item["changedResourceId"] == "missed"
        else:
            assert first["error"]["code"] == "unavailable", first
            assert first["error"]["message"] == "the feed changed meanwhile; retry"
            assert time.monotonic() - asked < 10  # changefeed.listener's ack_timeout
        await ws.close()


async def test_a_resume_from_the_feed_table_stops_once_its_listener_is_closing(
    feed_dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A listener drained (or evicted) while it catches up from the feed table
    gets no more of it: the close follows the page under way, not the whole
    catch-up."""
    from changefeed.publisher.delivery import Closing
    from changefeed.publisher.feed import FeedReader

    read_page = FeedReader.read_page

    # A small window: what a resume needs is read from the feed table.
    async with running_publisher(feed_dsn, window_bytes=20_000, tail_batch=100) as pub:
        since = await cursor_before(pub, [("vm", ["nic"], f"m{i}") for i in range(300)])

        async def read_then_drain(self: FeedReader, *args: Any) -> Any:
            page = await read_page(self, *args)
            # What Publisher.drain does to every listener, during the first page.
            for session in pub.publisher.registry:
                session.close(Closing(1001, None, "publisher shutting down"))
            return page

        monkeypatch.setattr(FeedReader, "read_page", read_then_drain)
        ws, ack = await register(pub.ws_url, registration(subs=["nic"], since=since))
        assert ack["resumed"] is True
        items: list[str] = []
        with pytest.raises(ConnectionClosed) as closed:
            async with asyncio.timeout(10):
                while True:
                    items.append(orjson.loads(await ws.recv())["changedResourceId"])
        assert closed.value.rcvd is not None and closed.value.rcvd.code == 1001
        assert items == []


async def test_a_drain_gives_up_on_a_catch_up_its_listener_does_not_read(feed_dsn: str) -> None:
    """A resuming listener that stops reading blocks its catch-up on the socket. A
    drain must not wait for it beyond close_timeout (every wait on a listener is
    bounded), and the listener is let go."""
    async with running_publisher(feed_dsn, close_timeout=0.5) as pub:
        publisher = pub.publisher
        # 20 MB to catch up on: more than the kernel and the transport absorb.
        padding = "x" * 4000
        since = await cursor_before(pub, [("vm", [], f"m{i}-{padding}") for i in range(5000)], [])
        stuck = await connect_not_reading(pub.ws_url)
        try:
            await stuck.send(registration(subs=[], since=since))
            progress: list[int] = []

            def catch_up_stalled() -> bool:
                progress.append(sum(s.delivery.sent for s in publisher.registry))
                return len(progress) > 5 and progress[-1] == progress[-6] > 0

            await wait_until(catch_up_stalled, timeout=30, interval=0.05)
            assert progress[-1] < 5000
            started = time.monotonic()
            await publisher.drain(grace=10)
            assert len(publisher.registry) == 0
            assert time.monotonic() - started < 5
            # What did go out before the catch-up was dropped is counted (and the one
            # item cursor_before's listener got).
            metrics = publisher.metrics.render().decode()
            assert metric_value(metrics, "changefeed_deliveries_total") == progress[-1] + 1
        finally:
            stuck.transport.abort()


async def test_a_catch_up_trimmed_under_its_feet_ends_with_cursor_expired_not_a_gap(
    feed_dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Garbage collection (another instance's retention, the Spark job) may run
    while a listener catches up from the feed table page by page. When it took
    entries the listener still needed, the listener must hear so (4011
    cursor_expired: register again without since, bootstrap), not carry on from a
    silent gap; and everyone else is served meanwhile."""
    from datetime import timedelta

    from changefeed.publisher.feed import FeedReader
    from changefeed.publisher.retention import trim_expired

    read_page = FeedReader.read_page
    pages_read = 0

    async def read_then_collect(self: FeedReader, *args: Any) -> Any:
        nonlocal pages_read
        page = await read_page(self, *args)
        pages_read += 1
        if pages_read == 1:  # the collector runs between the catch-up's first two pages
            conn = await asyncpg.connect(feed_dsn)
            try:
                await conn.execute("UPDATE changefeed.feed SET published = now() - interval '2d'")
                assert await trim_expired(conn, "changefeed", timedelta(days=1)) > 0
            finally:
                await conn.close()
        return page

    async with running_publisher(feed_dsn, window_bytes=20_000, tail_batch=100) as pub:
        bystander, _ = await register(pub.ws_url, registration(subs=[]))
        since = await cursor_before(pub, [("vm", ["nic"], f"m{i}") for i in range(300)])
        assert len(await receive_items(bystander, 301)) == 301

        monkeypatch.setattr(FeedReader, "read_page", read_then_collect)
        ws, ack = await register(pub.ws_url, registration(subs=["nic"], since=since))
        assert ack["resumed"] is True
        items: list[str] = []
        errors: list[str] = []
        with pytest.raises(ConnectionClosed) as closed:
            async with asyncio.timeout(10):
                while True:
                    doc = orjson.loads(await ws.recv())
                    if "error" in doc:
                        errors.append(doc["error"]["code"])
                    else:
                        items.append(doc["changedResourceId"])
        assert closed.value.rcvd is not None
        assert closed.value.rcvd.code == CloseCode.CURSOR_EXPIRED
        assert errors == ["cursor_expired"]
        assert items == [f"m{i}" for i in range(100)]  # the first page, then the error
        assert pub.publisher.stats()["counters"]["evictionsByCode"] == {"cursor_expired": 1}
        # The bystander was served all along and still is.
        await write(feed_dsn, [("vm", [], "after")])
        (after,) = await receive_items(bystander, 1)
        assert after["changedResourceId"] == "after"
        await bystander.close()


async def test_a_tailer_that_garbage_collection_passed_unread_closes_its_listeners_4011(
    feed_dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A collector with a max age shorter than a tailer's lag (say `changefeed
    compact --max-age 1s` against a tailer a few seconds behind) deletes entries
    the tailer has not read yet. The tailer's read says so (the low-water mark
    passed its position, same snapshot): its live listeners are closed with 4011
    (they bootstrap) instead of being served the rest with a silent gap."""
    from datetime import timedelta

    from changefeed.publisher.feed import FeedReader
    from changefeed.publisher.retention import trim_expired

    read_after = FeedReader.read_after
    armed = False

    async def lag_then_read(self: FeedReader, conn: Any, after: Any, limit: int) -> Any:
        nonlocal armed
        if armed:  # the collector gets there first: the tailer is "behind"
            armed = False
            other = await asyncpg.connect(feed_dsn)
            try:
                await other.execute("UPDATE changefeed.feed SET published = now() - interval '2d'")
                assert await trim_expired(other, "changefeed", timedelta(days=1)) == 3
            finally:
                await other.close()
            await write(feed_dsn, [("vm", [], "after-the-gap")])
        return await read_after(self, conn, after, limit)

    async with running_publisher(feed_dsn) as pub:
        ws, _ = await register(pub.ws_url, registration(subs=[]))
        monkeypatch.setattr(FeedReader, "read_after", lag_then_read)
        armed = True
        await write(feed_dsn, [("vm", [], f"unread-{i}") for i in range(3)])
        got: list[dict[str, Any]] = []
        with pytest.raises(ConnectionClosed) as closed:
            async with asyncio.timeout(10):
                while True:
                    got.append(orjson.loads(await ws.recv()))
        assert closed.value.rcvd is not None
        assert closed.value.rcvd.code == CloseCode.CURSOR_EXPIRED
        assert [doc["error"]["code"] for doc in got] == ["cursor_expired"]  # no item after a gap
        # The publisher carries on from the head, for listeners that register again.
        again, ack = await register(pub.ws_url, registration(subs=[]))
        assert ack["resumed"] is False
        await write(feed_dsn, [("vm", [], "later")])
        (later,) = await receive_items(again, 1)
        assert later["changedResourceId"] == "later"
        await again.close()


async def test_cursor_older_than_the_low_water_mark_is_not_resumed(feed_dsn: str) -> None:
    async with running_publisher(feed_dsn) as pub:
        ws, _ = await register(pub.ws_url, registration())
        await write(feed_dsn, [("vm", [], "old"), ("vm", [], "older")])
        old, _ = await receive_items(ws, 2)
        await ws.close()
        conn = await asyncpg.connect(feed_dsn)
        from datetime import timedelta

        from changefeed.publisher.retention import trim_expired

        await conn.execute("UPDATE changefeed.feed SET published = now() - interval '2 days'")
        assert await trim_expired(conn, "changefeed", timedelta(days=1)) == 2
        await conn.close()
        # "old" is gone and so is "older", which a resume from "old" would need.
        ws, ack = await register(pub.ws_url, registration(since=old["cursor"]))
        assert ack["resumed"] is False and ack["reason"] == "cursor_expired"
        await ws.close()


async def test_retention_keeps_entries_the_tailer_cannot_read_yet(feed_dsn: str) -> None:
    """A transaction held open for longer than max_age holds the tailer's horizon;
    entries committed behind it, aged past max_age meanwhile, are not trimmed
    before the tailer has read them (that would be a silent gap for every live
    listener)."""
    from datetime import timedelta

    from changefeed.publisher import publish
    from changefeed.publisher.retention import trim_expired

    async with running_publisher(feed_dsn) as pub:
        ws, _ = await register(pub.ws_url, registration(subs=[]))
        long = await asyncpg.connect(feed_dsn)
        conn = await asyncpg.connect(feed_dsn)
        try:
            tx = long.transaction()
            await tx.start()
            await publish(long, "vm", [], "long")
            await write(feed_dsn, [("vm", [], "behind-1"), ("vm", [], "behind-2")])
            await conn.execute("UPDATE changefeed.feed SET published = now() - interval '2 days'")
            assert await trim_expired(conn, "changefeed", timedelta(days=1)) == 0
            await tx.commit()
        finally:
            await long.close()
            await conn.close()
        got = await receive_items(ws, 3)
        assert [i["changedResourceId"] for i in got] == ["long", "behind-1", "behind-2"]
        await ws.close()


async def test_entries_committed_out_of_order_are_not_skipped(feed_dsn: str) -> None:
    """Invariant I1 in miniature: A appends first and commits last."""
    async with running_publisher(feed_dsn) as pub:
        ws, _ = await register(pub.ws_url, registration(subs=[]))
        first = await asyncpg.connect(feed_dsn)
        tx = first.transaction()
        await tx.start()
        from changefeed.publisher import publish

        await publish(first, "vm", [], "appended-first")
        await write(feed_dsn, [("vm", [], "appended-second")])
        # The second one's transaction is after the open one: held back, not skipped.
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(ws.recv(), 0.7)
        await tx.commit()
        await first.close()
        items = await receive_items(ws, 2)
        assert sorted(i["changedResourceId"] for i in items) == [
            "appended-first",
            "appended-second",
        ]
        await ws.close()


@pytest.mark.parametrize("ws", ["direct", "asgi"])
async def test_a_disconnect_says_whether_the_listener_closed_or_was_lost(
    feed_dsn: str, caplog: pytest.LogCaptureFixture, ws: str
) -> None:
    """A listener that sends its close frame "closed" its connection; one whose
    connection ends without one (its host gone, or the server's own keepalive
    through plain ASGI) was lost, and the log says which."""
    caplog.set_level(logging.INFO, logger="changefeed")
    async with running_publisher(feed_dsn, ws=ws) as pub:
        closing, _ = await register(pub.ws_url, registration(service="closing", subs=[]))
        dropped, _ = await register(pub.ws_url, registration(service="dropped", subs=[]))
        await closing.close()
        dropped.transport.abort()  # a reset, no close frame
        await wait_until(lambda: len(pub.publisher.registry) == 0, timeout=10)
    reasons = {
        r.cf_fields["service"]: r.cf_fields["reason"]  # type: ignore[attr-defined]
        for r in caplog.records
        if r.getMessage() == "listener.disconnected"
    }
    assert reasons == {
        "closing": "closed by listener",
        "dropped": "connection lost without a close frame from the listener",
    }, reasons


async def test_a_listener_that_stops_answering_pings_is_dropped_and_its_registration_gone(
    feed_dsn: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Liveness (docs/design.md): the server pings; a listener that stops
    reading, and so answering, is evicted within ping interval + four ping
    timeouts (its TCP acknowledges the ping, progress once; then
    PingWatch.PATIENCE + 1 deadlines without any), its
    registration is gone, and the log and the stats' recent evictions say why.
    Another listener is untouched."""
    caplog.set_level(logging.INFO, logger="changefeed")
    pings = {"ws_ping_interval": 0.3, "ws_ping_timeout": 0.3}
    async with running_publisher(feed_dsn, server=pings) as pub:
        alive, _ = await register(pub.ws_url, registration(subs=[]))
        mute, _ = await register(pub.ws_url, registration(service="mute"), ping_interval=None)
        assert len(pub.publisher.registry) == 2
        started = time.monotonic()
        mute.transport.pause_reading()  # pings go unanswered from now on
        await wait_until(lambda: len(pub.publisher.registry) == 1, timeout=5)
        assert time.monotonic() - started < 0.3 + 4 * 0.3 + 2.0  # interval + timeouts + slack
        (gone,) = [r for r in caplog.records if r.getMessage() == "listener.evicted"]
        fields = gone.cf_fields  # type: ignore[attr-defined]
        assert fields["service"] == "mute" and fields["code"] == "keepalive_timeout", fields
        stats = pub.publisher.stats()
        assert [r["service"] for r in stats["registrations"]] == ["tcns"]
        (evicted,) = stats["recentEvictions"]
        assert evicted["code"] == "keepalive_timeout" and evicted["service"] == "mute"
        assert "no answer to pings" in evicted["reason"]
        assert stats["counters"]["evictionsByCode"] == {"keepalive_timeout": 1}
        # The one that answers stays registered and keeps receiving.
        await write(feed_dsn, [("vm", [], "after-the-mute-one")])
        (item,) = await receive_items(alive, 1)
        assert item["changedResourceId"] == "after-the-mute-one"
        await alive.close()
        mute.transport.abort()


async def test_listeners_first_hands_the_listener_websocket_past_the_apps_middleware() -> None:
    """Publisher.listeners_first(app): the /changefeeds websocket goes straight to the
    publisher's endpoint (none of the app's frames held for an idle listener);
    everything else, HTTP on the same path included, to the app."""
    seen: list[tuple[str, str, str]] = []

    def recorder(name: str) -> Any:
        async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
            seen.append((name, scope["type"], scope.get("path", "")))

        return app

    from starlette.applications import Starlette

    from changefeed.publisher.routes import ListenersFirst

    first = ListenersFirst(recorder("app"), recorder("listeners"))
    for scope in (
        {"type": "websocket", "path": "/changefeeds"},
        {"type": "http", "path": "/changefeeds"},
        {"type": "websocket", "path": "/elsewhere"},
        {"type": "lifespan"},
    ):
        # The recorders never receive or send: None stands in for both callables.
        await first(scope, None, None)  # type: ignore[arg-type]
    assert seen == [
        ("listeners", "websocket", "/changefeeds"),
        ("app", "http", "/changefeeds"),
        ("app", "websocket", "/elsewhere"),
        ("app", "lifespan", ""),
    ]
    # Served in place of the app, it still reads as the app: ``app =
    # publisher.listeners_first(app)`` keeps ``app.state`` working.
    inner = Starlette()
    inner.state.pool = "the pool"
    rebound = ListenersFirst(inner, recorder("listeners"))
    assert rebound.state.pool == "the pool" and rebound.url_path_for is not None
    with pytest.raises(AttributeError):
        rebound.nosuch  # noqa: B018
