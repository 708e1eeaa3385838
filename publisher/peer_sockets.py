"""Through plain ASGI, the sockets of the listeners that fall behind, found in shared passes.

A listener that reads slower than it is written to has its sends held while
its kernel holds its unsent limit (changefeed.unsent_hold). That needs its
connection's socket, which ASGI does not hand over: a pass over ``/proc``
finds it (changefeed.port_sockets.find_connections). A pass reads every TCP
socket of the host and every descriptor of the process, so one pass serves
every listener that asked since the last one began: a burst that leaves
thousands of listeners behind costs a few passes, not thousands. Passes run in
a worker thread, one at a time; a connection's sends never wait for one.
Listeners that never fall behind cost nothing.
"""

from __future__ import annotations

import asyncio
import logging
from collections import defaultdict

from changefeed.logs import log_event
from changefeed.port_sockets import find_connections
from changefeed.unsent_hold import UnsentHold

from .held_sends import KernelHold

__all__ = ["PeerSockets"]

log = logging.getLogger(__name__)

Peer = tuple[str, int]


class PeerSockets:
    """Finds the sockets of plain-ASGI connections, on request.

    Args:
        limit: ``TCP_NOTSENT_LOWAT`` given to a socket found without one (the
            port's pass, changefeed.port_bounds, may not have reached it yet);
            0 (the server's sockets are left alone) finds none.
    """

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._asked: dict[tuple[int, Peer], asyncio.Future[KernelHold | None]] = {}
        self._running: asyncio.Task[None] | None = None
        self._failed = False

    def find(self, port: int | None, peer: Peer | None) -> asyncio.Future[KernelHold | None]:
        """The socket of the connection from ``peer`` on local ``port``, once a pass
        found it (None: not found, or not to be looked for)."""
        loop = asyncio.get_running_loop()
        if not self.limit or self._failed or port is None or peer is None:
            done: asyncio.Future[KernelHold | None] = loop.create_future()
            done.set_result(None)
            return done
        key = (port, (str(peer[0]), int(peer[1])))
        found = self._asked.get(key)
        if found is None:
            found = self._asked[key] = loop.create_future()
        if self._running is None:
            self._running = loop.create_task(self._passes(), name="changefeed-peer-sockets")
        return found

    async def close(self) -> None:
        """Stop the pass under way."""
        task = self._running
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        for found in self._asked.values():
            found.cancel()
        self._asked.clear()

    async def _passes(self) -> None:
        try:
            while self._asked:
                asked, self._asked = self._asked, {}
                by_port: dict[int, list[Peer]] = defaultdict(list)
                for port, peer in asked:
                    by_port[port].append(peer)
                try:
                    found = await asyncio.to_thread(_pass, by_port, self.limit)
                except Exception as exc:  # a courtesy: say why, send unheld from now on
                    log_event(log, "serving.peer_sockets_failed", logging.ERROR, exc=exc)
                    self._failed = True
                    found = {}
                for key, future in asked.items():
                    if not future.done():
                        future.set_result(found.get(key))
        finally:
            self._running = None


def _pass(by_port: dict[int, list[Peer]], limit: int) -> dict[tuple[int, Peer], KernelHold | None]:
    found: dict[tuple[int, Peer], KernelHold | None] = {}
    for port, peers in by_port.items():
        sockets = find_connections(port, peers, limit) or {}
        for peer, socket_ in sockets.items():
            if socket_.notsent_lowat > 0:  # none: the kernel would not poll at the limit
                found[(port, peer)] = UnsentHold(socket_)
    return found
