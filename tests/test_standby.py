"""Publishers that read their feed from a real hot standby (``read_dsn``).

The standby is a real streaming replica of the session's PostgreSQL, made with
``pg_basebackup -R`` (``pg_standby`` in conftest); switchover and failover get
a primary and a standby of their own, since they stop the primary. What is
proven here: every change reaches a listener once and in order through a
standby, with the doorbell ringing from the primary and no feed read there; a
cursor issued by a fresher publisher is held while the standby catches up, or
answered 4010 with ``retryAfter``, never ``resumed: false`` and never resumed
with a gap (I8); the feed's identity, and every cursor, survive a switchover
and a failover; a read replay cancels is read again, and a standby restart
reaches no listener as an error.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Iterator, Sequence
from pathlib import Path
from typing import Any

import asyncpg
import httpx
import pytest
from helpers import free_port, metric_value, standby_caught_up, wait_until
from publisher_fixtures import (
    PublisherUnderTest,
    receive_items,
    register,
    registration,
    running_publisher,
)
from test_deploy_support import ChangefeedServer, stopping
from websockets.asyncio.client import ClientConnection
from websockets.exceptions import ConnectionClosed

from changefeed.embedded import EmbeddedPostgres, standby_of, temporary
from changefeed.publisher import publish
from changefeed.publisher.feed import FeedEntry, FeedReader, ReplicaBehind
from changefeed.publisher.tailer import Tailer
from changefeed.schemas import ORIGIN, Position, apply_schema, notify_channel
from changefeed.stats_view import render_stats


async def publish_each(dsn: str, ids: Sequence[str]) -> None:
    """One committed transaction per id, as API writes are."""
    conn = await asyncpg.connect(dsn)
    try:
        for rid in ids:
            async with conn.transaction():
                await publish(conn, "vm", ["nic"], rid)
    finally:
        await conn.close()


@contextlib.asynccontextmanager
async def on_standby(
    primary_dsn: str, standby_dsn: str, **overrides: Any
) -> AsyncIterator[PublisherUnderTest]:
    """A publisher whose feed reads go to ``standby_dsn`` (``read_dsn``)."""
    async with running_publisher(primary_dsn, read_dsn=standby_dsn, **overrides) as pub:
        yield pub


def ids_of(items: Sequence[dict[str, Any]]) -> list[str]:
    return [item["changedResourceId"] for item in items]


async def application_names(dsn: str) -> list[str]:
    """The application names of the connections to ``dsn``'s database."""
    conn = await asyncpg.connect(dsn)
    try:
        rows = await conn.fetch(
            "SELECT application_name FROM pg_stat_activity"
            " WHERE datname = current_database() AND pid <> pg_backend_pid()"
        )
    finally:
        await conn.close()
    return sorted(r["application_name"] for r in rows)


async def test_a_publisher_reading_a_standby_delivers_every_change_once_in_order(
    feed_dsn: str, standby_dsn: str
) -> None:
    """Writers that commit out of the order they appended in, through a standby: the
    listener gets every change once, in feed order, promptly (the doorbell rings from
    the primary), and the tailer is connected to the standby, not to the primary."""
    async with on_standby(feed_dsn, standby_dsn, poll_interval=30.0) as pub:
        ws, ack = await register(pub.ws_url, registration())
        assert ack["resumed"] is False
        assert pub.publisher.stats()["tailer"]["reads"] == "read_dsn"
        # An early transaction appends first and commits last: the standby's horizon
        # holds everything after it back until it commits, as the primary's does.
        early = await asyncpg.connect(feed_dsn)
        try:
            slow = early.transaction()
            await slow.start()
            await publish(early, "vm", ["nic"], "early")
            await publish_each(feed_dsn, [f"later-{i}" for i in range(20)])
            await standby_caught_up(feed_dsn, standby_dsn)
            await a_read_begun_after_now(pub.publisher.tailer)  # it saw the later ones
            with pytest.raises(TimeoutError):
                await receive_items(ws, 1, timeout=0.2)
            await slow.commit()
        finally:
            await early.close()
        items = await receive_items(ws, 21, timeout=10.0)  # the poll is 30 s away: the doorbell
        assert ids_of(items) == ["early", *(f"later-{i}" for i in range(20))]
        await publish_each(feed_dsn, ["last"])
        (last,) = await receive_items(ws, 1, timeout=10.0)
        assert last["changedResourceId"] == "last"
        assert pub.publisher.tailer.doorbells_total >= 2
        on_primary = await application_names(feed_dsn)
        assert "changefeed-tailer" not in on_primary and "changefeed-doorbell" in on_primary
        assert "changefeed-tailer" in await application_names(standby_dsn)
        # What `changefeed stats` shows of it.
        assert "reads read_dsn; doorbell listening" in render_stats(pub.publisher.stats())
        await ws.close()


