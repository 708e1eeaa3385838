"""Exponential back-off with full jitter, capped, reset after a healthy period.

The schedule is client-go's reflector back-off (800 ms doubling to 30 s, full
jitter, reset after two healthy minutes); every number is a setting so tests
can use small ones. The jitter is drawn from an injectable ``random.Random``
so that a seeded test is reproducible. (The tailer's and the pager's retry
loops are tenacity's; this schedule is not a retry loop: the connection loop
sleeps it between registrations, and the controller's work queue holds an id
back for it, so it is only the arithmetic.)

``Backoff`` is the schedule of one listener's re-registrations;
``ItemBackoff`` is the per-id schedule of the controller's failed fetches and
reconciles (client-go's ItemExponentialFailureRateLimiter).

Pure code: the caller passes the time in and does the sleeping. It must never
read a clock, sleep, or hand out a delay above the policy's cap unless the
caller passes a longer floor (a publisher's ``retryAfter``).
"""

from __future__ import annotations

import random
from collections.abc import Hashable
from dataclasses import dataclass

from ._checks import check_seconds, is_number
from ._errors import ListenerConfigError

__all__ = ["DEFAULT_ITEM_BACKOFF", "Backoff", "BackoffPolicy", "ItemBackoff"]


@dataclass(frozen=True, slots=True)
class BackoffPolicy:
    """A capped exponential schedule with jitter.

    The n-th consecutive failure waits a random time in
    ``[ceiling * (1 - jitter), ceiling]`` where
    ``ceiling = min(maximum, initial * factor ** (n - 1))``; ``jitter=1`` is
    AWS's "full jitter" (uniform in ``[0, ceiling]``), ``jitter=0`` none.

    Args:
        initial: ceiling of the first delay, seconds.
        maximum: the cap, seconds.
        factor: growth per consecutive failure.
        jitter: fraction of the ceiling that is randomised (0 to 1).
        reset_after: a connection healthy this long resets the schedule, seconds.

    Raises:
        ListenerConfigError: a value is out of range.
    """

    initial: float = 0.8
    maximum: float = 30.0
    factor: float = 2.0
    jitter: float = 1.0
    reset_after: float = 120.0

    def __post_init__(self) -> None:
        check_seconds("backoff.initial", self.initial)
        check_seconds("backoff.maximum", self.maximum)
        if not self.maximum >= self.initial:
            raise ListenerConfigError(
                "backoff.maximum", f"must be >= initial ({self.initial}), got {self.maximum!r}"
            )
        if not (is_number(self.factor) and self.factor >= 1):
            raise ListenerConfigError("backoff.factor", f"must be >= 1, got {self.factor!r}")
        if not (is_number(self.jitter) and 0 <= self.jitter <= 1):
            raise ListenerConfigError("backoff.jitter", f"must be in [0, 1], got {self.jitter!r}")
        if not (is_number(self.reset_after) and self.reset_after >= 0):
            raise ListenerConfigError(
                "backoff.reset_after", f"must be a finite number >= 0, got {self.reset_after!r}"
            )

    def ceiling(self, failures: int) -> float:
        """The largest delay after ``failures`` consecutive failures (1 or more)."""
        exponent = max(1, failures) - 1
        try:
            return min(self.maximum, self.initial * self.factor**exponent)
        except OverflowError:  # thousands of failures in a row: long past the cap
            return self.maximum

    def delay(self, failures: int, rng: random.Random) -> tuple[float, float]:
        """A jittered delay after ``failures`` consecutive failures: ``(delay, ceiling)``."""
        ceiling = self.ceiling(failures)
        spread = ceiling * self.jitter
        return ceiling - spread + rng.uniform(0.0, spread), ceiling


DEFAULT_ITEM_BACKOFF = BackoffPolicy(initial=0.05, maximum=30.0, factor=2.0, jitter=1.0)
"""Per-id retries of the controller: 50 ms doubling to 30 s, full jitter."""


class Backoff:
    """The re-registration schedule of one listener.

    Call ``healthy(now)`` when a connection becomes live and ``failure(now)``
    when one ends; ``failure`` returns how long to wait. A failure that ends
    a connection which stayed healthy for ``reset_after`` seconds starts the
    schedule over (client-go's reset after two healthy minutes).

    Args:
        policy: the schedule.
        rng: source of jitter; seeded in tests.
    """

    def __init__(self, policy: BackoffPolicy | None = None, rng: random.Random | None = None):
        self.policy = policy or BackoffPolicy()
        self._rng = rng or random.Random()
        self.failures = 0
        """Consecutive failures since the last reset."""
        self.delay = 0.0
        """The last delay handed out (0 before any failure or after a reset)."""
        self.ceiling = 0.0
        """The ceiling the last delay was drawn under."""
        self.resets = 0
        self._healthy_since: float | None = None

    def healthy(self, now: float) -> None:
        """A connection became live at ``now`` (monotonic seconds)."""
        if self._healthy_since is None:
            self._healthy_since = now

    def healthy_for(self, now: float) -> float:
        """Seconds the current connection has been live (0 when not live)."""
        return 0.0 if self._healthy_since is None else max(0.0, now - self._healthy_since)

    def failure(self, now: float, at_least: float = 0.0) -> float:
        """A connection (attempt) ended at ``now``; return the delay before the next one,
        ``at_least`` seconds (the publisher's ``retryAfter``) or the drawn delay if longer."""
        if self._healthy_since is not None and now - self._healthy_since >= self.policy.reset_after:
            self.reset()
        self._healthy_since = None
        self.failures += 1
        drawn, self.ceiling = self.policy.delay(self.failures, self._rng)
        self.delay = max(drawn, at_least)
        return self.delay

    def reset(self) -> None:
        """Start the schedule over."""
        if self.failures:
            self.resets += 1
        self.failures = 0
        self.delay = 0.0
        self.ceiling = 0.0


class ItemBackoff:
    """Per-key exponential back-off: each key's failures are counted separately.

    Args:
        policy: the schedule (``reset_after`` is unused: ``forget`` resets a key).
        rng: source of jitter.
    """

    def __init__(self, policy: BackoffPolicy | None = None, rng: random.Random | None = None):
        self.policy = policy or DEFAULT_ITEM_BACKOFF
        self._rng = rng or random.Random()
        self._failures: dict[Hashable, int] = {}

    def failure(self, key: Hashable) -> float:
        """``key`` failed once more; return how long to wait before retrying it."""
        count = self._failures.get(key, 0) + 1
        self._failures[key] = count
        return self.policy.delay(count, self._rng)[0]

    def failures(self, key: Hashable) -> int:
        """Consecutive failures of ``key``."""
        return self._failures.get(key, 0)

    def forget(self, key: Hashable) -> None:
        """``key`` succeeded: its next failure starts from the first delay again."""
        self._failures.pop(key, None)

    def __len__(self) -> int:
        return len(self._failures)
