"""The listener's back-off: changefeed's one policy, with the listener's settings and errors.

``BackoffPolicy`` is ``changefeed.backoff.Backoff`` (capped, jittered
exponential, a server's Retry-After honoured, the jitter from an injectable
``random.Random``) plus ``reset_after``, and its settings are refused with a
``ListenerConfigError`` naming them (``backoff.initial``). The defaults are
client-go's reflector: 800 ms doubling to 30 s, full jitter, reset after two
healthy minutes.

``RegistrationBackoff`` is the re-registration schedule of one listener: the
connection loop sleeps it between two sessions (a lifecycle, not a call to
retry, so it is the policy's arithmetic rather than a tenacity loop). A
controller's per-id retries use ``DEFAULT_ITEM_BACKOFF`` through its work
queue the same way (``_reconcile``).

Pure code: the caller passes the time in and does the sleeping.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from changefeed.backoff import Backoff, FailureStreak, finite_number

from ._errors import ListenerConfigError

__all__ = ["DEFAULT_ITEM_BACKOFF", "BackoffPolicy", "RegistrationBackoff"]


@dataclass(frozen=True, slots=True)
class BackoffPolicy(Backoff):
    """A capped exponential schedule with jitter (``changefeed.backoff.Backoff``).

    The n-th consecutive failure waits a random time in
    ``[ceiling * (1 - jitter), ceiling]`` where
    ``ceiling = min(maximum, initial * factor ** (n - 1))``; ``jitter=1`` is
    AWS's "full jitter" (uniform in ``[0, ceiling]``), ``jitter=0`` none. A
    publisher's ``retryAfter`` is added to it.

    Args:
        initial: ceiling of the first delay, seconds.
        maximum: the cap, seconds.
        factor: growth per consecutive failure.
        jitter: fraction of the ceiling that is randomised (0 to 1).
        reset_after: a connection healthy this long resets the schedule, seconds.

    Raises:
        ListenerConfigError: a value is out of range (``backoff.initial``, ...).
    """

    reset_after: float = 120.0

    def __post_init__(self) -> None:
        Backoff.__post_init__(self)
        if not (finite_number(self.reset_after) and self.reset_after >= 0):
            self._refuse("reset_after", f"must be a finite number >= 0, got {self.reset_after!r}")

    def _refuse(self, field: str, message: str) -> None:
        raise ListenerConfigError(f"backoff.{field}", message)


DEFAULT_ITEM_BACKOFF = BackoffPolicy(initial=0.05, maximum=30.0, factor=2.0, jitter=1.0)
"""Per-id retries of the controller: 50 ms doubling to 30 s, full jitter."""


class RegistrationBackoff:
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
        self.rng = rng or random.Random()
        """The jitter's source, which the bootstrap walks' retries draw from too."""
        self.streak = FailureStreak(self.policy.reset_after)
        """Consecutive failures, started over by a healthy connection."""
        self.delay = 0.0
        """The last delay handed out (0 before any failure or after a reset)."""
        self.ceiling = 0.0
        """The ceiling the last delay was drawn under."""

    @property
    def failures(self) -> int:
        """Consecutive failures since the last reset."""
        return self.streak.count

    @property
    def resets(self) -> int:
        """Times the schedule started over."""
        return self.streak.resets

    def healthy(self, now: float) -> None:
        """A connection became live at ``now`` (monotonic seconds)."""
        self.streak.up(now)

    def healthy_for(self, now: float) -> float:
        """Seconds the current connection has been live (0 when not live)."""
        return self.streak.up_for(now)

    def failure(self, now: float, retry_after: float | None = None) -> float:
        """A connection (attempt) ended at ``now``; return the delay before the next
        one: the drawn delay, plus the publisher's ``retry_after`` when it gave one."""
        failures = self.streak.failed(now)
        self.ceiling = self.policy.ceiling(failures)
        self.delay = self.policy.delay(failures, self.rng, retry_after)
        return self.delay

    def reset(self) -> None:
        """Start the schedule over."""
        self.streak.reset()
        self.delay = 0.0
        self.ceiling = 0.0
