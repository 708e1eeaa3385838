"""Through plain ASGI, when a listener's sends wait for its kernel, and how big its turns are.

Close to the fast path's rule for direct writes (``_DirectSender.wrote`` in
``connection``): a listener with items still queued after a turn, or
catching up, gets one look at its kernel after each turn (two system calls,
against the dozens of microseconds of an ASGI send); once that look finds
the kernel holding its unsent limit, its turns are cut to that limit and the
next one waits until the kernel holds less (changefeed.unsent_hold), until
it is live with nothing queued. A live listener with nothing queued is
written to in full turns, with no look: its backlog is bounded by its queue.
What waits ahead of a listener's pings is then the limit and one turn, not
the server's transport buffer too.

Unlike the fast path, a live listener with a queue is looked at too: through
plain ASGI, a listener that stops reading fills the server's transport
(64 KiB) while it is still live, before its queue overflows; on the fast path
the transport holds 4 KiB.

The connection's socket is asked for when the listener first falls behind
(``find``), and found by a shared pass off the event loop
(publisher.peer_sockets); until then, and where it is not found, sends go
unheld, as before.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Protocol

from .delivery import Delivery

__all__ = ["HeldSends", "KernelHold"]


class KernelHold(Protocol):
    """A connection's kernel, as ``HeldSends`` looks at it (changefeed.unsent_hold)."""

    @property
    def limit(self) -> int:
        """Bytes of a turn, and what the kernel may hold unsent before sends wait."""

    def too_much(self) -> bool:
        """True while the kernel holds ``limit`` bytes or more unsent."""

    async def room(self) -> None:
        """Wait, a bounded time, for the kernel to take more."""


class HeldSends:
    """When one plain-ASGI listener's sends wait for its kernel.

    Args:
        find: asks for the connection's socket; called once, when the listener
            first falls behind.
    """

    __slots__ = ("_find", "_found", "_hold", "_wait", "holding")

    def __init__(self, find: Callable[[], asyncio.Future[KernelHold | None]]) -> None:
        self._find: Callable[[], asyncio.Future[KernelHold | None]] | None = find
        self._found: asyncio.Future[KernelHold | None] | None = None
        self._hold: KernelHold | None = None
        self._wait = False
        self.holding = False
        """A turn found the kernel holding its limit since the listener was last live
        with nothing queued: turns are cut to the limit."""

    def most_bytes(self) -> int:
        """Bytes of frames the next turn takes at most (0: a full turn)."""
        return self._hold.limit if self.holding and self._hold is not None else 0

    async def before_turn(self, delivery: Delivery) -> None:
        """Wait while the last turn left the kernel holding its limit, until the
        kernel takes more or the delivery closes."""
        hold = self._hold
        if not self._wait or hold is None:
            return
        self._wait = False
        while delivery.closing is None and hold.too_much():
            await hold.room()

    def after_turn(self, delivery: Delivery) -> None:
        """A turn went out: look at the kernel if the listener is behind."""
        if delivery.live and not delivery.queue:
            self.holding = False  # live, nothing queued: full turns again
            return
        hold = self._kernel()
        if hold is not None and hold.too_much():
            self.holding = self._wait = True

    def _kernel(self) -> KernelHold | None:
        if self._hold is not None:
            return self._hold
        if self._find is not None:
            self._found, self._find = self._find(), None
        found = self._found
        if found is None or not found.done() or found.cancelled():
            return None
        self._found = None
        self._hold = found.result()
        if self._hold is None:
            self._find = None  # not found: unheld for good
        return self._hold
