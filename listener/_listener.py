"""The listener: registers on a publisher's /changefeeds websocket and yields its changes.

The websockets / httpx adapter around the pure core (``lifecycle``,
``backoff``, ``buffer``). One background task runs the connection lifecycle
(steps 1-4, one connection, are a ``session.Session``, which reports back
through ``_Reports`` at the end of this module; the back-off is here):

1. CONNECTING: open the websocket (optional bearer token on the handshake)
   and send the RFD 5 v1 registration, with ``since`` when there is a cursor
   to resume from and ``batch: true``.
2. REGISTERED: the ack says whether the publisher resumed from ``since``.
3. BOOTSTRAPPING (``resumed: false``): page the ack's ``bootstrapRoute`` with
   the bootstrap Pager while every change item that arrives is buffered.
4. LIVE: items flow from the socket into the buffer and from the buffer to
   the application (``async for event in listener``).
5. BACKING_OFF: any failure (a drop, a retryable close code, a missed pong,
   an ack that never came, a failed page walk, a full buffer) clears the
   buffer and waits a jittered, growing, capped delay before step 1. A
   failure retrying cannot heal (bad_frame, unknown_resource, unauthorized,
   forbidden) stops the listener with ``RegistrationRefused`` instead.

The socket is always read as fast as it delivers, whatever the application
does: the buffer absorbs the difference, and when it cannot, the listener
aborts rather than block the publisher or grow without bound (RFD 5 "Back
pressure"). The cursor it resumes from is that of the last event handed to
the application, so nothing that was buffered and then cleared is lost.

It must never hand the application an item of a connection before that
connection's ``Resynced``, never retry without back-off, and never swallow a
failure without logging and counting it.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections import deque
from collections.abc import Sequence
from types import TracebackType
from typing import Any, Self
from urllib.parse import urlsplit, urlunsplit

import httpx
from prometheus_client import CollectorRegistry

from changefeed.logs import log_event
from changefeed.schemas import Ack, ChangeItem, ChangeKind, Registration

from ._backoff import Backoff
from ._buffer import Buffer, make_buffer
from ._config import ListenerConfig
from ._errors import (
    BufferOverflow,
    ListenerConfigError,
    ListenerError,
    PublisherClosed,
    RegistrationRefused,
    RetriesExhausted,
    SessionError,
)
from ._events import Event, ListenerStatus, Resynced
from ._lifecycle import ConnectionState, Disposition, Lifecycle, disposition
from ._metrics import Sample, register_listener
from ._session import Session

__all__ = ["Listener"]

log = logging.getLogger(__name__)

S = ConnectionState
_TAKE = 512  # items moved from the buffer to the hand-out queue at once
_LOW_WATER = 0.5  # the high-water event re-arms once the buffer drains below this


def _http_origin(ws_url: str) -> str:
    parts = urlsplit(ws_url)
    scheme = {"ws": "http", "wss": "https"}.get(parts.scheme)
    if scheme is None or not parts.netloc:
        raise ListenerConfigError("url", f"expected a ws:// or wss:// URL, got {ws_url!r}")
    return urlunsplit((scheme, parts.netloc, "/", "", ""))


class Listener:
    """A change-feed listener for one resource (RFD 5's listener module).

    Use it as an async context manager and iterate it::

        async with Listener("ws://vmapi/changefeeds", instance=uuid, service="tcns",
                            change_kind=ChangeKind("vm", ("nic", "alias"))) as listener:
            async for event in listener:
                ...  # Resynced(items) after each bootstrap, else ChangeItem

    Args:
        url: the publisher's websocket endpoint, ``ws://host:port/changefeeds``.
        instance: this listener's instance UUID (RFD 5 registration).
        service: this listener's service name, e.g. ``tcns``.
        change_kind: the resource and sub-resources to register for.
        config: buffer, back-off, resume, timeouts (see ListenerConfig).
        http: the HTTP client for bootstrap walks (and the controller's
            fetches); by default one is created and closed with the listener.
        api_url: base URL the ack's bootstrap route is resolved against
            (default: the websocket URL's origin, ``http://host:port/``).
        token: bearer token for the websocket handshake and, when the
            listener creates the HTTP client, for its requests.
        cursor: a cursor saved from an earlier run (``status().cursor``) to
            resume from; only useful when the application kept its state.
        buffer: a buffer instance to use instead of ``config.buffer_kind``.
        registry: a Prometheus registry to expose this listener's metrics on.
        name: this listener's name in logs and metrics (default ``service:resource``).
        rng: random source of the back-off jitter (seed it in tests).

    Raises:
        ListenerConfigError: the URL is not ws:// or wss://, or a setting is out of range.
    """

    def __init__(
        self,
        url: str,
        *,
        instance: str,
        service: str,
        change_kind: ChangeKind,
        config: ListenerConfig | None = None,
        http: httpx.AsyncClient | None = None,
        api_url: str | None = None,
        token: str | None = None,
        cursor: str | None = None,
        buffer: Buffer | None = None,
        registry: CollectorRegistry | None = None,
        name: str | None = None,
        rng: random.Random | None = None,
    ) -> None:
        self.config = config or ListenerConfig()
        self.url = url
        self.api_url = api_url or _http_origin(url)
        self.instance = instance
        self.service = service
        self.change_kind = change_kind
        self.name = name or f"{service}:{change_kind.resource}"
        self._token = token
        self._http = http
        self._own_http = http is None
        self._buffer = buffer or make_buffer(self.config.buffer_kind, self.config.buffer_size)
        self._backoff = Backoff(self.config.backoff, rng)
        self._lifecycle = Lifecycle(self._on_transition)
        self._clock = time.monotonic
        self._cursor = cursor
        self._route: str | None = None
        self._task: asyncio.Task[None] | None = None
        self._ready = asyncio.Event()
        self._staged: deque[ChangeItem] = deque()
        self._resync: Resynced | None = None
        self._generation = 0
        self._fatal: BaseException | None = None
        self._high = False
        self._bootstrapped_once = False
        self._live_since: float | None = None
        self.attempts = 0
        self.registrations = 0
        self.resumes = 0
        self.bootstraps = 0
        self.overflows = 0
        self.aborts = 0
        self.items_received = 0
        self.items_delivered = 0
        self.frames_received = 0
        self.last_error: str | None = None
        self._peak = 0
        if registry is not None:
            register_listener(registry, self)

    # -- public face -----------------------------------------------------------

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
        """The bootstrap route's absolute URL, known after the first ack."""
        return self._route

    @property
    def http(self) -> httpx.AsyncClient:
        """The HTTP client of bootstrap walks (started listeners only)."""
        if self._http is None:
            raise ListenerError("the listener has not been started")
        return self._http

    @property
    def buffer(self) -> Buffer:
        return self._buffer

    def status(self) -> ListenerStatus:
        """A snapshot of the listener's state and counters."""
        now = self._clock()
        held = len(self._buffer) + len(self._staged)
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
            route=self._route,
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
        return samples

    def start(self) -> None:
        """Start the connection lifecycle in a background task (idempotent)."""
        if self._task is not None:
            return
        if self._http is None:
            headers = {"Authorization": f"Bearer {self._token}"} if self._token else {}
            self._http = httpx.AsyncClient(
                base_url=self.api_url, headers=headers, timeout=self.config.http_timeout
            )
        self._task = asyncio.create_task(self._run(), name=f"changefeed-listener-{self.name}")

    async def close(self) -> None:
        """Stop: close the connection, drop the buffer, end iteration. Idempotent."""
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        if self._lifecycle.can(S.STOPPED):
            self._lifecycle.to(S.STOPPED)
        await self._clear()
        if self._own_http and self._http is not None:
            await self._http.aclose()
            self._http = None
        self._ready.set()

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
            StopAsyncIteration: the listener was closed.
        """
        while True:
            if self._resync is not None:
                resync, self._resync = self._resync, None
                self._cursor = resync.cursor
                return resync
            if self._staged:
                item = self._staged.popleft()
                self._cursor = item.cursor
                self.items_delivered += 1
                return item
            if self._fatal is not None:
                raise self._fatal
            state = self.state
            if state is S.STOPPED:
                raise StopAsyncIteration
            if state is S.LIVE and len(self._buffer):
                generation = self._generation
                taken = await self._buffer.take(_TAKE)
                if generation == self._generation:  # not cleared meanwhile
                    self._staged.extend(taken)
                    self._check_water()
                continue
            self._ready.clear()
            await self._ready.wait()

    # -- the lifecycle task ----------------------------------------------------

    async def _run(self) -> None:
        try:
            while True:
                self._lifecycle.to(S.CONNECTING)
                try:
                    await self._connect().run()
                except SessionError as exc:
                    ending = exc
                else:  # pragma: no cover - a session only ends by raising
                    ending = PublisherClosed("session ended")
                await self._after_session(ending)
        except asyncio.CancelledError:
            raise
        except ListenerError as exc:
            self._stop_with(exc)
        except Exception as exc:  # a bug: stop loudly rather than spin
            log_event(log, "listener.crashed", logging.ERROR, **self._fields(), error=repr(exc))
            self._stop_with(exc)

    def _connect(self) -> Session:
        """The next attempt's session (counted and logged here)."""
        assert self._http is not None
        since = self._cursor if self.config.resume else None
        self.attempts += 1
        log_event(log, "listener.connecting", **self._fields(), url=self.url, since=since)
        registration = Registration(
            self.instance, self.service, (self.change_kind,), since=since, batch=self.config.batch
        )
        return Session(
            _Reports(self),
            url=self.url,
            api_url=self.api_url,
            registration=registration.encode(),
            resuming=since is not None,
            config=self.config,
            http=self._http,
            token=self._token,
            name=self.name,
            first_bootstrap=not self._bootstrapped_once,
        )

    def _check_water(self) -> None:
        held = len(self._buffer) + len(self._staged)
        self._peak = max(self._peak, held)
        capacity = self._buffer.capacity
        if not self._high and held >= capacity * self.config.high_water:
            self._high = True
            log_event(log, "listener.buffer.high", logging.WARNING, **self._fields())
        elif self._high and held < capacity * _LOW_WATER:
            self._high = False
            log_event(log, "listener.buffer.normal", **self._fields())

    # -- ending ------------------------------------------------------------------

    def _stop_with(self, exc: BaseException) -> None:
        self._fatal = exc
        self.last_error = str(exc)
        if self._lifecycle.can(S.STOPPED):
            self._lifecycle.to(S.STOPPED)
        self._ready.set()

    async def _after_session(self, ending: SessionError) -> None:
        """Classify how a connection ended, then clear, count, log and back off."""
        self.aborts += 1
        self.last_error = f"{type(ending).__name__}: {ending}"
        self._live_since = None
        close_code = getattr(ending, "close_code", None)
        error_code = getattr(ending, "error_code", None)
        http_status = getattr(ending, "status", None)
        verdict = disposition(close_code, error_code, http_status)
        dropped = len(self._buffer) + len(self._staged)
        await self._clear()
        log_event(
            log,
            "listener.aborted",
            logging.WARNING,
            **self._fields(),
            reason=self.last_error,
            close_code=close_code,
            error_code=error_code,
            cleared=dropped,
            disposition=verdict.value,
        )
        if verdict is Disposition.STOP:
            code = error_code or (f"http_{http_status}" if http_status else f"close_{close_code}")
            raise RegistrationRefused(code, str(ending), close_code)
        if verdict is Disposition.RETRY_FRESH or (
            isinstance(ending, BufferOverflow) and self.config.resync_on_overflow
        ):
            self._cursor = None
        was_reset = self._backoff.resets
        delay = self._backoff.failure(self._clock())
        limit = self.config.max_attempts
        if limit is not None and self._backoff.failures >= limit:
            raise RetriesExhausted(self._backoff.failures, self.last_error)
        self._lifecycle.to(S.BACKING_OFF)
        log_event(
            log,
            "listener.backoff",
            logging.WARNING,
            **self._fields(),
            delay=round(delay, 4),
            ceiling=round(self._backoff.ceiling, 4),
            failures=self._backoff.failures,
            reset=self._backoff.resets > was_reset,
            resume=self._cursor is not None and self.config.resume,
        )
        await asyncio.sleep(delay)

    async def _clear(self) -> None:
        self._generation += 1
        self._staged.clear()
        self._resync = None
        self._high = False
        await self._buffer.clear()

    # -- logging --------------------------------------------------------------

    def _fields(self) -> dict[str, Any]:
        return {
            "listener": self.name,
            "state": self.state.value,
            "attempt": self.attempts,
            "buffer": len(self._buffer) + len(self._staged),
            "capacity": self._buffer.capacity,
        }

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


class _Reports:
    """The listener's side of ``session.SessionHost``: what a session reports
    lands in the listener's state. A separate object, so that these calls are
    not part of ``Listener``'s public face."""

    __slots__ = ("_listener",)

    def __init__(self, listener: Listener) -> None:
        self._listener = listener

    def log_fields(self) -> dict[str, Any]:
        return self._listener._fields()

    def registered(self, ack: Ack, route: str) -> None:
        listener = self._listener
        listener.registrations += 1
        listener._route = route
        listener._lifecycle.to(S.REGISTERED)
        if ack.resumed:
            listener.resumes += 1

    def bootstrapping(self) -> None:
        self._listener._lifecycle.to(S.BOOTSTRAPPING)

    def bootstrapped(self, resync: Resynced) -> None:
        listener = self._listener
        listener.bootstraps += 1
        listener._bootstrapped_once = True
        listener._resync = resync

    def live(self) -> None:
        listener = self._listener
        listener._lifecycle.to(S.LIVE)
        now = listener._clock()
        listener._live_since = now
        listener._backoff.healthy(now)
        listener._ready.set()

    def frame_received(self) -> None:
        self._listener.frames_received += 1

    async def received(self, items: Sequence[ChangeItem]) -> None:
        listener = self._listener
        listener.items_received += len(items)
        buffer = listener._buffer
        if not await buffer.put(items):
            listener.overflows += 1
            held = len(buffer)
            log_event(
                log,
                "listener.overflow",
                logging.WARNING,
                **listener._fields(),
                incoming=len(items),
                overflows=listener.overflows,
            )
            raise BufferOverflow(buffer.capacity, held, len(items))
        listener._check_water()
        listener._ready.set()
