"""Items written to a listener's connection that the listener has not taken yet. Pure code.

A direct write hands frames to the transport at once; they reach the listener
later, at its own pace, through the transport's buffer and the kernel's send
queue. What stats show of a listener (``delivered``, its lag, its queue
depth) must be what it has *taken*, not what waits in those buffers. The
connection knows how many bytes it wrote and how many of them its peer has
not yet acknowledged; this ledger of writes turns that into items.

The ledger stays small: a write is forgotten once its last byte was taken,
and what is outstanding is bounded by the transport's flow control and the
kernel's ``TCP_NOTSENT_LOWAT`` (changefeed.tcp_liveness). Past
``CROWDED`` writes the connection settles it (one look at the socket); if
that leaves it crowded, the two oldest writes are merged, which can only make
the listener look further behind than it is, never ahead.
"""

from __future__ import annotations

from collections import deque

__all__ = ["InFlight"]


class InFlight:
    """The writes to one connection whose bytes its peer has yet to take."""

    CROWDED = 64
    """Writes remembered before the connection should ``settle``."""

    __slots__ = ("_marks", "_taken", "items", "written")

    def __init__(self) -> None:
        self._marks: deque[tuple[int, int, float]] | None = None
        """Per outstanding write: the stream offset its last byte ends at, items
        written through it, and when its first item was published."""
        self.written = 0
        """Bytes written."""
        self.items = 0
        """Items written."""
        self._taken = 0

    def wrote(self, size: int, items: int, first_published: float) -> None:
        """Record a write of ``size`` bytes carrying ``items`` items (the first of
        them published at ``first_published``, POSIX seconds)."""
        self.written += size
        self.items += items
        marks = self._marks
        if marks is None:
            marks = self._marks = deque()
        elif len(marks) > 2 * self.CROWDED:
            _, _, published = marks.popleft()
            later = marks.popleft()
            marks.appendleft((later[0], later[1], published))
        marks.append((self.written, self.items, first_published))

    @property
    def crowded(self) -> bool:
        """True when the connection should ``settle`` the ledger now."""
        return self._marks is not None and len(self._marks) > self.CROWDED

    def settle(self, outstanding: int) -> int:
        """Items written and not taken, given ``outstanding``: bytes written that the
        peer has not acknowledged (still in the transport or the kernel)."""
        marks = self._marks
        if marks:
            taken_through = self.written - outstanding
            while marks and marks[0][0] <= taken_through:
                self._taken = marks.popleft()[1]
            if not marks:
                self._marks = None  # an idle connection keeps no deque
        else:
            self._taken = self.items
        return self.items - self._taken

    def oldest(self) -> float | None:
        """When the oldest item not yet taken was published (as of the last ``settle``)."""
        marks = self._marks
        return marks[0][2] if marks else None
