"""Exceptions of the listener package.

Exception tree::

    ListenerError               root of everything changefeed.listener raises
    ├── RegistrationRefused     the publisher refused the registration for good
    │                           (bad_frame, invalid_registration, unknown_resource,
    │                           unauthorized, forbidden; or HTTP 401/403 at the handshake)
    ├── RetriesExhausted        ``max_attempts`` connection attempts failed in a row
    ├── ListenerConfigError     a setting is out of range (also a ValueError)
    ├── CheckpointError         a checkpoint store cannot use what it holds, or refuses a
    │   │                       save that does not go on top of it
    │   └── CheckpointRefused   the store is not this listener's to use: another listener
    │                           holds it, or its file holds what it must not move
    ├── LifecycleError          an impossible state transition was requested (a bug)
    └── SessionError            one connection ended; the listener re-registers with back-off
        ├── BufferOverflow      the buffer could not hold what arrived (RFD 5: abort, clear,
        │                       retry with exponential back-off)
        ├── PublisherClosed     the publisher closed the socket or refused the handshake
        │                       (close code, error frame, HTTP status), or the connection
        │                       dropped, or a ping went unanswered
        ├── BootstrapFailed     the bootstrap walk gave up (its pager's retries ran out)
        └── BadPublisherFrame   the publisher sent something that breaks the wire contract

``SessionError`` and its subclasses are the retryable ones: the listener
handles them itself (they show up in ``status().last_error`` and in the log);
an application only ever sees ``RegistrationRefused``, ``RetriesExhausted``,
``CheckpointRefused`` (at start: the listener stops with it) and, on a bug,
``LifecycleError``. Any other ``CheckpointError`` is raised by stores; the
listener logs it (a checkpoint is a saving, never a requirement), and an
application's own store may raise it too. Failures of the network, of the websocket
and of the HTTP API are mapped into this tree at the boundary; nothing from
websockets or httpx crosses the public API (the ``wait_*`` helpers raise
``TimeoutError``, iteration ends with ``StopAsyncIteration``).
"""

from __future__ import annotations

__all__ = [
    "BadPublisherFrame",
    "BootstrapFailed",
    "BufferOverflow",
    "CheckpointError",
    "CheckpointRefused",
    "LifecycleError",
    "ListenerConfigError",
    "ListenerError",
    "PublisherClosed",
    "RegistrationRefused",
    "RetriesExhausted",
    "SessionError",
]


class ListenerError(Exception):
    """Root of the listener package's exceptions."""


class RegistrationRefused(ListenerError):
    """The publisher refused the registration in a way retrying cannot heal.

    Args:
        code: the error code of the publisher's error frame (``unknown_resource``),
            or ``http_<status>`` for a refused handshake.
        message: the publisher's explanation.
        close_code: the websocket close code, when there was one.
    """

    def __init__(self, code: str, message: str, close_code: int | None = None) -> None:
        super().__init__(f"registration refused ({code}): {message}")
        self.code = code
        self.message = message
        self.close_code = close_code


class RetriesExhausted(ListenerError):
    """The configured number of connection attempts failed in a row.

    Args:
        attempts: how many attempts were made.
        last_error: the last failure, as text.
    """

    def __init__(self, attempts: int, last_error: str | None) -> None:
        super().__init__(f"gave up after {attempts} connection attempts; last error: {last_error}")
        self.attempts = attempts
        self.last_error = last_error


class ListenerConfigError(ListenerError, ValueError):
    """A listener, buffer, back-off or controller setting is out of range.

    Args:
        key: the setting, e.g. ``backoff.initial``.
        message: what is wrong with it.
    """

    def __init__(self, key: str, message: str) -> None:
        super().__init__(f"{key}: {message}")
        self.key = key


class CheckpointError(ListenerError):
    """A checkpoint store cannot use what it holds (an older layout version; a store
    of the application's own, a row that does not decode), or refuses an incremental
    save that does not go on top of it."""


class CheckpointRefused(CheckpointError):
    """The store is not this listener's to use: another listener holds it (a second
    writer on the same file and name), or its file holds what the store must not move.
    Raised by the store when the listener loads at start; the listener stops with it,
    since every save would fail or overwrite another's."""


class LifecycleError(ListenerError):
    """A state transition the connection lifecycle does not allow (a bug, not a condition)."""


class SessionError(ListenerError):
    """One connection ended; the listener backs off and registers again."""


class BufferOverflow(SessionError):
    """More items arrived than the buffer holds.

    Args:
        capacity: the buffer's capacity.
        size: items it held when the frame arrived.
        incoming: items in the frame that did not fit.
    """

    def __init__(self, capacity: int, size: int, incoming: int) -> None:
        super().__init__(
            f"buffer overflow: {size} of {capacity} items held, {incoming} more arrived"
        )
        self.capacity = capacity
        self.size = size
        self.incoming = incoming


class PublisherClosed(SessionError):
    """The connection ended: closed or refused by the publisher, or dropped.

    Args:
        message: what happened.
        close_code: the websocket close code, when one was received.
        error_code: the code of the error frame sent before the close, if any.
        status: the HTTP status of a refused websocket handshake, if that is how it ended.
        retry_after: the error frame's ``retryAfter``: seconds before trying again
            may succeed (with ``unavailable``).
        explanation: the error frame's own message, when there was one.
    """

    def __init__(
        self,
        message: str,
        close_code: int | None = None,
        error_code: str | None = None,
        *,
        status: int | None = None,
        retry_after: float | None = None,
        explanation: str | None = None,
    ) -> None:
        super().__init__(message)
        self.close_code = close_code
        self.error_code = error_code
        self.status = status
        self.retry_after = retry_after
        self.explanation = explanation


class BootstrapFailed(SessionError):
    """The bootstrap walk failed for good; the listener backs off and registers again
    (or stops, when the route answered 401 or 403).

    Args:
        message: what failed.
        status: the last HTTP status of the walk, if any.
        retry_after: the route's last ``Retry-After`` (a 503), seconds: the least
            wait before registering again.
    """

    def __init__(
        self, message: str, status: int | None = None, *, retry_after: float | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.retry_after = retry_after


class BadPublisherFrame(SessionError):
    """The publisher sent a frame that does not follow the wire contract."""
