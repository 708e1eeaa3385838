"""Run an ASGI app that embeds publishers on uvicorn, draining them on SIGTERM.

The publisher works on any ASGI server through plain ASGI (docs/serving.md).
On uvicorn, ``server_config`` adds what an operator opts into, each used only
where it was tested (changefeed.fast_path): the fast path
(``FanoutWebSocketProtocol``: direct frame writes and the publisher's websocket
protections) and the request head's and body's deadlines. An app that runs
its own uvicorn gets the fast path with ``ws=changefeed.serving.FanoutWebSocketProtocol``
(``--ws changefeed.serving:FanoutWebSocketProtocol`` on the command line): the
name is uvicorn's own protocol wherever the fast path cannot run.

uvicorn's own shutdown closes websockets with 1012; a draining publisher
closes them with 1001 first ("going away": register with another instance),
after the listening socket stopped accepting, and within a bounded time.
"""

from __future__ import annotations

import logging
import signal
import socket
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from types import FrameType
from typing import TYPE_CHECKING, Any

import uvicorn

from changefeed import fast_path as guard
from changefeed.collector import tune_collector
from changefeed.file_limit import fit_file_limit
from changefeed.logs import log_event
from changefeed.publisher import Publisher
from changefeed.tcp_liveness import NOTSENT_LOWAT, set_notsent_lowat
from changefeed.uvicorn_private import missing

if TYPE_CHECKING:
    from changefeed.uvicorn_fastpath import FanoutWebSocketProtocol

__all__ = [
    "PLAIN_WS",
    "DrainingServer",
    "FanoutWebSocketProtocol",
    "UnsupportedUvicorn",
    "fast_path_unavailable",
    "server_config",
]

log = logging.getLogger(__name__)

PLAIN_WS = "websockets-sansio"
"""uvicorn's ``ws`` setting for plain ASGI: its own websockets sans-I/O protocol
(uvicorn 0.35 and later), the one the fast path extends."""


class UnsupportedUvicorn(RuntimeError):
    """The installed uvicorn lacks what ``DrainingServer`` builds on (the CLI's servers)."""


def fast_path_unavailable() -> str | None:
    """Why the fast path cannot run here (None: it can). Checked, and logged, once
    per process (changefeed.fast_path)."""
    return guard.fast_path().why_not