async def a_read_begun_after_now(tailer: Tailer) -> None:
    """Return once ``tailer`` has finished a read of the feed that began after this call.

    A tailer's reads run one after another: of two reads that end after the call,
    the second began after the first had ended."""
    for _ in range(2):
        since = time.monotonic()  # the clock of Tailer.last_read_at

        def ended_since(since: float = since) -> bool:
            return (tailer.last_read_at or 0.0) > since

        await wait_until(ended_since, message="a read of the standby")


@contextlib.asynccontextmanager
async def replay_paused(standby_dsn: str) -> AsyncIterator[asyncpg.Connection]:
    """The standby stops replaying WAL (``pg_wal_replay_pause()``) until the block ends,
    or until the yielded connection resumes it."""
    conn = await asyncpg.connect(standby_dsn)
    try:
        await conn.execute("SELECT pg_wal_replay_pause()")

        async def paused() -> bool:
            state = await conn.fetchval("SELECT pg_get_wal_replay_pause_state()")
            return bool(state == "paused")

        await wait_until(paused, message="replay paused")
        yield conn
    finally:
        await conn.execute("SELECT pg_wal_replay_resume()")
        await conn.close()


async def refusal(ws: ClientConnection, first: dict[str, Any]) -> tuple[dict[str, Any], int | None]:
    """The error of a refused registration and the close code that followed it."""
    with contextlib.suppress(Exception):
        async with asyncio.timeout(10):
            await ws.wait_closed()
    return first["error"], ws.close_code


async def test_a_fresher_cursor_is_held_until_the_standby_replays_it_never_reset(
    feed_dsn: str, standby_dsn: str
) -> None:
    """A cursor from a publisher on the primary, presented to one whose standby has
    paused replay: answered 4010 with retryAfter once ``standby_wait`` has passed, and
    held (then resumed, with no gap and nothing twice) when replay goes on meanwhile.
    Never ``resumed: false``."""
    async with (
        running_publisher(feed_dsn) as fresh,
        on_standby(feed_dsn, standby_dsn, standby_wait=1.5) as lagging,
    ):
        ws, _ = await register(fresh.ws_url, registration())
        async with replay_paused(standby_dsn) as standby:
            await publish_each(feed_dsn, ["x1", "x2", "x3"])
            seen = await receive_items(ws, 3)
            assert ids_of(seen) == ["x1", "x2", "x3"]
            since = seen[-1]["cursor"]

            started = asyncio.get_running_loop().time()
            late, first = await register(lagging.ws_url, registration(since=since))
            error, code = await refusal(late, first)
            assert code == 4010 and error["code"] == "unavailable", (code, error)
            assert error["retryAfter"] > 0
            assert asyncio.get_running_loop().time() - started >= 1.4  # held, then refused

            primary = lagging.publisher.standby
            assert primary is not None
            asked = primary.positions_asked
            held = asyncio.create_task(register(lagging.ws_url, registration(since=since)))
            await wait_until(
                lambda: primary.positions_asked > asked,
                message="the primary's position asked for the held cursor",
            )
            assert not held.done()  # held while the standby is behind the cursor
            await standby.execute("SELECT pg_wal_replay_resume()")
            resumed, ack = await held
        assert ack["resumed"] is True, ack
        await publish_each(feed_dsn, ["y1", "y2"])
        after = await receive_items(resumed, 2)
        assert ids_of(after) == ["y1", "y2"]  # nothing before the cursor again, nothing missed
        with pytest.raises(TimeoutError):
            await receive_items(resumed, 1, timeout=0.5)
        refused = lagging.publisher.counters.refusals
        assert sum(n for (code, _), n in refused.items() if code == "unavailable") == 1
        assert lagging.publisher.counters.registrations["vm", False] == 0
        await ws.close()
        await resumed.close()


