"""The fast path on uvicorn: direct frame writes and the publisher's websocket protections.

Do not import this module to get the class: ``changefeed.serving`` hands
``FanoutWebSocketProtocol`` out only where it was tested (changefeed.fast_path:
a uvicorn version range, the private names it uses, and a self-check that runs
it once), and uvicorn's own protocol (plain ASGI) everywhere else. It extends
uvicorn's private websockets sans-I/O protocol; every private name it uses is
listed in changefeed.uvicorn_private.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from uvicorn.protocols.websockets.websockets_sansio_impl import WebSocketsSansIOProtocol
from websockets.exceptions import PayloadTooBig
from websockets.frames import Close, Frame, Opcode
from websockets.http11 import Request
from websockets.protocol import State

from changefeed.bounded_writes import BoundedWrites
from changefeed.logs import log_event
from changefeed.publisher.wakeup import Wakeup
from changefeed.publisher.wire import DIRECT_WRITES, DISCONNECT_CAUSE, Disconnect
from changefeed.schemas import ERROR_CLOSE_CODES, ErrorFrame
from changefeed.tcp_liveness import (
    NOTSENT_LOWAT,
    PingWatch,
    bytes_acked,
    notsent_lowat,
    set_notsent_lowat,
    unacked_bytes,
    unsent_bytes,
)

__all__ = ["FanoutWebSocketProtocol"]

log = logging.getLogger("changefeed.serving")

_WRITE_BUFFER_HIGH = 4 * 1024
"""Bytes a listener's transport buffers above the kernel before the publisher's
writes to it wait: with ``TCP_NOTSENT_LOWAT`` below it, what sits ahead of a
ping or a pong stays small (changefeed.tcp_liveness). It is checked after a
write: one turn of frames may go past it."""
_PEER_BACKLOG = 256 * 1024
"""Bytes in a listener's transport buffer past which its frames are not read until
the buffer drains. The publisher's own writes wait at ``_WRITE_BUFFER_HIGH``; what
grows past it is what the protocol writes by itself, the pong of every ping: a peer
that sends pings and never reads their pongs would grow the buffer without bound."""
_ABORT_MARGIN = 1.0
"""Seconds past uvicorn's close handshake timeout before a connection whose app
is done is dropped (see FanoutWebSocketProtocol.run_asgi)."""


def _is_utf8(parts: list[bytes]) -> bool:
    try:
        (parts[0] if len(parts) == 1 else b"".join(parts)).decode()
    except UnicodeDecodeError:
        return False
    return True


class _DirectWriter:
    """changefeed.publisher.wire.FrameWriter for one uvicorn websocket connection.

    Called for every listener on every flush: it keeps what ``open`` reads at
    hand, and ``write`` is the bounded writes' (changefeed.bounded_writes), or
    the transport's own method."""

    __slots__ = ("_conn", "_protocol", "_socket", "_transport", "write")

    def __init__(self, protocol: FanoutWebSocketProtocol) -> None:
        self._protocol = protocol
        self._transport = protocol.transport
        self._conn = protocol.conn
        self._socket = protocol.transport.get_extra_info("socket")
        bounded = protocol.bounded_writes
        self.write = protocol.transport.write if bounded is None else bounded.write

    def backlogged(self) -> bool:
        return bool(self._transport.get_write_buffer_size())

    def buffered(self) -> int:
        # The kernel's part too: for a listener that stopped reading on a quiet
        # feed, what it has not taken may all sit there (the stall watch).
        return self._transport.get_write_buffer_size() + unacked_bytes(self._socket)

    @property
    def unsent_limit(self) -> int:
        return self._protocol.unsent_limit

    def hold_while_unsent(self) -> bool:
        return self._protocol.hold_while_unsent()

    @property
    def lost(self) -> bool:
        protocol = self._protocol
        return protocol.lost or protocol.close_sent or self._transport.is_closing()

    @property
    def open(self) -> bool:
        protocol = self._protocol
        return (
            not protocol.paused
            and not protocol.lost
            and not protocol.close_sent
            and self._conn.state is State.OPEN
            and not self._transport.is_closing()
        )


class _Inbox:
    """What uvicorn's protocol queues for the app's ``receive``: ``asyncio.Queue``'s
    ``put_nowait``, ``get`` and ``empty`` for its one reader, without the four empty
    deques (about 3 KB) every idle listener would hold."""

    __slots__ = ("_items", "_ready")

    def __init__(self) -> None:
        self._items: list[Any] = []
        self._ready = Wakeup()

    def put_nowait(self, item: Any) -> None:
        self._items.append(item)
        self._ready.set()

    async def get(self) -> Any:
        while not self._items:
            self._ready.clear()
            await self._ready.wait()
        return self._items.pop(0)

    def empty(self) -> bool:
        return not self._items

    def qsize(self) -> int:
        return len(self._items)


