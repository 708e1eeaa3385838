"""The listener's parts in isolation, without sockets: the inbox (frames in, events out, the
cursor), the attachments of a shared listener, the controller's per-id records, and the
count of reaches into other objects' private attributes."""

from __future__ import annotations

import ast
import asyncio
import pathlib
from collections.abc import Mapping, Sequence
from typing import Any

import orjson
import pytest
from helpers import wait_until

import changefeed.listener as listener_pkg
from changefeed.listener import BackoffPolicy, RegistrationRefused, Resynced
from changefeed.listener._attachments import Attachments, Stopped
from changefeed.listener._checkpoint import MirrorCheckpoint
from changefeed.listener._errors import BadPublisherFrame, BufferOverflow, PublisherClosed
from changefeed.listener._events import ListenerCounts
from changefeed.listener._inbox import Inbox, MemoryBuffer
from changefeed.listener._reconcile import Intake, Reconciler
from changefeed.schemas import ChangeItem, ChangeKind, ErrorFrame


def item(n: int, resource: str = "vm") -> ChangeItem:
    return ChangeItem(ChangeKind(resource, ()), f"id-{n}", f"c{n}", "2026-11-21T23:00:00Z")


def frame(*items: ChangeItem) -> bytes:
    return orjson.dumps([i.to_json() for i in items])


def resynced(resource: str, cursor: str = "ack") -> Resynced:
    return Resynced([], f"http://api/{resource}s", cursor, resource=resource)


def inbox(capacity: int = 10, resources: tuple[str, ...] = ("vm",)) -> Inbox:
    return Inbox(
        MemoryBuffer(capacity),
        None,
        resources=resources,
        multi=len(resources) > 1,
        high_water=0.8,
        fields=dict,
        counts=ListenerCounts(),
    )


async def next_resynced(box: Inbox) -> Resynced:
    """The next event of ``box``, a bootstrap's (a ChangeItem has no ``resource``)."""
    event = await box.__anext__()
    assert isinstance(event, Resynced), event
    return event


# -- the inbox -------------------------------------------------------------------------


async def test_frames_in_events_out_in_feed_order_resynced_first() -> None:
    box = inbox()
    await box.receive(frame(item(1), item(2)))  # buffered while the bootstrap walks
    box.bootstrapped([resynced("vm")])
    box.live()
    events = [await box.__anext__() for _ in range(3)]
    assert isinstance(events[0], Resynced)
    assert [e.cursor for e in events] == ["ack", "c1", "c2"]
    assert box.resume == "c2" and box.done == "c1"  # done: the one before
    counts = (
        box.counts.frames_received,
        box.counts.items_received,
        box.items_delivered,
        box.held(),
    )
    assert counts == (1, 2, 2, 0)


async def test_a_frame_that_does_not_fit_is_an_overflow_and_held_items_count() -> None:
    box = inbox(capacity=3)
    box.live()
    await box.receive(frame(item(1), item(2)))
    assert (await box.__anext__()).cursor == "c1"  # the other one is staged: still held
    with pytest.raises(BufferOverflow):
        await box.receive(frame(item(3), item(4), item(5)))  # 1 held + 3 > 3
    assert box.counts.overflows == 1 and box.held() == 1
    assert await box.clear() == 1 and box.held() == 0


async def test_error_and_bad_frames_end_the_session() -> None:
    box = inbox(resources=("vm", "server"))
    with pytest.raises(PublisherClosed) as closed:
        await box.receive(ErrorFrame("unavailable", "down", retry_after=1.5).encode())
    assert (closed.value.error_code, closed.value.retry_after) == ("unavailable", 1.5)
    with pytest.raises(BadPublisherFrame, match="did not register"):
        await box.receive(frame(item(1, "nic")))


async def test_a_single_resource_connection_refuses_another_resources_items() -> None:
    """A v1 connection registers one resource: an item of another one is the
    publisher breaking the contract, not an id to fetch from this resource's route."""
    box = inbox(resources=("vm",))
    with pytest.raises(BadPublisherFrame, match="'nic', which this connection did not"):
        await box.receive(frame(item(1), item(2, "nic")))
    assert box.held() == 0  # nothing of the bad frame was buffered


async def test_a_reconnect_between_resynced_events_moves_no_cursor() -> None:
    """Only whole hand-outs move the cursor: a connection that ends after the first of a
    bootstrap's Resynced events leaves both readings where they were (else a checkpoint
    of ``async for`` would save the ack's cursor then, though the application never got
    the other resource's bootstrap)."""
    box = inbox(resources=("vm", "server"))
    box.restore("before")
    box.bootstrapped([resynced("vm", "ack"), resynced("server", "ack")])
    box.live()
    assert (await next_resynced(box)).resource == "vm"
    await box.clear()  # the connection ended
    box.forget()  # ... in a way that needs a fresh bootstrap
    box.bootstrapped([resynced("vm", "ack2"), resynced("server", "ack2")])
    box.live()
    assert (await next_resynced(box)).resource == "vm"
    assert (box.resume, box.done) == (None, "before")
    assert (await next_resynced(box)).resource == "server"
    assert box.resume == "ack2"


