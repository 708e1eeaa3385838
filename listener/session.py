"""One connection of a listener: connect, register, bootstrap while buffering, read frames.

The websockets / httpx half of ``Listener`` (module ``listener``), as its base
class: the lifecycle task calls ``_session`` once per attempt, and a session
only ends by raising ``SessionError``; classifying that, clearing and backing
off stay with the lifecycle task. ``Listener.__init__`` sets the state the
methods here use (declared below for the type checker).
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any
from urllib.parse import urljoin

import httpx
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed, InvalidHandshake, InvalidStatus, InvalidURI

from changefeed.bootstrap import BootstrapError, Pager, PagerProgress
from changefeed.logs import log_event
from changefeed.schemas import (
    Ack,
    ChangeItem,
    ChangeKind,
    ErrorFrame,
    ProtocolError,
    Registration,
)

from .backoff import Backoff
from .buffer import Buffer
from .config import ListenerConfig
from .errors import (
    BadPublisherFrame,
    BootstrapFailed,
    BufferOverflow,
    PublisherClosed,
    RegistrationRefused,
    SessionError,
)
from .events import Resynced
from .frames import decode_frame, error_frame
from .lifecycle import ConnectionState, Lifecycle

__all__: list[str] = []

# The listener's logger: its events keep one logger name, whichever module logs them.
log = logging.getLogger("changefeed.listener.listener")

S = ConnectionState
_LOW_WATER = 0.5  # the high-water event re-arms once the buffer drains below this


class _Session:
    """The per-connection methods of ``Listener``."""

    url: str
    api_url: str
    instance: str
    service: str
    change_kind: ChangeKind
    name: str
    config: ListenerConfig
    attempts: int
    registrations: int
    resumes: int
    bootstraps: int
    overflows: int
    items_received: int
    frames_received: int
    _token: str | None
    _http: httpx.AsyncClient | None
    _buffer: Buffer
    _backoff: Backoff
    _lifecycle: Lifecycle
    _clock: Callable[[], float]
    _cursor: str | None
    _route: str | None
    _ready: asyncio.Event
    _staged: deque[ChangeItem]
    _resync: Resynced | None
    _high: bool
    _peak: int
    _bootstrapped_once: bool
    _live_since: float | None

    if TYPE_CHECKING:

        def _fields(self) -> dict[str, Any]: ...

    def _registration(self, since: str | None) -> str:
        return Registration(
            self.instance, self.service, (self.change_kind,), since=since, batch=self.config.batch
        ).encode()

    async def _session(self) -> None:
        config = self.config
        since = self._cursor if config.resume else None
        self.attempts += 1
        log_event(log, "listener.connecting", **self._fields(), url=self.url, since=since)
        headers = {"Authorization": f"Bearer {self._token}"} if self._token else None
        try:
            async with connect(
                self.url,
                additional_headers=headers,
                open_timeout=config.open_timeout,
                ping_interval=config.ping_interval,
                ping_timeout=config.ping_timeout,
                close_timeout=config.close_timeout,
                max_size=config.max_frame_bytes,
            ) as ws:
                await ws.send(self._registration(since))
                ack = await self._receive_ack(ws)
                await self._serve(ws, ack, since)
        except SessionError:
            raise
        except InvalidStatus as exc:
            status = exc.response.status_code
            raise PublisherClosed(f"handshake refused: HTTP {status}", status=status) from None
        except InvalidURI as exc:
            raise RegistrationRefused("bad_url", str(exc)) from None
        except ConnectionClosed as exc:
            raise self._closed(exc, None) from None
        except (OSError, TimeoutError, InvalidHandshake) as exc:
            raise PublisherClosed(f"cannot connect: {exc!r}") from None

    def _closed(self, exc: ConnectionClosed, error: ErrorFrame | None) -> PublisherClosed:
        code = exc.rcvd.code if exc.rcvd is not None else None
        reason = exc.rcvd.reason if exc.rcvd is not None else str(exc)
        if error is not None:
            return PublisherClosed(
                f"publisher error {error.code}: {error.message}", code, error.code
            )
        return PublisherClosed(f"connection closed: {reason or exc}", code)

    async def _receive_ack(self, ws: ClientConnection) -> Ack:
        try:
            async with asyncio.timeout(self.config.ack_timeout):  # not wait_for: see workqueue
                raw = await ws.recv()
        except TimeoutError:
            raise PublisherClosed(f"no ack within {self.config.ack_timeout:g}s") from None
        except ConnectionClosed as exc:
            raise self._closed(exc, None) from None
        decoded = error_frame(raw)
        if decoded is not None:
            raise PublisherClosed(
                f"registration refused ({decoded.code}): {decoded.message}", None, decoded.code
            )
        try:
            ack = Ack.decode(raw)
        except ProtocolError as exc:
            raise BadPublisherFrame(f"bad ack ({exc.code}): {exc.message}") from None
        self.registrations += 1
        self._route = urljoin(self.api_url, ack.bootstrap_route)
        self._lifecycle.to(S.REGISTERED)
        if ack.resumed:
            self.resumes += 1
        log_event(
            log,
            "listener.registered",
            **self._fields(),
            resumed=ack.resumed,
            route=self._route,
            cursor=ack.cursor,
        )
        return ack

    async def _serve(self, ws: ClientConnection, ack: Ack, since: str | None) -> None:
        receiver = asyncio.create_task(self._receive(ws), name=f"changefeed-recv-{self.name}")
        try:
            if ack.resumed and since is not None:
                self._go_live()
            else:
                self._lifecycle.to(S.BOOTSTRAPPING)
                resync = await self._bootstrap(ack, receiver)
                self._resync = resync
                self._go_live()
            await receiver
        finally:
            receiver.cancel()
            await asyncio.gather(receiver, return_exceptions=True)

    def _go_live(self) -> None:
        self._lifecycle.to(S.LIVE)
        now = self._clock()
        self._live_since = now
        self._backoff.healthy(now)
        self._ready.set()

    async def _bootstrap(self, ack: Ack, receiver: asyncio.Task[None]) -> Resynced:
        """Walk the bootstrap route while ``receiver`` buffers; a receiver failure
        (overflow, drop) aborts the walk."""
        assert self._route is not None and self._http is not None
        route = self._route
        pager = Pager(
            self._http,
            route,
            limit=self.config.page_limit,
            max_attempts=self.config.page_attempts,
            on_progress=self._on_page,
        )
        log_event(log, "listener.bootstrapping", **self._fields(), route=route)

        async def walk() -> list[Any]:
            items: list[Any] = []
            async for page in pager.pages():
                items.extend(page)
            return items

        walker = asyncio.create_task(walk(), name=f"changefeed-bootstrap-{self.name}")
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
        self.bootstraps += 1
        progress = pager.progress
        initial = not self._bootstrapped_once
        self._bootstrapped_once = True
        log_event(
            log,
            "listener.bootstrapped",
            **self._fields(),
            items=len(items),
            pages=progress.pages,
            elapsed=round(progress.elapsed, 4),
            rate=round(progress.rate, 1),
            retries=pager.retries,
        )
        return Resynced(items, route, ack.cursor, progress.pages, progress.elapsed, initial)

    def _on_page(self, progress: PagerProgress) -> None:
        log_event(
            log,
            "listener.bootstrap.page",
            logging.DEBUG,
            **self._fields(),
            items=progress.items,
            pages=progress.pages,
            rate=round(progress.rate, 1),
        )

    async def _receive(self, ws: ClientConnection) -> None:
        """Read frames into the buffer until the connection ends; always raises SessionError."""
        buffer = self._buffer
        while True:
            try:
                raw = await ws.recv()
            except ConnectionClosed as exc:
                raise self._closed(exc, None) from None
            self.frames_received += 1
            decoded = decode_frame(raw)
            if isinstance(decoded, ErrorFrame):
                raise PublisherClosed(
                    f"publisher error {decoded.code}: {decoded.message}", None, decoded.code
                )
            self.items_received += len(decoded)
            if not await buffer.put(decoded):
                self.overflows += 1
                held = len(buffer)
                log_event(
                    log,
                    "listener.overflow",
                    logging.WARNING,
                    **self._fields(),
                    incoming=len(decoded),
                    overflows=self.overflows,
                )
                raise BufferOverflow(buffer.capacity, held, len(decoded))
            self._check_water()
            self._ready.set()

    def _check_water(self) -> None:
        held = len(self._buffer) + len(self._staged)
        self._peak = max(self._peak, held)
        capacity = self._buffer.capacity
        if not self._high and held >= capacity * self.config.high_water:
            self._high = True
            log_event(log, "listener.buffer.high", logging.WARNING, **self._fields())
        elif self._high and held < capacity * _LOW_WATER:
            self._high = False
            log_event(log, "listener.buffer.normal", **self._fields())
