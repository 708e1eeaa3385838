"""The publisher's delivery core, without sockets or a database: the fan-out, each
listener's delivery state, the window, catch-up, the flush scheduler on a fake
clock, the stall watch and the page cache."""

from __future__ import annotations

import asyncio
import heapq
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from changefeed.publisher.catchup import Catchup, Filled
from changefeed.publisher.delivery import FRAME_OVERHEAD, Closing, Delivery
from changefeed.publisher.entries import Chunk
from changefeed.publisher.fanout import Fanout
from changefeed.publisher.feed import FeedEntry, PageOfFeed, Rewrites
from changefeed.publisher.matching import Interest
from changefeed.publisher.pages import CursorExpired, FeedPages, PageCache
from changefeed.publisher.scheduler import FlushScheduler
from changefeed.publisher.stall import stalled
from changefeed.publisher.window import Window
from changefeed.schemas import ChangeKind, Position

T0 = datetime(2026, 1, 1, tzinfo=UTC)


def entry(n: int, subs: tuple[str, ...] = ("nic",), resource: str = "vm") -> FeedEntry:
    return FeedEntry(Position(100, n), resource, subs, f"id{n}", T0 + timedelta(seconds=n))


def entries(first: int, last: int, **kw: Any) -> list[FeedEntry]:
    return [entry(n, **kw) for n in range(first, last + 1)]


ORIGIN = Position(100, 0)
ALL_VMS = Interest([ChangeKind("vm", ())])


class Encoder:
    """Counts what was encoded: each entry must be, at most, once."""

    def __init__(self) -> None:
        self.encoded: list[str] = []

    def __call__(self, e: FeedEntry) -> str:
        self.encoded.append(e.changed_resource_id)
        return e.changed_resource_id


def ids(delivery: Delivery, most: int = 10_000) -> list[str]:
    return [item.text for item in delivery.take(most)]


def live(interest: Interest = ALL_VMS, capacity: int = 100, start: Position = ORIGIN) -> Delivery:
    return Delivery(interest, start, ORIGIN, capacity=capacity)


# --------------------------------------------------------------------------- matching


def test_interest_is_the_matching_rule_and_the_union_of_several_kinds() -> None:
    nic = Interest([ChangeKind("vm", ("nic",))])
    assert nic.wants(entry(1, ("nic", "alias")))
    assert nic.wants(entry(1, ()))  # the resource as a whole
    assert not nic.wants(entry(1, ("alias",)))
    assert not nic.wants(entry(1, ("nic",), "network"))
    # Two kinds of one resource: the union; an empty set of sub-resources absorbs the rest.
    both = Interest([ChangeKind("vm", ("nic",)), ChangeKind("vm", ("alias",))])
    assert both.wants(entry(1, ("alias",))) and not both.wants(entry(1, ("disk",)))
    assert Interest([ChangeKind("vm", ("nic",)), ChangeKind("vm", ())]) == ALL_VMS
    assert hash(Interest([ChangeKind("vm", ())])) == hash(ALL_VMS)


# --------------------------------------------------------------------------- fan-out


def test_each_entry_is_encoded_once_and_shared_by_every_queue() -> None:
    encode = Encoder()
    window = Window(ORIGIN, 1 << 20, encode)
    fanout = Fanout()
    deliveries = [live() for _ in range(50)]
    for d in deliveries:
        fanout.join(d)
    chunk, start = window.append(entries(1, 10))
    done = fanout.dispatch(chunk, start)
    assert encode.encoded == [f"id{n}" for n in range(1, 11)]
    assert done.queued == 500 and len(done.touched) == 50 and done.behind == []
    taken = [d.take(100) for d in deliveries]
    # One item object per entry, referenced by every queue: no copies.
    assert all(t[i] is taken[0][i] for t in taken for i in range(10))


