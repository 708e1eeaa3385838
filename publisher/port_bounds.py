"""Through plain ASGI, the kernel's unsent bytes bounded on the ports listeners use.

The publisher bounds a port's sockets (changefeed.port_sockets) when the first
listener comes through it. The listening socket's setting is inherited by what
it accepts from then on, but not by a connection the kernel had already
completed and the server not yet accepted: so every later listener asks for a
pass too, and passes on a port run at most once per ``PASS_INTERVAL``, each
covering every listener that came before it. A listener is bounded within
about a second of its handshake, at a cost that does not grow with how many
arrive at once. Once a pass finds nothing left to bound, the listening socket
has had the setting since before every connection it holds was accepted, and
what it accepts later inherits it: the port needs no more passes. Each pass
reads ``/proc`` in a worker thread, never on the event loop, and a pass that
fails is logged and changes nothing else: a listener's connection never waits
for it.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

from changefeed.logs import log_event
from changefeed.port_sockets import Bounded, bound_unsent

__all__ = ["PortBounds"]

log = logging.getLogger(__name__)

PASS_INTERVAL = 1.0
"""Seconds between two passes on a port, at least."""
MAX_PORTS = 8
"""Ports looked at, at most: a server listens on a few."""


@dataclass(slots=True)
class _Port:
    passes: int = 0
    last: float = 0.0
    asked: bool = False
    """A listener came since the last pass began."""
    running: asyncio.Task[None] | None = None
    finished: bool = False
    """No later pass would change anything: the last one found nothing to bound (or
    no listening socket of the port, or failed)."""


class PortBounds:
    """Bounds the sockets of the ports plain-ASGI listeners come through.

    Args:
        limit: bytes the kernel may hold unsent (``notsent_lowat``); 0 leaves the
            server's sockets alone.
    """

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._ports: dict[int, _Port] = {}
        self._unbounded_said = False

    def saw(self, port: int | None) -> None:
        """A plain-ASGI listener connected through local ``port`` (None: not TCP)."""
        if self.limit == 0:
            return
        if port is None:
            self._say_unbounded(port)
            return
        state = self._ports.get(port)
        if state is None:
            if len(self._ports) >= MAX_PORTS:
                return
            state = self._ports[port] = _Port()
        if state.finished:
            return
        state.asked = True
        if state.running is None:
            state.running = asyncio.get_running_loop().create_task(
                self._passes(port, state), name=f"changefeed-bound-port-{port}"
            )

    async def close(self) -> None:
        """Stop the passes under way."""
        tasks = [s.running for s in self._ports.values() if s.running is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _passes(self, port: int, state: _Port) -> None:
        loop = asyncio.get_running_loop()
        try:
            while state.asked:
                wait = state.last + PASS_INTERVAL - loop.time() if state.passes else 0.0
                if wait > 0:
                    await asyncio.sleep(wait)
                state.asked = False
                state.last = loop.time()
                state.passes += 1
                try:
                    bounded = await asyncio.to_thread(bound_unsent, port, self.limit)
                except Exception as exc:  # a courtesy: say why it failed, go on serving
                    log_event(log, "serving.notsent_failed", logging.ERROR, exc=exc, port=port)
                    state.finished = True
                    return
                if state.passes == 1:
                    self._report(port, bounded)
                if bounded is None or bounded.listening == 0 or bounded.bounded == 0:
                    state.finished = True
                    return
        finally:
            state.running = None

    def _report(self, port: int, bounded: Bounded | None) -> None:
        if bounded is None or bounded.listening == 0:
            self._say_unbounded(port)
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

    def _say_unbounded(self, port: int | None) -> None:
        if self._unbounded_said:
            return
        self._unbounded_said = True
        log_event(
            log,
            "serving.notsent_unbounded",
            logging.WARNING,
            port=port,
            why="no listening socket of this port found in this process; set the "
            "server's TCP_NOTSENT_LOWAT, or the host's (net.ipv4.tcp_notsent_lowat)",
        )
