"""Registration as a decision: may this connection register, and where does it start? Pure code.

A registration is decided in three steps, and only the middle one awaits:

1. ``check_capacity`` before the frame is even read (draining, too many
   connections), then ``check_registration``: the frame, the limits, the
   resources and the token's access, and the ``since`` cursor's form. A refusal names its error
   code (schemas.closecodes) and says why, in words that quote no more of the
   listener's input than ``quote`` allows.
2. The publisher looks up what a resume needs to know in the feed
   (``feed.ResumeFacts``), when ``since`` was given; ``plan_resume`` then
   decides whether it resumes, or why not (the ack's ``reason``): a cursor of
   another feed, one ahead of everything the feed holds, one naming an entry
   the feed does not hold (a feed restored from a backup hands out the same
   positions again), one the feed was trimmed past, or one too far behind.
3. The publisher admits the connection in one synchronous step (reading the
   fan-out's head and joining it, or starting to catch up from ``since``), so
   no entry can slip between the head it read and the registration.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass

from changefeed.schemas import (
    ORIGIN,
    AccessDenied,
    Cursor,
    CursorCodec,
    CursorError,
    ForeignCursor,
    Position,
    ProtocolError,
    Registration,
    ResourceRoute,
    allows,
)

from .config import PublisherConfig
from .feed import ResumeFacts
from .matching import Interest

__all__ = [
    "LATE_REASONS",
    "Refusal",
    "Request",
    "check_capacity",
    "check_registration",
    "plan_resume",
    "quote",
    "read_cursor",
]

_QUOTED = 64
"""Characters of the listener's own input an error message or log line repeats."""


def quote(text: object, most: int = _QUOTED) -> str:
    """``repr`` of listener input, cut to ``most`` characters: an error frame or a log
    line never echoes a 60 KB ``instance`` back."""
    shown = repr(text)
    return shown if len(shown) <= most else shown[: most - 1] + "…"


@dataclass(frozen=True, slots=True)
class Refusal:
    """A registration refused: its error code (which names the close code) and why."""

    code: str
    message: str
    retry_after: float | None = None


@dataclass(frozen=True, slots=True)
class Request:
    """A registration this publisher may serve, checked."""

    registration: Registration
    interest: Interest
    routes: tuple[ResourceRoute, ...]
    undeclared: tuple[tuple[str, tuple[str, ...]], ...] = ()
    """(resource, sub-resources its config does not declare): accepted, worth a warning."""


def check_capacity(config: PublisherConfig, *, draining: bool, connections: int) -> Refusal | None:
    """Whether this publisher takes another listener at all (asked before its
    registration is read).

    Args:
        config: the publisher's limits.
        draining: the publisher is shutting down.
        connections: websocket connections open now, this one included.
    """
    if draining:
        return Refusal("unavailable", "publisher is shutting down; register elsewhere", 1.0)
    if connections > config.max_connections:
        return Refusal(
            "too_many_connections",
            f"publisher holds its maximum of {config.max_connections} connections",
            1.0,
        )
    return None


def check_registration(
    text: str, *, config: PublisherConfig, access: frozenset[str]
) -> Request | Refusal:
    """Decide everything about a registration frame that needs neither the
    database nor the feed's identity.

    Args:
        text: the registration frame (its size already checked).
        config: the publisher's resources and limits.
        access: the resources the connection's token may read (``"*"``: all).
    """
    try:
        registration = Registration.decode(text)
    except ProtocolError as exc:
        return Refusal(exc.code, exc.message)
    kinds = registration.change_kinds
    if len(kinds) > config.max_registrations:
        return Refusal(
            "too_many_registrations",
            f"{len(kinds)} change kinds on one connection; the limit is {config.max_registrations}",
        )
    routes = []
    undeclared = []
    for kind in kinds:
        resource = config.resource(kind.resource)
        if resource is None:
            return Refusal(
                "unknown_resource", f"no change feed for resource {quote(kind.resource)}"
            )
        if not allows(access, kind.resource):
            denied = AccessDenied.forbidden(kind.resource)
            return Refusal(denied.code, denied.message)
        unknown = tuple(sorted(set(kind.sub_resources) - set(resource.sub_resources)))
        if resource.sub_resources and unknown:
            # Accepted: the config's list is what GET /changefeeds advertises, not a
            # rule writers are held to, and RFD 5 listeners must work unchanged.
            undeclared.append((kind.resource, unknown))
        routes.append(
            ResourceRoute(resource.name, resource.sub_resources, resource.bootstrap_route)
        )
    return Request(registration, Interest(kinds), tuple(routes), tuple(undeclared))


def read_cursor(since: str, codec: CursorCodec) -> Cursor | Refusal | None:
    """The resume cursor of a registration; None for a cursor of another feed (not
    resumed, reason ``other_feed``); a ``bad_cursor`` refusal for garbage."""
    try:
        return codec.decode(since)
    except ForeignCursor:
        return None
    except CursorError as exc:
        return Refusal("bad_cursor", exc.message)


LATE_REASONS = frozenset({"cursor_ahead", "unknown_position", "other_feed"})
"""What ``plan_resume`` answers from a standby behind the cursor's issuer, and so is
believed only once the standby has caught up with the primary (a standby behind
answers no other reason that a caught-up one would not; ``other_feed``: one that
has not replayed the feed's new identity yet shows the old one)."""


def plan_resume(
    since: Cursor,
    facts: ResumeFacts,
    *,
    feed_id: uuid.UUID,
    head: Position,
    replay_limit: int,
) -> tuple[bool, str | None]:
    """Whether a registration with ``since`` resumes, and if not, why (the ack's ``reason``).

    Args:
        since: the resume cursor (of this feed's codec).
        facts: the feed's answer about its position, read just now.
        feed_id: the identity the cursor was checked against.
        head: the fan-out's position now.
        replay_limit: the most entries a resume may be behind (estimated from
            the entries' identities: ids the feed gave out between the two).
    """
    position = since.position
    state = facts.state
    if state.feed_id != feed_id:
        # Another publisher gave the feed a new identity (a restore) since this
        # one read it: the cursor belongs to what the feed was before.
        return False, "other_feed"
    if position < state.low_water:
        return False, "cursor_expired"
    if position > max(facts.newest, state.low_water) or position.txid >= facts.next_txid:
        return False, "cursor_ahead"
    if facts.stamp is None:
        # No entry there: trimmed (at the low-water mark), merged away by
        # compaction, or the cursor's entry was lost with the feed's history.
        if position not in (ORIGIN, state.low_water) and position > state.compacted_through:
            return False, "unknown_position"
    elif facts.stamp != since.stamp:
        return False, "unknown_position"  # another entry at the same (txid, id)
    if head.id - position.id > replay_limit:
        return False, "too_far_behind"
    return True, None