def test_matching_skip_until_and_feed_order_of_several_registrations() -> None:
    encode = Encoder()
    window = Window(ORIGIN, 1 << 20, encode)
    fanout = Fanout()
    nic = live(Interest([ChangeKind("vm", ("nic",))]))
    alias = live(Interest([ChangeKind("vm", ("alias",))]))
    late = live(start=Position(100, 3))
    v2 = live(
        Interest([ChangeKind("vm", ("nic",)), ChangeKind("network", ()), ChangeKind("vm", ())])
    )
    for d in (nic, alias, late, v2):
        fanout.join(d)
    batch = [
        entry(1, ("nic",)),
        entry(2, (), "network"),
        entry(3, ("alias",)),
        entry(4, ()),
        entry(5, ("nic", "alias")),
        entry(6, ("subnet",), "network"),
        entry(7, ("x",), "disk"),  # nobody wants it: never encoded
    ]
    fanout.dispatch(*window.append(batch))
    assert sorted(encode.encoded) == ["id1", "id2", "id3", "id4", "id5", "id6"]
    assert ids(nic) == ["id1", "id4", "id5"]
    assert ids(alias) == ["id3", "id4", "id5"]
    assert ids(late) == ["id4", "id5"]  # at or before its start: not sent
    assert ids(v2) == ["id1", "id2", "id3", "id4", "id5", "id6"]  # each once, feed order


def test_a_full_queue_falls_behind_instead_of_being_evicted_and_nobody_waits() -> None:
    window = Window(ORIGIN, 1 << 20, Encoder())
    fanout = Fanout()
    small, big = live(capacity=5), live(capacity=100)
    fanout.join(small)
    fanout.join(big)
    done = fanout.dispatch(*window.append(entries(1, 3)))
    assert done.queued == 6 and done.behind == []
    done = fanout.dispatch(*window.append(entries(4, 7)))
    assert done.behind == [small] and done.queued == 4
    # Not closed: it keeps what it has and remembers how far that goes.
    assert small.closing is None and not small.live and small.pending
    assert small.cursor == Position(100, 3) and len(small.queue) == 3
    assert small.ready.is_set()  # its sender has work: catch up
    assert len(fanout) == 1 and len(big.queue) == 7
    fanout.dispatch(*window.append(entries(8, 8)))
    assert len(big.queue) == 8 and len(small.queue) == 3


# --------------------------------------------------------------------------- catch-up


def _catchup(window: Window, fanout: Fanout, pages: FeedPages | None = None) -> Catchup:
    return Catchup(window, fanout, pages or FeedPages(_no_reads, str, page_size=10, max_bytes=1000))


async def _no_reads(*args: object) -> PageOfFeed:
    raise AssertionError("no page read expected")


def test_a_listener_behind_catches_up_from_the_window_and_rejoins_with_no_gap_or_duplicate() -> (
    None
):
    encode = Encoder()
    window = Window(ORIGIN, 1 << 20, encode)
    fanout = Fanout()
    catchup = _catchup(window, fanout)
    slow = live(capacity=4)
    fanout.join(slow)
    received: list[str] = []
    for first in range(1, 40, 3):  # batches of three, four fit
        fanout.dispatch(*window.append(entries(first, first + 2)))
        if first == 10:
            received += ids(slow)  # it reads a little, then nothing for a while
    assert not slow.live
    while True:  # it reads again: the sender's loop
        received += ids(slow)
        if slow.live:
            break
        assert catchup.fill(slow, 5) is not Filled.NEEDS_FEED
    fanout.dispatch(*window.append(entries(43, 44)))  # live again: the fan-out serves it
    received += ids(slow)
    assert received == [f"id{n}" for n in [*range(1, 40), 43, 44]]
    assert catchup.rejoined == 1 and catchup.from_window > 0
    assert len(set(encode.encoded)) == len(encode.encoded)  # never encoded twice


def test_a_resume_is_a_delivery_that_starts_behind() -> None:
    window = Window(ORIGIN, 1 << 20, Encoder())
    fanout = Fanout()
    catchup = _catchup(window, fanout)
    fanout.dispatch(*window.append(entries(1, 20, subs=("nic",))))
    fanout.dispatch(*window.append(entries(21, 30, subs=("alias",))))
    resumed = Delivery(
        Interest([ChangeKind("vm", ("alias",))]), Position(100, 24), window.head, capacity=100
    )
    assert not resumed.live and resumed.ready.is_set()
    assert catchup.fill(resumed, 3) is Filled.QUEUED
    assert ids(resumed) == ["id25", "id26", "id27"]
    # It reaches the head and rejoins the fan-out in the same step as its last items.
    assert catchup.fill(resumed, 100) is Filled.REJOINED and resumed.live
    assert ids(resumed) == ["id28", "id29", "id30"]
    assert not resumed.ready.is_set()  # nothing queued: its sender sleeps


