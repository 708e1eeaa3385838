"""The listener: registers on a publisher's /changefeeds websocket and yields its changes.

The websockets / httpx adapter around the pure core (``_lifecycle``,
``_backoff``, ``_buffer``). This module is the listener's face: its
settings, ``start`` and ``close``, ``async for``, the status and metrics, how
controllers attach to it, and where checkpoints come in. The work is done by
its parts, each in its own module, on the state they share
(``_listener_state``):

* ``_connection``: one background task runs the connection lifecycle
  (connect, register, bootstrap, live; after a failure, clear and back off);
  one connection is a ``_session.Session``, which reports back through
  ``_reports``;
* ``_handout``: events go to the application in feed order: ``async for``,
  or a dispatch task that hands each attached controller (``_sink.Sink``)
  its resource's events.

The socket is always read as fast as it delivers, whatever the application
does: the buffer absorbs the difference, and when it cannot, the listener
aborts rather than block the publisher or grow without bound (RFD 5 "Back
pressure"). Items taken from the buffer but not handed out yet count against
the same capacity. The cursor it resumes from is that of the last event
handed to the application, and items are handed out in feed order, so
nothing that was buffered and then cleared is lost.

Several controllers share one listener (one connection per publisher per
process, as client-go's shared informers): each attaches to one resource
before the listener starts, the listener starts once every attached
controller runs (or stops with a ``ListenerConfigError`` when one has not run
within ``controller_start_timeout`` of the first), and it closes when the
last one stops.

With a checkpoint store (``_checkpointer``), the listener loads the last
checkpoint before it first registers (its controllers start from their saved
mirrors, and it registers with the saved cursor), and saves one at intervals
and when it or the last controller running stops. A controller that stops
while others run on is parked (``_controller_done``), so checkpoints go on.
The cursor saved is the position the application is done with: for
controllers, that of the last event handed to them (their mirrors and
pending ids are taken in the same step); for ``async for``, that of the
event before the one handed out last.

It must never hand the application an item of a connection before that
connection's ``Resynced`` events, never retry without back-off, and never
swallow a failure without logging and counting it.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Sequence
from types import TracebackType
from typing import TYPE_CHECKING, Self
from urllib.parse import urlsplit, urlunsplit

import httpx

from changefeed.bootstrap import bearer_headers
from changefeed.logs import log_event
from changefeed.schemas import ChangeKind, Registration

from ._backoff import Backoff
from ._buffer import Buffer, make_buffer
from ._checkpoint import CheckpointStore
from ._checkpointer import Checkpointer
from ._checks import check_change_kinds, check_registration
from ._config import ListenerConfig
from ._connection import ConnectionLoop
from ._errors import ListenerConfigError, ListenerError
from ._events import Event, ListenerStatus, Resynced
from ._handout import HandingOut
from ._lifecycle import ConnectionState, Lifecycle
from ._listener_state import S, log
from ._metrics import Sample, register_listener
from ._sink import Sink

if TYPE_CHECKING:  # prometheus-client: needed only by whoever passes a registry
    from prometheus_client import CollectorRegistry

__all__ = ["Listener"]


def _http_origin(ws_url: str) -> str:
    """The http(s) origin of a ws(s) URL.

    Raises:
        ListenerConfigError: ``url`` is not a ws:// or wss:// URL with a host.
    """
    parts = urlsplit(ws_url) if isinstance(ws_url, str) else None
    scheme = None if parts is None else {"ws": "http", "wss": "https"}.get(parts.scheme)
    if parts is None or scheme is None or not parts.hostname:
        raise ListenerConfigError("url", f"expected a ws:// or wss:// URL, got {ws_url!r}")
    return urlunsplit((scheme, parts.netloc, "/", "", ""))


def _check_api_url(api_url: str) -> None:
    """Bootstrap routes are resolved against ``api_url``: it must be an http(s) URL.

    Raises:
        ListenerConfigError: it is not.
    """
    parts = urlsplit(api_url) if isinstance(api_url, str) else None
    if parts is None or parts.scheme not in ("http", "https") or not parts.hostname:
        raise ListenerConfigError(
            "api_url", f"expected an http:// or https:// URL, got {api_url!r}"
        )


def _change_kinds(
    change_kind: ChangeKind | None, change_kinds: Sequence[ChangeKind]
) -> tuple[ChangeKind, ...]:
    if change_kind is not None and change_kinds:
        raise ListenerConfigError("change_kinds", "give change_kind or change_kinds, not both")
    if change_kind is not None:
        kinds = check_change_kinds((change_kind,), "change_kind")
    else:
        kinds = check_change_kinds(tuple(change_kinds), "change_kinds")
    if not kinds:
        raise ListenerConfigError("change_kinds", "name at least one change kind")
    resources = [kind.resource for kind in kinds]
    twice = sorted({r for r in resources if resources.count(r) > 1})
    if twice:
        raise ListenerConfigError(
            "change_kinds",
            f"{', '.join(twice)} named twice: give each resource once, with all its sub-resources",
        )
    return kinds


class Listener(ConnectionLoop, HandingOut):
    """A change-feed listener for one or several change kinds (RFD 5's listener module).

    Use it as an async context manager and iterate it::

        async with Listener("ws://vmapi/changefeeds", instance=uuid, service="tcns",
                            change_kind=ChangeKind("vm", ("nic", "alias"))) as listener:
            async for event in listener:
                ...  # Resynced(items) after each bootstrap, else ChangeItem

    or attach controllers to it, one per resource, and run them (the
    listener starts when every attached controller runs, and closes when
    the last one stops)::

        listener = Listener(url, instance=uuid, service="tcns",
                            change_kinds=[ChangeKind("vm"), ChangeKind("server")])
        vms = Controller(listener, resource="vm", reconcile=on_vm)
        servers = Controller(listener, resource="server", reconcile=on_server)
        async with vms, servers:
            ...

    Args:
        url: the publisher's websocket endpoint, ``ws://host:port/changefeeds``.
        instance: this listener's instance UUID (RFD 5 registration).
        service: this listener's service name, e.g. ``tcns``.
        change_kind: the resource and sub-resources to register for ...
        change_kinds: ... or several, each resource once, on one connection
            (the v2 registration; one bootstrap route each).
        config: buffer, back-off, resume, timeouts (see ListenerConfig).
        http: the HTTP client for bootstrap walks (and the controllers'
            fetches); by default one is created and closed with the listener.
        api_url: base URL the ack's bootstrap routes are resolved against
            (default: the websocket URL's origin, ``http://host:port/``).
        token: bearer token for the websocket handshake and, when the
            listener creates the HTTP client, for its requests.
        cursor: a cursor saved from an earlier run (``status().cursor``) to
            resume from; only useful when the application kept its state.
        checkpoint: a store to keep checkpoints in (``SqliteCheckpointStore``, or
            your own ``CheckpointStore``): the cursor and the mirrors of every
            attached controller, loaded at start and saved every
            ``config.checkpoint_interval`` seconds and on a clean stop.
        buffer: a buffer instance to use instead of ``config.buffer_kind``.
        registry: a Prometheus registry to expose this listener's metrics on.
        name: this listener's name in logs and metrics (default
            ``service:resource``, ``service:vm+server`` for several).
        rng: random source of the back-off jitter (seed it in tests).

    Raises:
        ListenerConfigError: the URL is not ws:// or wss:// (``api_url`` not
            http:// or https://), no change kind or a resource twice, a setting
            is out of range, a registration the publisher would refuse (an empty
            ``instance`` or ``service``, a resource or sub-resource name the
            registration schema does not allow, too many of them, a ``cursor``
            too long), or both ``cursor`` and ``checkpoint`` (the checkpoint
            holds the cursor).
    """

    def __init__(
        self,
        url: str,
        *,
        instance: str,
        service: str,
        change_kind: ChangeKind | None = None,
        change_kinds: Sequence[ChangeKind] = (),
        config: ListenerConfig | None = None,
        http: httpx.AsyncClient | None = None,
        api_url: str | None = None,
        token: str | None = None,
        cursor: str | None = None,
        checkpoint: CheckpointStore | None = None,
        buffer: Buffer | None = None,
        registry: CollectorRegistry | None = None,
        name: str | None = None,
        rng: random.Random | None = None,
    ) -> None:
        if config is not None and not isinstance(config, ListenerConfig):
            raise ListenerConfigError("config", f"must be a ListenerConfig, got {config!r}")
        self.config = config or ListenerConfig()
        self.url = url
        origin = _http_origin(url)
        if api_url is not None:
            _check_api_url(api_url)
        self.api_url = api_url or origin
        self.instance = instance
        self.service = service
        self.change_kinds = _change_kinds(change_kind, change_kinds)
        self.resources = tuple(kind.resource for kind in self.change_kinds)
        self._multi = len(self.change_kinds) > 1
        # What every attempt will send, checked now rather than refused by the publisher.
        check_registration(
            Registration(
                instance,
                service,
                self.change_kinds,
                since=cursor,
                batch=self.config.batch,
                multi=self._multi,
            ),
            "change_kind" if change_kind is not None else "change_kinds",
        )
        if buffer is not None and not isinstance(buffer, Buffer):
            raise ListenerConfigError("buffer", f"must be a Buffer, got {buffer!r}")
        self.name = name or f"{service}:{'+'.join(self.resources)}"
        self._token = token
        self._http = http
        self._own_http = http is None
        self._buffer = buffer or make_buffer(self.config.buffer_kind, self.config.buffer_size)
        self._backoff = Backoff(self.config.backoff, rng)
        self._lifecycle = Lifecycle(self._on_transition)
        self._clock = time.monotonic
        self._cursor = cursor
        self._handed = cursor  # the cursor of the last event handed out
        self._position = cursor  # ... and of the last one the application is done with
        super().__init__()
        self._attached = 0
        self._running: set[Sink] = set()
        self._dispatcher: asyncio.Task[None] | None = None
        self._watchdog: asyncio.Task[None] | None = None  # see _controllers_must_run
        self._parked: set[Sink] = set()  # stopped, still checkpointed (_controller_done)
        if checkpoint is not None:
            self._use_checkpoint(checkpoint)
        if registry is not None:
            register_listener(registry, self)

    # -- public face -----------------------------------------------------------

    @property
    def change_kind(self) -> ChangeKind:
        """The (first) change kind registered."""
        return self.change_kinds[0]

    @property
    def state(self) -> ConnectionState:
        """Where the connection lifecycle is now."""
        return self._lifecycle.state

    @property
    def cursor(self) -> str | None:
        """The cursor a reconnect resumes from: that of the last event handed out."""
        return self._cursor

    @property
    def route(self) -> str | None:
        """The (first) bootstrap route's absolute URL, known after the first ack."""
        return self._routes.get(self.resources[0])

    @property
    def routes(self) -> dict[str, str]:
        """Each resource's bootstrap route (absolute URL), known after the first ack."""
        return dict(self._routes)

    @property
    def http(self) -> httpx.AsyncClient:
        """The HTTP client of bootstrap walks (started listeners only)."""
        if self._http is None:
            raise ListenerError("the listener has not been started")
        return self._http

    @property
    def buffer(self) -> Buffer:
        return self._buffer

    @property
    def items_delivered(self) -> int:
        """Change items handed to the application (iteration or controllers)."""
        return self._staged_total - len(self._staged) + self._dispatched

    def status(self) -> ListenerStatus:
        """A snapshot of the listener's state and counters."""
        now = self._clock()
        held = self._held()
        self._peak = max(self._peak, held)
        return ListenerStatus(
            name=self.name,
            state=self.state,
            attempts=self.attempts,
            failures=self._backoff.failures,
            registrations=self.registrations,
            resumes=self.resumes,
            bootstraps=self.bootstraps,
            buffer_size=held,
            buffer_capacity=self._buffer.capacity,
            buffer_peak=self._peak,
            overflows=self.overflows,
            aborts=self.aborts,
            backoff_delay=self._backoff.delay,
            backoff_ceiling=self._backoff.ceiling,
            backoff_resets=self._backoff.resets,
            last_error=self.last_error,
            cursor=self._cursor,
            items_received=self.items_received,
            items_delivered=self.items_delivered,
            frames_received=self.frames_received,
            live_for=0.0 if self._live_since is None else now - self._live_since,
            route=self.route,
            resources=self.resources,
            bootstrap=tuple(self._progress[r] for r in self.resources if r in self._progress),
            not_resumed=dict(self._not_resumed),
            checkpoint=None if self._checkpointer is None else self._checkpointer.status(),
        )

    def metric_samples(self) -> list[Sample]:
        """This listener's values for the ``changefeed_listener_*`` metrics."""
        st = self.status()
        p = "changefeed_listener_"
        samples = [
            Sample(p + "state", 1.0 if st.state is state else 0.0, (("state", state.value),))
            for state in ConnectionState
        ]
        samples += [
            Sample(p + "connection_attempts", st.attempts),
            Sample(p + "registrations", st.registrations),
            Sample(p + "resumes", st.resumes),
            Sample(p + "bootstraps", st.bootstraps),
            Sample(p + "aborts", st.aborts),
            Sample(p + "overflows", st.overflows),
            Sample(p + "buffer_items", st.buffer_size),
            Sample(p + "buffer_capacity", st.buffer_capacity),
            Sample(p + "backoff_seconds", st.backoff_delay),
            Sample(p + "backoff_failures", st.failures),
            Sample(p + "items_received", st.items_received),
            Sample(p + "items_delivered", st.items_delivered),
        ]
        samples += [
            Sample(p + "not_resumed", count, (("reason", reason),))
            for reason, count in sorted(st.not_resumed.items())
        ]
        checkpoint = st.checkpoint
        if checkpoint is not None:
            saved_at = checkpoint.last_saved_at
            samples += [
                Sample(p + "checkpoint_saves", checkpoint.saves),
                Sample(p + "checkpoint_save_failures", checkpoint.save_failures),
                Sample(p + "checkpoint_failing_saves", checkpoint.consecutive_failures),
                Sample(p + "checkpoint_save_seconds", checkpoint.last_save_seconds),
                Sample(
                    p + "checkpoint_age_seconds",
                    0.0 if saved_at is None else max(0.0, time.time() - saved_at),
                ),
            ]
        for progress in st.bootstrap:
            labels = (("resource", progress.resource),)
            samples += [
                Sample(p + "bootstrap_items", progress.items, labels),
                Sample(p + "bootstrap_pages", progress.pages, labels),
                Sample(p + "bootstrap_items_per_second", progress.rate, labels),
            ]
        return samples

    def start(self) -> None:
        """Start the connection lifecycle in a background task (idempotent)."""
        if self._task is not None:
            return
        if self._http is None:
            self._http = httpx.AsyncClient(
                base_url=self.api_url,
                headers=bearer_headers(self._token),
                timeout=self.config.http_timeout,
            )
        self._task = asyncio.create_task(self._run(), name=f"changefeed-listener-{self.name}")
        if self._checkpointer is not None:
            self._checkpointer.start()
        if self._sinks:
            self._dispatcher = asyncio.create_task(
                self._dispatch(), name=f"changefeed-dispatch-{self.name}"
            )

    async def close(self) -> None:
        """Stop: save the last checkpoint (with a store), close the connection, drop the
        buffer, end iteration. Idempotent."""
        watchdog, self._watchdog = self._watchdog, None
        if watchdog is not None and watchdog is not asyncio.current_task():
            watchdog.cancel()
        if self._checkpointer is not None:
            self._checkpointer.final("listener closed")
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        if self._lifecycle.can(S.STOPPED):
            self._lifecycle.to(S.STOPPED)
        await self._clear()
        self._ready.set()
        dispatcher, self._dispatcher = self._dispatcher, None
        if dispatcher is not None:
            dispatcher.cancel()
            await asyncio.gather(dispatcher, return_exceptions=True)
        self._stop_sinks(self._fatal)
        if self._checkpointer is not None:
            await self._checkpointer.close()
        if self._own_http and self._http is not None:
            await self._http.aclose()
            self._http = None

    async def save_checkpoint(self) -> bool:
        """Take a checkpoint now and save it (besides the periodic ones).

        Returns:
            whether one was saved: not without a store, before the checkpoint was
            loaded, without a position yet, after the listener or a controller
            stopped, or when the store failed (logged).
        """
        if self._checkpointer is None:
            return False
        return await self._checkpointer.save_now() is not None

    async def __aenter__(self) -> Self:
        self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    def __aiter__(self) -> Self:
        return self

    async def __anext__(self) -> Event:
        """The next event: ``Resynced`` or ``ChangeItem``.

        Raises:
            RegistrationRefused: the publisher refused the registration for good.
            RetriesExhausted: ``max_attempts`` attempts failed in a row.
            ListenerError: controllers are attached: they are its consumers.
            StopAsyncIteration: the listener was closed.
        """
        # Asking for the next event means the application is done with the last one
        # (with the last ``Resynced`` of a bootstrap: the others are not consistent
        # with its cursor on their own).
        if not self._resyncs:
            self._position = self._handed
        staged = self._staged
        if staged:  # the hot path: one item of a batch already taken from the buffer
            item = staged.popleft()
            self._cursor = self._handed = item.cursor
            return item
        if self._sinks:
            raise ListenerError(f"controllers are attached to listener {self.name}: not iterable")
        unit = await self._next_unit()
        if isinstance(unit, Resynced):
            self._handed = unit.cursor
            if not self._resyncs:  # a reconnect before the last one must bootstrap again
                self._cursor = unit.cursor
            return unit
        self._staged_total += len(unit)
        staged.extend(unit)
        item = staged.popleft()
        self._cursor = self._handed = item.cursor
        return item

    # -- controllers ---------------------------------------------------------------

    def _attach(self, resource: str, sink: Sink) -> None:
        """Make ``sink`` (a controller) the consumer of ``resource``'s events.

        Raises:
            ListenerConfigError: the listener does not register ``resource``, or it has
                started (the controller would have missed its bootstrap).
        """
        if resource not in self.resources:
            raise ListenerConfigError(
                "resource", f"{resource!r} is not registered by listener {self.name}"
            )
        if self._task is not None or self.state is not S.IDLE:
            raise ListenerConfigError(
                "listener", "attach every controller before the listener starts"
            )
        if self._checkpointer is not None:
            self._check_checkpointable(sink)
        self._sinks[resource] = [*self._sinks.get(resource, ()), sink]
        self._attached += 1

    def _detach(self, sink: Sink) -> None:
        """Undo ``_attach`` (the controller's constructor failed after it)."""
        for resource, sinks in list(self._sinks.items()):
            if sink in sinks:
                rest = [s for s in sinks if s is not sink]
                if rest:
                    self._sinks[resource] = rest
                else:
                    del self._sinks[resource]
                self._attached -= 1

    def _use_checkpoint(self, store: CheckpointStore) -> None:
        """Keep checkpoints in ``store`` (``Listener(checkpoint=)``, ``Controller(checkpoint=)``).

        Raises:
            ListenerConfigError: another store, a saved cursor besides it, a
                listener that started, or a controller that cannot be checkpointed.
        """
        if self._checkpointer is not None:
            if self._checkpointer.store is store:
                return
            raise ListenerConfigError("checkpoint", f"listener {self.name} has another store")
        if self._cursor is not None:
            raise ListenerConfigError(
                "checkpoint", "give a cursor or a checkpoint store, not both: it keeps the cursor"
            )
        if self._task is not None or self.state is not S.IDLE:
            raise ListenerConfigError("checkpoint", "give the store before the listener starts")
        for sinks in self._sinks.values():
            for sink in sinks:
                self._check_checkpointable(sink)
        self._checkpointer = Checkpointer(
            store,
            _Checkpointed(self),
            interval=self.config.checkpoint_interval,
            load_timeout=self.config.checkpoint_load_timeout,
            name=self.name,
        )

    def _check_checkpointable(self, sink: Sink) -> None:
        problem = sink.checkpoint_problem()
        if problem is not None:
            raise ListenerConfigError("checkpoint", problem)
        names = [s.name for sinks in self._sinks.values() for s in sinks if s is not sink]
        if sink.name in names:
            raise ListenerConfigError(
                "checkpoint",
                f"two controllers named {sink.name!r}: a checkpoint keeps each mirror by "
                "its controller's name (give name=)",
            )

    def _controller_stopping(self, sink: Sink) -> None:
        """An attached controller is about to stop taking events. The last one running
        takes the last checkpoint now, while every mirror still follows the cursor.
        One that stops while others run is parked instead (``_controller_done``), and
        checkpoints go on."""
        if self._checkpointer is not None and self._running == {sink}:
            self._checkpointer.final(f"controller {sink.name} stopped")

    def _controller_running(self, sink: Sink) -> None:
        """An attached controller runs; the listener starts once all of them do. On a
        listener that has stopped, it stops at once, the way the listener did."""
        if self.state is S.STOPPED:
            sink.stopped(self._fatal)
            return
        self._running.add(sink)
        self._start_when_all_run()

    def _start_when_all_run(self) -> None:
        if len(self._running) >= self._attached:
            self.start()
            return
        log_event(
            log,
            "listener.waiting_for_controllers",
            **self._fields(),
            running=len(self._running),
            attached=self._attached,
        )
        if self._watchdog is None or self._watchdog.done():
            self._watchdog = asyncio.create_task(
                self._controllers_must_run(), name=f"changefeed-watchdog-{self.name}"
            )

    async def _controllers_must_run(self) -> None:
        """Stop the listener (and so the controllers that run) with a clear error when
        the others attached to it have not run within ``controller_start_timeout``."""
        timeout = self.config.controller_start_timeout
        await asyncio.sleep(timeout)
        idle = [sink.name for sink in self._controllers() if sink not in self._running]
        if self._task is not None or self.state is not S.IDLE or not idle or not self._running:
            return  # started, or nobody waits any more
        error = ListenerConfigError(
            "controllers",
            f"{', '.join(idle)} attached to listener {self.name} did not run within "
            f"{timeout:g}s of the first that did (ListenerConfig.controller_start_timeout): "
            "run every controller made with a listener, or close() those you do not run",
        )
        log_event(
            log,
            "listener.controllers_not_running",
            logging.ERROR,
            **self._fields(),
            idle=idle,
            running=sorted(sink.name for sink in self._running),
            waited=timeout,
        )
        self._stop_with(error)
        self._stop_sinks(error)

    async def _controller_done(self, sink: Sink) -> None:
        """An attached controller stopped: the listener no longer waits for it to start;
        once started, the last one running closes it. One that stops while others
        run stays attached, *parked*, when there are checkpoints: it then takes its
        events into its mirror and pending ids only (``_controller_sink``), so that
        the checkpoints taken after it stopped are still consistent for it. Without
        checkpoints it gets nothing more."""
        if sink in self._parked:
            return
        started = self._task is not None or self.state is not S.IDLE
        was_running = sink in self._running
        self._running.discard(sink)
        if was_running and self._running and started and self._checkpointer is not None:
            self._parked.add(sink)
            self._attached -= 1
            log_event(log, "listener.controller_parked", **self._fields(), controller=sink.name)
            return
        for resource, sinks in list(self._sinks.items()):
            if sink in sinks:
                self._sinks[resource] = [s for s in sinks if s is not sink]
                self._attached -= 1
        if was_running:
            if not self._running and started:
                await self.close()
        elif self._running and not started:
            self._start_when_all_run()  # it may have been the one the others waited for

    # -- logging --------------------------------------------------------------

    def _on_transition(self, old: ConnectionState, new: ConnectionState) -> None:
        log_event(
            log,
            "listener.state",
            logging.DEBUG,
            listener=self.name,
            old=old.value,
            new=new.value,
            attempt=self.attempts,
        )
        if new is S.LIVE:
            log_event(log, "listener.live", **self._fields(), cursor=self._cursor)


class _Checkpointed:
    """The listener's side of ``_checkpointer.CheckpointHost``: what a checkpoint reads
    from it. A separate object, so that these calls are not part of ``Listener``'s
    public face."""

    __slots__ = ("_listener",)

    def __init__(self, listener: Listener) -> None:
        self._listener = listener

    @property
    def change_kinds(self) -> tuple[ChangeKind, ...]:
        return self._listener.change_kinds

    def checkpoint_position(self) -> str | None:
        return self._listener._position

    def checkpoint_sources(self) -> list[Sink]:
        return self._listener._controllers()
