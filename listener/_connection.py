"""The listener's connection loop: one session per attempt, and what follows its end.

One background task runs the connection lifecycle (``_lifecycle`` is the
state machine; steps 1-4, one connection, are a ``_session.Session``, which
reports back through ``_reports.SessionReports``):

1. CONNECTING: open the websocket (optional bearer token on the handshake)
   and send the registration: RFD 5's v1 form for one change kind, the v2
   form (``resources``) for several; with ``since`` when there is a cursor to
   resume from, and ``batch: true``.
2. REGISTERED: the ack says whether the publisher resumed from ``since``
   (and, when it did not, why: the ack's ``reason``, logged and counted).
3. BOOTSTRAPPING (``resumed: false``): page every change kind's bootstrap
   route at once while every change item that arrives is buffered.
4. LIVE: items flow from the socket into the buffer and from the buffer to
   the application (``_handout``).
5. BACKING_OFF: any failure (a drop, a retryable close code, a missed pong,
   an ack that never came, a failed page walk, a full buffer) clears the
   buffer and waits a jittered, growing, capped delay (at least the
   publisher's ``retryAfter``) before step 1. A failure retrying cannot heal
   (bad_frame, unknown_resource, unauthorized, forbidden) stops the listener
   with ``RegistrationRefused`` instead.

With a checkpoint store, the task first loads the last checkpoint (the
controllers start from their saved mirrors) and registers with its cursor.

It must never retry without back-off, and never swallow a failure without
logging and counting it.
"""

from __future__ import annotations

import asyncio
import logging

from changefeed.logs import log_event
from changefeed.schemas import Registration

from ._errors import (
    BufferOverflow,
    ListenerError,
    PublisherClosed,
    RegistrationRefused,
    RetriesExhausted,
    SessionError,
)
from ._lifecycle import Disposition, disposition, retry_floor
from ._listener_state import ListenerState, S, log
from ._reports import SessionReports
from ._session import Session

__all__ = ["ConnectionLoop"]


class ConnectionLoop(ListenerState):
    """The listener's part that connects, registers and backs off."""

    async def _run(self) -> None:
        try:
            if self._checkpointer is not None:
                cursor = await self._checkpointer.restore(self.config.resume)
                self._cursor = self._handed = self._position = cursor
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
            log_event(log, "listener.crashed", logging.ERROR, exc=exc, **self._fields())
            self._stop_with(exc)

    def _connect(self) -> Session:
        """The next attempt's session (counted and logged here)."""
        assert self._http is not None
        since = self._cursor if self.config.resume else None
        self.attempts += 1
        log_event(log, "listener.connecting", **self._fields(), url=self.url, since=since)
        registration = Registration(
            self.instance,
            self.service,
            self.change_kinds,
            since=since,
            batch=self.config.batch,
            multi=self._multi,
        )
        return Session(
            SessionReports(self),
            url=self.url,
            api_url=self.api_url,
            registration=registration.encode(),
            kinds=self.change_kinds,
            multi=self._multi,
            resuming=since is not None,
            config=self.config,
            http=self._http,
            token=self._token,
            name=self.name,
            first_bootstrap=not self._bootstrapped_once,
        )

    async def _after_session(self, ending: SessionError) -> None:
        """Classify how a connection ended, then clear, count, log and back off."""
        self.aborts += 1
        self.last_error = f"{type(ending).__name__}: {ending}"
        self._live_since = None
        close_code = getattr(ending, "close_code", None)
        error_code = getattr(ending, "error_code", None)
        http_status = getattr(ending, "status", None)
        retry_after = getattr(ending, "retry_after", None)
        verdict = disposition(close_code, error_code, http_status)
        dropped = self._held()
        await self._clear()
        log_event(
            log,
            "listener.aborted",
            logging.WARNING,
            **self._fields(),
            reason=self.last_error,
            close_code=close_code,
            error_code=error_code,
            retry_after=retry_after,
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
        delay = self._backoff.failure(self._clock(), retry_floor(retry_after))
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