async def test_a_cursor_of_an_identity_the_standby_has_not_replayed_is_held_not_reset(
    feed_dsn: str, standby_dsn: str
) -> None:
    """The feed gets a new identity (a restore) on the primary while the standby's
    replay is paused; a publisher on the primary issues a cursor of it. The publisher
    on the standby still sees the old identity: to it the cursor looks like another
    feed's, which it must not believe before its standby has caught up: 4010, and
    once replay goes on, the same cursor resumes. Never ``resumed: false``."""
    async with on_standby(feed_dsn, standby_dsn, standby_wait=1.5) as lagging:
        async with replay_paused(standby_dsn) as standby:
            conn = await asyncpg.connect(feed_dsn)
            try:
                reader = FeedReader()
                await reader.rotate_identity(conn, (await reader.state(conn)).feed_id)
            finally:
                await conn.close()
            async with running_publisher(feed_dsn) as fresh:
                ws, _ = await register(fresh.ws_url, registration())
                await publish_each(feed_dsn, ["x1"])
                (seen,) = await receive_items(ws, 1)
                await ws.close()
            late, first = await register(lagging.ws_url, registration(since=seen["cursor"]))
            assert "error" in first, first  # not an ack (resumed: false)
            error, code = await refusal(late, first)
            assert code == 4010 and error["code"] == "unavailable", (code, error, first)
            await standby.execute("SELECT pg_wal_replay_resume()")

        async def resumes() -> bool:
            ws, ack = await register(lagging.ws_url, registration(since=seen["cursor"]))
            await ws.close()
            assert ack.get("resumed") is not False, ack  # held or 4010, never reset
            return ack.get("resumed") is True

        await wait_until(resumes, timeout=30, message="the cursor resumes on the standby")
        assert lagging.publisher.counters.registrations["vm", False] == 0


async def test_a_stalled_replay_shows_as_tailer_lag_and_clears_once_replayed(
    feed_dsn: str, standby_dsn: str
) -> None:
    """A standby that stops replaying delivers nothing, so the newest entry's age says
    nothing: the tailer's lag (stats and metric, what ChangefeedTailerLag watches)
    grows with the wait of the oldest transaction the doorbell named, and falls back
    once the standby has replayed it and the entry is delivered."""
    async with on_standby(feed_dsn, standby_dsn) as pub:
        ws, _ = await register(pub.ws_url, registration())

        def lag() -> float:
            return float(pub.publisher.stats()["tailer"]["lagSeconds"])

        async with replay_paused(standby_dsn) as standby:
            await publish_each(feed_dsn, ["stalled"])
            await wait_until(lambda: lag() >= 1.0, timeout=15, message="the lag grows")
            metrics = pub.publisher.metrics.render().decode()
            assert metric_value(metrics, "changefeed_tailer_lag_seconds") >= 1.0
            await standby.execute("SELECT pg_wal_replay_resume()")
            (item,) = await receive_items(ws, 1, timeout=15)
        assert item["changedResourceId"] == "stalled"
        await wait_until(lambda: lag() < 1.0, timeout=15, message="the lag falls back")
        await ws.close()


@pytest.fixture
def replicated(pg_standby: EmbeddedPostgres) -> Iterator[tuple[EmbeddedPostgres, EmbeddedPostgres]]:
    """A primary and a streaming standby of their own, for a test that stops the
    primary (``pg_standby`` only says that standbys can be made here)."""
    primary = temporary()
    try:
        primary.start()
        standby = standby_of(primary)
        try:
            standby.start()
            yield primary, standby
        finally:
            standby.close()
    finally:
        primary.close()


async def _feed_on_both(primary: EmbeddedPostgres, standby: EmbeddedPostgres) -> str:
    """The feed schema on ``primary``, replayed by ``standby``; a DSN naming both."""
    conn = await asyncpg.connect(primary.dsn)
    try:
        await apply_schema(conn)
    finally:
        await conn.close()
    await standby_caught_up(primary.dsn, standby.dsn)
    return f"postgresql://postgres@127.0.0.1:{primary.port},127.0.0.1:{standby.port}/postgres"


@pytest.mark.parametrize("how", ["switchover", "failover"])
async def test_every_cursor_resumes_on_the_promoted_standby(
    replicated: tuple[EmbeddedPostgres, EmbeddedPostgres], how: str
) -> None:
    """The primary goes away (stopped cleanly for a switchover; killed, once the standby
    had everything, for a failover) and the standby is promoted. A cursor issued by a
    publisher on the old primary resumes on a publisher of the promoted server, with
    nothing lost or repeated; a publisher that was reading the standby keeps serving
    its listener through the promotion (its doorbell finds the new primary through a
    multi-host ``dsn``). The feed's identity lives in the database, so it is the same."""
    primary, standby = replicated
    both = await _feed_on_both(primary, standby)
    async with on_standby(
        f"{both}?target_session_attrs=read-write", standby.dsn, create_schema=False
    ) as reading_standby:
        through_standby, _ = await register(reading_standby.ws_url, registration())
        async with running_publisher(primary.dsn) as old:
            ws, _ = await register(old.ws_url, registration())
            await publish_each(primary.dsn, ["a1", "a2", "a3"])
            seen = await receive_items(ws, 3)
            assert ids_of(seen) == ["a1", "a2", "a3"]
        assert ids_of(await receive_items(through_standby, 3)) == ["a1", "a2", "a3"]
        if how == "switchover":
            primary.stop()  # a clean stop sends every last record to the standby first
        else:
            await standby_caught_up(primary.dsn, standby.dsn)
            primary.crash()
        standby.promote()
        await publish_each(standby.dsn, ["b1", "b2"])
        async with running_publisher(standby.dsn) as promoted:
            again, ack = await register(promoted.ws_url, registration(since=seen[-1]["cursor"]))
            assert ack["resumed"] is True, ack
            assert ids_of(await receive_items(again, 2)) == ["b1", "b2"]
            await again.close()
        # The publisher that read the standby never lost its listener.
        assert ids_of(await receive_items(through_standby, 2, timeout=30)) == ["b1", "b2"]
        await wait_until(
            lambda: (
                reading_standby.publisher.doorbell is not None
                and reading_standby.publisher.doorbell.status == "listening"
            ),
            timeout=30,
            message="the doorbell listens on the promoted server",
        )
        await publish_each(standby.dsn, ["c1"])
        assert ids_of(await receive_items(through_standby, 1, timeout=10)) == ["c1"]
        await through_standby.close()


