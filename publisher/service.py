"""The Publisher: what an API embeds to publish its changes. Lifecycle and wiring.

It puts the parts together and owns their lifecycle: the tailer reads the
feed (``tailer``), each batch goes into the window of recent entries
(``window``) and to the live listeners (``fanout``), whose queues the flush
rounds write out (``scheduler``); a listener that falls behind catches up
from the window or the feed table (``catchup``, ``pages``); registrations are
decided (``registration``) and admitted here in one synchronous step. With
``read_dsn`` the feed is read from a hot standby (``standby``, ``doorbell``).
Appending
entries needs none of it: writers call ``publish`` on their own connection
(or ``SELECT changefeed.publish(...)`` from any language), and this object
fans out whatever any writer committed, so publishing never waits on
listeners (I2).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import random
import time
from collections.abc import AsyncIterator, Coroutine, Mapping
from datetime import timedelta
from typing import Any

import asyncpg
from starlette.requests import HTTPConnection
from starlette.routing import BaseRoute

from changefeed import lost_writes
from changefeed.bootstrap.errors import TokenKeyUnavailable
from changefeed.logs import log_event
from changefeed.schemas import (
    BOOTSTRAP_ROUTE_STATE,
    AccessDenied,
    AccessGranted,
    Position,
    apply_schema,
    notify_channel,
    outdated,
    schema_version,
)

from .auth import Authorizer, BearerAuth, resources_served_at, routed_paths
from .broadcast import Broadcast
from .config import PublisherConfig
from .counters import Counters
from .doorbell import Doorbell
from .errors import ConfigError
from .feed import FeedHealth, FeedReader
from .identity import FeedIdentity, join_feed
from .metrics import PublisherMetrics
from .observe import metrics_snapshot, rate_counters, stats_document
from .periodic import every
from .rates import RateHistory
from .registry import Registry
from .retention import trim_expired
from .sessions import Sessions
from .standby import Standby
from .tailer import Tailer

__all__ = ["Publisher"]

log = logging.getLogger(__name__)

_WATCH_INTERVAL = 1.0
"""Seconds between two looks at the feed's health."""
_STALL_CHECK = 1.0
"""Seconds between two looks at the listeners' progress."""
_READY_TIMEOUT = 5.0