async def test_stop_ends_iteration_or_raises_what_stopped_it() -> None:
    box = inbox()
    box.stop(None)
    with pytest.raises(StopAsyncIteration):
        await box.__anext__()
    failed = inbox()
    refused = RegistrationRefused("forbidden", "no")
    failed.stop(refused)
    failed.stop(None)  # closing afterwards keeps the error
    with pytest.raises(RegistrationRefused):
        await failed.__anext__()


class Consumer:
    """A dispatch sink with a room it is told."""

    def __init__(self, room: int) -> None:
        self.space = room
        self.got: list[list[str]] = []
        self.more = asyncio.Event()

    def room(self) -> int:
        return self.space

    async def wait_room(self) -> None:
        await self.more.wait()

    def resynced(self, event: Resynced) -> None:
        self.got.append([f"resynced:{event.resource}"])

    def changed(self, items: Sequence[ChangeItem]) -> None:
        self.got.append([i.cursor for i in items])
        self.space -= len(items)


async def test_the_dispatch_hands_each_resource_its_run_as_far_as_there_is_room() -> None:
    box = inbox(capacity=20, resources=("vm", "server"))
    vms, servers = Consumer(room=2), Consumer(room=100)
    sinks: Mapping[str, Sequence[Any]] = {"vm": [vms], "server": [servers]}
    dispatch = asyncio.create_task(box.dispatch(sinks))
    box.bootstrapped([resynced("vm"), resynced("server")])
    box.live()
    await box.receive(frame(item(1), item(2), item(3), item(4, "server")))
    await wait_until(lambda: len(vms.got) == 2 and len(servers.got) == 1, 5)
    assert vms.got == [["resynced:vm"], ["c1", "c2"]] and servers.got == [["resynced:server"]]
    assert box.done == "c2" and box.held() == 2  # c3 and c4 wait for vms' room
    vms.space = 10
    vms.more.set()
    await wait_until(lambda: len(servers.got) == 2, 5)
    assert vms.got[-1] == ["c3"] and servers.got[-1] == ["c4"]
    assert box.done == box.resume == "c4" and box.items_delivered == 4
    box.stop(None)
    await asyncio.wait_for(dispatch, 1)


async def test_a_dispatch_waiting_for_a_full_controller_ends_when_the_listener_fails() -> None:
    """A controller whose queue stays full (its callbacks keep failing) must still learn
    that the listener stopped for good: the dispatch waiting for its room raises why."""
    box = inbox()
    vms = Consumer(room=0)
    dispatch = asyncio.create_task(box.dispatch({"vm": [vms]}))
    box.bootstrapped([resynced("vm")])
    box.live()
    await box.receive(frame(item(1), item(2)))
    await wait_until(lambda: box.held() == 2 and not len(box.buffer), 5)  # in the dispatch's hand
    refused = RegistrationRefused("close_4003", "unauthorized")
    box.stop(refused)
    with pytest.raises(RegistrationRefused):
        await asyncio.wait_for(dispatch, 1)
    assert vms.got == [["resynced:vm"]]
    box.stop(RegistrationRefused("http_401", "later"))  # a consequence: the first one stays
    with pytest.raises(RegistrationRefused, match="unauthorized"):
        await box.__anext__()


async def test_items_dropped_by_a_reconnect_no_longer_count_as_held() -> None:
    """Items the dispatch holds for a full controller when the connection ends are
    dropped (the publisher sends them again): they must not count against the next
    connection's buffer, or it overflows early."""
    box = inbox(capacity=10)
    vms = Consumer(room=0)
    dispatch = asyncio.create_task(box.dispatch({"vm": [vms]}))
    box.bootstrapped([resynced("vm")])
    box.live()
    await box.receive(frame(*(item(n) for n in range(1, 8))))
    await wait_until(lambda: box.held() == 7 and not len(box.buffer), 5)
    assert await box.clear() == 7
    assert box.held() == 0
    box.live()
    await box.receive(frame(*(item(n) for n in range(8, 12))))  # 4 more: they fit
    assert box.held() == 4 and box.counts.overflows == 0
    vms.space = 100
    vms.more.set()
    await wait_until(lambda: box.items_delivered == 4, 5)
    assert vms.got[-1] == ["c8", "c9", "c10", "c11"]  # the dropped ones did not go out
    box.stop(None)
    await asyncio.wait_for(dispatch, 1)


# -- attachments ------------------------------------------------------------------------


class Handle:
    def __init__(self, name: str) -> None:
        self.name = name
        self.sink = Consumer(room=1)


def test_attachments_wait_for_every_controller_then_park_or_close() -> None:
    vms, servers = Handle("vms"), Handle("servers")
    attached = Attachments()
    attached.attach("vm", vms)  # type: ignore[arg-type]
    attached.attach("server", servers)  # type: ignore[arg-type]
    assert attached.consumers == {"vm": [vms.sink], "server": [servers.sink]}
    assert not attached.start(vms)  # type: ignore[arg-type]
    # Handle is a stand-in for a controller (hence the ignores): the list holds it.
    assert attached.waited_for() == [servers]  # type: ignore[comparison-overlap]
    assert attached.start(servers)  # type: ignore[arg-type]
    # With checkpoints, the first to stop is parked; the last one closes the listener.
    assert attached.stop(vms, started=True, checkpoints=True) is Stopped.PARKED  # type: ignore[arg-type]
    assert attached.consumers["vm"] == [vms.sink]  # a parked one still takes events
    assert attached.stop(servers, started=True, checkpoints=True) is Stopped.CLOSE  # type: ignore[arg-type]
    assert attached.consumers["server"] == []