async def _cut_off(standby: EmbeddedPostgres) -> None:
    """The standby stops receiving WAL (as an asynchronous standby falls behind)."""
    conn = await asyncpg.connect(standby.dsn)
    try:
        await conn.execute("ALTER SYSTEM SET primary_conninfo = ''")
        await conn.execute("SELECT pg_reload_conf()")

        async def stopped() -> bool:
            return not await conn.fetchval("SELECT count(*) FROM pg_stat_wal_receiver")

        await wait_until(stopped, timeout=30, message="the WAL receiver stopped")
    finally:
        await conn.close()


async def _register_until_answered(
    pub: PublisherUnderTest, cursor: str
) -> tuple[ClientConnection, Any]:
    """Register with ``cursor``, again while answered 4010 (bounded); the ack."""
    async with asyncio.timeout(30):
        while True:
            ws, first = await register(pub.ws_url, registration(since=cursor))
            if "error" not in first:
                return ws, first
            error, _ = await refusal(ws, first)
            assert error["code"] == "unavailable", error
            await asyncio.sleep(error.get("retryAfter", 0.2))


async def _closed_with(ws: ClientConnection) -> int | None:
    """The close code ``ws`` ends with (items before it are read and dropped)."""
    with pytest.raises(ConnectionClosed) as closed:
        async with asyncio.timeout(60):
            while True:
                await ws.recv()
    return None if closed.value.rcvd is None else closed.value.rcvd.code


async def test_a_failover_that_loses_commits_gives_the_feed_a_new_identity_everywhere(
    replicated: tuple[EmbeddedPostgres, EmbeddedPostgres],
) -> None:
    """The standby is cut off, the primary commits two entries a publisher on it
    delivers, the primary dies and the standby is promoted without them. That
    publisher notices and gives the feed a new identity (its listeners bootstrap: with
    commits out of transaction-id order, a kept entry can follow a lost one, so no
    cursor of the old history can be trusted). The publisher that read the standby
    kept its connection through the promotion: it takes the new identity as soon as a
    registration shows it (not signing old cursors, which every other publisher refuses,
    for as long as its connection lasts), and from then on both publishers resume each
    other's cursors."""
    primary, standby = replicated
    both = await _feed_on_both(primary, standby)
    writer = f"{both}?target_session_attrs=read-write"
    async with (
        on_standby(writer, standby.dsn, create_schema=False) as reads_standby,
        running_publisher(writer, create_schema=False, poll_interval=0.05) as reads_primary,
    ):
        on_primary, _ = await register(reads_primary.ws_url, registration())
        on_standby_, _ = await register(reads_standby.ws_url, registration())
        await publish_each(primary.dsn, ["a1"])
        old_cursor = (await receive_items(on_standby_, 1))[0]["cursor"]
        await receive_items(on_primary, 1)
        await standby_caught_up(primary.dsn, standby.dsn)
        await _cut_off(standby)
        await publish_each(primary.dsn, ["lost1", "lost2"])
        lost = await receive_items(on_primary, 2)
        primary.crash()
        standby.promote()
        assert await _closed_with(on_primary) == 4011
        new_identity = reads_primary.publisher.identity.feed_id
        assert new_identity != reads_standby.publisher.identity.feed_id  # not told yet

        fresh, _ = await register(reads_primary.ws_url, registration())
        await publish_each(standby.dsn, ["b1", "b2"])
        renewed = (await receive_items(fresh, 2, timeout=30))[0]["cursor"]
        # A cursor of the new identity: the standby's publisher finds out, joins the
        # feed again (closing its own listener, whose cursors are of the old history),
        # and resumes it, in answer to that registration (not a 4010 to retry).
        ws, ack = await register(reads_standby.ws_url, registration(since=renewed))
        assert ack.get("resumed") is True, ack
        assert ids_of(await receive_items(ws, 1, timeout=30)) == ["b2"]
        await ws.close()
        assert reads_standby.publisher.identity.feed_id == new_identity
        assert await _closed_with(on_standby_) == 4011
        for pub in (reads_primary, reads_standby):
            for cursor in (old_cursor, lost[-1]["cursor"]):
                ws, ack = await _register_until_answered(pub, cursor)
                assert (ack["resumed"], ack["reason"]) == (False, "other_feed"), ack
                await ws.close()
            # What either issues now, the other resumes.
            ws, ack = await register(pub.ws_url, registration())
            await publish_each(standby.dsn, [f"c-{pub is reads_primary}"])
            (item,) = await receive_items(ws, 1, timeout=30)
            await ws.close()
            other = reads_standby if pub is reads_primary else reads_primary
            ws, ack = await _register_until_answered(other, item["cursor"])
            assert ack["resumed"] is True, ack
            await ws.close()
        await fresh.close()


