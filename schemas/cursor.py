"""Feed positions and the opaque cursors that carry them over the wire.

A position is ``(txid, id)``: the writer's transaction id (xid8) and the
entry's identity value. Feed order is the tuple order. A cursor carries:

* the feed it belongs to (the first 8 bytes of the feed's identity, made when
  the feed was created): a cursor of another feed is recognised as such,
  whatever key signed it;
* the position;
* a *stamp* of the entry at that position (the low 32 bits of its published
  time, in microseconds): a feed restored from a backup hands out the same
  ``(txid, id)`` again to other entries, and the stamp tells them apart;
* a keyed digest (BLAKE2b) with the feed's key, so that a garbage or edited
  cursor is refused instead of starting a delivery from an arbitrary place.

All base64url, unpadded. Pure code: no I/O.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import struct
from datetime import datetime
from typing import NamedTuple

from .errors import CursorError

__all__ = ["ORIGIN", "Cursor", "CursorCodec", "ForeignCursor", "Position", "stamp_of"]

_VERSION = b"\x02"
_BODY = struct.Struct(">8sQQI")
_DIGEST_SIZE = 8
_RAW = 1 + _BODY.size + _DIGEST_SIZE
_ENCODED_LENGTH = (_RAW * 4 + 2) // 3  # base64url, unpadded
_OLD_VERSIONS = {b"\x01": 34}
"""Versions this codec no longer issues, and their encoded lengths: cursors from
before feeds had an identity, answered as another feed's."""


class Position(NamedTuple):
    """A place in the feed; tuples compare in feed order."""

    txid: int
    id: int


ORIGIN = Position(0, 0)
"""Before every entry."""


def stamp_of(published: datetime) -> int:
    """The stamp of an entry published at ``published``."""
    return int(published.timestamp() * 1_000_000) & 0xFFFFFFFF


class Cursor(NamedTuple):
    """What a cursor says: a position in this feed, and the stamp of the entry there
    (0 for ORIGIN, before every entry)."""

    position: Position
    stamp: int


class ForeignCursor(CursorError):
    """A well-formed cursor of another feed (or of a feed before it had an identity)."""

    def __init__(self) -> None:
        super().__init__("cursor was issued by another feed")


class CursorCodec:
    """Encodes positions as cursors of one feed and back.

    Args:
        key: the digest key (the feed's, from the database; or configured).
        feed_id: the feed's identity (16 bytes; its first 8 go into cursors).
    """

    def __init__(self, key: bytes, feed_id: bytes) -> None:
        if len(feed_id) < 8:
            raise ValueError("a feed identity has at least 8 bytes")
        self._key = key
        self.feed_tag = feed_id[:8]

    def _digest(self, body: bytes) -> bytes:
        return hmac.digest(self._key, body, hashlib.blake2b)[:_DIGEST_SIZE]

    def encode(self, position: Position, stamp: int = 0) -> str:
        """Return the cursor string for ``position`` (the entry there has ``stamp``)."""
        body = _VERSION + _BODY.pack(self.feed_tag, position.txid, position.id, stamp)
        raw = body + self._digest(body)
        return base64.urlsafe_b64encode(raw).rstrip(b"=").decode("ascii")

    def decode(self, cursor: str) -> Cursor:
        """Return what ``cursor`` says.

        Raises:
            ForeignCursor: a cursor of another feed (not resumable here, but not garbage).
            CursorError: the cursor is malformed or was not issued with this feed's key.
        """
        if not isinstance(cursor, str):
            raise CursorError("cursor is not a string")
        raw = _decode_base64(cursor)
        if raw[:1] in _OLD_VERSIONS and len(cursor) == _OLD_VERSIONS[raw[:1]]:
            raise ForeignCursor()
        if len(cursor) != _ENCODED_LENGTH or len(raw) != _RAW:
            raise CursorError("cursor is not one this feed issued (wrong length)")
        if raw[:1] != _VERSION:
            raise CursorError("cursor is not one this feed issued (unknown version)")
        body, digest = raw[:-_DIGEST_SIZE], raw[-_DIGEST_SIZE:]
        tag, txid, entry_id, stamp = _BODY.unpack(body[1:])
        if tag != self.feed_tag:
            raise ForeignCursor()
        if not hmac.compare_digest(digest, self._digest(body)):
            raise CursorError("cursor is not one this feed issued (checksum mismatch)")
        return Cursor(Position(txid, entry_id), stamp)


def _decode_base64(cursor: str) -> bytes:
    try:
        raw = base64.urlsafe_b64decode(cursor + "==")
    except (binascii.Error, ValueError) as exc:
        raise CursorError("cursor is not one this feed issued (not base64url)") from exc
    if base64.urlsafe_b64encode(raw).rstrip(b"=").decode("ascii") != cursor:
        # The last character carries unused bits that decoding ignores: only the
        # one spelling a codec issues is accepted.
        raise CursorError("cursor is not one this feed issued (not canonical)")
    return raw
