"""The /changefeeds websocket: handshake auth, registration, ack, and delivery to one listener.

``ListenerEndpoint`` is a plain ASGI app (Starlette mounts it as is), so the
hot path calls the server's ASGI ``send`` directly, one await per frame, with
no per-message wrapper objects. The connection's own coroutine registers the
listener, then waits while two tasks of its own do the work: a sender, which
writes the delivery's queue to the socket and refills it while the listener
catches up, and a receiver, which takes whatever the listener sends
(node-sdc-changefeed sends "heartbeat" text frames; the server keeps
answering pings only while someone reads) and notices the disconnect.

Refusals: a missing or bad bearer token is refused at the handshake with HTTP
401, before anything is read from the listener (an authorizer that is
unavailable: close 4010 with ``retryAfter`` right after the handshake; the
decision is changefeed.schemas.access's); every later refusal is an error
frame followed by a documented close code (changefeed.schemas.closecodes).
Nothing a listener sends can stop the publisher from serving the others:
every wait on a listener is bounded (``registration_timeout``,
``close_timeout``, and ``stall_timeout`` through the publisher's watch), and a
connection's failure ends that connection only.
It must never await anything that depends on another listener.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

from starlette.datastructures import Headers
from starlette.types import Message, Receive, Scope, Send

from changefeed.backoff import Backoff
from changefeed.logs import log_event
from changefeed.schemas import ERROR_CLOSE_CODES, AccessDenied, ErrorFrame

from .catchup import Filled
from .delivery import Closing, Delivery
from .entries import Item
from .feed import DB_ERRORS
from .host import ListenerHost
from .inflight import InFlight
from .pages import CursorExpired
from .registration import Refusal
from .registry import Session
from .wire import (
    DIRECT_WRITES,
    DISCONNECT_CAUSE,
    BatchFrames,
    Disconnect,
    FrameWriter,
    batch_text,
    frame_size,
)

__all__ = ["ListenerEndpoint"]

log = logging.getLogger(__name__)

_FRAMES_PER_TURN = 128
"""Single-item frames sent before yielding to other connections. Under uvloop the
frames of one turn leave in one write system call."""

_FRAMES_PER_FLUSH = 16
"""Single-item frames a flush writes directly to each connection: the flush runs
for every listener before any of them gets a second turn, so a burst reaches
all of them early; the senders then go on in turns of _FRAMES_PER_TURN."""

_PIECE_LIMITS = 2
"""A turn of single-item frames goes out in writes of about this many times the
kernel's unsent limit (``_DirectSender.write_turn``)."""

_REFILL_TURNS = 2
"""Turns of items a catching-up connection queues at a time."""

_FEED_RETRY = Backoff(initial=0.05, maximum=2.0, jitter=0.5)
"""Waits before reading the feed again after failed page reads in a row
(changefeed.backoff's policy): 50 ms doubling to 2 s, the upper half of each drawn
at random, so that the connections of a database outage do not all ask at once."""

_REFUSALS = ("frame_too_large", "bad_frame")
"""Server closes that refuse what the listener sent (counted as refusals)."""
_NO_CLOSE_FRAME = (1005, 1006)
"""Disconnect codes of a connection that ended without the listener's close frame."""

_KEEPALIVE_MESSAGE = "no answer to pings, and no progress meanwhile (keepalive timeout)"


class _Gone(Exception):
    """The listener disconnected."""


class _ClosedByServer(OSError):
    """The server refused an ASGI send because it had closed the connection itself
    (uvicorn's own keepalive, for one, raises RuntimeError then rather than the
    OSError the ASGI spec asks for): the connection is gone, as when the
    listener left mid-send, and nothing is wrong with the publisher."""


def _peer(scope: Scope) -> str:
    client = scope.get("client")
    return f"{client[0]}:{client[1]}" if client else ""


