"""Admission control for bootstrap walks: how many, and how many page queries at once.

After a publisher restart every listener re-bootstraps at once. Unchecked,
hundreds of walks would hold every database connection of the API and its
ordinary requests would queue behind them. Two limits, per process:

* **Walks** (``max_walks``). A walk starts with a page request without
  ``after`` and is known by the walk id its page tokens carry. A *new* walk
  beyond the cap is refused at once (429, ``Retry-After``), before it costs a
  query. A walk's *continuation* pages are never refused by this cap, so a
  walk that got in finishes while it keeps going; a walk ends with its last
  page, or is forgotten after ``walk_idle_timeout`` without a page (its
  client went away). A continuation of a walk this process does not know is
  admitted as that walk when its token was issued within
  ``walk_idle_timeout`` (the walk began on another instance behind the same
  balancer). One whose walk ended here, or whose token is older (or dated
  ahead), is admitted as a new walk, under the cap, and may be refused:
  tokens kept aside never open walks the cap does not count. A walk that
  ended on one instance can still be taken up, counted, on another for
  ``walk_idle_timeout``: instances share no state.
* **Page queries** (``max_queries``). At most this many page queries run at
  once; a page waits up to ``queue_timeout`` for a slot, then is refused with
  429 too. Keep it below the API's pool size so ordinary requests always
  find a connection.

``Retry-After`` of a refused walk is an *appointment*, not a constant: the
refusals are queued on a virtual timeline that advances by the time one walk
slot takes to free up (the mean walk duration, measured, divided by
``max_walks``), so the 475 walks refused in the first second of a storm come
back spread over the time the admitted ones need, instead of all hammering
the route every second. It is clamped to ``[retry_after, max_retry_after]``.

Refusals cost no database work, and the Pager honours ``Retry-After`` and
resumes the walk where it was. Batch (``?ids=``) and per-id requests are not
walks and are not limited here.

``WalkTable`` is pure bookkeeping with an injected clock; ``QuerySlots`` is a
semaphore whose waits are bounded and race-free. Nothing here may ever block
without a bound or touch the database.
"""

from __future__ import annotations

import asyncio
import math
import secrets
import time
from collections import OrderedDict, deque
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

from .errors import BootstrapConfigError, WalkRefused

__all__ = ["Admission", "QuerySlots", "WalkTable"]

_DURATION_WEIGHT = 0.2  # of the newest walk in the mean duration (exponential moving average)

_CLOCK_SLACK = 2.0
"""Seconds a page token's issue time may be off: it is whole seconds, and
instances' clocks differ a little. Not more: a token dated far ahead would
otherwise stay recent for as long."""

_MOST_ENDED = 100_000
"""Walks remembered as ended, at most (the oldest are forgotten first)."""


