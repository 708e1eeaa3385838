"""Is a websocket peer that has not answered a ping yet alive? And what the kernel holds for it.

A websocket ping waits behind every byte sent before it. A listener that
reads slowly, behind a backlog, answers a ping only once it has read that
far: it is alive, and reading. Two things keep that wait short and tell it
apart from a dead peer:

* ``set_notsent_lowat``: the kernel keeps about this many bytes *unsent* for
  the connection (``TCP_NOTSENT_LOWAT``, Linux and the BSDs), and
  ``unsent_bytes`` says how many it holds, by which the fast path holds its
  writes; the rest waits in the publisher, which paces it (catch-up), so a
  ping or a pong written now is behind that much and the peer's own receive
  buffer, not behind megabytes.
* ``PingWatch`` (pure): when a ping's deadline passes without its pong, the
  connection is still alive if it made progress meanwhile: its TCP
  acknowledged more of the stream (the listener read, and its window let
  more in), or it sent anything (its own pings, heartbeats). The ping
  decides only after ``PATIENCE + 1`` deadlines in a row without either (60 s
  at the defaults, as long as the publisher's stall timeout gives a listener
  that takes nothing): once everything sent has been acknowledged, a
  listener reading its way through its own receive buffer shows nothing on
  this side, and on loopback its window reopens only after it has read a
  whole segment (64 KiB).

``bytes_acked`` reads what ``PingWatch`` needs from Linux's
``struct tcp_info``; elsewhere it is None, and only what the peer sends
counts as progress.
"""

from __future__ import annotations

import contextlib
import fcntl
import socket
import struct
import sys
import termios
from typing import Any

__all__ = [
    "NOTSENT_LOWAT",
    "PingWatch",
    "bytes_acked",
    "notsent_lowat",
    "set_notsent_lowat",
    "unacked_bytes",
    "unsent_bytes",
]

NOTSENT_LOWAT = 8 * 1024
"""Default bytes the kernel may hold unsent for one listener connection. The
kernel checks it only when a write needs a new segment, and appends to the
last one (on loopback up to 64 KiB) unchecked: so the fast path ends a segment
with each write (changefeed.bounded_writes), holds its writes to a listener
that is behind while the kernel holds this much, and cuts their turns to it
(changefeed.uvicorn_fastpath). What waits ahead of a ping
then stays under about twice this (bench/keepalive.py, ``--notsent-lowat`` to
compare); through plain ASGI up to one segment more."""

_TCP_NOTSENT_LOWAT: int | None = getattr(socket, "TCP_NOTSENT_LOWAT", None)

_SIOCOUTQNSD = 0x894B if sys.platform == "linux" else None
"""Linux's ioctl for the bytes of a TCP socket's send queue not sent yet
(``linux/sockios.h``); Python's ``termios`` does not name it."""

_TCP_INFO_SIZE = 128
_BYTES_ACKED = 120
"""Offset of ``tcpi_bytes_acked`` (u64) in Linux's ``struct tcp_info`` (since 4.1)."""


def set_notsent_lowat(sock: Any, limit: int) -> bool:
    """Keep at most about ``limit`` unsent bytes in ``sock``'s kernel send queue.

    Set on a listening socket, it holds for every connection accepted from then
    on. False where the platform has no such option (then the host's setting,
    ``net.ipv4.tcp_notsent_lowat`` on Linux, is what holds).
    """
    if _TCP_NOTSENT_LOWAT is None or sock is None:
        return False
    try:
        sock.setsockopt(socket.IPPROTO_TCP, _TCP_NOTSENT_LOWAT, limit)
    except (OSError, ValueError):
        return False
    return True


def notsent_lowat(sock: Any) -> int | None:
    """``sock``'s own ``TCP_NOTSENT_LOWAT`` (0: not set, the host's setting holds);
    None where it cannot be read."""
    if _TCP_NOTSENT_LOWAT is None or sock is None:
        return None
    with contextlib.suppress(OSError, ValueError):
        value: int = sock.getsockopt(socket.IPPROTO_TCP, _TCP_NOTSENT_LOWAT)
        return value
    return None


def unacked_bytes(sock: Any) -> int:
    """Bytes in ``sock``'s kernel send queue: sent and not acknowledged yet, or not
    sent yet (0 when it cannot tell)."""
    if sock is None:
        return 0
    with contextlib.suppress(OSError, ValueError, struct.error):
        outq = fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, b"\0\0\0\0")
        unacked: int = struct.unpack("i", outq)[0]
        return unacked
    return 0


def unsent_bytes(sock: Any) -> int | None:
    """Bytes in ``sock``'s kernel send queue not sent yet: what ``TCP_NOTSENT_LOWAT``
    bounds (None where the kernel cannot tell)."""
    if sock is None or _SIOCOUTQNSD is None:
        return None
    with contextlib.suppress(OSError, ValueError, struct.error):
        outq = fcntl.ioctl(sock.fileno(), _SIOCOUTQNSD, b"\0\0\0\0")
        unsent: int = struct.unpack("i", outq)[0]
        return unsent
    return None


def bytes_acked(sock: Any) -> int | None:
    """Bytes ``sock``'s peer acknowledged so far; None where the kernel cannot tell
    (not Linux, not TCP, the socket is gone)."""
    if sock is None or not hasattr(socket, "TCP_INFO"):
        return None
    with contextlib.suppress(OSError, ValueError, struct.error):
        info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, _TCP_INFO_SIZE)
        if len(info) >= _BYTES_ACKED + 8:
            acked: int = struct.unpack_from("Q", info, _BYTES_ACKED)[0]
            return acked
    return None


class PingWatch:
    """Decides, when a ping's deadline passes, whether its connection is alive. Pure code.

    ``sent`` when a ping goes out; ``expired`` at each deadline after it: False
    means alive (wait one more deadline), True means the ping decides (fail the
    connection).
    """

    PATIENCE = 2
    """Deadlines in a row without progress that a ping waits past before the next
    one decides."""

    __slots__ = ("_acked", "_idle", "_received")

    def __init__(self) -> None:
        self._acked: int | None = None
        self._received = 0
        self._idle = 0

    def sent(self, acked: int | None, received: int) -> None:
        """A ping went out; ``acked``: bytes the peer's TCP had acknowledged then,
        ``received``: bytes the peer had sent."""
        self._acked = acked
        self._received = received
        self._idle = 0

    def expired(self, acked: int | None, received: int) -> bool:
        """The deadline passed without a pong: True once ``PATIENCE + 1`` deadlines in
        a row showed no progress."""
        took = acked is not None and self._acked is not None and acked > self._acked
        heard = received > self._received
        self._acked, self._received = acked, received
        if took or heard:
            self._idle = 0
            return False
        self._idle += 1
        return self._idle > self.PATIENCE