async def test_a_page_a_standby_has_not_replayed_is_refused_not_taken_for_an_empty_one(
    feed_dsn: str, standby_dsn: str
) -> None:
    """A catch-up page reaches as far as the tailer has read. A standby behind that
    (another standby behind the same address, or one that restarted) answers the
    page query with no entries: that must be an error the catch-up retries, never a
    page that says there is nothing there."""
    reader = FeedReader()
    primary, standby = await asyncpg.connect(feed_dsn), await asyncpg.connect(standby_dsn)
    try:
        async with replay_paused(standby_dsn) as pausing:
            await publish_each(feed_dsn, ["p1", "p2", "p3"])
            upto = await reader.head(primary)
            assert upto > ORIGIN
            page = await reader.read_page(primary, ORIGIN, upto, ["vm"], 100)
            assert [e.changed_resource_id for e in page.entries] == ["p1", "p2", "p3"]
            with pytest.raises(ReplicaBehind):
                await reader.read_page(standby, ORIGIN, upto, ["vm"], 100)
            await pausing.execute("SELECT pg_wal_replay_resume()")
        await standby_caught_up(feed_dsn, standby_dsn)
        page = await reader.read_page(standby, ORIGIN, upto, ["vm"], 100)
        assert [e.changed_resource_id for e in page.entries] == ["p1", "p2", "p3"]
    finally:
        await primary.close()
        await standby.close()


class SlowRead(FeedReader):
    """The feed's reads, one of which, once armed, takes long while holding the feed
    table's lock on the standby (as a read of a large batch does): replay that needs
    the table for itself then cancels it."""

    def __init__(self) -> None:
        super().__init__()
        self.armed = asyncio.Event()
        self.reading = asyncio.Event()

    async def read_after_horizon(
        self, conn: Any, after: Position, limit: int
    ) -> tuple[list[FeedEntry], int]:
        if self.armed.is_set() and not self.reading.is_set():
            self.reading.set()
            await conn.fetchval("SELECT pg_sleep(10) FROM (SELECT count(*) FROM changefeed.feed) c")
        return await super().read_after_horizon(conn, after, limit)


async def test_a_read_replay_cancels_is_read_again_on_the_same_connection(
    feed_dsn: str, standby_dsn: str
) -> None:
    """A tailer on the standby is mid-read when the primary takes the feed table's
    ACCESS EXCLUSIVE lock (a migration): after ``max_standby_streaming_delay`` (500 ms
    here) the standby cancels the read with SQLSTATE 40001. The tailer reads again,
    without reconnecting, and hands on every entry once, in order."""
    reader = SlowRead()
    tailed: list[FeedEntry] = []
    tailer = Tailer(
        lambda: asyncpg.connect(standby_dsn),
        reader,
        notify_channel("changefeed"),
        tailed.extend,
        poll_interval=0.05,
        standby=True,
    )
    running = asyncio.create_task(tailer.run())
    try:
        await asyncio.wait_for(tailer.ready.wait(), 10)
        await publish_each(feed_dsn, ["a1", "a2"])
        await wait_until(lambda: len(tailed) == 2, message="a1 and a2 tailed")
        reader.armed.set()
        await asyncio.wait_for(reader.reading.wait(), 10)
        migration = await asyncpg.connect(feed_dsn)
        try:
            async with migration.transaction():
                await migration.execute("LOCK TABLE changefeed.feed IN ACCESS EXCLUSIVE MODE")
                await publish(migration, "vm", ["nic"], "b1")
        finally:
            await migration.close()
        await wait_until(lambda: tailer.replay_conflicts_total == 1, timeout=8, message="cancelled")
        await publish_each(feed_dsn, ["b2"])
        await wait_until(lambda: len(tailed) >= 4, message="b1 and b2 tailed")
        assert [e.changed_resource_id for e in tailed] == ["a1", "a2", "b1", "b2"]
        assert tailer.reconnects_total == 0 and tailer.status == "running"
    finally:
        running.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await running