def test_a_listener_behind_the_window_reads_the_feed_table() -> None:
    encode = Encoder()
    window = Window(ORIGIN, 1 << 20, encode)
    window.reset(Position(100, 50))  # the tailer started at 50: older entries are in the table
    fanout = Fanout()
    reads: list[tuple[Position, Position]] = []

    async def read(after: Position, upto: Position, resources: Any, limit: int) -> Any:
        reads.append((after, upto))
        table = [e for e in entries(1, 60) if after < e.position <= upto]
        return PageOfFeed(table[:limit], ORIGIN)

    pages = FeedPages(read, encode, page_size=20, max_bytes=1 << 20)
    catchup = _catchup(window, fanout, pages)
    fanout.dispatch(*window.append(entries(51, 60)))
    behind = Delivery(ALL_VMS, Position(100, 5), window.head, capacity=1000)
    got: list[str] = []

    async def scenario() -> None:
        while not behind.live:
            if catchup.fill(behind, 15) is Filled.NEEDS_FEED:
                await catchup.load(behind, 15)
            got.extend(ids(behind))

    asyncio.run(scenario())
    assert got == [f"id{n}" for n in range(6, 61)]
    assert catchup.from_feed == 45 and catchup.from_window == 10
    # Pages of 20 from where it was, up to where the window begins.
    base = Position(100, 50)
    assert reads == [(Position(100, 5), base), (Position(100, 25), base), (Position(100, 45), base)]


def test_the_window_is_bounded_and_lets_the_oldest_go() -> None:
    window = Window(ORIGIN, 20_000, Encoder())
    for first in range(1, 200, 10):
        window.append(entries(first, first + 9))
    assert window.nbytes <= 20_000 and len(window) < 200
    assert window.base > ORIGIN and window.head == Position(100, 200)
    assert window.find(Position(100, 1)) is None  # behind: read the table
    assert window.find(window.head) is None  # at the head: nothing to read
    chunk, index = window.find(window.base)  # type: ignore[misc]
    assert chunk.entries[index].position > window.base


# --------------------------------------------------------------------------- pages


def test_pages_are_shared_by_listeners_near_each_other_and_reads_under_way_are_awaited() -> None:
    reads: list[Position] = []

    async def read(after: Position, upto: Position, resources: Any, limit: int) -> Any:
        reads.append(after)
        await asyncio.sleep(0.01)
        table = [e for e in entries(1, 1000) if after < e.position <= upto]
        return PageOfFeed(table[:limit], ORIGIN)

    pages = FeedPages(read, str, page_size=100, max_bytes=1 << 24)

    async def scenario() -> list[Chunk]:
        head = Position(100, 1000)
        # A thousand listeners that fell behind together, a few entries apart.
        return await asyncio.gather(
            *(pages.page(["vm"], Position(100, 10 + i % 5), head) for i in range(1000))
        )

    got = asyncio.run(scenario())
    assert reads == [Position(100, 10)]  # one query, not a thousand
    assert all(page is got[0] for page in got) and pages.shared_total == 999


def test_a_page_below_the_low_water_mark_says_the_cursor_expired() -> None:
    async def read(after: Position, upto: Position, resources: Any, limit: int) -> Any:
        return PageOfFeed([], Position(100, 50))

    pages = FeedPages(read, str, page_size=100, max_bytes=1 << 20)
    with pytest.raises(CursorExpired):
        asyncio.run(pages.page(["vm"], Position(100, 10), Position(100, 100)))


