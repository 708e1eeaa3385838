"""One connection of a listener: connect, register, bootstrap while buffering, read frames.

The websockets / httpx half of ``Listener`` (module ``listener``). The
lifecycle task makes one ``Session`` per attempt and runs it; a session only
ends by raising ``SessionError``, and classifying that, clearing and backing
off stay with the lifecycle task. A session owns nothing that outlives its
connection: what it learns goes to its ``SessionHost`` (the listener), which
keeps the counters, the buffer and the connection state.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from typing import Any, Protocol
from urllib.parse import urljoin

import httpx
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed, InvalidHandshake, InvalidStatus, InvalidURI

from changefeed.bootstrap import BootstrapError, Pager, PagerProgress
from changefeed.logs import log_event
from changefeed.schemas import Ack, ChangeItem, ErrorFrame, ProtocolError

from ._config import ListenerConfig
from ._errors import (
    BadPublisherFrame,
    BootstrapFailed,
    PublisherClosed,
    RegistrationRefused,
    SessionError,
)
from ._events import Resynced
from ._frames import decode_frame, error_frame

__all__ = ["Session", "SessionHost"]

# The listener's logger: its events keep one logger name, whichever module logs them.
log = logging.getLogger("changefeed.listener.listener")


class SessionHost(Protocol):
    """What a session reports to its listener, in the order it happens."""

    def log_fields(self) -> dict[str, Any]:
        """The listener's fields for this session's log events."""

    def frame_received(self) -> None:
        """A frame arrived (before it is decoded: error and bad frames count too)."""

    def registered(self, ack: Ack, route: str) -> None:
        """The publisher acked the registration; ``route`` is the absolute bootstrap URL."""

    def bootstrapping(self) -> None:
        """The ack did not resume: the bootstrap walk starts (items are buffered meanwhile)."""

    def bootstrapped(self, resync: Resynced) -> None:
        """The walk ended; ``resync`` goes to the application before any buffered item."""

    def live(self) -> None:
        """Resumed or bootstrapped: items now flow to the application."""

    async def received(self, items: Sequence[ChangeItem]) -> None:
        """One frame's change items arrived.

        Raises:
            BufferOverflow: they do not fit in the buffer; the session ends.
        """


def _closed(exc: ConnectionClosed, error: ErrorFrame | None) -> PublisherClosed:
    code = exc.rcvd.code if exc.rcvd is not None else None
    reason = exc.rcvd.reason if exc.rcvd is not None else str(exc)
    if error is not None:
        return PublisherClosed(f"publisher error {error.code}: {error.message}", code, error.code)
    return PublisherClosed(f"connection closed: {reason or exc}", code)


class Session:
    """One connection to the publisher, from the handshake to its end.

    Args:
        host: the listener it reports to.
        url: the publisher's websocket endpoint.
        api_url: what the ack's bootstrap route is resolved against.
        registration: the encoded registration frame (with ``since`` when resuming).
        resuming: the registration carries ``since``.
        config: the listener's settings.
        http: the client of the bootstrap walk.
        token: bearer token for the handshake.
        name: the listener's name (task names).
        first_bootstrap: no bootstrap of this listener has completed yet.
    """

    def __init__(
        self,
        host: SessionHost,
        *,
        url: str,
        api_url: str,
        registration: str,
        resuming: bool,
        config: ListenerConfig,
        http: httpx.AsyncClient,
        token: str | None,
        name: str,
        first_bootstrap: bool,
    ) -> None:
        self._host = host
        self._url = url
        self._api_url = api_url
        self._registration = registration
        self._resuming = resuming
        self._config = config
        self._http = http
        self._token = token
        self._name = name
        self._first_bootstrap = first_bootstrap

    async def run(self) -> None:
        """Connect and serve until the connection ends; always raises ``SessionError``."""
        config = self._config
        headers = {"Authorization": f"Bearer {self._token}"} if self._token else None
        try:
            async with connect(
                self._url,
                additional_headers=headers,
                open_timeout=config.open_timeout,
                ping_interval=config.ping_interval,
                ping_timeout=config.ping_timeout,
                close_timeout=config.close_timeout,
                max_size=config.max_frame_bytes,
            ) as ws:
                await ws.send(self._registration)
                ack = await self._receive_ack(ws)
                await self._serve(ws, ack)
        except SessionError:
            raise
        except InvalidStatus as exc:
            status = exc.response.status_code
            raise PublisherClosed(f"handshake refused: HTTP {status}", status=status) from None
        except InvalidURI as exc:
            raise RegistrationRefused("bad_url", str(exc)) from None
        except ConnectionClosed as exc:
            raise _closed(exc, None) from None
        except (OSError, TimeoutError, InvalidHandshake) as exc:
            raise PublisherClosed(f"cannot connect: {exc!r}") from None

    async def _receive_ack(self, ws: ClientConnection) -> Ack:
        try:
            async with asyncio.timeout(self._config.ack_timeout):  # not wait_for: see workqueue
                raw = await ws.recv()
        except TimeoutError:
            raise PublisherClosed(f"no ack within {self._config.ack_timeout:g}s") from None
        except ConnectionClosed as exc:
            raise _closed(exc, None) from None
        decoded = error_frame(raw)
        if decoded is not None:
            raise PublisherClosed(
                f"registration refused ({decoded.code}): {decoded.message}", None, decoded.code
            )
        try:
            ack = Ack.decode(raw)
        except ProtocolError as exc:
            raise BadPublisherFrame(f"bad ack ({exc.code}): {exc.message}") from None
        route = urljoin(self._api_url, ack.bootstrap_route)
        self._host.registered(ack, route)
        log_event(
            log,
            "listener.registered",
            **self._host.log_fields(),
            resumed=ack.resumed,
            route=route,
            cursor=ack.cursor,
        )
        return ack

    async def _serve(self, ws: ClientConnection, ack: Ack) -> None:
        receiver = asyncio.create_task(self._receive(ws), name=f"changefeed-recv-{self._name}")
        try:
            if not (ack.resumed and self._resuming):
                self._host.bootstrapping()
                self._host.bootstrapped(await self._bootstrap(ack, receiver))
            self._host.live()
            await receiver
        finally:
            receiver.cancel()
            await asyncio.gather(receiver, return_exceptions=True)

    async def _bootstrap(self, ack: Ack, receiver: asyncio.Task[None]) -> Resynced:
        """Walk the bootstrap route while ``receiver`` buffers; a receiver failure
        (overflow, drop) aborts the walk."""
        route = urljoin(self._api_url, ack.bootstrap_route)
        pager = Pager(
            self._http,
            route,
            limit=self._config.page_limit,
            max_attempts=self._config.page_attempts,
            on_progress=self._on_page,
        )
        log_event(log, "listener.bootstrapping", **self._host.log_fields(), route=route)

        async def walk() -> list[Any]:
            items: list[Any] = []
            async for page in pager.pages():
                items.extend(page)
            return items

        walker = asyncio.create_task(walk(), name=f"changefeed-bootstrap-{self._name}")
        try:
            await asyncio.wait({walker, receiver}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not walker.done():
                walker.cancel()
                await asyncio.gather(walker, return_exceptions=True)
        if receiver.done():
            receiver.result()  # raises the receiver's SessionError
            raise PublisherClosed("connection ended during bootstrap")
        try:
            items = walker.result()
        except BootstrapError as exc:
            raise BootstrapFailed(f"bootstrap walk failed: {exc}", exc.status) from None
        except Exception as exc:  # e.g. httpx.InvalidURL: still this session's failure
            raise BootstrapFailed(f"bootstrap walk failed: {exc!r}") from None
        progress = pager.progress
        log_event(
            log,
            "listener.bootstrapped",
            **self._host.log_fields(),
            items=len(items),
            pages=progress.pages,
            elapsed=round(progress.elapsed, 4),
            rate=round(progress.rate, 1),
            retries=pager.retries,
        )
        return Resynced(
            items, route, ack.cursor, progress.pages, progress.elapsed, self._first_bootstrap
        )

    def _on_page(self, progress: PagerProgress) -> None:
        log_event(
            log,
            "listener.bootstrap.page",
            logging.DEBUG,
            **self._host.log_fields(),
            items=progress.items,
            pages=progress.pages,
            rate=round(progress.rate, 1),
        )

    async def _receive(self, ws: ClientConnection) -> None:
        """Read frames into the host until the connection ends; always raises SessionError."""
        while True:
            try:
                raw = await ws.recv()
            except ConnectionClosed as exc:
                raise _closed(exc, None) from None
            self._host.frame_received()
            decoded = decode_frame(raw)
            if isinstance(decoded, ErrorFrame):
                raise PublisherClosed(
                    f"publisher error {decoded.code}: {decoded.message}", None, decoded.code
                )
            await self._host.received(decoded)