async def test_a_standby_restart_reaches_no_listener_as_an_error(
    feed_dsn: str, standby_dsn: str, pg_standby: EmbeddedPostgres
) -> None:
    """The standby a publisher reads is stopped and started again while changes are
    written. A listener that stays connected gets every change once, in order, and
    no error; one that registers with its cursor meanwhile is held while the tailer
    reconnects (or told to retry with 4010 if the standby stays away longer than
    that) and resumes: never ``resumed: false``."""
    async with on_standby(feed_dsn, standby_dsn) as pub:
        staying, _ = await register(pub.ws_url, registration())
        leaving, _ = await register(pub.ws_url, registration())
        await publish_each(feed_dsn, ["r1"])
        assert ids_of(await receive_items(staying, 1)) == ["r1"]
        (r1,) = await receive_items(leaving, 1)
        await leaving.close()
        await asyncio.to_thread(pg_standby.stop)
        await publish_each(feed_dsn, ["r2"])
        tailer = pub.publisher.tailer
        await wait_until(lambda: not tailer.ready.is_set(), timeout=30, message="tailer away")
        # Registered while the tailer is away: held until it has joined the feed again.
        back = asyncio.create_task(_register_until_answered(pub, r1["cursor"]))
        await asyncio.to_thread(pg_standby.start)
        assert pg_standby.dsn_for(standby_dsn.rsplit("/", 1)[1]) == standby_dsn
        again, ack = await back
        assert ack.get("resumed") is True, ack
        await publish_each(feed_dsn, ["r3"])
        assert ids_of(await receive_items(again, 2, timeout=30)) == ["r2", "r3"]
        assert ids_of(await receive_items(staying, 2, timeout=30)) == ["r2", "r3"]
        assert staying.close_code is None
        await staying.close()
        await again.close()


async def test_the_doorbell_rests_while_the_feed_flows_and_nothing_waits_for_the_poll(
    feed_dsn: str, standby_dsn: str
) -> None:
    """Writes at a few hundred commits a second: after a second the doorbell stops
    listening on the primary (each ring costs the primary a wake-up per publisher)
    and the tailer reads the standby on its own; once the writes stop it listens
    again. Every change arrives once, in order, all the while, and one written after
    the rest is delivered by the doorbell, long before the 30 s poll."""
    async with on_standby(feed_dsn, standby_dsn, poll_interval=30.0) as pub:
        doorbell = pub.publisher.doorbell
        assert doorbell is not None
        ws, _ = await register(pub.ws_url, registration(batch=True))
        conn = await asyncpg.connect(feed_dsn)
        written: list[str] = []
        try:
            async with asyncio.timeout(30):
                while doorbell.status != "resting":  # written until it rests (a second or so)
                    rid = f"w{len(written)}"
                    async with conn.transaction():
                        await publish(conn, "vm", ["nic"], rid)
                    written.append(rid)
            for _ in range(100):  # and a while longer, while it rests
                rid = f"w{len(written)}"
                async with conn.transaction():
                    await publish(conn, "vm", ["nic"], rid)
                written.append(rid)
        finally:
            await conn.close()
        assert ids_of(await receive_items(ws, len(written), timeout=30)) == written
        await wait_until(lambda: doorbell.status == "listening", message="listening again")
        assert doorbell.rests_total >= 1
        await publish_each(feed_dsn, ["after"])
        assert ids_of(await receive_items(ws, 1, timeout=10)) == ["after"]
        await ws.close()


