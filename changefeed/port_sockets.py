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
import ipaddress
import os
import socket
import sys
from collections.abc import Collection, Iterator, Mapping
from dataclasses import dataclass
from typing import TypeVar

from .tcp_liveness import notsent_lowat, set_notsent_lowat

__all__ = ["Bounded", "PeerSocket", "bound_unsent", "find_connections"]

_T = TypeVar("_T")

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


@dataclass(frozen=True, slots=True)
class PeerSocket:
    """Where this process holds one accepted connection: the server's own descriptor,
    not a duplicate (a duplicate would keep the connection open after the server
    closed it), and the socket's inode, by which a later look tells whether the
    descriptor still names that socket (``os.fstat(fd).st_ino``)."""

    fd: int
    inode: int
    notsent_lowat: int
    """The socket's own ``TCP_NOTSENT_LOWAT`` when found (0: none)."""


def find_connections(
    port: int, peers: Collection[tuple[str, int]], limit: int = 0
) -> dict[tuple[str, int], PeerSocket] | None:
    """This process's connections accepted on local ``port`` from each of ``peers``
    (``(host, port)``, as an ASGI scope's ``client``), by peer, each given
    ``TCP_NOTSENT_LOWAT`` ``limit`` if it has none; None where the process's
    sockets cannot be listed (not Linux). One reading of ``/proc`` for all of
    them: run it off the event loop."""
    rows = _rows()
    if rows is None:
        return None
    wanted = {(_canonical(host), peer_port) for host, peer_port in peers}
    inodes: dict[int, tuple[str, int]] = {}
    for fields in rows:
        if fields[3] == _LISTEN or fields[9] == "0":
            continue
        try:
            if int(fields[1].rpartition(":")[2], 16) != port:
                continue
            remote = _endpoint(fields[2])
        except ValueError:
            continue
        if remote in wanted:
            inodes[int(fields[9])] = remote
    found: dict[tuple[str, int], PeerSocket] = {}
    by_inode = {inode: (inode, peer) for inode, peer in inodes.items()}
    for fd, (inode, peer) in _descriptors(by_inode):
        sock = _borrow(fd)
        if sock is None:
            continue
        with sock:
            lowat = notsent_lowat(sock) or 0
            if lowat == 0 and limit and set_notsent_lowat(sock, limit):
                lowat = limit
        found[peer] = PeerSocket(fd, inode, lowat)
    by_canonical = {(_canonical(host), peer_port): (host, peer_port) for host, peer_port in peers}
    return {by_canonical[peer]: socket_ for peer, socket_ in found.items()}


def _rows() -> list[list[str]] | None:
    """The rows of this network namespace's TCP tables, split into fields; None
    where neither table can be read."""
    found: list[list[str]] = []
    read_any = False
    for table in _TCP_TABLES:
        try:
            with open(table, encoding="ascii", errors="replace") as rows:
                next(rows, None)  # the header
                read_any = True
                found.extend(fields for row in rows if len(fields := row.split()) >= 10)
        except OSError:
            continue
    return found if read_any else None


def _endpoint(field: str) -> tuple[str, int]:
    """``(host, port)`` of a TCP table's address field: the address in hex, each
    32-bit word in the kernel's byte order (little-endian here), then the port."""
    address, _, port = field.partition(":")
    raw = bytes.fromhex(address)
    if sys.byteorder == "little":
        raw = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
    return _canonical(str(ipaddress.ip_address(raw))), int(port, 16)


def _canonical(host: str) -> str:
    """An address as one text whichever way it was written (an IPv4 address mapped
    into IPv6, as a dual-stack socket shows it, is the IPv4 one)."""
    try:
        address = ipaddress.ip_address(host.split("%", 1)[0])
    except ValueError:
        return host
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return str(address.ipv4_mapped)
    return str(address)


def _port_inodes(port: int) -> dict[int, bool] | None:
    """Inodes of the TCP sockets bound to local ``port`` (in this network namespace),
    each with whether it is listening; None where the tables cannot be read."""
    rows = _rows()
    if rows is None:
        return None
    found: dict[int, bool] = {}
    for fields in rows:
        try:
            local_port = int(fields[1].rpartition(":")[2], 16)
        except ValueError:
            continue
        if local_port == port and fields[9] != "0":
            found[int(fields[9])] = fields[3] == _LISTEN
    return found


def _descriptors(inodes: Mapping[int, _T]) -> Iterator[tuple[int, _T]]:
    """This process's descriptors of those socket inodes, each with what ``inodes``
    says of its inode."""
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
