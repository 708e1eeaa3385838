"""Websocket close codes the publisher uses, and the error codes sent before them.

Every refusal is an error frame ``{"error": {"code", "message"}}`` followed by a
close with one of these codes. Codes 4000-4999 are private-use in RFC 6455.
A listener should re-register (with back-off) after any of them except
BAD_FRAME, UNKNOWN_RESOURCE, UNAUTHORIZED and FORBIDDEN, which will not heal by
retrying the same registration. After CURSOR_EXPIRED it registers without
``since`` and bootstraps; after UNAVAILABLE it keeps its cursor and resumes.
"""

from __future__ import annotations

from enum import IntEnum

__all__ = ["ERROR_CLOSE_CODES", "CloseCode"]


class CloseCode(IntEnum):
    """Close codes of the /changefeeds websocket."""

    GOING_AWAY = 1001
    """Publisher shutting down or draining: register again (elsewhere)."""
    BAD_FRAME = 4000
    """First frame is not JSON, not an object, or fails the registration schema."""
    UNKNOWN_RESOURCE = 4001
    """The registration names a resource this publisher has no feed for."""
    REGISTRATION_TIMEOUT = 4002
    """No registration frame arrived in time."""
    UNAUTHORIZED = 4003
    """No or invalid bearer token (also refused at the handshake with HTTP 401/403)."""
    FORBIDDEN = 4004
    """The token may not read this resource."""
    BAD_CURSOR = 4005
    """'since' is not a cursor this feed issued."""
    FRAME_TOO_LARGE = 4006
    """A frame exceeded the configured maximum size."""
    TOO_MANY_REGISTRATIONS = 4007
    """More registrations on one connection than allowed."""
    TOO_MANY_CONNECTIONS = 4008
    """The publisher holds its maximum number of listener connections."""
    SLOW_LISTENER = 4009
    """The listener made no progress (read nothing) for the publisher's stall timeout:
    it was evicted; register again and resume. A listener that reads, however
    slowly, is never closed for it."""
    UNAVAILABLE = 4010
    """The publisher cannot serve the registration now (database unreachable, draining):
    register again after a back-off (the error frame's ``retryAfter``), keeping the cursor."""
    CURSOR_EXPIRED = 4011
    """While the listener was catching up, the feed was trimmed past its position:
    register again without ``since`` and bootstrap."""


ERROR_CLOSE_CODES: dict[str, CloseCode] = {
    "bad_frame": CloseCode.BAD_FRAME,
    "invalid_registration": CloseCode.BAD_FRAME,
    "unknown_resource": CloseCode.UNKNOWN_RESOURCE,
    "registration_timeout": CloseCode.REGISTRATION_TIMEOUT,
    "unauthorized": CloseCode.UNAUTHORIZED,
    "forbidden": CloseCode.FORBIDDEN,
    "bad_cursor": CloseCode.BAD_CURSOR,
    "frame_too_large": CloseCode.FRAME_TOO_LARGE,
    "too_many_registrations": CloseCode.TOO_MANY_REGISTRATIONS,
    "too_many_connections": CloseCode.TOO_MANY_CONNECTIONS,
    "slow_listener": CloseCode.SLOW_LISTENER,
    "unavailable": CloseCode.UNAVAILABLE,
    "cursor_expired": CloseCode.CURSOR_EXPIRED,
}
"""Which close code follows the error frame with a given error code."""