def test_kept_pages_are_let_go_once_a_compaction_run_announced_itself() -> None:
    """A page is the table as it was read: once a run has announced itself (a new
    rewrite generation) no listener may read an entry's keeper from a copy made
    before it, whatever the run changes."""
    rewrites = {"now": Rewrites(0, ORIGIN)}
    reads: list[Position] = []

    async def read(after: Position, upto: Position, resources: Any, limit: int) -> Any:
        reads.append(after)
        table = [e for e in entries(1, 100) if after < e.position <= upto]
        return PageOfFeed(table[:limit], ORIGIN, rewrites["now"])

    pages = FeedPages(read, str, page_size=20, max_bytes=1 << 24)
    head = Position(100, 100)

    async def scenario() -> None:
        first = await pages.page(["vm"], Position(100, 0), head)
        assert await pages.page(["vm"], Position(100, 5), head) is first  # kept, shared
        # A run that rewrites nothing past the floor already known still counts.
        rewrites["now"] = Rewrites(1, ORIGIN)
        await pages.page(["vm"], Position(100, 40), head)
        assert len(pages.cache) == 1  # only the page read under the new generation
        again = await pages.page(["vm"], Position(100, 5), head)
        assert again is not first
        assert pages.floor == ORIGIN

    asyncio.run(scenario())
    assert reads == [Position(100, 0), Position(100, 40), Position(100, 5)]


def _rewritten(e: FeedEntry) -> FeedEntry:
    """``e`` as the compaction job left it: widened with "alias"."""
    return FeedEntry(e.position, e.resource, ("alias", "nic"), e.changed_resource_id, e.published)


def _with_subs(e: FeedEntry) -> str:
    return f"{e.changed_resource_id}:{','.join(e.sub_resources)}"


def _texts(delivery: Delivery) -> list[str]:
    return [item.text for item in delivery.take(10_000)]


def test_below_the_rewrite_floor_a_listener_behind_reads_the_table_not_the_window() -> None:
    """The window holds entries 1-60 as the tailer read them; then a compaction run
    widened entries up to 40 in the table (the floor). A listener that resumes from
    10 reads 11-40 from the table, as the job left them, and only 41-60 from the
    window; it never takes a copy at or before the floor."""
    window = Window(ORIGIN, 1 << 20, _with_subs)
    window.append(entries(1, 60))  # the tailer's copies: ("nic",)
    floor = Position(100, 40)
    table = [_rewritten(e) if e.position <= floor else e for e in entries(1, 60)]
    reads: list[tuple[Position, Position]] = []

    async def read(after: Position, upto: Position, resources: Any, limit: int) -> Any:
        reads.append((after, upto))
        rows = [e for e in table if after < e.position <= upto]
        return PageOfFeed(rows[:limit], ORIGIN, Rewrites(1, floor))

    pages = FeedPages(read, _with_subs, page_size=100, max_bytes=1 << 20)
    catchup = _catchup(window, Fanout(), pages)
    resumed = Delivery(ALL_VMS, Position(100, 10), window.head, capacity=1000)
    got: list[str] = []

    async def scenario() -> None:
        # The window starts at ORIGIN, so without the floor the listener would
        # read it all from memory: it learns the floor from the resume's facts.
        catchup.observe(Rewrites(1, floor))
        while not resumed.live:
            if catchup.fill(resumed, 100) is Filled.NEEDS_FEED:
                await catchup.load(resumed, 100)
            got.extend(_texts(resumed))

    asyncio.run(scenario())
    assert got == [f"id{n}:alias,nic" for n in range(11, 41)] + [
        f"id{n}:nic" for n in range(41, 61)
    ]
    assert reads == [(Position(100, 10), floor)]


def test_a_listener_reaching_a_floor_ahead_of_the_tailer_rejoins_past_it() -> None:
    """The tailer is behind the floor (it read up to 20; the job widened up to 30):
    a listener behind reads the table up to the floor, rejoins live there, and the
    tailer's later copies of entries up to the floor are not sent to it again."""
    window = Window(ORIGIN, 1 << 20, _with_subs)
    fanout = Fanout()
    fanout.dispatch(*window.append(entries(1, 20)))
    floor = Position(100, 30)
    table = [_rewritten(e) if e.position <= floor else e for e in entries(1, 40)]

    async def read(after: Position, upto: Position, resources: Any, limit: int) -> Any:
        rows = [e for e in table if after < e.position <= upto]
        return PageOfFeed(rows[:limit], ORIGIN, Rewrites(1, floor))

    pages = FeedPages(read, _with_subs, page_size=100, max_bytes=1 << 20)
    catchup = _catchup(window, fanout, pages)
    behind = Delivery(ALL_VMS, Position(100, 5), window.head, capacity=1000)
    got: list[str] = []

    async def scenario() -> None:
        catchup.observe(Rewrites(1, floor))  # from its resume's facts
        while not behind.live:
            if catchup.fill(behind, 100) is Filled.NEEDS_FEED:
                await catchup.load(behind, 100)
            got.extend(_texts(behind))

    asyncio.run(scenario())
    assert behind.live and behind.skip_until == floor
    # The tailer, late, now reads 21-40 from a snapshot before the job's widening.
    fanout.dispatch(*window.append(entries(21, 40)))
    got.extend(_texts(behind))
    assert got == [f"id{n}:alias,nic" for n in range(6, 31)] + [f"id{n}:nic" for n in range(31, 41)]


