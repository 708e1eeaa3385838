"""The controller's work queue: coalescing, fair and stingy, delayed adds (pure core)."""

from __future__ import annotations

import asyncio

from hypothesis import given, settings
from hypothesis import strategies as st

from changefeed.listener._workqueue import WorkQueue


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_repeated_adds_coalesce_into_one() -> None:
    queue: WorkQueue[str] = WorkQueue()
    for _ in range(1000):
        queue.add("vm-1")
    assert len(queue) == 1
    assert queue.adds == 1000 and queue.coalesced == 999
    assert queue.pop(10) == ["vm-1"]
    assert queue.pop(10) == []


def test_add_many_is_adds_in_order_each_once() -> None:
    queue: WorkQueue[str] = WorkQueue()
    queue.add("c")
    queue.add_many(["a", "b", "a", "c", "d"])
    assert queue.adds == 6 and queue.coalesced == 2  # the second "a", and "c"
    assert queue.pop(10) == ["c", "a", "b", "d"]
    queue.add_many(["a", "e"])  # "a" is being processed: it waits for done
    assert queue.pop(10) == ["e"]
    queue.done_many(["a", "b", "c", "d", "e"])
    assert queue.pop(10) == ["a"]


def test_fifo_order() -> None:
    queue: WorkQueue[str] = WorkQueue()
    for key in "abcab":
        queue.add(key)
    assert queue.pop(10) == ["a", "b", "c"]


def test_an_id_being_processed_is_never_handed_out_again_until_done() -> None:
    queue: WorkQueue[str] = WorkQueue()
    queue.add("x")
    assert queue.pop() == ["x"]
    for _ in range(1000):
        queue.add("x")  # changes arriving while "x" is being fetched
    assert queue.pop(10) == []  # stingy: not concurrently
    assert queue.is_processing("x") and queue.pending == 1
    queue.done("x")
    assert queue.pop(10) == ["x"]  # requeued exactly once
    queue.done("x")
    assert queue.pop(10) == [] and queue.idle


def test_done_without_new_adds_does_not_requeue() -> None:
    queue: WorkQueue[str] = WorkQueue()
    queue.add("x")
    queue.pop()
    queue.done("x")
    assert len(queue) == 0 and queue.idle


def test_delayed_adds_come_due_on_the_clock() -> None:
    clock = FakeClock()
    queue: WorkQueue[str] = WorkQueue(clock)
    queue.add_rate_limited("a", 1.0)
    queue.add_after("b", 0.5)
    assert queue.retries == 1 and queue.waiting == 2 and not queue.idle
    assert queue.pop(10) == []
    assert queue.next_due() == 0.5
    clock.now = 0.6
    assert queue.pop(10) == ["b"]
    clock.now = 1.0
    assert queue.pop(10) == ["a"]
    assert queue.waiting == 0


def test_earlier_delay_wins() -> None:
    clock = FakeClock()
    queue: WorkQueue[str] = WorkQueue(clock)
    queue.add_after("a", 5.0)
    queue.add_after("a", 1.0)
    queue.add_after("a", 3.0)  # later than the pending 1.0: ignored
    clock.now = 1.0
    assert queue.pop() == ["a"]
    queue.done("a")
    clock.now = 10.0
    assert queue.pop() == []  # the superseded 5.0 entry does not fire again
    assert queue.waiting == 0 and queue.idle


def test_zero_delay_is_an_add() -> None:
    queue: WorkQueue[str] = WorkQueue()
    queue.add_after("a", 0.0)
    assert queue.pop() == ["a"]


async def test_get_waits_for_an_add_and_a_delay() -> None:
    queue: WorkQueue[str] = WorkQueue()
    getter = asyncio.create_task(queue.get(5))
    await asyncio.sleep(0)
    assert not getter.done()
    queue.add("a")
    assert await asyncio.wait_for(getter, 5) == ["a"]
    queue.done("a")
    queue.add_after("b", 0.05)
    assert await asyncio.wait_for(queue.get(), 5) == ["b"]


async def test_shut_down_releases_waiting_workers_and_refuses_adds() -> None:
    queue: WorkQueue[str] = WorkQueue()
    getters = [asyncio.create_task(queue.get()) for _ in range(3)]
    await asyncio.sleep(0)
    queue.shut_down()
    assert await asyncio.wait_for(asyncio.gather(*getters), 5) == [[], [], []]
    queue.add("late")
    assert len(queue) == 0 and queue.shutting_down


async def test_wait_idle() -> None:
    queue: WorkQueue[str] = WorkQueue()
    await asyncio.wait_for(queue.wait_idle(), 1)
    queue.add("a")
    waiter = asyncio.create_task(queue.wait_idle())
    await asyncio.sleep(0)
    assert not waiter.done()
    (key,) = queue.pop()
    queue.done(key)
    await asyncio.wait_for(waiter, 5)


@settings(max_examples=300, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["add", "add_many", "pop", "done", "done_many"]),
            st.sampled_from("abcd"),
        ),
        max_size=60,
    )
)
def test_model_never_concurrent_never_lost(ops: list[tuple[str, str]]) -> None:
    """Whatever the interleaving: no id is handed out while processing, and every id
    added after it was last handed out is handed out again once it is done."""
    queue: WorkQueue[str] = WorkQueue()
    processing: set[str] = set()
    owed: set[str] = set()  # ids added since they were last handed out
    for op, key in ops:
        if op == "add":
            queue.add(key)
            owed.add(key)
        elif op == "add_many":  # a batch with repeats, ending in ``key``
            batch = ["a", key, "b", key]
            queue.add_many(batch)
            owed.update(batch)
        elif op == "pop":
            for taken in queue.pop(2):
                assert taken not in processing
                processing.add(taken)
                owed.discard(taken)
        elif op == "done_many":
            queue.done_many(sorted(processing))
            processing.clear()
        elif key in processing:
            processing.discard(key)
            queue.done(key)
    for key in list(processing):
        queue.done(key)
    # Drain: everything still owed comes out, each exactly once.
    drained: list[str] = []
    while batch := queue.pop(10):
        drained.extend(batch)
        for key in batch:
            queue.done(key)
    assert sorted(drained) == sorted(owed)
    assert queue.idle


def test_a_long_queue_hands_out_in_order_while_it_drops_what_it_handed_out() -> None:
    """The ready ids are a list read from a head index, compacted now and then."""
    queue: WorkQueue[int] = WorkQueue(clock=lambda: 0.0)
    queue.add_many(range(3000))
    taken = queue.pop(1500)
    queue.add_many(range(3000, 3500))
    taken += queue.pop(1200)  # past half of the list: the part handed out is dropped
    assert len(queue) == 800
    queue.done_many(taken)
    queue.add(0)  # done: queued again, at the end
    taken += queue.pop(10_000)
    assert taken == [*range(3500), 0] and len(queue) == 0
