"""Run an ASGI app that embeds publishers on uvicorn, draining them on SIGTERM.

uvicorn's own shutdown closes websockets with 1012; a draining publisher
closes them with 1001 first ("going away": register with another instance),
after the listening socket stopped accepting, and within a bounded time.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import signal
import socket
import threading
from collections.abc import Iterator, Sequence
from types import FrameType
from typing import Any

import uvicorn
from uvicorn.protocols.websockets.websockets_sansio_impl import WebSocketsSansIOProtocol
from websockets.http11 import Request
from websockets.protocol import State

from changefeed.publisher import Publisher
from changefeed.publisher.wire import DIRECT_WRITES

__all__ = ["DrainingServer", "FanoutWebSocketProtocol", "server_config", "tune_collector"]

_YOUNG_THRESHOLD = 10_000


def tune_collector() -> None:
    """Garbage-collector settings for a long-running server process (CPython).

    Everything alive once the server has started (modules, the app, pools)
    lives as long as the process: ``gc.freeze`` takes it out of every later
    collection. Young collections then run after 10,000 new container objects
    instead of 700: a bootstrap page of thousands of rows (each a record, a
    dict) otherwise triggers several collections that find nothing to free,
    and each promotion brings the next full collection closer.
    """
    gc.collect()
    gc.freeze()
    young, middle, old = gc.get_threshold()
    gc.set_threshold(max(young, _YOUNG_THRESHOLD), middle, old)


class _DirectWriter:
    """changefeed.publisher.wire.FrameWriter for one uvicorn websocket connection.

    Called for every listener on every flush: it keeps what ``open`` reads at
    hand, and ``write`` is the transport's own method."""

    __slots__ = ("_conn", "_protocol", "_transport", "_writable", "write")

    def __init__(self, protocol: WebSocketsSansIOProtocol) -> None:
        self._protocol = protocol
        self._transport = protocol.transport
        self._writable = protocol.writable
        self._conn = protocol.conn
        self.write = protocol.transport.write

    @property
    def open(self) -> bool:
        protocol = self._protocol
        return (
            self._writable.is_set()
            and not protocol.close_sent
            and not protocol.disconnected
            and self._conn.state is State.OPEN
            and not self._transport.is_closing()
        )


class FanoutWebSocketProtocol(WebSocketsSansIOProtocol):
    """uvicorn's ``websockets-sansio`` protocol, plus the ``DIRECT_WRITES`` scope
    extension through which a publisher writes each fan-out frame, serialised once,
    straight to the transport (changefeed.publisher.wire).

    An API that runs its own uvicorn gets it with ``ws=FanoutWebSocketProtocol``.
    The extension is offered only when no websocket extension (per-message
    deflate) was negotiated: compressed frames differ per connection.
    """

    def handle_connect(self, event: Request) -> None:
        super().handle_connect(event)
        # The ASGI task is created but has not run: the scope can still grow.
        # Only on the uvicorn whose internals _DirectWriter reads (pyproject pins the
        # range); anything else gets plain ASGI sends.
        scope: Any = getattr(self, "scope", None)
        if (
            scope is not None
            and isinstance(getattr(self, "writable", None), asyncio.Event)
            and not self.close_sent
            and not self.conn.extensions
        ):
            scope["extensions"][DIRECT_WRITES] = _DirectWriter(self)


def server_config(app: Any, host: str, port: int, **overrides: Any) -> uvicorn.Config:
    """uvicorn settings for a publisher: uvloop/httptools where available, the
    fan-out's direct frame writes (``FanoutWebSocketProtocol``), websocket pings
    every 20 s (dead listeners are dropped within ~40 s), no per-message
    compression (small JSON frames gain little and cost CPU per listener)."""
    settings: dict[str, Any] = {
        "host": host,
        "port": port,
        "loop": "auto",
        "http": "auto",
        "ws": FanoutWebSocketProtocol,
        "ws_ping_interval": 20.0,
        "ws_ping_timeout": 20.0,
        "ws_per_message_deflate": False,
        "ws_max_size": 1 << 20,
        "lifespan": "on",
        "log_level": "warning",
        "timeout_graceful_shutdown": 10,
        # uvicorn's own loggers go through changefeed's formatter (JSON or human),
        # not a second, differently formatted configuration.
        "log_config": None,
    }
    settings.update(overrides)
    return uvicorn.Config(app, **settings)


def _drained(_signum: int, _frame: FrameType | None) -> None:
    """SIGTERM raised again by uvicorn after the drain it asked for: nothing left to do."""


class DrainingServer(uvicorn.Server):
    """A uvicorn server that drains ``publishers`` before it shuts down.

    Args:
        config: the uvicorn config.
        publishers: publishers to drain (close listeners with 1001) on shutdown.
        grace: seconds allowed for the drain.
        owns_process: this server is the process (a CLI server, not a test or
            an application that embeds it): once started, apply
            ``tune_collector``, and after a SIGTERM drain end with status 0.
    """

    def __init__(
        self,
        config: uvicorn.Config,
        publishers: Sequence[Publisher],
        grace: float = 5.0,
        *,
        owns_process: bool = False,
    ) -> None:
        super().__init__(config)
        self.publishers = list(publishers)
        self.grace = grace
        self.owns_process = owns_process

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        if self.owns_process and self.started:
            tune_collector()

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        """uvicorn's, and then a SIGTERM that was drained is done with.

        Once shut down, uvicorn raises the signals it handled again, for the
        handlers that were there before it: for SIGTERM that is the default
        one, which kills the process (status 143 in a shell). A server process
        that drained on SIGTERM has stopped as asked and ends with status 0;
        SIGINT still ends it as an interrupt.
        """
        if not self.owns_process or threading.current_thread() is not threading.main_thread():
            with super().capture_signals():
                yield
            return
        before = signal.signal(signal.SIGTERM, _drained)
        try:
            with super().capture_signals():
                yield
        finally:
            signal.signal(signal.SIGTERM, before)

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        for server in self.servers:
            server.close()  # stop accepting before asking listeners to go elsewhere
        for publisher in self.publishers:
            await publisher.drain(self.grace)
        await super().shutdown(sockets)
