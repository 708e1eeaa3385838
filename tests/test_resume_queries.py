"""How a publisher on a standby confirms resume cursors from a fresher publisher: the
standby's answer is believed once it has replayed what the primary held, and a
burst of such cursors waits for that replay once, not once per cursor.

The parts here stand in for the database (the standby's replay, the feed's facts,
the read pool): what is checked is how many pooled connections the waits hold.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator
from typing import Any

from helpers import wait_until

from changefeed.publisher.feed import FeedState, ResumeFacts
from changefeed.publisher.resume_queries import ResumeQueries
from changefeed.schemas import ORIGIN, Position

FEED = uuid.uuid4()


class Standby:
    """The standby (replays once ``replayed`` is set), its primary, and the read pool."""

    def __init__(self) -> None:
        self.wait = 5.0  # Standby.wait
        self.replayed = asyncio.Event()
        self.held = 0
        self.most_held_while_behind = 0
        self.looks = 0

    async def primary_position(self) -> str:
        return "0/3000000"

    # the pool
    @contextlib.asynccontextmanager
    async def acquire(self, timeout: float) -> AsyncIterator[Standby]:
        self.held += 1
        if not self.replayed.is_set():
            self.most_held_while_behind = max(self.most_held_while_behind, self.held)
        try:
            yield self
        finally:
            self.held -= 1

    # a connection
    async def fetchval(self, query: str, *args: Any) -> bool:
        self.looks += 1  # at the replay position
        return self.replayed.is_set()

    # the feed reader
    async def resume_facts(self, conn: Any, position: Position) -> ResumeFacts:
        state = FeedState(FEED, b"k" * 32, ORIGIN, ORIGIN)
        return ResumeFacts(state, newest=position, next_txid=position.txid + 1, stamp=1)


async def test_a_burst_of_fresher_cursors_waits_for_the_replay_on_one_connection() -> None:
    standby = Standby()
    queries = ResumeQueries(
        standby,  # type: ignore[arg-type]
        lambda: standby,  # type: ignore[arg-type,return-value]
        5.0,
        standby=standby,  # type: ignore[arg-type]
    )
    cursors = [Position(100 + n, n) for n in range(20)]
    asked = [asyncio.create_task(queries.caught_up(position)) for position in cursors]
    await wait_until(lambda: standby.looks >= 10, 5, message="the replay is waited for")
    assert not any(task.done() for task in asked)
    standby.replayed.set()
    answers = await asyncio.wait_for(asyncio.gather(*asked), 5)
    assert [a.newest for a in answers] == cursors
    # One connection waited; the other connections of the read pool stayed free for
    # everyone else's reads (each cursor used to hold one for the whole wait).
    assert standby.most_held_while_behind == 1
