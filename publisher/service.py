"""The Publisher: what an API embeds to publish its changes.

It owns the tailer, the registry of listeners and their outboxes, inline
retention, and the HTTP/websocket routes an existing Starlette app mounts.
Appending entries needs none of it: writers call ``publish`` on their own
connection (or ``SELECT changefeed.publish(...)`` from any language), and this
object fans out whatever any writer committed, so publishing never waits on
listeners (I2).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Sequence
from datetime import timedelta
from typing import Any

import asyncpg
import orjson
from starlette.requests import HTTPConnection
from starlette.routing import BaseRoute
from starlette.websockets import WebSocket

from changefeed.logs import log_event
from changefeed.schemas import (
    ChangeKind,
    CursorCodec,
    Position,
    ResourceRoute,
    apply_schema,
    notify_channel,
)

from .config import PublisherConfig, ResourceConfig
from .errors import ConfigError
from .feed import FeedEntry, FeedReader
from .matching import matches
from .metrics import PublisherMetrics
from .registry import Closing, ListenerSession, Registry
from .retention import trim_expired
from .tailer import DB_ERRORS, Tailer

__all__ = ["Authorizer", "Publisher"]

log = logging.getLogger(__name__)

Authorizer = Callable[[str], Awaitable[frozenset[str] | None]]
"""Maps a bearer token to the resources it may read (``frozenset({"*"})`` for all),
or None to refuse it."""

_REPLAY_PAGE = 1000
_READY_TIMEOUT = 5.0


class Publisher:
    """Change-feed publisher for one feed table.

    Args:
        config: what to publish and how (see PublisherConfig).
        pool: an asyncpg pool of the embedding API, used for resume and
            retention queries; when None the publisher makes a small one.
        authorize: optional async callable for bearer tokens; by default the
            static ``config.auth_tokens`` (any of them may read everything).
    """

    def __init__(
        self,
        config: PublisherConfig,
        *,
        pool: asyncpg.Pool | None = None,
        authorize: Authorizer | None = None,
    ) -> None:
        if not config.dsn:
            raise ConfigError("publisher.dsn", "is required (the tailer needs its own connection)")
        self.config = config
        self.codec = CursorCodec(config.cursor_key.encode())
        self.registry = Registry()
        self.metrics = PublisherMetrics()
        self.reader = FeedReader(config.schema)
        self.tailer = Tailer(
            self._connect,
            self.reader,
            notify_channel(config.schema),
            self._dispatch,
            poll_interval=config.poll_interval,
            batch=config.tail_batch,
            retry_budget=config.db_retry_budget,
        )
        self._pool = pool
        self._own_pool = pool is None
        self._authorize = authorize
        self._tasks: list[asyncio.Task[None]] = []
        self.connections = 0
        self.draining = False
        self.sent_total = 0
        self._no_listeners = asyncio.Event()
        self._no_listeners.set()
        self.metrics.bind(
            queue_depth=lambda: max((len(s.outbox) for s in self.registry.sessions), default=0),
            lag=lambda: self.tailer.lag_seconds,
            up=lambda: 1.0 if self.tailer.status == "running" else 0.0,
        )
        self.metrics.oldest_xact.set_function(lambda: self.tailer.oldest_writer_seconds)

    # -- lifecycle ---------------------------------------------------------

    async def _connect(self) -> asyncpg.Connection:
        return await asyncpg.connect(
            self.config.dsn, timeout=5.0, server_settings={"application_name": "changefeed-tailer"}
        )

    async def start(self) -> None:
        """Connect, create the schema if configured, and start tailing."""
        if self._pool is None:
            self._pool = await asyncpg.create_pool(
                self.config.dsn, min_size=1, max_size=4, timeout=5.0
            )
        if self.config.create_schema:
            async with self._pool.acquire() as conn:
                await apply_schema(conn, self.config.schema)
        self._spawn(self.tailer.run(), "changefeed-tailer")
        if self.config.retention:
            self._spawn(self._retention_loop(), "changefeed-retention")
        log_event(
            log,
            "publisher.started",
            schema=self.config.schema,
            resources=[r.name for r in self.config.resources],
        )

    def _spawn(self, work: Coroutine[Any, Any, None], name: str) -> None:
        task = asyncio.create_task(work, name=name)
        task.add_done_callback(self._task_ended)
        self._tasks.append(task)

    def _task_ended(self, task: asyncio.Task[None]) -> None:
        # Background work must never die silently: say so loudly and show it in /readyz.
        if not task.cancelled() and (exc := task.exception()) is not None:
            self.tailer.status = "failed"
            log_event(
                log,
                "publisher.task_failed",
                logging.CRITICAL,
                task=task.get_name(),
                error=repr(exc),
            )

    async def drain(self, grace: float = 5.0) -> None:
        """Refuse new registrations and close every listener with 1001 ("going away"),
        so that they re-register with another instance; wait up to ``grace`` seconds."""
        if not self.draining:
            log_event(log, "publisher.draining", listeners=len(self.registry))
        self.draining = True
        for session in list(self.registry.sessions):
            session.close(Closing(1001, None, "publisher shutting down"))
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._no_listeners.wait(), grace)

    async def stop(self, grace: float = 5.0) -> None:
        """Drain, then stop tailing and retention; nothing is half-written (the
        publisher never writes the feed, it only reads and trims it in
        transactions)."""
        await self.drain(grace)
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks.clear()
        if self._own_pool and self._pool is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._pool.close(), grace)
            self._pool = None
        log_event(log, "publisher.stopped")

    @contextlib.asynccontextmanager
    async def lifespan(self, app: Any = None) -> AsyncIterator[None]:
        """Starlette lifespan: ``Starlette(lifespan=publisher.lifespan)``."""
        await self.start()
        try:
            yield
        finally:
            await self.stop()

    @property
    def routes(self) -> list[BaseRoute]:
        """Routes to mount in the embedding app: /changefeeds (GET and websocket),
        /changefeeds/stats, /metrics, /healthz, /readyz."""
        from .routes import publisher_routes

        return publisher_routes(self)

    # -- fan-out -------------------------------------------------------------

    def encode(self, entry: FeedEntry) -> str:
        """The change item frame for ``entry``: encoded once, sent to every match."""
        published = entry.published.isoformat(timespec="milliseconds").replace("+00:00", "Z")
        return orjson.dumps(
            {
                "changeKind": {
                    "resource": entry.resource,
                    "subResources": list(entry.sub_resources),
                },
                "changedResourceId": entry.changed_resource_id,
                "cursor": self.codec.encode(entry.position),
                "published": published,
            }
        ).decode()

    def _dispatch(self, entries: Sequence[FeedEntry]) -> None:
        self.metrics.entries_total.inc(len(entries))
        _, evicted = self.registry.dispatch(entries, self.encode)
        for session in evicted:
            self.metrics.evictions_total.inc()
            self._count_gone(session)
            log_event(
                log,
                "listener.evicted",
                logging.WARNING,
                instance=session.instance,
                service=session.service,
                peer=session.peer,
                queue=session.outbox.capacity,
                listeners=len(self.registry),
            )

    def count_sent(self, frames: int) -> None:
        self.sent_total += frames
        self.metrics.deliveries_total.inc(frames)

    def admit(self, session: ListenerSession, kinds: Sequence[tuple[ChangeKind, Position]]) -> None:
        """Add a registered session to the registry (synchronously: see websocket._register)."""
        self.registry.add(session, kinds)
        self._no_listeners.clear()
        self.metrics.listeners.set(len(self.registry))
        for kind, _ in kinds:
            self.metrics.registrations.labels(kind.resource).inc()
            self.metrics.registrations_total.labels(
                kind.resource, str(session.resumed).lower()
            ).inc()
        log_event(
            log,
            "registration",
            instance=session.instance,
            service=session.service,
            peer=session.peer,
            kinds=[k.to_json() for k, _ in kinds],
            resumed=session.resumed,
            batch=session.batch,
            listeners=len(self.registry),
        )

    def forget(self, session: ListenerSession) -> None:
        """Drop a session whose connection ended."""
        if self.registry.remove(session):
            self._count_gone(session)
            log_event(
                log,
                "listener.disconnected",
                instance=session.instance,
                service=session.service,
                peer=session.peer,
                reason=session.closing.message if session.closing else "closed by listener",
                listeners=len(self.registry),
            )

    def _count_gone(self, session: ListenerSession) -> None:
        if not len(self.registry):
            self._no_listeners.set()
        self.metrics.disconnects_total.inc()
        self.metrics.listeners.set(len(self.registry))
        for sub in session.subscriptions:
            self.metrics.registrations.labels(sub.change_kind.resource).dec()

    # -- registration support ------------------------------------------------

    def route_of(self, resource: ResourceConfig) -> ResourceRoute:
        return ResourceRoute(resource.name, resource.sub_resources, resource.bootstrap_route)

    async def wait_ready(self) -> bool:
        """True once the tailer knows its position (it may be briefly reconnecting)."""
        try:
            await asyncio.wait_for(self.tailer.ready.wait(), _READY_TIMEOUT)
        except TimeoutError:
            return False
        return self.tailer.status != "unavailable"

    async def can_resume(self, since: Position, resources: Sequence[str]) -> bool:
        """True when the feed still holds everything after ``since`` (and the replay is
        not larger than ``replay_limit``)."""
        assert self._pool is not None
        try:
            async with self._pool.acquire(timeout=_READY_TIMEOUT) as conn:
                low_water = await self.reader.low_water(conn)
                if since < low_water:
                    return False
                pending = await self.reader.count_after(
                    conn, since, resources, self.config.replay_limit + 1
                )
        except DB_ERRORS as exc:
            log_event(log, "resume.unchecked", logging.WARNING, error=repr(exc))
            return False
        return pending <= self.config.replay_limit

    async def replay(
        self, ws: WebSocket, session: ListenerSession, since: Position, upto: Position
    ) -> None:
        """Send the entries in ``(since, upto]`` that match ``session`` (resume)."""
        assert self._pool is not None
        kinds = [(s.change_kind.resource, s.sub_resources) for s in session.subscriptions]
        resources = sorted({r for r, _ in kinds})
        after = since
        replayed = 0
        while True:
            async with self._pool.acquire(timeout=_READY_TIMEOUT) as conn:
                entries = await self.reader.read_between(conn, after, upto, resources, _REPLAY_PAGE)
            frames = [
                self.encode(e)
                for e in entries
                if any(r == e.resource and matches(e.sub_resources, subs) for r, subs in kinds)
            ]
            if frames:
                if session.batch:
                    for i in range(0, len(frames), self.config.max_batch):
                        await ws.send_text(
                            "[" + ",".join(frames[i : i + self.config.max_batch]) + "]"
                        )
                else:
                    for frame in frames:
                        await ws.send_text(frame)
                replayed += len(frames)
            if len(entries) < _REPLAY_PAGE:
                break
            after = entries[-1].position
        self.metrics.replayed_total.inc(replayed)
        self.count_sent(replayed)
        log_event(
            log,
            "resume.replayed",
            instance=session.instance,
            items=replayed,
            since=str(since),
            upto=str(upto),
        )

    # -- authentication ------------------------------------------------------

    async def _allowed(self, conn: HTTPConnection) -> frozenset[str] | None:
        """Resources the connection's bearer token may read; None if refused.
        Without configured auth everything is allowed."""
        if not self.config.auth_tokens and self._authorize is None:
            return frozenset({"*"})
        header = conn.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not token:
            return None
        if self._authorize is not None:
            return await self._authorize(token)
        for known in self.config.auth_tokens:
            if hmac.compare_digest(known.encode(), token.encode()):
                return frozenset({"*"})
        return None

    async def authorize_handshake(self, ws: WebSocket) -> bool:
        allowed = await self._allowed(ws)
        ws.state.changefeed_allowed = allowed
        return allowed is not None

    def may_read(self, ws: WebSocket, resource: str) -> bool:
        allowed: frozenset[str] | None = getattr(ws.state, "changefeed_allowed", None)
        return allowed is not None and ("*" in allowed or resource in allowed)

    async def authorize_request(self, conn: HTTPConnection) -> bool:
        """For the embedding API's own bootstrap routes: is this request authenticated?"""
        return await self._allowed(conn) is not None

    # -- retention ---------------------------------------------------------

    async def _retention_loop(self) -> None:
        max_age = timedelta(seconds=self.config.max_age)
        while True:
            await asyncio.sleep(self.config.retention_interval)
            assert self._pool is not None
            try:
                async with self._pool.acquire(timeout=_READY_TIMEOUT) as conn:
                    deleted = await trim_expired(conn, self.config.schema, max_age)
                if deleted:
                    log_event(
                        log, "retention.trimmed", entries=deleted, max_age=self.config.max_age
                    )
            except DB_ERRORS as exc:
                log_event(log, "retention.failed", logging.WARNING, error=repr(exc))

    # -- observability -----------------------------------------------------

    def stats(self) -> dict[str, Any]:
        """The /changefeeds/stats document."""
        return {
            "listeners": len(self.registry),
            "registrations": self.registry.registrations(),
            "connections": self.connections,
            "draining": self.draining,
            "tailer": self.tailer.stats(),
            "counters": {
                "registrations": self.registry.registrations_total,
                "disconnects": self.registry.disconnects_total,
                "evictions": self.registry.evictions_total,
                "sent": self.sent_total,
            },
        }
