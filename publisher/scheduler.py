"""When live items go out: the flush rounds of the fan-out, on an injected clock.

Live deliveries are not written one by one as items arrive. After a dispatch,
the deliveries it touched wait for the next *flush*, which gives each of them
one turn (``Delivery.send_now``: a direct write, no task switch) and wakes a
connection's sender task only for what that turn left. The flush runs in
slices of at most ``slice_seconds``; between two slices the event loop runs,
so a doorbell, or the tailer's next read, need not wait for the last listener
of a large flush. The next slice goes to the back of the loop's queue
``slice_yields`` times before it runs: each step of the tailer's way from a
doorbell to a read is a callback that would otherwise wait a slice
(docs/fanout.md). Senders are woken only when the whole round is done, so
every listener has its turn before any of them takes a second.

The next flush may start once three times this one's cost has passed since it
started, and at most ``send_interval`` after it: with few listeners a change
goes out at once; with many, whatever was read meanwhile goes out together
(one batch frame per listener) and flushing takes at most a third of the
process's time. A flush that woke sender tasks cannot see what their sends
will cost, so the next one waits ``send_interval``.

The clock is injected (``Clock``; ``LoopClock`` in the publisher), so the
scheduling is tested without sockets or a running loop's real time.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable
from typing import Any, Protocol

from changefeed.logs import log_event

from .delivery import Delivery

__all__ = ["Clock", "FlushScheduler", "LoopClock"]

log = logging.getLogger(__name__)


class Handle(Protocol):
    def cancel(self) -> None: ...


class Clock(Protocol):
    """What the scheduler needs of time and the event loop."""

    def time(self) -> float:
        """Now, on the clock ``call_at`` uses (the event loop's)."""

    def perf(self) -> float:
        """A fine clock for measuring the cost of a slice."""

    def call_at(self, when: float, callback: Callable[..., None], *args: Any) -> Handle:
        """Run ``callback(*args)`` at ``when``."""

    def call_soon(self, callback: Callable[..., None], *args: Any) -> Handle:
        """Run ``callback(*args)`` after what is ready now."""


class LoopClock:
    """The running event loop's clock, and ``time.perf_counter``."""

    def time(self) -> float:
        return asyncio.get_running_loop().time()

    def perf(self) -> float:
        return time.perf_counter()

    def call_at(self, when: float, callback: Callable[..., None], *args: Any) -> Handle:
        return asyncio.get_running_loop().call_at(when, callback, *args)

    def call_soon(self, callback: Callable[..., None], *args: Any) -> Handle:
        return asyncio.get_running_loop().call_soon(callback, *args)


FlushReport = Callable[[float, int, int], None]
"""Told of each finished flush: its cost (seconds), the deliveries it covered, and
how many of them its own turn left with items for their senders."""


class _Round:
    """One flush under way."""

    __slots__ = ("cost", "next", "pending", "started", "unsent")

    def __init__(self, pending: list[Delivery], started: float) -> None:
        self.pending = pending
        self.started = started
        self.next = 0
        """Index in ``pending`` of the next delivery to write."""
        self.cost = 0.0
        self.unsent: list[Delivery] = []
        """Deliveries left with items for their sender tasks."""


class FlushScheduler:
    """Flushes the deliveries that live dispatches touched.

    Args:
        clock: time and callbacks.
        send_interval: the longest wait between two flushes (seconds).
        report: told of each finished flush.
        slice_seconds: the most a slice writes before the event loop runs.
        slice_yields: times the next slice goes to the back of the loop's queue.
    """

    def __init__(
        self,
        clock: Clock,
        *,
        send_interval: float,
        report: FlushReport,
        slice_seconds: float = 0.00025,
        slice_yields: int = 2,
    ) -> None:
        self._clock = clock
        self._send_interval = send_interval
        self._report = report
        self._slice_seconds = slice_seconds
        self._slice_yields = slice_yields
        self._pending: dict[Delivery, None] = {}
        self._timer: Handle | None = None
        """The next flush, or the next slice of the one under way."""
        self._next_flush = 0.0
        self.idle = asyncio.Event()
        """Set while no delivery waits for a flush and none is under way."""
        self.idle.set()

    def add(self, deliveries: Iterable[Delivery]) -> None:
        """Deliveries that received items: flush them now, or as soon as the
        last flush allows (with everything that arrives meanwhile)."""
        pending = self._pending
        for delivery in deliveries:
            pending[delivery] = None
        if not pending or self._timer is not None:
            return  # a flush or a slice is already scheduled and will see them
        self.idle.clear()
        if self._clock.time() >= self._next_flush:
            self._flush()
        else:
            self._timer = self._clock.call_at(self._next_flush, self._flush)

    def stop(self) -> None:
        """Cancel whatever is scheduled (the publisher is stopping)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._pending.clear()
        self.idle.set()

    def _flush(self) -> None:
        flush = _Round(list(self._pending), self._clock.time())
        self._pending = {}
        self._slice(flush)

    def _slice(self, flush: _Round) -> None:
        self._timer = None
        perf = self._clock.perf
        started = perf()
        deadline = started + self._slice_seconds
        pending, unsent = flush.pending, flush.unsent
        i, end = flush.next, len(pending)
        while i < end:
            delivery = pending[i]
            i += 1
            send_now = delivery.send_now
            try:
                written = send_now is not None and send_now()
            except Exception as exc:
                # A bug in one connection's write must not cost the others their
                # turn, nor reach the tailer through the dispatch that ran this.
                log_event(log, "fanout.write_failed", logging.ERROR, exc=exc)
                written = False
            if not written:
                unsent.append(delivery)
            if perf() >= deadline:
                break
        flush.next = i
        flush.cost += perf() - started
        if i < end:
            # Meanwhile add() only queues (the timer is set): a delivery still
            # ahead in this round sends what it gets; one behind waits for the
            # next round, as it would have anyway.
            self._timer = self._clock.call_soon(self._requeue, flush, self._slice_yields)
            return
        for delivery in unsent:
            delivery.wake()
        self._report(flush.cost, len(pending), len(unsent))
        if unsent:
            self._next_flush = self._clock.time() + self._send_interval
        else:
            self._next_flush = flush.started + min(self._send_interval, 3 * flush.cost)
        if self._pending:
            self._timer = self._clock.call_at(self._next_flush, self._flush)
        else:
            self.idle.set()

    def _requeue(self, flush: _Round, yields: int) -> None:
        if yields > 1:
            self._timer = self._clock.call_soon(self._requeue, flush, yields - 1)
        else:
            self._timer = self._clock.call_soon(self._slice, flush)
