"""One connection of a listener: connect, register, bootstrap while buffering, read frames.

The websockets / httpx adapter of the listener. The connection loop
(``_connection``) makes one ``Session`` per attempt and runs it; a session
only ends by raising ``SessionError``, and classifying that, clearing and
backing off stay with the loop. A session owns nothing that outlives its
connection: what it learns goes to its ``SessionHost`` (the connection loop),
and each frame it reads goes, undecoded, to the inbox (``_inbox``: decoding,
the buffer, the hand-out).

A registration of several change kinds (v2) is answered with one bootstrap
route per kind; when the publisher does not resume, every route is walked at
once while the socket keeps being read into the buffer, and the walks end in
one ``Resynced`` per kind, all consistent with the ack's cursor.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
from collections.abc import Sequence
from typing import Any, Protocol
from urllib.parse import urljoin

import httpx
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed, InvalidHandshake, InvalidStatus, InvalidURI

from changefeed.bootstrap import BootstrapError, Pager, PagerProgress, bearer_headers
from changefeed.logs import log_event
from changefeed.schemas import Ack, ChangeKind, ProtocolError

from ._config import ListenerConfig
from ._errors import (
    BadPublisherFrame,
    BootstrapFailed,
    PublisherClosed,
    RegistrationRefused,
    SessionError,
)
from ._events import Resynced
from ._inbox import error_frame, publisher_error
from ._log import log

__all__ = ["Session", "SessionHost", "bootstrap_routes"]


class Frames(Protocol):
    """Where a session's frames go: the listener's inbox (``_inbox.Inbox``)."""

    async def receive(self, frame: str | bytes) -> None:
        """A frame arrived, undecoded (error and bad frames too).

        Raises:
            SessionError: it ends the session (an error frame, a bad frame, an
                overflow of the buffer).
        """


class SessionHost(Protocol):
    """What a session reports to its listener, in the order it happens."""

    def log_fields(self) -> dict[str, Any]:
        """The listener's fields for this session's log events."""

    def registered_ack(self, ack: Ack, routes: dict[str, str], resuming: bool) -> None:
        """The publisher acked the registration; ``routes``: resource -> absolute
        bootstrap URL; ``resuming``: the registration carried ``since``."""

    def bootstrapping(self) -> None:
        """The ack did not resume: the bootstrap walks start (items are buffered meanwhile)."""

    def bootstrap_progress(
        self, resource: str, route: str, progress: PagerProgress, done: bool
    ) -> None:
        """A page of ``resource``'s walk arrived (``done``: the walk ended)."""

    def bootstrapped(self, resyncs: list[Resynced]) -> None:
        """Every walk ended; ``resyncs`` go to the application before any buffered item."""

    def live(self) -> None:
        """Resumed or bootstrapped: items now flow to the application."""


def bootstrap_routes(
    ack: Ack, kinds: Sequence[ChangeKind], multi: bool, api_url: str
) -> dict[str, str]:
    """Each registered resource's absolute bootstrap URL, from the ack.

    A v1 ack names one route (for the one change kind); a v2 ack names one
    per resource, matched by name.

    Raises:
        BadPublisherFrame: the ack names no route for a registered resource, or one
            that is not a URL.
    """
    if not multi:
        return {kinds[0].resource: _absolute(api_url, ack.bootstrap_route)}
    named = {route.resource: route.bootstrap_route for route in ack.routes}
    missing = [kind.resource for kind in kinds if kind.resource not in named]
    if missing:
        raise BadPublisherFrame(f"the ack names no bootstrap route for {', '.join(missing)}")
    return {kind.resource: _absolute(api_url, named[kind.resource]) for kind in kinds}


def _absolute(api_url: str, route: str) -> str:
    """``route`` resolved against the API's URL, checked as httpx will read it: a
    publisher's bad route is that publisher's bad frame, not a crash of the listener."""
    try:
        url = urljoin(api_url, route)
        httpx.URL(url)
    except (ValueError, httpx.InvalidURL) as exc:
        raise BadPublisherFrame(
            f"the ack's bootstrap route {route[:200]!r} is not a URL: {exc}"
        ) from None
    return url


def _retry_after(value: str) -> float | None:
    """A ``Retry-After`` header in seconds (an HTTP date is not worth honouring here)."""
    value = value.strip()
    return float(value) if value.isascii() and value.isdigit() else None


