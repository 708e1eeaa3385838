"""The controller: a mirror of the publisher's resources kept current from a listener.

client-go's informer + controller in one object, for RFD 5 feeds that say
*that* a resource changed, never *what*:

* A ``Resynced`` (bootstrap) replaces the mirror in one step. Ids whose state
  changed are queued for the application's callbacks; ids missing from the
  fresh list are deletes. Ids being fetched right then are queued again with a
  fresh fetch, because a fetch that started before the list may finish after
  it with older state.
* A change item marks its id stale and queues it. A worker fetches the
  current state (``GET route/id``, or ``GET route?ids=a,b,c`` for several at
  once; absent means deleted), writes it to the mirror and calls
  ``on_add`` / ``on_update`` / ``on_delete`` (or one ``reconcile``) with the
  state the application last saw and the new one.
* The work queue coalesces repeated changes to one id into one fetch and
  never processes one id concurrently; fetch concurrency is bounded by the
  number of workers. A failed fetch or callback is retried per id with
  exponential back-off; the application's view advances only when its
  callback returns, so a failed callback is called again with the same ``old``.
* Duplicate and out-of-order items are harmless: every fetch reads current state.
* When the application falls ``max_pending`` ids behind, the controller
  stops taking events from the listener, whose buffer then fills and, if it
  must, overflows (abort, back off, re-bootstrap).

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
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, fields
from types import TracebackType
from typing import Any, Protocol, Self

from prometheus_client import CollectorRegistry

from changefeed.bootstrap import fetch_many, fetch_one
from changefeed.logs import log_event
from changefeed.schemas import ChangeItem

from ._backoff import DEFAULT_ITEM_BACKOFF, BackoffPolicy, ItemBackoff
from ._errors import ListenerConfigError, ListenerError
from ._events import Event, Resynced
from ._listener import Listener
from ._metrics import Sample, register_controller
from ._mirror import Mirror
from ._workqueue import WorkQueue

__all__ = [
    "Callback",
    "Controller",
    "ControllerStats",
    "EventSource",
    "Fetcher",
]

log = logging.getLogger(__name__)

_NOTHING = object()
"""No failed callback is on record for an id."""

Fetcher = Callable[[Sequence[str]], Awaitable[Mapping[str, Any]]]
"""Fetches resources by id: returns the ones that exist (absent ids are deleted)."""

Callback = Callable[..., Awaitable[None] | None]
"""A user callback; it may be a coroutine function or a plain function."""


class EventSource(Protocol):
    """What the controller reads events from: a Listener, or anything iterable like one."""

    def __aiter__(self) -> AsyncIterator[Event]: ...


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
        reconciles: callbacks completed.
        reconcile_errors: callbacks that raised.
        resyncs: bootstraps applied to the mirror.
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
    reconciles: int
    reconcile_errors: int
    resyncs: int
    mirror_items: int
    synced: bool

    def to_json(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


async def _call(callback: Callback, *args: Any) -> None:
    result = callback(*args)
    if inspect.isawaitable(result):
        await result


class Controller:
    """Keeps a mirror of one resource current and calls the application back on changes.

    Either ``reconcile(id, old, new)`` or any of ``on_add(id, new)``,
    ``on_update(id, old, new)``, ``on_delete(id, old)``; ``old``/``new`` are
    None for a resource that did not / does not exist. Callbacks may be
    coroutine functions or plain functions; one that raises is retried with
    back-off (with the same ``old``).

    Args:
        listener: where events come from; a Listener is started and closed by ``run``.
        reconcile: the one callback for every change.
        on_add: a resource appeared.
        on_update: a resource changed.
        on_delete: a resource disappeared.
        fetch: how to fetch resources by id (default: the bootstrap client's
            ``fetch_one`` / ``fetch_many`` on the listener's route and HTTP client).
        key: the id of a listed resource (default: its ``id_field``).
        id_field: the field holding a resource's id.
        concurrency: workers, hence concurrent fetches.
        fetch_batch: ids per fetch request (1: one ``GET route/id`` each).
        fetch_attempts: attempts per fetch request before the ids are retried later.
        retry: the per-id retry schedule of failed fetches and callbacks.
        max_pending: stop taking events from the listener while this many ids wait.
        name: the controller's name in logs and metrics.
        registry: a Prometheus registry to expose the work-queue metrics on.
        rng: random source of the retry jitter.

    Raises:
        ListenerConfigError: both ``reconcile`` and an ``on_*`` callback, a bad number,
            or a listener holding a saved cursor (the mirror starts empty, so the
            listener must bootstrap).
    """

    def __init__(
        self,
        listener: Listener | EventSource,
        *,
        reconcile: Callback | None = None,
        on_add: Callback | None = None,
        on_update: Callback | None = None,
        on_delete: Callback | None = None,
        fetch: Fetcher | None = None,
        key: Callable[[Any], str] | None = None,
        id_field: str = "uuid",
        concurrency: int = 4,
        fetch_batch: int = 50,
        fetch_attempts: int = 3,
        retry: BackoffPolicy = DEFAULT_ITEM_BACKOFF,
        max_pending: int = 10_000,
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
        if fetch is None and not isinstance(listener, Listener):
            raise ListenerConfigError("fetch", "is required when the source is not a Listener")
        if isinstance(listener, Listener) and listener.cursor is not None:
            # The mirror starts empty: resuming would skip the bootstrap that fills it.
            raise ListenerConfigError(
                "listener.cursor", "a controller's listener must bootstrap: pass no saved cursor"
            )
        self.listener = listener
        self.name = name or (listener.name if isinstance(listener, Listener) else "controller")
        self._reconcile = reconcile
        self._on_add = on_add
        self._on_update = on_update
        self._on_delete = on_delete
        self._fetch = fetch or self._default_fetch
        self._key = key or (lambda obj: str(obj[id_field]))
        self._id_field = id_field
        self.concurrency = concurrency
        self.fetch_batch = fetch_batch
        self.fetch_attempts = fetch_attempts
        self.max_pending = max_pending
        self._mirror: Mirror[Any] = Mirror()
        self.queue: WorkQueue[str] = WorkQueue()
        self._retry = ItemBackoff(retry, rng)
        self._stale: set[str] = set()
        self._seen: dict[str, Any] = {}  # id -> state the application last saw, while pending
        # id -> the new state of a callback that raised: the application may hold
        # part of it, even if the mirror goes back to what it last saw.
        self._attempted: dict[str, Any] = {}
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
        self.reconciles = 0
        self.reconcile_errors = 0
        self.resyncs = 0
        if registry is not None:
            register_controller(registry, self)

    # -- public face -----------------------------------------------------------

    @property
    def mirror(self) -> Mapping[str, Any]:
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
            reconciles=self.reconciles,
            reconcile_errors=self.reconcile_errors,
            resyncs=self.resyncs,
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
            Sample(c + "reconciles", st.reconciles),
            Sample(c + "reconcile_errors", st.reconcile_errors),
            Sample(c + "resyncs", st.resyncs),
            Sample(c + "mirror_items", st.mirror_items),
        ]

    async def wait_synced(self, timeout: float | None = None) -> None:  # noqa: ASYNC109
        """Wait until the first bootstrap is in the mirror and its callbacks have run.

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
        listener = self.listener
        owns = isinstance(listener, Listener)
        if isinstance(listener, Listener):
            listener.start()
        workers = [
            asyncio.create_task(self._work(), name=f"changefeed-worker-{self.name}-{n}")
            for n in range(self.concurrency)
        ]
        try:
            await self._consume()
        except BaseException as exc:
            if not isinstance(exc, asyncio.CancelledError):
                self._failure = exc
            raise
        finally:
            self._ended.set()
            self.queue.shut_down()
            helpers = [*workers, *([self._sync_task] if self._sync_task else [])]
            for helper in helpers:
                helper.cancel()
            await asyncio.gather(*helpers, return_exceptions=True)
            if owns and isinstance(listener, Listener):
                await listener.close()

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

    async def _consume(self) -> None:
        async for event in self.listener:
            while self.queue.pending >= self.max_pending:
                self._room.clear()
                await self._room.wait()
            if isinstance(event, Resynced):
                self._apply_resync(event)
            elif isinstance(event, ChangeItem):
                self.items += 1
                self._stale.add(event.changed_resource_id)
                self.queue.add(event.changed_resource_id)

    def _apply_resync(self, event: Resynced) -> None:
        self._route = event.route
        fresh: dict[str, Any] = {}
        for obj in event.items:
            try:
                fresh[self._key(obj)] = obj
            except (KeyError, TypeError, IndexError):
                log_event(
                    log, "controller.unkeyed", logging.WARNING, controller=self.name, item=obj
                )
        changes = self._mirror.replace(fresh)
        for change in changes:
            self._seen.setdefault(change.id, change.old)
            self.queue.add(change.id)
        for busy in self.queue.processing:
            self._stale.add(busy)
            self.queue.add(busy)
        self.resyncs += 1
        log_event(
            log,
            "controller.resynced",
            controller=self.name,
            items=len(fresh),
            changed=len(changes),
            initial=event.initial,
            pending=self.queue.pending,
        )
        if not self._resynced_once:
            self._resynced_once = True
            self._sync_task = asyncio.create_task(self._mark_synced())

    async def _mark_synced(self) -> None:
        await self.queue.wait_idle()
        self._synced.set()
        log_event(log, "controller.synced", controller=self.name, items=len(self._mirror))

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
                log_event(
                    log, "controller.crashed", logging.ERROR, controller=self.name, error=repr(exc)
                )
                for key in ids:
                    self._stale.add(key)
                    queue.add_rate_limited(key, self._retry.failure(key))
            finally:
                for key in ids:
                    queue.done(key)
                if queue.pending < self.max_pending:
                    self._room.set()

    async def _process(self, ids: list[str]) -> None:
        failed = await self._refresh([key for key in ids if key in self._stale])
        for key in ids:
            if key not in failed:
                await self._notify(key)

    async def _refresh(self, stale: list[str]) -> set[str]:
        """Fetch ``stale`` ids into the mirror; return the ids whose fetch failed."""
        if not stale:
            return set()
        # Unmark first: an item arriving during the fetch marks the id again.
        self._stale.difference_update(stale)
        started = time.monotonic()
        try:
            found = await self._fetch(stale)
        except Exception as exc:
            self.fetch_errors += 1
            self._stale.update(stale)
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
        for key in stale:
            new = found.get(key)
            old = self._mirror.get(key)
            if new == old:
                continue
            self._seen.setdefault(key, old)
            if new is None:
                self._mirror.delete(key)
            else:
                self._mirror.put(key, new)
        return set()

    async def _notify(self, key: str) -> None:
        if key not in self._seen:
            self._retry.forget(key)
            return
        seen = old = self._seen[key]
        new = self._mirror.get(key)
        if old == new:
            attempted = self._attempted.get(key, _NOTHING)
            if attempted is _NOTHING or attempted == new:
                del self._seen[key]
                self._attempted.pop(key, None)
                self._retry.forget(key)
                return
            # A failed callback for this id may have applied part of its change,
            # and the mirror is back where it was: undo from there.
            old = attempted
        try:
            await self._dispatch(key, old, new)
        except Exception as exc:
            if old == seen:
                self._attempted[key] = new
            self.reconcile_errors += 1
            delay = self._retry.failure(key)
            self.queue.add_rate_limited(key, delay)
            log_event(
                log,
                "controller.reconcile_failed",
                logging.WARNING,
                controller=self.name,
                id=key,
                failures=self._retry.failures(key),
                retry_in=round(delay, 4),
                error=f"{type(exc).__name__}: {exc}",
            )
            return
        self.reconciles += 1
        self._attempted.pop(key, None)
        self._retry.forget(key)
        # The mirror may have moved on during the callback (a resync): the
        # application now holds ``new``; the id is already queued again.
        if self._mirror.get(key) == new:
            del self._seen[key]
        else:
            self._seen[key] = new

    async def _dispatch(self, key: str, old: Any, new: Any) -> None:
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
        assert isinstance(listener, Listener)
        route = self._route or listener.route
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
