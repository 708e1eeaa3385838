"""Every listener at its own pace: catch-up instead of eviction, on real sockets and PostgreSQL.

A listener that reads slower than the feed is written falls behind and
catches up from the window of recent entries or from the feed table; it is
never cut off for being slow. Only one that takes nothing at all for
``stall_timeout`` is closed (4009), and one whose position the feed was
trimmed past (4011, covered in test_publisher.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sys
import time
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import asyncpg
import orjson
import pytest
from helpers import wait_until
from publisher_fixtures import (
    PublisherUnderTest,
    connect_not_reading,
    cursor_before,
    receive_items,
    register,
    registration,
    running_publisher,
)
from websockets.exceptions import ConnectionClosed

from changefeed.publisher import publish_many
from changefeed.schemas import CloseCode

PACED = Path(__file__).with_name("paced_listeners.py")


async def publish_in_one_transaction(dsn: str, ids: list[str]) -> None:
    conn = await asyncpg.connect(dsn)
    try:
        async with conn.transaction():
            await publish_many(conn, [("vm", ["nic"], x) for x in ids])
    finally:
        await conn.close()


@contextlib.asynccontextmanager
async def paced_listeners(
    url: str, expected: int, rates: Sequence[float]
) -> AsyncIterator[asyncio.subprocess.Process]:
    """The listeners of paced_listeners.py, registered and reading, in another process."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        str(PACED),
        url,
        str(expected),
        *map(str, rates),
        stdout=asyncio.subprocess.PIPE,
        limit=1 << 24,  # a line holds all the ids one listener got
    )
    try:
        assert proc.stdout is not None
        line = await asyncio.wait_for(proc.stdout.readline(), 60)
        assert line == b"ready\n", line
        yield proc
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


async def results(proc: asyncio.subprocess.Process, count: int, timeout: float) -> list[Any]:
    assert proc.stdout is not None
    found = []
    async with asyncio.timeout(timeout):
        for _ in range(count):
            found.append(orjson.loads(await proc.stdout.readline()))
        await proc.wait()
    return found


@pytest.mark.parametrize("ws", ["direct", "asgi"])
async def test_ten_rfd5_listeners_at_their_own_pace_get_a_50000_entry_burst_exactly_once(
    feed_dsn: str, ws: str
) -> None:
    """One transaction of 50,000 entries, ten RFD 5 listeners (one item per frame)
    reading at ten different paces: none is evicted, and each gets every entry
    exactly once, in feed order, on the connection it registered."""
    ids = [f"burst-{i:05d}" for i in range(50_000)]
    # Items per second each reads at most (0: as fast as it can).
    rates = [0, 0, 50_000, 30_000, 20_000, 15_000, 12_000, 10_000, 8_000, 6_000]
    async with running_publisher(feed_dsn, ws=ws, stall_timeout=30.0) as pub:
        async with paced_listeners(pub.ws_url, len(ids), rates) as proc:
            await wait_until(lambda: len(pub.publisher.registry) == len(rates))
            await publish_in_one_transaction(feed_dsn, ids)
            got = await results(proc, len(rates), timeout=240)
        stats = pub.publisher.stats()
    for listener in got:
        assert listener["closed"] is None and listener["errors"] == [], listener["rate"]
        assert listener["ids"] == ids, listener["rate"]
    counters = stats["counters"]
    assert counters["evictions"] == 0
    # The slower ones fell behind and caught up; nobody was cut off for it.
    assert counters["fellBehind"] >= 1 and counters["rejoined"] >= counters["fellBehind"] - 1
    print(f"\n{ws}: {counters}")


