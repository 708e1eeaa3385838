"""Deadlines for an HTTP request's head and body, for uvicorn: connections that send
nothing, or half a request, are closed.

uvicorn (0.54, both its httptools and its h11 protocols) has one timer on an
HTTP connection, ``timeout_keep_alive``: it is armed only when a response has
been sent, and cancelled by the next byte that arrives. Nothing is armed when
a connection is accepted, and nothing once the first byte of a request is in.
A peer that connects and sends nothing, or sends part of a request line or of
its headers and then stops (slowloris), keeps its socket, its protocol object
and its place in ``limit_concurrency`` for as long as it likes: uvicorn never
closes it.

``head_timeout_protocol(seconds)`` is uvicorn's HTTP protocol (httptools, as
``http="auto"`` chooses with uvicorn[standard], or h11) with a second timer,
the request head's deadline. It is armed when a connection is accepted and
whenever it starts waiting for its next request (a response was sent), and
cancelled once the request line and every header have arrived. When it
fires, a connection that sent part of a head is answered ``408 Request
Timeout`` and closed; one that sent nothing is closed without a word, as an
idle keep-alive connection is. An idle keep-alive connection still goes after
``timeout_keep_alive`` (5 s by default) when that comes first.

A request body has a deadline of the same length, as an idle one (nginx's
``client_body_timeout``): armed when the head is in, restarted by each part of
the body that arrives, cancelled once it is all in. A body that stops
arriving is answered ``408`` (unless the app already answered) and closed; a
slow one that keeps coming is served. It does not run while the server is the
one waiting: reading paused because the app has not taken what came, or a
client waiting for ``100 Continue``.

A request head has a size limit too, ``max_head_bytes`` (64 KiB, ``[server]
header_max_bytes``; nginx's default buffers hold 32 KiB): the bytes of a head
still under way are counted as they arrive, and a head that has not ended
within the limit is answered ``431 Request Header Fields Too Large`` and the
connection closed (a whole head that came in one read, at most 256 KiB, is
parsed as it is). uvicorn's
httptools protocol sets none, and the time it spends on a head grows with its
size: one peer sending an endless header would hold the event loop, and every
listener's deliveries with it. A chunked body's trailers are header fields
too: what a body brings besides itself (chunk sizes, extensions, trailers) may
exceed it by ``max_head_bytes`` plus eight bytes per body byte, and is
answered the same way past that (h11 bounds both with its own limit on an
incomplete event).

A websocket upgrade cancels the head's deadline with its headers, before the
connection becomes a websocket: registered listeners are never touched (the
publisher's own ``registration_timeout`` covers a websocket that never
registers).

Each timeout is logged (``http.head_timeout``, ``http.body_timeout``), and so is
each head refused for its size (``http.head_too_large``), but
not one line per socket: peers choose how many sockets time out, so the first
``LOG_BURST`` timeouts of every ``log_window`` seconds are logged one by one,
and the rest are counted and logged as one ``http.timeouts_held`` line when
that window ends (``changefeed.log_budget``).

These deadlines are first the proxy's job (nginx ``client_header_timeout`` and
``client_body_timeout``, granian's ``--http1-header-read-timeout``;
docs/security.md). This is an opt-in layer for uvicorn, on its private HTTP
protocols (changefeed.uvicorn_private): ask for it with
``changefeed.serving.server_config(app, host, port, head_timeout=15.0)``, which
uses it only where changefeed.fast_path's checks pass, and otherwise says why.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from typing import Any, ClassVar

import h11
from uvicorn.protocols.http.flow_control import FlowControl
from uvicorn.protocols.http.h11_impl import H11Protocol
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from changefeed.budgeted_log import BudgetedLines
from changefeed.log_budget import LogBudget
from changefeed.logs import log_event
from changefeed.publisher.config import ServerConfig

__all__ = [
    "DEFAULT_HEAD_TIMEOUT",
    "DEFAULT_MAX_HEAD_BYTES",
    "LOG_BURST",
    "LOG_WINDOW",
    "head_timeout_protocol",
]

log = logging.getLogger(__name__)

DEFAULT_HEAD_TIMEOUT: float = ServerConfig().header_timeout
"""Seconds a connection has to deliver a whole request head (``[server] header_timeout``):
far above any real client's, even over a slow link, and short enough that idle
sockets cannot pile up by the thousand."""

DEFAULT_MAX_HEAD_BYTES: int = ServerConfig().header_max_bytes
"""Bytes a request line and its headers may take (``[server] header_max_bytes``)."""

LOG_BURST = 10
"""Timeouts of one window logged one by one, each with its peer."""

LOG_WINDOW = 10.0
"""Seconds of a window: however many sockets time out, a server writes at most
``LOG_BURST`` + 1 timeout lines in that time."""


class _TimeoutLog:
    """The timeout lines of one protocol class (one server setting), within a budget."""

    __slots__ = ("_lines",)

    def __init__(self, window: float) -> None:
        self._lines = BudgetedLines(LogBudget(LOG_BURST, window), log, "http.timeouts_held")

    def timed_out(
        self, loop: asyncio.AbstractEventLoop, event: str, peer: str, **fields: Any
    ) -> None:
        if self._lines.due(event, loop):
            log_event(log, event, logging.INFO, peer=peer, **fields)


def _request_timeout(message: bytes) -> bytes:
    return (
        b"HTTP/1.1 408 Request Timeout\r\n"
        b"content-type: text/plain; charset=utf-8\r\n"
        b"content-length: %d\r\n"
        b"connection: close\r\n"
        b"\r\n%s" % (len(message), message)
    )


_REQUEST_TIMEOUT = _request_timeout(b"the request head did not arrive in time\n")
_BODY_TIMEOUT = _request_timeout(b"the request body stopped arriving\n")
_LINGER = 2.0
"""Seconds a connection answered 431 is still read (and what it sends dropped)
before it is closed, so that the answer is not lost to a reset."""
_FRAMING_PER_BODY_BYTE = 8
"""Bytes of chunk framing a body may bring per byte of its own, beyond
``max_head_bytes``: a chunk of one byte takes five more ("1\\r\\nX\\r\\n")."""
_HEAD_TOO_LARGE_MESSAGE = b"the request line and headers are too large\n"
_HEAD_TOO_LARGE = (
    b"HTTP/1.1 431 Request Header Fields Too Large\r\n"
    b"content-type: text/plain; charset=utf-8\r\n"
    b"content-length: %d\r\n"
    b"connection: close\r\n"
    b"\r\n%s" % (len(_HEAD_TOO_LARGE_MESSAGE), _HEAD_TOO_LARGE_MESSAGE)
)


class _HeadDeadline(asyncio.Protocol):
    """The deadlines' state and what happens when one passes, and the steps both
    protocols take alike (a mixin: it comes before uvicorn's protocol in their bases,
    so ``super()`` is uvicorn's)."""

    head_timeout: ClassVar[float] = DEFAULT_HEAD_TIMEOUT
    max_head_bytes: ClassVar[int] = DEFAULT_MAX_HEAD_BYTES
    timeout_log: ClassVar[_TimeoutLog]
    loop: asyncio.AbstractEventLoop
    transport: asyncio.Transport
    client: tuple[str, int] | None
    flow: FlowControl
    cycle: Any  # uvicorn's RequestResponseCycle of the request under way (None before one)
    _head_timer: asyncio.TimerHandle | None = None
    _head_started = False
    _head_bytes = 0
    _discarding = False
    _body_timer: asyncio.TimerHandle | None = None
    _in_body = False
    _body_phase_bytes = 0
    """Bytes received since the head ended, while the body is read."""
    _body_bytes = 0
    """Of those, the body's own."""

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm_head_deadline()

    def data_received(self, data: bytes) -> None:
        if self._discarding:
            return
        self._note_head_bytes(len(data))
        if self._in_body:
            self._body_phase_bytes += len(data)
        super().data_received(data)
        # Checked once the parser has seen the data: a head that ended in it (its
        # deadline cancelled) is not refused for the body that came with it.
        if self._head_timer is not None and self._head_bytes > self.max_head_bytes:
            self._fields_too_large("head")
        elif (
            self._in_body
            and self._body_phase_bytes - self._body_bytes
            > self.max_head_bytes + _FRAMING_PER_BODY_BYTE * self._body_bytes
        ):
            # What came besides the body (chunk sizes, their extensions, trailers)
            # is out of all proportion to it: a trailer section that never ends
            # is a request head that never ends.
            self._fields_too_large("framing")

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_head_deadline()
        self._cancel_body_deadline()
        super().connection_lost(exc)

    def _arm_head_deadline(self) -> None:
        """Start the deadline, unless it is running: bytes never extend it."""
        if self._head_timer is None and not self.transport.is_closing():
            self._head_started = False
            self._head_bytes = 0
            self._head_timer = self.loop.call_later(self.head_timeout, self._head_deadline_passed)

    def _cancel_head_deadline(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _note_head_bytes(self, count: int) -> None:
        if self._head_timer is not None:
            self._head_started = True
            self._head_bytes += count

    def _still_ours(self) -> bool:
        # Once handed to a websocket protocol, the transport is not this one's to close.
        protocol: object = self.transport.get_protocol()
        return not self.transport.is_closing() and protocol is self

    def _log_timeout(self, event: str, **fields: Any) -> None:
        client = self.client
        peer = f"{client[0]}:{client[1]}" if client else ""
        self.timeout_log.timed_out(self.loop, event, peer, **fields)

    def _fields_too_large(self, part: str) -> None:
        """Answer 431 and close: the peer has sent more head (``part``: ``head``), or
        more chunk framing and trailers (``framing``), than any client needs."""
        self._cancel_head_deadline()
        self._cancel_body_deadline()
        self._in_body = False
        if not self._still_ours():
            return
        self._log_timeout("http.head_too_large", part=part, limit=self.max_head_bytes)
        transport = self.transport
        cycle = self.cycle
        if cycle is not None:
            # The app's next receive() is a disconnect, and what it sends goes nowhere.
            cycle.disconnected = True
            cycle.message_event.set()
        if cycle is None or not cycle.response_started:
            transport.write(_HEAD_TOO_LARGE)
        if not transport.can_write_eof():
            transport.close()
            return
        # A lingering close: the peer is still sending its head, and closing now,
        # with its bytes unread, would reset the connection and lose the answer.
        # Say we are done (FIN), read and drop what still comes, close shortly.
        transport.write_eof()
        self._discarding = True
        self.loop.call_later(_LINGER, transport.close)

    def _head_deadline_passed(self) -> None:
        self._head_timer = None
        if not self._still_ours():
            return
        self._log_timeout(
            "http.head_timeout", partial=self._head_started, timeout=self.head_timeout
        )
        if self._head_started:
            self.transport.write(_REQUEST_TIMEOUT)
        self.transport.close()

    def _arm_body_deadline(self) -> None:
        """(Re)start the body's deadline: each part of the body that arrives restarts it."""
        self._cancel_body_deadline()
        if not self.transport.is_closing():
            self._body_timer = self.loop.call_later(self.head_timeout, self._body_deadline_passed)

    def _cancel_body_deadline(self) -> None:
        if self._body_timer is not None:
            self._body_timer.cancel()
            self._body_timer = None

    def _body_deadline_passed(self) -> None:
        self._body_timer = None
        if not self._still_ours():
            return
        cycle = self.cycle
        if self.flow.read_paused or (cycle is not None and cycle.waiting_for_100_continue):
            # The server is the one waiting (the app has not taken the body so far,
            # or has not asked for it): not the peer's delay.
            self._arm_body_deadline()
            return
        self._log_timeout("http.body_timeout", partial=True, timeout=self.head_timeout)
        answered = cycle is None or cycle.response_started
        if cycle is not None:
            # Whatever the app sends from now on goes nowhere (not after the 408), and
            # its next receive() is a disconnect.
            cycle.disconnected = True
            cycle.message_event.set()
        if not answered:
            self.transport.write(_BODY_TIMEOUT)
        self.transport.close()


class _HttpToolsHeadDeadline(_HeadDeadline, HttpToolsProtocol):
    """uvicorn's httptools protocol with the request head's deadline."""

    def on_headers_complete(self) -> None:
        self._cancel_head_deadline()
        super().on_headers_complete()
        self._arm_body_deadline()  # a request without a body completes at once
        # httptools takes chunk framing and trailers without a limit: counted.
        self._in_body, self._body_phase_bytes, self._body_bytes = True, 0, 0

    def on_body(self, body: bytes) -> None:
        self._body_bytes += len(body)
        super().on_body(body)
        if self._body_timer is not None:
            self._arm_body_deadline()

    def on_message_complete(self) -> None:
        self._in_body = False
        self._cancel_body_deadline()
        super().on_message_complete()

    def on_response_complete(self) -> None:
        # A queued (pipelined) request already has its whole head: it runs next.
        waits_for_a_request = not self.pipeline
        super().on_response_complete()
        if waits_for_a_request:
            self._arm_head_deadline()


class _H11HeadDeadline(_HeadDeadline, H11Protocol):
    """uvicorn's h11 protocol with the request head's deadline: h11 says whether the
    connection waits for a request (``IDLE``) after each step."""

    def handle_events(self) -> None:
        super().handle_events()
        self._follow_h11_state()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._follow_h11_state()

    def _follow_h11_state(self) -> None:
        state = self.conn.their_state
        if state is h11.IDLE:
            self._arm_head_deadline()
        else:  # a request head arrived (or an upgrade, or an error that closes)
            self._cancel_head_deadline()
        if state is h11.SEND_BODY:
            self._arm_body_deadline()  # its head, or more of its body, arrived
        else:
            self._cancel_body_deadline()


_BASES: dict[str, type[_HeadDeadline]] = {
    "httptools": _HttpToolsHeadDeadline,
    "h11": _H11HeadDeadline,
}


@functools.cache
def head_timeout_protocol(
    seconds: float = DEFAULT_HEAD_TIMEOUT,
    http: str = "auto",
    *,
    log_window: float = LOG_WINDOW,
    max_head_bytes: int = DEFAULT_MAX_HEAD_BYTES,
) -> type[asyncio.Protocol]:
    """uvicorn's HTTP protocol class that closes a connection whose request head has not
    arrived ``seconds`` after it was accepted or after its previous response.

    Args:
        seconds: the deadline (``[server] header_timeout``).
        http: ``"auto"`` or ``"httptools"`` (uvicorn[standard]'s choice), or ``"h11"``.
        log_window: seconds in which at most ``LOG_BURST`` timeouts are logged one
            by one; the rest are counted in one line at the window's end.
        max_head_bytes: a request line and headers that have not ended within this
            many bytes are answered 431 and the connection closed (``[server]
            header_max_bytes``).

    Raises:
        ValueError: ``seconds`` or ``log_window`` is not positive, ``max_head_bytes``
            is below 1 KiB, or ``http`` is unknown.
    """
    if not seconds > 0:
        raise ValueError(f"the request head timeout must be positive, got {seconds!r}")
    if not log_window > 0:
        raise ValueError(f"the log window must be positive, got {log_window!r}")
    if not max_head_bytes >= 1024:
        raise ValueError(
            f"the request head limit must be at least 1024 bytes, got {max_head_bytes!r}"
        )
    if http == "auto":
        http = "httptools"
    if http not in _BASES:
        raise ValueError(f"unknown HTTP protocol {http!r} (known: auto, {', '.join(_BASES)})")
    base = _BASES[http]
    attributes: dict[str, Any] = {
        "head_timeout": float(seconds),
        "max_head_bytes": int(max_head_bytes),
        "timeout_log": _TimeoutLog(log_window),
        "__module__": __name__,
    }
    protocol: type[asyncio.Protocol] = type(base.__name__.lstrip("_"), (base,), attributes)
    return protocol
