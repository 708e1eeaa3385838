"""A publisher that reads its feed from a hot standby: the primary beside it, and replay.

With ``read_dsn``, a publisher's feed reads (tailing, catch-up pages, resume
checks) go to a standby, and only what must be on the primary goes there:
the doorbell (``doorbell``), giving the feed a new identity, the oldest
writer's age, and, when a standby's answer may just be late, the primary's
WAL position. A standby's answer is late when it has not yet replayed
something another publisher (on the primary, or on a standby further ahead)
already read: a cursor that publisher issued names an entry this standby
does not hold yet. So before a standby's "no" is believed, the standby is
made to catch up with the primary as it is now: this publisher asks the
primary's WAL insert position (one cheap query, shared by everyone who asks
at the same time; no feed table is read) and waits, bounded, until the
standby has replayed that far (``pg_last_wal_replay_lsn``, polled on the
standby only). Anything a cursor names was committed before it was issued,
so below that position. PostgreSQL 19's ``WAIT FOR LSN`` would replace the
polling.

LSNs are compared in SQL (``pg_lsn``); the target a standby must reach is
``changefeed.wal``'s.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections.abc import AsyncIterator, Callable

import asyncpg

from changefeed.backoff import Backoff
from changefeed.logs import log_event
from changefeed.schemas import PgConnection
from changefeed.wal import insert_target

from .rounds import Rounds

__all__ = ["Standby", "wait_replayed"]

log = logging.getLogger(__name__)

_POLL = Backoff(initial=0.002, maximum=0.05, jitter=0.0)
"""Waits between two looks at a standby's replay (changefeed.backoff's policy,
without jitter: one client asking one server): 2 ms doubling to 50 ms."""
_NO_JITTER = random.Random()
"""The random source ``_POLL`` is handed: a policy without jitter draws nothing from it."""


async def wait_replayed(conn: PgConnection, target: str, within: float) -> bool:
    """Wait until ``conn``'s server has replayed WAL up to ``target`` (or is not in
    recovery: a primary, or a promoted standby, has everything it will ever have).

    Polls the server, from every few milliseconds to every 50 ms. Each look is a
    statement of its own, so a statement after this one sees everything replayed.

    Returns:
        False when it had not within ``within`` seconds.
    """
    deadline = time.monotonic() + within
    looks = 0
    while True:
        replayed = await conn.fetchval(
            "SELECT NOT pg_is_in_recovery() OR pg_last_wal_replay_lsn() >= $1::text::pg_lsn", target
        )
        if replayed:
            return True
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        looks += 1
        await asyncio.sleep(min(_POLL.delay(looks, _NO_JITTER), left))


class Standby:
    """The primary of a publisher that reads a standby.

    Args:
        primary: the pool of the primary (the publisher's ``dsn``), once started.
        wait: seconds a standby's answer may be awaited while it catches up
            (``standby_wait``).
        timeout: seconds allowed to get a primary connection, and again for a query.
    """

    def __init__(
        self, primary: Callable[[], asyncpg.Pool], *, wait: float, timeout: float = 5.0
    ) -> None:
        self._primary = primary
        self.wait = wait
        self._timeout = timeout
        self._rounds: Rounds[None, str] = Rounds()
        self.positions_asked = 0
        """Times the primary was asked its WAL position."""

    @contextlib.asynccontextmanager
    async def primary(self) -> AsyncIterator[PgConnection]:
        """A connection to the primary, for what must be done there."""
        async with self._primary().acquire(timeout=self._timeout) as conn:
            yield conn

    async def primary_position(self) -> str:
        """A replay target (``changefeed.wal.insert_target``) covering every transaction the primary
        had committed when this call was made.

        Callers at the same time share one query: a query already under way may
        have been sent before a caller's cursor was issued, so latecomers share
        the next one, sent as soon as it ends (``rounds``).

        Raises:
            the database's errors (``feed.DB_ERRORS``), and TimeoutError.
        """
        return await self._rounds.ask(None, self._ask)

    async def _ask(self) -> str:
        self.positions_asked += 1
        async with self.primary() as conn:
            async with asyncio.timeout(self._timeout):
                target = await insert_target(conn)
        log_event(log, "standby.primary_position", logging.DEBUG, target=target)
        return target
