"""Exceptions of the wire protocol.

Exception tree::

    ProtocolError            root: a payload does not follow the wire contract
    └── CursorError          a cursor is not one this feed issued (garbage or tampered)

Every ProtocolError carries the machine-readable ``code`` that goes into an
error frame (``{"error": {"code": ..., "message": ...}}``).
"""

from __future__ import annotations

__all__ = ["CursorError", "ProtocolError"]


class ProtocolError(Exception):
    """A payload does not follow the wire contract.

    Args:
        code: machine-readable error code for the error frame, e.g. ``bad_frame``.
        message: what is wrong, for people.
        retry_after: seconds after which trying again may succeed (an error
            frame's ``retryAfter``), when the publisher said so.
    """

    def __init__(self, code: str, message: str, retry_after: float | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.retry_after = retry_after


class CursorError(ProtocolError):
    """A cursor that this feed did not issue: garbage, truncated or tampered."""

    def __init__(self, message: str) -> None:
        super().__init__("bad_cursor", message)