def test_a_controller_closed_before_it_ran_lets_the_others_start() -> None:
    vms, servers = Handle("vms"), Handle("servers")
    attached = Attachments()
    attached.attach("vm", vms)  # type: ignore[arg-type]
    attached.attach("server", servers)  # type: ignore[arg-type]
    attached.start(vms)  # type: ignore[arg-type]
    assert attached.stop(servers, started=False, checkpoints=False) is Stopped.START_OTHERS  # type: ignore[arg-type]
    assert attached.waited_for() == []


# -- the controller's records ---------------------------------------------------------------


def core(fetched: dict[str, Any], fetch: Any = None, retry: float = 0.01) -> Reconciler[Any]:
    async def lookup(ids: Sequence[str]) -> Mapping[str, Any]:
        return {i: fetched[i] for i in ids if i in fetched}

    return Reconciler(
        name="t",
        resource="vm",
        fetch=fetch or lookup,
        key=lambda doc: str(doc["uuid"]),
        decode=None,
        encode=None,
        reconcile=None,
        on_add=None,
        on_update=None,
        on_delete=None,
        concurrency=1,
        fetch_batch=10,
        max_pending=100,
        retry=BackoffPolicy(initial=retry, maximum=retry),
        rng=None,
    )


async def test_ids_named_by_change_items_keep_no_record_and_leave_none() -> None:
    """The common case costs no per-id bookkeeping: an id queued without a record was
    named by a change item; a fetch that finds it absent, as it was, changes nothing."""
    rec = core({})
    rec.intake = Intake.OPEN
    rec.changed([item(1), item(2), item(1)])
    assert rec.pending() == {"id-1", "id-2"} and rec.room() == 98
    worker = asyncio.create_task(rec.work())
    await asyncio.wait_for(rec.queue.wait_idle(), 1)
    assert rec.counts.fetches == 2 and rec.pending() == set() and len(rec.mirror) == 0
    rec.stop()
    await asyncio.wait_for(worker, 1)


async def test_a_parked_controller_marks_items_pending_and_a_waiting_one_takes_nothing() -> None:
    rec = core({})
    assert rec.room() == 1 << 30  # not running yet: the dispatch does not wait for it
    rec.changed([item(1)])
    assert rec.counts.items == 0 and rec.pending() == set()
    rec.intake = Intake.OPEN
    rec.stop()  # it ran and stopped: parked
    assert rec.intake is Intake.PARKED
    rec.changed([item(2)])
    assert rec.pending() == {"id-2"} and rec.queue.pending == 0  # pending, not queued


async def test_a_stale_fetch_that_fails_does_not_keep_the_controller_from_syncing() -> None:
    """An id restored as pending is being fetched when the first bootstrap arrives: that
    fetch is stale (its completion does not count) and it fails. The id's next, fresh
    completion is the one the sync waits for: synced, not stuck until the id changes."""
    gate = asyncio.Event()
    calls: list[list[str]] = []

    async def fetch(ids: Sequence[str]) -> Mapping[str, Any]:
        calls.append(list(ids))
        if len(calls) == 1:
            await gate.wait()
            raise OSError("the API blinked")
        return {key: {"uuid": key, "v": 2} for key in ids}

    # A failed id is retried only after a minute: the sync must not wait for that.
    rec = core({}, fetch, retry=60.0)
    rec.restore(MirrorCheckpoint("vm", {"K": {"uuid": "K", "v": 1}}, (), {"K"}))
    rec.intake = Intake.OPEN
    worker = asyncio.create_task(rec.work())
    await wait_until(lambda: calls == [["K"]], 5)  # K's fetch is under way
    rec.resync(Resynced([{"uuid": "K", "v": 2}, {"uuid": "L", "v": 1}], "http://api/vms", "c1"))
    gate.set()
    await asyncio.wait_for(rec.synced.wait(), 5)
    assert rec.mirror.get("K") == {"uuid": "K", "v": 2}
    rec.stop()
    await asyncio.wait_for(worker, 5)


# -- ownership --------------------------------------------------------------------------------


def test_the_listener_reaches_into_other_objects_private_attributes_at_most_5_times() -> None:
    """Each part owns its state: ``x._name`` where ``x`` is not ``self`` or ``cls``."""
    folder = pathlib.Path(listener_pkg.__file__).parent
    reaches = []
    for path in sorted(folder.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.Attribute)
                and node.attr.startswith("_")
                and not node.attr.startswith("__")
                and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"))
            ):
                reaches.append(f"{path.name}:{node.lineno}: {ast.unparse(node)}")
    assert len(reaches) <= 5, reaches