def __getattr__(name: str) -> Any:
    """``FanoutWebSocketProtocol``: the fast path's websocket protocol where it runs,
    else uvicorn's own (plain ASGI). Looked up by uvicorn for
    ``--ws changefeed.serving:FanoutWebSocketProtocol``, and by
    ``from changefeed.serving import FanoutWebSocketProtocol``."""
    if name == "FanoutWebSocketProtocol":
        if guard.fast_path().ok:
            from changefeed.uvicorn_fastpath import FanoutWebSocketProtocol

            return FanoutWebSocketProtocol
        from uvicorn.protocols.websockets.websockets_sansio_impl import (
            WebSocketsSansIOProtocol,
        )

        return WebSocketsSansIOProtocol
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def server_config(
    app: Any,
    host: str,
    port: int,
    *,
    fast_path: bool = False,
    head_timeout: float | None = None,
    max_head_bytes: int | None = None,
    **overrides: Any,
) -> uvicorn.Config:
    """uvicorn settings for a publisher: uvloop/httptools where available, websocket
    pings every 20 s (a dead listener is dropped after three 20 s ping deadlines
    without progress, 60-80 s), no per-message
    compression (small JSON frames gain little and cost CPU per listener).

    Args:
        fast_path: run ``FanoutWebSocketProtocol`` (direct frame writes, the
            publisher's websocket protections) where it was tested; plain ASGI
            otherwise, with one log line saying why (changefeed.fast_path).
        head_timeout: close a connection whose request head has not arrived that
            many seconds after it was accepted or answered, or whose body stopped
            arriving for as long (changefeed.http_timeouts); under the same guard
            as the fast path. None: the proxy's job (docs/security.md).
        max_head_bytes: with ``head_timeout``, a request head not ended within this
            many bytes is answered 431 and closed (default: ``[server] header_max_bytes``).
        overrides: any other ``uvicorn.Config`` setting.
    """
    settings: dict[str, Any] = {
        "host": host,
        "port": port,
        "loop": "auto",
        "ws": PLAIN_WS,
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
    if fast_path and guard.fast_path().ok:
        from changefeed.uvicorn_fastpath import FanoutWebSocketProtocol

        settings["ws"] = FanoutWebSocketProtocol
    if head_timeout is not None:
        if not head_timeout > 0:
            raise ValueError(f"the request head timeout must be positive, got {head_timeout!r}")
        if guard.deadlines().ok:
            from changefeed.http_timeouts import head_timeout_protocol

            limit = {} if max_head_bytes is None else {"max_head_bytes": max_head_bytes}
            settings["http"] = head_timeout_protocol(head_timeout, **limit)
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
        notsent_lowat: bytes the kernel may hold unsent for each connection
            (``TCP_NOTSENT_LOWAT`` on the listening sockets, inherited by every
            connection, whichever websocket protocol serves it). A ping or pong
            then waits behind this much, and the listener's own receive buffer.
        announce: called once listening, with the address bound (``host:port``,
            the port the system picked when the config asked for port 0).

    Raises:
        UnsupportedUvicorn: the installed uvicorn lacks one of the private methods
            this server extends (changefeed.uvicorn_private, ``serve``).
    """

    def __init__(
        self,
        config: uvicorn.Config,
        publishers: Sequence[Publisher],
        grace: float = 5.0,
        *,
        owns_process: bool = False,
        notsent_lowat: int = NOTSENT_LOWAT,
        announce: Callable[[str], None] | None = None,
    ) -> None:
        if lacking := missing("serve", kinds=("class", "method")):
            # Without them a SIGTERM would cut listeners off with 1012 instead of
            # draining them, and a failed start-up could pass for a clean stop: say
            # so before anything is served, rather than find out at shutdown. The
            # attributes it reads are checked by tests (oldest and newest uvicorn):
            # their check reads uvicorn's source, too fragile to refuse a start on.
            raise UnsupportedUvicorn(
                f"uvicorn {uvicorn.__version__} lacks what changefeed's server uses: "
                + "; ".join(lacking)
                + " (install a uvicorn changefeed was tested with)"
            )
        super().__init__(config)
        self.publishers = list(publishers)
        self.grace = grace
        self.owns_process = owns_process
        self.notsent_lowat = notsent_lowat
        self.announce = announce

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        try:
            await super().startup(sockets)
        except SystemExit:
            # uvicorn exits the process when it cannot listen (it has logged why, a
            # port in use say): an error the command reports in one line instead.
            where = f"{self.config.host}:{self.config.port}"
            raise OSError(f"cannot listen on {where} (the line above says why)") from None
        listening = [sock for server in self.servers for sock in server.sockets]
        bounded = [set_notsent_lowat(sock, self.notsent_lowat) for sock in listening]
        if listening and not all(bounded):
            log_event(
                log,
                "serving.notsent_unbounded",
                logging.WARNING,
                why="TCP_NOTSENT_LOWAT is not available here; set the host's "
                "(net.ipv4.tcp_notsent_lowat on Linux)",
            )
        if self.owns_process and self.started:
            tune_collector()
            self._fit_file_limit()
        if self.announce is not None and self.started:
            self.announce(self.address(listening))

    def address(self, listening: Sequence[socket.socket]) -> str:
        """``host:port`` as configured, with the port actually bound (port 0 asks the
        system for a free one, which only the socket knows)."""
        host, port = self.config.host, self.config.port
        inet = [s for s in listening if s.family in (socket.AF_INET, socket.AF_INET6)]
        if inet:
            port = inet[0].getsockname()[1]
        if ":" in host and not host.startswith("["):
            host = f"[{host}]"
        return f"{host}:{port}"

    def _fit_file_limit(self) -> None:
        """As many file descriptors as the publishers may hold connections, or a warning."""
        connections = sum(p.config.max_connections for p in self.publishers)
        short = fit_file_limit(connections) if connections else None
        if short is not None:
            soft, wanted = short
            log_event(
                log,
                "serving.file_limit",
                logging.WARNING,
                limit=soft,
                wanted=wanted,
                max_connections=connections,
                why="the process may open fewer files than max_connections asks: connections "
                "beyond the limit are dropped by accept(); raise the hard limit "
                "(ulimit -n, systemd LimitNOFILE) or lower max_connections",
            )

    @contextmanager
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
