"""Catch-up: refilling the queue of a listener that is behind, from the window or the feed.

A delivery that fell behind (or started behind: a resume) is refilled by its
own connection's sender whenever its queue runs dry, so it is paced by its
own socket and by nothing else. ``fill`` takes the next items it wants from
the window of recent entries, synchronously; when the listener is further
back than the window holds, ``load`` reads a page of the feed table (shared
with every listener near that position, see ``pages``). Once the listener's
position reaches the head, ``fill`` hands it back to the fan-out in the same
synchronous step: the window's head *is* the fan-out's position, so the next
batch the tailer dispatches is exactly the first one it has not been sent.

What a listener is sent never depends on which of the three ways (live, the
window, the feed) it came: the same entries, the same items, in feed order.

The window and live delivery hand out copies made when the tailer read them;
the compaction job may have widened an entry since. Below the job's rewrite
floor (``FeedPages.floor``, learnt from every page and every resume) a
listener that is behind reads the table, never the window, and rejoins live
delivery only past the floor: having read a stretch of the table after a
merge, it must not then take the merge's keeper from a copy made before it
(docs/compaction.md, "Publishers' copies").
"""

from __future__ import annotations

from bisect import bisect_right
from enum import Enum

from changefeed.schemas import Position

from .delivery import Delivery
from .entries import Chunk
from .fanout import Fanout
from .feed import Rewrites
from .pages import FeedPages
from .window import Window

__all__ = ["Catchup", "Filled"]

_CHUNKS_PER_FILL = 16
"""Chunks one fill looks through at most: a listener of a rare resource, far
behind, walks the window a few chunks per turn, never all of it at once."""


class Filled(Enum):
    """What ``Catchup.fill`` did."""

    QUEUED = "queued"
    """Items were queued (or there were none to queue yet): the sender writes them."""
    REJOINED = "rejoined"
    """The listener reached the head and is live again."""
    NEEDS_FEED = "needs_feed"
    """The listener is behind the window: ``load`` a page of the feed table."""


class Catchup:
    """Refills deliveries that are behind.

    Args:
        window: the recent entries.
        fanout: live delivery, which a listener rejoins at the head.
        pages: the feed table's pages, for listeners behind the window.
    """

    def __init__(self, window: Window, fanout: Fanout, pages: FeedPages) -> None:
        self._window = window
        self._fanout = fanout
        self._pages = pages
        self.from_window = 0
        """Items queued from the window."""
        self.from_feed = 0
        """Items queued from pages of the feed table."""
        self.rejoined = 0
        """Times a listener that was behind rejoined live delivery."""

    @property
    def floor(self) -> Position:
        """Positions a listener that is behind reads from the table, never from
        memory (``FeedPages.floor``)."""
        return self._pages.floor

    def observe(self, rewrites: Rewrites) -> None:
        """Take the compaction job's rewrites a resume's facts brought (``FeedPages.observe``)."""
        self._pages.observe(rewrites)

    def fill(self, delivery: Delivery, most: int) -> Filled:
        """Queue up to ``most`` items ``delivery`` wants next, from the window,
        looking through at most ``_CHUNKS_PER_FILL`` chunks (the caller yields
        between two fills)."""
        window = self._window
        floor = self._pages.floor
        queued = 0
        for _ in range(_CHUNKS_PER_FILL):
            if queued >= most:
                break
            found = window.find(delivery.cursor) if delivery.cursor >= floor else None
            if found is None:
                if delivery.cursor >= window.head and delivery.cursor >= floor:
                    self._fanout.join(delivery)
                    delivery.rejoin()
                    self.rejoined += 1
                    return Filled.REJOINED
                return Filled.QUEUED if queued else Filled.NEEDS_FEED
            taken = _take(found[0], delivery, most - queued)
            queued += taken
            self.from_window += taken
        return Filled.QUEUED

    async def load(self, delivery: Delivery, most: int) -> None:
        """Queue up to ``most`` items from the page of the feed table after ``delivery``'s
        position. Pages reach as far as where the window begins, or the rewrite
        floor when that is further (every entry up to it is final: the job
        announced it from its own snapshot): from there on the window has the
        entries, in memory.

        Raises:
            pages.CursorExpired: the feed was trimmed past the listener's position.
            Exception: the read failed (the database is away); the caller retries.
        """
        delivery.waiting_on_feed = True
        try:
            upto = max(self._window.base, self._pages.floor)
            resources = sorted(delivery.interest.resources)
            page = await self._pages.page(resources, delivery.cursor, upto)
        finally:
            delivery.waiting_on_feed = False
        if not delivery.live and delivery.closing is None and page.covers(delivery.cursor):
            self.from_feed += _take(page, delivery, most)


def _take(chunk: Chunk, delivery: Delivery, most: int) -> int:
    """Queue the next items of ``chunk`` that ``delivery`` wants (at most ``most``),
    and move its position past what was looked at."""
    selection = chunk.selection(delivery.interest)
    start = bisect_right(selection.positions, delivery.cursor)
    end = start + most
    items = selection.items[start:end]
    delivery.queue.extend(items)
    if end < len(selection.positions):
        delivery.cursor = selection.positions[end - 1]
        delivery.cursor_published = chunk.entries[selection.indexes[end - 1]].published
    else:
        delivery.cursor = chunk.through
        if chunk.entries:
            delivery.cursor_published = chunk.entries[-1].published
    return len(items)
