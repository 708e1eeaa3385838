"""A listener connection's bounded send queue. Pure code (asyncio only for the wake-up event).

The tailer puts already-encoded frames into every matching listener's outbox
and never waits: when an outbox is full, ``offer`` says so and the caller
evicts that listener (invariant I3). Each connection's sender drains its own
outbox, taking several frames at once when they are waiting, so that a
listener that negotiated ``batch`` gets them in one websocket frame.
"""

from __future__ import annotations

import asyncio
from collections import deque

__all__ = ["Outbox"]


class Outbox:
    """Bounded FIFO of encoded change items for one connection.

    Args:
        capacity: the most frames it holds; beyond that ``offer`` refuses.
    """

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._frames: deque[str] = deque()
        self._ready = asyncio.Event()
        self.offered = 0
        self.refused = 0

    def __len__(self) -> int:
        return len(self._frames)

    def offer(self, frame: str) -> bool:
        """Queue ``frame`` unless full; never blocks. Returns False when full."""
        if len(self._frames) >= self.capacity:
            self.refused += 1
            return False
        self._frames.append(frame)
        self.offered += 1
        self._ready.set()
        return True

    def take(self, most: int) -> list[str]:
        """Remove and return up to ``most`` frames (possibly none)."""
        frames = self._frames
        count = min(most, len(frames))
        taken = [frames.popleft() for _ in range(count)]
        if not frames:
            self._ready.clear()
        return taken

    async def wait(self) -> None:
        """Return once at least one frame is queued."""
        await self._ready.wait()

    def clear(self) -> None:
        self._frames.clear()
        self._ready.clear()
