"""The tailer: follows the feed table in feed order and hands final entries to the fan-out.

Doorbell + poll: a LISTEN on the feed's channel wakes it as soon as a writer
commits; a poll every ``poll_interval`` is the fallback, so a lost or late
doorbell costs latency, never an entry. It reads only entries below the
snapshot horizon (see ``FeedReader``), from its own in-memory position, so a
reconnect after a dropped connection or a PostgreSQL restart carries on
exactly where it stopped: nothing lost, nothing repeated. It never claims,
marks or deletes entries: every publisher instance tails every entry (HA).

On a hot standby (``standby``) it cannot LISTEN: the doorbell rings from a
connection to the primary (``doorbell``), naming the writer's transaction,
and the tailer reads until the standby has replayed it; while the feed flows
the doorbell rests and the tailer reads on its own (``pacing``). A read that
replay cancelled (SQLSTATE 40001, a conflict with recovery) is read again on
the same connection.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections.abc import Awaitable, Callable, Sequence
from datetime import UTC, datetime
from typing import Any

import asyncpg
from tenacity import RetryCallState

from changefeed.backoff import Backoff, FailureStreak, retrying
from changefeed.logs import log_event
from changefeed.schemas import Position, stamp_of

from .feed import DB_ERRORS, FeedEntry, FeedReader, FeedTrimmed
from .pacing import StandbyPacing

__all__ = ["Join", "Tailer"]

Join = Callable[[asyncpg.Connection, Position | None, int], Awaitable[tuple[Position, int]]]
"""See Tailer's ``join``."""

log = logging.getLogger(__name__)

_LOGGED_IDS = 20
"""Changed resource ids a ``tailer.read`` debug event names (the first of its batch)."""

_UNEXPECTED_RETRIES = 3
"""Failures in a row that are not database errors (a bug, most likely) after which
the tailer gives up instead of retrying them forever."""

_RECONNECT = Backoff(initial=0.05, maximum=2.0, jitter=0.5)
"""Waits before connecting again (changefeed.backoff's policy): 50 ms doubling to
2 s, the upper half of each drawn at random."""

RECONNECT_RESET = 5.0
"""Seconds a connection must stay up for the next failure to reconnect at
``_RECONNECT``'s start again (``FailureStreak``): long past a connection's
set-up, short against an hour of health."""

_CONFLICT = Backoff(initial=0.01, maximum=1.0, jitter=0.5)
"""Waits before reading again after reads replay cancelled, in a row."""


def _txid(payload: object) -> int | None:
    """The transaction a doorbell names (its payload), or None (an older writer's
    empty payload, or anything else)."""
    if isinstance(payload, str) and payload.isdigit() and len(payload) < 21:
        return int(payload)
    return None


