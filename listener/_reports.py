"""What a connection reports, landing in the listener's state.

A ``_session.Session`` owns nothing that outlives its connection: it reports
to its ``SessionHost``, and ``SessionReports`` is the listener's side of that:
the ack (the bootstrap routes; resumed, or why not, logged and counted), the
bootstrap's progress and its ``Resynced`` events, going live (from when the
back-off counts the healthy time that resets it), and each frame's change
items, put into the buffer. Items that do not fit are an overflow that ends
the session (the connection loop then clears and backs off): the socket is
read as fast as it delivers, never slower because the application is.

It must never wait for the application, nor hold anything of its own: every
report changes the listener's state, and only that.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from changefeed.bootstrap import PagerProgress
from changefeed.logs import log_event
from changefeed.schemas import RESUME_REASONS, Ack, ChangeItem

from ._errors import BufferOverflow
from ._events import BootstrapProgress, Resynced
from ._listener_state import ListenerState, S, log

__all__ = ["SessionReports"]


class SessionReports:
    """The listener's side of ``_session.SessionHost``: what a session reports
    lands in the listener's state. A separate object, so that these calls are
    not part of ``Listener``'s public face."""

    __slots__ = ("_listener",)

    def __init__(self, listener: ListenerState) -> None:
        self._listener = listener

    def log_fields(self) -> dict[str, Any]:
        return self._listener._fields()

    def registered(self, ack: Ack, routes: dict[str, str], resuming: bool) -> None:
        listener = self._listener
        listener.registrations += 1
        listener._routes = routes
        listener._registered.set()
        listener._lifecycle.to(S.REGISTERED)
        # A resume is an ack that resumed the ``since`` this registration sent; an ack
        # that says ``resumed`` to a registration without one resumed nothing (the
        # session bootstraps), so it is not counted.
        listener._resumed_now = ack.resumed and resuming
        if listener._resumed_now:
            listener.resumes += 1
        elif resuming:
            reason = ack.reason or "unknown"
            listener._not_resumed[reason] = listener._not_resumed.get(reason, 0) + 1
            log_event(
                log,
                "listener.not_resumed",
                logging.WARNING,
                **listener._fields(),
                reason=reason,
                explanation=RESUME_REASONS.get(reason, "the publisher gave no reason"),
                count=listener._not_resumed[reason],
            )

    def bootstrapping(self) -> None:
        listener = self._listener
        listener._lifecycle.to(S.BOOTSTRAPPING)
        listener._progress = {
            resource: BootstrapProgress(resource, route)
            for resource, route in listener._routes.items()
        }

    def bootstrap_progress(
        self, resource: str, route: str, progress: PagerProgress, done: bool
    ) -> None:
        self._listener._progress[resource] = BootstrapProgress(
            resource, route, progress.pages, progress.items, progress.elapsed, progress.rate, done
        )

    def bootstrapped(self, resyncs: list[Resynced]) -> None:
        listener = self._listener
        listener.bootstraps += 1
        listener._bootstrapped_once = True
        listener._resyncs.extend(resyncs)

    def live(self) -> None:
        listener = self._listener
        listener._lifecycle.to(S.LIVE)
        now = listener._clock()
        listener._live_since = now
        listener._backoff.healthy(now)
        listener._ready.set()
        if listener._resumed_now:
            for sink in listener._controllers():
                sink.resumed()

    def frame_received(self) -> None:
        self._listener.frames_received += 1

    async def received(self, items: Sequence[ChangeItem]) -> None:
        listener = self._listener
        listener.items_received += len(items)
        buffer = listener._buffer
        held = listener._held()
        if held + len(items) > buffer.capacity or not await buffer.put(items):
            listener.overflows += 1
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
