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

LSNs are compared in SQL (``pg_lsn``); the few pure steps are here as
functions.
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

from .rounds import Rounds

__all__ = ["Standby", "format_lsn", "parse_lsn", "replay_target", "wait_replayed"]

log = logging.getLogger(__name__)

_LONG_PAGE_HEADER = 40
"""Bytes of the longest WAL page header (a segment's first page; others have 24)."""
_POLL = Backoff(initial=0.002, maximum=0.05, jitter=0.0)
"""Waits between two looks at a standby's replay (changefeed.backoff's policy,
without jitter: one client asking one server): 2 ms doubling to 50 ms."""
_NO_JITTER = random.Random()
"""Seconds between two looks at a standby's replay position, growing from the first."""


def parse_lsn(text: str) -> int:
    """A WAL position from PostgreSQL's ``X/Y`` notation."""
    high, _, low = text.partition("/")
    return (int(high, 16) << 32) | int(low, 16)


def format_lsn(lsn: int) -> str:
    """A WAL position in PostgreSQL's ``X/Y`` notation."""
    return f"{lsn >> 32:X}/{lsn & 0xFFFFFFFF:X}"


def replay_target(insert_lsn: int, block_size: int) -> int:
    """The replay position a standby must reach to have every record inserted before
    ``insert_lsn`` (``pg_current_wal_insert_lsn()``).

    A standby reports the end of the last record it replayed. The insert position
    right after a record that filled its WAL page to the end is past the next
    page's header instead, where no record ends: a standby that has replayed
    everything would wait for it until some other record is written. No record
    ends inside a page header, so the page's start is the same target.
    """
    offset = insert_lsn % block_size
    return insert_lsn - offset if offset <= _LONG_PAGE_HEADER else insert_lsn


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
        """A replay target (``replay_target``) covering every transaction the primary
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
                row = await conn.fetchrow(
                    "SELECT pg_current_wal_insert_lsn()::text AS lsn,"
                    " current_setting('wal_block_size')::int AS block"
                )
        assert row is not None
        target = format_lsn(replay_target(parse_lsn(row["lsn"]), row["block"]))
        log_event(log, "standby.primary_position", logging.DEBUG, target=target)
        return target
