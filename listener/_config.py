"""Listener settings: one typed, documented, validated value object.

Every number the listener uses is here, with the client-go / RFD 5 default,
so that an embedding service can tune it and a test can make it small.
Pure code; it must never accept a value the listener cannot work with
(each one is checked when the object is made).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from changefeed.backoff import finite_number

from ._backoff import BackoffPolicy
from ._checks import check_count, check_flag, check_seconds
from ._errors import ListenerConfigError
from ._inbox import BUFFER_KINDS

__all__ = ["ListenerConfig"]


@dataclass(frozen=True, slots=True)
class ListenerConfig:
    """How a listener buffers, backs off, resumes, bootstraps and checks liveness.

    Args:
        buffer_kind: the buffer kind (``"memory"``, or one added with
            ``register_buffer_kind``).
        buffer_size: items the buffer holds; one more and the listener aborts,
            clears it and registers again with back-off.
        backoff: the re-registration schedule (client-go: 0.8 s doubling to
            30 s, full jitter, reset after 120 healthy seconds).
        resume: reconnect with ``since`` = the cursor of the last event handed
            to the application, so that the publisher replays what was missed
            instead of a full bootstrap.
        resync_on_overflow: after an overflow register *without* ``since``:
            the backlog that overflowed the buffer once would only be replayed
            into it again, while a bootstrap costs one page walk (RFD 5).
        batch: ask the publisher for JSON arrays of items (fewer frames).
        page_limit: items per bootstrap page asked for (the route may clamp it).
            Each request costs a few milliseconds of fixed work at both ends,
            so pages of thousands walk several times faster than pages of 100.
        page_attempts: failed attempts per bootstrap page before the walk fails
            (the listener then backs off and registers again).
        ping_interval: seconds between websocket pings (None: no pings).
        ping_timeout: seconds a ping may go unanswered before the connection
            is declared dead (None: wait forever).
        open_timeout: seconds for TCP connect plus the websocket handshake.
        ack_timeout: seconds between sending the registration and the ack.
        close_timeout: seconds to wait for the close handshake before dropping
            the TCP connection.
        max_frame_bytes: largest frame accepted from the publisher.
        max_attempts: give up with RetriesExhausted after this many failed
            attempts in a row (None: never give up).
        http_timeout: seconds per HTTP request of the client the listener
            creates itself (an injected client keeps its own).
        high_water: buffer fill (fraction of ``buffer_size``) at which a
            ``listener.buffer.high`` event is logged.
        checkpoint_interval: seconds between checkpoints, with a checkpoint
            store (one is also saved on a clean stop). A restart replays at
            most about this long of changes.
        checkpoint_replay: seconds, after resuming from a checkpoint, during
            which every id a change item names is called back even if its state
            is what the checkpoint saved (``old == new``): the process that
            stopped may have told the application of a state in between (a
            change and its undoing) after its last checkpoint. Keep it above
            the time the replay of the changes since a checkpoint takes.
        checkpoint_load_timeout: seconds the checkpoint store's ``load`` may take
            before the listener gives up on it (a ``CheckpointError`` naming the
            store, logged) and bootstraps: a store that hangs must not keep the
            listener from starting. Keep it above what loading the largest
            checkpoint takes (about half a second per million resources from SQLite).
        controller_start_timeout: seconds a listener with controllers attached
            waits, once one of them runs (or it was started directly), for the
            others to run too (it starts only then, so that none misses the
            bootstrap). Past it, the listener and the controllers that run
            stop with a ``ListenerConfigError`` naming the ones that did not: a
            controller made and never run (nor closed) is a mistake to report,
            not a reason to wait for good. With nothing running, the same time
            after the last controller was made, an ERROR line names them.

    Every count is a whole number of at least 1, every number of seconds a
    finite number above 0, every flag a bool.

    Raises:
        ListenerConfigError: a value is of another type or out of range, or the
            buffer kind is unknown.
    """

    buffer_kind: str = "memory"
    buffer_size: int = 10_000
    backoff: BackoffPolicy = field(default_factory=BackoffPolicy)
    resume: bool = True
    resync_on_overflow: bool = True
    batch: bool = True
    page_limit: int = 5000
    page_attempts: int = 8
    ping_interval: float | None = 20.0
    ping_timeout: float | None = 20.0
    open_timeout: float = 10.0
    ack_timeout: float = 10.0
    close_timeout: float = 2.0
    max_frame_bytes: int = 2**22
    max_attempts: int | None = None
    http_timeout: float = 10.0
    high_water: float = 0.8
    checkpoint_interval: float = 10.0
    checkpoint_replay: float = 60.0
    checkpoint_load_timeout: float = 300.0
    controller_start_timeout: float = 10.0

    def __post_init__(self) -> None:
        if not (isinstance(self.buffer_kind, str) and self.buffer_kind in BUFFER_KINDS):
            known = ", ".join(sorted(BUFFER_KINDS))
            raise ListenerConfigError(
                "buffer_kind", f"unknown kind {self.buffer_kind!r} (known: {known})"
            )
        if not isinstance(self.backoff, BackoffPolicy):
            raise ListenerConfigError("backoff", f"must be a BackoffPolicy, got {self.backoff!r}")
        for key in ("resume", "resync_on_overflow", "batch"):
            check_flag(key, getattr(self, key))
        for key in ("buffer_size", "page_limit", "page_attempts", "max_frame_bytes"):
            check_count(key, getattr(self, key))
        check_count("max_attempts", self.max_attempts, optional=True)
        for key in ("ping_interval", "ping_timeout"):
            check_seconds(key, getattr(self, key), optional=True)
        for key in (
            "open_timeout",
            "ack_timeout",
            "close_timeout",
            "http_timeout",
            "checkpoint_interval",
            "checkpoint_replay",
            "checkpoint_load_timeout",
            "controller_start_timeout",
        ):
            check_seconds(key, getattr(self, key))
        if not (finite_number(self.high_water) and 0 < self.high_water <= 1):
            raise ListenerConfigError("high_water", f"must be in (0, 1], got {self.high_water!r}")
