"""The feed as the trustworthy core: nothing skipped (I1), HA, reconnects, restarts.

Real PostgreSQL, real publishers on uvicorn, real websocket listeners.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
from collections import Counter
from typing import Any

import asyncpg
import httpx
import orjson
import pytest
from helpers import metric_value, terminate_tailer, wait_until
from publisher_fixtures import VM, receive_items, register, registration, running_publisher

from changefeed.embedded import EmbeddedPostgres, temporary
from changefeed.publisher import Publisher, PublisherConfig, publish
from changefeed.publisher import tailer as tailer_module
from changefeed.schemas import apply_schema

WRITERS = 16
ENTRIES = 20_000


async def _writer(dsn: str, name: str, entries: int, rng: random.Random, done: list[str]) -> None:
    """Transactions of 1-5 entries held open for random durations: appended early,
    committed late, interleaved with the other writers."""
    conn = await asyncpg.connect(dsn)
    try:
        written = 0
        while written < entries:
            batch = min(rng.randint(1, 5), entries - written)
            ids = [f"{name}-{written + i}" for i in range(batch)]
            async with conn.transaction():
                for changed_id in ids:
                    await publish(conn, "vm", ["nic"], changed_id)
                    if rng.random() < 0.3:
                        await asyncio.sleep(rng.random() * 0.004)
                if rng.random() < 0.05:
                    await asyncio.sleep(rng.random() * 0.05)
            done.extend(ids)
            written += batch
    finally:
        await conn.close()


async def _held_writer(dsn: str, hold: asyncio.Event, done: list[str]) -> None:
    """Appends first and commits last: the entry a naive `id > last` reader skips."""
    conn = await asyncpg.connect(dsn)
    try:
        async with conn.transaction():
            await publish(conn, "vm", ["nic"], "held-0")
            await asyncio.wait_for(hold.wait(), 60)
        done.append("held-0")
    finally:
        await conn.close()


async def _naive_reader(dsn: str, stop: asyncio.Event, seen: list[str]) -> None:
    """What the horizon prevents: a reader of id > last, polling as fast as it can."""
    conn = await asyncpg.connect(dsn)
    last = 0
    try:
        while True:
            rows = await conn.fetch(
                "SELECT id, changed_resource_id FROM changefeed.feed WHERE id > $1 "
                "ORDER BY id LIMIT 1000",
                last,
            )
            if rows:
                last = rows[-1]["id"]
                seen.extend(r["changed_resource_id"] for r in rows)
            elif stop.is_set():
                return
            await asyncio.sleep(0.001)
    finally:
        await conn.close()


async def test_concurrent_writers_committing_out_of_order_lose_nothing(feed_dsn: str) -> None:
    rng = random.Random(20261122)
    async with running_publisher(feed_dsn, tail_batch=2000, queue_size=50_000) as pub:
        ws, _ = await register(pub.ws_url, registration(subs=["nic"], batch=True), max_size=None)
        received: list[str] = []

        async def listen() -> None:
            while True:
                doc = orjson.loads(await ws.recv())
                received.extend(i["changedResourceId"] for i in doc)

        listener = asyncio.create_task(listen())
        committed: list[str] = []
        naive_seen: list[str] = []
        stop_naive = asyncio.Event()
        hold = asyncio.Event()
        naive = asyncio.create_task(_naive_reader(feed_dsn, stop_naive, naive_seen))
        held = asyncio.create_task(_held_writer(feed_dsn, hold, committed))
        per_writer = (ENTRIES - 1) // WRITERS
        writers = [
            asyncio.create_task(
                _writer(
                    feed_dsn,
                    f"w{n}",
                    per_writer + (n < (ENTRIES - 1) % WRITERS),
                    random.Random(rng.random()),
                    committed,
                )
            )
            for n in range(WRITERS)
        ]
        await asyncio.wait_for(asyncio.gather(*writers), 120)
        hold.set()
        await asyncio.wait_for(held, 10)
        assert len(committed) == ENTRIES
        await wait_until(
            lambda: len(received) >= ENTRIES,
            timeout=60,
            message="every committed entry reaches the listener",
        )
        stop_naive.set()
        await asyncio.wait_for(naive, 30)
        listener.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await listener
        await ws.close()

    counts = Counter(received)
    assert set(counts) == set(committed), "the listener got every committed entry"
    assert max(counts.values()) == 1, "and each exactly once"
    # The same workload defeats an `id > last` reader: it skipped entries.
    skipped = set(committed) - set(naive_seen)
    assert "held-0" in skipped
    assert len(skipped) >= 1


async def test_three_publishers_on_one_feed_all_deliver_everything(feed_dsn: str) -> None:
    async with contextlib.AsyncExitStack() as stack:
        pubs = [await stack.enter_async_context(running_publisher(feed_dsn)) for _ in range(3)]
        sockets = [(await register(p.ws_url, registration(subs=[])))[0] for p in pubs]
        # Writers use three separate connections, as three API instances would.
        conns = [await asyncpg.connect(feed_dsn) for _ in range(3)]
        try:
            for i in range(300):
                async with conns[i % 3].transaction():
                    await publish(conns[i % 3], "vm", ["alias"], f"vm{i}")
        finally:
            for conn in conns:
                await conn.close()
        for ws in sockets:
            items = await receive_items(ws, 300, timeout=20)
            assert [i["changedResourceId"] for i in items] == [f"vm{i}" for i in range(300)]
            await ws.close()


async def _steady_writer(dsn: str, stop: asyncio.Event, acked: list[str]) -> None:
    """Writes one entry per transaction until told to stop, reconnecting through outages."""
    n = 0
    conn: asyncpg.Connection | None = None
    while not stop.is_set():
        try:
            if conn is None or conn.is_closed():
                conn = await asyncpg.connect(dsn, timeout=2)
            changed_id = f"e{n}"
            n += 1
            async with conn.transaction():
                await publish(conn, "vm", [], changed_id)
            acked.append(changed_id)
            await asyncio.sleep(0.002)
        except Exception:  # an API retries whatever the outage throws at it
            if conn is not None:
                conn.terminate()
            conn = None
            await asyncio.sleep(0.05)
    if conn is not None:
        await conn.close()


async def _committed_ids(dsn: str) -> list[str]:
    conn = await asyncpg.connect(dsn)
    try:
        rows = await conn.fetch("SELECT changed_resource_id FROM changefeed.feed ORDER BY txid, id")
    finally:
        await conn.close()
    return [r["changed_resource_id"] for r in rows]


async def _collect(ws, into: list[str]) -> None:  # type: ignore[no-untyped-def]
    while True:
        doc = orjson.loads(await ws.recv())
        into.extend(i["changedResourceId"] for i in (doc if isinstance(doc, list) else [doc]))


@pytest.mark.parametrize(("reset_after", "logged"), [(3600.0, [1, 2]), (0.0, [1, 1])])
async def test_a_blip_after_a_healthy_stretch_reconnects_at_the_schedules_start(
    feed_dsn: str,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
    reset_after: float,
    logged: list[int],
) -> None:
    """The tailer's reconnections climb the back-off while its connection has not
    stayed up ``RECONNECT_RESET`` (set here to an hour, then to nothing), and start
    over once it has: an outage earlier in the publisher's life does not slow its
    recovery from every later blip."""
    monkeypatch.setattr(tailer_module, "RECONNECT_RESET", reset_after)
    caplog.set_level(logging.WARNING, logger="changefeed.publisher.tailer")

    def attempts() -> list[int]:
        return [
            getattr(r, "cf_fields", {})["attempt"]
            for r in caplog.records
            if r.getMessage() == "tailer.reconnecting"
        ]

    async with running_publisher(feed_dsn, poll_interval=0.1) as pub:
        tailer = pub.publisher.tailer
        for blips in (1, 2):  # the second once the tailer is running again
            await terminate_tailer(feed_dsn)
            await wait_until(lambda: tailer.reconnects_total >= blips, timeout=20)  # noqa: B023
            await wait_until(lambda: tailer.status == "running", timeout=20)
    assert attempts() == logged


@pytest.mark.parametrize("outage", ["terminate_backend", "restart_postgres"])
async def test_publisher_recovers_from_database_outages_without_loss_or_duplicates(
    feed_dsn: str, restartable_pg_server: EmbeddedPostgres, outage: str
) -> None:
    async with running_publisher(feed_dsn, poll_interval=0.1) as pub:
        ws, _ = await register(pub.ws_url, registration(subs=[]))
        received: list[str] = []
        collector = asyncio.create_task(_collect(ws, received))
        stop = asyncio.Event()
        acked: list[str] = []
        writer = asyncio.create_task(_steady_writer(feed_dsn, stop, acked))
        await wait_until(lambda: len(received) >= 50, timeout=20)
        reconnects = pub.publisher.tailer.reconnects_total
        if outage == "terminate_backend":
            await terminate_tailer(feed_dsn)
        else:
            await asyncio.to_thread(restartable_pg_server.restart)
        await wait_until(lambda: pub.publisher.tailer.reconnects_total > reconnects, timeout=20)
        mark = len(acked)
        await wait_until(
            lambda: len(acked) >= mark + 50 or writer.done(),
            timeout=60,
            message="writers recover too",
        )
        assert not writer.done(), writer
        stop.set()
        await asyncio.wait_for(writer, 20)
        committed = await _committed_ids(feed_dsn)
        assert set(acked) <= set(committed)
        await wait_until(lambda: len(received) >= len(committed), timeout=30)
        collector.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await collector
        await ws.close()
        assert pub.publisher.tailer.status == "running"
    # In feed order, each exactly once: nothing lost, nothing repeated.
    assert received == committed


async def test_a_prepared_transaction_holds_delivery_back_and_stats_say_so() -> None:
    """Two-phase commit: a prepared transaction that appended an entry holds the
    snapshot horizon back like an open one. Stats and metrics show its age (it
    has no backend in pg_stat_activity), the feed's oldest entry and its size;
    once it commits, its entry is delivered, after the one committed before it."""
    with temporary(settings={"max_prepared_transactions": "2"}) as server:
        dsn = server.start()
        conn = await asyncpg.connect(dsn)
        try:
            await apply_schema(conn)
            async with (
                running_publisher(dsn) as pub,
                httpx.AsyncClient(base_url=pub.server.url) as http,
            ):
                ws, _ = await register(pub.ws_url, registration(subs=[]))
                # publish() rings the doorbell, and PostgreSQL cannot prepare a
                # transaction that did NOTIFY: a two-phase writer inserts the entry
                # itself and the tailer's poll finds it (docs/design.md).
                await conn.execute(
                    "BEGIN; INSERT INTO changefeed.feed (resource, changed_resource_id)"
                    " VALUES ('vm', 'prepared'); PREPARE TRANSACTION 'changefeed-test'"
                )
                await conn.execute("SELECT changefeed.publish('vm', '{}', 'after')")

                async def stats() -> dict[str, Any]:
                    doc: dict[str, Any] = (await http.get("/changefeeds/stats")).json()
                    return doc

                async def held() -> bool:
                    doc = await stats()
                    return bool(
                        doc["tailer"]["oldestOpenTransactionSeconds"] >= 1.0
                        and doc["feed"]["oldestEntrySeconds"] >= 1.0
                        and doc["feed"]["bytes"] > 0
                    )

                await wait_until(held, 15, 0.1, "the prepared writer shows in stats")
                metrics = (await http.get("/metrics")).text
                for gauge in (
                    "changefeed_oldest_open_transaction_seconds",
                    "changefeed_feed_oldest_entry_seconds",
                    "changefeed_feed_max_age_seconds",
                    "changefeed_feed_bytes",
                ):
                    value = next(
                        float(line.split()[-1])
                        for line in metrics.splitlines()
                        if line.startswith(gauge + " ")
                    )
                    assert value > 0, gauge
                # Nothing committed after it went out while it was prepared.
                with pytest.raises(TimeoutError):
                    await receive_items(ws, 1, timeout=0.5)

                await conn.execute("COMMIT PREPARED 'changefeed-test'")
                items = await receive_items(ws, 2)
                assert [i["changedResourceId"] for i in items] == ["prepared", "after"]

                async def released() -> bool:
                    return bool((await stats())["tailer"]["oldestOpenTransactionSeconds"] < 1.0)

                await wait_until(released, 15, 0.1, "the writer is gone from stats")
                await ws.close()
        finally:
            with contextlib.suppress(Exception):
                await conn.execute("ROLLBACK PREPARED 'changefeed-test'")
            await conn.close()


async def test_the_tailer_reuses_one_plan_for_its_read_on_an_analysed_feed(feed_dsn: str) -> None:
    """Once the feed has statistics (autovacuum analyses any real one), PostgreSQL
    would plan the tailer's prepared read afresh on every execution, planning
    costing more than the read. The tailer's connection keeps the generic plan."""
    conn = await asyncpg.connect(feed_dsn)
    try:
        await conn.execute(
            "SELECT changefeed.publish_many(array_fill('vm'::text, ARRAY[5000]),"
            " array_fill('nic'::text, ARRAY[5000]),"
            " ARRAY(SELECT 'vm-' || g FROM generate_series(1, 5000) g))"
        )
        await conn.execute("ANALYZE changefeed.feed")
    finally:
        await conn.close()
    publisher = Publisher(PublisherConfig(dsn=feed_dsn, resources=(VM,), retention=False))
    tailer = await publisher._connect()
    try:
        head = await publisher.reader.head(tailer)
        for _ in range(10):
            assert await publisher.reader.read_after(tailer, head, 1000) == []
        plans = await tailer.fetchrow(
            "SELECT generic_plans, custom_plans FROM pg_prepared_statements"
            " WHERE statement LIKE '%LIMIT $3'"
        )
        assert plans is not None
        assert (plans["custom_plans"], plans["generic_plans"]) == (0, 10)
    finally:
        await tailer.close()


