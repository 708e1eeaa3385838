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
import logging
import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Sequence
from datetime import UTC, datetime, timedelta
from typing import Any

import asyncpg
import orjson
from starlette.requests import HTTPConnection
from starlette.routing import BaseRoute
from starlette.types import Scope

from changefeed.logs import log_event
from changefeed.schemas import (
    ChangeKind,
    CursorCodec,
    Position,
    ResourceRoute,
    apply_schema,
    notify_channel,
)

from .auth import Authorizer, AuthUnavailable, BearerAuth
from .config import PublisherConfig, ResourceConfig
from .errors import ConfigError, ResumeGap
from .feed import FeedEntry, FeedHealth, FeedReader
from .matching import matches
from .metrics import PublisherMetrics
from .outbox import Outbox
from .rates import RateHistory
from .registry import Closing, ListenerSession, Registry
from .retention import trim_expired
from .tailer import DB_ERRORS, Tailer
from .wire import FrameCache, batch_text

__all__ = ["Publisher"]

log = logging.getLogger(__name__)

_REPLAY_PAGE = 1000
_WATCH_INTERVAL = 1.0
"""Seconds between two looks at the feed's health (FeedReader.health)."""
_FLUSH_SLICE = 0.00025
"""Seconds a flush writes before it lets the event loop run (see Publisher._flush)."""
_SLICE_YIELDS = 2
"""Times the next slice of a flush goes to the back of the event loop's queue
(see Publisher._requeue_slice)."""
_READY_TIMEOUT = 5.0
_FANNED_OUT_TIMEOUT = 1.0
_REFUSALS_KEPT = 100


class _FlushRound:
    """One flush under way: the outboxes it covers and how far it got."""

    __slots__ = ("cost", "next", "pending", "started", "through", "unsent")

    def __init__(self, pending: list[Outbox], started: float, through: Position | None) -> None:
        self.pending = pending
        self.started = started
        """Loop time at its start."""
        self.through = through
        """The last entry dispatched before it started (for the debug events)."""
        self.next = 0
        """Index in ``pending`` of the next outbox to write."""
        self.cost = 0.0
        """Seconds its slices have spent writing so far."""
        self.unsent: list[Outbox] = []
        """Outboxes left with frames for their sender tasks."""