class WalkTable:
    """The walks in progress, by id, ordered by when each was last seen.

    Args:
        max_walks: most walks at once (None: unlimited).
        idle_timeout: a walk without a page for this long is forgotten.
        expected_duration: the mean walk duration assumed until one is measured.
        clock: monotonic seconds.
    """

    def __init__(
        self,
        max_walks: int | None,
        idle_timeout: float,
        clock: Callable[[], float] = time.monotonic,
        expected_duration: float = 1.0,
    ) -> None:
        if max_walks is not None and max_walks < 1:
            raise BootstrapConfigError(f"max_walks must be positive or None, got {max_walks}")
        self.max_walks = max_walks
        self.idle_timeout = idle_timeout
        self._clock = clock
        self._last_seen: OrderedDict[str, float] = OrderedDict()
        self._started_at: dict[str, float] = {}
        # Walks that finished or idled out here, with when: their tokens may still
        # look recent, and must not bring them back uncounted (``ended``).
        self._ended: OrderedDict[str, float] = OrderedDict()
        self.mean_duration = expected_duration
        self.started = 0
        self.finished = 0
        self.expired = 0
        self.refused = 0

    def __len__(self) -> int:
        return len(self._last_seen)

    def __contains__(self, walk: object) -> bool:
        """Whether ``walk`` is in progress here (seen within ``idle_timeout``)."""
        self._expire(self._clock())
        return walk in self._last_seen

    def ended(self, walk: str) -> bool:
        """Whether ``walk`` finished or idled out here lately (for as long as one of
        its tokens can look recent)."""
        self._expire(self._clock())
        return walk in self._ended

    def _expire(self, now: float) -> None:
        while self._last_seen:
            walk, seen = next(iter(self._last_seen.items()))
            if now - seen < self.idle_timeout:
                break
            del self._last_seen[walk]
            self._started_at.pop(walk, None)
            self._end(walk, now)
            self.expired += 1
        remembered = self.idle_timeout + 2 * _CLOCK_SLACK + 1
        while self._ended:
            walk, when = next(iter(self._ended.items()))
            if now - when < remembered and len(self._ended) <= _MOST_ENDED:
                break
            del self._ended[walk]

    def _end(self, walk: str, now: float) -> None:
        self._ended[walk] = now
        self._ended.move_to_end(walk)

    def start(self) -> str | None:
        """Admit a new walk: its id, or None when the cap is reached."""
        now = self._clock()
        self._expire(now)
        if self.max_walks is not None and len(self._last_seen) >= self.max_walks:
            self.refused += 1
            return None
        walk = secrets.token_hex(6)
        self._last_seen[walk] = now
        self._started_at[walk] = now
        self.started += 1
        return walk

    def touch(self, walk: str) -> None:
        """A continuation page of ``walk`` (admitted even if it began on another
        process)."""
        now = self._clock()
        self._expire(now)
        self._last_seen[walk] = now
        self._last_seen.move_to_end(walk)

    def finish(self, walk: str) -> None:
        """``walk`` served its last page."""
        if self._last_seen.pop(walk, None) is not None:
            self.finished += 1
            self._end(walk, self._clock())
        started = self._started_at.pop(walk, None)
        if started is not None:
            duration = self._clock() - started
            self.mean_duration += _DURATION_WEIGHT * (duration - self.mean_duration)

    def abandon(self, walk: str) -> None:
        """A new walk that never got its first page (refused later, or failed)."""
        self._started_at.pop(walk, None)
        if self._last_seen.pop(walk, None) is not None:
            self.started -= 1


class QuerySlots:
    """A counting semaphore whose acquire gives up after a bound, without races.

    Args:
        size: slots.
    """

    def __init__(self, size: int) -> None:
        if size < 1:
            raise BootstrapConfigError(f"max_queries must be positive, got {size}")
        self.size = size
        self._free = size
        # Only waiters still waiting: release() pops before handing over, and
        # a waiter that gives up removes itself.
        self._waiters: deque[asyncio.Future[None]] = deque()

    @property
    def active(self) -> int:
        return self.size - self._free

    @property
    def waiting(self) -> int:
        return len(self._waiters)

    async def acquire(self, timeout: float) -> bool:  # noqa: ASYNC109 (a bound, not a deadline API)
        """Take a slot; False when none came free within ``timeout`` seconds."""
        if self._free > 0 and not self._waiters:
            self._free -= 1
            return True
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        try:
            # asyncio.wait neither cancels the waiter nor raises on timeout, so
            # afterwards done() tells exactly whether a slot was handed over.
            await asyncio.wait((waiter,), timeout=timeout)
        except asyncio.CancelledError:
            if waiter.done():
                self.release()  # handed a slot just as we were cancelled: pass it on
            else:
                self._waiters.remove(waiter)
                waiter.cancel()
            raise
        if waiter.done():
            return True
        self._waiters.remove(waiter)
        waiter.cancel()
        return False

    def release(self) -> None:
        """Give a slot back, handing it to the oldest waiter."""
        if self._waiters:
            self._waiters.popleft().set_result(None)
        else:
            self._free += 1


