"""Which feed a publisher serves, and how its cursors are signed.

Both come from the feed itself (``feed_state``, schema migration 5), read
each time the tailer connects: the identity made when the feed was created,
and the key cursors are signed with, made with it and kept only in the
database. Every instance of one feed therefore issues and accepts the same
cursors with no shared secret in any configuration file, and no two feeds
accept each other's. An operator may configure a key instead
(``cursor_key``); the identity always comes from the feed.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable

from changefeed.logs import log_event
from changefeed.schemas import Cursor, CursorCodec, PgConnection, Position

from .feed import FeedReader, FeedState
from .registration import plan_resume
from .window import Window

__all__ = ["FeedIdentity", "join_feed"]

log = logging.getLogger(__name__)


class FeedIdentity:
    """The feed's identity and cursor codec, once the tailer has read them.

    Args:
        configured_key: a cursor key from configuration, used instead of the feed's.
    """

    def __init__(self, configured_key: bytes | None = None) -> None:
        self._configured_key = configured_key
        self.feed_id: uuid.UUID | None = None
        self._codec: CursorCodec | None = None

    @property
    def codec(self) -> CursorCodec:
        """The cursor codec (only once ``adopt`` has run: the tailer is ready)."""
        assert self._codec is not None, "the feed's identity is not known yet"
        return self._codec

    def adopt(self, state: FeedState) -> bool:
        """Take the feed's identity and key; True when the identity changed."""
        changed = self.feed_id is not None and self.feed_id != state.feed_id
        self.feed_id = state.feed_id
        self._codec = CursorCodec(self._configured_key or state.cursor_key, state.feed_id.bytes)
        return changed


async def join_feed(
    conn: PgConnection,
    position: Position | None,
    *,
    reader: FeedReader,
    identity: FeedIdentity,
    window: Window,
    feed_changed: Callable[[str], None],
) -> Position:
    """The tailer's ``join``, each time it connects: take the feed's identity and
    cursor key, and check that the feed still holds the tailer's position.

    A feed restored from a backup (its transaction and entry ids went back), or
    trimmed past the position while the tailer was away, cannot be followed from
    there: the feed gets a new identity (restored; whichever publisher notices
    first), every listener is closed (``feed_changed``: 4011, they bootstrap),
    and the tailer starts again from the head.

    Returns:
        the position to read after.
    """
    state = await reader.state(conn)
    changed = identity.adopt(state)
    if position is not None:
        facts = await reader.resume_facts(conn, position)
        resumed, reason = plan_resume(
            Cursor(position, window.head_stamp),
            facts,
            feed_id=state.feed_id,
            head=position,
            replay_limit=1 << 62,
        )
        if changed:
            reason = "other_feed"  # another publisher found it restored first
        elif not resumed and reason in ("cursor_ahead", "unknown_position"):
            identity.adopt(await reader.rotate_identity(conn, state.feed_id))
        if changed or not resumed:
            log_event(
                log,
                "feed.rewound",
                logging.CRITICAL,
                reason=reason,
                position=str(position),
                feed_id=str(identity.feed_id),
            )
            feed_changed(f"the feed changed under this publisher ({reason})")
            position = None
    if position is None:
        position, stamp = await reader.head_entry(conn)
        window.reset(position, stamp)
    return position
