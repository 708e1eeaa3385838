"""The listener: registers on a publisher's /changefeeds websocket and yields its changes.

This module is the listener's face: its settings, ``start`` and ``close``,
``async for``, the status and metrics, how controllers attach to it, and
where checkpoints come in. It owns no items and no connection state; it
composes the parts that do, each owning its own state:

* ``_connection.ConnectionLoop``: one background task runs the connection
  lifecycle (connect, register, bootstrap, live; after a failure, clear and
  back off), one ``_session.Session`` per attempt, the session reporting to
  the loop;
* ``_inbox.Inbox``: each frame's items into the buffer, and out to the
  application in feed order: ``async for``, or a dispatch task that hands
  each attached controller its resource's events; its cursor is where
  the application is;
* ``_attachments.Attachments``: the attached controllers, which run and which
  are parked;
* ``_checkpointer.Checkpointer``: the checkpoints, with a store.

The socket is always read as fast as it delivers, whatever the application
does: the buffer absorbs the difference, and when it cannot, the listener
aborts rather than block the publisher or grow without bound (RFD 5 "Back
pressure"). The cursor it resumes from is that of the last event handed to
the application, and items are handed out in feed order, so nothing that was
buffered and then cleared is lost.

Several controllers share one listener: each attaches to one resource before
the listener starts (``_attach``, their one way in), the listener starts
once every attached controller runs (or stops with a ``ListenerConfigError``
when one has not run within ``controller_start_timeout`` of the first), and
it closes when the last one stops.

With a checkpoint store, the listener loads the last checkpoint before it
first registers (its controllers start from their saved mirrors, and it
registers with the saved cursor), and saves one at intervals and when it or
the last controller running stops. A controller that stops while others run
on is parked, so checkpoints go on. The cursor saved is ``Inbox.done``.

It must never hand the application an item of a connection before that
connection's ``Resynced`` events, never retry without back-off, and never
swallow a failure without logging and counting it.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import random
import time
from collections.abc import AsyncIterator, Sequence
from types import TracebackType
from typing import TYPE_CHECKING, Any, Self
from urllib.parse import urlsplit, urlunsplit

import httpx

from changefeed.bootstrap import bearer_headers
from changefeed.logs import log_event
from changefeed.schemas import ChangeKind, Registration

from ._attachments import Attached, Attachments, ControllerLink, Stopped
from ._backoff import RegistrationBackoff
from ._checkpoint import CheckpointStore
from ._checkpointer import Checkpointer
from ._checks import check_change_kinds, check_registration
from ._config import ListenerConfig
from ._connection import ConnectionLoop
from ._errors import ListenerConfigError, ListenerError
from ._events import Event, ListenerCounts, ListenerStatus
from ._inbox import Buffer, Inbox, make_buffer
from ._lifecycle import ConnectionState
from ._log import log
from ._metrics import Sample, register_listener, samples_of

if TYPE_CHECKING:  # prometheus-client: needed only by whoever passes a registry
    from prometheus_client import CollectorRegistry

__all__ = ["Listener"]

S = ConnectionState


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


class Listener:
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
        rng: random source of the jitter of the re-registration back-off and
            the bootstrap walks' retries (seed it in tests).

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
        multi = len(self.change_kinds) > 1
        # What every attempt will send, checked now rather than refused by the publisher.
        check_registration(
            Registration(
                instance,
                service,
                self.change_kinds,
                since=cursor,
                batch=self.config.batch,
                multi=multi,
            ),
            "change_kind" if change_kind is not None else "change_kinds",
        )
        if buffer is not None and not isinstance(buffer, Buffer):
            raise ListenerConfigError("buffer", f"must be a Buffer, got {buffer!r}")
        self.name = name or f"{service}:{'+'.join(self.resources)}"
        self._token = token
        self._http = http
        self._own_http = http is None
        self._counts = ListenerCounts()
        self._inbox = Inbox(
            buffer or make_buffer(self.config.buffer_kind, self.config.buffer_size),
            cursor,
            resources=self.resources,
            multi=multi,
            high_water=self.config.high_water,
            fields=self._fields,
            counts=self._counts,
        )
        self._connection = ConnectionLoop(
            self._inbox,
            url=url,
            api_url=self.api_url,
            instance=instance,
            service=service,
            change_kinds=self.change_kinds,
            config=self.config,
            token=token,
            backoff=RegistrationBackoff(self.config.backoff, rng),
            name=self.name,
            on_resumed=self._resumed,
            counts=self._counts,
        )
        self._attachments = Attachments()
        self._checkpointer: Checkpointer | None = None
        self._fatal: BaseException | None = None
        self._task: asyncio.Task[None] | None = None
        self._dispatcher: asyncio.Task[None] | None = None
        self._watchdog: asyncio.Task[None] | None = None  # see _controllers_must_run
        self._host: asyncio.Task[Any] | None = None  # the task in ``async with listener``
        self._host_cancelled = False
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
        return self._connection.state

    @property
    def cursor(self) -> str | None:
        """The cursor a reconnect resumes from: that of the last event handed out."""
        return self._inbox.resume

    @property
    def route(self) -> str | None:
        """The (first) bootstrap route's absolute URL, known after the first ack."""
        return self._connection.routes.get(self.resources[0])

    @property
    def routes(self) -> dict[str, str]:
        """Each resource's bootstrap route (absolute URL), known after the first ack."""
        return dict(self._connection.routes)

    @property
    def http(self) -> httpx.AsyncClient:
        """The HTTP client of bootstrap walks (started listeners only)."""
        if self._http is None:
            raise ListenerError("the listener has not been started")
        return self._http

    @property
    def buffer(self) -> Buffer:
        return self._inbox.buffer

    # The counters of ``status()`` that the listener also shows as attributes.

    @property
    def attempts(self) -> int:
        """Connection attempts since start."""
        return self._counts.attempts

    @property
    def registrations(self) -> int:
        """Acks received."""
        return self._counts.registrations

    @property
    def resumes(self) -> int:
        """Registrations that sent ``since`` and were answered ``resumed: true``."""
        return self._counts.resumes

    @property
    def bootstraps(self) -> int:
        """Bootstrap walks completed."""
        return self._counts.bootstraps

    @property
    def aborts(self) -> int:
        """Connections that ended."""
        return self._counts.aborts

    @property
    def overflows(self) -> int:
        """Times the buffer overflowed."""
        return self._counts.overflows

    @property
    def items_received(self) -> int:
        """Change items decoded from the socket."""
        return self._counts.items_received

    @property
    def frames_received(self) -> int:
        """Websocket frames received."""
        return self._counts.frames_received

    @property
    def last_error(self) -> str | None:
        """The last failure, as text."""
        return self._connection.last_error

    @property
    def items_delivered(self) -> int:
        """Change items handed to the application (iteration or controllers)."""
        return self._inbox.items_delivered

    def status(self) -> ListenerStatus:
        """A snapshot of the listener's state and counters."""
        connection, inbox = self._connection, self._inbox
        backoff = connection.backoff
        held = inbox.held()
        live_since = connection.live_since
        return ListenerStatus.of(
            self._counts,
            name=self.name,
            state=connection.state,
            failures=backoff.failures,
            buffer_size=held,
            buffer_capacity=inbox.buffer.capacity,
            buffer_peak=max(inbox.peak, held),
            backoff_delay=backoff.delay,
            backoff_ceiling=backoff.ceiling,
            backoff_resets=backoff.resets,
            last_error=connection.last_error,
            cursor=self._inbox.resume,
            items_delivered=inbox.items_delivered,
            live_for=0.0 if live_since is None else time.monotonic() - live_since,
            route=self.route,
            resources=self.resources,
            bootstrap=tuple(
                connection.progress[r] for r in self.resources if r in connection.progress
            ),
            checkpoint=None if self._checkpointer is None else self._checkpointer.status(),
        )

    def metric_samples(self) -> list[Sample]:
        """This listener's values for the ``changefeed_listener_*`` metrics."""
        return samples_of("changefeed_listener_", self.status())

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
        if self._attachments.waited_for():
            # Started directly, ahead of controllers attached to it: from now on
            # they miss what it takes.
            self._watch_controllers()
        if self._checkpointer is not None:
            self._checkpointer.start()
        if self._attachments:
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
        self._connection.stop()
        await self._inbox.clear()
        self._inbox.stop(None)
        dispatcher, self._dispatcher = self._dispatcher, None
        if dispatcher is not None:
            dispatcher.cancel()
            await asyncio.gather(dispatcher, return_exceptions=True)
        self._stop_controllers(self._fatal)
        if self._checkpointer is not None:
            await self._checkpointer.close()
        if self._own_http and self._http is not None:
            await self._http.aclose()
            self._http = None

    def done_with_last(self) -> None:
        """The application is done with the last event ``async for`` handed out, without
        asking for another (a loop that stops after an item): checkpoints and resumes
        cover it. Otherwise an event counts as done only once the next is asked for."""
        self._inbox.done_with_last()

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
        """Start, and close when the block exits. Should the listener stop for good
        while controllers are attached and none of them runs (so that neither
        iteration nor a controller would say so: controllers attached and never
        run), the block is cancelled, as a ``TaskGroup`` cancels it for a failed
        task, and its exit raises that error."""
        self._host = asyncio.current_task()
        self._host_cancelled = False
        self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        """Close. Raises the error that stopped the listener when that cancelled the block."""
        host, self._host = self._host, None
        ours = self._host_cancelled and host is not None and host.uncancel() == 0
        self._host_cancelled = False
        await self.close()
        if ours and isinstance(exc, asyncio.CancelledError) and self._fatal is not None:
            raise self._fatal

    def __aiter__(self) -> AsyncIterator[Event]:
        """The events, handed out by the inbox: ``Resynced`` or ``ChangeItem``.

        Raises:
            ListenerError: controllers are attached: they are its consumers.
        """
        self._check_iterable()
        return self._inbox

    async def __anext__(self) -> Event:
        """The next event: ``Resynced`` or ``ChangeItem``.

        Raises:
            RegistrationRefused: the publisher refused the registration for good.
            RetriesExhausted: ``max_attempts`` attempts failed in a row.
            ListenerError: controllers are attached: they are its consumers.
            StopAsyncIteration: the listener was closed.
        """
        self._check_iterable()
        return await self._inbox.__anext__()

    def _check_iterable(self) -> None:
        if self._attachments:
            raise ListenerError(f"controllers are attached to listener {self.name}: not iterable")

    # -- the background tasks ------------------------------------------------------

    async def _run(self) -> None:
        """The connection lifecycle, after loading the checkpoint (with a store)."""
        try:
            if self._checkpointer is not None:
                self._inbox.restore(await self._checkpointer.restore(self.config.resume))
            await self._connection.run(self.http)
        except asyncio.CancelledError:
            raise
        except ListenerError as exc:
            self._fail(exc)
        except Exception as exc:  # a bug: stop loudly rather than spin
            log_event(log, "listener.crashed", logging.ERROR, exc=exc, **self._fields())
            self._fail(exc)

    async def _dispatch(self) -> None:
        """Hand every attached controller its resource's events until the listener stops."""
        ending: BaseException | None = None
        try:
            await self._inbox.dispatch(self._attachments.consumers)
        except Exception as exc:
            if exc is not self._fatal:  # a bug here: stop loudly rather than hang the controllers
                log_event(
                    log, "listener.dispatch_crashed", logging.ERROR, exc=exc, **self._fields()
                )
                self._fail(exc)
            ending = exc
        self._stop_controllers(ending)

    def _fail(self, exc: BaseException) -> None:
        """Stop for good with ``exc``: iteration and the controllers raise it (the first
        such error: a later one is a consequence). The connection ends with it."""
        if self._fatal is None:
            self._fatal = exc
        self._connection.stop(self._fatal)
        self._inbox.stop(self._fatal)
        task = self._task
        if task is not None and task is not asyncio.current_task():
            task.cancel()  # (``close`` collects it)
        host = self._host
        if (
            host is not None
            and not host.done()
            and host is not asyncio.current_task()
            and self._attachments
            and not self._attachments.running
            and not self._host_cancelled
        ):
            # Nobody else would say so: not iterable (controllers are attached), and
            # no controller runs to raise it.
            self._host_cancelled = True
            host.cancel()

    def _fields(self) -> dict[str, Any]:
        return self._connection.fields()

    # -- controllers ---------------------------------------------------------------

    def _started(self) -> bool:
        return self._task is not None or self.state is not S.IDLE

    def _attach(self, resource: str, sink: Attached) -> ControllerLink:
        """Make ``sink`` (a controller) the consumer of ``resource``'s events: a
        controller's one way into its listener.

        Raises:
            ListenerConfigError: the listener does not register ``resource``, or it has
                started (the controller would have missed its bootstrap).
        """
        if resource not in self.resources:
            raise ListenerConfigError(
                "resource", f"{resource!r} is not registered by listener {self.name}"
            )
        if self._started():
            raise ListenerConfigError(
                "listener", "attach every controller before the listener starts"
            )
        if self._checkpointer is not None:
            self._check_checkpointable(sink)
        self._attachments.attach(resource, sink)
        self._watch_controllers()
        return ControllerLink(
            running=functools.partial(self._controller_running, sink),
            stopping=functools.partial(self._controller_stopping, sink),
            done=functools.partial(self._controller_done, sink),
            detach=functools.partial(self._attachments.detach, sink),
            use_checkpoint=self._use_checkpoint,
            registered=self._connection.registered,
            routes=lambda: self._connection.routes,
            http=lambda: self.http,
        )

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
        if self._inbox.resume is not None:
            raise ListenerConfigError(
                "checkpoint", "give a cursor or a checkpoint store, not both: it keeps the cursor"
            )
        if self._started():
            raise ListenerConfigError("checkpoint", "give the store before the listener starts")
        for sink in self._attachments.all():
            self._check_checkpointable(sink)
        inbox = self._inbox
        self._checkpointer = Checkpointer(
            store,
            self.change_kinds,
            position=lambda: inbox.done,
            sources=self._attachments.all,
            interval=self.config.checkpoint_interval,
            load_timeout=self.config.checkpoint_load_timeout,
            name=self.name,
        )

    def _check_checkpointable(self, sink: Attached) -> None:
        problem = sink.checkpoint_problem()
        if problem is not None:
            raise ListenerConfigError("checkpoint", problem)
        names = [s.name for s in self._attachments.all() if s is not sink]
        if sink.name in names:
            raise ListenerConfigError(
                "checkpoint",
                f"two controllers named {sink.name!r}: a checkpoint keeps each mirror by "
                "its controller's name (give name=)",
            )

    def _resumed(self) -> None:
        for sink in self._attachments.all():
            sink.resumed(self.config.checkpoint_replay)

    def _stop_controllers(self, error: BaseException | None) -> None:
        if self._checkpointer is not None:  # while every mirror still follows the cursor
            self._checkpointer.final("listener stopped")
        for sink in self._attachments.all():
            sink.stopped(error)

    def _controller_running(self, sink: Attached) -> None:
        """An attached controller runs; the listener starts once all of them do. On a
        listener that has stopped, it stops at once, the way the listener did."""
        if self.state is S.STOPPED:
            sink.stopped(self._fatal)
            return
        self._attachments.start(sink)
        self._start_when_all_run()

    def _start_when_all_run(self) -> None:
        waited_for = self._attachments.waited_for()
        if not waited_for:
            self.start()
            return
        running = len(self._attachments.running)
        log_event(
            log,
            "listener.waiting_for_controllers",
            **self._fields(),
            running=running,
            attached=running + len(waited_for),
        )
        if running == 1:
            self._watch_controllers()  # the others have that long from the first's run

    def _watch_controllers(self) -> None:
        """Give the attached controllers ``controller_start_timeout`` from now to run
        (``_controllers_must_run``): from their attachment, from the first that runs,
        and from the listener's start, whichever came last."""
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return  # attached outside a loop: the wait begins when one runs
        if self._watchdog is not None and not self._watchdog.done():
            self._watchdog.cancel()
        self._watchdog = loop.create_task(
            self._controllers_must_run(), name=f"changefeed-watchdog-{self.name}"
        )

    async def _controllers_must_run(self) -> None:
        """Report controllers that have not run within ``controller_start_timeout``.

        Once the listener or another controller runs, that stops the listener (and
        so the controllers that run) with a clear error: the listener waits for
        them or, started directly, goes on without them. Before anything runs
        nothing is missed yet: an ERROR line says which controllers wait."""
        timeout = self.config.controller_start_timeout
        await asyncio.sleep(timeout)
        idle = [sink.name for sink in self._attachments.waited_for()]
        if not idle or self.state is S.STOPPED:
            return  # nobody waits any more
        running = sorted(sink.name for sink in self._attachments.running)
        started = self._started()
        log_event(
            log,
            "listener.controllers_not_running",
            logging.ERROR,
            **self._fields(),
            idle=idle,
            running=running,
            listener_started=started,
            waited=timeout,
        )
        if not started and not running:
            return
        since = "the first that did" if running else "the listener's start"
        error = ListenerConfigError(
            "controllers",
            f"{', '.join(idle)} attached to listener {self.name} did not run within "
            f"{timeout:g}s of {since} (ListenerConfig.controller_start_timeout): "
            "run every controller made with a listener, or close() those you do not run",
        )
        self._fail(error)
        self._stop_controllers(error)

    def _controller_stopping(self, sink: Attached) -> None:
        """An attached controller is about to stop taking events. The last one running
        takes the last checkpoint now, while every mirror still follows the cursor.
        One that stops while others run is parked instead (``_controller_done``), and
        checkpoints go on."""
        if self._checkpointer is not None and self._attachments.running == {sink}:
            self._checkpointer.final(f"controller {sink.name} stopped")

    async def _controller_done(self, sink: Attached) -> None:
        """An attached controller stopped (or was closed without running): the listener
        no longer waits for it to start; once started, the last one running closes it.
        One that stops while others run stays attached, *parked*, when there are
        checkpoints: it then takes its events into its mirror and pending ids only, so
        that the checkpoints taken after it stopped are still consistent for it.
        Without checkpoints it gets nothing more."""
        outcome = self._attachments.stop(
            sink, started=self._started(), checkpoints=self._checkpointer is not None
        )
        if outcome is Stopped.PARKED:
            log_event(log, "listener.controller_parked", **self._fields(), controller=sink.name)
        elif outcome is Stopped.CLOSE:
            await self.close()
        elif outcome is Stopped.START_OTHERS:
            self._start_when_all_run()