class Admission:
    """Per-process admission control of bootstrap walks and their page queries.

    Args:
        max_walks: walks in progress at once; new ones beyond are refused (None: no cap).
        max_queries: page queries running at once.
        queue_timeout: how long a page waits for a query slot before it is refused.
        walk_idle_timeout: a walk without a page for this long is forgotten.
        retry_after: the smallest ``Retry-After`` of a refusal, in whole seconds.
        max_retry_after: the largest.
        expected_walk_seconds: mean walk duration assumed until one is measured.
        clock: monotonic seconds (tests inject one).
        wall_clock: wall-clock seconds, to age a page token another process may
            have issued (tests inject one).
    """

    def __init__(
        self,
        *,
        max_walks: int | None = 32,
        max_queries: int = 4,
        queue_timeout: float = 1.0,
        walk_idle_timeout: float = 30.0,
        retry_after: int = 1,
        max_retry_after: int = 60,
        expected_walk_seconds: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        if not 0 <= retry_after <= max_retry_after:
            raise BootstrapConfigError(
                f"need 0 <= retry_after ({retry_after}) <= max_retry_after ({max_retry_after})"
            )
        self.walks = WalkTable(max_walks, walk_idle_timeout, clock, expected_walk_seconds)
        self.slots = QuerySlots(max_queries)
        self.queue_timeout = queue_timeout
        self.retry_after = retry_after
        self.max_retry_after = max_retry_after
        self._clock = clock
        self._wall_clock = wall_clock
        self._appointments = 0.0  # the virtual time the last refused walk was told to return
        self.pages_served = 0
        self.pages_refused = 0

    def appointment(self) -> int:
        """``Retry-After`` for a walk refused now: after the walks refused before it."""
        now = self._clock()
        assert self.walks.max_walks is not None
        per_slot = self.walks.mean_duration / self.walks.max_walks
        self._appointments = max(self._appointments, now) + per_slot
        wait = math.ceil(self._appointments - now)
        return min(max(wait, self.retry_after), self.max_retry_after)

    def admit(self, walk: str | None, *, issued: int | None = None) -> tuple[str, bool]:
        """Admit a page of ``walk`` (None: a new walk), whose token was ``issued``
        (Unix seconds; None: it did not say). A continuation is admitted as its walk
        when this process knows the walk, or when its token is recent and the walk
        did not end here (it began on another instance); otherwise as a new walk.

        Returns:
            the walk id (a new one for a continuation admitted as a new walk), and
            whether the walk is new.

        Raises:
            WalkRefused: a new walk while ``max_walks`` walks are in progress.
        """
        if walk is not None and (
            walk in self.walks or (self._recent(issued) and not self.walks.ended(walk))
        ):
            self.walks.touch(walk)
            return walk, False
        started = self.walks.start()
        if started is None:
            self.pages_refused += 1
            retry_after = self.appointment()
            raise WalkRefused(
                f"{len(self.walks)} bootstrap walks in progress (the most this process "
                f"admits); retry in {retry_after}s",
                retry_after,
            )
        return started, True

    def _recent(self, issued: int | None) -> bool:
        """Whether a token issued then may still belong to a walk some process knows."""
        if issued is None:
            return False
        age = self._wall_clock() - issued
        return -_CLOCK_SLACK <= age <= self.walks.idle_timeout + _CLOCK_SLACK

    @asynccontextmanager
    async def query_slot(self) -> AsyncIterator[None]:
        """Hold a page-query slot for the block.

        Raises:
            WalkRefused: no slot came free within ``queue_timeout``.
        """
        if not await self.slots.acquire(self.queue_timeout):
            self.pages_refused += 1
            raise WalkRefused(
                f"{self.slots.size} page queries running, none finished within "
                f"{self.queue_timeout}s; retry in {self.retry_after}s",
                self.retry_after,
            )
        try:
            yield
        finally:
            self.slots.release()

    def served(self, walk: str, last: bool) -> None:
        """A page of ``walk`` was served; ``last`` ends the walk."""
        self.pages_served += 1
        if last:
            self.walks.finish(walk)

    def stats(self) -> dict[str, Any]:
        """Counters for stats pages and tests."""
        return {
            "walksActive": len(self.walks),
            "walksStarted": self.walks.started,
            "walksFinished": self.walks.finished,
            "walksExpired": self.walks.expired,
            "walksRefused": self.walks.refused,
            "meanWalkSeconds": round(self.walks.mean_duration, 3),
            "pagesServed": self.pages_served,
            "pagesRefused": self.pages_refused,
            "queriesActive": self.slots.active,
            "queriesWaiting": self.slots.waiting,
            "maxWalks": self.walks.max_walks,
            "maxQueries": self.slots.size,
        }