def test_the_window_lets_entries_older_than_its_max_age_go() -> None:
    window = Window(ORIGIN, 1 << 30, Encoder(), max_age=10.0)
    for first in range(1, 100, 10):  # entry n is published at T0 + n seconds
        window.append(entries(first, first + 9))
    window.expire(T0.timestamp() + 50)  # chunks holding entries from before T0 + 40 s go
    assert Position(100, 39) <= window.base <= Position(100, 41)
    assert window.find(Position(100, 20)) is None and window.find(Position(100, 45)) is not None
    assert all(e.published.timestamp() >= T0.timestamp() + 40 for e in _held(window))
    window.expire(T0.timestamp() + 1000)  # all of them, the newest chunk too
    assert len(window) == 0 and window.base == window.head == Position(100, 100)


def _held(window: Window) -> list[FeedEntry]:
    found = window.find(window.base)
    held: list[FeedEntry] = []
    while found is not None:
        chunk, index = found
        held += chunk.entries[index:]
        found = window.find(chunk.through)
    return held


def test_the_page_cache_is_bounded_and_finds_the_page_covering_a_position() -> None:
    cache = PageCache(max_bytes=3000)
    for first in range(0, 100, 10):
        cache.add(
            ("vm",),
            Chunk(
                entries(first + 1, first + 10), Position(100, first), Position(100, first + 10), str
            ),
        )
    assert cache.nbytes <= 3000 + 10 * 1000
    newest = cache.find(("vm",), Position(100, 95))
    assert newest is not None and newest.after == Position(100, 90)
    assert cache.find(("vm",), Position(100, 1)) is None  # let go
    assert cache.find(("network",), Position(100, 95)) is None


# --------------------------------------------------------------------------- scheduler


class FakeClock:
    """A clock and a callback queue that a test runs step by step."""

    def __init__(self) -> None:
        self.now = 0.0
        self.perf_now = 0.0
        self.soon: list[tuple[Callable[..., None], tuple[Any, ...]]] = []
        self.timers: list[tuple[float, int, Callable[..., None], tuple[Any, ...]]] = []
        self._seq = 0

    def time(self) -> float:
        return self.now

    def perf(self) -> float:
        return self.perf_now

    def call_soon(self, callback: Callable[..., None], *args: Any) -> Any:
        self.soon.append((callback, args))
        return _Handle(lambda: self.soon.remove((callback, args)))

    def call_at(self, when: float, callback: Callable[..., None], *args: Any) -> Any:
        self._seq += 1
        item = (when, self._seq, callback, args)
        heapq.heappush(self.timers, item)
        return _Handle(lambda: self.timers.remove(item))

    def run_soon(self) -> int:
        """Run what is ready now (one loop iteration); returns how many ran."""
        ready, self.soon = self.soon, []
        for callback, args in ready:
            callback(*args)
        return len(ready)

    def advance(self, seconds: float) -> None:
        self.now += seconds
        while self.timers and self.timers[0][0] <= self.now:
            _, _, callback, args = heapq.heappop(self.timers)
            callback(*args)


class _Handle:
    def __init__(self, cancel: Callable[[], None]) -> None:
        self.cancel = cancel


def _writing(
    clock: FakeClock, order: list[object], index: int, cost: float, leaves: bool = False
) -> Callable[[], bool]:
    def send_now() -> bool:
        clock.perf_now += cost
        order.append(index)
        return not leaves

    return send_now