async def test_example_api_read_dsn_from_the_command_line(
    feed_dsn: str, standby_dsn: str, tmp_path: Path
) -> None:
    """``changefeed example-api --dsn PRIMARY --read-dsn STANDBY``: the API writes to the
    primary, its publisher reads the standby, and a listener gets the API's change."""
    port = free_port()
    api = ChangefeedServer(
        "api", ["example-api", "--dsn", feed_dsn, "--read-dsn", standby_dsn, "--port", str(port)],
        port, tmp_path,
    )  # fmt: skip
    api.start()
    async with stopping(api):
        await api.wait_ready()
        assert (await api.stats())["tailer"]["reads"] == "read_dsn"
        ws, _ = await register(api.ws_url, registration())
        async with httpx.AsyncClient(base_url=api.url, timeout=10) as http:
            created = await http.post("/vms", json={"alias": "via-the-standby", "nics": []})
            assert created.status_code == 201, created.text
        (item,) = await receive_items(ws, 1, timeout=10)
        assert item["changedResourceId"] == created.json()["uuid"]
        await ws.close()
    # A --read-dsn that cannot be reached is refused at start-up, naming the option.
    refused = ChangefeedServer(
        "refused",
        ["example-api", "--dsn", feed_dsn, "--read-dsn", "postgresql://postgres@127.0.0.1:9/x"],
        free_port(), tmp_path,
    )  # fmt: skip
    refused.start()
    async with stopping(refused):
        assert await refused.wait_exit(30) != 0
    assert "--read-dsn" in refused.log()


async def test_the_drops_wait_for_standbys_not_wal_receivers_and_not_past_an_away_slot(
    feed_dsn: str, standby_dsn: str, pg_server: Any, tmp_path: Path
) -> None:
    """``pg_receivewal`` streams the WAL and never replays it: the wait does not count
    it as a standby for ever behind (no run could drop). An inactive physical slot
    says only what its standby had *flushed*, not that it is caught up: its standby
    may come back serving keepers it has not replayed, so it counts as behind until
    the standby is back, or the slot is dropped."""
    from changefeed.compaction.apply import CompactionStore
    from changefeed.compaction.errors import CompactionError
    from changefeed.embedded import find_postgres_bindir

    conn = await asyncpg.connect(feed_dsn)
    receiver = await asyncio.create_subprocess_exec(
        str(find_postgres_bindir() / "pg_receivewal"),
        *("-D", str(tmp_path), "-d", pg_server.dsn, "-s", "1", "--no-loop"),
    )  # fmt: skip
    slot = f"away_{free_port()}"
    try:
        store = CompactionStore(conn, "changefeed")
        await store.prepare()

        async def receiving() -> bool:
            return bool(
                await conn.fetchval(
                    "SELECT count(*) FROM pg_stat_replication"
                    " WHERE application_name = 'pg_receivewal' AND write_lsn IS NOT NULL"
                )
            )

        await wait_until(receiving, 30, message="pg_receivewal streams")
        await store.announce(Position(10, 5))
        names = await store.wait_for_standbys(30.0)
        assert names and "pg_receivewal" not in names, names  # the standby, only
        await conn.execute("SELECT pg_create_physical_replication_slot($1, true)", slot)
        with pytest.raises(CompactionError, match=f"slot {slot}"):
            await store.wait_for_standbys(0.3)
    finally:
        await conn.execute(
            "SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots"
            " WHERE slot_name = $1",
            slot,
        )
        receiver.terminate()
        await asyncio.wait_for(receiver.wait(), 30)
        await conn.close()


async def test_the_compaction_drops_wait_until_the_standby_has_replayed_the_keepers(
    feed_dsn: str, standby_dsn: str
) -> None:
    """Before any drop the job waits for every standby to replay what it wrote (the
    widened keepers): with replay paused the wait ends in an error after its
    seconds (the drops are left to the next run), and once replay goes on it ends
    as soon as the standby has caught up."""
    from changefeed.compaction.apply import CompactionStore
    from changefeed.compaction.errors import CompactionError

    conn = await asyncpg.connect(feed_dsn)
    try:
        # As a server may run: a commit's WAL need not be written out at once.
        await conn.execute("SET synchronous_commit = off")
        store = CompactionStore(conn, "changefeed")
        await store.prepare()
        async with replay_paused(standby_dsn) as standby:
            await store.announce(Position(10, 5))  # a write the standby has not replayed
            with pytest.raises(CompactionError, match="has not replayed"):
                await store.wait_for_standbys(0.5)
            waiting = asyncio.create_task(store.wait_for_standbys(60.0))
            done, _ = await asyncio.wait({waiting}, timeout=0.5)
            assert not done  # still waiting while replay is paused
            await standby.execute("SELECT pg_wal_replay_resume()")
            names = await asyncio.wait_for(waiting, 30)
        assert names, "the standby it waited for is named"
    finally:
        await conn.close()


