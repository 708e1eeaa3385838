"""A flag one task waits on: ``asyncio.Event`` for a single waiter, at a fraction of its memory.

Every listener connection holds a few of these (its sender has work; its
connection should end). An ``asyncio.Event`` allocates a waiter ``deque``
(about 760 bytes) whether anyone waits or not; ten thousand idle listeners
would hold megabytes of empty deques. A ``Wakeup`` holds a flag, and a future
only while a task waits on it.
"""

from __future__ import annotations

import asyncio

__all__ = ["Wakeup"]


class Wakeup:
    """Set, clear, and wait until set; any number of tasks may wait at once."""

    __slots__ = ("_set", "_waiters")

    def __init__(self) -> None:
        self._set = False
        self._waiters: asyncio.Future[None] | list[asyncio.Future[None]] | None = None
        """The one waiter's future (the usual case), or the futures of several."""

    def is_set(self) -> bool:
        return self._set

    def set(self) -> None:
        """Set the flag and wake whoever waits."""
        if self._set:
            return
        self._set = True
        waiters, self._waiters = self._waiters, None
        if waiters is None:
            return
        for waiter in waiters if isinstance(waiters, list) else (waiters,):
            if not waiter.done():
                waiter.set_result(None)

    def clear(self) -> None:
        self._set = False

    async def wait(self) -> None:
        """Return once the flag is set (at once if it is)."""
        if self._set:
            return
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        waiters = self._waiters
        if waiters is None:
            self._waiters = waiter
        elif isinstance(waiters, list):
            waiters.append(waiter)
        else:
            self._waiters = [waiters, waiter]
        try:
            await waiter
        finally:
            self._forget(waiter)

    def _forget(self, waiter: asyncio.Future[None]) -> None:
        waiters = self._waiters
        if waiters is waiter:
            self._waiters = None
        elif isinstance(waiters, list) and waiter in waiters:
            waiters.remove(waiter)
            if not waiters:
                self._waiters = None
