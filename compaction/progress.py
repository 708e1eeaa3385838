"""How the compaction job reports its progress, and the arithmetic of a progress line.

The job never prints. It calls a ``Progress``: ``phase`` when a phase begins
(with what it counts and its total when the job knows it; a phase that
counts nothing, such as taking a lock, is a plain step), ``advance`` as work
gets done,
``add_total`` when more work turns up (Spark plans its stages as it goes),
``end_phase`` when the phase is over, and ``note`` for the facts worth keeping
(the snapshot, the plan, the summary). Adapters render it: ``progress_rich``
draws bars on a terminal, ``progress_log`` writes structured log lines.

``Meter`` is what an adapter needs to say about one phase -- done of total,
rate, time left -- computed from the clock readings it is given. Nothing here
does I/O.

Calls come from one thread at a time (the job's, or while Spark runs, the
thread that watches Spark), so an adapter needs no lock of its own.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

__all__ = ["Meter", "NullProgress", "Progress"]


class Progress(Protocol):
    """What the compaction job reports while it runs."""

    def phase(self, name: str, total: int | None = None, unit: str | None = None) -> None:
        """Phase ``name`` begins.

        Args:
            total: units of work, or None while not known.
            unit: what the phase counts (``entries``, ``tasks``); None for a
                step that counts nothing.
        """

    def advance(self, n: int) -> None:
        """``n`` more units of the current phase are done."""

    def add_total(self, n: int) -> None:
        """``n`` more units of work turned up in the current phase."""

    def end_phase(self) -> None:
        """The current phase is over (finished, or left by an error)."""

    def note(self, event: str, fields: Mapping[str, Any]) -> None:
        """A fact about the run: ``start``, ``snapshot``, ``planned``, ``done``."""


class NullProgress:
    """A ``Progress`` that reports nothing (the job's default); a base for partial ones."""

    def phase(self, name: str, total: int | None = None, unit: str | None = None) -> None:
        pass

    def advance(self, n: int) -> None:
        pass

    def add_total(self, n: int) -> None:
        pass

    def end_phase(self) -> None:
        pass

    def note(self, event: str, fields: Mapping[str, Any]) -> None:
        pass


@dataclass(slots=True)
class Meter:
    """Done of total for one phase, and what follows from it at a given time.

    Attributes:
        unit: what the phase counts; None for a step that counts nothing.
        started: the clock reading when the phase began.
        total: None while not known.
    """

    name: str
    unit: str | None
    started: float
    total: int | None = None
    done: int = 0

    def advance(self, n: int) -> None:
        self.done += n

    def add_total(self, n: int) -> None:
        self.total = (self.total or 0) + n

    def elapsed(self, now: float) -> float:
        return max(0.0, now - self.started)

    def rate(self, now: float) -> float:
        """Units per second since the phase began (0 before any time has passed)."""
        elapsed = self.elapsed(now)
        return self.done / elapsed if elapsed > 0 else 0.0

    def fraction(self) -> float | None:
        """Done over total, at most 1; None while the total is not known.

        A phase with nothing to do (total 0) is complete.
        """
        if self.total is None:
            return None
        if self.total == 0:
            return 1.0
        return min(1.0, self.done / self.total)

    def seconds_left(self, now: float) -> float | None:
        """At the average rate so far; None while the total or the rate is not known."""
        if self.total is None:
            return None
        left = max(0, self.total - self.done)
        if left == 0:
            return 0.0
        rate = self.rate(now)
        return left / rate if rate > 0 else None

    def fields(self, now: float) -> dict[str, Any]:
        """The facts of a progress line: phase, done, total, unit, percent, rate,
        seconds left and seconds so far (for a step: phase and seconds)."""
        seconds = round(self.elapsed(now), 3)
        if self.unit is None:
            return {"phase": self.name, "seconds": seconds}
        fraction = self.fraction()
        left = self.seconds_left(now)
        return {
            "phase": self.name,
            "done": self.done,
            "total": self.total,
            "unit": self.unit,
            "percent": None if fraction is None else round(100 * fraction, 1),
            "rate": round(self.rate(now), 1),
            "seconds_left": None if left is None else round(left, 1),
            "seconds": seconds,
        }
