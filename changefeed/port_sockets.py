"""``TCP_NOTSENT_LOWAT`` on the sockets of a server the publisher does not start.

Embedded in an API, the publisher speaks plain ASGI to a server it neither
started nor configured (``uvicorn vmapi:app``, hypercorn, granian), and ASGI
hands it no socket. Without a bound on what the kernel holds unsent, a
listener that falls behind has megabytes queued ahead of every ping and pong
(changefeed.tcp_liveness): a listener that is reading, only late, is cut off
by its own keepalive or by the server's.

The sockets are the process's own, so the operating system lists them: when
the first listener connects through a local port, ``bound_unsent`` finds that
port's sockets among the process's file descriptors, sets the bound on its
listening sockets (every connection accepted from then on inherits it) and on
the connections already accepted. A socket that already has a bound of its own
(the server's, or the embedder's) keeps it. Where the descriptors cannot be
listed, or the platform has no such option, nothing changes, and the host's
setting (``net.ipv4.tcp_notsent_lowat`` on Linux) is what holds.

Which descriptors are the port's is read from Linux's ``/proc`` (the socket
inodes bound to the port, and the descriptors naming those inodes) without
touching any other descriptor of the process: wrapping a descriptor in a
Python socket can change its blocking mode (``socket.setdefaulttimeout``),
which would break whoever owns it. Only the port's own are wrapped, each a
duplicate closed at once, with its file status flags put back.
"""

from __future__ import annotations

import fcntl
import os
import socket
from collections.abc import Iterator
from dataclasses import dataclass

from .tcp_liveness import notsent_lowat, set_notsent_lowat

__all__ = ["Bounded", "bound_unsent"]

_FDS = "/proc/self/fd"
_TCP_TABLES = ("/proc/self/net/tcp", "/proc/self/net/tcp6")
_LISTEN = "0A"
"""``st`` of a listening socket in the TCP tables (TCP_LISTEN)."""


@dataclass(frozen=True, slots=True)
class Bounded:
    """What ``bound_unsent`` found on a port, and did."""

    listening: int
    """Listening sockets found."""
    connections: int
    """Connections already accepted, found."""
    bounded: int
    """Of these, the sockets it set the bound on (the others had one, or refused)."""


def bound_unsent(port: int, limit: int) -> Bounded | None:
    """Set ``TCP_NOTSENT_LOWAT`` to ``limit`` on this process's TCP sockets of local
    ``port`` that have none; None where the process's sockets cannot be listed (not
    Linux). It reads ``/proc``: run it off the event loop."""
    inodes = _port_inodes(port)
    if inodes is None:
        return None
    listening = connections = bounded = 0
    for fd, is_listening in _descriptors(inodes):
        sock = _borrow(fd)
        if sock is None:
            continue
        with sock:
            if is_listening:
                listening += 1
            else:
                connections += 1
            if notsent_lowat(sock) == 0 and set_notsent_lowat(sock, limit):
                bounded += 1
    return Bounded(listening, connections, bounded)


def _port_inodes(port: int) -> dict[int, bool] | None:
    """Inodes of the TCP sockets bound to local ``port`` (in this network namespace),
    each with whether it is listening; None where the tables cannot be read."""
    found: dict[int, bool] = {}
    read_any = False
    for table in _TCP_TABLES:
        try:
            with open(table, encoding="ascii", errors="replace") as rows:
                next(rows, None)  # the header
                read_any = True
                for row in rows:
                    fields = row.split()
                    if len(fields) < 10:
                        continue
                    _, _, local_port = fields[1].rpartition(":")
                    if int(local_port, 16) == port and fields[9] != "0":
                        found[int(fields[9])] = fields[3] == _LISTEN
        except (OSError, ValueError):
            continue
    return found if read_any else None


def _descriptors(inodes: dict[int, bool]) -> Iterator[tuple[int, bool]]:
    """This process's descriptors of those socket inodes, with whether listening."""
    try:
        names = os.listdir(_FDS)
    except OSError:
        return
    for name in names:
        try:
            target = os.readlink(f"{_FDS}/{name}")
        except OSError:
            continue
        if target.startswith("socket:[") and target.endswith("]"):
            inode = int(target[8:-1])
            if inode in inodes:
                yield int(name), inodes[inode]


def _borrow(fd: int) -> socket.socket | None:
    """A Python socket on a duplicate of ``fd`` (closing it leaves ``fd`` open), the
    descriptor's status flags as they were; None if it is gone or not a socket now."""
    try:
        dup = os.dup(fd)
    except OSError:
        return None
    try:
        flags = fcntl.fcntl(dup, fcntl.F_GETFL)
        sock = socket.socket(fileno=dup)
    except OSError:
        os.close(dup)
        return None
    try:
        fcntl.fcntl(dup, fcntl.F_SETFL, flags)
    except OSError:
        sock.close()
        return None
    if sock.family not in (socket.AF_INET, socket.AF_INET6) or sock.type != socket.SOCK_STREAM:
        sock.close()
        return None
    return sock
