"""The controller: a mirror of one resource kept current from a listener.

client-go's informer + controller in one object, for RFD 5 feeds that say
*that* a resource changed, never *what*:

* A ``Resynced`` (bootstrap) replaces the mirror in one step. Ids whose state
  changed are queued for the application's callbacks; ids missing from the
  fresh list are deletes. Ids being fetched right then are queued again with a
  fresh fetch, because a fetch that started before the list may finish after
  it with older state.
* Change items mark their ids stale and queue them (a batch at a time). A
  worker fetches the current state (``GET route/id``, or ``GET route?ids=a,b,c``
  for several at once; absent means deleted), writes it to the mirror and
  calls ``on_add`` / ``on_update`` / ``on_delete`` (or one ``reconcile``) with
  the state the application last saw and the new one.
* The work queue coalesces repeated changes to one id into one fetch and
  never processes one id concurrently; fetch concurrency is bounded by the
  number of workers. A failed fetch or callback is retried per id with
  exponential back-off; the application's view advances only when its
  callback returns, so a failed callback is called again with the same ``old``.
* Duplicate and out-of-order items are harmless: every fetch reads current state.
* When the application falls ``max_pending`` ids behind, the controller
  takes no more events, and the listener's buffer then fills and, if it
  must, overflows (abort, back off, re-bootstrap).
* With ``resync_period``, every resource of the mirror goes through the work
  queue again once a period, and the application is called with ``old ==
  new`` (client-go's resync): a change the application dropped is handed to
  it again, without listing anything again.
* ``decode`` turns each resource's JSON into the application's own type
  ``T``; the mirror and the callbacks hold ``T``.
* With a checkpoint store on its listener (``_checkpoint``), the mirror is
  saved with the listener's cursor and loaded at start: the controller then
  starts from the mirror as its callbacks last saw it, fetches again the ids
  that were pending, and is called back only for what changed since.

Several controllers may share one Listener, one per resource it registers
(``resource=``): each has its own mirror, work queue and callbacks, and sees
only its resource's bootstrap and items.

What it must never do: call back for an id concurrently, lose a change that
arrived while its id was being fetched, or let a stale fetch be the last word.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import math
import random
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, fields
from types import TracebackType
from typing import Any, Generic, Self

import orjson
from prometheus_client import CollectorRegistry
from typing_extensions import TypeVar

from changefeed.bootstrap import fetch_many, fetch_one
from changefeed.logs import log_event
from changefeed.schemas import ChangeItem

from ._backoff import DEFAULT_ITEM_BACKOFF, BackoffPolicy, ItemBackoff
from ._checkpoint import CheckpointStore, JsonItems, MirrorCheckpoint, application_view
from ._errors import ListenerConfigError, ListenerError
from ._events import Resynced
from ._handlers import (
    AddHandler,
    DeleteHandler,
    EventSource,
    Fetcher,
    ReconcileHandler,
    UpdateHandler,
)
from ._listener import Listener
from ._metrics import Sample, register_controller
from ._mirror import Mirror
from ._workqueue import WorkQueue

__all__ = ["Controller", "ControllerStats"]

log = logging.getLogger("changefeed.listener.controller")

T = TypeVar("T", default=Any)

_NOTHING = object()
"""No failed callback is on record for an id."""


class _Undecodable:
    """What ``decode`` refused."""


_UNDECODABLE = _Undecodable()


@dataclass(frozen=True, slots=True)
class ControllerStats:
    """A snapshot of a controller (``controller.stats()``); also its metrics.

    Attributes:
        depth: ids ready to be processed.
        pending: ids queued, requeued behind a running worker, or waiting out a retry.
        processing: ids held by workers.
        adds: ids added to the work queue.
        coalesced: adds of an id that was already queued.
        retries: rate-limited re-adds after a failed fetch or callback.
        items: change items taken from the listener.
        fetches: resources fetched.
        fetch_requests: fetch calls (one per batch).
        fetch_errors: fetch calls that failed.
        decode_errors: resources ``decode`` refused (retried like a failed fetch).
        reconciles: callbacks completed.
        reconcile_errors: callbacks that raised.
        resyncs: bootstraps applied to the mirror.
        periodic_resyncs: passes of ``resync_period`` over the mirror.
        mirror_items: resources in the mirror.
        synced: the first bootstrap has been applied and its work finished.
    """

    depth: int
    pending: int
    processing: int
    adds: int
    coalesced: int
    retries: int
    items: int
    fetches: int
    fetch_requests: int
    fetch_errors: int
    decode_errors: int
    reconciles: int
    reconcile_errors: int
    resyncs: int
    periodic_resyncs: int
    mirror_items: int
    synced: bool

    def to_json(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


async def _call(callback: Callable[..., Awaitable[None] | None], *args: Any) -> None:
    result = callback(*args)
    if inspect.isawaitable(result):
        await result


def _listener_resource(listener: Listener, resource: str | None) -> str:
    if resource is not None:
        return resource
    if len(listener.resources) == 1:
        return listener.resources[0]
    raise ListenerConfigError(
        "resource",
        f"listener {listener.name} follows {', '.join(listener.resources)}: say which one",
    )


class Controller(Generic[T]):
    """Keeps a mirror of one resource current and calls the application back on changes.

    Either ``reconcile(id, old, new)`` or any of ``on_add(id, new)``,
    ``on_update(id, old, new)``, ``on_delete(id, old)`` (see ``_handlers``);
    ``old``/``new`` are None for a resource that did not / does not exist.
    Callbacks may be coroutine functions or plain functions; one that raises
    is retried with back-off (with the same ``old``).

    Args:
        listener: where events come from. A Listener is shared: the controller
            attaches to it for one ``resource``, the listener starts once every
            controller attached to it runs, and closes when the last one stops.
            Any other async-iterable of events is read as it is.
        resource: which of the listener's resources this controller mirrors
            (default: its only one). With another source, events of other
            resources are ignored.
        reconcile: the one callback for every change.
        on_add: a resource appeared.
        on_update: a resource changed (or, on a periodic resync, did not).
        on_delete: a resource disappeared.
        decode: turns a resource's JSON into the application's ``T``; what it
            refuses is logged and retried with back-off, like a failed fetch.
            ``T`` must compare by value (dataclasses, msgspec Structs do).
        encode: turns a ``T`` back into JSON for a checkpoint (``decode`` of the
            result must give it back); required with ``decode`` when the
            listener has a checkpoint store. It may run off the event loop.
        checkpoint: a checkpoint store for the listener (and so for every
            controller attached to it); the same as ``Listener(checkpoint=...)``.
        fetch: how to fetch resources by id (default: the bootstrap client's
            ``fetch_one`` / ``fetch_many`` on the resource's route and the
            listener's HTTP client).
        key: the id of a listed resource, from its JSON (default: its ``id_field``).
        id_field: the field holding a resource's id.
        concurrency: workers, hence concurrent fetches.
        fetch_batch: ids per fetch request (1: one ``GET route/id`` each).
        fetch_attempts: attempts per fetch request before the ids are retried later.
        retry: the per-id retry schedule of failed fetches and callbacks
            (default: 50 ms doubling to 30 s, full jitter).
        max_pending: take no more events while this many ids wait.
        resync_period: seconds between passes that hand every mirrored resource
            to the callbacks again (``old == new``); None: never.
        name: the controller's name in logs and metrics (default: the
            listener's name, plus ``/resource`` on a shared listener).
        registry: a Prometheus registry to expose the work-queue metrics on.
        rng: random source of the retry jitter.

    Raises:
        ListenerConfigError: both ``reconcile`` and an ``on_*`` callback, a bad number,
            a resource the listener does not register (or none named on a listener
            of several), a listener that has started, or one holding a saved cursor
            (the mirror starts empty, so the listener must bootstrap: a checkpoint
            store saves and loads the mirror with the cursor instead); with a
            checkpoint store, ``decode`` without ``encode`` or a name another
            controller of the listener has.
    """

    def __init__(
        self,
        listener: Listener | EventSource,
        *,
        resource: str | None = None,
        reconcile: ReconcileHandler[T] | None = None,
        on_add: AddHandler[T] | None = None,
        on_update: UpdateHandler[T] | None = None,
        on_delete: DeleteHandler[T] | None = None,
        decode: Callable[[Any], T] | None = None,
        encode: Callable[[T], Any] | None = None,
        checkpoint: CheckpointStore | None = None,
        fetch: Fetcher | None = None,
        key: Callable[[Any], str] | None = None,
        id_field: str = "uuid",
        concurrency: int = 4,
        fetch_batch: int = 50,
        fetch_attempts: int = 3,
        retry: BackoffPolicy | None = None,
        max_pending: int = 10_000,
        resync_period: float | None = None,
        name: str | None = None,
        registry: CollectorRegistry | None = None,
        rng: random.Random | None = None,
    ) -> None:
        if reconcile is not None and (on_add or on_update or on_delete):
            raise ListenerConfigError("reconcile", "give either reconcile or on_add/update/delete")
        for setting, value in (
            ("concurrency", concurrency),
            ("fetch_batch", fetch_batch),
            ("fetch_attempts", fetch_attempts),
            ("max_pending", max_pending),
        ):
            if value < 1:
                raise ListenerConfigError(setting, f"must be at least 1, got {value!r}")
        if resync_period is not None and not resync_period > 0:
            raise ListenerConfigError("resync_period", f"must be > 0, got {resync_period!r}")
        shared = isinstance(listener, Listener)
        if fetch is None and not shared:
            raise ListenerConfigError("fetch", "is required when the source is not a Listener")
        if checkpoint is not None and not shared:
            raise ListenerConfigError("checkpoint", "is kept by a Listener: give it one")
        if isinstance(listener, Listener):
            if listener.cursor is not None:
                # The mirror starts empty: resuming would skip the bootstrap that fills it.
                raise ListenerConfigError(
                    "listener.cursor",
                    "a controller's listener must bootstrap: pass no saved cursor",
                )
            resource = _listener_resource(listener, resource)
            default_name = listener.name
            if len(listener.resources) > 1:
                default_name += f"/{resource}"
        else:
            default_name = "controller"
        self.listener = listener
        self.resource = resource
        self.name = name or default_name
        self._reconcile = reconcile
        self._on_add = on_add
        self._on_update = on_update
        self._on_delete = on_delete
        self._decode = decode
        self._encode = encode
        self._fetch = fetch or self._default_fetch
        self._key = key or (lambda obj: str(obj[id_field]))
        self._id_field = id_field
        self.concurrency = concurrency
        self.fetch_batch = fetch_batch
        self.fetch_attempts = fetch_attempts
        self.max_pending = max_pending
        self.resync_period = resync_period
        self._mirror: Mirror[T] = Mirror()
        self.queue: WorkQueue[str] = WorkQueue()
        self._retry = ItemBackoff(retry or DEFAULT_ITEM_BACKOFF, rng)
        self._stale: set[str] = set()
        self._seen: dict[str, T | None] = {}  # id -> state the application last saw
        # id -> the new state of a callback that raised: the application may hold
        # part of it, even if the mirror goes back to what it last saw.
        self._attempted: dict[str, Any] = {}
        self._resyncing: set[str] = set()  # ids a periodic resync hands out again
        # Ids called back even when unchanged, after a restore: the process that saved
        # the checkpoint may have told the application of a state in between.
        self._forced: set[str] = set()
        self._replay_until: float | None = None  # items until then add to ``_forced``
        self._restored = False
        self._fetching: set[str] = set()  # ids whose fetch is under way
        # Ids whose state as the application saw it may have changed since the last
        # checkpoint (None: no checkpoint is kept, nothing is tracked).
        self._touched: set[str] | None = None
        self._route: str | None = None
        self._synced = asyncio.Event()
        self._resynced_once = False
        self._room = asyncio.Event()
        self._ended = asyncio.Event()
        self._failure: BaseException | None = None
        self._task: asyncio.Task[None] | None = None
        self._sync_task: asyncio.Task[None] | None = None
        self.items = 0
        self.fetches = 0
        self.fetch_requests = 0
        self.fetch_errors = 0
        self.decode_errors = 0
        self.reconciles = 0
        self.reconcile_errors = 0
        self.resyncs = 0
        self.periodic_resyncs = 0
        self._sink: _Sink | None = None
        if isinstance(listener, Listener):
            assert resource is not None
            self._sink = _Sink(self)
            listener._attach(resource, self._sink)
            if checkpoint is not None:
                listener._use_checkpoint(checkpoint)
        if registry is not None:
            register_controller(registry, self)

    # -- public face -----------------------------------------------------------

    @property
    def mirror(self) -> Mapping[str, T]:
        """A read-only live view of the mirror: id -> resource."""
        return self._mirror.view()

    @property
    def synced(self) -> bool:
        """The first bootstrap has been applied and its work finished."""
        return self._synced.is_set()

    def stats(self) -> ControllerStats:
        """A snapshot of the work queue and the controller's counters."""
        queue = self.queue
        return ControllerStats(
            depth=len(queue),
            pending=queue.pending,
            processing=len(queue.processing),
            adds=queue.adds,
            coalesced=queue.coalesced,
            retries=queue.retries,
            items=self.items,
            fetches=self.fetches,
            fetch_requests=self.fetch_requests,
            fetch_errors=self.fetch_errors,
            decode_errors=self.decode_errors,
            reconciles=self.reconciles,
            reconcile_errors=self.reconcile_errors,
            resyncs=self.resyncs,
            periodic_resyncs=self.periodic_resyncs,
            mirror_items=len(self._mirror),
            synced=self.synced,
        )

    def metric_samples(self) -> list[Sample]:
        """This controller's values for the work-queue and controller metrics."""
        st = self.stats()
        w, c = "changefeed_workqueue_", "changefeed_controller_"
        return [
            Sample(w + "depth", st.depth),
            Sample(w + "pending", st.pending),
            Sample(w + "processing", st.processing),
            Sample(w + "adds", st.adds),
            Sample(w + "coalesced", st.coalesced),
            Sample(w + "retries", st.retries),
            Sample(c + "fetches", st.fetches),
            Sample(c + "fetch_requests", st.fetch_requests),
            Sample(c + "fetch_errors", st.fetch_errors),
            Sample(c + "decode_errors", st.decode_errors),
            Sample(c + "reconciles", st.reconciles),
            Sample(c + "reconcile_errors", st.reconcile_errors),
            Sample(c + "resyncs", st.resyncs),
            Sample(c + "periodic_resyncs", st.periodic_resyncs),
            Sample(c + "mirror_items", st.mirror_items),
        ]

    async def wait_synced(self, timeout: float | None = None) -> None:  # noqa: ASYNC109
        """Wait until the first bootstrap is in the mirror and its callbacks have run, or,
        for a mirror loaded from a checkpoint, until the listener resumed its cursor
        and the ids loaded as pending have been fetched and called back.

        Raises:
            TimeoutError: not synced within ``timeout`` seconds.
            ListenerError: the controller stopped (e.g. the registration was refused).
        """
        async with asyncio.timeout(timeout):
            synced = asyncio.ensure_future(self._synced.wait())
            ended = asyncio.ensure_future(self._ended.wait())
            try:
                await asyncio.wait({synced, ended}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                synced.cancel()
                ended.cancel()
        if not self._synced.is_set():
            raise self._failure or ListenerError("the controller stopped before it synced")

    async def wait_idle(self, timeout: float | None = None) -> None:  # noqa: ASYNC109
        """Wait until nothing is queued, being processed or waiting out a retry.

        Raises:
            TimeoutError: not idle within ``timeout`` seconds.
        """
        async with asyncio.timeout(timeout):
            await self.queue.wait_idle()

    async def run(self) -> None:
        """Follow the listener and keep the mirror current until cancelled or the
        listener stops.

        Raises:
            RegistrationRefused, RetriesExhausted: from the listener.
        """
        helpers = [
            asyncio.create_task(self._work(), name=f"changefeed-worker-{self.name}-{n}")
            for n in range(self.concurrency)
        ]
        if self.resync_period is not None:
            helpers.append(
                asyncio.create_task(
                    self._resync_every(self.resync_period), name=f"changefeed-resync-{self.name}"
                )
            )
        try:
            if self._sink is not None:
                await self._follow_listener(self._sink)
            else:
                await self._consume()
        except BaseException as exc:
            if not isinstance(exc, asyncio.CancelledError):
                self._failure = exc
            raise
        finally:
            if self._sink is not None and isinstance(self.listener, Listener):
                # Before this controller takes nothing more: the listener's last
                # checkpoint must see its mirror with the cursor it has reached.
                self.listener._controller_stopping(self._sink)
            self._ended.set()
            self._room.set()  # a dispatch task waiting for this controller's room goes on
            self.queue.shut_down()
            if self._sync_task is not None:
                helpers.append(self._sync_task)
            for helper in helpers:
                helper.cancel()
            await asyncio.gather(*helpers, return_exceptions=True)
            if self._sink is not None and isinstance(self.listener, Listener):
                await self.listener._controller_done(self._sink)

    async def __aenter__(self) -> Self:
        """Run in a background task until the block exits."""
        self._task = asyncio.create_task(self.run(), name=f"changefeed-controller-{self.name}")
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    async def close(self) -> None:
        """Stop the background task started by ``async with`` (idempotent)."""
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    # -- events -----------------------------------------------------------------

    async def _follow_listener(self, sink: _Sink) -> None:
        """Wait while the listener's dispatch task feeds ``sink``; raise how it stopped."""
        assert isinstance(self.listener, Listener)
        stopped = sink.running()
        self.listener._controller_running(sink)
        await stopped

    async def _consume(self) -> None:
        """Read another event source one event at a time."""
        source = self.listener
        assert not isinstance(source, Listener)
        resource = self.resource
        async for event in source:
            if isinstance(event, Resynced):
                if resource is None or event.resource in ("", resource):
                    self._apply_resync(event)
            elif isinstance(event, ChangeItem):
                if resource is not None and event.change_kind.resource != resource:
                    continue
                while self._room_left() <= 0:
                    await self._wait_room()
                self._take_items((event,))

    def _room_left(self) -> int:
        return self.max_pending - self.queue.pending

    async def _wait_room(self, gone: Callable[[], bool] | None = None) -> None:
        """Return once there is room, the controller ended, or ``gone()`` says so."""
        while self._room_left() <= 0 and not self._ended.is_set():
            if gone is not None and gone():
                return
            self._room.clear()
            await self._room.wait()

    def _take_items(self, items: Sequence[ChangeItem]) -> None:
        self.items += len(items)
        ids = [item.changed_resource_id for item in items]
        self._stale.update(ids)
        if self._replay_until is not None:
            if time.monotonic() < self._replay_until:
                self._forced.update(ids)
            else:
                self._replay_until = None
        self.queue.add_many(ids)

    def _apply_resync(self, event: Resynced) -> None:
        self._route = event.route
        fresh: dict[str, T] = {}
        refetch: list[str] = []
        for obj in event.items:
            try:
                key = self._key(obj)
            except (KeyError, TypeError, IndexError):
                log_event(
                    log, "controller.unkeyed", logging.WARNING, controller=self.name, item=obj
                )
                continue
            value = self._decoded(key, obj)
            if isinstance(value, _Undecodable):
                # Not the application's type: keep what the mirror held, and fetch
                # it again (with back-off) until it decodes.
                refetch.append(key)
                if key in self._mirror:
                    fresh[key] = self._mirror[key]
                continue
            fresh[key] = value
        changes = self._mirror.replace(fresh)
        for change in changes:
            self._seen.setdefault(change.id, change.old)
            self.queue.add(change.id)
        if self._touched is not None:
            self._touched.update(change.id for change in changes)
        for busy in self.queue.processing:
            self._stale.add(busy)
            self.queue.add(busy)
        for key in refetch:
            self._stale.add(key)
            self.queue.add_rate_limited(key, self._retry.failure(key))
        self.resyncs += 1
        log_event(
            log,
            "controller.resynced",
            controller=self.name,
            items=len(fresh),
            changed=len(changes),
            undecodable=len(refetch),
            initial=event.initial,
            pending=self.queue.pending,
        )
        if not self._resynced_once:
            self._resynced_once = True
            self._sync_task = asyncio.create_task(self._mark_synced())

    def _decoded(self, key: str, obj: Any) -> T | _Undecodable:
        """``obj`` as the application's type, or ``_UNDECODABLE`` when ``decode`` refuses it."""
        if self._decode is None:
            decoded: T = obj  # no decoder: T is the JSON itself
            return decoded
        try:
            return self._decode(obj)
        except Exception as exc:
            self.decode_errors += 1
            log_event(
                log,
                "controller.decode_failed",
                logging.WARNING,
                exc=exc,
                controller=self.name,
                id=key,
            )
            return _UNDECODABLE

    # -- checkpoints ----------------------------------------------------------------

    def _restore(self, part: MirrorCheckpoint) -> None:
        """Start from a checkpoint's mirror (no callbacks for it); its pending ids, and
        any ``decode`` refuses, are fetched again and called back if they changed."""
        refetch = set(part.pending)
        held = part.items
        if self._decode is None:
            if isinstance(held, JsonItems) and not held.values_held:
                # Decoded as they are read: going live does not wait for a million objects.
                encoded = held.encoded
                self._mirror.restore_encoded(
                    encoded if isinstance(encoded, dict) else dict(encoded), orjson.loads
                )
            else:
                self._mirror.restore(held)  # the JSON itself is T
        else:
            decoded: dict[str, T] = {}
            for key, raw in held.items():
                value = self._decoded(key, raw)
                if isinstance(value, _Undecodable):
                    refetch.add(key)
                else:
                    decoded[key] = value
            self._mirror.restore(decoded)
        self._touched = set()
        self._restored = True
        self._forced.update(refetch)
        self._stale.update(refetch)
        self.queue.add_many(refetch)
        log_event(
            log,
            "controller.restored",
            controller=self.name,
            items=len(self._mirror),
            pending=len(refetch),
        )

    def _track_changes(self) -> None:
        """Start counting the ids a checkpoint must save again (nothing was restored)."""
        if self._touched is None:
            self._touched = set()

    def _checkpoint_part(self, changed: set[str] | None) -> MirrorCheckpoint:
        """This controller's part of a checkpoint taken now: every resource as the
        application saw it (``changed`` None), or those of ``changed`` (ids absent
        from the view are deleted), and every id with work outstanding."""
        seen, resource = self._seen, self.resource or ""
        deleted: list[str] = []
        encoded: dict[str, bytes] = {}
        if changed is None:
            values, encoded = self._mirror.copy_parts()
            for key in seen:
                encoded.pop(key, None)  # what the application saw instead, or nothing
            view = application_view(values, seen)
        else:
            view = {}
            get = self._mirror.get
            for key in changed:
                value = seen[key] if key in seen else get(key)
                if value is None:
                    deleted.append(key)
                else:
                    view[key] = value
        pending = self._stale | self._fetching | seen.keys() | self._attempted.keys()
        return MirrorCheckpoint(resource, JsonItems(view, encoded, self._encode), deleted, pending)

    def _take_touched(self) -> set[str]:
        touched = self._touched or set()
        self._touched = set()
        return touched

    def _resumed(self) -> None:
        """The listener resumed: for a mirror loaded from a checkpoint, this is what
        a first bootstrap is to an empty one; the change items replayed now are
        called back even when unchanged (see ``_forced``)."""
        if not self._resynced_once:
            self._resynced_once = True
            self._sync_task = asyncio.create_task(self._mark_synced())
            if self._restored and isinstance(self.listener, Listener):
                self._replay_until = time.monotonic() + self.listener.config.checkpoint_replay

    async def _mark_synced(self) -> None:
        await self.queue.wait_idle()
        self._synced.set()
        log_event(log, "controller.synced", controller=self.name, items=len(self._mirror))

    async def _resync_every(self, period: float) -> None:
        await self._synced.wait()
        while True:
            await asyncio.sleep(period)
            self._resync_pass()

    def _resync_pass(self) -> None:
        """Queue every mirrored id for a callback with ``old == new`` (coalescing with
        real changes already queued)."""
        ids = list(self._mirror)
        self._resyncing.update(ids)
        self.queue.add_many(ids)
        self.periodic_resyncs += 1
        log_event(
            log,
            "controller.periodic_resync",
            logging.DEBUG,
            controller=self.name,
            ids=len(ids),
            pending=self.queue.pending,
        )

    # -- workers ----------------------------------------------------------------

    async def _work(self) -> None:
        queue = self.queue
        while True:
            share = math.ceil(len(queue) / self.concurrency)
            ids = await queue.get(max(1, min(self.fetch_batch, share)))
            if not ids:
                return
            if queue.pending < self.max_pending:
                self._room.set()
            try:
                await self._process(ids)
            except Exception as exc:  # a bug in this module: keep the ids, keep going
                log_event(log, "controller.crashed", logging.ERROR, exc=exc, controller=self.name)
                for key in ids:
                    self._stale.add(key)
                    queue.add_rate_limited(key, self._retry.failure(key))
            finally:
                queue.done_many(ids)
                if queue.pending < self.max_pending:
                    self._room.set()

    async def _process(self, ids: list[str]) -> None:
        stale = self._stale
        failed = await self._refresh([key for key in ids if key in stale])
        seen, resyncing = self._seen, self._resyncing
        retrying = len(self._retry) > 0  # any id with failures on record
        for key in ids:
            if key in failed:
                continue
            if key not in seen and key not in resyncing and key not in self._forced:
                # nothing for the application
                if retrying:
                    self._retry.forget(key)
                continue
            await self._notify(key)

    async def _refresh(self, stale: list[str]) -> set[str]:
        """Fetch ``stale`` ids into the mirror; return the ids whose fetch failed."""
        if not stale:
            return set()
        # Unmark first: an item arriving during the fetch marks the id again. Until
        # the result is in the mirror the ids are "fetching": a checkpoint counts
        # them as pending, and a fetch cut short (cancelled) marks them again.
        self._stale.difference_update(stale)
        self._fetching.update(stale)
        started = time.monotonic()
        try:
            found = await self._fetch(stale)
        except BaseException as exc:
            self._fetching.difference_update(stale)
            self._stale.update(stale)
            if not isinstance(exc, Exception):
                raise
            self.fetch_errors += 1
            for key in stale:
                self.queue.add_rate_limited(key, self._retry.failure(key))
            log_event(
                log,
                "controller.fetch_failed",
                logging.WARNING,
                controller=self.name,
                ids=len(stale),
                error=f"{type(exc).__name__}: {exc}",
            )
            return set(stale)
        self.fetch_requests += 1
        self.fetches += len(stale)
        log_event(
            log,
            "controller.fetched",
            logging.DEBUG,
            controller=self.name,
            ids=len(stale),
            found=len(found),
            elapsed=round(time.monotonic() - started, 4),
        )
        self._fetching.difference_update(stale)
        failed: set[str] = set()
        current = self._mirror.view().get
        decode = self._decode
        touched = self._touched
        for key in stale:
            raw = found.get(key)
            new: T | _Undecodable | None = raw
            if raw is not None and decode is not None:
                new = self._decoded(key, raw)
            if isinstance(new, _Undecodable):
                failed.add(key)
                self._stale.add(key)
                self.queue.add_rate_limited(key, self._retry.failure(key))
                continue
            old = current(key)
            if new == old:
                continue
            self._seen.setdefault(key, old)
            if new is None:
                self._mirror.delete(key)
            else:
                self._mirror.put(key, new)
            if touched is not None:
                touched.add(key)
        return failed

    def _done_with(self, key: str) -> None:
        self._resyncing.discard(key)
        self._forced.discard(key)
        self._retry.forget(key)

    async def _notify(self, key: str) -> None:
        new = self._mirror.get(key)
        forced = key in self._forced
        resync = forced or key in self._resyncing
        # A forced id absent before and after may have existed in between (created
        # and deleted after the checkpoint): reconcile(id, None, None) says it is gone.
        absent_too = forced and self._reconcile is not None
        if key in self._seen:
            seen = old = self._seen[key]
            if old == new:
                attempted = self._attempted.get(key, _NOTHING)
                if attempted is _NOTHING or attempted == new:
                    del self._seen[key]
                    self._attempted.pop(key, None)
                    if not resync or (new is None and not absent_too):
                        self._done_with(key)
                        return
                else:
                    # A failed callback for this id may have applied part of its
                    # change, and the mirror is back where it was: undo from there.
                    old = attempted
        elif new is None:  # a resync of an id deleted meanwhile: its delete went out
            if not absent_too:
                self._done_with(key)
                return
            seen = old = None
        else:
            seen = old = new  # a periodic resync (or a forced id): old == new
        try:
            await self._dispatch(key, old, new)
        except Exception as exc:
            if old == seen and key in self._seen:
                self._attempted[key] = new
            self.reconcile_errors += 1
            delay = self._retry.failure(key)
            self.queue.add_rate_limited(key, delay)
            log_event(
                log,
                "controller.reconcile_failed",
                logging.WARNING,
                exc=exc,
                controller=self.name,
                id=key,
                failures=self._retry.failures(key),
                retry_in=round(delay, 4),
            )
            return
        self.reconciles += 1
        self._resyncing.discard(key)
        self._forced.discard(key)
        self._attempted.pop(key, None)
        self._retry.forget(key)
        # The mirror may have moved on during the callback (a resync): the
        # application now holds ``new``; the id is already queued again.
        if self._mirror.get(key) == new:
            self._seen.pop(key, None)
        else:
            self._seen[key] = new
        if self._touched is not None and seen != new:
            self._touched.add(key)  # what the application saw changed

    async def _dispatch(self, key: str, old: T | None, new: T | None) -> None:
        if self._reconcile is not None:
            await _call(self._reconcile, key, old, new)
        elif old is None:
            if self._on_add is not None:
                await _call(self._on_add, key, new)
        elif new is None:
            if self._on_delete is not None:
                await _call(self._on_delete, key, old)
        elif self._on_update is not None:
            await _call(self._on_update, key, old, new)

    async def _default_fetch(self, ids: Sequence[str]) -> Mapping[str, Any]:
        listener = self.listener
        assert isinstance(listener, Listener) and self.resource is not None
        route = self._route or listener.routes.get(self.resource)
        if route is None:
            # Ids loaded from a checkpoint as pending are fetched from the route
            # the first ack names.
            await listener._registered.wait()
            route = listener.routes.get(self.resource)
        if route is None:
            raise ListenerError("no resource route yet: the listener has not registered")
        if len(ids) == 1:
            one = await fetch_one(
                listener.http, route, ids[0], max_attempts=self.fetch_attempts, max_wait=30.0
            )
            return {} if one is None else {ids[0]: one}
        return await fetch_many(
            listener.http,
            route,
            ids,
            chunk=self.fetch_batch,
            id_field=self._id_field,
            max_attempts=self.fetch_attempts,
            max_wait=30.0,
        )


class _Sink:
    """The controller's side of ``_sink.Sink``: what the listener's dispatch task
    hands it. A separate object, so that these calls are not part of the
    controller's public face."""

    __slots__ = ("_controller", "_stopped")

    def __init__(self, controller: Controller[Any]) -> None:
        self._controller = controller
        self._stopped: asyncio.Future[None] | None = None

    def running(self) -> asyncio.Future[None]:
        """A future that ends the way the listener stops (``Controller.run`` awaits it)."""
        self._stopped = asyncio.get_running_loop().create_future()
        return self._stopped

    def _gone(self) -> bool:
        return self._stopped is None or self._stopped.done() or self._controller._ended.is_set()

    def room(self) -> int:
        if self._gone():
            return 1 << 30  # a stopped controller never holds the others up
        return self._controller._room_left()

    async def wait_room(self) -> None:
        await self._controller._wait_room(self._gone)

    def resynced(self, event: Resynced) -> None:
        if not self._gone():
            self._controller._apply_resync(event)

    def changed(self, items: Sequence[ChangeItem]) -> None:
        if not self._gone():
            self._controller._take_items(items)

    @property
    def name(self) -> str:
        return self._controller.name

    @property
    def resource(self) -> str:
        return self._controller.resource or ""

    def checkpoint_problem(self) -> str | None:
        controller = self._controller
        if controller._decode is not None and controller._encode is None:
            return f"controller {controller.name} has decode but no encode: give encode"
        return None

    def resumed(self) -> None:
        if not self._gone():
            self._controller._resumed()

    def restore(self, part: MirrorCheckpoint) -> None:
        self._controller._restore(part)

    def track_changes(self) -> None:
        self._controller._track_changes()

    def take_changed(self) -> set[str]:
        return self._controller._take_touched()

    def has_changed(self) -> bool:
        return bool(self._controller._touched)

    def checkpoint_part(self, changed: set[str] | None) -> MirrorCheckpoint:
        return self._controller._checkpoint_part(changed)

    def size(self) -> int:
        return len(self._controller._mirror)

    def stopped(self, error: BaseException | None) -> None:
        stopped = self._stopped
        if stopped is None or stopped.done():
            return
        if error is None:
            stopped.set_result(None)
        else:
            stopped.set_exception(error)
        self._controller._room.set()
