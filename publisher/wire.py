"""Serialised websocket frames for the fan-out's direct path. Pure code.

Through ASGI, every frame to every listener is a coroutine call that builds a
message dict, passes the middleware's wrappers, and has the server serialise
the frame again for each connection. But a fan-out sends the *same* frames to
many listeners, and server frames are not masked: the bytes on the wire are
identical for all of them. ``FrameCache`` serialises each payload once, and a
server that offers the ``DIRECT_WRITES`` scope extension (a ``FrameWriter``
per connection, see ``changefeed.serving``) takes those bytes synchronously.
Without the extension the publisher sends through ASGI, which works on any
server, at more CPU per frame.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from websockets.frames import Frame, Opcode

__all__ = [
    "DIRECT_WRITES",
    "FRAME_TOO_LARGE",
    "KEEPALIVE_TIMEOUT",
    "FrameCache",
    "FrameWriter",
    "batch_text",
]

DIRECT_WRITES = "changefeed.direct_writes"
"""ASGI scope extension: the connection's ``FrameWriter``."""

FRAME_TOO_LARGE = "frame_too_large"
"""Error code of a frame over a size limit, and the close reason of its 4006. A
server that refuses such a frame itself (changefeed.serving, over ``ws_max_size``)
has sent the error frame and the close, and tells the app with a disconnect
carrying that code and reason."""

KEEPALIVE_TIMEOUT = "keepalive ping timeout"
"""Close reason (with 1011) of a connection whose peer stopped answering pings, in
the disconnect a server that tells its app why (changefeed.serving) sends."""


class FrameWriter(Protocol):
    """Writes serialised frames to one websocket connection, without awaiting."""

    @property
    def open(self) -> bool:
        """True while a write goes out now: the connection is open and its
        transport is not paused (a paused one is left to ASGI sends, which wait)."""

    def write(self, data: bytes) -> None:
        """Write ``data`` (whole frames); only when ``open``."""


def batch_text(items: Sequence[str]) -> str:
    """The payload of a batch frame: the JSON array of already-encoded ``items``."""
    return "[" + ",".join(items) + "]"


def text_frame(payload: str) -> bytes:
    """A server's (unmasked, uncompressed) text frame carrying ``payload``."""
    return Frame(Opcode.TEXT, payload.encode()).serialize(mask=False, extensions=())


class FrameCache:
    """Wire bytes of recent frames, each payload serialised once for all listeners.

    Listeners that want the same entries get the same item strings from the
    registry, so the lookups below hash each item once and compare by identity.
    Recent is bounded by bytes: past ``max_bytes`` the cache starts afresh.
    A frame is only worth keeping while the connections of one flush, or the
    sender turns after a burst, still ask for it; older ones are dead weight.

    Args:
        max_bytes: serialised bytes kept, at most.
    """

    __slots__ = ("_batches", "_bytes", "_singles", "max_bytes")

    def __init__(self, max_bytes: int = 1 << 20) -> None:
        self.max_bytes = max_bytes
        self._batches: dict[tuple[str, ...], bytes] = {}
        self._singles: dict[str, bytes] = {}
        self._bytes = 0

    def _kept(self, data: bytes) -> None:
        self._bytes += len(data)
        if self._bytes > self.max_bytes:
            self._batches.clear()
            self._singles.clear()
            self._bytes = 0

    def batch(self, items: Sequence[str]) -> bytes:
        """One text frame holding the JSON array of ``items``."""
        key = tuple(items)
        data = self._batches.get(key)
        if data is None:
            data = text_frame(batch_text(items))
            self._kept(data)
            self._batches[key] = data
        return data

    def singles(self, items: Sequence[str]) -> bytes:
        """One text frame per item (RFD 5 listeners), back to back."""
        singles = self._singles
        parts = []
        for item in items:
            data = singles.get(item)
            if data is None:
                data = text_frame(item)
                self._kept(data)
                singles[item] = data
            parts.append(data)
        return b"".join(parts)
