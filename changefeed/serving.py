"""Run an ASGI app that embeds publishers on uvicorn, draining them on SIGTERM.

uvicorn's own shutdown closes websockets with 1012; a draining publisher
closes them with 1001 first ("going away": register with another instance),
after the listening socket stopped accepting, and within a bounded time.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import gc
import logging
import signal
import socket
import threading
from collections.abc import Iterator, Sequence
from types import FrameType
from typing import Any

import uvicorn
from uvicorn.protocols.websockets.websockets_sansio_impl import WebSocketsSansIOProtocol
from uvicorn.server import ServerState
from websockets.exceptions import PayloadTooBig
from websockets.frames import Close, Frame, Opcode
from websockets.http11 import Request
from websockets.protocol import State

from changefeed.http_timeouts import head_timeout_protocol
from changefeed.logs import log_event
from changefeed.publisher import Publisher
from changefeed.publisher.wire import DIRECT_WRITES, DISCONNECT_CAUSE, Disconnect
from changefeed.schemas import ERROR_CLOSE_CODES, ErrorFrame
from changefeed.tcp_liveness import (
    NOTSENT_LOWAT,
    PingWatch,
    bytes_acked,
    notsent_lowat,
    set_notsent_lowat,
    unacked_bytes,
)

__all__ = [
    "DrainingServer",
    "FanoutWebSocketProtocol",
    "direct_writes_unsupported",
    "server_config",
    "tune_collector",
]

log = logging.getLogger(__name__)

_YOUNG_THRESHOLD = 10_000
_WRITE_BUFFER_HIGH = 4 * 1024
"""Bytes a listener's transport buffers above the kernel before the publisher's
writes to it wait: with ``TCP_NOTSENT_LOWAT`` below it, what sits ahead of a
ping or a pong stays small (changefeed.tcp_liveness). It is checked after a
write: one turn of frames may go past it."""
_ABORT_MARGIN = 1.0
"""Seconds past uvicorn's close handshake timeout before a connection whose app
is done is dropped (see FanoutWebSocketProtocol.run_asgi)."""


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


_BORROWED = (
    "config",
    "conn",
    "frames",
    "close_sent",
    "close_timeout",
    "disconnected",
    "handshake_complete",
    "initial_response",
    "loop",
    "pending_ping_payload",
    "ping_timeout",
    "pong_timer",
    "queue",
    "transport",
    "writable",
)
"""Attributes of uvicorn's websockets-sansio protocol that FanoutWebSocketProtocol
reads or writes: private to uvicorn, so checked once (``direct_writes_unsupported``)."""

_OVERRIDDEN = (
    "data_received",
    "handle_connect",
    "handle_parser_exception",
    "keepalive_timeout",
    "run_asgi",
    "send",
    "send_keepalive_ping",
    "send_receive_event_to_app",
)


@functools.cache
def direct_writes_unsupported() -> str | None:
    """Why the installed uvicorn cannot give a publisher direct writes (None: it can).

    ``FanoutWebSocketProtocol`` borrows private parts of uvicorn's protocol
    (pyproject pins the uvicorn versions CI runs). This checks every one of them
    on a throwaway instance, once per process; without them the protocol behaves
    exactly as uvicorn's own, and the publisher sends through ASGI.
    """
    missing = [
        name for name in _OVERRIDDEN if not callable(getattr(WebSocketsSansIOProtocol, name, None))
    ]
    try:
        config = uvicorn.Config(_no_app, log_config=None, ws="websockets-sansio")
        config.load()
        probe = WebSocketsSansIOProtocol(config, ServerState(), {}, _loop=asyncio.new_event_loop())
    except Exception as exc:  # a uvicorn that builds its protocol differently
        return f"uvicorn's websockets-sansio protocol cannot be built here: {exc!r}"
    finally:
        with contextlib.suppress(Exception):
            probe.loop.close()
    missing += [name for name in _BORROWED if not hasattr(probe, name)]
    if not isinstance(getattr(probe, "writable", None), asyncio.Event):
        missing.append("writable (an asyncio.Event)")
    if missing:
        return f"uvicorn {uvicorn.__version__} lacks {', '.join(sorted(set(missing)))}"
    return None


def _is_utf8(parts: list[bytes]) -> bool:
    try:
        (parts[0] if len(parts) == 1 else b"".join(parts)).decode()
    except UnicodeDecodeError:
        return False
    return True


async def _no_app(scope: Any, receive: Any, send: Any) -> None:  # pragma: no cover - never run
    pass


class _DirectWriter:
    """changefeed.publisher.wire.FrameWriter for one uvicorn websocket connection.

    Called for every listener on every flush: it keeps what ``open`` reads at
    hand, and ``write`` is the transport's own method."""

    __slots__ = ("_conn", "_protocol", "_socket", "_transport", "_writable", "write")

    def __init__(self, protocol: WebSocketsSansIOProtocol) -> None:
        self._protocol = protocol
        self._transport = protocol.transport
        self._writable = protocol.writable
        self._conn = protocol.conn
        self._socket = protocol.transport.get_extra_info("socket")
        self.write = protocol.transport.write

    def buffered(self) -> int:
        # The kernel's part too: for a listener that stopped reading on a quiet
        # feed, what it has not taken may all sit there (the stall watch).
        return self._transport.get_write_buffer_size() + unacked_bytes(self._socket)

    @property
    def lost(self) -> bool:
        protocol = self._protocol
        return protocol.close_sent or protocol.disconnected or self._transport.is_closing()

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

    What else a publisher needs from its server: a frame over ``ws_max_size`` is
    refused like one over the publisher's ``max_frame_bytes`` (error frame, then
    4006), and a text frame that is not UTF-8 like any other bad frame (error
    frame, then 4000); a listener that stops answering pings is reported to the app as such,
    at once; a handshake refused with an HTTP response (401) is not logged as an
    error; a handshake websockets cannot parse is answered (431) and closed, not
    left open for good; and a connection whose app is done is dropped once its close
    handshake had its time, even when the peer stopped reading (``run_asgi``).
    """

    def data_received(self, data: bytes) -> None:
        """A handshake websockets cannot parse is answered and closed.

        httptools hands over any head with ``Upgrade: websocket`` (which ends its
        head deadline, changefeed.http_timeouts); websockets then refuses what it
        cannot parse (a header line over 8 KiB, too many headers: 431; anything
        else: no answer) without raising an event. uvicorn writes nothing and
        closes nothing then, so the socket would be held for good by a peer that
        never even sent a token. Its answer is written and the connection closed.
        """
        self._received += len(data)
        super().data_received(data)
        if (
            direct_writes_unsupported() is None
            and self.conn.handshake_exc is not None
            and not self.handshake_complete
            and not self.transport.is_closing()
        ):
            self.transport.write(b"".join(self.conn.data_to_send()))
            self.transport.close()

    _received = 0
    """Bytes the peer has sent (progress, for the keepalive)."""
    _ping_watch: PingWatch | None = None

    def handle_connect(self, event: Request) -> None:
        super().handle_connect(event)
        self._bound_unsent()
        # The ASGI task is created but has not run: the scope can still grow.
        # Only on the uvicorn whose internals _DirectWriter reads (checked once,
        # direct_writes_unsupported); anything else gets plain ASGI sends.
        scope: Any = getattr(self, "scope", None)
        if (
            scope is not None
            and direct_writes_unsupported() is None
            and not self.close_sent
            and not self.conn.extensions
        ):
            scope["extensions"][DIRECT_WRITES] = _DirectWriter(self)

    def _bound_unsent(self) -> None:
        """Keep what waits below the app for this connection small: at most
        ``_WRITE_BUFFER_HIGH`` in the transport before the publisher's writes wait
        (asyncio's flow control), and ``NOTSENT_LOWAT`` unsent in the kernel unless
        the socket was given its own limit (a listening socket's is inherited)."""
        self.transport.set_write_buffer_limits(high=_WRITE_BUFFER_HIGH)
        sock = self.transport.get_extra_info("socket")
        if notsent_lowat(sock) == 0:
            set_notsent_lowat(sock, NOTSENT_LOWAT)

    def handle_parser_exception(self) -> None:
        """A frame over ``ws_max_size`` gets the publisher's refusal, an error frame
        and 4006 (the app hears of it as a disconnect with that code and reason),
        instead of a bare 1009. The frame itself is never read: websockets refuses
        it from its header."""
        exc = self.conn.parser_exc
        if (
            direct_writes_unsupported() is not None
            or not isinstance(exc, PayloadTooBig)
            or not self.handshake_complete
            or self.close_sent
        ):
            super().handle_parser_exception()
            return
        self.conn.data_to_send()  # websockets' own close (1009): replaced below
        message = f"frame exceeds the server's limit of {self.config.ws_max_size} bytes"
        self._refuse_frame(Disconnect.FRAME_TOO_LARGE, message)

    def send_receive_event_to_app(self) -> None:
        """A text message that is not UTF-8 is a bad frame: the publisher's refusal
        (error frame ``bad_frame``, then 4000), as for any other bad frame, instead
        of uvicorn's error log with a traceback for each one and a bare 1007."""
        if (
            direct_writes_unsupported() is None
            and getattr(self, "curr_msg_data_type", None) == "text"
            and self.handshake_complete
            and not self.close_sent
            and not _is_utf8(self.frames)
        ):
            self.frames = []
            self._refuse_frame(Disconnect.BAD_FRAME, "a text frame must be UTF-8")
            return
        super().send_receive_event_to_app()

    def _refuse_frame(self, cause: Disconnect, message: str) -> None:
        """Send the publisher's error frame for ``cause`` and its close code, tell the
        app why, and close."""
        reason = cause.value
        code = ERROR_CLOSE_CODES[reason]
        error = ErrorFrame(reason, message).encode().encode()
        close = Close(code, reason).serialize()
        self.transport.write(
            Frame(Opcode.TEXT, error).serialize(mask=False, extensions=())
            + Frame(Opcode.CLOSE, close).serialize(mask=False, extensions=())
        )
        disconnect: Any = {
            "type": "websocket.disconnect",
            "code": code,
            "reason": reason,
            DISCONNECT_CAUSE: cause,
        }
        self.queue.put_nowait(disconnect)
        self.close_sent = True
        self.transport.close()

    async def send(self, message: Any) -> None:
        await super().send(message)
        if direct_writes_unsupported() is not None:
            return
        if self.initial_response is not None and self.close_sent and not self.handshake_complete:
            # The app answered the handshake with an HTTP response (a refused token):
            # that is a complete handshake. uvicorn would log an error for each one
            # ("ASGI callable returned without completing handshake").
            self.handshake_complete = True

    def send_keepalive_ping(self) -> None:
        super().send_keepalive_ping()
        if self.pending_ping_payload is not None and direct_writes_unsupported() is None:
            if self._ping_watch is None:
                self._ping_watch = PingWatch()
            transport = self.transport
            outstanding = transport.get_write_buffer_size() + unacked_bytes(
                transport.get_extra_info("socket")
            )
            self._ping_watch.sent(self._acked(), outstanding, self._received)

    def _acked(self) -> int | None:
        return bytes_acked(self.transport.get_extra_info("socket"))

    def keepalive_timeout(self) -> None:
        """A ping's deadline passed without its pong.

        A listener that reads slowly answers a ping only once it has read the
        frames before it. While it makes progress (its TCP acknowledges more of
        the stream, or it sends anything), and for a while once the ping is in
        its receive buffer, the deadline is extended: a listener that reads is
        never cut off here, and one that stops is for the publisher's stall
        timeout (changefeed.tcp_liveness).
        Otherwise uvicorn fails the connection, and the app hears of it at once
        and why, not only once the socket has closed (which, for a peer that
        stopped reading too, is when ``run_asgi`` aborts it)."""
        watch = self._ping_watch
        timeout = self.ping_timeout
        if (
            watch is not None
            and timeout is not None
            and direct_writes_unsupported() is None
            and not watch.expired(self._acked(), self._received)
        ):
            self.pong_timer = self.loop.call_later(timeout, self.keepalive_timeout)
            return
        failing = not (self.close_sent or self.transport.is_closing())
        super().keepalive_timeout()
        if failing and direct_writes_unsupported() is None:
            disconnect: Any = {
                "type": "websocket.disconnect",
                "code": 1011,
                "reason": "keepalive ping timeout",
                DISCONNECT_CAUSE: Disconnect.KEEPALIVE_TIMEOUT,
            }
            self.queue.put_nowait(disconnect)

    async def run_asgi(self) -> None:
        """Run the app; once it is done, make sure the connection ends.

        uvicorn closes the transport gracefully, which waits until its write
        buffer drains. A peer that stopped reading (an evicted listener, whose
        unsent frames fill the buffer) never lets it drain, and would keep its
        socket, the buffer and the kernel's send queue for good, outside
        ``max_connections``. Nothing but the close handshake is sent once the app
        is done: a connection still there after the handshake's timeout, or whose
        app gave up before its close frame could be written, is aborted.
        """
        await super().run_asgi()
        if self.disconnected or direct_writes_unsupported() is not None:
            return
        if self.close_sent:
            self.loop.call_later(self.close_timeout + _ABORT_MARGIN, self._abort_unless_lost)
        elif self.transport.get_write_buffer_size():
            self._abort()

    def _abort_unless_lost(self) -> None:
        if not self.disconnected:
            self._abort()

    def _abort(self) -> None:
        client = self.client
        log_event(
            log,
            "connection.aborted",
            logging.INFO,
            peer=f"{client[0]}:{client[1]}" if client else "",
            unsent=self.transport.get_write_buffer_size(),
        )
        self.transport.abort()


def server_config(app: Any, host: str, port: int, **overrides: Any) -> uvicorn.Config:
    """uvicorn settings for a publisher: uvloop/httptools where available, the
    fan-out's direct frame writes (``FanoutWebSocketProtocol``), websocket pings
    every 20 s (dead listeners are dropped within ~40 s), no per-message
    compression (small JSON frames gain little and cost CPU per listener)."""
    settings: dict[str, Any] = {
        "host": host,
        "port": port,
        "loop": "auto",
        # A connection that never finishes its request head is closed (header_timeout).
        "http": head_timeout_protocol(),
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
    if settings["ws"] is FanoutWebSocketProtocol:
        unsupported = direct_writes_unsupported()
        log_event(
            log,
            "serving.fanout_path",
            logging.WARNING if unsupported else logging.INFO,
            path="ASGI sends" if unsupported else "direct writes",
            why=unsupported,
            uvicorn=uvicorn.__version__,
        )
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
    """

    def __init__(
        self,
        config: uvicorn.Config,
        publishers: Sequence[Publisher],
        grace: float = 5.0,
        *,
        owns_process: bool = False,
        notsent_lowat: int = NOTSENT_LOWAT,
    ) -> None:
        super().__init__(config)
        self.publishers = list(publishers)
        self.grace = grace
        self.owns_process = owns_process
        self.notsent_lowat = notsent_lowat

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
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
