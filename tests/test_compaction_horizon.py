"""The compaction job and the publishers agree on a horizon: no copy a publisher holds
in memory contradicts what the job wrote, whatever ``--compaction-lag`` says.

Real PostgreSQL, real publishers on uvicorn, real websocket listeners, the job
with real Spark on ``local[2]`` (``conftest.spark``). The scenario of issue 29,
scaled down: a hot id and sparse ids, all merged once with a two-second lag
(far shorter than the publishers' five-minute window); a publisher starts and
holds the next changes in its window; a second run merges those into the
first run's keepers; listeners resume from before everything on that publisher
and on one started afterwards. A writer holds its transaction open across the
first run.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import defaultdict
from typing import Any

import asyncpg
import orjson
import pytest
from helpers import wait_until
from publisher_fixtures import receive_items, register, registration, running_publisher

from changefeed.compaction import NullProgress, run_compaction
from changefeed.publisher import publish
from changefeed.publisher.feed import FeedEntry, FeedReader
from changefeed.publisher.pages import FeedPages
from changefeed.schemas import ORIGIN, Position

pytestmark = pytest.mark.spark

LAG = 2.0
HOT = 5_000
IDS = 500
PER_ID = 8


async def seed(dsn: str, subs: str, per_id: int, hot: int) -> None:
    """``per_id`` entries with sub-resource ``subs`` on each of ``IDS`` ids, and ``hot``
    on one hot id, in one transaction (published now)."""
    conn = await asyncpg.connect(dsn)
    try:
        await conn.execute(
            """
            INSERT INTO changefeed.feed (resource, sub_resources, changed_resource_id)
            SELECT 'vm', ARRAY[$1], CASE WHEN g < $3 THEN 'hot' ELSE 'vm-' || (g % $4) END
            FROM generate_series(0, $2 - 1) AS g
            """,
            subs,
            hot + per_id * IDS,
            hot,
            IDS,
        )
    finally:
        await conn.close()


async def seed_each(dsn: str, prefix: str, subs: str) -> None:
    """One entry with sub-resource ``subs`` on each of ``IDS`` ids ``prefix-i``, in
    one transaction, published a minute ago: past the compaction lag already."""
    conn = await asyncpg.connect(dsn)
    try:
        await conn.execute(
            "INSERT INTO changefeed.feed"
            " (resource, sub_resources, changed_resource_id, published)"
            " SELECT 'vm', ARRAY[$1], $2 || g, now() - interval '1 minute'"
            " FROM generate_series(0, $3 - 1) AS g",
            subs,
            prefix + "-",
            IDS,
        )
    finally:
        await conn.close()


async def table_after(dsn: str, cursor: tuple[int, int]) -> int:
    conn = await asyncpg.connect(dsn)
    try:
        return int(
            await conn.fetchval(
                "SELECT count(*) FROM changefeed.feed"
                " WHERE (txid, id) > ($1::bigint::text::xid8, $2)",
                *cursor,
            )
        )
    finally:
        await conn.close()


async def resume_all(url: str, since: str, count: int) -> list[dict[str, Any]]:
    """Register with ``since`` and take ``count`` items, and whatever follows them
    at once (there must be nothing)."""
    ws, ack = await register(url, registration(subs=[], since=since))
    try:
        assert ack["resumed"] is True, ack
        items = await receive_items(ws, count, timeout=60)
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(1.0):
                extra = orjson.loads(await ws.recv())
                items.extend(extra if isinstance(extra, list) else [extra])
        return items
    finally:
        await ws.close()


def subs_by_id(items: list[dict[str, Any]]) -> dict[str, set[str]]:
    found: dict[str, set[str]] = defaultdict(set)
    for item in items:
        found[item["changedResourceId"]].update(item["changeKind"]["subResources"])
    return found


def compact(dsn: str, spark: Any) -> Any:
    return run_compaction(dsn, max_age=86400, compaction_lag=LAG, spark=spark, batch_size=500)


async def test_a_lag_shorter_than_the_window_loses_nothing_through_any_publisher(
    feed_dsn: str, spark: Any
) -> None:
    # A cursor from before everything, as the feed issues it.
    async with running_publisher(feed_dsn) as first:
        ws, ack = await register(first.ws_url, registration(subs=[]))
        since = ack["cursor"]
        await ws.close()

    await seed(feed_dsn, "alias", PER_ID, HOT)
    writer = await asyncpg.connect(feed_dsn)
    tx = writer.transaction()
    await tx.start()
    try:
        # Held open across the first run: it is not final, the run leaves it alone.
        await publish(writer, "vm", ["nic"], "vm-7")
        await asyncio.sleep(LAG + 0.5)
        one = await asyncio.to_thread(compact, feed_dsn, spark)
        assert one.full and one.merged == HOT - 1 + (PER_ID - 1) * IDS
        assert one.hot == 1  # merged apart from the others, across the read's tasks
        assert one.rewritten == 0  # each group had one sub-resource: nothing widened

        async with running_publisher(feed_dsn) as pub:
            live, _ = await register(pub.ws_url, registration(subs=[]))
            await tx.commit()
            # The open writer's entry reaches a live listener once committed (I1).
            (arrived,) = await receive_items(live, 1)
            assert arrived["changedResourceId"] == "vm-7"
            assert arrived["changeKind"]["subResources"] == ["nic"]

            await seed(feed_dsn, "disk", PER_ID, HOT // 10)
            tailed = pub.publisher.tailer.entries_total + HOT // 10 + PER_ID * IDS
            await wait_until(lambda: pub.publisher.tailer.entries_total >= tailed, timeout=30)
            window = pub.publisher.broadcast.window
            assert len(window) > HOT // 10  # its copies of the changes, from before run 2
            items = await receive_items(live, HOT // 10 + PER_ID * IDS)
            assert {i["changeKind"]["subResources"][0] for i in items} == {"disk"}
            await live.close()
            await asyncio.sleep(LAG + 0.5)

            two = await asyncio.to_thread(compact, feed_dsn, spark)
            assert not two.full, two.scope
            assert two.groups == IDS + 1 and two.rewritten == IDS + 1
            # Run 1 sealed its drops (1); run 2 announced (2) and sealed (3).
            assert one.rewrite_generation == 1 and one.rewritten_through == (0, 0)
            assert two.rewrite_generation == 3 and two.rewritten_through is not None

            expected = await table_after(feed_dsn, (0, 0))
            # The publisher that held the copies, and one started afterwards: the
            # same, complete answer from the table as the job left it.
            async with running_publisher(feed_dsn) as later:
                for url in (pub.ws_url, later.ws_url):
                    items = await resume_all(url, since, expected)
                    got = subs_by_id(items)
                    lost = {i: s for i, s in got.items() if not {"alias", "disk"} <= s}
                    assert not lost, (url, dict(list(lost.items())[:5]))
                    assert set(got) == {"hot", *(f"vm-{i}" for i in range(IDS))}, url
                    assert got["vm-7"] == {"alias", "disk", "nic"}  # the open writer's
                    assert len(items) == expected, url  # nothing twice, nothing more
    finally:
        with contextlib.suppress(asyncpg.InterfaceError):
            await tx.rollback()
        await writer.close()

    conn = await asyncpg.connect(feed_dsn)
    try:
        state = await FeedReader().state(conn)
        assert state.rewrites.generation == 3 and state.rewrites.through == two.rewritten_through
    finally:
        await conn.close()


class ReadAPageWhenAnnounced(NullProgress):
    """Has the publisher's pages read (and keep) a page as soon as the run has
    announced itself, before it widens a keeper: what a listener catching up
    right then makes a publisher do."""

    def __init__(self, loop: asyncio.AbstractEventLoop, read: Any) -> None:
        self.loop, self.read, self.pages_read = loop, read, 0

    def note(self, event: str, fields: Any) -> None:
        if event == "announced":
            asyncio.run_coroutine_threadsafe(self.read(), self.loop).result(timeout=30)
            self.pages_read += 1


async def test_a_page_read_while_keepers_are_widened_is_not_served_after_the_drops(
    feed_dsn: str, spark: Any
) -> None:
    """The feed, in order: IDS fillers, then an "alias" entry and then a "disk"
    entry for each of IDS ids. The run widens each "disk" entry (the keeper) to
    both and drops the "alias" one. A page of the table read after the
    announcement and before the widening holds keepers as they were; a listener
    that then reads the table from among the fillers (no "alias" entry there
    any more) and steps into that page would get "disk" alone for those ids."""
    for prefix, subs in (("filler", "nic"), ("vm", "alias"), ("vm", "disk")):
        await seed_each(feed_dsn, prefix, subs)
    conn = await asyncpg.connect(feed_dsn)
    try:
        reader = FeedReader()
        feed = await reader.read_after(conn, ORIGIN, 3 * IDS)
        assert len(feed) == 3 * IDS
        head = feed[-1].position

        async def read(after: Position, upto: Position, resources: Any, limit: int) -> Any:
            return await reader.read_page(conn, after, upto, resources, limit)

        pages = FeedPages(read, str, page_size=IDS, max_bytes=1 << 24)
        # Read mid-run from the middle of the "alias" entries: the first half of
        # the keepers, as they were.
        during = feed[IDS + IDS // 2].position
        progress = ReadAPageWhenAnnounced(
            asyncio.get_running_loop(), lambda: pages.page(["vm"], during, head)
        )
        summary = await asyncio.to_thread(
            lambda: run_compaction(
                feed_dsn,
                max_age=86400,
                compaction_lag=LAG,
                spark=spark,
                batch_size=500,
                progress=progress,
            )
        )
        assert progress.pages_read == 1
        assert summary.rewritten == IDS and summary.merged == IDS

        # A listener behind, among the fillers, reads on through the pages.
        position, got = feed[IDS // 4].position, list[FeedEntry]()
        while position < head:
            page = await pages.page(["vm"], position, head)
            got += [e for e in page.entries if e.position > position]
            position = page.through
        subs_of = {e.changed_resource_id: set(e.sub_resources) for e in got}
        assert len(got) == len(subs_of) == IDS - IDS // 4 - 1 + IDS
        lost = {i: s for i, s in subs_of.items() if i.startswith("vm-") and s != {"alias", "disk"}}
        assert not lost, dict(list(lost.items())[:5])
    finally:
        await conn.close()