async def test_a_short_pause_is_caught_up_and_only_a_listener_that_stops_for_good_is_evicted(
    feed_dsn: str,
) -> None:
    """During 10,000 changes, one listener stops reading for less than
    stall_timeout (2 s of 8) and then reads on: it is not evicted and gets
    everything.
    Another stops reading for good: it is evicted once stall_timeout has passed
    without progress. A third, reading all along, is unaffected by either."""
    stall = 8.0
    pause = 2.0
    ids = [f"change-{i:05d}-{'x' * 200}" for i in range(10_000)]
    async with running_publisher(feed_dsn, stall_timeout=stall, queue_size=1000) as pub:
        publisher = pub.publisher
        steady, _ = await register(pub.ws_url, registration(subs=[]), max_queue=None)
        pausing = await connect_not_reading(pub.ws_url)
        await pausing.send(registration(subs=[], service="pausing"))
        await asyncio.wait_for(pausing.recv(), 10)
        stopped = await connect_not_reading(pub.ws_url)
        await stopped.send(registration(subs=[], service="stopped"))
        await asyncio.wait_for(stopped.recv(), 10)
        await wait_until(lambda: len(publisher.registry) == 3)

        async def read_all(ws: Any, after: float = 0.0) -> list[str]:
            await asyncio.sleep(after)
            received: list[str] = []
            async with asyncio.timeout(90):
                while len(received) < len(ids):
                    received.append(orjson.loads(await ws.recv())["changedResourceId"])
            return received

        # The steady one reads all along; the pausing one reads nothing for a
        # while (its socket and then its queue fill: it falls behind), then reads on.
        readers = [
            asyncio.create_task(read_all(steady)),
            asyncio.create_task(read_all(pausing, after=pause)),
        ]
        writer = await asyncpg.connect(feed_dsn)
        try:
            for first in range(0, len(ids), 500):
                await publish_many(writer, [("vm", [], x) for x in ids[first : first + 500]])
        finally:
            await writer.close()
        steady_got, pausing_got = await asyncio.gather(*readers)
        assert steady_got == ids
        assert pausing_got == ids
        stats = publisher.stats()
        assert stats["counters"]["fellBehind"] >= 2  # the pausing and the stopped one
        assert all(e["service"] != "pausing" for e in stats["recentEvictions"])

        # The one that stopped for good is evicted, and only it.
        await wait_until(
            lambda: publisher.stats()["counters"]["evictions"] == 1, timeout=stall + 10
        )
        evicted = publisher.stats()["recentEvictions"]
        assert [(e["service"], e["code"]) for e in evicted] == [("stopped", "slow_listener")]
        assert {r["service"] for r in publisher.stats()["registrations"]} == {"tcns", "pausing"}
        errors: list[str] = []
        with pytest.raises(ConnectionClosed) as closed:
            async with asyncio.timeout(30):
                while True:
                    doc = orjson.loads(await stopped.recv())
                    if "error" in doc:
                        errors.append(doc["error"]["code"])
        assert errors == ["slow_listener"]
        assert closed.value.rcvd is not None
        assert closed.value.rcvd.code == CloseCode.SLOW_LISTENER
        await steady.close()
        await pausing.close()


async def _resume_many(pub: PublisherUnderTest, since: str, count: int, expected: int) -> None:
    async def one() -> list[str]:
        ws, ack = await register(pub.ws_url, registration(subs=[], since=since, batch=True))
        assert ack["resumed"] is True
        try:
            items = await receive_items(ws, expected, timeout=60)
        finally:
            await ws.close()
        return [i["changedResourceId"] for i in items]

    got = await asyncio.gather(*(one() for _ in range(count)))
    assert all(ids == got[0] for ids in got) and len(got[0]) == expected


async def test_listeners_resuming_from_the_feed_table_share_its_pages(feed_dsn: str) -> None:
    """Fifty listeners resume from the same old cursor, behind the window: they
    read the feed table together, a page at a time, not fifty times over."""
    async with running_publisher(feed_dsn, window_bytes=50_000, tail_batch=200) as pub:
        missed: list[tuple[str, list[str], str]] = [
            ("vm", [], f"missed-{i:04d}") for i in range(4000)
        ]
        since = await cursor_before(pub, missed, subs=[])
        stats = pub.publisher.stats()
        assert stats["window"]["entries"] < 1000  # most of what was missed is only in the table
        reader = pub.publisher.reader
        asked = reader.resume_facts
        questions = 0

        async def counted(conn: Any, position: Any) -> Any:
            nonlocal questions
            questions += 1
            return await asked(conn, position)

        reader.resume_facts = counted  # type: ignore[method-assign]
        await _resume_many(pub, since, 50, len(missed))
        counters = pub.publisher.stats()["counters"]
        # The registrations asked about the same cursor together: asked once, or a few times.
        print(f"resume facts asked {questions} times for 50 registrations")
        assert questions <= 10, questions
    pages = len(missed) // 200
    print(f"\npage reads: {counters['pageReads']} for {pages} pages and 50 listeners")
    assert counters["caughtUpFromFeed"] >= 50 * 3000
    assert counters["pageReads"] <= 3 * pages
    assert counters["pagesShared"] >= 40 * pages


