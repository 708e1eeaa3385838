"""Writes that keep a connection's unsent bytes within ``TCP_NOTSENT_LOWAT`` and one write.

The kernel checks ``TCP_NOTSENT_LOWAT`` only when a write needs a segment of
its own. A write that fits the last segment, one not sent yet, is appended to
it unchecked (up to 64 KiB on loopback): a listener that stops reading while
it is live finds tens of KiB parked in the kernel ahead of its next ping,
although every write was within the limit when it started. Linux never
appends to a segment whose write was flagged ``MSG_EOR`` (end of record), so
with the flag every write needs a segment of its own, the limit is checked
before each one, and past it the kernel refuses the write (``EAGAIN``): the
transport keeps the rest, under asyncio's flow control, where the fast path
sees it.

The transport has no way to pass a flag, so the writes go to its socket
through a ``socket.socket`` *borrowed* on the transport's own descriptor
(plain TCP only, never under TLS):
only while the transport holds nothing to write (then it would call ``send``
itself, with the same bytes in the same order), never while it is closing,
and never closed (``release`` forgets the descriptor; the transport owns it).
"""

from __future__ import annotations

import socket
import sys
from typing import Any

__all__ = ["BoundedWrites"]

_MSG_EOR: int = getattr(socket, "MSG_EOR", 0) if sys.platform == "linux" else 0
"""Where ``MSG_EOR`` ends a TCP segment for later writes (Linux); 0 elsewhere."""


class _Borrowed(socket.socket):
    """A socket object on a descriptor someone else owns: it never closes it."""

    __slots__ = ()

    def __del__(self) -> None:
        # socket.socket closes its descriptor when collected; this one is the
        # transport's, and may already be another connection's.
        self.detach()


class BoundedWrites:
    """Writes to one transport, each ending its TCP segment.

    Args:
        transport: the connection's asyncio transport.
        sock: a socket borrowed on the transport's descriptor.
    """

    __slots__ = ("_socket", "_transport")

    def __init__(self, transport: Any, sock: socket.socket) -> None:
        self._transport = transport
        self._socket: socket.socket | None = sock

    @classmethod
    def of(cls, transport: Any) -> BoundedWrites | None:
        """Bounded writes for ``transport``; None where the platform has no such
        flag, or the transport no TCP socket of its own: a TLS transport's
        socket carries records it encrypts, never the bytes it is given."""
        if not _MSG_EOR or transport.get_extra_info("ssl_object") is not None:
            return None
        extra = transport.get_extra_info("socket")
        if extra is None or extra.family not in (socket.AF_INET, socket.AF_INET6):
            return None
        try:
            borrowed = _Borrowed(fileno=extra.fileno())
            # Never wait in send(): a default timeout (socket.setdefaulttimeout) would
            # make a refused write block the event loop for that long.
            borrowed.settimeout(0.0)
        except (OSError, ValueError):
            return None
        return cls(transport, borrowed)

    def write(self, data: bytes) -> None:
        """Write ``data``: what the kernel refuses goes to the transport."""
        sock, transport = self._socket, self._transport
        if (
            sock is not None
            and not transport.get_write_buffer_size()
            and not transport.is_closing()
        ):
            try:
                sent = sock.send(data, _MSG_EOR)
            except OSError:
                # EAGAIN: the limit is reached, the transport waits for room. Any
                # other error the transport meets again, and reports its own way.
                sent = 0
            if sent == len(data):
                return
            data = data[sent:]
        transport.write(data)

    def release(self) -> None:
        """The connection is gone: forget its descriptor (never closed here)."""
        sock, self._socket = self._socket, None
        if sock is not None:
            sock.detach()
