"""The feed's facts about resume cursors, asked once for every registration that asks
about the same position at the same time, and from a standby, believed only once
it has caught up.

Listeners that reconnect together, after an outage or a failover, mostly resume
from the same few cursors: a thousand of them cost a few queries, not a
thousand. A registration never takes facts read before it came (``rounds``):
a query already under way may predate what the listener has seen elsewhere,
a compaction's announcement among them. Each query is bounded, since an
embedding API's pool may have no statement timeout.

A publisher that reads a standby (``standby``) asks it, not the primary. A
standby's "this feed holds no such entry" may only mean it has not replayed
that entry yet: a fresher publisher issued the cursor. Before answering
``resumed: false`` the standby is made to catch up with the primary as it is
now (``Standby.primary_position``), for at most ``standby_wait``; then its
answer stands, or, if it is still behind, the listener is told to retry
(``StandbyBehind``: 4010 with ``retryAfter``). A read the standby cancelled
for a conflict with replay is asked again; while the standby cannot be asked
at all (it is restarting), the primary is.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
import uuid
from collections.abc import Awaitable, Callable

import asyncpg

from changefeed.logs import log_event
from changefeed.schemas import Cursor, PgConnection, Position

from .feed import DB_ERRORS, FeedReader, ResumeFacts
from .registration import LATE_REASONS, plan_resume
from .rounds import Rounds
from .standby import Standby, wait_replayed

__all__ = ["ResumeQueries", "StandbyBehind"]

log = logging.getLogger(__name__)

_CONFLICT_RETRIES = 3
"""Times a query replay cancelled (SQLSTATE 40001) is asked again."""


class StandbyBehind(Exception):
    """The standby had not caught up with a cursor within ``standby_wait``."""


class ResumeQueries:
    """Asks the feed about resume positions, one query per position in flight.

    Args:
        reader: the feed's queries.
        pool: the pool of the server the publisher reads (its standby, or the
            primary), once started.
        timeout: seconds allowed to get a connection, and again for the query.
        standby: the primary beside the standby, when ``pool`` is a standby's.
        on_facts: told every answer ``plan`` uses, before it decides.
    """

    def __init__(
        self,
        reader: FeedReader,
        pool: Callable[[], asyncpg.Pool],
        timeout: float,
        *,
        standby: Standby | None = None,
        on_facts: Callable[[ResumeFacts], None] | None = None,
    ) -> None:
        self._reader = reader
        self._on_facts = on_facts
        self._pool = pool
        self._timeout = timeout
        self._standby = standby
        self._rounds: Rounds[Position, ResumeFacts] = Rounds()
        self._replayed: Rounds[tuple[Position, str], ResumeFacts | None] = Rounds()
        self._replays: Rounds[str, bool] = Rounds()
        self.confirmed_total = 0
        """Answers of a standby checked again once it had caught up with the primary."""

    async def plan(
        self, cursor: Cursor, *, feed_id: uuid.UUID, head: Position, replay_limit: int
    ) -> tuple[bool, str | None]:
        """Whether a registration with ``cursor`` resumes, and if not why
        (``registration.plan_resume`` on the feed's facts, from a standby only once
        they may be believed).

        Raises:
            StandbyBehind: the standby did not catch up within ``standby_wait``.
            the database's errors (``feed.DB_ERRORS``), and TimeoutError.
        """
        facts = await self.facts(cursor.position)
        self._told(facts)
        resumed, reason = plan_resume(
            cursor, facts, feed_id=feed_id, head=head, replay_limit=replay_limit
        )
        late = reason in LATE_REASONS and facts.in_recovery
        if resumed or not late or self._standby is None:
            return resumed, reason
        caught_up = await self.caught_up(cursor.position)
        return plan_resume(cursor, caught_up, feed_id=feed_id, head=head, replay_limit=replay_limit)

    async def caught_up(self, position: Position) -> ResumeFacts:
        """The facts about ``position`` from the standby once it has replayed what the
        primary holds now: what a standby says against a fresher publisher's cursor,
        believed (also told to ``on_facts``).

        Raises:
            StandbyBehind: the standby did not catch up within ``standby_wait``.
            the database's errors (``feed.DB_ERRORS``), and TimeoutError.
        """
        assert self._standby is not None
        self.confirmed_total += 1
        target = await self._standby.primary_position()
        # Joining a query under way is safe here, unlike in ``facts``: its answer is
        # read once the standby has replayed ``target``, which this caller's own
        # ``primary_position`` gave (a round that began after it came), so it
        # covers everything committed before the caller came.
        caught_up = await self._replayed.ask(
            (position, target),
            functools.partial(self._replayed_facts, position, target),
            join_running=True,
        )
        if caught_up is None:
            log_event(
                log,
                "resume.standby_behind",
                logging.WARNING,
                position=str(position),
                target=target,
                waited=self._standby.wait,
            )
            raise StandbyBehind(
                f"this publisher's standby has not caught up with the cursor within "
                f"{self._standby.wait:g}s; retry"
            )
        self._told(caught_up)
        return caught_up

    @property
    def on_standby(self) -> bool:
        """Whether the answers come from a standby (``read_dsn``)."""
        return self._standby is not None

    def _told(self, facts: ResumeFacts) -> None:
        if self._on_facts is not None:
            self._on_facts(facts)

    async def facts(self, position: Position) -> ResumeFacts:
        """The feed's facts about ``position`` (shared with whoever asks meanwhile).

        Raises:
            the database's errors (``feed.DB_ERRORS``), and TimeoutError.
        """
        return await self._rounds.ask(position, functools.partial(self._facts, position))

    async def _facts(self, position: Position) -> ResumeFacts:
        try:
            return await self._retried(lambda: self._ask(self._pool(), position))
        except DB_ERRORS as exc:
            if self._standby is None:
                raise
            # The standby cannot be asked (restarting, unreachable): the primary
            # holds everything it holds, and its answer stands (not in recovery).
            log_event(log, "resume.asking_primary", logging.WARNING, exc=exc)
            return await self._retried(lambda: self._ask_primary(position))

    async def _replayed_facts(self, position: Position, target: str) -> ResumeFacts | None:
        """The standby's facts once it has replayed ``target``; None if it has not
        within the wait.

        The wait is one per target, on one pooled connection, however many cursors
        wait for it: a burst of resumes from a fresher publisher must not hold
        every connection of the read pool (and send the others' reads to the
        primary). Each cursor's facts are then read on a connection that has
        replayed the target itself (at once, unless the address leads to several
        standbys and this one is further behind: it is waited for in what is
        left of the wait)."""
        assert self._standby is not None
        wait = self._standby.wait
        deadline = time.monotonic() + wait
        replayed = await self._replays.ask(
            target, functools.partial(self._wait_for, target, wait), join_running=True
        )
        if not replayed:
            return None
        async with self._pool().acquire(timeout=self._timeout) as conn:
            if not await wait_replayed(conn, target, max(0.0, deadline - time.monotonic())):
                return None
            return await self._retried(lambda: self._on(conn, position))

    async def _wait_for(self, target: str, wait: float) -> bool:
        async with self._pool().acquire(timeout=self._timeout) as conn:
            return await wait_replayed(conn, target, wait)

    async def _retried(self, ask: Callable[[], Awaitable[ResumeFacts]]) -> ResumeFacts:
        for attempt in range(_CONFLICT_RETRIES + 1):
            try:
                return await ask()
            except asyncpg.SerializationError as exc:
                # Replay cancelled the query (a conflict with recovery): ask again.
                if attempt == _CONFLICT_RETRIES:
                    raise
                log_event(log, "resume.replay_conflict", logging.WARNING, error=str(exc))
        raise AssertionError("unreachable")

    async def _ask(self, pool: asyncpg.Pool, position: Position) -> ResumeFacts:
        async with pool.acquire(timeout=self._timeout) as conn:
            return await self._on(conn, position)

    async def _on(self, conn: PgConnection, position: Position) -> ResumeFacts:
        async with asyncio.timeout(self._timeout):
            return await self._reader.resume_facts(conn, position)

    async def _ask_primary(self, position: Position) -> ResumeFacts:
        assert self._standby is not None
        async with self._standby.primary() as conn:
            return await self._on(conn, position)