def test_a_long_flush_runs_in_slices_and_wakes_senders_only_at_its_end() -> None:
    clock = FakeClock()
    flushes: list[tuple[float, int, int]] = []
    scheduler = FlushScheduler(clock, send_interval=0.002, report=lambda *f: flushes.append(f))
    order: list[object] = []
    deliveries = [live() for _ in range(40)]
    for index, d in enumerate(deliveries):
        d.queue.append(object())  # type: ignore[arg-type]
        d.send_now = _writing(clock, order, index, 0.0001, leaves=index == 0)
    scheduler.add(deliveries)  # the first slice runs at once
    iterations = 0
    while clock.soon:
        assert not deliveries[0].ready.is_set()  # its sender waits for the round's end
        order.append("loop ran")
        clock.run_soon()
        iterations += 1
    written = [x for x in order if isinstance(x, int)]
    assert written == list(range(40))  # every one had its turn, in order
    # A slice writes for at most 0.25 ms (three of these writes), and the next one
    # goes to the back of the loop's queue twice: 14 slices, 39 loop iterations.
    assert iterations == 13 * 3
    assert order.index("loop ran") == 3
    assert deliveries[0].ready.is_set()  # left with items: its sender is woken
    ((cost, listeners, to_senders),) = flushes
    assert listeners == 40 and to_senders == 1 and cost == pytest.approx(40 * 0.0001)
    assert scheduler.idle.is_set()


def test_the_next_flush_waits_three_times_the_last_ones_cost_at_most_send_interval() -> None:
    clock = FakeClock()
    scheduler = FlushScheduler(clock, send_interval=0.010, report=lambda *f: None)
    order: list[object] = []
    d = live()
    d.send_now = _writing(clock, order, 1, 0.001)
    scheduler.add([d])
    assert order == [1]  # the first flush goes out at once
    scheduler.add([d])
    assert order == [1] and not scheduler.idle.is_set()  # too soon: waits
    clock.advance(0.0029)
    assert order == [1]
    clock.advance(0.0002)  # three times the first one's cost has passed
    assert order == [1, 1] and scheduler.idle.is_set()
    # A flush that left items to a sender cannot know their cost: send_interval.
    d.send_now = _writing(clock, order, 2, 0.0, leaves=True)
    clock.advance(1)
    scheduler.add([d])
    scheduler.add([d])
    clock.advance(0.009)
    assert order == [1, 1, 2]
    clock.advance(0.002)
    assert order == [1, 1, 2, 2]


# --------------------------------------------------------------------------- stall


def test_only_a_listener_that_takes_nothing_for_stall_timeout_is_stalled() -> None:
    idle, slow, stuck, waiting = (live() for _ in range(4))
    buffered = {"slow": 60_000}
    slow.buffered = lambda: buffered["slow"]
    for d in (slow, stuck, waiting):
        d.queue.append(object())  # type: ignore[arg-type]
    waiting.waiting_on_feed = True
    everyone = [idle, slow, stuck, waiting]
    assert stalled(everyone, 100.0, 10.0) == []
    for t in range(101, 130):
        buffered["slow"] -= 100  # it drains its transport's buffer, a little at a time
        found = stalled(everyone, float(t), 10.0)
        if t < 110:
            assert found == []
        else:
            assert found == [stuck], t
    stuck.close(Closing(4009, "slow_listener", "gone"))
    assert stalled(everyone, 130.0, 10.0) == []


def test_a_sender_blocked_mid_send_with_an_empty_queue_is_stalled() -> None:
    """Through ASGI sends: the sender took the last turn and waits in send() on a
    listener that stopped reading; the queue is empty and the delivery live, but
    it has not taken what it was sent."""
    d = live()
    d.queue.extend([object()] * 10)  # type: ignore[list-item]
    d.take(128)
    d.sending = 1  # what the sender sets around its ASGI send
    found: list[Delivery] = []
    for t in range(0, 200, 5):
        found += stalled([d], float(t + 1), stall_timeout=60.0)
    assert found and all(f is d for f in found)


