"""What a listener keeps: its buffer and what was taken from it, its cursors, its counters.

``Listener`` is assembled from parts that all work on this one state, each
in its own module: the connection loop and its back-off (``_connection``),
what a connection reports (``_reports``) and the hand-out to the application
(``_handout``). The state is declared here once, with the accounting that
every part goes through:

* Items are *held* from the moment they are read off the socket until they
  are handed out: in the buffer, staged for ``async for``, or in the
  dispatch task's hand. All three count against the buffer's capacity
  (``_held``), and the high-water warning is logged from that figure.
* Three cursors: ``_cursor``, what a reconnect resumes from (that of the last
  event handed out, or of a bootstrap's last ``Resynced`` once that is out;
  None once a failure calls for a fresh bootstrap);
  ``_handed``, that of the last event handed out; and ``_position``, that of
  the last one the application is done with (what a checkpoint saves).
* ``_clear`` drops everything held when a connection ends, and starts a new
  ``_generation``: a hand-out that was waiting meanwhile drops what it took.
* ``_stop_with`` records the failure that stopped the listener for good.

What the application gave the listener (its settings, HTTP client, buffer
and cursor) is set by ``Listener.__init__``; the rest starts here. It must
never talk to the publisher or the application itself: the parts do.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Callable
from typing import Any

import httpx

from changefeed.logs import log_event
from changefeed.schemas import ChangeItem, ChangeKind

from ._backoff import Backoff
from ._buffer import Buffer
from ._checkpointer import Checkpointer
from ._config import ListenerConfig
from ._events import BootstrapProgress, Resynced
from ._lifecycle import ConnectionState, Lifecycle
from ._log import log
from ._sink import Sink

__all__ = ["ListenerState", "S", "log"]

S = ConnectionState
_LOW_WATER = 0.5  # the high-water event re-arms once the buffer drains below this


class ListenerState:
    """The state every part of a listener shares (see the module docstring)."""

    # Set by Listener.__init__, from what the application gave it.
    config: ListenerConfig
    url: str
    api_url: str
    instance: str
    service: str
    change_kinds: tuple[ChangeKind, ...]
    resources: tuple[str, ...]
    name: str
    _multi: bool  # several change kinds: the v2 registration
    _token: str | None
    _http: httpx.AsyncClient | None
    _buffer: Buffer
    _backoff: Backoff
    _lifecycle: Lifecycle
    _clock: Callable[[], float]
    _cursor: str | None  # the cursor a reconnect resumes from
    _handed: str | None  # the cursor of the last event handed out
    _position: str | None  # ... and of the last one the application is done with

    def __init__(self) -> None:
        self._checkpointer: Checkpointer | None = None
        self._registered = asyncio.Event()  # the first ack named the routes
        self._resumed_now = False  # the current connection resumed its cursor
        self._routes: dict[str, str] = {}
        self._progress: dict[str, BootstrapProgress] = {}
        self._not_resumed: dict[str, int] = {}
        self._task: asyncio.Task[None] | None = None
        self._ready = asyncio.Event()
        self._resyncs: deque[Resynced] = deque()
        self._staged: deque[ChangeItem] = deque()
        self._staged_total = 0  # items ever staged for ``async for``
        self._in_hand = 0  # items the dispatch task took and has not handed over yet
        self._dispatched = 0  # items the dispatch task handed to controllers
        self._sinks: dict[str, list[Sink]] = {}
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
        self.frames_received = 0
        self.last_error: str | None = None
        self._peak = 0

    def _held(self) -> int:
        """Items received and not handed out: buffered, staged or in the dispatcher's hand."""
        return len(self._buffer) + len(self._staged) + self._in_hand

    def _controllers(self) -> list[Sink]:
        """The attached controllers, in the order they attached."""
        return [sink for sinks in self._sinks.values() for sink in sinks]

    def _check_water(self) -> None:
        held = self._held()
        self._peak = max(self._peak, held)
        capacity = self._buffer.capacity
        if not self._high and held >= capacity * self.config.high_water:
            self._high = True
            log_event(log, "listener.buffer.high", logging.WARNING, **self._fields())
        elif self._high and held < capacity * _LOW_WATER:
            self._high = False
            log_event(log, "listener.buffer.normal", **self._fields())

    def _stop_with(self, exc: BaseException) -> None:
        self._fatal = exc
        self.last_error = str(exc)
        if self._lifecycle.can(S.STOPPED):
            self._lifecycle.to(S.STOPPED)
        self._ready.set()

    async def _clear(self) -> None:
        self._generation += 1
        self._staged_total -= len(self._staged)
        self._staged.clear()
        self._resyncs.clear()
        self._high = False
        await self._buffer.clear()

    def _fields(self) -> dict[str, Any]:
        return {
            "listener": self.name,
            "state": self._lifecycle.state.value,
            "attempt": self.attempts,
            "buffer": self._held(),
            "capacity": self._buffer.capacity,
        }
