"""The listener's connection loop: one session per attempt, and what follows its end.

One background task runs the connection lifecycle (``_lifecycle`` is the
state machine; steps 1-4, one connection, are a ``_session.Session``, which
reports to this loop as its ``SessionHost``):

1. CONNECTING: open the websocket (optional bearer token on the handshake)
   and send the registration: RFD 5's v1 form for one change kind, the v2
   form (``resources``) for several; with ``since`` when there is a cursor to
   resume from, and ``batch: true``.
2. REGISTERED: the ack says whether the publisher resumed from ``since``
   (and, when it did not, why: the ack's ``reason``, logged and counted).
3. BOOTSTRAPPING (``resumed: false``): page every change kind's bootstrap
   route at once while every change item that arrives is buffered.
4. LIVE: frames go into the inbox, and from there to the application.
5. BACKING_OFF: any failure (a drop, a retryable close code, a missed pong,
   an ack that never came, a failed page walk, a full buffer) clears the
   inbox and waits a jittered, growing, capped delay (at least the
   publisher's ``retryAfter``) before step 1. A failure retrying cannot heal
   (bad_frame, unknown_resource, unauthorized, forbidden) stops the listener
   with ``RegistrationRefused`` instead.

The loop owns the connection's state: the lifecycle, the back-off, the
routes the last ack named and the bootstrap's progress; it counts attempts,
registrations, resumes, bootstraps and aborts in the listener's
``ListenerCounts``. The items belong to the inbox, and so does the cursor. It
must never retry without back-off, and never swallow a failure without
logging and counting it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

import httpx

from changefeed.bootstrap import PagerProgress
from changefeed.logs import log_event
from changefeed.schemas import RESUME_REASONS, Ack, ChangeKind, Registration

from ._backoff import RegistrationBackoff
from ._config import ListenerConfig
from ._errors import (
    BufferOverflow,
    PublisherClosed,
    RegistrationRefused,
    RetriesExhausted,
    SessionError,
)
from ._events import BootstrapProgress, ListenerCounts, Resynced
from ._inbox import Inbox
from ._lifecycle import ConnectionState, Disposition, Lifecycle, disposition
from ._log import log
from ._session import Session

__all__ = ["ConnectionLoop"]

S = ConnectionState


class ConnectionLoop:
    """Connects, registers, bootstraps and backs off, one session at a time.

    Args:
        inbox: where each session's frames and bootstraps go.
        url: the publisher's websocket endpoint.
        api_url: what the ack's bootstrap routes are resolved against.
        instance: the registration's instance.
        service: the registration's service.
        change_kinds: what is registered (several: the v2 registration).
        config: the listener's settings.
        token: bearer token for the handshake.
        backoff: the re-registration schedule.
        name: the listener's name (logs, task names).
        on_resumed: called when a connection resumed the cursor (no bootstrap).
        counts: the listener's counts, whose connection counts this loop keeps.
    """

    def __init__(
        self,
        inbox: Inbox,
        *,
        url: str,
        api_url: str,
        instance: str,
        service: str,
        change_kinds: tuple[ChangeKind, ...],
        config: ListenerConfig,
        token: str | None,
        backoff: RegistrationBackoff,
        name: str,
        on_resumed: Callable[[], None],
        counts: ListenerCounts,
    ) -> None:
        self._inbox = inbox
        self._url = url
        self._api_url = api_url
        self._instance = instance
        self._service = service
        self._kinds = change_kinds
        self._multi = len(change_kinds) > 1
        self._config = config
        self._token = token
        self.backoff = backoff
        self._name = name
        self._on_resumed = on_resumed
        self.lifecycle = Lifecycle(self._on_transition)
        self._clock: Callable[[], float] = time.monotonic
        self.routes: dict[str, str] = {}
        """Each resource's bootstrap route (absolute URL), as the last ack named it."""
        self.progress: dict[str, BootstrapProgress] = {}
        """Each route's bootstrap walk: the one under way, or the last one."""
        self._registered = asyncio.Event()
        self._resumed_now = False
        self._bootstrapped_once = False
        self.live_since: float | None = None
        self.counts = counts
        self.last_error: str | None = None

    @property
    def state(self) -> ConnectionState:
        return self.lifecycle.state

    def fields(self) -> dict[str, Any]:
        """The fields of every log event of the listener."""
        return {
            "listener": self._name,
            "state": self.lifecycle.state.value,
            "attempt": self.counts.attempts,
            "buffer": self._inbox.held(),
            "capacity": self._inbox.buffer.capacity,
        }

    async def registered(self) -> None:
        """Return once an ack named the routes (the first registration)."""
        await self._registered.wait()

    def stop(self, error: BaseException | None = None) -> None:
        """Move to STOPPED: closed, or stopped for good with ``error``."""
        if error is not None:
            self.last_error = str(error)
        if self.lifecycle.can(S.STOPPED):
            self.lifecycle.to(S.STOPPED)

    # -- the loop ---------------------------------------------------------------------

    async def run(self, http: httpx.AsyncClient) -> None:
        """Run sessions until a failure retrying cannot heal.

        Raises:
            RegistrationRefused: the publisher refused the registration for good.
            RetriesExhausted: ``max_attempts`` attempts failed in a row.
        """
        while True:
            self.lifecycle.to(S.CONNECTING)
            try:
                await self._session(http).run()
            except SessionError as exc:
                ending = exc
            else:  # pragma: no cover - a session only ends by raising
                ending = PublisherClosed("session ended")
            await self._after_session(ending)

    def _session(self, http: httpx.AsyncClient) -> Session:
        """The next attempt's session (counted and logged here)."""
        since = self._inbox.resume if self._config.resume else None
        self.counts.attempts += 1
        log_event(log, "listener.connecting", **self.fields(), url=self._url, since=since)
        registration = Registration(
            self._instance,
            self._service,
            self._kinds,
            since=since,
            batch=self._config.batch,
            multi=self._multi,
        )
        return Session(
            self,
            self._inbox,
            url=self._url,
            api_url=self._api_url,
            registration=registration.encode(),
            kinds=self._kinds,
            multi=self._multi,
            resuming=since is not None,
            config=self._config,
            http=http,
            token=self._token,
            name=self._name,
            first_bootstrap=not self._bootstrapped_once,
            rng=self.backoff.rng,
        )

    async def _after_session(self, ending: SessionError) -> None:
        """Classify how a connection ended, then clear, count, log and back off."""
        self.counts.aborts += 1
        self.last_error = f"{type(ending).__name__}: {ending}"
        self.live_since = None
        close_code = getattr(ending, "close_code", None)
        error_code = getattr(ending, "error_code", None)
        http_status = getattr(ending, "status", None)
        retry_after = getattr(ending, "retry_after", None)
        verdict = disposition(close_code, error_code, http_status)
        dropped = await self._inbox.clear()
        log_event(
            log,
            "listener.aborted",
            logging.WARNING,
            **self.fields(),
            reason=self.last_error,
            close_code=close_code,
            error_code=error_code,
            retry_after=retry_after,
            cleared=dropped,
            disposition=verdict.value,
        )
        if verdict is Disposition.STOP:
            code = error_code or (f"http_{http_status}" if http_status else f"close_{close_code}")
            # The publisher's own words: the code is already in the refusal's text.
            explanation = getattr(ending, "explanation", None) or str(ending)
            raise RegistrationRefused(code, explanation, close_code)
        if verdict is Disposition.RETRY_FRESH or (
            isinstance(ending, BufferOverflow) and self._config.resync_on_overflow
        ):
            self._inbox.forget()
        backoff = self.backoff
        was_reset = backoff.resets
        delay = backoff.failure(self._clock(), retry_after)
        limit = self._config.max_attempts
        if limit is not None and backoff.failures >= limit:
            raise RetriesExhausted(backoff.failures, self.last_error)
        self.lifecycle.to(S.BACKING_OFF)
        log_event(
            log,
            "listener.backoff",
            logging.WARNING,
            **self.fields(),
            delay=round(delay, 4),
            ceiling=round(backoff.ceiling, 4),
            failures=backoff.failures,
            reset=backoff.resets > was_reset,
            resume=self._inbox.resume is not None and self._config.resume,
        )
        await asyncio.sleep(delay)

    def _on_transition(self, old: ConnectionState, new: ConnectionState) -> None:
        log_event(
            log,
            "listener.state",
            logging.DEBUG,
            listener=self._name,
            old=old.value,
            new=new.value,
            attempt=self.counts.attempts,
        )
        if new is S.LIVE:
            # Where a reconnect would resume: null until the application has taken
            # what a bootstrap gave it (a reconnect meanwhile bootstraps again).
            log_event(log, "listener.live", **self.fields(), resumes_from=self._inbox.resume)

    # -- what a session reports (SessionHost) -------------------------------------------

    def log_fields(self) -> dict[str, Any]:
        return self.fields()

    def registered_ack(self, ack: Ack, routes: dict[str, str], resuming: bool) -> None:
        self.counts.registrations += 1
        self.routes = routes
        self._registered.set()
        self.lifecycle.to(S.REGISTERED)
        # A resume is an ack that resumed the ``since`` this registration sent; an ack
        # that says ``resumed`` to a registration without one resumed nothing (the
        # session bootstraps), so it is not counted.
        self._resumed_now = ack.resumed and resuming
        if self._resumed_now:
            self.counts.resumes += 1
        elif resuming:
            reason = ack.reason or "unknown"
            self.counts.not_resumed[reason] = self.counts.not_resumed.get(reason, 0) + 1
            log_event(
                log,
                "listener.not_resumed",
                logging.WARNING,
                **self.fields(),
                reason=reason,
                explanation=RESUME_REASONS.get(reason, "the publisher gave no reason"),
                count=self.counts.not_resumed[reason],
            )

    def bootstrapping(self) -> None:
        self.lifecycle.to(S.BOOTSTRAPPING)
        self.progress = {
            resource: BootstrapProgress(resource, route) for resource, route in self.routes.items()
        }

    def bootstrap_progress(
        self, resource: str, route: str, progress: PagerProgress, done: bool
    ) -> None:
        self.progress[resource] = BootstrapProgress(
            resource, route, progress.pages, progress.items, progress.elapsed, progress.rate, done
        )

    def bootstrapped(self, resyncs: list[Resynced]) -> None:
        self.counts.bootstraps += 1
        self._bootstrapped_once = True
        self._inbox.bootstrapped(resyncs)

    def live(self) -> None:
        self.lifecycle.to(S.LIVE)
        now = self._clock()
        self.live_since = now
        self.backoff.healthy(now)
        self._inbox.live()
        if self._resumed_now:
            self._on_resumed()
