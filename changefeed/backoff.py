"""The one back-off policy: capped, jittered exponential, honouring a server's Retry-After.

Every part of changefeed that waits before trying again uses ``Backoff``:
the listener between registrations and for each controller id, the
bootstrap pager and its fetches, the publisher's tailer and a connection's
catch-up reads of the feed, and the compaction job's batches.

**The rule.** After the n-th consecutive failure the ceiling is
``min(maximum, initial * factor ** (n - 1))`` and the delay is drawn
uniformly from ``[ceiling * (1 - jitter), ceiling]``: ``jitter=1`` is "full
jitter" (client-go's reflector, AWS's advice), ``jitter=0`` none. When the
failure carries a server's Retry-After (an HTTP 429/503, the publisher's
``retryAfter``), the wait is that hint (capped at ``MAX_RETRY_AFTER``) plus
the drawn delay: at least what the server asked, and spread, so that the
clients it turned away together do not all come back at the same moment.
The jitter is drawn from an injectable ``random.Random``: a seeded test is
reproducible, and no part draws from the global one.

Where a part retries a *call*, the retrying is tenacity's: ``retrying``
builds an ``AsyncRetrying`` whose wait is ``WaitBackoff`` (the rule above,
reading the Retry-After off the failure's ``retry_after`` attribute).
tenacity's own ``wait_exponential_jitter`` adds its jitter from the global
``random`` and has no floor for a server's hint, hence this wait. Where a
part waits between two steps of a longer life (the listener's connection
loop, a controller's per-id retries through its work queue), it calls
``delay`` itself: that is the same arithmetic. A part whose connection comes
and goes for a long life (the listener's registrations, the publisher's
tailer and doorbell) counts its failures in a ``FailureStreak``, which starts
over once a connection has stayed up: a blip after a healthy hour is retried
at the schedule's start, not where the last outage left it.

Pure code apart from tenacity's loop. It must never sleep, read a clock, or
hand out a delay above ``maximum`` plus the capped hint.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeGuard

from tenacity import AsyncRetrying, RetryCallState
from tenacity.retry import retry_base
from tenacity.stop import stop_base
from tenacity.wait import wait_base

__all__ = [
    "MAX_RETRY_AFTER",
    "Backoff",
    "BackoffError",
    "FailureStreak",
    "WaitBackoff",
    "finite_number",
    "retry_after_floor",
    "retrying",
]

MAX_RETRY_AFTER = 300.0
"""The longest Retry-After honoured, seconds: a server's hint, not a sentence."""


class BackoffError(ValueError):
    """A back-off setting out of range.

    Args:
        field: the setting (``initial``, ``maximum``, ``factor``, ``jitter``).
        message: what is wrong with it.
    """

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


def finite_number(value: object) -> TypeGuard[int | float]:
    """A finite int or float (a bool is not a number here): what every duration and
    factor a setting takes must be."""
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def retry_after_floor(retry_after: float | None) -> float:
    """A server's Retry-After as the least wait: capped at ``MAX_RETRY_AFTER``; 0 without
    one (or for one that is not a positive number, NaN included)."""
    if retry_after is None or not retry_after > 0:
        return 0.0
    return min(float(retry_after), MAX_RETRY_AFTER)


@dataclass(frozen=True, slots=True)
class Backoff:
    """A capped exponential schedule with jitter (see the module docstring).

    Args:
        initial: ceiling of the first delay, seconds.
        maximum: the cap, seconds.
        factor: growth per consecutive failure.
        jitter: fraction of the ceiling that is randomised (0 to 1).

    Raises:
        BackoffError: a value is out of range.
    """

    initial: float = 0.8
    maximum: float = 30.0
    factor: float = 2.0
    jitter: float = 1.0

    def __post_init__(self) -> None:
        if not (finite_number(self.initial) and self.initial > 0):
            self._refuse("initial", f"must be a finite number > 0, got {self.initial!r}")
        if not (finite_number(self.maximum) and self.maximum > 0):
            self._refuse("maximum", f"must be a finite number > 0, got {self.maximum!r}")
        if not self.maximum >= self.initial:
            self._refuse("maximum", f"must be >= initial ({self.initial}), got {self.maximum!r}")
        if not (finite_number(self.factor) and self.factor >= 1):
            self._refuse("factor", f"must be >= 1, got {self.factor!r}")
        if not (finite_number(self.jitter) and 0 <= self.jitter <= 1):
            self._refuse("jitter", f"must be in [0, 1], got {self.jitter!r}")

    def _refuse(self, field: str, message: str) -> None:
        """Raise the error of a setting out of range (a subclass may raise its own kind)."""
        raise BackoffError(field, message)

    def ceiling(self, failures: int) -> float:
        """The largest drawn delay after ``failures`` consecutive failures (1 or more)."""
        exponent = max(1, failures) - 1
        try:
            return min(self.maximum, self.initial * self.factor**exponent)
        except OverflowError:  # thousands of failures in a row: long past the cap
            return self.maximum

    def draw(self, failures: int, rng: random.Random) -> tuple[float, float]:
        """A jittered delay after ``failures`` consecutive failures: ``(delay, ceiling)``."""
        ceiling = self.ceiling(failures)
        if not self.jitter:  # nothing to draw: a seeded rng shared with others is left as it is
            return ceiling, ceiling
        spread = ceiling * self.jitter
        return ceiling - spread + rng.uniform(0.0, spread), ceiling

    def delay(self, failures: int, rng: random.Random, retry_after: float | None = None) -> float:
        """How long to wait after ``failures`` consecutive failures, the last one
        carrying the server's ``retry_after`` (seconds, or None)."""
        return retry_after_floor(retry_after) + self.draw(failures, rng)[0]


