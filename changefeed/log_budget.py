"""How many log lines of one kind a stretch of time may hold, whatever the peers do.

A line that a peer can cause at will (a connection that times out, say) must
not let that peer set the volume of the log: 2,000 idle sockets must not write
2,000 lines. ``LogBudget`` lets the first ``burst`` lines of a ``window`` be
written one by one, each with its details, and counts the rest by kind; the
counts go out as one summary line once the window is over. The next line
after that opens a new window.

Pure code: no clock and no I/O; the caller passes the time and writes the
lines (``changefeed.http_timeouts`` does, for its timeouts).
"""

from __future__ import annotations

from collections import Counter

__all__ = ["LogBudget"]


class LogBudget:
    """The first ``burst`` lines of each ``window`` seconds, one by one; the rest counted.

    Args:
        burst: lines written one by one in a window.
        window: seconds a window lasts, from its first line.

    Raises:
        ValueError: ``burst`` below 1 or ``window`` not positive.
    """

    def __init__(self, burst: int, window: float) -> None:
        if burst < 1 or not window > 0:
            raise ValueError(f"need burst >= 1 and window > 0, got {burst!r}, {window!r}")
        self.burst = burst
        self.window = window
        self._ends: float | None = None  # None: no window open
        self._written = 0
        self._held: Counter[str] = Counter()

    @property
    def ends(self) -> float | None:
        """When the open window ends (None: none is open)."""
        return self._ends

    def note(self, now: float, kind: str) -> tuple[bool, dict[str, int] | None]:
        """A line of ``kind`` is due at ``now``.

        Returns:
            whether to write it, and what an earlier window held back (to be
            written first as its summary; None when nothing was).
        """
        ended = self.close(now)
        if self._ends is None:
            self._ends = now + self.window
            self._written = 0
        if self._written < self.burst:
            self._written += 1
            return True, ended
        self._held[kind] += 1
        return False, ended

    def close(self, now: float) -> dict[str, int] | None:
        """End the window if it is over at ``now``: what it held back, by kind (None:
        nothing, or the window is not over)."""
        if self._ends is None or now < self._ends:
            return None
        held = dict(self._held)
        self._held.clear()
        self._ends = None
        return held or None
