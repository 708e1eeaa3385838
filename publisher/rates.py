"""Per-second rates of the publisher's counters over the last minutes, for the dashboard.

Pure code: the caller reads its counters and both clocks and hands them to
``RateHistory.observe`` as often as it likes (the publisher does once a
second); one sample is kept per ``interval`` (the first call in each slot of
the monotonic clock), at most ``span`` seconds of them. A rate is the
difference between two consecutive samples over the monotonic time between
them, so a late or skipped sample changes the spacing of the points, never
their values, and a step of the wall clock changes only the ``at`` labels.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

__all__ = ["RateHistory", "RateSample"]


@dataclass(frozen=True, slots=True)
class _Reading:
    monotonic: float
    wall: float
    counters: Mapping[str, int]


@dataclass(frozen=True, slots=True)
class RateSample:
    """The rates between two consecutive readings."""

    at: float
    """Wall-clock time (Unix seconds) of the later reading."""
    seconds: float
    """Monotonic seconds between the two readings."""
    per_second: Mapping[str, float]
    """Counter name -> its increase per second over those seconds."""


def _increase(before: int, after: int) -> int:
    # A counter that went down was reset (a new process, a new object): it
    # counted ``after`` since then, as Prometheus' rate() takes it.
    return after - before if after >= before else after


class RateHistory:
    """A ring of counter readings, one per ``interval`` seconds, ``span`` seconds long.

    Args:
        interval: seconds between two kept readings.
        span: seconds of history kept (``span / interval`` rates).
    """

    def __init__(self, interval: float = 5.0, span: float = 600.0) -> None:
        if interval <= 0 or span < interval:
            raise ValueError(f"need 0 < interval <= span, got {interval=} {span=}")
        self.interval = interval
        self.span = span
        # One reading more than rates: n rates need n + 1 readings.
        self._readings: deque[_Reading] = deque(maxlen=round(span / interval) + 1)
        self._slot: int | None = None

    def observe(self, monotonic: float, wall: float, counters: Mapping[str, int]) -> bool:
        """Keep this reading if it is the first in its ``interval`` slot.

        Args:
            monotonic: a monotonic clock's time (``time.monotonic()``).
            wall: the wall clock's time in Unix seconds (``time.time()``).
            counters: counter name -> its value now (counters only ever grow).

        Returns:
            whether the reading was kept.
        """
        slot = int(monotonic // self.interval)
        if self._slot is not None and slot <= self._slot:
            return False
        self._slot = slot
        self._readings.append(_Reading(monotonic, wall, dict(counters)))
        return True

    def samples(self) -> list[RateSample]:
        """The rates between consecutive kept readings, oldest first."""
        rates = []
        for before, after in itertools.pairwise(self._readings):
            seconds = after.monotonic - before.monotonic
            per_second = {
                name: _increase(before.counters.get(name, 0), value) / seconds
                for name, value in after.counters.items()
            }
            rates.append(RateSample(after.wall, seconds, per_second))
        return rates

    def to_json(self) -> dict[str, Any]:
        """The ``rates`` member of /changefeeds/stats: ``intervalSeconds``, ``spanSeconds``
        and ``samples``, each ``{"at", "seconds", "<counter>PerSecond", ...}``."""
        return {
            "intervalSeconds": self.interval,
            "spanSeconds": self.span,
            "samples": [
                {
                    "at": _timestamp(sample.at),
                    "seconds": round(sample.seconds, 3),
                    **{f"{name}PerSecond": round(v, 3) for name, v in sample.per_second.items()},
                }
                for sample in self.samples()
            ],
        }


def _timestamp(unix: float) -> str:
    moment = datetime.fromtimestamp(unix, UTC)
    return moment.isoformat(timespec="milliseconds").replace("+00:00", "Z")
