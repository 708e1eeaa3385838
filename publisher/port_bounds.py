"""Through plain ASGI, the kernel's unsent bytes bounded on the ports listeners use.

The publisher bounds a port's sockets (changefeed.port_sockets) when the first
listener comes through it, and twice more, a second apart: a connection the
kernel had completed but the server had not yet accepted when the listening
socket was bounded did not inherit the setting. Each pass reads ``/proc`` in a
worker thread, never on the event loop, and a pass that fails is logged and
changes nothing else: a listener's connection never waits for it.
"""

from __future__ import annotations

import asyncio
import logging

from changefeed.logs import log_event
from changefeed.port_sockets import Bounded, bound_unsent

__all__ = ["PortBounds"]

log = logging.getLogger(__name__)

PASSES = 3
"""Times a port's sockets are bounded."""
PASS_INTERVAL = 1.0
"""Seconds between two passes on a port."""
MAX_PORTS = 8
"""Ports looked at, at most: a server listens on a few."""


class PortBounds:
    """Bounds, once per port, the sockets plain-ASGI listeners come through.

    Args:
        limit: bytes the kernel may hold unsent (``notsent_lowat``); 0 leaves the
            server's sockets alone.
    """

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._ports: set[int | None] = set()
        self._tasks: set[asyncio.Task[None]] = set()

    def saw(self, port: int | None) -> None:
        """A plain-ASGI listener connected through local ``port`` (None: not TCP)."""
        if self.limit == 0 or port in self._ports or len(self._ports) >= MAX_PORTS:
            return
        self._ports.add(port)
        task = asyncio.get_running_loop().create_task(
            self._bound(port), name=f"changefeed-bound-port-{port}"
        )
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def close(self) -> None:
        """Stop the passes under way."""
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _bound(self, port: int | None) -> None:
        for done_passes in range(PASSES):
            if done_passes:
                await asyncio.sleep(PASS_INTERVAL)
            try:
                bounded = await asyncio.to_thread(bound_unsent, port, self.limit) if port else None
            except Exception as exc:  # a pass is a courtesy: say why it failed, go on serving
                log_event(log, "serving.notsent_failed", logging.ERROR, exc=exc, port=port)
                return
            if done_passes == 0:
                self._report(port, bounded)
                if bounded is None or bounded.listening == 0:
                    return

    def _report(self, port: int | None, bounded: Bounded | None) -> None:
        if bounded is None or bounded.listening == 0:
            log_event(
                log,
                "serving.notsent_unbounded",
                logging.WARNING,
                port=port,
                why="no listening socket of this port found in this process; set the "
                "server's TCP_NOTSENT_LOWAT, or the host's (net.ipv4.tcp_notsent_lowat)",
            )
            return
        log_event(
            log,
            "serving.notsent_lowat",
            port=port,
            limit=self.limit,
            listening=bounded.listening,
            connections=bounded.connections,
            bounded=bounded.bounded,
        )
