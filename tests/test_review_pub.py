"""Review of the publisher core: each test here proves one defect found in review
(docs/design.md is the contract it is held to)."""

from __future__ import annotations

import asyncio
from datetime import timedelta
from typing import Any

import asyncpg
import httpx
import orjson
import pytest
from helpers import wait_until
from publisher_fixtures import receive_items, register, registration, running_publisher, write
from websockets.exceptions import ConnectionClosed

from changefeed.publisher.retention import trim_expired
from changefeed.schemas import CloseCode


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


async def _kill_tailer(dsn: str) -> None:
    conn = await asyncpg.connect(dsn)
    try:
        killed = await conn.fetchval(
            "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity"
            " WHERE application_name = 'changefeed-tailer' AND datname = current_database()"
        )
        assert killed == 1
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
        await _kill_tailer(feed_dsn)
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


async def test_a_stats_limit_of_non_decimal_digits_is_a_400_not_a_500(feed_dsn: str) -> None:
    """``?limit=²`` passes ``str.isdigit`` but not ``int()``: a malformed query
    parameter must get the protocol's 400 ``bad_request`` (I6), not an internal error."""
    async with (
        running_publisher(feed_dsn) as pub,
        httpx.AsyncClient(base_url=pub.server.url) as http,
    ):
        response = await http.get("/changefeeds/stats", params={"limit": "\u00b2"})
        assert response.status_code == 400, response.status_code
        assert response.json()["error"]["code"] == "bad_request"


async def test_every_unavailable_close_carries_retry_after(feed_dsn: str) -> None:
    """4010 tells the listener when to come back: "the error frame carries
    ``retryAfter``" (docs/fanout.md, close codes). The 4010 a publisher sends its
    listeners when it recovers from a batch that failed to reach them (or when its
    tailer gave up: ``Sessions.resume_all``) must carry it too, like every other."""
    async with running_publisher(feed_dsn, poll_interval=0.05) as pub:
        ws, _ = await register(pub.ws_url, registration(subs=[]))
        fanout = pub.publisher.broadcast.fanout
        original = fanout.dispatch
        calls = {"n": 0}

        def fails_once(chunk: Any, start: int) -> Any:
            calls["n"] += 1
            if calls["n"] == 1:
                raise RuntimeError("a programming error, once")
            return original(chunk, start)

        fanout.dispatch = fails_once  # type: ignore[method-assign]
        await write(feed_dsn, [("vm", [], "lost")])
        errors: list[dict[str, Any]] = []
        with pytest.raises(ConnectionClosed) as closed:
            async with asyncio.timeout(30):
                while True:
                    doc = orjson.loads(await ws.recv())
                    if isinstance(doc, dict) and "error" in doc:
                        errors.append(doc["error"])
        assert closed.value.rcvd is not None and closed.value.rcvd.code == CloseCode.UNAVAILABLE
        assert [e["code"] for e in errors] == ["unavailable"]
        assert "retryAfter" in errors[0], errors[0]