async def test_entry_age_shows_how_long_a_writer_held_its_entry(feed_dsn: str) -> None:
    """changefeed_entry_age_seconds: each entry's age (from its INSERT, the
    database's clock) when the tailer hands it to the fan-out. An entry whose
    transaction stayed open for 0.6 s after appending it arrives that old; one
    committed at once arrives young. Every entry is counted once."""
    async with (
        running_publisher(feed_dsn) as pub,
        httpx.AsyncClient(base_url=pub.server.url) as http,
    ):
        ws, _ = await register(pub.ws_url, registration(subs=[]))
        writer = await asyncpg.connect(feed_dsn)
        try:
            async with writer.transaction():
                await publish(writer, "vm", [], "held")
                held_since = asyncio.get_running_loop().time()
                # Bounded and not a synchronisation: the age to be measured.
                await asyncio.sleep(0.6)
            held_for = asyncio.get_running_loop().time() - held_since
            for i in range(5):
                await publish(writer, "vm", [], f"prompt-{i}")
        finally:
            await writer.close()
        items = await receive_items(ws, 6)
        assert [i["changedResourceId"] for i in items] == ["held"] + [
            f"prompt-{i}" for i in range(5)
        ]
        await ws.close()
        metrics = (await http.get("/metrics")).text

    def bucket(le: str) -> float:
        return metric_value(metrics, "changefeed_entry_age_seconds_bucket", le=le)

    assert metric_value(metrics, "changefeed_entry_age_seconds_count") == 6
    assert bucket("+Inf") == 6
    assert held_for >= 0.6
    # The held entry is at least 0.5 s old; the five prompt ones are not
    # (a loaded machine may still take a while over them: 0.5 s is generous).
    assert bucket("0.5") == 5
    assert metric_value(metrics, "changefeed_entry_age_seconds_sum") >= 0.6


