"""Which feed a publisher serves, and how its cursors are signed.

Both come from the feed itself (``feed_state``, schema migration 5), read
each time the tailer connects: the identity made when the feed was created,
and the key cursors are signed with, made with it and kept only in the
database. Every instance of one feed therefore issues and accepts the same
cursors with no shared secret in any configuration file, and no two feeds
accept each other's. An operator may configure a key instead
(``cursor_key``); the identity always comes from the feed. The key of the
bootstrap routes' page tokens is derived from the same key (``page_token_key``),
so that every instance accepts the others' tokens too.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import uuid
from collections.abc import Callable

from changefeed.logs import log_event
from changefeed.schemas import Cursor, CursorCodec, PgConnection, Position

from .feed import FeedReader, FeedState, ReplicaBehind, ResumeFacts
from .pages import FeedPages
from .registration import LATE_REASONS, plan_resume
from .standby import Standby, wait_replayed
from .window import Window

__all__ = ["PAGE_TOKEN_LABEL", "FeedIdentity", "join_feed"]

PAGE_TOKEN_LABEL = b"changefeed page tokens v1"
"""What the page tokens' key is derived for (HMAC-SHA-256 of it under the cursor
key): knowing one of the two keys tells nothing of the other."""

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
        self.page_token_key: bytes | None = None
        """The key of the bootstrap routes' page tokens (None until ``adopt``)."""
        self.generation = 0
        """Grows each time the identity changes: a registration decided across a
        change is decided again."""

    @property
    def codec(self) -> CursorCodec:
        """The cursor codec (only once ``adopt`` has run: the tailer is ready)."""
        assert self._codec is not None, "the feed's identity is not known yet"
        return self._codec

    def adopt(self, state: FeedState) -> bool:
        """Take the feed's identity and key; True when the identity changed."""
        changed = self.feed_id is not None and self.feed_id != state.feed_id
        if changed:
            self.generation += 1
        self.feed_id = state.feed_id
        key = self._configured_key or state.cursor_key
        self._codec = CursorCodec(key, state.feed_id.bytes)
        self.page_token_key = hmac.new(key, PAGE_TOKEN_LABEL, hashlib.sha256).digest()
        return changed


async def join_feed(
    conn: PgConnection,
    position: Position | None,
    stamp: int,
    *,
    reader: FeedReader,
    identity: FeedIdentity,
    window: Window,
    pages: FeedPages,
    feed_changed: Callable[[str], None],
    resume_all: Callable[[str], None],
    standby: Standby | None = None,
) -> tuple[Position, int]:
    """The tailer's ``join``, each time it connects (registrations wait meanwhile):
    take the feed's identity and cursor key, and check that the feed still holds
    the tailer's position, all from one snapshot.

    A feed restored from a backup, or a standby promoted without the primary's
    last commits (its transaction and entry ids went back), or one trimmed past
    the position while the tailer was away, cannot be followed from there: the
    feed gets a new identity (restored; whichever publisher notices first), the
    window and the kept pages are let go, every listener is closed
    (``feed_changed``: 4011, they bootstrap), and the tailer starts again from
    the head. A publisher that finds the identity changed by another (its join
    was asked for by a registration that saw it: ``Tailer.rejoin``) does the
    same without giving another one.

    A window ahead of the tailer (its last batch failed to reach the listeners, a
    bug) is let go too, and every listener is told to resume (``resume_all``:
    4010), so that none keeps a gap.

    On a standby (``standby``), a position the standby does not hold, or an
    identity other than the one this publisher follows, may only mean it has
    not replayed them yet (it restarted, or the address now leads to another
    standby, behind the one read before): either is believed only once the
    standby has caught up with the primary, and a new identity is given on the
    primary, then awaited on the standby.

    Returns:
        the position to read after, and its entry's stamp.

    Raises:
        ReplicaBehind: the standby did not catch up within ``standby_wait`` (the
            tailer joins again).
    """
    if position is None:
        identity.adopt(await reader.state(conn))
        return await _start_at_head(conn, reader, window, pages)
    known = identity.feed_id
    assert known is not None
    cursor = Cursor(position, stamp)
    facts = await reader.resume_facts(conn, position)
    resumed, reason = plan_resume(cursor, facts, feed_id=known, head=position, replay_limit=1 << 62)
    if reason in LATE_REASONS and standby is not None and facts.in_recovery:
        # (``other_feed`` too: a standby behind, or another one behind the same
        # address, may show an identity this publisher has already moved past.)
        facts = await _caught_up(conn, position, reader, standby)
        resumed, reason = plan_resume(
            cursor, facts, feed_id=known, head=position, replay_limit=1 << 62
        )
    if resumed:
        identity.adopt(facts.state)
        if window.head != position:
            window.reset(position, stamp)
            pages.reset()
            log_event(log, "fanout.recovered", logging.ERROR, position=str(position))
            resume_all("the publisher recovered from an internal error; resume")
        return position, stamp
    state = facts.state
    # A new identity only from the first publisher to notice: one that finds the
    # identity already changed takes it as it is.
    if reason in ("cursor_ahead", "unknown_position") and state.feed_id == known:
        if standby is None or not facts.in_recovery:
            state = await reader.rotate_identity(conn, state.feed_id)
        else:
            async with standby.primary() as primary:
                await reader.rotate_identity(primary, state.feed_id)
            state = (await _caught_up(conn, position, reader, standby)).state
    head, head_stamp = await reader.head_entry(conn)
    # From here on no await: the new identity, window and pages are in place
    # before any listener hears of the change.
    identity.adopt(state)
    window.reset(head, head_stamp)
    pages.reset()
    log_event(
        log,
        "feed.rewound",
        logging.CRITICAL,
        reason=reason,
        position=str(position),
        feed_id=str(state.feed_id),
    )
    feed_changed(f"the feed changed under this publisher ({reason})")
    return head, head_stamp


async def _caught_up(
    conn: PgConnection, position: Position, reader: FeedReader, standby: Standby
) -> ResumeFacts:
    """The facts about ``position`` once ``conn``'s standby has replayed everything the
    primary had written when asked."""
    target = await standby.primary_position()
    if not await wait_replayed(conn, target, standby.wait):
        raise ReplicaBehind(f"the standby has not replayed the primary's {target} yet")
    return await reader.resume_facts(conn, position)


async def _start_at_head(
    conn: PgConnection, reader: FeedReader, window: Window, pages: FeedPages
) -> tuple[Position, int]:
    head, head_stamp = await reader.head_entry(conn)
    window.reset(head, head_stamp)
    pages.reset()
    return head, head_stamp