class FailureStreak:
    """Consecutive failures of a connection that comes and goes: the count a
    ``Backoff`` is drawn for.

    It starts over once a connection has stayed up ``reset_after`` seconds, so
    that a blip after a healthy stretch is retried at the start of the schedule;
    a connection that fails again at once keeps climbing it (a server that
    accepts and drops every connection is not hammered).

    Args:
        reset_after: seconds a connection must stay up to start the count over.
    """

    __slots__ = ("_up_since", "count", "reset_after", "resets")

    def __init__(self, reset_after: float) -> None:
        self.reset_after = reset_after
        self.count = 0
        """Consecutive failures so far."""
        self.resets = 0
        """Times a count of one or more started over."""
        self._up_since: float | None = None

    def up(self, now: float) -> None:
        """A connection works, from ``now`` (monotonic seconds) if it did not already."""
        if self._up_since is None:
            self._up_since = now

    def up_for(self, now: float) -> float:
        """Seconds the current connection has worked (0 when none does)."""
        return 0.0 if self._up_since is None else max(0.0, now - self._up_since)

    def failed(self, now: float) -> int:
        """A connection (or an attempt at one) failed at ``now``: the consecutive
        failures, this one included."""
        if self._up_since is not None and now - self._up_since >= self.reset_after:
            self.reset()
        self._up_since = None
        self.count += 1
        return self.count

    def reset(self) -> None:
        """Start the count over."""
        if self.count:
            self.resets += 1
        self.count = 0


class WaitBackoff(wait_base):
    """tenacity's wait for a ``Backoff``: the policy's delay for the failures so far,
    plus the Retry-After the last failure carries (its ``retry_after`` attribute).

    Args:
        policy: the schedule.
        rng: source of the jitter (default: a fresh ``random.Random``).
        failures: the failures the schedule counts, from tenacity's state (default:
            the attempt number; a caller whose "busy" answers do not count says so).
    """

    def __init__(
        self,
        policy: Backoff,
        rng: random.Random | None = None,
        failures: Callable[[RetryCallState], int] | None = None,
    ) -> None:
        self.policy = policy
        self.rng = rng or random.Random()
        self._failures = failures

    def __call__(self, retry_state: RetryCallState) -> float:
        outcome = retry_state.outcome
        failure = outcome.exception() if outcome is not None and outcome.failed else None
        count = (
            self._failures(retry_state)
            if self._failures is not None
            else retry_state.attempt_number
        )
        return self.policy.delay(count, self.rng, getattr(failure, "retry_after", None))


def retrying(
    policy: Backoff,
    *,
    retry: retry_base | Callable[[RetryCallState], bool],
    stop: stop_base | Callable[[RetryCallState], bool] | None = None,
    rng: random.Random | None = None,
    before_sleep: Callable[[RetryCallState], Any] | None = None,
    failures: Callable[[RetryCallState], int] | None = None,
) -> AsyncRetrying:
    """An ``AsyncRetrying`` waiting by ``policy`` (the last error is re-raised when it
    gives up).

    Args:
        retry: which outcomes are tried again.
        stop: when to give up (default: never).
        rng: source of the jitter.
        before_sleep: called before each wait (log, count).
        failures: the failures the schedule counts (default: tenacity's attempt
            number; a ``FailureStreak``'s count where the retried call is a
            connection's whole life).
    """
    options: dict[str, Any] = {}
    if stop is not None:
        options["stop"] = stop
    if before_sleep is not None:
        options["before_sleep"] = before_sleep
    wait = WaitBackoff(policy, rng, failures)
    return AsyncRetrying(wait=wait, retry=retry, reraise=True, **options)
