"""Waiting, through plain ASGI, until a connection's kernel holds less than its limit unsent.

On the fast path the publisher writes to the transport and watches the kernel
itself (changefeed.uvicorn_fastpath). Through plain ASGI it writes through a
server it does not see into: an ASGI send returns once the server's transport
took the frame, and the transport holds up to 64 KiB (asyncio's default) before
it makes a send wait. A listener that reads slower than it is written to then
has that much, and what the kernel appends to its last segment, ahead of every
ping and pong: at 100 items/s, seconds.

The connection's socket is the server's, but it is the process's own: found
among its descriptors (changefeed.port_sockets.find_connections), the kernel
says how much it holds unsent (``SIOCOUTQNSD``). A sender to a listener that
is behind sends a turn no bigger than the limit, then waits while the kernel
holds the limit or more: the socket polls writable when less than half of it
is left (``TCP_NOTSENT_LOWAT``), and by then the server's transport, woken by
the same poll, has handed the kernel what it held, so what is left unsent is
looked at once it has. What waits ahead of a ping is then about the limit and
one turn, as on the fast path; the rest waits in the publisher's queue.

The descriptor is the server's own, never kept open by this module: each look
first checks that it still names the socket found (its inode), and a wait
polls a duplicate that is closed when the wait ends.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import stat

from .port_sockets import PeerSocket
from .tcp_liveness import unsent_bytes

__all__ = ["RECHECK", "UnsentHold"]

RECHECK = 1.0
"""Seconds a wait lasts at most before the kernel is asked again (a poll that never
comes: a listener that stopped reading is for the publisher's stall timeout)."""


class UnsentHold:
    """The kernel's unsent bytes of one connection a plain-ASGI server accepted."""

    __slots__ = ("_fd", "_inode", "gone", "limit")

    def __init__(self, found: PeerSocket) -> None:
        self._fd = found.fd
        self._inode = found.inode
        self.limit = found.notsent_lowat
        """The socket's own ``TCP_NOTSENT_LOWAT``: the most a turn holds, and what
        the kernel may hold before sends wait."""
        self.gone = False
        """The descriptor no longer names the socket found (the server closed it)."""

    def too_much(self) -> bool:
        """True while the kernel holds ``limit`` bytes or more unsent."""
        if not self._same_socket():
            return False
        unsent = unsent_bytes(self._fd)
        return unsent is not None and unsent >= self.limit

    async def room(self) -> None:
        """Wait until the socket polls writable and what the server's transport then
        handed the kernel leaves it under ``limit``; at most ``RECHECK`` seconds."""
        if not self._same_socket():
            return
        try:
            # A descriptor of its own: the server's transport registered the server's
            # with the loop, and a second registration would replace the transport's.
            watched = os.dup(self._fd)
        except OSError:
            self.gone = True
            return
        loop = asyncio.get_running_loop()
        room: asyncio.Future[None] = loop.create_future()

        def look() -> None:
            if not room.done() and not self.too_much():
                room.set_result(None)

        def writable() -> None:
            # The transport's writer may run after this one in the same poll.
            loop.call_soon(look)

        try:
            loop.add_writer(watched, writable)
        except (OSError, ValueError, NotImplementedError):
            os.close(watched)
            self.gone = True  # a loop that cannot watch it: sends go unheld
            return
        try:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(RECHECK):
                    await room
        finally:
            loop.remove_writer(watched)
            os.close(watched)

    def _same_socket(self) -> bool:
        if self.gone:
            return False
        try:
            status = os.fstat(self._fd)
        except OSError:
            status = None
        if status is None or not stat.S_ISSOCK(status.st_mode) or status.st_ino != self._inode:
            self.gone = True
        return not self.gone