class Publisher:
    """Change-feed publisher for one feed table.

    Args:
        config: what to publish and how (see PublisherConfig).
        pool: an asyncpg pool of the embedding API, used for resume and
            retention queries; when None the publisher makes a small one.
        authorize: optional async callable for bearer tokens (see ``Authorizer``),
            asked about any token the static ``auth_tokens`` / ``token_resources``
            do not know. With neither, there is no authentication (docs/security.md).
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
        self.metrics.feed_max_age.set(config.max_age)
        self.reader = FeedReader(config.schema)
        self.tailer = Tailer(
            self._connect,
            self.reader,
            notify_channel(config.schema),
            self._dispatch,
            poll_interval=config.poll_interval,
            batch=config.tail_batch,
            retry_budget=config.db_retry_budget,
            fanned_out=self._fanned_out,
        )
        self._pool = pool
        self._own_pool = pool is None
        self.auth = BearerAuth(config.auth_tokens, config.token_resources, authorize)
        self._tasks: list[asyncio.Task[None]] = []
        self.connections = 0
        """Websocket connections open now (registered or not)."""
        self.connections_opened = 0
        self.connections_closed = 0
        self.draining = False
        self.entries_total = 0
        self.queued_total = 0
        self.sent_total = 0
        self.frames_total = 0
        self.dropped_total = 0
        self._pending: set[Outbox] = set()
        self.frame_cache = FrameCache()
        """Serialised frames shared by the direct writes of every connection."""
        self._flush_timer: asyncio.Handle | None = None
        """The next flush, or the next slice of the one under way."""
        self._next_flush = 0.0
        """Loop time before which a flush waits (see _flush)."""
        self._flushed = asyncio.Event()
        """Set while no outbox waits for a flush and none is under way."""
        self._flushed.set()
        self._dispatched_through: Position | None = None
        """The last entry handed to the fan-out (for the debug events)."""
        self.feed_health = FeedHealth(0.0, 0.0, 0)
        """The feed as last seen by _watch_loop (oldest writer, oldest entry, size)."""
        self.refusals: dict[str, int] = {}
        self.recent_refusals: deque[dict[str, str]] = deque(maxlen=_REFUSALS_KEPT)
        self.rates = RateHistory()
        """Entries, deliveries and evictions per second, sampled by _watch_loop
        (the dashboard's chart)."""
        self._no_listeners = asyncio.Event()
        self._no_listeners.set()
        self.metrics.bind(
            queue_depth=lambda: max((len(s.outbox) for s in self.registry.sessions), default=0),
            queued=lambda: sum(len(s.outbox) for s in self.registry.sessions),
            connections=lambda: self.connections,
            lag=lambda: self.tailer.lag_seconds,
            up=lambda: 1.0 if self.tailer.status == "running" else 0.0,
            oldest_xact=lambda: self.feed_health.oldest_writer_seconds,
            oldest_entry=lambda: self.feed_health.oldest_entry_seconds,
            feed_bytes=lambda: self.feed_health.feed_bytes,
            position=lambda: float(self.tailer.position.id) if self.tailer.position else 0.0,
        )
        self.metrics.count_live(
            entries=lambda: self.entries_total,
            queued=lambda: self.queued_total,
            deliveries=lambda: self.sent_total,
            frames=lambda: self.frames_total,
            fanout_wait=lambda: self.tailer.fanout_wait_seconds,
        )

    # -- lifecycle ---------------------------------------------------------

    async def _connect(self) -> asyncpg.Connection:
        # command_timeout: a read blocked on a lock or a half-open connection
        # becomes an error the tailer retries, instead of a silent stall.
        # plan_cache_mode: once the feed table has been analysed, PostgreSQL
        # plans the tailer's prepared read afresh on every execution (the
        # custom plan looks cheaper than the generic one), and planning costs
        # more than the read. The generic plan, an index range scan in feed
        # order under the LIMIT, is the right one for every cursor.
        return await asyncpg.connect(
            self.config.dsn,
            timeout=5.0,
            command_timeout=30.0,
            server_settings={
                "application_name": "changefeed-tailer",
                "plan_cache_mode": "force_generic_plan",
            },
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
        self._spawn(self._watch_loop(), "changefeed-watch")
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
            async with asyncio.timeout(grace):
                await self._no_listeners.wait()

    async def stop(self, grace: float = 5.0) -> None:
        """Drain, then stop tailing and retention; nothing is half-written (the
        publisher never writes the feed, it only reads and trims it in
        transactions)."""
        await self.drain(grace)
        if self._flush_timer is not None:
            self._flush_timer.cancel()
            self._flush_timer = None
        self._flushed.set()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks.clear()
        if self._own_pool and self._pool is not None:
            with contextlib.suppress(Exception):
                async with asyncio.timeout(grace):
                    await self._pool.close()
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
        /changefeeds/stats, /changefeeds/dashboard, /metrics, /healthz, /readyz."""
        from .routes import publisher_routes

        return publisher_routes(self)

    # -- fan-out -------------------------------------------------------------
    #
    # The tailer hands each batch of final entries to _dispatch, synchronously.
    # The registry encodes each wanted entry once and offers the frames to the
    # bounded outbox of every matching listener; a listener whose outbox is full
    # is evicted (4009) there and then. Nothing here awaits, so no listener can
    # slow the tailer or another listener (I2, I3). See docs/fanout.md.

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
        self.entries_total += len(entries)
        now, observe = time.time(), self.metrics.entry_age.observe
        for entry in entries:
            observe(now - entry.published.timestamp())
        touched: list[Outbox] = []
        queued, evicted = self.registry.dispatch(entries, self.encode, touched)
        self.queued_total += queued
        self._dispatched_through = entries[-1].position
        if log.isEnabledFor(logging.DEBUG):
            log_event(
                log,
                "fanout.dispatched",
                logging.DEBUG,
                entries=len(entries),
                last=list(self._dispatched_through),
                queued=queued,
                listeners=len(touched),
                evicted=len(evicted),
            )
        self._pending.update(touched)
        if self._pending:
            self._flushed.clear()
        if self._pending and self._flush_timer is None:
            # Flush now, unless the last flush was too recent (see _flush): then
            # as soon as it may, with everything read meanwhile.
            loop = asyncio.get_running_loop()
            if loop.time() >= self._next_flush:
                self._flush()
            else:
                self._flush_timer = loop.call_at(self._next_flush, self._flush)
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
                delivered=session.sent,
                dropped=session.dropped,
                listeners=len(self.registry),
            )

    def _flush(self) -> None:
        """Send what the outboxes received since the last flush.

        Each connection that can takes one turn right here, without a task
        switch (websocket._DirectSender); its sender task is woken only for what
        is left. The flush runs in slices of at most ``_FLUSH_SLICE`` seconds
        (``_flush_slice``), and between two slices the event loop runs: a
        doorbell, or the tailer's next read, need not wait for the last
        listener of a large flush. The next flush may start once three times
        this one's cost has passed since it started, and at most
        ``send_interval`` after its start: with few listeners a change goes out
        at once, with many the flushes (one frame per listener each) take at
        most a third of the process's time and the rest is left to reading and
        to everything else. A flush that woke sender tasks cannot see what
        their sends will cost, so the next one waits ``send_interval`` after it.
        """
        loop = asyncio.get_running_loop()
        flush = _FlushRound(list(self._pending), loop.time(), self._dispatched_through)
        self._pending = set()
        self._flush_slice(flush)

    def _flush_slice(self, flush: _FlushRound) -> None:
        self._flush_timer = None
        loop = asyncio.get_running_loop()
        perf_counter = time.perf_counter
        started = perf_counter()
        deadline = started + _FLUSH_SLICE
        pending, unsent = flush.pending, flush.unsent
        i, end = flush.next, len(pending)
        while i < end:
            outbox = pending[i]
            i += 1
            send_now = outbox.send_now
            if send_now is None or not send_now():
                unsent.append(outbox)
            if perf_counter() >= deadline:
                break
        flush.next = i
        flush.cost += perf_counter() - started
        if i < end:
            # Meanwhile _dispatch only queues (_flush_timer is set): an outbox
            # still ahead in this flush sends what it gets; one behind waits for
            # the next flush, as it would have anyway.
            self._flush_timer = loop.call_soon(self._requeue_slice, flush, _SLICE_YIELDS)
            return
        # Senders are woken only now: every listener has had its turn in this
        # flush before any of them takes a second one.
        for outbox in unsent:
            outbox.wake()
        cost = flush.cost
        self.metrics.flush_seconds.observe(cost)
        if log.isEnabledFor(logging.DEBUG):
            log_event(
                log,
                "fanout.flushed",
                logging.DEBUG,
                through=list(flush.through) if flush.through else None,
                listeners=len(pending),
                written=len(pending) - len(unsent),
                to_senders=len(unsent),
                cost_ms=round(cost * 1e3, 3),
            )
        if unsent:
            self._next_flush = loop.time() + self.config.send_interval
        else:
            self._next_flush = flush.started + min(self.config.send_interval, 3 * cost)
        if self._pending:
            self._flush_timer = loop.call_at(self._next_flush, self._flush)
        else:
            self._flushed.set()

    def _requeue_slice(self, flush: _FlushRound, yields: int) -> None:
        """Put the flush's next slice behind whatever became ready meanwhile.

        The event loop runs the callbacks that were ready when an iteration
        began, in order, and what they schedule waits for the next iteration.
        A slice that queued its successor at once would run before every step
        of the tailer: the doorbell's callback, the tailer task it wakes, the
        reply to its read. Each would wait a slice, and together they took
        about 0.4 ms of a change's way to its listeners at 100 listeners
        (docs/performance.md). Going to the back of the queue twice puts the
        slice behind those two-step chains, at the cost of an empty callback.
        """
        loop = asyncio.get_running_loop()
        if yields > 1:
            self._flush_timer = loop.call_soon(self._requeue_slice, flush, yields - 1)
        else:
            self._flush_timer = loop.call_soon(self._flush_slice, flush)

    async def _fanned_out(self) -> None:
        """Return once every frame dispatched so far has had its flush (the tailer
        waits for this between full batches; see Tailer). Bounded: a flush that
        never ends, which is a bug, must not stop the tailer for good."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(_FANNED_OUT_TIMEOUT):
                await self._flushed.wait()

    def count_sent(self, items: int, frames: int) -> None:
        """Count ``items`` written to a listener socket in ``frames`` websocket frames."""
        self.sent_total += items
        self.frames_total += frames

    def connection_opened(self) -> None:
        """A websocket handshake arrived on /changefeeds (whatever becomes of it)."""
        self.connections += 1
        self.connections_opened += 1
        self.metrics.connections_total.inc()

    def connection_closed(self) -> None:
        """A connection counted by ``connection_opened`` ended."""
        self.connections -= 1
        self.connections_closed += 1

    def refused(self, code: str, endpoint: str, peer: str, reason: str) -> None:
        """Count and log one refusal (bad input, auth, limits) with its error code."""
        self.refusals[code] = self.refusals.get(code, 0) + 1
        at = datetime.now(UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")
        self.recent_refusals.append(
            {"at": at, "code": code, "endpoint": endpoint, "peer": peer, "reason": reason[:256]}
        )
        self.metrics.refusals_total.labels(code, endpoint).inc()
        log_event(
            log,
            "registration.refused" if endpoint == "websocket" else "request.refused",
            logging.WARNING,
            code=code,
            endpoint=endpoint,
            peer=peer,
            reason=reason,
        )

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
        if session.closing is None:
            session.close(Closing(1000, None, "connection ended"))
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
        self.dropped_total += session.dropped
        self.metrics.dropped_total.inc(session.dropped)
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
            async with asyncio.timeout(_READY_TIMEOUT):
                await self.tailer.ready.wait()
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
        self,
        send_text: Callable[[str], Awaitable[None]],
        session: ListenerSession,
        since: Position,
        upto: Position,
    ) -> None:
        """Send the entries in ``(since, upto]`` that match ``session`` (resume)."""
        assert self._pool is not None
        kinds = [(s.change_kind.resource, s.sub_resources) for s in session.subscriptions]
        resources = sorted({r for r, _ in kinds})
        after = since
        replayed = 0
        while session.closing is None:
            async with self._pool.acquire(timeout=_READY_TIMEOUT) as conn:
                entries = await self.reader.read_between(conn, after, upto, resources, _REPLAY_PAGE)
            frames = [
                self.encode(e)
                for e in entries
                if any(r == e.resource and matches(e.sub_resources, subs) for r, subs in kinds)
            ]
            step = self.config.max_batch if session.batch else 1
            for i in range(0, len(frames), step):
                # Evicted (its live queue overflowed meanwhile) or drained: the rest
                # of the replay would only be thrown away with the connection.
                if session.closing is not None:
                    break
                sent = frames[i : i + step]
                await send_text(batch_text(sent) if session.batch else sent[0])
                session.frames += 1
                session.sent += len(sent)
                replayed += len(sent)
                # Counted as it goes: a replay may be dropped mid-way (see websocket).
                self.metrics.replayed_total.inc(len(sent))
                self.sent_total += len(sent)
            if len(entries) < _REPLAY_PAGE:
                break
            after = entries[-1].position
        interrupted = session.closing is not None
        if not interrupted:
            # Garbage collection (inline or the Spark job) raises the low-water mark
            # in the same transaction as its deletes: if it passed `since` while we
            # read page by page, entries may have vanished under the replay. Say so
            # rather than leave a silent gap; the listener re-registers and bootstraps.
            async with self._pool.acquire(timeout=_READY_TIMEOUT) as conn:
                if since < await self.reader.low_water(conn):
                    raise ResumeGap("the feed was trimmed past the cursor during the replay")
        log_event(
            log,
            "resume.interrupted" if interrupted else "resume.replayed",
            instance=session.instance,
            items=replayed,
            since=str(since),
            upto=str(upto),
        )

    # -- authentication ------------------------------------------------------

    @property
    def auth_required(self) -> bool:
        """Whether requests need a bearer token (static tokens or an authorizer)."""
        return self.auth.required

    async def authenticate(self, conn: HTTPConnection | Scope) -> frozenset[str] | None:
        """The resources the bearer token of a request or websocket handshake may read
        (``{"*"}``: all); None when it is missing or unknown (see ``BearerAuth``).

        Raises:
            AuthUnavailable: the authorizer raised or took longer than 5 s.
        """
        headers = conn.headers if isinstance(conn, HTTPConnection) else HTTPConnection(conn).headers
        return await self.auth.resolve(headers.get("authorization", ""))

    async def authorize_request(self, request: HTTPConnection, resource: str | None = None) -> bool:
        """For the embedding API's own routes (bootstrap routes): may this request go on?

        Args:
            request: the request (its ``Authorization: Bearer`` header).
            resource: when given, the token must also be allowed to read this resource.

        A refusal is counted (``changefeed_refusals_total``, stats) as ``unauthorized``;
        an unavailable authorizer refuses too (the caller answers 401).
        """
        try:
            allowed = await self.authenticate(request)
        except AuthUnavailable:
            allowed = None
        ok = allowed is not None and (resource is None or "*" in allowed or resource in allowed)
        if not ok:
            peer = f"{request.client.host}:{request.client.port}" if request.client else ""
            code = "unauthorized" if allowed is None else "forbidden"
            self.refused(code, "http", peer, request.url.path)
        return ok

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

    async def _watch_loop(self) -> None:
        # On the pool, not the tailer's connection: a slow look never delays a read.
        # While the database is away the last figures stay (the tailer reports it).
        while True:
            self.rates.observe(
                time.monotonic(),
                time.time(),
                {
                    "entries": self.entries_total,
                    "deliveries": self.sent_total,
                    "evictions": self.registry.evictions_total,
                },
            )
            assert self._pool is not None
            with contextlib.suppress(*DB_ERRORS):
                async with self._pool.acquire(timeout=_READY_TIMEOUT) as conn:
                    async with asyncio.timeout(_READY_TIMEOUT):
                        self.feed_health = await self.reader.health(conn)
            await asyncio.sleep(_WATCH_INTERVAL)

    # -- observability -----------------------------------------------------

    def stats(self, allowed: frozenset[str] | None = None) -> dict[str, Any]:
        """The /changefeeds/stats document.

        Args:
            allowed: show only registrations of these resources (None or ``{"*"}``: all).
        """
        registry = self.registry
        everything = allowed is None or "*" in allowed
        visible = frozenset() if allowed is None else allowed
        return {
            "listeners": len(registry),
            "registrations": registry.registrations(allowed),
            "connections": self.connections,
            "draining": self.draining,
            "tailer": {
                **self.tailer.stats(),
                "oldestOpenTransactionSeconds": round(self.feed_health.oldest_writer_seconds, 3),
            },
            "feed": {
                "oldestEntrySeconds": round(self.feed_health.oldest_entry_seconds, 3),
                "bytes": self.feed_health.feed_bytes,
            },
            "counters": {
                "connections": self.connections_opened,
                "connectionsClosed": self.connections_closed,
                "listeners": registry.sessions_total,
                "registrations": registry.registrations_total,
                "disconnects": registry.disconnects_total,
                "evictions": registry.evictions_total,
                "sent": self.sent_total,
                "frames": self.frames_total,
                "dropped": self.dropped_total,
                "refused": dict(sorted(self.refusals.items())),
            },
            # A token limited to some resources sees those resources' listeners
            # only, and no refusals (they name peers and other resources).
            "recentEvictions": [
                eviction
                for eviction in registry.recent_evictions
                if everything or any(k["resource"] in visible for k in eviction["changeKinds"])
            ],
            "recentRefusals": list(self.recent_refusals) if everything else [],
            "rates": self.rates.to_json(),
        }
