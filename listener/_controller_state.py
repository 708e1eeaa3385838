"""What a controller keeps: its mirror, its work queue, and where each id stands.

``Controller`` is assembled from parts that all work on this one state, each
in its own module: events come in through ``_controller_sink``, bootstraps
and resyncs are applied by ``_resync``, the workers fetch and call back in
``_reconcile``, and ``_controller_checkpoint`` saves and restores the mirror.
The state is declared here once, with what each piece of bookkeeping means,
so that every part reads it the same way:

* an id in ``_stale`` must be fetched before its next callback; one in
  ``_fetching`` is being fetched (a checkpoint counts both as pending);
* ``_seen`` holds, for an id the mirror has moved past, the state the
  application last saw: its next callback's ``old``;
* ``_attempted``, ``_resyncing`` and ``_forced`` say why an id is called back
  although the mirror did not change.

What the application gave the controller (callbacks, ``decode``, ``fetch``,
the settings) is set by ``Controller.__init__``; the rest starts here.

It must never await or do I/O (logging aside): the parts change this state
in steps that do not wait, which is what lets a checkpoint take every mirror
with the cursor in one synchronous step.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any, Generic

from typing_extensions import TypeVar

from changefeed.logs import log_event

from ._backoff import ItemBackoff
from ._handlers import (
    AddHandler,
    DeleteHandler,
    EventSource,
    Fetcher,
    ReconcileHandler,
    UpdateHandler,
)
from ._listener import Listener
from ._mirror import Mirror
from ._workqueue import WorkQueue

__all__ = ["UNDECODABLE", "ControllerState", "T", "Undecodable", "log"]

# The controller's logger: its events keep one logger name, whichever part logs them.
log = logging.getLogger("changefeed.listener.controller")

T = TypeVar("T", default=Any)


class Undecodable:
    """What ``decode`` refused."""


UNDECODABLE = Undecodable()


class ControllerState(Generic[T]):
    """The state every part of a controller shares (see the module docstring)."""

    # Set by Controller.__init__, from what the application gave it.
    listener: Listener | EventSource
    resource: str | None
    name: str
    concurrency: int
    fetch_batch: int
    fetch_attempts: int
    max_pending: int
    resync_period: float | None
    _reconcile: ReconcileHandler[T] | None
    _on_add: AddHandler[T] | None
    _on_update: UpdateHandler[T] | None
    _on_delete: DeleteHandler[T] | None
    _decode: Callable[[Any], T] | None
    _encode: Callable[[T], Any] | None
    _fetch: Fetcher
    _key: Callable[[Any], str]
    _id_field: str
    _retry: ItemBackoff

    def __init__(self) -> None:
        self._mirror: Mirror[T] = Mirror()
        self.queue: WorkQueue[str] = WorkQueue()
        self._stale: set[str] = set()
        self._seen: dict[str, T | None] = {}  # id -> state the application last saw
        # id -> the new state of a callback that raised: the application may hold
        # part of it, even if the mirror goes back to what it last saw.
        self._attempted: dict[str, Any] = {}
        self._resyncing: set[str] = set()  # ids a periodic resync hands out again
        # Ids called back even when unchanged, after a restore: the process that saved
        # the checkpoint may have told the application of a state in between.
        self._forced: set[str] = set()
        self._replay_until: float | None = None  # items until then add to ``_forced``
        self._restored = False
        self._fetching: set[str] = set()  # ids whose fetch is under way
        # Ids whose state as the application saw it may have changed since the last
        # checkpoint (None: no checkpoint is kept, nothing is tracked).
        self._touched: set[str] | None = None
        self._route: str | None = None
        self._synced = asyncio.Event()
        self._resynced_once = False
        # The ids the first bootstrap (or resume) left to process; synced once each
        # of them has been processed once (None: not in sync yet, nothing tracked).
        self._unsynced: set[str] | None = None
        self._unsynced_busy: set[str] = set()  # ... of which a worker held a stale fetch
        # Ids a worker still holds (the rest of its batch is under way) that it has
        # already processed through: no stale completion of theirs is still to come.
        self._through: set[str] = set()
        self._room = asyncio.Event()
        self._ended = asyncio.Event()
        self.items = 0
        self.fetches = 0
        self.fetch_requests = 0
        self.fetch_errors = 0
        self.decode_errors = 0
        self.reconciles = 0
        self.reconcile_errors = 0
        self.resyncs = 0
        self.periodic_resyncs = 0

    def _start_sync(self, busy: frozenset[str] = frozenset()) -> None:
        """The first bootstrap (or resume) is in: synced once every id queued now has
        been processed once. A snapshot, so that a steady stream of new changes does
        not keep the controller from ever being synced. ``busy``: ids a worker holds
        with a fetch that started before, queued again; their next completion is
        that stale one and does not count."""
        if self._resynced_once:
            return
        self._resynced_once = True
        # An id a worker holds but is already through with (the rest of its batch is
        # under way) has nothing to come unless it is queued again.
        through = self._through
        self._unsynced = self.queue.queued() | (self.queue.processing - through)
        self._unsynced_busy = set(busy) - through
        if not self._unsynced:
            self._set_synced()

    def _settled(self, key: str) -> None:
        """``key`` was processed through (fetched if stale, called back if due)."""
        unsynced = self._unsynced
        if unsynced and key in unsynced:
            if key in self._unsynced_busy:
                self._unsynced_busy.discard(key)
                return
            unsynced.discard(key)
            if not unsynced:
                self._set_synced()

    def _set_synced(self) -> None:
        self._unsynced = None
        self._synced.set()
        log_event(log, "controller.synced", controller=self.name, items=len(self._mirror))

    def _decoded(self, key: str, obj: Any) -> T | Undecodable:
        """``obj`` as the application's type, or ``UNDECODABLE`` when ``decode`` refuses it."""
        if self._decode is None:
            decoded: T = obj  # no decoder: T is the JSON itself
            return decoded
        try:
            return self._decode(obj)
        except Exception as exc:
            self.decode_errors += 1
            log_event(
                log,
                "controller.decode_failed",
                logging.WARNING,
                exc=exc,
                controller=self.name,
                id=key,
            )
            return UNDECODABLE
