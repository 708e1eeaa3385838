"""The controller: a mirror of one resource kept current from a listener.

client-go's informer + controller in one object, for RFD 5 feeds that say
*that* a resource changed, never *what*: a bootstrap (``Resynced``) fills the
mirror, change items queue their ids, and workers fetch each id's current
state into the mirror and call the application back with the state it last
saw and the new one. ``decode`` turns each resource's JSON into the
application's own type ``T``; the mirror and the callbacks hold ``T``.

Several controllers may share one Listener, one per resource it registers
(``resource=``): each has its own mirror, work queue and callbacks, and sees
only its resource's bootstrap and items. With a checkpoint store on its
listener, the mirror is saved with the listener's cursor and loaded at start:
the controller then starts from the mirror as its callbacks last saw it,
fetches again the ids that were pending, and is called back only for what
changed since.

This module is the controller's face: its settings, ``run``, the waits and
the stats. The work is done by its core, a ``_reconcile.Reconciler`` (the
mirror, the work queue, where each id stands, the workers). Events reach the
core one of two ways: from a shared Listener, whose dispatch task hands them
to the controller's ``ListenerSink`` as far as the work queue has room
(``max_pending``); or read one at a time from any other event source.

What it must never do: call back for an id concurrently, lose a change that
arrived while its id was being fetched, or let a stale fetch be the last word.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Awaitable, Callable, Mapping, Sequence
from types import TracebackType
from typing import TYPE_CHECKING, Any, Generic, Self

from changefeed.bootstrap import fetch_many, fetch_one, fetchable_by_path
from changefeed.schemas import ChangeItem

from ._attachments import ControllerLink
from ._backoff import DEFAULT_ITEM_BACKOFF, BackoffPolicy
from ._checkpoint import CheckpointStore, MirrorCheckpoint
from ._checks import check_count, check_seconds
from ._errors import ListenerConfigError, ListenerError
from ._events import ControllerStats, Resynced
from ._handlers import (
    AddHandler,
    DeleteHandler,
    EventSource,
    Fetcher,
    ReconcileHandler,
    UpdateHandler,
)
from ._lifecycle import ConnectionState
from ._listener import Listener
from ._metrics import Sample, register_controller, samples_of
from ._reconcile import Intake, Reconciler, T
from ._workqueue import WorkQueue

if TYPE_CHECKING:  # prometheus-client: needed only by whoever passes a registry
    from prometheus_client import CollectorRegistry

__all__ = ["Controller", "ControllerStats"]


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
            listener's HTTP client). A failure is retried per id with back-off,
            except a ``changefeed.bootstrap.BootstrapError`` whose ``status`` is
            401 or 403, which stops the controller (``RegistrationRefused``).
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
        rng: random source of the jitter of its retries: per id, and the
            default fetch's requests.

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
            check_count(setting, value)
        check_seconds("resync_period", resync_period, optional=True)
        if retry is not None and not isinstance(retry, BackoffPolicy):
            raise ListenerConfigError("retry", f"must be a BackoffPolicy, got {retry!r}")
        shared = listener if isinstance(listener, Listener) else None
        if fetch is None and shared is None:
            raise ListenerConfigError("fetch", "is required when the source is not a Listener")
        if checkpoint is not None and shared is None:
            raise ListenerConfigError("checkpoint", "is kept by a Listener: give it one")
        if shared is not None:
            if shared.cursor is not None and shared.state is ConnectionState.IDLE:
                # The mirror starts empty: resuming would skip the bootstrap that fills it.
                # (A listener past IDLE has a cursor of its own: _attach refuses it as
                # started.)
                raise ListenerConfigError(
                    "listener.cursor",
                    "a controller's listener must bootstrap: pass no saved cursor",
                )
            resource = _listener_resource(shared, resource)
            default_name = shared.name
            if len(shared.resources) > 1:
                default_name += f"/{resource}"
        else:
            default_name = "controller"
        self.listener = listener
        self.resource = resource
        self.name = name or default_name
        self.concurrency = concurrency
        self.fetch_batch = fetch_batch
        self.fetch_attempts = fetch_attempts
        self.max_pending = max_pending
        self.resync_period = resync_period
        self._id_field = id_field
        self._rng = rng or random.Random()
        self._core: Reconciler[T] = Reconciler(
            name=self.name,
            resource=resource or "",
            fetch=fetch or self._fetch_from_listener,
            key=key or (lambda obj: str(obj[id_field])),
            decode=decode,
            encode=encode,
            reconcile=reconcile,
            on_add=on_add,
            on_update=on_update,
            on_delete=on_delete,
            concurrency=concurrency,
            fetch_batch=fetch_batch,
            max_pending=max_pending,
            retry=retry or DEFAULT_ITEM_BACKOFF,
            rng=self._rng,
        )
        self._failure: BaseException | None = None
        self._task: asyncio.Task[None] | None = None
        self._host: asyncio.Task[Any] | None = None  # the task inside ``async with``
        self._host_cancelled = False  # ... which this controller's failure cancelled
        self._closing = False
        self._close_asked = asyncio.Event()  # close(): run() returns, wherever it runs
        self._ran = False  # run() has begun
        self._ended = asyncio.Event()
        self._source: EventSource | None = None
        self._sink: ListenerSink[T] | None = None
        self._link: ControllerLink | None = None
        if shared is not None:
            assert resource is not None
            sink = ListenerSink(self._core, can_checkpoint=decode is None or encode is not None)
            link = shared._attach(resource, sink)  # the controller's one way in
            try:
                if checkpoint is not None:
                    link.use_checkpoint(checkpoint)
                if registry is not None:
                    register_controller(registry, self)
            except BaseException:
                # A controller that does not exist must not keep the listener
                # waiting for it to run.
                link.detach()
                raise
            self._sink, self._link = sink, link
        else:
            self._source = listener
            if registry is not None:
                register_controller(registry, self)

    # -- public face -----------------------------------------------------------

    @property
    def mirror(self) -> Mapping[str, T]:
        """A read-only live view of the mirror: id -> resource."""
        return self._core.mirror.view()

    @property
    def synced(self) -> bool:
        """The first bootstrap has been applied and each id it queued processed once
        (see ``wait_synced``)."""
        return self._core.synced.is_set()

    @property
    def queue(self) -> WorkQueue[str]:
        """The work queue (read-only use: its depth, what it holds)."""
        return self._core.queue

    @property
    def items(self) -> int:
        """Change items taken from the listener."""
        return self._core.counts.items

    def stats(self) -> ControllerStats:
        """A snapshot of the work queue and the controller's counters."""
        core = self._core
        queue = core.queue
        return ControllerStats.of(
            core.counts,
            depth=len(queue),
            pending=queue.pending,
            processing=len(queue.processing),
            adds=queue.adds,
            coalesced=queue.coalesced,
            retries=queue.retries,
            mirror_items=len(core.mirror),
            synced=self.synced,
        )

    def metric_samples(self) -> list[Sample]:
        """This controller's values for the work-queue and controller metrics."""
        return samples_of("changefeed_", self.stats())

    async def wait_synced(self, timeout: float | None = None) -> None:  # noqa: ASYNC109
        """Wait until the first bootstrap is in the mirror and the callbacks it called
        for have run, or, for a mirror loaded from a checkpoint, until the listener
        resumed its cursor and the ids loaded as pending have been fetched and
        called back. Changes that arrive meanwhile do not hold it back: each id
        queued at that moment need only be processed once (a callback that keeps
        failing does, until it succeeds).

        Raises:
            TimeoutError: not synced within ``timeout`` seconds.
            ListenerError: the controller stopped (e.g. the registration was refused).
        """
        async with asyncio.timeout(timeout):
            synced = asyncio.ensure_future(self._core.synced.wait())
            ended = asyncio.ensure_future(self._ended.wait())
            try:
                await asyncio.wait({synced, ended}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                synced.cancel()
                ended.cancel()
        if not self._core.synced.is_set():
            raise self._failure or ListenerError("the controller stopped before it synced")

    async def wait_idle(self, timeout: float | None = None) -> None:  # noqa: ASYNC109
        """Wait until nothing is queued, being processed or waiting out a retry.

        Raises:
            TimeoutError: not idle within ``timeout`` seconds.
        """
        async with asyncio.timeout(timeout):
            await self.queue.wait_idle()

    async def run(self) -> None:
        """Follow the listener and keep the mirror current until ``close()`` (then it
        returns), cancelled, or the listener stops.

        Raises:
            RegistrationRefused, RetriesExhausted: the listener stopped for good;
                or ``RegistrationRefused`` (``http_401``, ``http_403``): a fetch of
                this controller was refused for good (a token revoked meanwhile).
            ListenerConfigError: another controller attached to the listener did
                not run (``ListenerConfig.controller_start_timeout``).
            CheckpointRefused: the listener's checkpoint store is another listener's.
        """
        self._ran = True
        core = self._core
        helpers = [
            asyncio.create_task(core.work(), name=f"changefeed-worker-{self.name}-{n}")
            for n in range(self.concurrency)
        ]
        if self.resync_period is not None:
            helpers.append(
                asyncio.create_task(
                    self._resync_every(self.resync_period), name=f"changefeed-resync-{self.name}"
                )
            )
        try:
            if self._sink is not None and self._link is not None:
                stopped = self._sink.running()
                self._link.running()
                await self._until_closed(stopped)
            elif self._source is not None:
                await self._until_closed(self._consume(self._source))
        except BaseException as exc:
            if not isinstance(exc, asyncio.CancelledError):
                self._failure = exc
            raise
        finally:
            if self._link is not None:
                # Before this controller takes nothing more: the listener's last
                # checkpoint must see its mirror with the cursor it has reached.
                self._link.stopping()
            self._ended.set()
            core.stop()  # a dispatch task waiting for this controller's room goes on
            for helper in helpers:
                helper.cancel()
            await asyncio.gather(*helpers, return_exceptions=True)
            if self._link is not None:
                await self._link.done()

    async def _until_closed(self, following: Awaitable[None]) -> None:
        """Await ``following``; should ``close()`` come first, stop it and return. A
        fetch refused for good (401, 403) ends it too, with that refusal."""
        follow = asyncio.ensure_future(following)
        refused = asyncio.ensure_future(self._core.until_refused())
        closed = asyncio.ensure_future(self._close_asked.wait())
        try:
            await asyncio.wait((follow, refused, closed), return_when=asyncio.FIRST_COMPLETED)
        finally:
            closed.cancel()
            if not refused.done():
                refused.cancel()
            if not follow.done():
                follow.cancel()
                await asyncio.gather(follow, return_exceptions=True)
        if refused.done() and not refused.cancelled():
            if follow.done() and not follow.cancelled():
                follow.exception()  # retrieved: the refusal is what ends it
            refused.result()  # raises the refusal
        if not follow.cancelled():
            follow.result()  # its error, if it stopped with one

    async def _consume(self, source: EventSource) -> None:
        """Read an event source other than a Listener one event at a time."""
        core, resource = self._core, self.resource
        async for event in source:
            if isinstance(event, Resynced):
                if resource is None or event.resource in ("", resource):
                    core.resync(event)
            elif isinstance(event, ChangeItem):
                if resource is not None and event.change_kind.resource != resource:
                    continue
                while core.queue_room() <= 0:
                    await core.wait_queue_room()
                core.take((event,))

    async def _resync_every(self, period: float) -> None:
        await self._core.synced.wait()
        while True:
            await asyncio.sleep(period)
            self._core.resync_pass()

    async def _fetch_from_listener(self, ids: Sequence[str]) -> Mapping[str, Any]:
        """The default fetch: the listener's bootstrap client on the resource's route."""
        link = self._link
        assert link is not None and self.resource is not None
        # The latest ack's route: a resumed reconnect may name another than the
        # last bootstrap's, and the old one may answer 404, which reads as a delete.
        route = link.routes().get(self.resource) or self._core.route
        if route is None:
            # Ids loaded from a checkpoint as pending are fetched from the route
            # the first ack names.
            await link.registered()
            route = link.routes().get(self.resource)
        if route is None:
            raise ListenerError("no resource route yet: the listener has not registered")
        if len(ids) == 1 and fetchable_by_path(ids[0]):
            one = await fetch_one(
                link.http(),
                route,
                ids[0],
                max_attempts=self.fetch_attempts,
                max_wait=30.0,
                rng=self._rng,
            )
            return {} if one is None else {ids[0]: one}
        return await fetch_many(
            link.http(),
            route,
            ids,
            chunk=self.fetch_batch,
            id_field=self._id_field,
            max_attempts=self.fetch_attempts,
            max_wait=30.0,
            rng=self._rng,
        )

    def done(self) -> bool:
        """Whether the controller has stopped: ``run`` returned or raised."""
        return self._ended.is_set()

    def exception(self) -> BaseException | None:
        """The error that stopped the controller for good (``RegistrationRefused``,
        ``RetriesExhausted``, ...); None while it runs, or when it stopped because it
        was closed or cancelled, or its listener was."""
        return self._failure

    async def __aenter__(self) -> Self:
        """Run in a background task until the block exits. Should the controller stop
        for good meanwhile (the registration refused, retries exhausted), the block is
        cancelled, as a ``TaskGroup`` cancels it for a failed task, and its exit raises
        that error."""
        self._closing = False
        self._close_asked.clear()
        self._host = asyncio.current_task()
        self._task = asyncio.create_task(self.run(), name=f"changefeed-controller-{self.name}")
        self._task.add_done_callback(self._stopped)
        return self

    def _stopped(self, task: asyncio.Task[None]) -> None:
        """The background task ended: a failure cancels the block it runs beside."""
        if task.cancelled() or task.exception() is None or self._closing:
            return
        host = self._host
        if host is not None and not host.done():
            self._host_cancelled = True
            host.cancel()

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        """Stop the background task. Raises the error that stopped the controller, unless
        the block raised one of its own (then that one goes on; ``exception()`` still
        tells)."""
        self._closing = True
        host, self._host = self._host, None
        ours = self._host_cancelled and host is not None and host.uncancel() == 0
        self._host_cancelled = False
        try:
            await self.close()
        except Exception:
            if exc is None or (ours and isinstance(exc, asyncio.CancelledError)):
                raise
            # The block's own exception wins; the controller's is in exception().

    async def close(self) -> None:
        """Stop the controller (idempotent): the background task of ``async with``, or
        ``run()`` awaited elsewhere, which then returns. A controller that has not
        run is detached from its listener, which then no longer waits for it to run.

        Raises:
            RegistrationRefused, RetriesExhausted, ...: the error that stopped the
                controller (``exception()``), each time it is called: a controller
                that stopped for good cannot be closed as if it had not.
        """
        self._closing = True
        self._close_asked.set()
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        elif self._ran:
            await self._ended.wait()  # run() in a task of the caller's: it returns
        if (task is not None or not self._ran) and self._link is not None:
            # Also when it never ran (or its task was cancelled before ``run`` began):
            # the listener must not wait for this controller to start.
            await self._link.done()
        if self._failure is not None:
            raise self._failure


class ListenerSink(Generic[T]):
    """The controller's side of a shared listener (``_attachments.Attached``): how the
    listener stops it, tells it of a resume, and reads and loads its mirror in
    checkpoints. A separate object, so that these calls are not part of the
    controller's public face. The dispatch hands events to the controller's core
    itself (``sink``), as far as its work queue has room; a controller that
    stopped while the listener goes on is parked there (``_reconcile.Intake``).
    """

    def __init__(self, core: Reconciler[T], *, can_checkpoint: bool) -> None:
        self._core = core
        self._can_checkpoint = can_checkpoint
        self._stopped: asyncio.Future[None] | None = None

    @property
    def name(self) -> str:
        return self._core.name

    @property
    def resource(self) -> str:
        return self._core.resource

    @property
    def sink(self) -> Reconciler[T]:
        return self._core

    def running(self) -> asyncio.Future[None]:
        """The controller runs: a future that ends the way the listener stops
        (``Controller.run`` awaits it)."""
        self._stopped = asyncio.get_running_loop().create_future()
        self._core.intake = Intake.OPEN
        return self._stopped

    def stopped(self, error: BaseException | None) -> None:
        stopped = self._stopped
        if stopped is None or stopped.done():
            return
        if error is None:
            stopped.set_result(None)
        else:
            stopped.set_exception(error)
        self._core.close_intake()

    def resumed(self, replay: float) -> None:
        if self._core.intake is Intake.OPEN:
            self._core.resumed(replay)

    def checkpoint_problem(self) -> str | None:
        if not self._can_checkpoint:
            return f"controller {self.name} has decode but no encode: give encode"
        return None

    def restore(self, part: MirrorCheckpoint) -> None:
        self._core.restore(part)

    def track_changes(self) -> None:
        self._core.track_changes()

    def take_changed(self) -> set[str]:
        return self._core.take_touched()

    def has_changed(self) -> bool:
        return self._core.has_touched()

    def checkpoint_part(self, changed: set[str] | None) -> MirrorCheckpoint:
        return self._core.checkpoint_part(changed)

    def size(self) -> int:
        return len(self._core.mirror)
