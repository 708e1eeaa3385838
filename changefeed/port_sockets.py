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
"""

from __future__ import annotations

import os
import socket
import stat
from collections.abc import Iterator
from dataclasses import dataclass

from .tcp_liveness import notsent_lowat, set_notsent_lowat

__all__ = ["Bounded", "bound_unsent"]

_FD_DIRS = ("/proc/self/fd", "/dev/fd")


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
    ``port`` that have none; None where the process's descriptors cannot be listed."""
    found = [0, 0, 0]
    listed = False
    for sock in _port_sockets(port):
        listed = True
        with sock:
            listening = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN) != 0
            found[0 if listening else 1] += 1
            if notsent_lowat(sock) == 0 and set_notsent_lowat(sock, limit):
                found[2] += 1
    if not listed and not any(os.path.isdir(d) for d in _FD_DIRS):
        return None
    return Bounded(*found)


def _port_sockets(port: int) -> Iterator[socket.socket]:
    """This process's TCP sockets (IPv4 and IPv6) bound to local ``port``, each a
    duplicate descriptor the caller closes (closing it leaves the server's open)."""
    for directory in _FD_DIRS:
        try:
            names = os.listdir(directory)
        except OSError:
            continue
        for name in names:
            sock = _tcp_socket(int(name)) if name.isdigit() else None
            if sock is None:
                continue
            try:
                mine = sock.getsockname()[1] == port
            except OSError:
                mine = False
            if mine:
                yield sock
            else:
                sock.close()
        return


def _tcp_socket(fd: int) -> socket.socket | None:
    try:
        if not stat.S_ISSOCK(os.fstat(fd).st_mode):
            return None
        sock = socket.socket(fileno=os.dup(fd))
    except OSError:
        return None
    if sock.family in (socket.AF_INET, socket.AF_INET6) and sock.type == socket.SOCK_STREAM:
        return sock
    sock.close()
    return None
