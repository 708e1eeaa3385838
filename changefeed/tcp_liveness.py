"""Is the peer of a TCP connection alive, though it has not answered a ping yet?

A websocket ping waits behind every frame sent before it. A listener that
reads slowly, far behind a backlog of frames in the kernel's buffers, answers
a ping only once it has read that far, which may take longer than the ping
timeout: it is alive, and reading. Its TCP stack, though, acknowledges each
segment as it arrives. This asks the kernel (Linux) whether data is still in
flight to the peer and when the peer last acknowledged some: data in flight
and a recent acknowledgement mean the peer's host is there, and whether its
application keeps up is for the publisher's stall timeout to judge.
"""

from __future__ import annotations

import contextlib
import fcntl
import socket
import struct
import termios
from typing import Any

__all__ = ["acked_while_sending", "unacked_bytes"]

_TCP_INFO_SIZE = 104
_LAST_ACK_RECV = 56
"""Offset of ``tcpi_last_ack_recv`` (milliseconds, u32) in Linux's ``struct tcp_info``:
eight u8 fields, nine u32 fields, then last_data_sent, last_ack_sent,
last_data_recv and last_ack_recv; unchanged since Linux 2.6."""


def unacked_bytes(sock: Any) -> int:
    """Bytes sent on ``sock`` that its peer has not acknowledged yet (0 when it
    cannot tell)."""
    if sock is None:
        return 0
    with contextlib.suppress(OSError, ValueError, struct.error):
        outq = fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, b"\0\0\0\0")
        unacked: int = struct.unpack("i", outq)[0]
        return unacked
    return 0


def acked_while_sending(sock: Any, within: float) -> bool:
    """True when ``sock`` has sent data its peer has not yet acknowledged, and the
    peer acknowledged something within the last ``within`` seconds. False when it
    cannot tell (not Linux, not TCP, the socket is gone)."""
    if sock is None or not hasattr(socket, "TCP_INFO"):
        return False
    with contextlib.suppress(OSError, ValueError, struct.error):
        outq = fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, b"\0\0\0\0")
        unacked: int = struct.unpack("i", outq)[0]
        info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, _TCP_INFO_SIZE)
        last_ack_ms: int = struct.unpack_from("I", info, _LAST_ACK_RECV)[0]
        return unacked > 0 and last_ack_ms < within * 1000
    return False
