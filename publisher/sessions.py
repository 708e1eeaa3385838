"""The publisher's listener connections: registering, admitting, evicting and forgetting them.

``Sessions`` is what a connection talks to (``host.ListenerHost``): it
decides registrations (``registration``), admits a connection in one
synchronous step (reading the fan-out's head and joining it, or starting it
behind so that it catches up), and closes the ones the publisher must close.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import random
import time
from collections.abc import Callable, Mapping
from typing import Final

import asyncpg

from changefeed.budgeted_log import BudgetedLines
from changefeed.log_budget import LogBudget
from changefeed.logs import log_event
from changefeed.schemas import (
    ERROR_CLOSE_CODES,
    ORIGIN,
    AccessDenied,
    AccessGranted,
    Ack,
    Cursor,
)

from .auth import BearerAuth
from .catchup import Catchup
from .config import PublisherConfig
from .counters import Counters, timestamp
from .delivery import Closing, Delivery
from .fanout import Fanout
from .feed import DB_ERRORS, FeedReader, ResumeFacts
from .host import Admitted
from .identity import FeedIdentity
from .port_bounds import PortBounds
from .registration import (
    Refusal,
    Request,
    check_capacity,
    check_registration,
    quote,
    read_cursor,
)
from .registry import Registry, Session
from .resume_queries import ResumeQueries, StandbyBehind
from .stall import stalled
from .standby import Standby
from .tailer import Tailer
from .window import Window

__all__ = ["Sessions"]

log = logging.getLogger(__name__)

_READY_TIMEOUT = 5.0

_DECISIONS = 3
"""Decisions on one registration at most, each made again because the feed changed
(or the tailer began to join it again) meanwhile; then it is refused with 4010."""
_STANDBY_RETRY = 2.0
"""retryAfter (seconds) for a cursor this publisher's standby has not caught up with:
by then it most likely has, or the balancer sends the listener elsewhere."""


_CHANGED = Refusal("unavailable", "the feed changed meanwhile; retry", 1.0)


class _Again(enum.Enum):
    """A registration to decide again (``Sessions._decide``)."""

    AGAIN = enum.auto()


_AGAIN: Final = _Again.AGAIN

REFUSALS_LOGGED = 20
"""Refusals of one code in one window logged one by one, each with its peer and reason."""
REFUSALS_WINDOW = 10.0
"""Seconds of a window: the refusals beyond ``REFUSALS_LOGGED`` in it go out as one
``refusals_held`` line (counts by event and code) when it ends. Every refusal is
counted (``changefeed_refusals_total``) and kept in ``recentRefusals`` regardless."""


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None


class Sessions:
    """The listener connections of one publisher (``host.ListenerHost``).

    Args:
        config: the publisher's configuration.
        identity: the feed's identity and cursors.
        auth: bearer-token authentication.
        counters: where events are counted.
        window: the recent entries (its head is the fan-out's position).
        fanout: live delivery.
        catchup: refills connections that are behind.
        tailer: the feed's tailer (ready once it knows its position).
        reader: the feed's queries.
        pool: the pool of the server the publisher reads (``read_dsn``, or the
            primary's), once started.
        standby: the primary beside it, when the publisher reads a standby.
        rng: random source of the connections' waits before reading the feed again.
    """

    def __init__(
        self,
        config: PublisherConfig,
        *,
        identity: FeedIdentity,
        auth: BearerAuth,
        counters: Counters,
        window: Window,
        fanout: Fanout,
        catchup: Catchup,
        tailer: Tailer,
        reader: FeedReader,
        pool: Callable[[], asyncpg.Pool],
        standby: Standby | None = None,
        rng: random.Random | None = None,
    ) -> None:
        self._config = config
        self._rng = rng or random.Random()
        self._identity = identity
        self.auth = auth
        self._counters = counters
        self._window = window
        self._fanout = fanout
        self._catchup = catchup
        self._tailer = tailer
        # A listener may have read past a compaction run elsewhere: every answer about
        # a cursor tells catch-up of it before the listener's start is decided (_admit).
        self._resume_queries = ResumeQueries(
            reader,
            pool,
            _READY_TIMEOUT,
            standby=standby,
            on_facts=self._observe,
        )
        self.registry = Registry()
        self.draining = False
        self.direct_writes: bool | None = None
        """Whether connections get direct writes (known from the first one)."""
        self.port_bounds = PortBounds(config.notsent_lowat)
        """Bounds the kernel's unsent bytes on the ports plain-ASGI listeners use."""
        self._empty = asyncio.Event()
        self._empty.set()
        # Anyone can be refused at will (no token, a socket left idle): the first
        # refusals of a window are logged one by one, the rest as one summary. One
        # budget per code, so that a flood of one kind hides none of another.
        self._refusal_lines: dict[str, BudgetedLines] = {}

    @property
    def config(self) -> PublisherConfig:
        return self._config

    @property
    def catchup(self) -> Catchup:
        return self._catchup

    @property
    def rng(self) -> random.Random:
        return self._rng

    async def drain(self, grace: float) -> None:
        """Refuse new registrations and close every listener with 1001 ("going away"),
        so that they re-register with another instance; wait up to ``grace`` seconds."""
        for lines in self._refusal_lines.values():
            lines.flush()
        if not self.draining:
            log_event(log, "publisher.draining", listeners=len(self.registry))
        self.draining = True
        for session in list(self.registry):
            session.close(Closing(1001, None, "publisher shutting down"))
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(grace):
                await self._empty.wait()

    async def authenticate(self, headers: Mapping[str, str]) -> frozenset[str] | None:
        """The resources a request's bearer token may read (``{"*"}``: all); None
        when it is missing or unknown (see ``BearerAuth``).

        Raises:
            AuthUnavailable: the authorizer raised or took longer than 5 s.
        """
        return await self.auth.resolve(headers.get("authorization", ""))

    async def access(self, headers: Mapping[str, str], peer: str) -> AccessGranted | AccessDenied:
        """Whether a websocket handshake may go on (``BearerAuth.check``); a refusal
        is counted and logged."""
        outcome = await self.auth.check(headers.get("authorization", ""))
        if isinstance(outcome, AccessDenied):
            self.refused(outcome.code, "websocket", peer, outcome.message)
        return outcome

    def refused(self, code: str, endpoint: str, peer: str, reason: str) -> None:
        """Count one refusal (bad input, auth, limits) with its error code, and log it
        within the refusals' budget."""
        self._counters.refused(code, endpoint, peer, reason)
        event = "registration.refused" if endpoint == "websocket" else "request.refused"
        lines = self._refusal_lines.get(code)
        if lines is None:  # codes are the publisher's own: a few dozen at most
            budget = LogBudget(REFUSALS_LOGGED, REFUSALS_WINDOW)
            lines = BudgetedLines(budget, log, "refusals_held", logging.WARNING)
            self._refusal_lines[code] = lines
        if lines.due(f"{event} {code}", _running_loop()):
            log_event(
                log, event, logging.WARNING, code=code, endpoint=endpoint, peer=peer, reason=reason
            )

    def connection_opened(self, direct_writes: bool, port: int | None) -> None:
        self._counters.connections_opened += 1
        if self.direct_writes is None:
            self.direct_writes = direct_writes
            log_event(log, "fanout.path", path="direct writes" if direct_writes else "ASGI sends")
        if not direct_writes:
            self.port_bounds.saw(port)

    def connection_closed(self) -> None:
        self._counters.connections_closed += 1

    def capacity(self) -> Refusal | None:
        """A refusal when this publisher takes no more listeners now (draining, full)."""
        return check_capacity(
            self._config, draining=self.draining, connections=self._counters.connections_open
        )

    async def register(self, text: str, access: frozenset[str], peer: str) -> Admitted | Refusal:
        """Decide on a registration frame and admit the connection if it may register."""
        config = self._config
        request = self.capacity() or check_registration(text, config=config, access=access)
        if isinstance(request, Refusal):
            return request
        for resource, unknown in request.undeclared:
            log_event(
                log,
                "registration.undeclared_sub_resources",
                logging.WARNING,
                peer=peer,
                instance=quote(request.registration.instance),
                resource=resource,
                undeclared=list(unknown),
            )
        # One deadline for every decision: the listener waits for its answer only so
        # long (its ack_timeout, 10 s by default). A decision is made again only
        # while it has not passed.
        ready_by = asyncio.get_running_loop().time() + _READY_TIMEOUT
        for _ in range(_DECISIONS):
            decided = await self._decide(request, peer, ready_by)
            if decided is not _AGAIN:
                return decided
            if asyncio.get_running_loop().time() >= ready_by:
                break
        return _CHANGED

    async def _decide(
        self, request: Request, peer: str, ready_by: float
    ) -> Admitted | Refusal | _Again:
        """Admit or refuse ``request`` once the tailer is ready (by ``ready_by``, on the
        event loop's clock); ``_AGAIN`` when the feed changed (or the tailer began to
        join it again) while this was decided: what was decided may be about another
        feed, and a moment later it is not."""
        if not await self.wait_ready(ready_by):
            why = "its database is unreachable, or its standby is behind"
            return Refusal("unavailable", f"the feed cannot be read now ({why}); retry later", 1.0)
        generation = self._identity.generation
        since, reason = None, None
        if request.registration.since is not None:
            cursor = read_cursor(request.registration.since, self._identity.codec)
            if isinstance(cursor, Refusal):
                return cursor
            if cursor is None:
                stale = await self._identity_stale(peer)
                if stale is not None:
                    return stale
                reason = "other_feed"
            else:
                decided = await self._plan_resume(cursor, peer)
                if isinstance(decided, Refusal):
                    return decided
                since, reason = decided
        if self.draining:
            return Refusal("unavailable", "publisher is shutting down; register elsewhere", 1.0)
        if self._identity.generation != generation or not self._tailer.ready.is_set():
            return _AGAIN
        return self._admit(request, since, reason, peer)

    def _observe(self, facts: ResumeFacts) -> None:
        """What an answer about a cursor tells beyond it: a compaction run elsewhere,
        or a new identity another publisher gave the feed (join it again: its
        listeners' cursors are another feed's, and so would be its own)."""
        self._catchup.observe(facts.state.rewrites)
        if facts.state.feed_id != self._identity.feed_id:
            self._tailer.rejoin()  # nothing changes if it is only this server lagging

    async def _identity_stale(self, peer: str) -> Refusal | _Again | None:
        """For a cursor of another identity: ``_AGAIN`` when the feed's identity changed
        under this publisher (the cursor may be of the new one, which it joins now),
        None when the cursor is another feed's. On a standby, "another feed's" is
        believed only once the standby has replayed what the primary holds: one
        behind may not have replayed the identity a fresher publisher issued the
        cursor under (4010 while it catches up, never a ``resumed: false``)."""
        queries = self._resume_queries
        try:
            facts = await queries.facts(ORIGIN)
            same = facts.state.feed_id == self._identity.feed_id
            if same and facts.in_recovery and queries.on_standby:
                facts = await queries.caught_up(ORIGIN)
        except StandbyBehind as exc:
            return Refusal("unavailable", str(exc), _STANDBY_RETRY)
        except DB_ERRORS as exc:
            log_event(log, "resume.unavailable", logging.WARNING, exc=exc, peer=peer)
            return Refusal("unavailable", "the feed database cannot be asked now; retry", 1.0)
        if facts.state.feed_id == self._identity.feed_id:
            return None
        self._tailer.rejoin()
        return _AGAIN

    async def _plan_resume(
        self, cursor: Cursor, peer: str
    ) -> tuple[Cursor | None, str | None] | Refusal:
        """Ask the feed about a resume cursor: the cursor to start from, or None and
        why not; a refusal (4010, retry) while the database cannot be asked, or while
        this publisher's standby is behind the cursor, never a ``resumed: false``
        that would cost the listener a bootstrap."""
        feed_id = self._identity.feed_id
        assert feed_id is not None
        try:
            resumed, reason = await self._resume_queries.plan(
                cursor,
                feed_id=feed_id,
                head=self._window.head,
                replay_limit=self._config.replay_limit,
            )
        except StandbyBehind as exc:
            return Refusal("unavailable", str(exc), _STANDBY_RETRY)
        except DB_ERRORS as exc:
            log_event(log, "resume.unavailable", logging.WARNING, exc=exc, peer=peer)
            return Refusal("unavailable", "the feed database cannot be asked now; retry", 1.0)
        return (cursor if resumed else None), reason

    def _admit(
        self, request: Request, since: Cursor | None, reason: str | None, peer: str
    ) -> Admitted:
        # One synchronous step, from reading the head to joining the fan-out: no
        # entry can be dispatched between the two (see registration).
        registration = request.registration
        resumed = since is not None
        head = self._window.head
        start = since.position if since is not None else head
        stamp = since.stamp if since is not None else self._window.head_stamp
        # A resume below the compaction job's rewrite floor reads the table up to
        # it before it is served copies held in memory (catchup); a new listener
        # bootstraps, and the copies after the head only tell it to fetch again.
        live_from = max(head, self._catchup.floor) if resumed else head
        delivery = Delivery(
            request.interest,
            start,
            live_from,
            capacity=self._config.queue_size,
            batch=registration.batch,
        )
        delivery.progress_at = time.monotonic()
        if delivery.live:
            self._fanout.join(delivery)
        session = Session(
            registration.instance,
            registration.service,
            registration.change_kinds,
            delivery,
            peer=peer,
            resumed=resumed,
        )
        self.registry.add(session)
        self._empty.clear()
        counters = self._counters
        counters.sessions += 1
        for kind in registration.change_kinds:
            counters.registrations[kind.resource, resumed] += 1
        log_event(
            log,
            "registration",
            instance=session.instance,
            service=session.service,
            peer=peer,
            kinds=[k.to_json() for k in session.kinds],
            resumed=resumed,
            reason=reason,
            start=str(start),
            catching_up=not delivery.live,
            batch=delivery.batch,
            listeners=len(self.registry),
        )
        ack = Ack(
            request.routes,
            self._identity.codec.encode(start, stamp),
            resumed,
            batch=registration.batch,
            multi=registration.multi,
            reason=reason,
        )
        return Admitted(session, ack.encode())

    def evict(
        self, session: Session, code: str, message: str, close_code: int | None = None
    ) -> None:
        """Close ``session`` for the publisher's own reason (``code``: ``slow_listener``,
        ``cursor_expired``, ``keepalive_timeout``), with ``code``'s close code unless
        ``close_code`` says which one the server already sent."""
        if session.closing is not None:
            return
        self._fanout.leave(session.delivery)
        session.close(Closing(close_code or ERROR_CLOSE_CODES[code], code, message))
        if self.registry.retire(session):
            self._unregistered()
        self._counters.evictions[code] += 1
        self._counters.recent_evictions.append(
            {"at": timestamp(), "code": code, "reason": message, **session.summary()}
        )
        log_event(
            log,
            "listener.evicted",
            logging.WARNING,
            code=code,
            reason=message,
            instance=session.instance,
            service=session.service,
            peer=session.peer,
            delivered=session.delivery.delivered(),
            listeners=len(self.registry),
        )

    def forget(self, session: Session) -> None:
        """Drop a session whose connection ended."""
        if session.closing is None:
            session.close(Closing(1000, None, "connection ended"))
        self._fanout.leave(session.delivery)
        counters = self._counters
        counters.gone_sent += session.delivery.sent
        counters.gone_frames += session.delivery.frames
        counters.gone_dropped += session.delivery.dropped
        if not self.registry.remove(session):
            return  # evicted: already unregistered
        self._unregistered()
        log_event(
            log,
            "listener.disconnected",
            instance=session.instance,
            service=session.service,
            peer=session.peer,
            reason=session.closing.message if session.closing else "closed by listener",
            delivered=session.delivery.delivered(),
            listeners=len(self.registry),
        )

    def _unregistered(self) -> None:
        self._counters.disconnects += 1
        if not len(self.registry):
            self._empty.set()

    async def wait_ready(self, until: float | None = None) -> bool:
        """True once the tailer knows its position (it may be briefly reconnecting),
        waiting until ``until`` at most (the event loop's clock; None: 5 s)."""
        if self._tailer.status == "failed":
            return False  # it gave up: nothing to wait for
        if until is None:
            until = asyncio.get_running_loop().time() + _READY_TIMEOUT
        try:
            async with asyncio.timeout_at(until):
                await self._tailer.ready.wait()
        except TimeoutError:
            return False
        return self._tailer.status not in ("unavailable", "failed")

    def feed_changed(self, why: str) -> None:
        """The feed was restored or trimmed under this publisher: every listener's
        state may hold changes the feed no longer has, or miss some. Close them all
        with 4011: they register again without ``since`` and bootstrap."""
        for session in list(self.registry):
            self.evict(session, "cursor_expired", f"{why}; register again without since")

    def resume_all(self, why: str) -> None:
        """Close every listener with 4010: each registers again and resumes from its
        cursor (with this instance or another)."""
        for session in list(self.registry):
            session.close(Closing(ERROR_CLOSE_CODES["unavailable"], "unavailable", why, 1.0))

    async def evict_stalled(self) -> None:
        """Close the listeners that made no progress for ``stall_timeout`` (only those)."""
        sessions = {id(s.delivery): s for s in self.registry}
        timeout = self._config.stall_timeout
        for delivery in stalled(self.registry.deliveries, time.monotonic(), timeout):
            message = f"no progress for {timeout:g}s: evicted; register again and resume"
            self.evict(sessions[id(delivery)], "slow_listener", message)