class Publisher:
    """Change-feed publisher for one feed table.

    Args:
        config: what to publish and how (see PublisherConfig).
        pool: an asyncpg pool of the embedding API on ``dsn``, used for registrations,
            catch-up and retention queries; when None the publisher makes a small one.
            With ``read_dsn``, registrations and catch-up read a pool of the
            publisher's own on the standby instead.
        authorize: optional async callable for bearer tokens (see ``Authorizer``),
            asked about any token the static ``auth_tokens`` / ``token_resources``
            do not know. With neither, there is no authentication (docs/security.md).
        rng: random source of the jitter of every wait before trying again (the
            tailer's, the doorbell's, a connection's catch-up reads); seed it in
            tests. None: a fresh ``random.Random()``, never the global one.
    """

    def __init__(
        self,
        config: PublisherConfig,
        *,
        pool: asyncpg.Pool | None = None,
        authorize: Authorizer | None = None,
        rng: random.Random | None = None,
    ) -> None:
        if not config.dsn:
            raise ConfigError("publisher.dsn", "is required (the tailer needs its own connection)")
        self.config = config
        rng = rng or random.Random()
        self.identity = FeedIdentity(config.cursor_key.encode() if config.cursor_key else None)
        self.counters = Counters()
        self.reader = FeedReader(config.schema)
        self.standby = (
            Standby(lambda: self.pool, wait=config.standby_wait) if config.read_dsn else None
        )
        """The primary beside the standby the feed is read from (``read_dsn``)."""
        self.broadcast = Broadcast(
            config,
            identity=self.identity,
            counters=self.counters,
            reader=self.reader,
            pool=lambda: self.read_pool,
        )
        channel = notify_channel(config.schema)
        self.tailer = Tailer(
            self._connect,
            self.reader,
            channel,
            self.broadcast.dispatch,
            poll_interval=config.poll_interval,
            batch=config.tail_batch,
            retry_budget=config.db_retry_budget,
            fanned_out=self.broadcast.fanned_out,
            join=self._join_feed,
            standby=self.standby is not None,
            rng=rng,
        )
        self.doorbell = (
            Doorbell(self._connect_primary, channel, self.tailer.ring, rng=rng)
            if self.standby
            else None
        )
        """The LISTEN on the primary that rings a tailer reading a standby."""
        if self.doorbell is not None:
            self.tailer.on_rest = self.doorbell.rest
        self.sessions = Sessions(
            config,
            identity=self.identity,
            auth=BearerAuth(config.auth_tokens, config.token_resources, authorize),
            counters=self.counters,
            window=self.broadcast.window,
            fanout=self.broadcast.fanout,
            catchup=self.broadcast.catchup,
            tailer=self.tailer,
            reader=self.reader,
            pool=lambda: self.read_pool,
            standby=self.standby,
            rng=rng,
        )
        self.feed_health = FeedHealth(0.0, 0.0, 0, Position(0, 0))
        """The feed as last seen by the watch (oldest writer, oldest entry, size)."""
        self.rates = RateHistory()
        """Entries, deliveries and evictions per second over the last minutes."""
        self.failed: dict[str, str] = {}
        """Background work that gave up: name -> its last error (see _task_ended)."""
        self._pool = pool
        self._own_pool = pool is None
        self._read_pool: asyncpg.Pool | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._holds_lost_writes = False
        """Whether this publisher holds the budget on the loop's lost-write lines
        (``changefeed.lost_writes``), from ``start`` to ``stop``."""
        histograms = (self.broadcast.entry_age, self.broadcast.flush_seconds)
        self.metrics = PublisherMetrics(lambda: metrics_snapshot(self), histograms)

    # -- lifecycle ---------------------------------------------------------

    async def _connect(self) -> asyncpg.Connection:
        # The tailer's connection, to the server it reads (read_dsn, or dsn).
        # command_timeout: a read blocked on a lock or a half-open connection
        # becomes an error the tailer retries, instead of a silent stall.
        # plan_cache_mode: once the feed table has been analysed, PostgreSQL
        # plans the tailer's prepared read afresh on every execution (the
        # custom plan looks cheaper than the generic one), and planning costs
        # more than the read. The generic plan, an index range scan in feed
        # order under the LIMIT, is the right one for every cursor.
        return await asyncpg.connect(
            self.config.read_dsn or self.config.dsn,
            timeout=5.0,
            command_timeout=30.0,
            server_settings={
                "application_name": "changefeed-tailer",
                "plan_cache_mode": "force_generic_plan",
            },
        )

    async def _connect_primary(self) -> asyncpg.Connection:
        # The doorbell's LISTEN, on the primary (a standby refuses LISTEN).
        return await asyncpg.connect(
            self.config.dsn,
            timeout=5.0,
            command_timeout=30.0,
            server_settings={"application_name": "changefeed-doorbell"},
        )

    @property
    def pool(self) -> asyncpg.Pool:
        """The pool on ``dsn``, the primary."""
        assert self._pool is not None, "the publisher is not started"
        return self._pool

    @property
    def read_pool(self) -> asyncpg.Pool:
        """The pool on the server the feed is read from (``read_dsn``, or ``dsn``)."""
        return self._read_pool if self._read_pool is not None else self.pool

    async def start(self) -> None:
        """Connect, create the schema if configured, and start tailing."""
        if self._pool is None:
            # command_timeout: a query blocked on a lock fails (and is retried, or
            # answered 4010) instead of holding a registration or a catch-up for good.
            self._pool = await asyncpg.create_pool(
                self.config.dsn, min_size=1, max_size=4, timeout=5.0, command_timeout=30.0
            )
        if self.config.read_dsn and self._read_pool is None:
            # min_size 0: a standby that is down when the publisher starts delays
            # its reads (the tailer retries), not the embedding API's start-up.
            self._read_pool = await asyncpg.create_pool(
                self.config.read_dsn,
                min_size=0,
                max_size=4,
                timeout=5.0,
                command_timeout=30.0,
                server_settings={"application_name": "changefeed-reads"},
            )
        why: str | None = None
        async with self._pool.acquire() as conn:
            if self.config.create_schema:
                await apply_schema(conn, self.config.schema)
            else:
                # Otherwise the tailer would retry a query on a missing column forever,
                # taken for a database away, and never say why.
                version = await schema_version(conn, self.config.schema)
                why = outdated(self.config.schema, version)
        if not self.config.create_schema and why is not None:
            await self.stop(grace=0)  # the pools it opened
            raise ConfigError("publisher.create_schema", f"is false and {why}")
        if not self._holds_lost_writes:
            lost_writes.hold()
            self._holds_lost_writes = True
        self._spawn(self.tailer.run(), "tailer")
        if self.doorbell is not None:
            self._spawn(self.doorbell.run(), "doorbell")
        stall = every(_STALL_CHECK, self.sessions.evict_stalled, name="stall", log=log)
        self._spawn(stall, "stall")
        self._spawn(every(_STALL_CHECK, self._sample_rates, name="rates", log=log), "rates")
        self._spawn(every(_STALL_CHECK, self._expire, name="window", log=log), "window")
        self._spawn(
            every(_WATCH_INTERVAL, self._watch, name="watch", log=log, log_db_errors=False),
            "watch",
        )
        if self.config.retention:
            interval = self.config.retention_interval
            self._spawn(every(interval, self._trim, name="retention", log=log), "retention")
        log_event(
            log,
            "publisher.started",
            schema=self.config.schema,
            resources=[r.name for r in self.config.resources],
        )

    def _spawn(self, work: Coroutine[Any, Any, None], name: str) -> None:
        task = asyncio.create_task(work, name=f"changefeed-{name}")
        task.add_done_callback(lambda task: self._task_ended(name, task))
        self._tasks.append(task)

    def _task_ended(self, name: str, task: asyncio.Task[None]) -> None:
        # Background work must never die silently: say what failed and why, with
        # its traceback, and show it in /readyz and stats.
        if not task.cancelled() and (exc := task.exception()) is not None:
            self.failed[name] = f"{type(exc).__name__}: {exc}"
            log_event(log, "publisher.task_failed", logging.CRITICAL, exc=exc, task=name)
            if name == "tailer":
                # Nothing reaches this instance's listeners any more: send them to
                # another instance, cursors in hand, rather than leave them waiting.
                self.sessions.resume_all("this publisher's tailer failed; resume elsewhere")

    async def drain(self, grace: float = 5.0) -> None:
        """Refuse new registrations and close every listener with 1001 ("going away"),
        so that they re-register with another instance; wait up to ``grace`` seconds."""
        await self.sessions.drain(grace)

    @property
    def draining(self) -> bool:
        return self.sessions.draining

    @property
    def registry(self) -> Registry:
        return self.sessions.registry

    @property
    def connections(self) -> int:
        """Websocket connections open now (registered or not)."""
        return self.counters.connections_open

    async def stop(self, grace: float = 5.0) -> None:
        """Drain, then stop tailing and retention; nothing is half-written (the
        publisher never writes the feed, it only reads and trims it in
        transactions)."""
        await self.drain(grace)
        await self.sessions.port_bounds.close()
        self.broadcast.stop()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks.clear()
        if self._read_pool is not None:
            with contextlib.suppress(Exception):
                async with asyncio.timeout(grace):
                    await self._read_pool.close()
            self._read_pool = None
        if self._own_pool and self._pool is not None:
            with contextlib.suppress(Exception):
                async with asyncio.timeout(grace):
                    await self._pool.close()
            self._pool = None
        if self._holds_lost_writes:
            lost_writes.release()
            self._holds_lost_writes = False
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

    def listeners_first(self, app: Any) -> Any:
        """``app`` (an ASGI app that mounts ``routes``), with the listener websocket
        handed to this publisher before ``app``'s middleware and router: an idle
        listener then holds no frames of theirs (``routes.ListenersFirst``)."""
        from .connection import ListenerEndpoint
        from .routes import ListenersFirst

        return ListenersFirst(app, ListenerEndpoint(self.sessions))

    async def _join_feed(
        self, conn: asyncpg.Connection, position: Position | None, stamp: int
    ) -> tuple[Position, int]:
        return await join_feed(
            conn,
            position,
            stamp,
            reader=self.reader,
            identity=self.identity,
            window=self.broadcast.window,
            pages=self.broadcast.pages,
            feed_changed=self.sessions.feed_changed,
            resume_all=self.sessions.resume_all,
            standby=self.standby,
        )

    # -- requests ------------------------------------------------------------

    @property
    def auth(self) -> BearerAuth:
        """Who may read what (bearer tokens, the authorizer)."""
        return self.sessions.auth

    async def authenticate(self, headers: Mapping[str, str]) -> frozenset[str] | None:
        """The resources a request's bearer token may read (``{"*"}``: all); None
        when it is missing or unknown.

        Raises:
            AuthUnavailable: the authorizer raised or took longer than 5 s.
        """
        return await self.sessions.authenticate(headers)

    def refused(self, code: str, endpoint: str, peer: str, reason: str) -> None:
        """Count and log one refusal (bad input, auth, limits) with its error code."""
        self.sessions.refused(code, endpoint, peer, reason)

    def page_token_key(self) -> bytes:
        """The key of the page tokens of the API's bootstrap routes:
        ``KeysetQuery(..., token_key=publisher.page_token_key)``. Derived from the
        feed's cursor key (``identity.py``), it is secret as that key is and the
        same on every instance of the feed, so a walk may go on through any of
        them.

        Raises:
            TokenKeyUnavailable: the publisher has not read its feed yet (the route
                answers 503 with ``Retry-After``).
        """
        key = self.identity.page_token_key
        if key is None:
            raise TokenKeyUnavailable("the publisher has not read its feed yet; retry")
        return key

    async def authorize_request(
        self, request: HTTPConnection, resource: str | None = None
    ) -> AccessGranted | AccessDenied:
        """For the embedding API's own routes (bootstrap routes): may this request go on?

        The answer is true when it may. A refusal (false) says how to answer it,
        as every route of the publisher does (``changefeed.schemas.access``):
        ``status`` 401 ``unauthorized`` (no token, or an unknown one), 403
        ``forbidden`` (a token not allowed the resource) or 503 ``unavailable``
        (the authorizer failed or took longer than 5 s; ``Retry-After``), with
        ``headers()`` and the error body ``frame()``. ``BootstrapRoute`` answers it
        so. A refusal is counted (``changefeed_refusals_total``, stats).

        Args:
            request: the request (its ``Authorization: Bearer`` header).
            resource: the resource the request reads. When None, the resource whose
                ``bootstrap_route`` serves the request's path (the route, or an item
                under it; ``auth.resources_served_at``), so that
                ``BootstrapRoute(..., authorize=publisher.authorize_request)`` checks
                the resource it serves. Where two resources share a route, a token
                allowed either may read it. A path no bootstrap route serves needs
                a known token only.
        """
        header = request.headers.get("authorization", "")
        bootstrap_route = getattr(request.state, BOOTSTRAP_ROUTE_STATE, None)
        served = [] if resource is None else [resource]
        if resource is None:
            routes = [(r.name, r.bootstrap_route) for r in self.config.resources]
            for path in routed_paths(request.scope, bootstrap_route):
                if served := resources_served_at(path, routes):
                    break
        outcome = await self.auth.check(header, any_of=served)
        if outcome and not served and bootstrap_route is not None:
            # A bootstrap route reads a resource: one no check can name is refused,
            # never left to any known token.
            outcome = AccessDenied(
                "forbidden",
                f"no resource's bootstrap_route serves {bootstrap_route!r}; build the route"
                " with authorize=lambda r: publisher.authorize_request(r, resource=...)",
            )
        if isinstance(outcome, AccessDenied):
            peer = f"{request.client.host}:{request.client.port}" if request.client else ""
            self.refused(outcome.code, "http", peer, f"{request.url.path}: {outcome.message}")
        return outcome

    async def wait_ready(self) -> bool:
        """True once the tailer knows its position (it may be briefly reconnecting)."""
        return await self.sessions.wait_ready()

    # -- background work -----------------------------------------------------

    async def _watch(self) -> None:
        """Look at the feed's health, on the pool: a slow look never delays the
        tailer; while the database is away the last figures stay (the tailer
        reports it). Reading a standby, only the writers' age is asked of the
        primary (it alone knows its writers); the feed is looked at on the standby."""
        async with self.read_pool.acquire(timeout=_READY_TIMEOUT) as conn:
            async with asyncio.timeout(_READY_TIMEOUT):
                health = await self.reader.health(conn)
        if self.standby is not None:
            async with self.pool.acquire(timeout=_READY_TIMEOUT) as conn:
                async with asyncio.timeout(_READY_TIMEOUT):
                    writer = await self.reader.oldest_writer_seconds(conn)
            health = dataclasses.replace(health, oldest_writer_seconds=writer)
        self.feed_health = health

    async def _sample_rates(self) -> None:
        """A reading of the counters the dashboard charts (rates.RateHistory keeps
        one per slot)."""
        self.rates.observe(time.monotonic(), time.time(), rate_counters(self))

    async def _expire(self) -> None:
        """Let entries older than ``window_max_age`` leave the window, even while
        nothing new arrives to push them out."""
        self.broadcast.window.expire(time.time())

    async def _trim(self) -> None:
        async with self.pool.acquire(timeout=_READY_TIMEOUT) as conn:
            deleted = await trim_expired(
                conn, self.config.schema, timedelta(seconds=self.config.max_age)
            )
        if deleted:
            log_event(log, "retention.trimmed", entries=deleted, max_age=self.config.max_age)

    # -- observability -----------------------------------------------------

    def stats(self, allowed: frozenset[str] | None = None) -> dict[str, Any]:
        """The /changefeeds/stats document (``allowed``: only registrations of these
        resources; None or ``{"*"}``: all)."""
        return stats_document(self, allowed)