async def test_a_listener_reading_slowly_behind_its_backlog_is_not_taken_for_dead(
    feed_dsn: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Its pong waits behind seconds of frames it has yet to read, far past the
    ping timeout; but its TCP stack keeps acknowledging what arrives: it is
    alive, only slow, and is served until it has everything."""
    caplog.set_level(logging.INFO, logger="changefeed")
    # A second's timeout: a slow reader's kernel acknowledges every few hundred ms.
    pings = {"ws_ping_interval": 0.5, "ws_ping_timeout": 1.0}
    ids = [f"slow-{i:04d}-{'x' * 1000}" for i in range(3000)]
    async with running_publisher(feed_dsn, server=pings, stall_timeout=30.0) as pub:
        slow = await connect_not_reading(pub.ws_url, ping_interval=None)
        await slow.send(registration(subs=[]))
        await asyncio.wait_for(slow.recv(), 10)
        writer = await asyncpg.connect(feed_dsn)
        try:
            await publish_many(writer, [("vm", [], x) for x in ids])
        finally:
            await writer.close()
        received: list[str] = []
        started = time.monotonic()
        async with asyncio.timeout(60):
            while time.monotonic() - started < 4:  # ~50 frames a second: ~1 MB behind
                received.append(orjson.loads(await slow.recv())["changedResourceId"])
                await asyncio.sleep(0.02)
            assert len(pub.publisher.registry) == 1  # many ping timeouts later
            while len(received) < len(ids):
                received.append(orjson.loads(await slow.recv())["changedResourceId"])
        assert received == ids
        dropped = [r for r in caplog.records if "keepalive" in str(getattr(r, "cf_fields", {}))]
        assert dropped == []
        await slow.close()


async def test_stats_show_a_listeners_lag_growing_while_it_does_not_read_and_shrinking_when_it_does(
    feed_dsn: str,
) -> None:
    ids = [f"lag-{i:05d}-{'x' * 500}" for i in range(16_000)]
    async with running_publisher(feed_dsn, stall_timeout=120.0, queue_size=1000) as pub:
        idle = await connect_not_reading(pub.ws_url, ping_interval=None)
        await idle.send(registration(subs=[]))
        await asyncio.wait_for(idle.recv(), 10)
        (session,) = pub.publisher.registry

        def lag() -> tuple[int, float]:
            (row,) = pub.publisher.stats()["registrations"]
            return row["lagEntries"], row["lagSeconds"] or 0.0

        assert lag() == (0, 0.0)
        writer = await asyncpg.connect(feed_dsn)
        try:

            async def publish(chunk: list[str], tailed: int) -> None:
                await publish_many(writer, [("vm", [], x) for x in chunk])
                await wait_until(lambda: pub.publisher.tailer.entries_total >= tailed)

            # Enough to fill every buffer between the two: then nothing moves any more
            # (the stall watch notes the last progress).
            await publish(ids[:10_000], 10_000)
            await wait_until(lambda: time.monotonic() - session.delivery.progress_at > 1.5, 30)
            seen = [lag()]
            for first in range(10_000, len(ids), 2000):
                await publish(ids[first : first + 2000], first + 2000)
                seen.append(lag())
        finally:
            await writer.close()
        entries, seconds = [e for e, _ in seen], [s for _, s in seen]
        assert entries == sorted(entries) and len(set(entries)) == len(entries), seen
        assert seconds == sorted(seconds) and seconds[-1] > seconds[0] > 0, seen
        # It reads: the lag shrinks, and is gone once it has everything.
        received = 0
        async with asyncio.timeout(60):
            while received < len(ids) // 2:
                await idle.recv()
                received += 1
            halfway = lag()
            while received < len(ids):
                await idle.recv()
                received += 1
        assert halfway[0] < entries[-1], (halfway, seen)
        await wait_until(lambda: lag() == (0, 0.0), timeout=10)
        await idle.close()