async def test_an_old_identity_on_a_standby_behind_is_waited_out_not_adopted(
    feed_dsn: str, standby_dsn: str
) -> None:
    """The feed gets a new identity on the primary and the publisher already follows it
    when its tailer joins again through a standby that has not replayed it (replay
    paused): the standby shows the old identity. Believed at once, the publisher
    would go back to it, close every listener with 4011 and sign cursors no other
    publisher accepts; it waits for the standby instead (``ReplicaBehind`` when the
    wait runs out: the tailer joins again), and once replay goes on the join keeps
    the new identity and its position."""
    from changefeed.publisher.identity import FeedIdentity, join_feed
    from changefeed.publisher.pages import FeedPages
    from changefeed.publisher.standby import Standby
    from changefeed.publisher.window import Window

    await publish_each(feed_dsn, ["before"])
    await standby_caught_up(feed_dsn, standby_dsn)
    reader = FeedReader()

    async def no_page(*args: Any) -> Any:
        raise AssertionError("a join reads no page")

    async with (
        asyncpg.create_pool(feed_dsn, min_size=1, max_size=2) as primary,
        replay_paused(standby_dsn) as paused,
    ):
        async with primary.acquire() as conn:
            head, stamp = await reader.head_entry(conn)
            new = await reader.rotate_identity(conn, (await reader.state(conn)).feed_id)
        identity = FeedIdentity()
        identity.adopt(new)  # as a registration carrying the new identity made it do
        changed: list[str] = []

        async def join(wait: float) -> tuple[Position, int]:
            window = Window(head, 1 << 20, lambda e: e.changed_resource_id)
            pages = FeedPages(
                no_page, lambda e: e.changed_resource_id, page_size=10, max_bytes=1 << 20
            )
            conn = await asyncpg.connect(standby_dsn)
            try:
                return await join_feed(
                    conn,
                    head,
                    stamp,
                    reader=reader,
                    identity=identity,
                    window=window,
                    pages=pages,
                    feed_changed=changed.append,
                    resume_all=changed.append,
                    standby=Standby(lambda: primary, wait=wait),
                )
            finally:
                await conn.close()

        with pytest.raises(ReplicaBehind):
            await join(0.5)
        assert identity.feed_id == new.feed_id and changed == []
        waiting = asyncio.create_task(join(30.0))
        await paused.execute("SELECT pg_wal_replay_resume()")
        assert await asyncio.wait_for(waiting, 30) == (head, stamp)
    assert identity.feed_id == new.feed_id and changed == []  # nobody closed, nothing reset


async def test_a_burst_of_fresher_cursors_waits_for_the_replay_on_few_connections(
    feed_dsn: str, standby_dsn: str
) -> None:
    """20 cursors of a fresher publisher reach a publisher whose standby lags: the wait
    is one per replay target, rather than each cursor holding a connection of the read
    pool for the whole wait (the others' reads then going to the primary). The
    primary's position is asked in at most two rounds, so at most two connections
    wait, however many cursors do; all 20 are answered once replay goes on."""
    from changefeed.publisher.resume_queries import ResumeQueries
    from changefeed.publisher.standby import Standby

    async with (
        asyncpg.create_pool(feed_dsn, min_size=1, max_size=2) as primary,
        asyncpg.create_pool(standby_dsn, min_size=1, max_size=20) as reads,
        replay_paused(standby_dsn) as paused,
    ):
        await publish_each(feed_dsn, ["unreplayed"])  # the primary is ahead now
        queries = ResumeQueries(
            FeedReader(), lambda: reads, 5.0, standby=Standby(lambda: primary, wait=30.0)
        )
        cursors = [Position(100 + n, n) for n in range(20)]
        asked = [asyncio.create_task(queries.caught_up(position)) for position in cursors]

        async def polls() -> list[asyncpg.Record]:
            return await paused.fetch(
                "SELECT pid, query_start FROM pg_stat_activity"
                " WHERE query LIKE '%pg_last_wal_replay_lsn%' AND pid <> pg_backend_pid()"
            )

        waiting: list[asyncpg.Record] = []

        async def someone_waits() -> bool:
            waiting[:] = await polls()
            return bool(waiting)

        await wait_until(someone_waits, 10, message="a connection waits for the replay")
        pid, seen = waiting[0]["pid"], {waiting[0]["query_start"]}

        async def polled_again() -> bool:  # time for every cursor to have asked
            seen.update(r["query_start"] for r in await polls() if r["pid"] == pid)
            return len(seen) >= 4

        await wait_until(polled_again, 10, message="the wait polls the standby")
        assert len(await polls()) <= 2
        assert reads.get_size() - reads.get_idle_size() <= 2
        assert not any(task.done() for task in asked)
        await paused.execute("SELECT pg_wal_replay_resume()")
        answers = await asyncio.wait_for(asyncio.gather(*asked), 30)
    assert len(answers) == 20 and all(a.state.feed_id for a in answers)
