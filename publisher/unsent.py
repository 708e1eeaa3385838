"""Through plain ASGI, writes to a listener that falls behind wait while its kernel holds the bound.

``TCP_NOTSENT_LOWAT`` (set on the port's sockets, changefeed.port_sockets)
does not bound what the kernel holds unsent on its own: the kernel checks it
only when a write needs a new segment, and appends to the last one (up to 64
KiB) unchecked. What piles up there, and in the server's transport behind it,
waits ahead of every ping and pong of a listener that reads slowly. The fast
path holds its writes in its own protocol (changefeed.uvicorn_fastpath);
through plain ASGI the server's protocol is not the publisher's, so the
publisher looks at the socket itself.

A connection's socket is looked for once its listener falls behind (a write
leaves more to write), before the server's buffers below fill:
``ConnectionSockets`` finds those of one port in a pass over ``/proc``, off
the event loop, one pass for every listener that asked meanwhile. From then
on, after each write while behind, ``UnsentHold`` waits while the kernel
holds the bound, until the socket polls writable (with the option set, when
less than half of it is left unsent), and once it has waited the connection
cuts its turns to the bound. A listener that stays caught up
``RELEASE_AFTER`` lets its socket go. Where it cannot be found (not Linux,
another process's), writes go on as before.
"""

from __future__ import annotations

import asyncio
import logging
import socket

from changefeed.logs import log_event
from changefeed.port_sockets import Peer, connection_sockets
from changefeed.tcp_liveness import notsent_lowat, set_notsent_lowat, unsent_bytes

__all__ = ["ConnectionSockets", "UnsentHold"]

log = logging.getLogger(__name__)

PASS_INTERVAL = 0.25
"""Seconds between two passes on a port, at least: the listeners that fall behind
meanwhile share the next one."""
RELEASE_AFTER = 10.0
"""Seconds a listener stays caught up before its socket is let go: one that falls
behind at every burst keeps it (no pass each time), an idle one holds no second
descriptor."""


