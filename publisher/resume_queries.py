"""The feed's facts about resume cursors, asked once for every registration that asks
about the same position at the same time.

Listeners that reconnect together, after an outage or a failover, mostly resume
from the same few cursors: a thousand of them cost a few queries, not a
thousand. Each query is bounded, since an embedding API's pool may have no
statement timeout.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import asyncpg

from changefeed.schemas import Position

from .feed import FeedReader, ResumeFacts

__all__ = ["ResumeQueries"]


class ResumeQueries:
    """Asks the feed about resume positions, one query per position in flight.

    Args:
        reader: the feed's queries.
        pool: the publisher's pool, once started.
        timeout: seconds allowed to get a connection, and again for the query.
    """

    def __init__(
        self, reader: FeedReader, pool: Callable[[], asyncpg.Pool], timeout: float
    ) -> None:
        self._reader = reader
        self._pool = pool
        self._timeout = timeout
        self._asking: dict[Position, asyncio.Future[ResumeFacts]] = {}

    async def facts(self, position: Position) -> ResumeFacts:
        """The feed's facts about ``position`` (shared with whoever asks meanwhile).

        Raises:
            the database's errors (``feed.DB_ERRORS``), and TimeoutError.
        """
        asked = self._asking.get(position)
        if asked is None:
            asked = self._asking[position] = asyncio.ensure_future(self._ask(position))
            asked.add_done_callback(self._asked)
        # Shielded: one registration that gives up does not cancel the others' answer.
        return await asyncio.shield(asked)

    def _asked(self, asked: asyncio.Future[ResumeFacts]) -> None:
        for position, future in list(self._asking.items()):
            if future is asked:
                del self._asking[position]
        if not asked.cancelled():
            asked.exception()  # retrieved: every registration that asked has it too

    async def _ask(self, position: Position) -> ResumeFacts:
        async with self._pool().acquire(timeout=self._timeout) as conn:
            async with asyncio.timeout(self._timeout):
                return await self._reader.resume_facts(conn, position)
