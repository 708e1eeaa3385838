"""Where one listener connection is in the feed, and what is queued for it. No I/O.

A delivery is **live** while it keeps up: the fan-out offers it every new
batch it wants, and its bounded queue takes them. When a batch does not fit
(the listener reads slower than the feed is written, or not at all for a
while), the delivery **falls behind**: it keeps what it has queued, remembers
how far that goes (``cursor``) and leaves the fan-out. Its connection then
*catches up*: whenever the queue runs low it refills it from the shared
window of recent entries, or from the feed table when it is further back
(``catchup``), paced by its own socket. Once it reaches the head it rejoins
the fan-out in the same synchronous step, so nothing is skipped or sent
twice. A resume is a delivery that starts behind.

What a delivery holds does not grow with how far behind it is: a queue of at
most ``capacity`` references to shared items, and a few fields.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime

from changefeed.schemas import Position

from .entries import Item
from .inflight import InFlight
from .matching import Interest
from .wakeup import Wakeup

__all__ = ["Closing", "Delivery"]

FRAME_OVERHEAD = 4
"""Bytes a websocket frame adds to an item's text, near enough (an item under 64 KiB)."""


@dataclass(frozen=True, slots=True)
class Closing:
    """Why the publisher is closing a connection: close code, error code and message."""

    close_code: int
    error_code: str | None
    message: str
    retry_after: float | None = None
    """Seconds the listener should wait before registering again (with ``unavailable``)."""


class Delivery:
    """One connection's place in the feed and its send queue.

    Args:
        interest: what the connection registered for.
        start: the position it starts after (the head for a new listener, the
            resume cursor for one that resumes).
        head: the fan-out's position now: a delivery that starts at or after it is
            live (entries up to ``start`` are skipped); one that starts before it
            catches up first.
        capacity: the most items its queue holds.
        batch: the listener takes batch frames.
    """

    __slots__ = (
        "batch",
        "buffered",
        "capacity",
        "closing",
        "cursor",
        "cursor_published",
        "dropped",
        "ended",
        "frames",
        "in_flight",
        "interest",
        "live",
        "progress_at",
        "progress_mark",
        "queue",
        "ready",
        "send_now",
        "sending",
        "sent",
        "skip_until",
        "waiting_on_feed",
    )

    def __init__(
        self,
        interest: Interest,
        start: Position,
        head: Position,
        *,
        capacity: int,
        batch: bool = False,
    ) -> None:
        self.interest = interest
        self.capacity = capacity
        self.batch = batch
        # A list, not a deque: an empty deque allocates a 64-slot block, and ten
        # thousand idle listeners would hold megabytes of them.
        self.queue: list[Item] = []
        self.live = start >= head
        self.skip_until = start
        """While live: entries at or before this are not sent (a resume cursor
        ahead of this instance's tailer: another instance served them)."""
        self.cursor = start
        """While catching up: every wanted entry up to here has been queued."""
        self.cursor_published: datetime | None = None
        """When the entry at ``cursor`` was published (for the lag in seconds)."""
        self.ready = Wakeup()
        """Set while items are queued, while catching up, and once closing: the
        connection's sender has work."""
        if not self.live:
            self.ready.set()
        self.closing: Closing | None = None
        self.ended = Wakeup()
        """Set once the delivery is closing."""
        self.sending = 0
        """Items the connection's sender took and is writing through ASGI sends (0:
        none): nothing else may write meanwhile, or frames would overtake each other."""
        self.send_now: Callable[[], bool] | None = None
        """Set by a connection that can write synchronously: writes one turn of the
        queue now; True when nothing is left, False when its sender must go on."""
        self.buffered: Callable[[], int] | None = None
        """Set by a connection that can tell: bytes written that the listener has yet
        to take (in its transport's buffer and the kernel's send queue)."""
        self.in_flight: InFlight | None = None
        """Set by a connection that writes directly: its writes not yet taken."""
        self.waiting_on_feed = False
        """True while the sender waits for a page of the feed table (not the listener's fault)."""
        self.sent = 0
        """Items written to the socket (each item of a batch frame counts)."""
        self.frames = 0
        """Websocket frames written (a batch frame counts once)."""
        self.dropped = 0
        """Items lost when the connection closed: still queued, or taken for a send
        that failed."""
        self.progress_at = 0.0
        """When the listener last took something (see stall.StallWatch)."""
        self.progress_mark: tuple[int, int] = (0, 0)

    def __len__(self) -> int:
        return len(self.queue)

    @property
    def pending(self) -> bool:
        """True when there is something the listener has yet to take (queued, behind
        the head, or in a send under way)."""
        return bool(self.queue) or not self.live or self.sending > 0

    def untaken(self) -> int:
        """Items written that the listener has not taken yet (0 where the connection
        cannot tell: they count as taken once written)."""
        in_flight, buffered = self.in_flight, self.buffered
        if in_flight is None or buffered is None:
            return 0
        return in_flight.settle(buffered())

    def outstanding(self, untaken: int) -> int:
        """Items the listener has yet to take of those queued for it: queued, in a
        send under way, or ``untaken`` (written, not acknowledged)."""
        return len(self.queue) + self.sending + untaken

    def delivered(self) -> int:
        """Items the listener has taken."""
        return self.sent - self.untaken()

    def oldest_untaken(self) -> float | None:
        """When the oldest item written and not yet taken was published (as of the
        last ``untaken``)."""
        return self.in_flight.oldest() if self.in_flight is not None else None

    def offer(self, items: Sequence[Item]) -> bool:
        """Queue a live batch's items whole, or none of them (returns False: the
        caller makes the delivery fall behind)."""
        if len(self.queue) + len(items) > self.capacity:
            return False
        self.queue.extend(items)
        return True

    def fall_behind(self, position: Position) -> None:
        """Leave live delivery: everything wanted up to ``position`` is queued."""
        self.live = False
        self.cursor = max(position, self.skip_until)
        self.ready.set()

    def rejoin(self) -> None:
        """Back to live delivery at the head (``cursor``): later entries come from the fan-out."""
        self.live = True
        self.skip_until = self.cursor
        self.cursor_published = None
        if not self.queue and self.closing is None:
            self.ready.clear()

    def take(self, most: int, most_bytes: int = 0) -> list[Item]:
        """Remove and return up to ``most`` queued items (possibly none); with
        ``most_bytes``, no more than about that many bytes of frames, and at least
        one item (a listener that reads slower than it is written to gets no more
        than its kernel may hold unsent: what waits ahead of its pings)."""
        queue = self.queue
        if most_bytes:
            end, count, size = min(most, len(queue)), 0, 0
            while count < end and size < most_bytes:
                size += len(queue[count].text) + FRAME_OVERHEAD
                count += 1
            most = count
        if len(queue) <= most:
            taken, self.queue = queue, []
        else:
            taken = queue[:most]
            del queue[:most]
        if not self.queue and self.live and self.closing is None:
            self.ready.clear()
        return taken

    def wake(self) -> None:
        """Wake the sender if anything is queued."""
        if self.queue:
            self.ready.set()

    def close(self, closing: Closing) -> None:
        """Mark for closing (the first reason wins), drop what is queued, wake the sender."""
        if self.closing is not None:
            return
        self.closing = closing
        self.dropped += len(self.queue)
        self.queue.clear()
        self.ready.set()
        self.ended.set()
