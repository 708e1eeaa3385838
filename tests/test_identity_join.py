"""``join_feed`` on a standby that is behind: what it shows is believed only once it has
caught up with the primary.

The publisher already follows the feed's new identity (a restore, or a failover
that lost commits) when its tailer joins again through a standby that has not
replayed it yet (it restarted, or the address now leads to another standby,
behind the first). That standby shows the old identity: believed at once, the
publisher would go back to it, close every listener with 4011 and sign cursors
no other publisher accepts. The parts here stand in for the database (the
replay position, the feed's facts); the decision is ``join_feed``'s own.
"""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import pytest

from changefeed.publisher.feed import FeedState, ReplicaBehind, ResumeFacts
from changefeed.publisher.identity import FeedIdentity, join_feed
from changefeed.publisher.pages import FeedPages
from changefeed.publisher.window import Window
from changefeed.schemas import ORIGIN, Position

OLD, NEW = uuid.uuid4(), uuid.uuid4()
AT = Position(100, 5)


def state(feed_id: uuid.UUID) -> FeedState:
    return FeedState(feed_id, b"k" * 32, ORIGIN, ORIGIN)


class LaggingStandby:
    """A standby's connection and the feed as it shows it: the old identity until it
    has replayed ``replays_after`` more looks' worth (never, with None)."""

    def __init__(self, replays_after: int | None) -> None:
        self.replays_after = replays_after
        self.looks = 0
        self.wait = 0.5  # Standby.wait: seconds a catch-up is awaited

    async def fetchval(self, query: str, *args: Any) -> bool:  # the replay position
        self.looks += 1
        return self.replays_after is not None and self.looks > self.replays_after

    async def primary_position(self) -> str:
        return "0/3000000"

    async def resume_facts(self, conn: Any, position: Position) -> ResumeFacts:
        caught_up = self.replays_after is not None and self.looks > self.replays_after
        shown = NEW if caught_up else OLD
        return ResumeFacts(
            state(shown), newest=position, next_txid=position.txid + 10, stamp=7, in_recovery=True
        )

    async def head_entry(self, conn: Any) -> tuple[Position, int]:
        return Position(90, 1), 3


async def join(standby: LaggingStandby, identity: FeedIdentity, changed: list[str]) -> Any:
    window = Window(AT, 1 << 20, lambda e: e.changed_resource_id)

    async def no_pages(*args: Any) -> Any:
        raise AssertionError("no page is read")

    pages = FeedPages(no_pages, lambda e: e.changed_resource_id, page_size=10, max_bytes=1 << 20)
    return await join_feed(
        standby,  # type: ignore[arg-type]
        AT,
        7,
        reader=standby,  # type: ignore[arg-type]
        identity=identity,
        window=window,
        pages=pages,
        feed_changed=changed.append,
        resume_all=changed.append,
        standby=standby,  # type: ignore[arg-type]
    )


def test_an_old_identity_on_a_standby_behind_is_waited_out_not_adopted() -> None:
    identity = FeedIdentity()
    identity.adopt(state(NEW))
    changed: list[str] = []
    standby = LaggingStandby(replays_after=2)
    assert asyncio.run(join(standby, identity, changed)) == (AT, 7)
    assert identity.feed_id == NEW and changed == []  # nobody closed, nothing signed with OLD
    assert standby.looks > 2  # it waited for the replay


def test_a_standby_that_does_not_catch_up_is_a_join_to_try_again() -> None:
    identity = FeedIdentity()
    identity.adopt(state(NEW))
    changed: list[str] = []
    with pytest.raises(ReplicaBehind):
        asyncio.run(join(LaggingStandby(replays_after=None), identity, changed))
    assert identity.feed_id == NEW and changed == []