def _closed(exc: ConnectionClosed) -> PublisherClosed:
    code = exc.rcvd.code if exc.rcvd is not None else None
    reason = exc.rcvd.reason if exc.rcvd is not None else str(exc)
    return PublisherClosed(f"connection closed: {reason or exc}", code)


class Session:
    """One connection to the publisher, from the handshake to its end.

    Args:
        host: the connection loop it reports to.
        frames: where its frames go (the inbox).
        url: the publisher's websocket endpoint.
        api_url: what the ack's bootstrap routes are resolved against.
        registration: the encoded registration frame (with ``since`` when resuming).
        kinds: the registered change kinds.
        multi: the registration is v2 (``resources``); items are then checked
            to be of a registered resource.
        resuming: the registration carries ``since``.
        config: the listener's settings.
        http: the client of the bootstrap walks.
        token: bearer token for the handshake.
        name: the listener's name (task names).
        first_bootstrap: no bootstrap of this listener has completed yet.
        rng: source of the jitter of the bootstrap walk's retries.
    """

    def __init__(
        self,
        host: SessionHost,
        frames: Frames,
        *,
        url: str,
        api_url: str,
        registration: str,
        kinds: Sequence[ChangeKind],
        multi: bool,
        resuming: bool,
        config: ListenerConfig,
        http: httpx.AsyncClient,
        token: str | None,
        name: str,
        first_bootstrap: bool,
        rng: random.Random,
    ) -> None:
        self._host = host
        self._frames = frames
        self._url = url
        self._api_url = api_url
        self._registration = registration
        self._kinds = tuple(kinds)
        self._multi = multi
        self._resuming = resuming
        self._config = config
        self._http = http
        self._token = token
        self._name = name
        self._first_bootstrap = first_bootstrap
        self._rng = rng

    async def run(self) -> None:
        """Connect and serve until the connection ends; always raises ``SessionError``."""
        config = self._config
        try:
            async with connect(
                self._url,
                additional_headers=bearer_headers(self._token),
                open_timeout=config.open_timeout,
                ping_interval=config.ping_interval,
                ping_timeout=config.ping_timeout,
                close_timeout=config.close_timeout,
                max_size=config.max_frame_bytes,
            ) as ws:
                # A publisher may refuse right after the handshake, before it reads
                # the registration (its authorizer unavailable, no room): the error
                # frame it sent first, read next, says why and when to come back.
                with contextlib.suppress(ConnectionClosed):
                    await ws.send(self._registration)
                ack, routes = await self._receive_ack(ws)
                await self._serve(ws, ack, routes)
        except SessionError:
            raise
        except InvalidStatus as exc:
            status = exc.response.status_code
            raise PublisherClosed(
                f"handshake refused: HTTP {status}",
                status=status,
                retry_after=_retry_after(exc.response.headers.get("Retry-After", "")),
            ) from None
        except InvalidURI as exc:
            raise RegistrationRefused("bad_url", str(exc)) from None
        except ConnectionClosed as exc:
            raise _closed(exc) from None
        except (OSError, TimeoutError, InvalidHandshake) as exc:
            raise PublisherClosed(f"cannot connect: {exc!r}") from None

    async def _receive_ack(self, ws: ClientConnection) -> tuple[Ack, dict[str, str]]:
        try:
            async with asyncio.timeout(self._config.ack_timeout):  # not wait_for: see _workqueue
                raw = await ws.recv()
        except TimeoutError:
            raise PublisherClosed(f"no ack within {self._config.ack_timeout:g}s") from None
        except ConnectionClosed as exc:
            raise _closed(exc) from None
        decoded = error_frame(raw)
        if decoded is not None:
            raise publisher_error(decoded, "registration refused")
        try:
            ack = Ack.decode(raw)
        except ProtocolError as exc:
            raise BadPublisherFrame(f"bad ack ({exc.code}): {exc.message}") from None
        routes = bootstrap_routes(ack, self._kinds, self._multi, self._api_url)
        self._host.registered_ack(ack, routes, self._resuming)
        log_event(
            log,
            "listener.registered",
            **self._host.log_fields(),
            resumed=ack.resumed,
            routes=list(routes.values()),
            cursor=ack.cursor,
            reason=ack.reason,
        )
        return ack, routes

    async def _serve(self, ws: ClientConnection, ack: Ack, routes: dict[str, str]) -> None:
        receiver = asyncio.create_task(self._receive(ws), name=f"changefeed-recv-{self._name}")
        try:
            if not (ack.resumed and self._resuming):
                self._host.bootstrapping()
                self._host.bootstrapped(await self._bootstrap(ack, routes, receiver))
            self._host.live()
            await receiver
        finally:
            receiver.cancel()
            await asyncio.gather(receiver, return_exceptions=True)

    async def _bootstrap(
        self, ack: Ack, routes: dict[str, str], receiver: asyncio.Task[None]
    ) -> list[Resynced]:
        """Walk every route at once while ``receiver`` buffers; a receiver failure
        (overflow, drop) or one failed walk aborts them all."""
        walks = {
            resource: asyncio.create_task(
                self._walk(resource, route), name=f"changefeed-bootstrap-{self._name}-{resource}"
            )
            for resource, route in routes.items()
        }
        try:
            waiting: set[asyncio.Task[Any]] = {receiver, *walks.values()}
            while True:
                done, waiting = await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
                if receiver in done or any(task.exception() is not None for task in done):
                    break
                if all(walk.done() for walk in walks.values()):
                    break
        finally:
            unfinished = [walk for walk in walks.values() if not walk.done()]
            for walk in unfinished:
                walk.cancel()
            await asyncio.gather(*unfinished, return_exceptions=True)
        if receiver.done():
            receiver.result()  # raises the receiver's SessionError
            raise PublisherClosed("connection ended during bootstrap")
        for resource, walk in walks.items():
            # The failed walk, not one cancelled because of it.
            failure = None if walk.cancelled() else walk.exception()
            if isinstance(failure, BootstrapError):
                raise BootstrapFailed(
                    f"bootstrap walk of {resource} failed: {failure}",
                    failure.status,
                    retry_after=getattr(failure, "retry_after", None),
                ) from None
            if failure is not None:  # e.g. httpx.InvalidURL: still this session's failure
                # Not one the pager expects (possibly a bug): its traceback goes to the log.
                log_event(
                    log,
                    "listener.bootstrap.crashed",
                    logging.ERROR,
                    exc=failure,
                    **self._host.log_fields(),
                    resource=resource,
                )
                raise BootstrapFailed(f"bootstrap walk of {resource} failed: {failure!r}") from None
        resyncs = []
        for resource, walk in walks.items():
            items, pages, elapsed = walk.result()
            resyncs.append(
                Resynced(
                    items,
                    routes[resource],
                    ack.cursor,
                    pages,
                    elapsed,
                    self._first_bootstrap,
                    resource,
                )
            )
        return resyncs

    async def _walk(self, resource: str, route: str) -> tuple[list[Any], int, float]:
        """One route's walk: its items, pages and seconds."""
        host = self._host

        def on_page(progress: PagerProgress) -> None:
            host.bootstrap_progress(resource, route, progress, False)
            log_event(
                log,
                "listener.bootstrap.page",
                logging.DEBUG,
                **host.log_fields(),
                resource=resource,
                items=progress.items,
                pages=progress.pages,
                rate=round(progress.rate, 1),
            )

        pager = Pager(
            self._http,
            route,
            limit=self._config.page_limit,
            max_attempts=self._config.page_attempts,
            on_progress=on_page,
            rng=self._rng,
        )
        log_event(
            log, "listener.bootstrapping", **host.log_fields(), resource=resource, route=route
        )
        items: list[Any] = []
        async for page in pager.pages():
            items.extend(page)
        progress = pager.progress
        host.bootstrap_progress(resource, route, progress, True)
        log_event(
            log,
            "listener.bootstrapped",
            **host.log_fields(),
            resource=resource,
            items=len(items),
            pages=progress.pages,
            elapsed=round(progress.elapsed, 4),
            rate=round(progress.rate, 1),
            retries=pager.retries,
        )
        return items, progress.pages, progress.elapsed

    async def _receive(self, ws: ClientConnection) -> None:
        """Read frames into the host until the connection ends; always raises SessionError."""
        receive = self._frames.receive
        while True:
            try:
                # Undecoded: the frame decoder checks the UTF-8 of what it keeps.
                raw = await ws.recv(decode=False)
            except ConnectionClosed as exc:
                raise _closed(exc) from None
            await receive(raw)
