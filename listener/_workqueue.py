"""The controller's work queue: keyed, coalescing, "fair and stingy" (client-go ``workqueue``).

* **Keyed and coalescing.** The queue holds resource ids, not change items: an
  id added a thousand times before a worker takes it is processed once.
* **Stingy.** An id is never processed by two workers at once. An id added
  while it is being processed is marked dirty and queued again, exactly
  once, when the worker calls ``done``, so a change that arrives during a
  fetch is never lost and never causes a concurrent fetch.
* **Fair.** Ids are handed out first in, first out.
* **Delayed adds** (``add_after``) carry the per-id retry back-off: a failed
  id comes back when its delay is over, without holding a worker.

Counters (adds, coalesced, retries, processed) and the depth are read by the
controller's status and metrics.

Pure code apart from one ``asyncio.Event`` used to wake waiting workers; the
clock is injectable, and the synchronous ``pop``/``done`` core is what the
tests drive. It must never hand out an id that is already being processed.
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import itertools
import time
from collections.abc import Callable, Collection, Hashable, Iterable
from typing import Generic, TypeVar

__all__ = ["WorkQueue"]

K = TypeVar("K", bound=Hashable)


class WorkQueue(Generic[K]):
    """Keyed FIFO with a dirty set, a processing set and delayed adds.

    Args:
        clock: monotonic seconds; the default is ``time.monotonic``.
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._queue: list[K] = []
        """Ids ready to be handed out: those from ``_head`` on (a list sliced in C, the
        part handed out dropped now and then, rather than a deque popped per id)."""
        self._head = 0
        self._dirty: set[K] = set()
        self._processing: set[K] = set()
        self._waiting: list[tuple[float, int, K]] = []
        self._due: dict[K, float] = {}
        self._seq = itertools.count()
        self._wake = asyncio.Event()
        self._idle = asyncio.Event()
        self._idle.set()
        self._shut_down = False
        self.adds = 0
        """Calls to add (and delayed adds that came due)."""
        self.coalesced = 0
        """Adds of an id that was already waiting to be processed."""
        self.retries = 0
        """Rate-limited re-adds after a failure."""
        self.processed = 0
        """Ids handed to workers."""

    # -- state -------------------------------------------------------------

    def __len__(self) -> int:
        """Depth: ids ready to be handed out."""
        return len(self._queue) - self._head

    def __contains__(self, key: object) -> bool:
        return key in self._dirty or key in self._processing or key in self._due

    @property
    def processing(self) -> frozenset[K]:
        """Ids a worker holds now."""
        return frozenset(self._processing)

    @property
    def waiting(self) -> int:
        """Ids waiting out a retry delay."""
        return len(self._due)

    @property
    def pending(self) -> int:
        """Ids that still need processing: queued, requeued after processing, or delayed."""
        return len(self._dirty) + len(self._due)

    def queued(self) -> set[K]:
        """Every id that still needs processing (queued, requeued or delayed; a snapshot)."""
        return self._dirty | self._due.keys()

    def is_queued(self, key: K) -> bool:
        """Whether ``key`` still needs processing: queued, requeued, or delayed."""
        return key in self._dirty or key in self._due

    def is_processing(self, key: K) -> bool:
        return key in self._processing

    @property
    def idle(self) -> bool:
        """Nothing queued, processing or delayed."""
        return not self._dirty and not self._processing and not self._due

    @property
    def shutting_down(self) -> bool:
        return self._shut_down

    def _changed(self) -> None:
        if self.idle:
            self._idle.set()
        else:
            self._idle.clear()

    # -- adding -------------------------------------------------------------

    def add(self, key: K) -> None:
        """Queue ``key`` unless it is already queued; if a worker holds it, queue it again
        once the worker is done."""
        if self._shut_down:
            return
        self.adds += 1
        if key in self._dirty:
            self.coalesced += 1
            return
        self._dirty.add(key)
        if key not in self._processing:
            self._queue.append(key)
            self._wake.set()
        self._changed()

    def add_many(self, keys: Iterable[K]) -> None:
        """``add`` each of ``keys``, in order (one call for a batch of change items)."""
        if self._shut_down:
            return
        keys = list(keys)
        dirty, processing = self._dirty, self._processing
        # In order, each key once, and only keys not queued already; set work in C, and
        # a step in Python only per key that was queued or is being processed.
        fresh: Collection[K]
        if dirty.isdisjoint(keys):
            before = len(dirty)
            dirty.update(keys)
            # Every key new, and each once (the common case): queued as they came.
            fresh = keys if len(dirty) - before == len(keys) else dict.fromkeys(keys)
        else:
            fresh = dict.fromkeys(keys)
            for key in dirty.intersection(fresh):
                del fresh[key]
            dirty.update(fresh)
        busy = processing.intersection(fresh) if processing else None
        self._queue.extend([key for key in fresh if key not in busy] if busy else fresh)
        self.adds += len(keys)
        self.coalesced += len(keys) - len(fresh)
        if len(self._queue) > self._head:
            self._wake.set()
        self._changed()

    def add_after(self, key: K, delay: float, now: float | None = None) -> None:
        """Queue ``key`` once ``delay`` seconds have passed (an earlier pending delay wins)."""
        if self._shut_down:
            return
        if delay <= 0:
            self.add(key)
            return
        due = (self._clock() if now is None else now) + delay
        current = self._due.get(key)
        if current is not None and current <= due:
            return
        self._due[key] = due
        heapq.heappush(self._waiting, (due, next(self._seq), key))
        self._wake.set()
        self._changed()

    def add_rate_limited(self, key: K, delay: float, now: float | None = None) -> None:
        """Re-add ``key`` after a failure, ``delay`` seconds from now (counted as a retry)."""
        self.retries += 1
        self.add_after(key, delay, now)

    def _promote(self, now: float) -> None:
        waiting = self._waiting
        while waiting and waiting[0][0] <= now:
            due, _, key = heapq.heappop(waiting)
            if self._due.get(key) == due:
                del self._due[key]
                self.add(key)

    def next_due(self) -> float | None:
        """When the earliest delayed id comes due (None: none is delayed)."""
        while self._waiting and self._due.get(self._waiting[0][2]) != self._waiting[0][0]:
            heapq.heappop(self._waiting)
        return self._waiting[0][0] if self._waiting else None

    # -- taking --------------------------------------------------------------

    def pop(self, most: int = 1, now: float | None = None) -> list[K]:
        """Hand out up to ``most`` ready ids (possibly none); each stays "processing"
        until ``done``."""
        self._promote(self._clock() if now is None else now)
        queue, head = self._queue, self._head
        taken = queue[head : head + most]
        head += len(taken)
        if head == len(queue):
            queue.clear()
            head = 0
        elif head > 1024 and head * 2 > len(queue):
            del queue[:head]
            head = 0
        self._head = head
        self._dirty.difference_update(taken)
        self._processing.update(taken)
        if len(queue) == head:
            self._wake.clear()
        self.processed += len(taken)
        return taken

    async def get(self, most: int = 1) -> list[K]:
        """Wait for ready ids and hand out up to ``most`` of them.

        Returns an empty list only once the queue is shut down.
        """
        while True:
            taken = self.pop(most)
            if taken:
                return taken
            if self._shut_down:
                return []
            self._wake.clear()
            due = self.next_due()
            if due is None:
                await self._wake.wait()
            else:
                # asyncio.timeout, not wait_for: on Python 3.11 wait_for can swallow a
                # cancellation that races with the event, and a worker would never stop.
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(max(0.0, due - self._clock())):
                        await self._wake.wait()

    def done(self, key: K) -> None:
        """A worker finished ``key``; if it was added meanwhile, it is queued again now."""
        self._processing.discard(key)
        if key in self._dirty:
            self._queue.append(key)
            self._wake.set()
        self._changed()

    def done_many(self, keys: Iterable[K]) -> None:
        """``done`` for each of ``keys`` (a worker's whole batch)."""
        keys = list(keys)
        self._processing.difference_update(keys)
        again = self._dirty.intersection(keys)
        if again:  # added while processed: queued again now, in the batch's order
            self._queue.extend([key for key in keys if key in again])
            self._wake.set()
        self._changed()

    # -- lifecycle --------------------------------------------------------------

    def shut_down(self) -> None:
        """Refuse new adds and wake every waiting worker (``get`` returns ``[]`` when empty)."""
        self._shut_down = True
        self._wake.set()

    async def wait_idle(self) -> None:
        """Return once nothing is queued, processing or delayed."""
        await self._idle.wait()
