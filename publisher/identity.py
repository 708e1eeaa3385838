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

import uuid

from changefeed.schemas import CursorCodec

from .feed import FeedState

__all__ = ["FeedIdentity"]


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
