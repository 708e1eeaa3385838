"""The controller's logic with a scripted event source and an in-memory "API" (no sockets).

The fakes stand in for the listener and the HTTP fetches only: what is under
test is the work queue, the mirror and the callbacks. tests/test_controller.py
runs the same controller against the real publisher, API and PostgreSQL.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import math
from collections import Counter
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import pytest
from helpers import wait_until
from test_listener_support import capture_events

from changefeed.bootstrap import PagingError
from changefeed.listener import (
    BackoffPolicy,
    ConnectionState,
    Controller,
    Listener,
    ListenerConfig,
    ListenerConfigError,
    MirrorCheckpoint,
    RegistrationRefused,
    Resynced,
    SqliteCheckpointStore,
)
from changefeed.schemas import ChangeItem, ChangeKind

FAST_RETRY = BackoffPolicy(initial=0.005, maximum=0.05, jitter=0.0)
_cursors = itertools.count()


def change(rid: str) -> ChangeItem:
    return ChangeItem(ChangeKind("vm", ()), rid, f"c{next(_cursors)}", "2026-11-21T23:00:00Z")


def vm(rid: str, alias: str = "a") -> dict[str, Any]:
    return {"uuid": rid, "alias": alias, "nics": []}


class Source:
    """Events pushed by the test; an exception object is raised to the consumer."""

    def __init__(self) -> None:
        self.queue: asyncio.Queue[Any] = asyncio.Queue()

    def send(self, *events: Any) -> None:
        for event in events:
            self.queue.put_nowait(event)

    def end(self) -> None:
        self.queue.put_nowait(StopAsyncIteration())

    def __aiter__(self) -> Source:
        return self

    async def __anext__(self) -> Any:
        event = await self.queue.get()
        if isinstance(event, BaseException):
            raise event
        return event


class Api:
    """The resources, and a fetch that can be held in flight or made to fail."""

    def __init__(self, data: dict[str, dict[str, Any]] | None = None) -> None:
        self.data = dict(data or {})
        self.calls: list[list[str]] = []
        self.fetched: Counter[str] = Counter()
        self.gate: asyncio.Event | None = None
        self.in_flight = asyncio.Event()
        self.failures = 0
        self.error: Exception = ConnectionError("API unreachable")

    async def fetch(self, ids: Sequence[str]) -> Mapping[str, Any]:
        self.calls.append(list(ids))
        self.fetched.update(ids)
        self.in_flight.set()
        if self.gate is not None:
            await self.gate.wait()
        if self.failures:
            self.failures -= 1
            raise self.error
        return {i: dict(self.data[i]) for i in ids if i in self.data}


class Recorder:
    def __init__(self) -> None:
        self.calls: list[tuple[str, Any, Any]] = []
        self.fail_next = 0
        self.active: set[str] = set()
        self.overlaps = 0

    async def reconcile(self, rid: str, old: Any, new: Any) -> None:
        if rid in self.active:
            self.overlaps += 1
        self.active.add(rid)
        try:
            await asyncio.sleep(0)
            if self.fail_next:
                self.fail_next -= 1
                raise RuntimeError("downstream write failed")
            self.calls.append((rid, old, new))
        finally:
            self.active.discard(rid)


def resync(items: list[dict[str, Any]], initial: bool = True) -> Resynced:
    return Resynced(items, "http://api/vms", f"c{next(_cursors)}", 1, 0.0, initial)


async def test_a_change_repeated_1000_times_during_its_fetch_costs_at_most_two_fetches() -> None:
    source, api, rec = Source(), Api({"x": vm("x")}), Recorder()
    controller = Controller(source, fetch=api.fetch, reconcile=rec.reconcile, concurrency=4)
    async with controller:
        source.send(resync([]))
        await controller.wait_synced(5)
        api.gate = asyncio.Event()
        source.send(change("x"))
        await asyncio.wait_for(api.in_flight.wait(), 5)
        source.send(*(change("x") for _ in range(999)))
        await wait_until(lambda: controller.items == 1000, 5, message="items consumed")
        assert api.fetched["x"] == 1
        api.gate.set()
        await controller.wait_idle(5)
    assert api.fetched["x"] <= 2
    assert api.fetched["x"] == 2  # one in flight, one for everything that came meanwhile
    stats = controller.stats()
    assert stats.coalesced >= 998 and stats.items == 1000
    assert rec.calls == [("x", None, vm("x"))]  # the second fetch found nothing new


async def test_bootstrap_diff_calls_add_update_delete() -> None:
    source = Source()
    api = Api()
    added: list[str] = []
    updated: list[tuple[str, str, str]] = []
    deleted: list[str] = []
    controller = Controller(
        source,
        fetch=api.fetch,
        on_add=lambda rid, new: added.append(rid),  # plain functions work too
        on_update=lambda rid, old, new: updated.append((rid, old["alias"], new["alias"])),
        on_delete=lambda rid, old: deleted.append(rid),
    )
    async with controller:
        source.send(resync([vm("a"), vm("b"), vm("c")]))
        await controller.wait_synced(5)
        assert sorted(added) == ["a", "b", "c"] and controller.synced
        source.send(resync([vm("b", "renamed"), vm("c"), vm("d")], initial=False))
        await wait_until(lambda: len(deleted) == 1 and len(added) == 4, 5)
        await controller.wait_idle(5)
    assert updated == [("b", "a", "renamed")]
    assert deleted == ["a"]
    assert dict(controller.mirror) == {"b": vm("b", "renamed"), "c": vm("c"), "d": vm("d")}
    assert api.calls == []  # a bootstrap needs no fetches
    assert controller.stats().resyncs == 2


async def test_change_items_fetch_current_state_and_404_is_a_delete() -> None:
    source, api, rec = Source(), Api({"a": vm("a")}), Recorder()
    controller = Controller(source, fetch=api.fetch, reconcile=rec.reconcile)
    async with controller:
        source.send(resync([]))
        await controller.wait_synced(5)
        source.send(change("a"))
        await wait_until(lambda: "a" in controller.mirror, 5)
        api.data["a"] = vm("a", "v2")
        source.send(change("a"), change("a"))  # duplicates are harmless
        await wait_until(lambda: controller.mirror["a"]["alias"] == "v2", 5)
        del api.data["a"]
        source.send(change("a"), change("zz"))  # "zz" never existed: nothing to report
        await wait_until(lambda: "a" not in controller.mirror, 5)
        await controller.wait_idle(5)
    assert rec.calls == [
        ("a", None, vm("a")),
        ("a", vm("a"), vm("a", "v2")),
        ("a", vm("a", "v2"), None),
    ]


@pytest.mark.parametrize("expected", [False, True], ids=["application-error", "paging-error"])
async def test_failed_fetches_are_retried_with_backoff(
    expected: bool, caplog: pytest.LogCaptureFixture
) -> None:
    """Each failure is logged; with its traceback unless it is the default fetch's own
    PagingError, whose message says it all."""
    caplog.set_level(logging.WARNING, logger="changefeed")
    source, api, rec = Source(), Api({"a": vm("a")}), Recorder()
    api.failures = 3
    if expected:
        api.error = PagingError("GET /vms/a: gave up after 3 failed attempts")
    controller = Controller(source, fetch=api.fetch, reconcile=rec.reconcile, retry=FAST_RETRY)
    async with controller:
        source.send(resync([]), change("a"))
        await wait_until(lambda: rec.calls == [("a", None, vm("a"))], 5)
    stats = controller.stats()
    assert stats.fetch_errors == 3 and stats.retries == 3 and api.fetched["a"] == 4
    logged = [r for r in caplog.records if r.getMessage() == "controller.fetch_failed"]
    assert len(logged) == 3
    assert all((r.exc_info is None) is expected for r in logged)


async def test_failed_callbacks_are_retried_with_the_same_old_state() -> None:
    source, api, rec = Source(), Api(), Recorder()
    rec.fail_next = 2
    controller = Controller(source, fetch=api.fetch, reconcile=rec.reconcile, retry=FAST_RETRY)
    async with controller:
        source.send(resync([vm("a")]))
        await controller.wait_synced(5)
        source.send(resync([vm("a", "v2")], initial=False))
        await wait_until(lambda: controller.stats().resyncs == 2, 5)
        await controller.wait_idle(5)
    # The first two attempts failed; the application still saw None -> a, then a -> v2.
    assert rec.calls == [("a", None, vm("a")), ("a", vm("a"), vm("a", "v2"))]
    assert controller.stats().reconcile_errors == 2


async def test_a_failed_callback_is_undone_when_the_change_is_reverted() -> None:
    """A callback that raised may have applied part of its change (a write that
    committed before its connection died). If the resource then goes back to
    what the application last saw, the application is still called, from the
    state it may partly hold back to the current one; without that call it
    would keep the half-applied change forever."""
    source, api, rec = Source(), Api(), Recorder()
    slow_retry = BackoffPolicy(initial=1.0, maximum=1.0, jitter=0.0)
    controller = Controller(source, fetch=api.fetch, reconcile=rec.reconcile, retry=slow_retry)
    async with controller:
        source.send(resync([vm("a", "v1")]))
        await controller.wait_synced(5)
        rec.fail_next = 1
        source.send(resync([vm("a", "v2")], initial=False))
        await wait_until(lambda: controller.stats().reconcile_errors == 1, 5)
        source.send(resync([vm("a", "v1")], initial=False))  # before the retry is due
        await wait_until(lambda: len(rec.calls) == 2, 5, message="the revert reaches the app")
        await controller.wait_idle(5)
    assert rec.calls == [("a", None, vm("a", "v1")), ("a", vm("a", "v2"), vm("a", "v1"))]
    assert controller.stats().reconciles == 2


async def test_an_id_in_flight_during_a_resync_is_fetched_again() -> None:
    """A fetch that started before a bootstrap list may finish after it with older state:
    it must never be the last word."""
    source, api, rec = Source(), Api({"a": vm("a", "old")}), Recorder()
    controller = Controller(source, fetch=api.fetch, reconcile=rec.reconcile)
    async with controller:
        source.send(resync([]))
        await controller.wait_synced(5)
        api.gate = asyncio.Event()
        source.send(change("a"))
        await asyncio.wait_for(api.in_flight.wait(), 5)  # fetch returns "old" when released
        api.data["a"] = vm("a", "new")
        source.send(resync([vm("a", "new")], initial=False))
        await wait_until(lambda: controller.stats().resyncs == 2, 5)
        api.gate.set()
        await controller.wait_idle(5)
    assert controller.mirror["a"] == vm("a", "new")
    assert rec.calls[-1][2] == vm("a", "new")
    assert api.fetched["a"] == 2


async def test_no_id_is_reconciled_concurrently() -> None:
    ids = [f"id{i}" for i in range(20)]
    source, api, rec = Source(), Api({i: vm(i) for i in ids}), Recorder()
    controller = Controller(
        source, fetch=api.fetch, reconcile=rec.reconcile, concurrency=8, fetch_batch=3
    )
    async with controller:
        source.send(resync([]))
        for round_ in range(30):
            for i in ids:
                api.data[i] = vm(i, f"v{round_}")
                source.send(change(i))
        await wait_until(lambda: controller.items == 600, 10)
        await controller.wait_idle(10)
    assert rec.overlaps == 0
    assert {i: controller.mirror[i]["alias"] for i in ids} == dict.fromkeys(ids, "v29")
    assert max(len(call) for call in api.calls) <= 3  # batched, within fetch_batch


async def test_max_pending_stops_reading_the_source() -> None:
    source, api = Source(), Api({f"i{n}": vm(f"i{n}") for n in range(10)})
    api.gate = asyncio.Event()
    controller = Controller(source, fetch=api.fetch, concurrency=1, fetch_batch=1, max_pending=3)
    async with controller:
        source.send(resync([]), *(change(f"i{n}") for n in range(10)))
        await asyncio.wait_for(api.in_flight.wait(), 5)
        await wait_until(lambda: controller.queue.pending >= 3, 5)
        assert source.queue.qsize() > 0  # events are left in the source: back-pressure
        assert controller.items < 10
        api.gate.set()
        await wait_until(lambda: controller.items == 10, 5)
        await controller.wait_idle(5)
    assert len(controller.mirror) == 10


async def test_wait_synced_raises_when_the_source_fails() -> None:
    """... and so does the block's exit, though the block caught it: the controller
    stopped for good (``exception()``)."""
    source, api = Source(), Api()
    controller = Controller(source, fetch=api.fetch)
    with pytest.raises(RegistrationRefused) as exited:
        async with controller:
            source.send(RegistrationRefused("unknown_resource", "no feed for 'vmz'", 4001))
            with pytest.raises(RegistrationRefused) as waited:
                await controller.wait_synced(5)
    assert exited.value is waited.value is controller.exception()


async def test_run_returns_when_the_source_ends() -> None:
    source, api = Source(), Api()
    controller = Controller(source, fetch=api.fetch)
    source.send(resync([vm("a")]))
    source.end()
    await asyncio.wait_for(controller.run(), 5)
    assert "a" in controller.mirror and controller.stats().resyncs == 1


def test_configuration_errors() -> None:
    source, api = Source(), Api()
    with pytest.raises(ListenerConfigError, match="either reconcile"):
        Controller(source, fetch=api.fetch, reconcile=print, on_add=print)
    with pytest.raises(ListenerConfigError, match="fetch"):
        Controller(source)
    with pytest.raises(ListenerConfigError, match="concurrency"):
        Controller(source, fetch=api.fetch, concurrency=0)
    resuming = Listener(
        "ws://127.0.0.1:9/changefeeds", instance="i", service="s", change_kind=ChangeKind("vm"),
        cursor="saved",
    )  # fmt: skip
    with pytest.raises(ListenerConfigError, match="must bootstrap"):
        Controller(resuming)
    with pytest.raises(ListenerConfigError, match="resync_period"):
        Controller(source, fetch=api.fetch, resync_period=0)
    for setting, bad in (
        ("concurrency", math.nan),  # a NaN slipped past ``< 1``
        ("fetch_batch", 2.5),
        ("max_pending", True),
        ("resync_period", math.inf),
        ("retry", 0.5),
    ):
        with pytest.raises(ListenerConfigError, match=f"^{setting}: "):
            # Values of the wrong type, on purpose: the checks under test refuse them.
            Controller(source, fetch=api.fetch, **{setting: bad})  # type: ignore[arg-type]
    two = Listener(
        "ws://127.0.0.1:9/changefeeds", instance="i", service="s",
        change_kinds=[ChangeKind("vm"), ChangeKind("server")],
    )  # fmt: skip
    with pytest.raises(ListenerConfigError, match="follows vm, server: say which one"):
        Controller(two)
    with pytest.raises(ListenerConfigError, match="'nic' is not registered"):
        Controller(two, resource="nic")
    with pytest.raises(ListenerConfigError, match="named twice"):
        Listener(
            "ws://127.0.0.1:9/changefeeds", instance="i", service="s",
            change_kinds=[ChangeKind("vm"), ChangeKind("vm", ("nic",))],
        )  # fmt: skip


def test_checkpoint_configuration_errors(tmp_path: Path) -> None:
    store = SqliteCheckpointStore(tmp_path / "cp.sqlite")

    def listener(**options: Any) -> Listener:
        return Listener(
            "ws://127.0.0.1:9/changefeeds", instance="i", service="s",
            change_kinds=[ChangeKind("vm"), ChangeKind("server")], **options,
        )  # fmt: skip

    with pytest.raises(ListenerConfigError, match="not both"):
        listener(cursor="saved", checkpoint=store)
    with pytest.raises(ListenerConfigError, match="decode but no encode"):
        Controller(listener(checkpoint=store), resource="vm", decode=dict)
    late = listener()
    Controller(late, resource="vm", decode=dict)
    with pytest.raises(ListenerConfigError, match="decode but no encode"):
        Controller(late, resource="server", checkpoint=store)  # the store covers both
    shared = listener(checkpoint=store)
    Controller(shared, resource="vm")
    with pytest.raises(ListenerConfigError, match="two controllers named"):
        Controller(shared, resource="vm")  # the same default name
    Controller(shared, resource="vm", name="again")
    Controller(shared, resource="server", checkpoint=store)  # the listener's own: fine
    with pytest.raises(ListenerConfigError, match="another store"):
        Controller(shared, resource="server", name="other", checkpoint=SqliteCheckpointStore("x"))
    with pytest.raises(ListenerConfigError, match="kept by a Listener"):
        Controller(Source(), fetch=Api().fetch, checkpoint=store)
    with pytest.raises(ListenerConfigError, match="checkpoint_interval"):
        ListenerConfig(checkpoint_interval=0)


async def test_a_controller_cannot_join_a_listener_that_started() -> None:
    listener = Listener(
        "ws://127.0.0.1:9/changefeeds", instance="i", service="s", change_kind=ChangeKind("vm"),
    )  # fmt: skip
    async with listener:
        with pytest.raises(ListenerConfigError, match="before the listener starts"):
            Controller(listener)


async def test_a_periodic_resync_coalesces_with_a_real_change_of_the_same_id() -> None:
    """The resync goes through the work queue: an id already queued for a real change
    gets one callback, with the real old and new, not two."""
    source, api, rec = Source(), Api({"x": vm("x")}), Recorder()
    controller = Controller(source, fetch=api.fetch, reconcile=rec.reconcile)
    async with controller:
        source.send(resync([vm("x")]))
        await controller.wait_synced(5)
        api.gate = asyncio.Event()
        api.data["x"] = vm("x", "b")
        source.send(change("x"))
        await asyncio.wait_for(api.in_flight.wait(), 5)  # x's fetch is in flight
        controller._core.resync_pass()  # the period elapses now
        api.gate.set()
        await controller.wait_idle(5)
        # A pass with nothing pending for x: one callback, old == new.
        controller._core.resync_pass()
        await controller.wait_idle(5)
    assert rec.calls == [
        ("x", None, vm("x")),
        ("x", vm("x"), vm("x", "b")),  # the real change; the resync coalesced into it
        ("x", vm("x", "b"), vm("x", "b")),  # the next pass: old == new
    ]
    assert controller.stats().periodic_resyncs == 2


class Host(NamedTuple):
    uuid: str
    alias: str

    @classmethod
    def from_json(cls, doc: Any) -> Host:
        if not isinstance(doc.get("alias"), str):
            raise ValueError("alias must be a string")
        return cls(doc["uuid"], doc["alias"])


async def test_decode_gives_the_application_its_own_type_and_retries_what_it_refuses() -> None:
    source, api = Source(), Api({"a": vm("a"), "b": {"uuid": "b", "alias": None}})
    calls: list[tuple[str, Host | None, Host | None]] = []

    def reconcile(key: str, old: Host | None, new: Host | None) -> None:
        calls.append((key, old, new))

    controller = Controller[Host](
        source, fetch=api.fetch, decode=Host.from_json, reconcile=reconcile, retry=FAST_RETRY
    )
    async with controller:
        source.send(resync([vm("a"), {"uuid": "b", "alias": None}]))
        await wait_until(lambda: controller.stats().decode_errors >= 2, 5)  # b, and its refetch
        assert controller.mirror == {"a": Host("a", "a")}
        api.data["b"] = vm("b", "fixed")  # the API serves a decodable b again
        await wait_until(lambda: "b" in controller.mirror, 5)
        await controller.wait_idle(5)
    assert calls == [("a", None, Host("a", "a")), ("b", None, Host("b", "fixed"))]


async def test_with_a_resource_a_controller_ignores_other_resources_events() -> None:
    source, api, rec = Source(), Api({"n1": vm("n1")}), Recorder()
    controller = Controller(source, resource="network", fetch=api.fetch, reconcile=rec.reconcile)
    other = ChangeItem(ChangeKind("vm", ()), "v1", "c-other", "2026-11-21T23:00:00Z")
    mine = ChangeItem(ChangeKind("network", ()), "n1", "c-mine", "2026-11-21T23:00:00Z")
    async with controller:
        source.send(Resynced([vm("v1")], "http://api/vms", "c0", resource="vm"))
        source.send(Resynced([], "http://api/networks", "c0", resource="network"))
        await controller.wait_synced(5)
        source.send(other, mine)
        await wait_until(lambda: controller.items == 1, 5)
        await controller.wait_idle(5)
    assert rec.calls == [("n1", None, vm("n1"))]
    assert controller.resource == "network" and api.fetched == {"n1": 1}


async def test_a_shared_listener_starts_once_every_attached_controller_runs() -> None:
    """Started earlier, the listener would hand the bootstrap to one controller only."""
    listener = Listener(
        "ws://127.0.0.1:9/changefeeds", instance="i", service="s",
        change_kinds=[ChangeKind("vm"), ChangeKind("server")],
        config=ListenerConfig(backoff=FAST_RETRY),
    )  # fmt: skip
    vms = Controller(listener, resource="vm")
    servers = Controller(listener, resource="server")
    assert (vms.name, servers.name) == ("s:vm+server/vm", "s:vm+server/server")
    with capture_events() as events:
        async with vms:
            await wait_until(lambda: events.named("listener.waiting_for_controllers"), 5)
            assert listener.state is ConnectionState.IDLE
            async with servers:
                await wait_until(lambda: listener.status().attempts >= 1, 5)
            # vms still runs. (mypy still holds listener.state to the IDLE asserted
            # above, though the listener started since: hence the ignores.)
            assert listener.state is not ConnectionState.STOPPED  # type: ignore[comparison-overlap]
        # The last one out closed it.
        assert listener.state is ConnectionState.STOPPED  # type: ignore[comparison-overlap]
    (waiting,) = events.named("listener.waiting_for_controllers")
    assert (waiting["running"], waiting["attached"]) == (1, 2)


async def test_a_controller_whose_constructor_fails_does_not_keep_the_listener_waiting(
    tmp_path: Path,
) -> None:
    """The failed controller never runs: the listener must start once the others do."""
    listener = Listener(
        "ws://127.0.0.1:9/changefeeds", instance="i", service="s",
        change_kinds=[ChangeKind("vm"), ChangeKind("server")],
        config=ListenerConfig(backoff=FAST_RETRY),
        checkpoint=SqliteCheckpointStore(tmp_path / "a.sqlite"),
    )  # fmt: skip
    with pytest.raises(ListenerConfigError, match="another store"):
        Controller(
            listener, resource="vm", name="failed",
            checkpoint=SqliteCheckpointStore(tmp_path / "b.sqlite"),
        )  # fmt: skip
    vms = Controller(listener, resource="vm")
    servers = Controller(listener, resource="server")
    async with vms, servers:
        await wait_until(lambda: listener.status().attempts >= 1, 5, message="started")


def restored(controller: Controller[Any], items: dict[str, Any], pending: Sequence[str]) -> None:
    """Load ``items`` into the controller as a checkpoint would (its sink's ``restore``)."""
    controller._core.restore(MirrorCheckpoint("vm", items, (), pending))


async def test_a_forced_id_waiting_out_a_failed_callback_stays_pending_in_a_checkpoint() -> None:
    """Restored as pending, fetched unchanged, its callback failed: a checkpoint taken
    while it waits for the retry must still list it, or a restart never calls back."""
    source, api, rec = Source(), Api({"x": vm("x")}), Recorder()
    slow = BackoffPolicy(initial=60, maximum=60, jitter=0.0)
    controller = Controller(source, fetch=api.fetch, reconcile=rec.reconcile, retry=slow)
    restored(controller, {"x": vm("x")}, ["x"])
    rec.fail_next = 1
    async with controller:
        await wait_until(lambda: controller.stats().reconcile_errors == 1, 5, message="failed")
        assert "x" in controller._core.checkpoint_part(None).pending


async def test_wait_synced_returns_while_new_changes_keep_the_queue_busy() -> None:
    """Synced means: every id the first bootstrap queued was processed once. Changes
    arriving faster than the callbacks keep the queue from ever going idle."""
    source = Source()
    api = Api({f"v{n}": vm(f"v{n}") for n in range(20)})
    done: list[str] = []

    async def reconcile(key: str, old: Any, new: Any) -> None:
        await asyncio.sleep(0.005)
        done.append(key)

    controller = Controller(source, fetch=api.fetch, reconcile=reconcile, concurrency=1)
    stop = asyncio.Event()

    async def keep_changing() -> None:
        for n in itertools.count():
            if stop.is_set():
                return
            api.data[f"new{n}"] = vm(f"new{n}")
            source.send(change(f"new{n}"))
            await asyncio.sleep(0.001)

    async with controller:
        source.send(resync([vm(f"v{n}") for n in range(20)]))
        changing = asyncio.create_task(keep_changing())
        try:
            await controller.wait_synced(10)
            assert controller.queue.pending > 0  # never idle, and synced all the same
            assert {f"v{n}" for n in range(20)} <= set(done)
        finally:
            stop.set()
            await changing


@pytest.mark.parametrize("first_sync", ["bootstrap", "resume"])
async def test_wait_synced_when_the_first_sync_finds_an_id_settled_in_its_batch(
    first_sync: str,
) -> None:
    """A worker processes a batch one id at a time: an id it has already called back is
    still "processing" while the worker waits for the next id's callback. The first
    bootstrap (or resume) arriving then must not wait for that id again: on a
    bootstrap, by counting its next completion as the stale one it skips; on a
    resume, by keeping it in the snapshot although nothing queues it again. Either
    way it would never leave the snapshot, and wait_synced would never return.
    (Restored pending ids are processed with the application's own ``fetch`` while
    the listener registers.)"""
    source = Source()
    api = Api({"k1": vm("k1", "b"), "k2": vm("k2", "b")})
    gate = asyncio.Event()
    holding = asyncio.Event()
    calls: list[str] = []

    async def reconcile(key: str, old: Any, new: Any) -> None:
        if calls and not gate.is_set():  # the batch's second id: hold its callback
            holding.set()
            await gate.wait()
        calls.append(key)

    controller = Controller(source, fetch=api.fetch, reconcile=reconcile, concurrency=1)
    restored(controller, {"k1": vm("k1", "a"), "k2": vm("k2", "a")}, ["k1", "k2"])
    async with controller:
        await asyncio.wait_for(holding.wait(), 5)  # one called back, the other's under way
        assert len(calls) == 1 and controller.queue.processing == {"k1", "k2"}
        if first_sync == "bootstrap":  # resumed: false
            source.send(resync([vm("k1", "b"), vm("k2", "b")]))
            await wait_until(lambda: controller.stats().resyncs == 1, 5, message="resynced")
        else:
            controller._core.resumed(60.0)  # what the listener's sink does when the ack resumed
        gate.set()
        await controller.wait_idle(5)
        await controller.wait_synced(5)