class Tailer:
    """Follows one feed table and calls ``sink`` with each batch of final entries.

    Args:
        connect: opens a new asyncpg connection to the feed database.
        reader: the feed's queries.
        channel: the NOTIFY channel writers ring.
        sink: called synchronously with each batch, in feed order; must not block.
        join: called on each connection before reading, with the position the
            tailer is at and its entry's stamp ((None, 0) the first time);
            returns the position to read after and its stamp (the feed's head
            the first time, or when the feed was restored or trimmed under it:
            see identity.join_feed). ``ready`` is clear meanwhile.
        poll_interval: seconds between polls when no doorbell rings.
        batch: entries per read.
        retry_budget: after this many seconds without the database, status is
            ``unavailable`` (the tailer keeps retrying).
        fanned_out: awaited after a full batch, before the next read: returns once
            the fan-out's flush has given every listener its turn of what ``sink`` took.
        standby: ``connect`` opens connections to a hot standby: no LISTEN on them
            (``ring`` is called from elsewhere), and reads paced by ``pacing``.
        rng: random source of the back-off's jitter (seed it in tests).
    """

    def __init__(
        self,
        connect: Callable[[], Awaitable[asyncpg.Connection]],
        reader: FeedReader,
        channel: str,
        sink: Callable[[Sequence[FeedEntry]], None],
        *,
        poll_interval: float = 0.5,
        batch: int = 1000,
        retry_budget: float = 30.0,
        fanned_out: Callable[[], Awaitable[None]] | None = None,
        join: Join | None = None,
        standby: bool = False,
        rng: random.Random | None = None,
    ) -> None:
        self._connect = connect
        self._rng = rng or random.Random()
        self._reader = reader
        self._channel = channel
        self._sink = sink
        self._poll_interval = poll_interval
        self._batch = batch
        self._retry_budget = retry_budget
        self._fanned_out = fanned_out
        self._join = join
        self._pacing = StandbyPacing(poll_interval) if standby else None
        self.on_rest: Callable[[bool], None] | None = None
        """Told True when the feed flows and the doorbell may rest, False when it
        must ring again (``Doorbell.rest``)."""
        self._unexpected = 0
        self._failures = FailureStreak(RECONNECT_RESET)
        self._wake = asyncio.Event()
        self._rejoin = False
        """Join the feed again before the next read (``rejoin``)."""
        self.ready = asyncio.Event()
        self.position: Position | None = None
        self.stamp = 0
        """The stamp of the entry at ``position`` (schemas.stamp_of)."""
        self.status = "starting"
        self.last_error: str | None = None
        self.failing_since: float | None = None
        self.entries_total = 0
        self.doorbells_total = 0
        self.polls_total = 0
        self.reconnects_total = 0
        self.last_published: datetime | None = None
        self.last_read_at: float | None = None
        self._entry_lag = 0.0
        """Age of the newest entry when the last read that found any read it."""
        self.fanout_wait_seconds = 0.0
        """Time spent waiting for the fan-out between full batches (see _drain)."""
        self.replay_conflicts_total = 0
        """Reads the standby cancelled for a conflict with replay (read again)."""

    def ring(self, *args: Any) -> None:
        """Doorbell: read now (called by NOTIFY, or by anyone who knows there is news).
        The last argument is the notification's payload: the writer's transaction."""
        self.doorbells_total += 1
        if self._pacing is not None:
            self._pacing.rung(_txid(args[-1]) if args else None, time.monotonic())
        self._wake.set()

    def rejoin(self) -> None:
        """Join the feed again before the next read: another publisher gave the feed a
        new identity while this one's connection stayed up (it reads a standby that
        was promoted), and this one would otherwise go on signing with the old one.
        Not ready until then: registrations wait for the feed as it is now."""
        self._rejoin = True
        self.ready.clear()
        self._wake.set()

    async def run(self) -> None:
        """Tail forever, reconnecting with exponential back-off and jitter.

        Database errors are retried forever (the database comes back). Anything
        else is most likely a bug: it is logged with its traceback and retried a
        few times in a row, then the tailer gives up and raises, and the
        publisher reports itself failed (/readyz) rather than spin.
        """
        reconnecting = retrying(
            _RECONNECT,
            retry=self._retryable,
            rng=self._rng,
            before_sleep=self._on_retry,
            failures=lambda _: self._failures.count,
        )
        async for attempt in reconnecting:
            with attempt:
                await self._follow()

    def _retryable(self, state: RetryCallState) -> bool:
        # A failure to retry is counted here: tenacity asks this, then the wait (which
        # reads the count), then before_sleep.
        exc = state.outcome.exception() if state.outcome else None
        if exc is None:
            return False
        if isinstance(exc, DB_ERRORS):
            self._unexpected = 0
        else:
            self._unexpected += 1
            if self._unexpected > _UNEXPECTED_RETRIES:
                self.status = "failed"
                self.last_error = f"{type(exc).__name__}: {exc}"
                return False
            if not isinstance(exc, Exception):
                return False
        self._failures.failed(time.monotonic())
        return True

    def _on_retry(self, state: RetryCallState) -> None:
        exc = state.outcome.exception() if state.outcome else None
        now = time.monotonic()
        if self.failing_since is None:
            self.failing_since = now
        self.last_error = f"{type(exc).__name__}: {exc}"
        down_for = now - self.failing_since
        self.status = "unavailable" if down_for >= self._retry_budget else "reconnecting"
        self.reconnects_total += 1
        unexpected = not isinstance(exc, DB_ERRORS)
        level = logging.ERROR if self.status == "unavailable" or unexpected else logging.WARNING
        log_event(
            log,
            "tailer.reconnecting",
            level,
            # A database error is expected weather; anything else needs its traceback.
            exc=exc if unexpected else None,
            error=self.last_error,
            attempt=self._failures.count,
            down_for=round(down_for, 3),
            status=self.status,
        )

    async def _follow(self) -> None:
        # Not ready until this connection has joined the feed: registrations wait
        # (or are told to retry) rather than read a head that may be about to change.
        self.ready.clear()
        conn = await self._connect()
        try:
            if self._pacing is None:
                await conn.add_listener(self._channel, self.ring)
            first = self.position is None
            await self._join_feed(conn)
            if first:
                log_event(log, "tailer.started", position=str(self.position))
            elif self.status != "starting":
                log_event(
                    log,
                    "tailer.reconnected",
                    position=str(self.position),
                    after=round(time.monotonic() - (self.failing_since or 0), 3),
                )
            self.status = "running"
            self._failures.up(time.monotonic())
            self.failing_since = None
            self.last_error = None
            self.ready.set()
            conflicts = 0
            while True:
                if self._rejoin:
                    self.ready.clear()
                    while self._rejoin:  # asked again while joining: join again
                        await self._join_feed(conn)
                    self.ready.set()
                self._wake.clear()
                try:
                    await self._drain(conn)
                except FeedTrimmed as exc:
                    # Entries after the position were deleted before they were read
                    # (garbage collected with a max age shorter than this lag): join
                    # the feed again, which closes every listener with 4011 (they
                    # bootstrap) and starts from the head. Never a silent gap.
                    log_event(log, "tailer.trimmed", logging.ERROR, exc=exc, reason=str(exc))
                    self.ready.clear()
                    await self._join_feed(conn)
                    self.ready.set()
                    continue
                except asyncpg.SerializationError as exc:
                    # Replay cancelled the read (a standby's conflict with
                    # recovery): nothing was handed on; read again.
                    conflicts += 1
                    pause = _CONFLICT.delay(conflicts, self._rng)
                    self._replay_conflict(exc, pause)
                    await asyncio.sleep(pause)
                    continue
                conflicts = 0
                with contextlib.suppress(TimeoutError):
                    # asyncio.timeout, not wait_for: on 3.11 wait_for can swallow a
                    # cancellation that races the doorbell, and stop() then hangs.
                    async with asyncio.timeout(self._next_read()):
                        await self._wake.wait()
                self.polls_total += 1
        finally:
            with contextlib.suppress(Exception):
                async with asyncio.timeout(2.0):
                    await conn.close()
            if not conn.is_closed():
                conn.terminate()

    async def _join_feed(self, conn: asyncpg.Connection) -> None:
        """Where to read from on ``conn``: ``join``'s answer, or the head the first time."""
        self._rejoin = False
        if self._pacing is not None:
            self._pacing.forget()  # rings before this join say nothing about the feed now
        if self._join is not None:
            self.position, self.stamp = await self._join(conn, self.position, self.stamp)
        elif self.position is None:
            self.position = await self._reader.head(conn)

    def _next_read(self) -> float:
        """Seconds until the next read unless the doorbell rings first."""
        return self._poll_interval if self._pacing is None else self._pacing.delay()

    def _replay_conflict(self, exc: Exception, pause: float) -> None:
        self.replay_conflicts_total += 1
        log_event(
            log,
            "tailer.replay_conflict",
            logging.WARNING,
            error=f"{type(exc).__name__}: {exc}",
            retry_in=round(pause, 4),
            conflicts=self.replay_conflicts_total,
        )

    async def _read(self, conn: asyncpg.Connection, after: Position) -> list[FeedEntry]:
        if self._pacing is None:
            return await self._reader.read_after(conn, after, self._batch)
        entries, horizon = await self._reader.read_after_horizon(conn, after, self._batch)
        rest = self._pacing.read(horizon, bool(entries), time.monotonic())
        if rest is not None:
            event = "tailer.doorbell_rests" if rest else "tailer.doorbell_listens"
            log_event(log, event, logging.DEBUG)  # counted in stats: doorbell.rests
            if self.on_rest is not None:
                self.on_rest(rest)
        return entries

    async def _drain(self, conn: asyncpg.Connection) -> None:
        assert self.position is not None
        # A rejoin asked for is done before the next read: registrations wait for it.
        while not self._rejoin:
            read_from = time.monotonic()
            entries = await self._read(conn, self.position)
            self.last_read_at = time.monotonic()
            if not entries:
                self._unexpected = 0  # a round got through: whatever failed did not repeat
                self._entry_lag = 0.0
                return
            last = entries[-1]
            if log.isEnabledFor(logging.DEBUG):
                log_event(
                    log,
                    "tailer.read",
                    logging.DEBUG,
                    entries=len(entries),
                    first=list(entries[0].position),
                    last=list(last.position),
                    read_ms=round((self.last_read_at - read_from) * 1e3, 3),
                    ids=[e.changed_resource_id for e in entries[:_LOGGED_IDS]],
                )
            self._sink(entries)
            self._unexpected = 0
            self.position = last.position
            self.stamp = stamp_of(last.published)
            self.entries_total += len(entries)
            self.last_published = last.published
            self._entry_lag = max(0.0, (datetime.now(UTC) - last.published).total_seconds())
            if len(entries) < self._batch:
                return
            # A full batch: more is waiting (a burst, a catch-up). Reading and
            # encoding the next batch now would hold back the listeners that
            # this batch's flush has not reached yet, and fill every queue
            # faster than they are written out.
            if self._fanned_out is not None:
                waited_from = time.monotonic()
                await self._fanned_out()
                self.fanout_wait_seconds += time.monotonic() - waited_from

    @property
    def lag_seconds(self) -> float:
        """How far behind the feed the tailer is: the age of the newest entry it read
        (0 once a read finds nothing new), or on a standby, when longer, how long the
        oldest transaction the doorbell named has waited for the standby to replay
        it. A standby whose replay stalls delivers nothing, and shows here."""
        if self._pacing is None:
            return self._entry_lag
        return max(self._entry_lag, self._pacing.unreplayed_for(time.monotonic()))

    def stats(self) -> dict[str, Any]:
        """The tailer's live picture for /changefeeds/stats."""
        return {
            "status": self.status,
            "position": list(self.position) if self.position else None,
            "entries": self.entries_total,
            "lagSeconds": round(self.lag_seconds, 6),
            "fanoutWaitSeconds": round(self.fanout_wait_seconds, 6),
            "lastPublished": self.last_published.isoformat() if self.last_published else None,
            "doorbells": self.doorbells_total,
            "polls": self.polls_total,
            "reconnects": self.reconnects_total,
            "lastError": self.last_error,
            "replayWaits": self.replay_waits_total,
            "replayConflicts": self.replay_conflicts_total,
        }

    @property
    def replay_waits_total(self) -> int:
        """Reads made again because the standby had not replayed a rung transaction."""
        return 0 if self._pacing is None else self._pacing.replay_waits
