"""The /changefeeds websocket: handshake auth, registration, ack, resume replay, live items.

``ListenerEndpoint`` is a plain ASGI app (Starlette mounts it as is), so the
hot path calls the server's ASGI ``send`` directly, one await per frame, with
no per-message wrapper objects. The connection's own coroutine registers the
listener, then waits while two tasks of its own do the work: a sender, which
drains the outbox onto the socket, and a receiver, which takes whatever the
listener sends (node-sdc-changefeed sends "heartbeat" text frames; the server
keeps answering pings only while someone reads) and notices the disconnect.

Refusals: a missing or bad bearer token is refused at the handshake with HTTP
401 (503 when the authorizer is unavailable), before anything is read from
the listener; every later refusal is an error frame followed by a documented
close code (changefeed.schemas.closecodes). Nothing a listener sends can stop
the publisher from serving the others: every wait on a listener is bounded
(``registration_timeout``, ``close_timeout``), and a connection's failure
ends that connection only. It must never await anything that depends on
another listener.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import TYPE_CHECKING, Any

from starlette.types import Message, Receive, Scope, Send

from changefeed.logs import log_event
from changefeed.schemas import (
    ERROR_CLOSE_CODES,
    Ack,
    CursorError,
    ErrorFrame,
    Position,
    ProtocolError,
    Registration,
)

from .auth import AuthUnavailable
from .errors import ResumeGap
from .outbox import Outbox
from .registry import Closing, ListenerSession
from .wire import DIRECT_WRITES, FRAME_TOO_LARGE, KEEPALIVE_TIMEOUT, FrameWriter, batch_text

if TYPE_CHECKING:
    from .service import Publisher

__all__ = ["ListenerEndpoint"]

log = logging.getLogger(__name__)

_FRAMES_PER_TURN = 128
"""Single-item frames sent before yielding to other connections. Under uvloop the
frames of one turn leave in one write system call."""

_FRAMES_PER_FLUSH = 16
"""Single-item frames a flush writes directly to each connection: the flush runs
for every listener before any of them gets a second turn, so a burst reaches
all of them early; the senders then go on in turns of _FRAMES_PER_TURN."""

_HTTP_STATUS = {"unauthorized": 401, "forbidden": 403, "unavailable": 503}


class _Refusal(Exception):
    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


class _Gone(Exception):
    """The listener disconnected."""


def _refused_by_server(message: Message) -> _Refusal | None:
    """The server's own refusal of a frame over its size limit (changefeed.serving),
    told as a disconnect: the error frame and the close have already been sent."""
    if message.get("code") == ERROR_CLOSE_CODES[FRAME_TOO_LARGE] and (
        message.get("reason") == FRAME_TOO_LARGE
    ):
        return _Refusal(FRAME_TOO_LARGE, "frame exceeds the server's size limit")
    return None


def _peer(scope: Scope) -> str:
    client = scope.get("client")
    return f"{client[0]}:{client[1]}" if client else ""


class ListenerEndpoint:
    """The ASGI app behind ``WebSocketRoute("/changefeeds", ...)``.

    Args:
        publisher: the publisher whose listeners this serves.
    """

    def __init__(self, publisher: Publisher) -> None:
        self._publisher = publisher

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "websocket":  # pragma: no cover - the route only sends these
            return
        await _Connection(self._publisher, scope, receive, send).serve()


class _Connection:
    """One listener connection, from the handshake to the close."""

    __slots__ = ("_gone", "peer", "publisher", "receive", "scope", "send")

    def __init__(self, publisher: Publisher, scope: Scope, receive: Receive, send: Send) -> None:
        self.publisher = publisher
        self.scope = scope
        self.receive = receive
        self.send = send
        self.peer = _peer(scope)
        self._gone = False

    async def serve(self) -> None:
        message = await self.receive()
        if message["type"] != "websocket.connect":
            return
        publisher = self.publisher
        publisher.connection_opened()
        try:
            await self._serve()
        except OSError:
            pass  # the listener went away mid-send: nothing to tell it
        finally:
            publisher.connection_closed()

    async def _serve(self) -> None:
        publisher = self.publisher
        try:
            access = await publisher.authenticate(self.scope)
        except AuthUnavailable as exc:
            await self._refuse_handshake("unavailable", str(exc))
            return
        if access is None:
            await self._refuse_handshake("unauthorized", "missing or invalid bearer token")
            return
        await self.send({"type": "websocket.accept"})
        try:
            session = await self._register(access)
        except _Refusal as refusal:
            publisher.refused(refusal.code, "websocket", self.peer, refusal.message)
            await self._close(
                ERROR_CLOSE_CODES[refusal.code], ErrorFrame(refusal.code, refusal.message)
            )
            return
        except _Gone:
            return
        direct: _DirectSender | None = None
        writer: FrameWriter | None = self.scope.get("extensions", {}).get(DIRECT_WRITES)
        if writer is not None:
            # Only now, after the ack and any resume replay went out through ASGI.
            direct = _DirectSender(publisher, session, writer)
            session.outbox.send_now = direct.send_now
        try:
            await self._pump(session, direct)
        finally:
            session.outbox.send_now = None
            publisher.forget(session)

    # -- refusals and closing ----------------------------------------------

    async def _refuse_handshake(self, code: str, message: str) -> None:
        """Refuse before accepting: an HTTP answer where the server can send one
        (ASGI websocket denial response), else accept, error frame, close code."""
        self.publisher.refused(code, "websocket", self.peer, message)
        if "websocket.http.response" not in self.scope.get("extensions", {}):
            await self.send({"type": "websocket.accept"})
            await self._close(ERROR_CLOSE_CODES[code], ErrorFrame(code, message))
            return
        headers = [(b"content-type", b"application/json")]
        if code == "unauthorized":
            headers.append((b"www-authenticate", b"Bearer"))
        await self.send(
            {
                "type": "websocket.http.response.start",
                "status": _HTTP_STATUS[code],
                "headers": headers,
            }
        )
        body = ErrorFrame(code, message).encode().encode()
        await self.send({"type": "websocket.http.response.body", "body": body})

    async def _close(self, close_code: int, error: ErrorFrame | None) -> None:
        """Send the error frame (if any) and the close frame, waiting at most
        ``close_timeout`` for a listener that does not read."""
        if self._gone:
            return
        with contextlib.suppress(Exception):
            async with asyncio.timeout(self.publisher.config.close_timeout):
                if error is not None:
                    await self.send({"type": "websocket.send", "text": error.encode()})
                reason = error.code if error is not None else ""
                await self.send({"type": "websocket.close", "code": close_code, "reason": reason})

    # -- registration --------------------------------------------------------

    async def _receive_registration(self) -> str:
        config = self.publisher.config
        try:
            async with asyncio.timeout(config.registration_timeout):
                message = await self.receive()
        except TimeoutError:
            raise _Refusal(
                "registration_timeout", f"no registration within {config.registration_timeout:g}s"
            ) from None
        if message["type"] == "websocket.disconnect":
            self._gone = True
            raise _refused_by_server(message) or _Gone()
        text = message.get("text")
        if text is None:
            raise _Refusal("bad_frame", "registration must be a JSON text frame, not binary")
        if len(text) > config.max_frame_bytes or len(text.encode()) > config.max_frame_bytes:
            raise _Refusal(
                "frame_too_large", f"registration frame exceeds {config.max_frame_bytes} bytes"
            )
        return str(text)

    async def _register(self, access: frozenset[str]) -> ListenerSession:
        publisher = self.publisher
        config = publisher.config
        if publisher.draining:
            raise _Refusal("unavailable", "publisher is shutting down; register elsewhere")
        if publisher.connections > config.max_connections:
            raise _Refusal(
                "too_many_connections",
                f"publisher holds its maximum of {config.max_connections} connections",
            )
        text = await self._receive_registration()
        try:
            registration = Registration.decode(text)
        except ProtocolError as exc:
            raise _Refusal(exc.code, exc.message) from None
        if len(registration.change_kinds) > config.max_registrations:
            raise _Refusal(
                "too_many_registrations",
                f"{len(registration.change_kinds)} change kinds on one connection; "
                f"the limit is {config.max_registrations}",
            )
        routes = []
        for kind in registration.change_kinds:
            resource = config.resource(kind.resource)
            if resource is None:
                raise _Refusal("unknown_resource", f"no change feed for resource {kind.resource!r}")
            undeclared = sorted(set(kind.sub_resources) - set(resource.sub_resources))
            if resource.sub_resources and undeclared:
                # Accepted: the config's list is what GET /changefeeds advertises, not
                # a rule writers are held to, and RFD 5 listeners must work unchanged.
                # But it is most likely a typo on one side: say so.
                log_event(
                    log,
                    "registration.undeclared_sub_resources",
                    logging.WARNING,
                    peer=self.peer,
                    instance=registration.instance,
                    resource=kind.resource,
                    undeclared=undeclared,
                    declared=list(resource.sub_resources),
                )
            if "*" not in access and kind.resource not in access:
                raise _Refusal("forbidden", f"this token may not read resource {kind.resource!r}")
            routes.append(publisher.route_of(resource))
        since: Position | None = None
        if registration.since is not None:
            try:
                since = publisher.codec.decode(registration.since)
            except CursorError as exc:
                raise _Refusal("bad_cursor", exc.message) from None
        if not await publisher.wait_ready():
            raise _Refusal("unavailable", "the feed database is unreachable; retry later")
        resources = [kind.resource for kind in registration.change_kinds]
        resumed = since is not None and await publisher.can_resume(since, resources)
        if publisher.draining:
            raise _Refusal("unavailable", "publisher is shutting down; register elsewhere")

        # From here to the registry insert there is no await: everything at or
        # before `head` went out before this registration existed, everything after
        # it will be offered to this session's outbox by the tailer.
        head = publisher.tailer.position
        assert head is not None
        skip_until = max(since, head) if resumed and since is not None else head
        session = ListenerSession(
            instance=registration.instance,
            service=registration.service,
            outbox=Outbox(config.queue_size),
            batch=registration.batch,
            peer=self.peer,
            resumed=resumed,
        )
        publisher.admit(session, [(kind, skip_until) for kind in registration.change_kinds])
        ack = Ack(
            tuple(routes),
            publisher.codec.encode(skip_until),
            resumed,
            batch=registration.batch,
            multi=registration.multi,
        )
        try:
            await self.send({"type": "websocket.send", "text": ack.encode()})
            if resumed and since is not None and since < head:
                await self._replay(session, since, head)
        except ResumeGap as gap:
            publisher.forget(session)
            raise _Refusal("unavailable", str(gap)) from None
        except BaseException:
            publisher.forget(session)
            raise
        return session

    async def _send_text(self, text: str) -> None:
        await self.send({"type": "websocket.send", "text": text})

    async def _replay(self, session: ListenerSession, since: Position, head: Position) -> None:
        """The resume replay, bounded like every other wait on a listener: once the
        session is closing (evicted, drained), a replay stuck on a listener that
        does not read is given ``close_timeout``, then dropped.

        Raises:
            ResumeGap: the feed was trimmed under the replay.
        """
        publisher = self.publisher
        replay = asyncio.ensure_future(publisher.replay(self._send_text, session, since, head))
        try:
            await asyncio.wait(
                (replay, session.outbox.closing()), return_when=asyncio.FIRST_COMPLETED
            )
            if not replay.done():
                await asyncio.wait((replay,), timeout=publisher.config.close_timeout)
        finally:
            if not replay.done():
                replay.cancel()
                await asyncio.gather(replay, return_exceptions=True)
        if not replay.cancelled():
            replay.result()

    # -- live delivery -------------------------------------------------------

    async def _pump(self, session: ListenerSession, direct: _DirectSender | None) -> None:
        # The sender and the receiver are tasks of their own, not coroutines awaited
        # here: resuming a task wakes every coroutine frame it awaits through, and
        # this one sits under a dozen (server, middleware, router). A sender woken
        # for each change must resume two frames, not fourteen.
        sender = asyncio.create_task(
            self._send_loop(session, direct), name=f"changefeed-send-{session.id}"
        )
        receiver = asyncio.create_task(
            self._receive_loop(session), name=f"changefeed-receive-{session.id}"
        )
        closing = session.outbox.closing()
        try:
            await asyncio.wait((sender, receiver, closing), return_when=asyncio.FIRST_COMPLETED)
            if not sender.done():
                # Closing (evicted, draining, the listener left or sent too much): the
                # sender finishes the frame it is writing, unless the listener does not
                # read; then it is given up after close_timeout.
                await asyncio.wait((sender,), timeout=self.publisher.config.close_timeout)
        finally:
            for task in (sender, receiver):
                task.cancel()
            await asyncio.gather(sender, receiver, return_exceptions=True)
        if not sender.cancelled() and (exc := sender.exception()) is not None:
            if isinstance(exc, OSError):
                self._gone = True  # the server's ClientDisconnected is an OSError
            else:
                log_event(
                    log, "listener.error", logging.ERROR, instance=session.instance, error=repr(exc)
                )
                session.close(Closing(1011, None, f"internal error: {exc!r}"))
        why = session.closing
        if why is not None:
            error = ErrorFrame(why.error_code, why.message) if why.error_code else None
            await self._close(why.close_code, error)

    async def _send_loop(self, session: ListenerSession, direct: _DirectSender | None) -> None:
        publisher = self.publisher
        send = self.send
        outbox = session.outbox
        ready = outbox.ready
        max_batch = publisher.config.max_batch
        while True:
            await ready.wait()
            if session.closing is not None:
                return
            if direct is not None and direct.ready():
                direct.write_turn()
                if len(outbox):
                    await asyncio.sleep(0)  # take turns with the other connections
                continue
            outbox.sending = True
            try:
                if session.batch:
                    frames = outbox.take(max_batch)
                    if not frames:  # a flush's direct write took them first
                        continue
                    await send({"type": "websocket.send", "text": batch_text(frames)})
                    session.frames += 1
                    publisher.count_sent(len(frames), 1)
                else:
                    frames = outbox.take(_FRAMES_PER_TURN)
                    for frame in frames:
                        await send({"type": "websocket.send", "text": frame})
                    session.frames += len(frames)
                    publisher.count_sent(len(frames), len(frames))
            finally:
                outbox.sending = False
            session.sent += len(frames)
            if len(outbox):
                # Yield even when the transport never blocks: without it one busy
                # connection starves every other one on the event loop.
                await asyncio.sleep(0)

    async def _receive_loop(self, session: ListenerSession) -> None:
        try:
            await self._receive(session)
        finally:
            if session.closing is None:  # an unexpected end: let the sender know
                session.close(Closing(1011, None, "receiver ended"))

    async def _receive(self, session: ListenerSession) -> None:
        max_frame_bytes = self.publisher.config.max_frame_bytes
        receive = self.receive
        while True:
            message: Message = await receive()
            if message["type"] == "websocket.disconnect":
                self._gone = True
                refused = _refused_by_server(message)
                code = int(message.get("code", 1005))
                if refused is not None:
                    session.close(Closing(code, refused.code, refused.message))
                elif message.get("reason") == KEEPALIVE_TIMEOUT:
                    session.close(Closing(code, None, "no answer to pings (keepalive timeout)"))
                else:
                    session.close(Closing(code, None, "closed by listener"))
                return
            data: Any = message.get("text")
            if data is None:
                data = message.get("bytes") or b""
            elif len(data) * 4 > max_frame_bytes:
                data = data.encode()  # the limit is in bytes; UTF-8 takes up to 4 a character
            if len(data) > max_frame_bytes:
                session.close(
                    Closing(4006, "frame_too_large", f"frame exceeds {max_frame_bytes} bytes")
                )
                return
            # Anything else (RFD 5 listeners send "heartbeat") needs no answer.


class _DirectSender:
    """Direct writes for one connection (changefeed.publisher.wire): takes one turn
    of queued frames and writes them, serialised once for every listener through
    the publisher's ``FrameCache``, straight to the transport, without a task
    switch. Used by the fan-out's flush (``send_now``) and by the connection's
    sender for what one turn left queued. Refuses while the sender is mid-send
    (frames must never overtake each other) and while the transport is paused or
    closing; the sender's ASGI send, which waits for the transport, does that part.
    """

    __slots__ = ("_cache", "_flush_turn", "_publisher", "_session", "_turn", "_writer")

    def __init__(self, publisher: Publisher, session: ListenerSession, writer: FrameWriter) -> None:
        self._publisher = publisher
        self._session = session
        self._writer = writer
        max_batch = publisher.config.max_batch
        self._turn = max_batch if session.batch else _FRAMES_PER_TURN
        self._flush_turn = max_batch if session.batch else _FRAMES_PER_FLUSH
        self._cache = publisher.frame_cache

    def ready(self) -> bool:
        """True when a direct write may go out now."""
        session = self._session
        return not session.outbox.sending and session.closing is None and self._writer.open

    def send_now(self) -> bool:
        """The outbox's ``send_now``: one turn now; True when nothing is left queued."""
        if not self.ready():
            return False
        outbox = self._session.outbox
        frames = outbox.take(self._flush_turn)
        if frames:
            self._write(frames)
        return not len(outbox)

    def write_turn(self) -> None:
        """Write one turn of queued items (only when ``ready``)."""
        frames = self._session.outbox.take(self._turn)
        if frames:
            self._write(frames)

    def _write(self, frames: list[str]) -> None:
        session = self._session
        batch = session.batch
        data = self._cache.batch(frames) if batch else self._cache.singles(frames)
        try:
            self._writer.write(data)
        except Exception as exc:
            # Never let one connection's failure out of the flush: the tailer
            # would see its batch fail and read it again for everyone.
            session.dropped += len(frames)
            session.close(Closing(1011, None, f"write failed: {exc!r}"))
            log_event(
                log, "listener.error", logging.ERROR, instance=session.instance, error=repr(exc)
            )
            return
        count = 1 if batch else len(frames)
        session.frames += count
        session.sent += len(frames)
        publisher = self._publisher
        publisher.sent_total += len(frames)
        publisher.frames_total += count
