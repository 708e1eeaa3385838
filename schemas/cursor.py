"""Feed positions and the opaque cursors that carry them over the wire.

A position is ``(txid, id)``: the writer's transaction id (xid8) and the
entry's identity value. Feed order is the tuple order. A cursor is the
position plus a short keyed digest, base64url-encoded, so that a garbage or
edited cursor is refused with a clear error instead of starting a replay from
an arbitrary place. The key is shared configuration (default: a constant), so
cursors stay valid across publisher instances of one feed.

Pure code: no I/O.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import struct
from typing import NamedTuple

from .errors import CursorError

__all__ = ["DEFAULT_CURSOR_KEY", "ORIGIN", "CursorCodec", "Position"]

DEFAULT_CURSOR_KEY = b"changefeed-cursor-v1"
_VERSION = b"\x01"
_BODY = struct.Struct(">QQ")
_DIGEST_SIZE = 8
_ENCODED_LENGTH = 34  # base64url of 1 + 16 + 8 bytes, unpadded


class Position(NamedTuple):
    """A place in the feed; tuples compare in feed order."""

    txid: int
    id: int


ORIGIN = Position(0, 0)
"""Before every entry."""


class CursorCodec:
    """Encodes positions as tamper-checked cursors and back.

    Args:
        key: digest key; every publisher of one feed must use the same one.
    """

    def __init__(self, key: bytes = DEFAULT_CURSOR_KEY) -> None:
        self._key = key

    def _digest(self, body: bytes) -> bytes:
        return hmac.digest(self._key, body, hashlib.blake2b)[:_DIGEST_SIZE]

    def encode(self, position: Position) -> str:
        """Return the cursor string for ``position``."""
        body = _VERSION + _BODY.pack(position.txid, position.id)
        raw = body + self._digest(body)
        return base64.urlsafe_b64encode(raw).rstrip(b"=").decode("ascii")

    def decode(self, cursor: str) -> Position:
        """Return the position in ``cursor``.

        Raises:
            CursorError: the cursor is malformed or was not issued with this key.
        """
        if not isinstance(cursor, str) or len(cursor) != _ENCODED_LENGTH:
            raise CursorError("cursor is not one this feed issued (wrong length)")
        try:
            raw = base64.urlsafe_b64decode(cursor + "==")
        except (binascii.Error, ValueError) as exc:
            raise CursorError("cursor is not one this feed issued (not base64url)") from exc
        if base64.urlsafe_b64encode(raw).rstrip(b"=").decode("ascii") != cursor:
            # The last character carries 4 unused bits that decoding ignores:
            # only the one spelling this codec issues is accepted.
            raise CursorError("cursor is not one this feed issued (not canonical)")
        body, digest = raw[:-_DIGEST_SIZE], raw[-_DIGEST_SIZE:]
        if body[:1] != _VERSION:
            raise CursorError("cursor is not one this feed issued (unknown version)")
        if not hmac.compare_digest(digest, self._digest(body)):
            raise CursorError("cursor is not one this feed issued (checksum mismatch)")
        txid, entry_id = _BODY.unpack(body[1:])
        return Position(txid, entry_id)
