"""What the publisher and its server say to each other beyond ASGI. Pure code.

Through ASGI, every frame to every listener is a coroutine call that builds a
message dict, passes the middleware's wrappers, and has the server serialise
the frame again for each connection. But a fan-out sends the *same* frames to
many listeners, and server frames are not masked: the bytes on the wire are
identical for all of them. A server that offers the ``DIRECT_WRITES`` scope
extension (a ``FrameWriter`` per connection, see ``changefeed.serving``)
takes frames serialised once (``entries.Item.wire``, ``BatchFrames``)
synchronously. Without the extension the publisher sends through ASGI, which
works on any server, at more CPU per frame.

Such a server also tells the app *why* a connection ended when it was the
server's doing, with a ``Disconnect`` under ``DISCONNECT_CAUSE`` in the
``websocket.disconnect`` message.
"""

from __future__ import annotations

from collections.abc import Sequence
from enum import Enum
from typing import Protocol

from websockets.frames import Frame, Opcode

__all__ = [
    "DIRECT_WRITES",
    "DISCONNECT_CAUSE",
    "BatchFrames",
    "Disconnect",
    "FrameWriter",
    "batch_text",
    "frame_size",
    "text_frame",
]

DIRECT_WRITES = "changefeed.direct_writes"
"""ASGI scope extension: the connection's ``FrameWriter``."""

DISCONNECT_CAUSE = "changefeed.disconnect_cause"
"""Key of a ``Disconnect`` in a ``websocket.disconnect`` message the server sent
because of something it did itself."""


class Disconnect(Enum):
    """Why the server ended a connection on its own."""

    FRAME_TOO_LARGE = "frame_too_large"
    """A frame over the server's size limit: it sent the publisher's error frame
    (``frame_too_large``) and closed with 4006."""
    KEEPALIVE_TIMEOUT = "keepalive_timeout"
    """The listener stopped answering pings."""
    BAD_FRAME = "bad_frame"
    """A text frame that is not UTF-8: it sent the publisher's error frame
    (``bad_frame``) and closed with 4000."""


class FrameWriter(Protocol):
    """Writes serialised frames to one websocket connection, without awaiting."""

    @property
    def open(self) -> bool:
        """True while a write goes out now: the connection is open and its
        transport is not paused (a paused one is left to ASGI sends, which wait)."""

    @property
    def lost(self) -> bool:
        """True once the connection is closing or gone: nothing written now would
        reach the listener."""

    def write(self, data: bytes) -> None:
        """Write ``data`` (whole frames); only when ``open``."""

    def backlogged(self) -> bool:
        """True when part of what was written waits in the transport: the kernel
        refused it, holding its limit unsent."""

    def buffered(self) -> int:
        """Bytes written that the peer has yet to take: in the transport's buffer,
        and in the kernel's unacknowledged where the server can tell."""

    @property
    def unsent_limit(self) -> int:
        """Bytes the kernel may hold unsent for this connection before
        ``hold_while_unsent`` holds writes (0: no limit of its own)."""

    def hold_while_unsent(self) -> bool:
        """After a write to a listener that is behind: True, and the writer is not
        ``open`` until the kernel has sent most of it, when the kernel holds
        ``unsent_limit`` or more unsent."""


def batch_text(items: Sequence[str]) -> str:
    """The payload of a batch frame: the JSON array of already-encoded ``items``."""
    return "[" + ",".join(items) + "]"


def frame_size(payload_bytes: int) -> int:
    """Bytes on the wire of a server's (unmasked) frame carrying ``payload_bytes``."""
    if payload_bytes < 126:
        return 2 + payload_bytes
    return (4 if payload_bytes < 1 << 16 else 10) + payload_bytes


def text_frame(payload: str) -> bytes:
    """A server's (unmasked, uncompressed) text frame carrying ``payload``."""
    return Frame(Opcode.TEXT, payload.encode()).serialize(mask=False, extensions=())


class BatchFrames:
    """Serialised batch frames, each made once for every listener that gets the same items.

    Listeners of one interest that keep up take the same items at each flush;
    the lookup hashes the items by identity. Bounded by bytes: past
    ``max_bytes`` it starts afresh, since a frame is worth keeping only while
    the connections of one flush still ask for it.

    Args:
        max_bytes: serialised bytes kept, at most.
    """

    __slots__ = ("_bytes", "_frames", "max_bytes")

    def __init__(self, max_bytes: int = 1 << 20) -> None:
        self.max_bytes = max_bytes
        self._frames: dict[tuple[object, ...], bytes] = {}
        self._bytes = 0

    def __len__(self) -> int:
        return len(self._frames)

    def frame(self, items: Sequence[object], texts: Sequence[str]) -> bytes:
        """The batch frame of ``items`` (whose JSON texts are ``texts``)."""
        key = tuple(items)
        data = self._frames.get(key)
        if data is None:
            data = text_frame(batch_text(texts))
            self._bytes += len(data)
            if self._bytes > self.max_bytes:
                self._frames.clear()
                self._bytes = len(data)
            self._frames[key] = data
        return data
