"""The listener's connection lifecycle: an explicit state machine, and what to do after a failure.

::

         start
           |
           v
      +------------+  ack (resumed=false)  +---------------+  pages walked  +------+
      | CONNECTING |--------> REGISTERED -->| BOOTSTRAPPING |--------------->| LIVE |
      +------------+            |          +---------------+                +------+
           ^                    |  ack (resumed=true)                          ^  |
           |                    +----------------------------------------------+  |
           |                                                                      |
           |   delay over   +-------------+   any failure: drop, close, overflow,  |
           +----------------| BACKING_OFF |<-- ping timeout, refused page walk ----+
                            +-------------+   (from CONNECTING, REGISTERED,
                                               BOOTSTRAPPING or LIVE)

    any state --close() or a failure retrying cannot heal--> STOPPED

Pure code: no I/O, no clock, no event loop. The adapter (the listener: its
connection loop, ``_connection``, and what it hands on, ``_inbox``)
asks ``Lifecycle.to`` for each step and ``disposition`` what a failure means,
so policy lives here only. It must never allow a transition that is not in
``TRANSITIONS`` (the adapter's bugs surface as LifecycleError, not as a
listener in a state nobody planned).
"""

from __future__ import annotations

import enum
from collections.abc import Callable

from changefeed.backoff import MAX_RETRY_AFTER
from changefeed.backoff import retry_after_floor as retry_floor
from changefeed.schemas import CloseCode

from ._errors import LifecycleError

__all__ = [
    "FATAL_ERROR_CODES",
    "FATAL_HTTP_STATUSES",
    "FRESH_ERROR_CODES",
    "MAX_RETRY_AFTER",
    "TRANSITIONS",
    "ConnectionState",
    "Disposition",
    "Lifecycle",
    "disposition",
    "retry_floor",
]


class ConnectionState(enum.StrEnum):
    """Where one listener is in its connection lifecycle."""

    IDLE = "idle"
    """Created, not started."""
    CONNECTING = "connecting"
    """Opening the websocket and sending the registration."""
    REGISTERED = "registered"
    """The ack arrived; deciding between resume and bootstrap."""
    BOOTSTRAPPING = "bootstrapping"
    """Paging the bootstrap route while change items are buffered."""
    LIVE = "live"
    """Handing change items to the application as they arrive."""
    BACKING_OFF = "backing_off"
    """Waiting out a jittered delay before registering again."""
    STOPPED = "stopped"
    """Closed by the application, or refused for good: terminal."""


S = ConnectionState

TRANSITIONS: dict[ConnectionState, frozenset[ConnectionState]] = {
    S.IDLE: frozenset({S.CONNECTING, S.STOPPED}),
    S.CONNECTING: frozenset({S.REGISTERED, S.BACKING_OFF, S.STOPPED}),
    S.REGISTERED: frozenset({S.BOOTSTRAPPING, S.LIVE, S.BACKING_OFF, S.STOPPED}),
    S.BOOTSTRAPPING: frozenset({S.LIVE, S.BACKING_OFF, S.STOPPED}),
    S.LIVE: frozenset({S.BACKING_OFF, S.STOPPED}),
    S.BACKING_OFF: frozenset({S.CONNECTING, S.STOPPED}),
    S.STOPPED: frozenset(),
}
"""Every allowed transition; anything else raises LifecycleError."""


class Lifecycle:
    """The current state, checked transitions, and a bounded history.

    Args:
        on_change: called as ``on_change(old, new)`` after every transition
            (the adapter logs and counts there).
        history: how many past transitions to keep for ``history``.
    """

    def __init__(
        self,
        on_change: Callable[[ConnectionState, ConnectionState], None] | None = None,
        history: int = 64,
    ) -> None:
        self._state = ConnectionState.IDLE
        self._on_change = on_change
        self._limit = history
        self.history: list[tuple[ConnectionState, ConnectionState]] = []
        self.transitions = 0

    @property
    def state(self) -> ConnectionState:
        return self._state

    def can(self, new: ConnectionState) -> bool:
        """Whether moving to ``new`` is allowed from the current state."""
        return new in TRANSITIONS[self._state]

    def to(self, new: ConnectionState) -> None:
        """Move to ``new``.

        Raises:
            LifecycleError: the transition is not in TRANSITIONS.
        """
        old = self._state
        if new not in TRANSITIONS[old]:
            raise LifecycleError(f"no transition from {old.value} to {new.value}")
        self._state = new
        self.transitions += 1
        self.history.append((old, new))
        if len(self.history) > self._limit:
            del self.history[0]
        if self._on_change is not None:
            self._on_change(old, new)


class Disposition(enum.Enum):
    """What the listener does after a connection ends."""

    RETRY = "retry"
    """Back off and register again, resuming from the cursor when there is one."""
    RETRY_FRESH = "retry_fresh"
    """Back off and register again without the cursor (refused, or expired while the
    listener caught up): full bootstrap."""
    STOP = "stop"
    """Give up with RegistrationRefused: the same registration will be refused again."""


FATAL_ERROR_CODES = frozenset(
    {"bad_frame", "invalid_registration", "unknown_resource", "unauthorized", "forbidden"}
)
"""Error codes that retrying the same registration cannot heal (schemas/closecodes.py)."""

FRESH_ERROR_CODES = frozenset({"bad_cursor", "cursor_expired"})
"""Error codes after which the cursor is useless: register again without ``since``."""


_FATAL_CLOSE_CODES = frozenset(
    {CloseCode.BAD_FRAME, CloseCode.UNKNOWN_RESOURCE, CloseCode.UNAUTHORIZED, CloseCode.FORBIDDEN}
)
_FRESH_CLOSE_CODES = frozenset({CloseCode.BAD_CURSOR, CloseCode.CURSOR_EXPIRED})
FATAL_HTTP_STATUSES = frozenset({401, 403})
"""HTTP answers that retrying cannot heal: the token is unknown, or may not read the
resource (a refused handshake, a bootstrap page, a controller's fetch)."""


def disposition(
    close_code: int | None = None, error_code: str | None = None, http_status: int | None = None
) -> Disposition:
    """Decide what a connection's end means.

    ===================================================  ============
    how it ended                                         disposition
    ===================================================  ============
    bad_frame, invalid_registration, unknown_resource,   STOP
    unauthorized, forbidden (error or close code);
    HTTP 401/403 at the handshake
    bad_cursor (4005), cursor_expired (4011)             RETRY_FRESH
    anything else: unavailable (4010, keeps the cursor;  RETRY
    see ``retry_floor``), slow_listener, going away,
    a drop, a timeout, HTTP 5xx
    ===================================================  ============

    Args:
        close_code: the websocket close code received, if any.
        error_code: the code of the publisher's error frame, if one came first.
        http_status: the HTTP status of a refused handshake, if that is how it ended.
    """
    if error_code is not None:
        if error_code in FATAL_ERROR_CODES:
            return Disposition.STOP
        if error_code in FRESH_ERROR_CODES:
            return Disposition.RETRY_FRESH
        return Disposition.RETRY
    if close_code in _FATAL_CLOSE_CODES:
        return Disposition.STOP
    if close_code in _FRESH_CLOSE_CODES:
        return Disposition.RETRY_FRESH
    if http_status in FATAL_HTTP_STATUSES:
        return Disposition.STOP
    return Disposition.RETRY