@pytest.mark.parametrize("read", ["read_after", "read_after_horizon"])
async def test_a_read_the_collector_passed_says_so_rather_than_return_a_gap(
    feed_dsn: str, read: str
) -> None:
    """Both of the tailer's reads (on the primary; on a standby, with the horizon) say
    when entries after the position were deleted before they were read: the low-water
    mark passed it, in the read's own snapshot."""
    from datetime import timedelta

    from changefeed.publisher.feed import FeedReader, FeedTrimmed
    from changefeed.publisher.retention import trim_expired

    reader = FeedReader()
    conn = await asyncpg.connect(feed_dsn)
    try:
        await publish(conn, "vm", [], "read")
        position = await reader.head(conn)
        await publish(conn, "vm", [], "collected-unread")
        await conn.execute("UPDATE changefeed.feed SET published = now() - interval '2d'")
        assert await trim_expired(conn, "changefeed", timedelta(days=1)) == 2
        await publish(conn, "vm", [], "after-the-gap")
        with pytest.raises(FeedTrimmed):
            await getattr(reader, read)(conn, position, 10)
        # From the low-water mark on, nothing is missing: the read goes on.
        low_water = await reader.low_water(conn)
        got = await getattr(reader, read)(conn, low_water, 10)
        entries = got[0] if read == "read_after_horizon" else got
        assert [e.changed_resource_id for e in entries] == ["after-the-gap"]
    finally:
        await conn.close()
