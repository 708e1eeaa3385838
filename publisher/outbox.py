"""A listener connection's bounded send queue. Pure code (asyncio only for the wake-up event).

The tailer puts already-encoded frames into every matching listener's outbox
and never waits: when an outbox is full, ``offer`` says so and the caller
evicts that listener (invariant I3). Each connection's sender drains its own
outbox, taking several frames at once when they are waiting, so that a
listener that negotiated ``batch`` gets them in one websocket frame.

The outbox holds references to frames, never copies: a frame is encoded once
per entry and shared by every outbox it is queued in, so a full outbox costs
``capacity`` pointers, whatever the number of listeners.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable, Sequence

__all__ = ["Outbox"]


class Outbox:
    """Bounded FIFO of encoded change items for one connection.

    Args:
        capacity: the most frames it holds; beyond that ``offer`` refuses.
    """

    __slots__ = (
        "_closed_future",
        "_frames",
        "capacity",
        "closed",
        "offered",
        "ready",
        "refused",
        "send_now",
        "sending",
    )

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._frames: deque[str] = deque()
        self.ready = asyncio.Event()
        """Set while frames are queued (after ``wake``) or once closed; the sender awaits it."""
        self.closed = False
        self._closed_future: asyncio.Future[None] | None = None
        self.offered = 0
        self.refused = 0
        self.sending = False
        """True while the connection's sender is writing frames it took (an ASGI send
        in progress): nothing else may write to the connection meanwhile, or frames
        would overtake each other."""
        self.send_now: Callable[[], bool] | None = None
        """Set by a connection that can write synchronously (changefeed.publisher.wire):
        writes one turn of what is queued now; True when nothing is left, False when
        the sender must be woken for the rest."""

    def __len__(self) -> int:
        return len(self._frames)

    def offer(self, frame: str) -> bool:
        """Queue ``frame`` unless full; never blocks. Returns False when full."""
        return self.offer_many((frame,))

    def offer_many(self, frames: Sequence[str], wake: bool = True) -> bool:
        """Queue all of ``frames``, or none of them when they do not fit (returns False).

        Args:
            frames: encoded change items, in feed order.
            wake: wake the sender now; with False the caller calls ``wake`` later
                (the publisher wakes many outboxes at once, see Publisher._flush).

        A closed outbox takes nothing and refuses nothing: its connection is going away.
        """
        if self.closed:
            return True
        if len(self._frames) + len(frames) > self.capacity:
            self.refused += len(frames)
            return False
        self._frames.extend(frames)
        self.offered += len(frames)
        if wake:
            self.ready.set()
        return True

    def wake(self) -> None:
        """Wake the sender if anything is queued."""
        if self._frames:
            self.ready.set()

    def take(self, most: int) -> list[str]:
        """Remove and return up to ``most`` frames (possibly none)."""
        frames = self._frames
        if len(frames) <= most:
            taken = list(frames)
            frames.clear()
        else:
            popleft = frames.popleft
            taken = [popleft() for _ in range(most)]
        if not frames and not self.closed:
            self.ready.clear()
        return taken

    async def wait(self) -> None:
        """Return once at least one frame is queued, or the outbox is closed."""
        await self.ready.wait()

    def closing(self) -> asyncio.Future[None]:
        """A future that is done once the outbox is closed (made on first use, in the loop)."""
        if self._closed_future is None:
            self._closed_future = asyncio.get_running_loop().create_future()
            if self.closed:
                self._closed_future.set_result(None)
        return self._closed_future

    def close(self) -> int:
        """Drop every queued frame, refuse nothing from now on, and wake the sender.

        Returns:
            the number of frames dropped.
        """
        dropped = len(self._frames)
        self._frames.clear()
        self.closed = True
        self.ready.set()
        if self._closed_future is not None and not self._closed_future.done():
            self._closed_future.set_result(None)
        return dropped
