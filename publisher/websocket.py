"""The /changefeeds websocket: registration, ack, resume replay, then live change items.

One coroutine per listener connection. It validates the first frame against
the registration schema, answers with an ack, replays what a resuming
listener missed, and then runs two loops until either ends: the sender drains
this connection's outbox onto the socket, and the receiver takes whatever the
listener sends (node-sdc-changefeed sends "heartbeat" text frames) and
notices the disconnect. Every refusal is an error frame and a documented
close code (changefeed.schemas.closecodes); nothing a listener sends can stop
the publisher from serving the others.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

from starlette.websockets import WebSocket, WebSocketDisconnect

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

from .outbox import Outbox
from .registry import Closing, ListenerSession

if TYPE_CHECKING:
    from .service import Publisher

__all__ = ["serve_listener"]

log = logging.getLogger(__name__)

_SEND_TIMEOUT = 2.0
_FRAMES_PER_TURN = 64  # single-item frames sent before yielding to other connections


class _Refusal(Exception):
    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


async def _close(ws: WebSocket, close_code: int, error: ErrorFrame | None) -> None:
    """Send the error frame (if any) and close, never waiting long on a peer that does not read."""
    with contextlib.suppress(Exception):
        if error is not None:
            await asyncio.wait_for(ws.send_text(error.encode()), _SEND_TIMEOUT)
        await asyncio.wait_for(ws.close(close_code), _SEND_TIMEOUT)


def _peer(ws: WebSocket) -> str:
    return f"{ws.client.host}:{ws.client.port}" if ws.client else ""


async def serve_listener(publisher: Publisher, ws: WebSocket) -> None:
    """Serve one listener connection until it closes, is evicted, or the publisher stops."""
    peer = _peer(ws)
    await ws.accept()
    publisher.connections += 1
    try:
        try:
            session = await _register(publisher, ws, peer)
        except _Refusal as refusal:
            publisher.metrics.refusals_total.labels(refusal.code).inc()
            log_event(
                log,
                "registration.refused",
                logging.WARNING,
                peer=peer,
                code=refusal.code,
                reason=refusal.message,
            )
            await _close(
                ws, ERROR_CLOSE_CODES[refusal.code], ErrorFrame(refusal.code, refusal.message)
            )
            return
        except WebSocketDisconnect:
            return
        if session is None:
            return
        try:
            await _pump(publisher, ws, session)
        finally:
            publisher.forget(session)
    finally:
        publisher.connections -= 1


async def _receive_registration(publisher: Publisher, ws: WebSocket) -> str | None:
    config = publisher.config
    try:
        message = await asyncio.wait_for(ws.receive(), config.registration_timeout)
    except TimeoutError:
        raise _Refusal(
            "registration_timeout", f"no registration within {config.registration_timeout:g}s"
        ) from None
    if message["type"] == "websocket.disconnect":
        return None
    text = message.get("text")
    if text is None:
        raise _Refusal("bad_frame", "registration must be a JSON text frame, not binary")
    if len(text) > config.max_frame_bytes or len(text.encode()) > config.max_frame_bytes:
        raise _Refusal(
            "frame_too_large", f"registration frame exceeds {config.max_frame_bytes} bytes"
        )
    return str(text)


async def _register(publisher: Publisher, ws: WebSocket, peer: str) -> ListenerSession | None:
    config = publisher.config
    if publisher.draining:
        raise _Refusal("unavailable", "publisher is shutting down; register elsewhere")
    if publisher.connections > config.max_connections:
        raise _Refusal(
            "too_many_connections",
            f"publisher holds its maximum of {config.max_connections} connections",
        )
    if not await publisher.authorize_handshake(ws):
        raise _Refusal("unauthorized", "missing or invalid bearer token")
    text = await _receive_registration(publisher, ws)
    if text is None:
        return None
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
        if not publisher.may_read(ws, kind.resource):
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
        peer=peer,
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
        await ws.send_text(ack.encode())
        if resumed and since is not None and since < head:
            await publisher.replay(ws, session, since, head)
    except BaseException:
        publisher.forget(session)
        raise
    return session


async def _send_loop(
    ws: WebSocket, session: ListenerSession, max_batch: int, on_sent: Callable[[int], None]
) -> None:
    outbox = session.outbox
    while True:
        await outbox.wait()
        if session.batch:
            frames = outbox.take(max_batch)
            await ws.send_text("[" + ",".join(frames) + "]")
        else:
            frames = outbox.take(_FRAMES_PER_TURN)
            for frame in frames:
                await ws.send_text(frame)
        on_sent(len(frames))
        # Yield even when the transport never blocks: without it one busy
        # connection starves every other one on the event loop.
        await asyncio.sleep(0)


async def _receive_loop(ws: WebSocket, session: ListenerSession, max_frame_bytes: int) -> None:
    while True:
        message = await ws.receive()
        if message["type"] == "websocket.disconnect":
            return
        data = message.get("text") or message.get("bytes") or ""
        if len(data) > max_frame_bytes:
            session.close(
                Closing(4006, "frame_too_large", f"frame exceeds {max_frame_bytes} bytes")
            )
            return
        # Anything else (RFD 5 listeners send "heartbeat") needs no answer.


async def _pump(publisher: Publisher, ws: WebSocket, session: ListenerSession) -> None:
    closing = asyncio.Event()
    session.on_close = lambda _: closing.set()
    if session.closing is not None:
        closing.set()
    tasks = {
        asyncio.create_task(
            _send_loop(ws, session, publisher.config.max_batch, publisher.count_sent)
        ),
        asyncio.create_task(_receive_loop(ws, session, publisher.config.max_frame_bytes)),
        asyncio.create_task(closing.wait()),
    }
    try:
        done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    for task in done:
        if (
            not task.cancelled()
            and (exc := task.exception()) is not None
            and not isinstance(exc, WebSocketDisconnect | OSError | RuntimeError)
        ):
            log_event(
                log, "listener.error", logging.ERROR, instance=session.instance, error=repr(exc)
            )
    if session.closing is not None:
        c = session.closing
        error = ErrorFrame(c.error_code, c.message) if c.error_code else None
        await _close(ws, c.close_code, error)