class ConnectionSockets:
    """Finds the sockets of plain-ASGI connections, a port's at a time, off the event loop."""

    def __init__(self) -> None:
        self._wanted: dict[int, dict[Peer, asyncio.Future[socket.socket | None]]] = {}
        self._passes: dict[int, asyncio.Task[None]] = {}
        self._failed = False

    def find(self, port: int, peer: Peer) -> asyncio.Future[socket.socket | None]:
        """The socket of the connection from ``peer`` on local ``port`` (a duplicate the
        caller closes), or None; cancel the future to give up on it."""
        loop = asyncio.get_running_loop()
        if self._failed:
            nothing: asyncio.Future[socket.socket | None] = loop.create_future()
            nothing.set_result(None)
            return nothing
        wanted = self._wanted.setdefault(port, {})
        found = wanted.get(peer)
        if found is None or found.cancelled():  # one given up on: ask again
            found = wanted[peer] = loop.create_future()
        if port not in self._passes:
            self._passes[port] = loop.create_task(
                self._run_passes(port), name=f"changefeed-find-sockets-{port}"
            )
        return found

    async def close(self) -> None:
        """Stop the passes under way; what was asked for is not found."""
        tasks = list(self._passes.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for wanted in self._wanted.values():
            for future in wanted.values():
                if not future.done():
                    future.set_result(None)
        self._wanted.clear()

    async def _run_passes(self, port: int) -> None:
        try:
            while batch := self._wanted.pop(port, None):
                try:
                    found = await asyncio.to_thread(connection_sockets, port, batch.keys())
                except Exception as exc:  # a courtesy: say why, and write as before
                    log_event(log, "serving.sockets_unfound", logging.ERROR, exc=exc, port=port)
                    self._failed = True
                    found = {}
                for peer, future in batch.items():
                    sock = found.pop(peer, None)
                    if future.done():  # given up on meanwhile
                        if sock is not None:
                            sock.close()
                    else:
                        future.set_result(sock)
                for sock in found.values():
                    sock.close()
                await asyncio.sleep(PASS_INTERVAL)
        finally:
            self._passes.pop(port, None)


def _wake(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_result(None)


class UnsentHold:
    """What one plain-ASGI connection's kernel holds unsent, looked at after its writes
    while its listener is behind.

    Args:
        sockets: where its socket is found, when first needed.
        port: the local port it came through.
        peer: its remote end.
        limit: the port's ``TCP_NOTSENT_LOWAT``: writes wait while the kernel holds
            this much unsent, and once they have, a turn carries no more.
    """

    __slots__ = (
        "_lookup",
        "_peer",
        "_port",
        "_release",
        "_sock",
        "_sockets",
        "holding",
        "limit",
    )

    def __init__(self, sockets: ConnectionSockets, port: int, peer: Peer, limit: int) -> None:
        self.limit = limit
        """The socket's own bound once found (0: none, or not found: never asked again)."""
        self.holding = False
        """A write found the kernel holding ``limit`` since the listener last caught up."""
        self._sockets = sockets
        self._port = port
        self._peer = peer
        self._release: asyncio.TimerHandle | None = None
        self._lookup: asyncio.Future[socket.socket | None] | None = None
        self._sock: socket.socket | None = None

    async def after_write(self) -> None:
        """After a write that left more to write: wait while the kernel holds ``limit``
        or more unsent. The first call asks for the socket, and calls return at once
        until it is found."""
        if self._release is not None:
            self._release.cancel()
            self._release = None
        sock = self._socket()
        if sock is None:
            return
        loop = asyncio.get_running_loop()
        while (unsent := unsent_bytes(sock)) is not None and unsent >= self.limit:
            self.holding = True
            waiter: asyncio.Future[None] = loop.create_future()
            # The duplicate's own descriptor: the server's is registered with the
            # loop already, and a second registration would replace the server's.
            fd = sock.fileno()
            loop.add_writer(fd, _wake, waiter)
            try:
                await waiter
            finally:
                loop.remove_writer(fd)
            # The server's transport, woken by the same poll, writes what it holds
            # before this looks again.
            await asyncio.sleep(0)

    def caught_up(self) -> None:
        """Nothing is left to write: full turns again, and the socket let go unless
        the listener falls behind again within ``RELEASE_AFTER``."""
        self.holding = False
        if self._release is None and self._lookup is not None:
            loop = asyncio.get_running_loop()
            self._release = loop.call_later(RELEASE_AFTER, self._let_go)

    def close(self) -> None:
        """The connection ended: let its socket go (the duplicate held it open)."""
        self._let_go()

    def _let_go(self) -> None:
        if self._release is not None:
            self._release.cancel()
            self._release = None
        lookup, sock = self._lookup, self._sock
        if lookup is not None and sock is None:
            if not lookup.done():
                lookup.cancel()
            elif not lookup.cancelled():
                sock = lookup.result()  # found, not yet taken
        if sock is not None:
            sock.close()
        self._lookup = self._sock = None

    def _socket(self) -> socket.socket | None:
        if self._sock is not None or not self.limit:
            return self._sock
        if self._lookup is None:
            self._lookup = self._sockets.find(self._port, self._peer)
            return None
        if not self._lookup.done() or self._lookup.cancelled():
            return None
        sock = self._lookup.result()
        if sock is None:
            self.limit = 0  # not found: write as before, and never ask again
            return None
        # The socket's own bound is what its polls go by (a server's, or the one
        # the port's pass set); one it has not been given yet is set here.
        own = notsent_lowat(sock)
        if own == 0 and set_notsent_lowat(sock, self.limit):
            own = self.limit
        if not own:
            sock.close()
            self._lookup, self.limit = None, 0
            return None
        self.limit, self._sock = own, sock
        return sock