class FanoutWebSocketProtocol(WebSocketsSansIOProtocol):
    """uvicorn's ``websockets-sansio`` protocol, plus the ``DIRECT_WRITES`` scope
    extension through which a publisher writes each fan-out frame, serialised once,
    straight to the transport (changefeed.publisher.wire).

    The extension is offered only when no websocket extension (per-message
    deflate) was negotiated: compressed frames differ per connection.

    What else a publisher gets from it: a frame over ``ws_max_size`` is refused
    like one over the publisher's ``max_frame_bytes`` (error frame, then 4006),
    and a text frame that is not UTF-8 like any other bad frame (error frame,
    then 4000); a listener that stops answering pings while it makes no
    progress is reported to the app as such, at once, and one that reads is
    never cut off by them; a handshake refused with an HTTP response (401) is
    not logged as an error; a handshake websockets cannot parse is answered
    (431) and closed, not left open for good; what waits below the app is
    small (a 4 KiB transport buffer, ``TCP_NOTSENT_LOWAT`` made exact by
    writes that end their segment, ``bounded_writes``, and writes held while
    the kernel holds that much, ``hold_while_unsent``); and a connection
    whose app is done is dropped once its close handshake had its time, even
    when the peer stopped reading (``run_asgi``).
    """

    paused = False
    """Writes wait: the transport paused writing (asyncio flow control), or the
    kernel holds ``unsent_limit`` unsent (``hold_while_unsent``)."""
    unsent_limit = 0
    """The connection's own ``TCP_NOTSENT_LOWAT`` (0: none, the host's holds)."""
    _flow_paused = False
    _unsent_wait: int | None = None
    """A duplicate of the socket's descriptor, watched for writability while
    ``hold_while_unsent`` holds writes (None: not holding)."""
    lost = False
    """The connection is gone."""
    bounded_writes: BoundedWrites | None = None
    """The publisher's frames written so that the kernel holds at most
    ``unsent_limit`` and one write unsent (None: through the transport alone)."""
    reading_held = False
    """Reading is paused until the transport's buffer drains (``_PEER_BACKLOG``)."""
    _received = 0
    """Bytes the peer has sent (progress, for the keepalive)."""
    _ping_watch: PingWatch | None = None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # Ten thousand idle listeners: what each connection holds counts. The same
        # methods as uvicorn's asyncio.Queue and asyncio.Event, without their deques.
        self.queue: Any = _Inbox()
        self.writable: Any = Wakeup()
        self.writable.set()

    # -- asyncio's own protocol hooks (public), for state this class keeps itself

    def pause_writing(self) -> None:
        self._flow_paused = self.paused = True
        super().pause_writing()

    def resume_writing(self) -> None:
        self._flow_paused = False
        super().resume_writing()
        if self._unsent_wait is not None:
            self.writable.clear()  # the kernel still holds too much
        else:
            self.paused = False
        if self.reading_held:
            self.reading_held = False
            # uvicorn pauses reading too, while the app has not taken a message.
            if not self.read_paused and not self.transport.is_closing():
                self.transport.resume_reading()

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        self._end_unsent_wait()
        if self.bounded_writes is not None:
            self.bounded_writes.release()
        super().connection_lost(exc)

    def hold_while_unsent(self) -> bool:
        """Called after a write to a listener that is behind: True, and writes wait
        (``paused``, and uvicorn's ``writable`` for ASGI sends), while the kernel
        holds ``unsent_limit`` bytes or more that it has not sent.

        ``TCP_NOTSENT_LOWAT`` alone does not bound them: the kernel checks it only
        when a write needs a new segment, and appends to the last one (up to 64
        KiB) unchecked, so a listener's backlog would sit there, ahead of every
        ping and pong. The wait ends when the socket polls writable, which with
        the option set is when less than half of it is left unsent. Pings and
        pongs are written by the protocol itself and never wait."""
        if self._unsent_wait is not None:
            return True
        if not self.unsent_limit or self.lost or self.transport.is_closing():
            return False
        if not self._too_much_unsent():
            return False
        sock = self.transport.get_extra_info("socket")
        try:
            # A descriptor of its own: the transport's is registered with the loop
            # already, and a second registration would replace the transport's.
            watched = os.dup(sock.fileno())
        except OSError:
            return False  # out of descriptors: asyncio's flow control alone
        try:
            self.loop.add_writer(watched, self._unsent_sent)
        except Exception as exc:  # never out of a flush: asyncio's flow control alone
            os.close(watched)
            log_event(log, "listener.error", logging.ERROR, exc=exc, task="unsent hold")
            return False
        self._unsent_wait = watched
        self.paused = True
        self.writable.clear()
        return True

    def _too_much_unsent(self) -> bool:
        if self.transport.get_write_buffer_size():
            return True  # the kernel refused part of a write: it is full
        unsent = unsent_bytes(self.transport.get_extra_info("socket"))
        return unsent is not None and unsent >= self.unsent_limit

    def _unsent_sent(self) -> None:
        """The socket polls writable. The transport, woken by the same poll, may
        still have to write what it holds: then this waits on (the poll reports
        the socket writable again only once the kernel has sent it)."""
        if not self.lost and self._too_much_unsent():
            return
        self._end_unsent_wait()
        if not self._flow_paused:
            self.paused = False
            self.writable.set()

    def _end_unsent_wait(self) -> None:
        # Held only while waiting: the duplicate keeps the socket open, so the
        # transport's close takes effect once it is closed too.
        watched, self._unsent_wait = self._unsent_wait, None
        if watched is not None:
            self.loop.remove_writer(watched)
            os.close(watched)

    # -- uvicorn's (private, changefeed.uvicorn_private)

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
            self.conn.handshake_exc is not None
            and not self.handshake_complete
            and not self.transport.is_closing()
        ):
            self.transport.write(b"".join(self.conn.data_to_send()))
            self.transport.close()
        self._hold_reading_while_backlogged()

    def _hold_reading_while_backlogged(self) -> None:
        """Read nothing more from a peer that does not read what it asked for.

        Each ping read is answered at once with a pong, whatever the transport
        holds: a peer flooding pings and reading nothing would make the
        publisher's memory grow without bound. Past ``_PEER_BACKLOG`` its frames
        wait in the kernel until the buffer drains (``resume_writing``); one that
        never reads then makes no progress, and its pings' deadlines
        (``keepalive_timeout``) or the publisher's stall timeout end it."""
        transport = self.transport
        if transport.get_write_buffer_size() > _PEER_BACKLOG and not transport.is_closing():
            self.reading_held = True
            if transport.is_reading():
                transport.pause_reading()

    def handle_connect(self, event: Request) -> None:
        super().handle_connect(event)
        self._bound_unsent()
        # The ASGI task is created but has not run: the scope can still grow.
        if not self.close_sent and not self.conn.extensions:
            extensions: dict[str, Any] = self.scope["extensions"]
            extensions[DIRECT_WRITES] = _DirectWriter(self)

    def _bound_unsent(self) -> None:
        """Keep what waits below the app for this connection small: at most
        ``_WRITE_BUFFER_HIGH`` in the transport before the publisher's writes wait
        (asyncio's flow control), and ``NOTSENT_LOWAT`` unsent in the kernel unless
        the socket was given its own limit (a listening socket's is inherited)."""
        self.transport.set_write_buffer_limits(high=_WRITE_BUFFER_HIGH)
        sock = self.transport.get_extra_info("socket")
        limit = notsent_lowat(sock)
        if limit == 0 and set_notsent_lowat(sock, NOTSENT_LOWAT):
            limit = NOTSENT_LOWAT
        self.unsent_limit = limit or 0
        if self.unsent_limit:
            self.bounded_writes = BoundedWrites.of(self.transport)

    def handle_parser_exception(self) -> None:
        """A frame over ``ws_max_size`` gets the publisher's refusal, an error frame
        and 4006 (the app hears of it as a disconnect with that code and reason),
        instead of a bare 1009. The frame itself is never read: websockets refuses
        it from its header."""
        exc = self.conn.parser_exc
        if not isinstance(exc, PayloadTooBig) or not self.handshake_complete or self.close_sent:
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
            self.curr_msg_data_type == "text"
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
        if message["type"] == "websocket.accept" and self.handshake_complete:
            # The handshake's request and response are not read again, nor are the
            # scope's headers once the app accepted (it checked the token before):
            # kept, they would stay for the connection's life.
            self.request = self.response = None  # type: ignore[assignment]
            self.scope["headers"] = []
        if self.initial_response is not None and self.close_sent and not self.handshake_complete:
            # The app answered the handshake with an HTTP response (a refused token):
            # that is a complete handshake. uvicorn would log an error for each one
            # ("ASGI callable returned without completing handshake").
            self.handshake_complete = True

    def send_keepalive_ping(self) -> None:
        super().send_keepalive_ping()
        if self.pending_ping_payload is not None:
            if self._ping_watch is None:
                self._ping_watch = PingWatch()
            self._ping_watch.sent(self._acked(), self._received)

    def _acked(self) -> int | None:
        return bytes_acked(self.transport.get_extra_info("socket"))

    def keepalive_timeout(self) -> None:
        """A ping's deadline passed without its pong.

        A listener that reads slowly answers a ping only once it has read the
        frames before it. The deadline is extended until the connection has
        shown no progress (its TCP acknowledged nothing more, it sent nothing)
        for ``PingWatch.PATIENCE + 1`` deadlines in a row: a listener that reads
        is never cut off here, and one that stops is for the publisher's stall
        timeout (changefeed.tcp_liveness). Then uvicorn fails the connection, and
        the app hears of it at once and why, not only once the socket has closed
        (which, for a peer that stopped reading too, is when ``run_asgi`` aborts
        it)."""
        watch = self._ping_watch
        timeout = self.ping_timeout
        if (
            watch is not None
            and timeout is not None
            and not watch.expired(self._acked(), self._received)
        ):
            self.pong_timer = self.loop.call_later(timeout, self.keepalive_timeout)
            return
        failing = not (self.close_sent or self.transport.is_closing())
        super().keepalive_timeout()
        if failing:
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
        if self.lost:
            return
        if self.close_sent:
            self.loop.call_later(self.close_timeout + _ABORT_MARGIN, self._abort_unless_lost)
        elif self.transport.get_write_buffer_size():
            self._abort()

    def _abort_unless_lost(self) -> None:
        if not self.lost:
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