def test_pages_kept_from_before_the_feed_changed_are_not_served_after() -> None:
    """A restore hands out the same positions again: the publisher lets its kept
    pages go (join_feed calls FeedPages.reset), and the lower rewrite generation
    of the restored feed does not stop pages from being kept again."""

    def old(k: int) -> FeedEntry:
        return FeedEntry(Position(10 + k, 100 + k), "vm", (), f"lost-{k}", T0)

    def new(k: int) -> FeedEntry:
        return FeedEntry(Position(11 + k, 100 + k), "vm", (), f"new-{k}", T0)

    zero = Position(0, 0)
    feed: dict[str, Any] = {"entries": [old(k) for k in range(50)], "rewrites": Rewrites(4, zero)}

    async def read(after: Position, upto: Position, resources: Any, limit: int) -> PageOfFeed:
        rows = [e for e in feed["entries"] if after < e.position <= upto]
        return PageOfFeed(rows[:limit], zero, feed["rewrites"])

    pages = FeedPages(read, lambda e: e.changed_resource_id, page_size=20, max_bytes=1 << 24)

    async def scenario() -> None:
        await pages.page(["vm"], Position(9, 99), Position(60, 150))
        feed["entries"], feed["rewrites"] = [new(k) for k in range(50)], Rewrites(0, zero)
        pages.reset()
        page = await pages.page(["vm"], Position(11, 100), Position(60, 150))
        assert [e.changed_resource_id for e in page.entries[:2]] == ["new-1", "new-2"]
        assert len(pages.cache) == 1  # kept again, under the restored feed's generation

    asyncio.run(scenario())


def test_a_page_read_across_a_reset_is_neither_kept_nor_believed() -> None:
    """A read of the feed as it was before a restore, answered after the publisher let
    its pages go (``reset``), must not be kept (it would be served to the restored
    feed's listeners) nor bring back the old feed's rewrite generation."""
    zero = Position(0, 0)
    gate, started = asyncio.Event(), asyncio.Event()
    old = [FeedEntry(Position(10 + k, 100 + k), "vm", (), f"lost-{k}", T0) for k in range(30)]

    async def read(after: Position, upto: Position, resources: Any, limit: int) -> PageOfFeed:
        started.set()
        await gate.wait()
        rows = [e for e in old if after < e.position <= upto]
        return PageOfFeed(rows[:limit], zero, Rewrites(7, Position(20, 110)))

    pages = FeedPages(read, lambda e: e.changed_resource_id, page_size=20, max_bytes=1 << 24)

    async def scenario() -> None:
        reading = asyncio.create_task(pages.page(["vm"], Position(9, 99), Position(60, 150)))
        await started.wait()  # the read is under way
        pages.reset()  # the feed was restored meanwhile
        gate.set()
        await reading
        assert len(pages.cache) == 0 and pages.floor == zero

    asyncio.run(scenario())


def test_an_entry_that_arrives_already_old_leaves_the_window_in_time() -> None:
    """An entry is stamped when its statement ran: a long transaction's entries
    arrive already old, and must leave the window as soon as any other."""
    now = T0.timestamp() + 3600
    window = Window(Position(1, 0), 1 << 30, lambda e: e.changed_resource_id, max_age=300.0)
    fresh = FeedEntry(Position(10, 1), "vm", (), "fresh", datetime.fromtimestamp(now - 1, UTC))
    late = FeedEntry(Position(11, 2), "vm", (), "late", datetime.fromtimestamp(now - 1200, UTC))
    window.append([fresh])
    window.append([late])
    window.expire(now)
    assert window.find(Position(10, 1)) is None and window.base == Position(11, 2)


def test_a_turn_cut_to_a_byte_budget_still_takes_one_item_and_keeps_the_order() -> None:
    window = Window(ORIGIN, 1 << 20, Encoder())
    fanout = Fanout()
    delivery = live(capacity=100)
    fanout.join(delivery)
    fanout.dispatch(*window.append(entries(1, 10)))
    queued = [i.text for i in delivery.queue]
    size = len(queued[0]) + FRAME_OVERHEAD
    first = delivery.take(8, most_bytes=3 * size)
    assert len(first) == 3
    one = delivery.take(8, most_bytes=1)  # never none while items wait
    assert len(one) == 1
    rest = delivery.take(8)
    assert len(rest) == 6 and not delivery.queue
    assert [i.text for i in first + one + rest] == queued