def _local_port(scope: Scope) -> int | None:
    server = scope.get("server")
    port = server[1] if server and len(server) > 1 else None
    if isinstance(port, str) and port.isdigit():
        return int(port)  # granian gives it as text
    return port if isinstance(port, int) else None


def _server_closing(message: Message) -> Closing | None:
    """Why the server itself ended the connection, from a disconnect message."""
    cause = message.get(DISCONNECT_CAUSE)
    code = int(message.get("code", 1005))
    if cause is Disconnect.FRAME_TOO_LARGE:
        return Closing(code, "frame_too_large", "frame exceeds the server's size limit")
    if cause is Disconnect.KEEPALIVE_TIMEOUT:
        return Closing(code, "keepalive_timeout", _KEEPALIVE_MESSAGE)
    if cause is Disconnect.BAD_FRAME:
        return Closing(code, "bad_frame", "a text frame that is not UTF-8")
    return None


class ListenerEndpoint:
    """The ASGI app behind ``WebSocketRoute("/changefeeds", ...)``.

    Args:
        host: the publisher whose listeners this serves.
    """

    def __init__(self, host: ListenerHost) -> None:
        self._host = host
        self._batches = BatchFrames()
        """Batch frames serialised once for every connection of this publisher."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "websocket":  # pragma: no cover - the route only sends these
            return
        await _Connection(self._host, self._batches, scope, receive, send).serve()


class _Connection:
    """One listener connection, from the handshake to the close."""

    __slots__ = ("_batches", "_gone", "host", "peer", "receive", "scope", "send", "writer")

    def __init__(
        self, host: ListenerHost, batches: BatchFrames, scope: Scope, receive: Receive, send: Send
    ) -> None:
        self.host = host
        self._batches = batches
        self.scope = scope
        self.receive = receive
        self.send = send
        self.peer = _peer(scope)
        self.writer: FrameWriter | None = scope.get("extensions", {}).get(DIRECT_WRITES)
        self._gone = False

    async def serve(self) -> None:
        message = await self.receive()
        if message["type"] != "websocket.connect":
            return
        self.host.connection_opened(self.writer is not None, _local_port(self.scope))
        try:
            await self._serve()
        except OSError:
            pass  # the listener went away mid-send: nothing to tell it
        finally:
            self.host.connection_closed()

    async def _serve(self) -> None:
        host = self.host
        access = await host.access(Headers(scope=self.scope), self.peer)
        if isinstance(access, AccessDenied):
            await self._refuse_handshake(access)
            return
        await self.send({"type": "websocket.accept"})
        full = host.capacity()
        if full is not None:
            await self._refuse(full)
            return
        try:
            text = await self._receive_registration()
        except _Refused as refused:
            await self._refuse(refused.refusal)
            return
        except _Gone:
            return
        outcome = await host.register(text, access.resources, self.peer)
        if isinstance(outcome, Refusal):
            await self._refuse(outcome)
            return
        session = outcome.session
        try:
            stall = host.config.stall_timeout
            try:
                # Bounded like every wait on a listener: one that does not even
                # take its ack (its pings' answers filled the buffer, and it reads
                # nothing) is evicted, and its connection let go.
                async with asyncio.timeout(stall):
                    try:
                        await self.send({"type": "websocket.send", "text": outcome.ack})
                    except RuntimeError as exc:
                        raise _ClosedByServer(str(exc)) from exc
            except TimeoutError:
                message = f"took not even its ack within {stall:g}s: evicted"
                host.evict(session, "slow_listener", message)
                return
            direct = None
            if self.writer is not None:
                direct = _DirectSender(
                    session.delivery, self.writer, host.config.max_batch, self._batches
                )
                session.delivery.send_now = direct.send_now
                session.delivery.buffered = self.writer.buffered
                session.delivery.in_flight = InFlight()
            await self._pump(session, direct)
        finally:
            session.delivery.send_now = None
            session.delivery.buffered = None
            session.delivery.in_flight = None
            host.forget(session)

    # -- refusals and closing ----------------------------------------------

    async def _refuse_handshake(self, denied: AccessDenied) -> None:
        """Refuse a token (``host.access`` counted it). A bad token is answered before
        accepting, in HTTP where the server can send it (ASGI websocket denial
        response). An authorizer that is unavailable is answered as every other
        retryable refusal on the websocket is: accepted, then error frame
        ``unavailable`` with ``retryAfter`` and close 4010, which any websocket
        client reads (a browser's cannot read a refused handshake's status)."""
        denial = "websocket.http.response" in self.scope.get("extensions", {})
        if not denial or denied.code == "unavailable":
            await self.send({"type": "websocket.accept"})
            await self._close(denied.close_code, denied.frame())
            return
        headers = [(b"content-type", b"application/json")]
        headers += [(k.lower().encode(), v.encode()) for k, v in denied.headers().items()]
        await self.send(
            {"type": "websocket.http.response.start", "status": denied.status, "headers": headers}
        )
        body = denied.frame().encode().encode()
        await self.send({"type": "websocket.http.response.body", "body": body})

    async def _refuse(self, refusal: Refusal) -> None:
        self.host.refused(refusal.code, "websocket", self.peer, refusal.message)
        error = ErrorFrame(refusal.code, refusal.message, refusal.retry_after)
        await self._close(ERROR_CLOSE_CODES[refusal.code], error)

    async def _close(self, close_code: int, error: ErrorFrame | None) -> None:
        """Send the error frame (if any) and the close frame, waiting at most
        ``close_timeout`` for a listener that does not read."""
        if self._gone:
            return
        with contextlib.suppress(Exception):
            async with asyncio.timeout(self.host.config.close_timeout):
                if error is not None:
                    await self.send({"type": "websocket.send", "text": error.encode()})
                reason = error.code if error is not None else ""
                await self.send({"type": "websocket.close", "code": close_code, "reason": reason})

    # -- registration --------------------------------------------------------

    async def _receive_registration(self) -> str:
        """The registration frame's text.

        Raises:
            _Refused: no registration in time, a binary one, or one too large.
            _Gone: the listener disconnected.
        """
        config = self.host.config
        try:
            async with asyncio.timeout(config.registration_timeout):
                message = await self.receive()
        except TimeoutError:
            raise _Refused(
                Refusal(
                    "registration_timeout",
                    f"no registration within {config.registration_timeout:g}s",
                )
            ) from None
        if message["type"] == "websocket.disconnect":
            self._gone = True
            closing = _server_closing(message)
            if closing is not None and closing.error_code in _REFUSALS:
                self.host.refused(closing.error_code, "websocket", self.peer, closing.message)
            raise _Gone()
        text = message.get("text")
        if text is None:
            raise _Refused(
                Refusal("bad_frame", "registration must be a JSON text frame, not binary")
            )
        limit = config.max_frame_bytes
        if len(text) > limit or len(text.encode()) > limit:
            raise _Refused(Refusal("frame_too_large", f"registration frame exceeds {limit} bytes"))
        return str(text)

    # -- delivery ------------------------------------------------------------

    async def _pump(self, session: Session, direct: _DirectSender | None) -> None:
        # The sender and the receiver are tasks of their own, not coroutines awaited
        # here: resuming a task wakes every coroutine frame it awaits through, and
        # this one sits under a dozen (server, middleware, router). A sender woken
        # for each change must resume two frames, not fourteen. Every way the
        # connection ends closes the delivery (each task does so when it ends), so
        # this waits for that alone: no asyncio.wait kept for each idle listener.
        sender = asyncio.create_task(
            self._sender(session, direct), name=f"changefeed-send-{session.id}"
        )
        receiver = asyncio.create_task(
            self._receive_loop(session), name=f"changefeed-receive-{session.id}"
        )
        try:
            await session.delivery.ended.wait()
            if not sender.done():
                # Closing (evicted, draining, the listener left or sent too much): the
                # sender finishes the frame it is writing, unless the listener does not
                # read; then it is given up after close_timeout.
                await asyncio.wait((sender,), timeout=self.host.config.close_timeout)
        finally:
            for task in (sender, receiver):
                task.cancel()
            await asyncio.gather(sender, receiver, return_exceptions=True)
        for task in (sender, receiver):
            if task.cancelled() or (exc := task.exception()) is None:
                continue
            if isinstance(exc, OSError):
                self._gone = True  # the server's ClientDisconnected is an OSError
                continue
            log_event(
                log,
                "listener.error",
                logging.ERROR,
                exc=exc,
                task=task.get_name(),
                instance=session.instance,
                peer=session.peer,
            )
            session.close(Closing(1011, None, f"internal error: {exc!r}"))
        why = session.closing
        if why is not None:
            error = (
                ErrorFrame(why.error_code, why.message, why.retry_after) if why.error_code else None
            )
            await self._close(why.close_code, error)

    async def _sender(self, session: Session, direct: _DirectSender | None) -> None:
        """Write what the delivery queues, and refill it while the listener catches
        up, until the delivery closes. One coroutine frame: every idle listener
        holds it."""
        delivery = session.delivery
        ready = delivery.ready
        turn = self.host.config.max_batch if delivery.batch else _FRAMES_PER_TURN
        refill = min(turn * _REFILL_TURNS, delivery.capacity)
        catchup = self.host.catchup
        failures = 0
        try:
            while True:
                await ready.wait()
                if delivery.closing is not None:
                    return
                if not delivery.queue:
                    if delivery.live:
                        ready.clear()  # a flush's direct write took what woke us
                        continue
                    if catchup.fill(delivery, refill) is Filled.NEEDS_FEED:
                        failures = await self._load(session, refill, failures)
                    # Take turns: a refill that found nothing wanted, or a page that
                    # was already kept, awaited nothing.
                    await asyncio.sleep(0)
                    continue
                if direct is None:
                    await self._send_turn(delivery, delivery.take(turn), direct)
                elif direct.ready():
                    direct.write_turn()
                else:
                    await self._send_turn(delivery, direct.take(turn), direct)
                if delivery.queue or not delivery.live:
                    # Yield even when the transport never blocks: without it one busy
                    # connection starves every other one on the event loop.
                    await asyncio.sleep(0)
        except OSError:
            session.close(Closing(1006, None, "gone mid-send"))
            raise
        except Exception as exc:
            session.close(Closing(1011, None, f"internal error: {exc!r}"))
            raise
        finally:
            if session.closing is None:  # an unexpected end: let the connection know
                session.close(Closing(1011, None, "sender ended"))

    async def _send_turn(
        self, delivery: Delivery, items: list[Item], direct: _DirectSender | None
    ) -> None:
        """Send ``items`` through ASGI sends, which wait while the transport is paused."""
        send = self.send
        delivery.sending = len(items)
        sent, size = 0, 0
        try:
            if delivery.batch:
                text = batch_text([i.text for i in items])
                await send({"type": "websocket.send", "text": text})
                delivery.frames += 1
                sent, size = len(items), frame_size(len(text.encode()))
            else:
                for item in items:
                    if direct is not None and direct.lost():
                        break  # gone meanwhile: the server would only log each write
                    await send({"type": "websocket.send", "text": item.text})
                    sent += 1
                    size += len(item.wire) if direct is not None else 0
                delivery.frames += sent
        except RuntimeError as exc:
            raise _ClosedByServer(str(exc)) from exc
        finally:
            delivery.sending = 0
            # Taken from the queue, so counted here whatever happened: written, or
            # lost with the connection (a send that failed, a peer gone meanwhile).
            delivery.sent += sent
            delivery.dropped += len(items) - sent
        if direct is not None:
            # What a direct write will follow: count it as written, not taken.
            direct.wrote(size, items[:sent])

    async def _load(self, session: Session, most: int, failures: int) -> int:
        """Read the next page of the feed for a listener behind the window; returns
        the failures in a row so far (retried with a growing wait)."""
        try:
            await self.host.catchup.load(session.delivery, most)
        except CursorExpired:
            self.host.evict(
                session,
                "cursor_expired",
                "the feed was trimmed past this listener's position while it caught up;"
                " register again without since and bootstrap",
            )
            return 0
        except DB_ERRORS as exc:
            failures += 1
            if failures == 1:
                log_event(
                    log,
                    "catchup.feed_unavailable",
                    logging.WARNING,
                    exc=exc,
                    instance=session.instance,
                    peer=session.peer,
                )
            # Waiting for the database is not the listener's fault (stall.py).
            session.delivery.waiting_on_feed = True
            try:
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(_FEED_RETRY.delay(failures, self.host.rng)):
                        await session.delivery.ended.wait()
            finally:
                session.delivery.waiting_on_feed = False
            return failures
        return 0

    async def _receive_loop(self, session: Session) -> None:
        """Take what the listener sends until it disconnects. One coroutine frame:
        every idle listener holds it."""
        max_frame_bytes = self.host.config.max_frame_bytes
        receive = self.receive
        try:
            while True:
                message: Message = await receive()
                if message["type"] == "websocket.disconnect":
                    self._disconnected(session, message)
                    return
                data: Any = message.get("text")
                if data is None:
                    data = message.get("bytes") or b""
                elif len(data) * 4 > max_frame_bytes:
                    data = data.encode()  # the limit is in bytes; UTF-8 takes up to 4 a character
                if len(data) > max_frame_bytes:
                    why = f"frame exceeds {max_frame_bytes} bytes"
                    self.host.refused("frame_too_large", "websocket", self.peer, why)
                    session.close(Closing(4006, "frame_too_large", why))
                    return
                # Anything else (RFD 5 listeners send "heartbeat") needs no answer.
        finally:
            if session.closing is None:  # an unexpected end: let the sender know
                session.close(Closing(1011, None, "receiver ended"))

    def _disconnected(self, session: Session, message: Message) -> None:
        """The connection ended: why, and what the publisher makes of it."""
        self._gone = True
        closing = _server_closing(message)
        code = int(message.get("code", 1005))
        if closing is not None and closing.error_code == "keepalive_timeout":
            # A liveness close is an eviction like the stall watch's.
            self.host.evict(session, closing.error_code, closing.message, code)
            return
        if closing is not None and closing.error_code in _REFUSALS:
            self.host.refused(closing.error_code, "websocket", self.peer, closing.message)
        if closing is None and code in _NO_CLOSE_FRAME:
            # Dropped, not closed: the listener's host, the network, or the server
            # (its own keepalive, through plain ASGI) ended it.
            closing = Closing(code, None, "connection lost without a close frame from the listener")
        session.close(closing or Closing(code, None, "closed by listener"))


class _Refused(Exception):
    """A registration refused before it reached the publisher (timeout, size, binary)."""

    def __init__(self, refusal: Refusal) -> None:
        super().__init__(refusal.message)
        self.refusal = refusal


class _DirectSender:
    """Direct writes for one connection (changefeed.publisher.wire): takes one turn
    of queued items and writes their frames, serialised once for every listener,
    straight to the transport, without a task switch. Used by the fan-out's flush
    (``send_now``) and by the connection's sender. Refuses while the sender is
    mid-send through ASGI (frames must never overtake each other) and while the
    transport is paused or closing; the sender's ASGI send, which waits for the
    transport, does that part.
    """

    __slots__ = (
        "_batches",
        "_delivery",
        "_flush_turn",
        "_frame_bytes",
        "_holding",
        "_turn",
        "_writer",
    )

    def __init__(
        self, delivery: Delivery, writer: FrameWriter, max_batch: int, batches: BatchFrames
    ) -> None:
        self._delivery = delivery
        self._writer = writer
        self._batches = batches
        self._turn = max_batch if delivery.batch else _FRAMES_PER_TURN
        self._flush_turn = max_batch if delivery.batch else _FRAMES_PER_FLUSH
        self._holding = False
        """A write found the kernel holding its limit unsent since the listener last
        caught up: it reads slower than it is written to, and turns are cut to that
        limit."""
        self._frame_bytes = 256
        """Bytes of the last write's frames, on average (what sizes a turn's pieces)."""

    def lost(self) -> bool:
        """True once the connection is closing or gone."""
        return self._writer.lost

    def ready(self) -> bool:
        """True when a direct write may go out now."""
        delivery = self._delivery
        return not delivery.sending and delivery.closing is None and self._writer.open

    def send_now(self) -> bool:
        """The delivery's ``send_now``: one turn now; True when nothing is left queued."""
        if not self.ready():
            return False
        delivery = self._delivery
        items = self.take(self._flush_turn)
        if items:
            self._write(items)
        return not delivery.queue

    def write_turn(self) -> None:
        """Write one turn of queued items (only when ``ready``).

        Single-item frames go out in pieces of about ``_PIECE_LIMITS`` times the
        kernel's unsent limit, and the turn ends at the first piece the kernel does
        not take whole (the writer is ``backlogged``) or that made the writer hold
        (``wrote``): the rest stays queued here, where catch-up paces it, instead
        of waiting in the kernel or the transport ahead of the listener's pings.
        The kernel refuses past its limit because each write ends its segment
        (changefeed.bounded_writes). Once held, turns are cut to the limit."""
        writer = self._writer
        limit = writer.unsent_limit
        delivery = self._delivery
        if delivery.batch or not limit or self._holding:
            items = self.take(self._turn)
            if items:
                self._write(items)
            return
        piece = max(1, _PIECE_LIMITS * limit // self._frame_bytes)
        left = self._turn
        while left > 0:
            items = delivery.take(min(left, piece))
            if not items:
                return
            self._write(items)
            left -= len(items)
            if writer.backlogged() or not self.ready():
                return

    def take(self, most: int) -> list[Item]:
        """Up to ``most`` queued items for the next write; for a listener that reads
        slower than it is written to, no more bytes than its kernel may hold unsent."""
        return self._delivery.take(most, self._writer.unsent_limit if self._holding else 0)

    def _write(self, items: list[Any]) -> None:
        delivery = self._delivery
        if delivery.batch:
            data = self._batches.frame(items, [item.text for item in items])
            frames = 1
        else:
            data = b"".join([item.wire for item in items])
            frames = len(items)
            self._frame_bytes = len(data) // frames or 1
        try:
            self._writer.write(data)
        except Exception as exc:
            # Never let one connection's failure out of the flush: the tailer
            # would see its batch fail and read it again for everyone.
            delivery.dropped += len(items)
            delivery.close(Closing(1011, None, f"write failed: {exc!r}"))
            log_event(log, "listener.error", logging.ERROR, exc=exc, task="direct write")
            return
        delivery.frames += frames
        delivery.sent += len(items)
        self.wrote(len(data), items)

    def wrote(self, size: int, items: list[Any]) -> None:
        """``items`` went out in ``size`` bytes (directly, or through the sender's
        ASGI sends): not taken until the listener's TCP acknowledges them."""
        delivery = self._delivery
        in_flight = delivery.in_flight
        if in_flight is not None and items:
            in_flight.wrote(size, len(items), items[0].published)
            if in_flight.crowded:
                in_flight.settle(self._writer.buffered())
        if not delivery.live or (self._holding and delivery.queue):
            # Catching up, or still behind since: one look at the kernel, a system
            # call per write. A live listener that never fell behind its queue costs
            # none (its backlog is bounded by the queue): holding the writes of
            # every listener a burst leaves briefly behind cost a live fan-out 14 %.
            if self._writer.hold_while_unsent():
                self._holding = True
        else:
            self._holding = False  # live, nothing queued: full turns again
