"""Who is listening to what on this publisher instance, and the fan-out to them.

Pure code: the registry never touches a socket or the database. ``dispatch``
matches each entry against the registrations of its resource, encodes it once
(only if someone wants it), and offers the frame to each matching listener's
bounded outbox. A listener whose outbox is full is evicted and returned to the
caller, which closes its socket; nobody else waits for it (invariants I2, I3).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from changefeed.schemas import ChangeKind, Position

from .feed import FeedEntry
from .outbox import Outbox

__all__ = ["Closing", "ListenerSession", "Registry", "Subscription"]

_session_ids = itertools.count(1)


@dataclass(frozen=True, slots=True)
class Closing:
    """Why the publisher is closing a listener: close code, error code and message."""

    close_code: int
    error_code: str | None
    message: str


@dataclass(eq=False, slots=True)
class Subscription:
    """One registration (change kind) of a listener session."""

    session: ListenerSession
    change_kind: ChangeKind
    skip_until: Position
    """Entries at or before this position are not sent: the seam between a resume's
    replay (or the listener's bootstrap) and live delivery."""
    sub_resources: frozenset[str]
    delivered: int = 0
    dropped: int = 0


@dataclass(eq=False)
class ListenerSession:
    """One listener websocket connection."""

    instance: str
    service: str
    outbox: Outbox
    batch: bool = False
    peer: str = ""
    id: int = field(default_factory=lambda: next(_session_ids))
    connected_since: datetime = field(default_factory=lambda: datetime.now(UTC))
    resumed: bool = False
    subscriptions: list[Subscription] = field(default_factory=list)
    closing: Closing | None = None
    on_close: Callable[[ListenerSession], None] | None = None

    def close(self, closing: Closing) -> None:
        """Mark the session for closing (first reason wins) and wake its handler."""
        if self.closing is None:
            self.closing = closing
            if self.on_close is not None:
                self.on_close(self)


class Registry:
    """The sessions connected to this instance, indexed by resource."""

    def __init__(self) -> None:
        self._sessions: dict[int, ListenerSession] = {}
        self._by_resource: dict[str, dict[Subscription, None]] = {}
        self.registrations_total = 0
        self.disconnects_total = 0
        self.evictions_total = 0

    def __len__(self) -> int:
        return len(self._sessions)

    @property
    def sessions(self) -> Iterable[ListenerSession]:
        return self._sessions.values()

    def subscriptions_for(self, resource: str) -> int:
        return len(self._by_resource.get(resource, ()))

    def add(self, session: ListenerSession, kinds: Iterable[tuple[ChangeKind, Position]]) -> None:
        """Register ``session`` for each ``(change kind, skip_until)``."""
        self._sessions[session.id] = session
        for kind, skip_until in kinds:
            sub = Subscription(session, kind, skip_until, frozenset(kind.sub_resources))
            session.subscriptions.append(sub)
            self._by_resource.setdefault(kind.resource, {})[sub] = None
            self.registrations_total += 1

    def remove(self, session: ListenerSession) -> bool:
        """Forget ``session`` (registrations are ephemeral). True if it was registered."""
        if self._sessions.pop(session.id, None) is None:
            return False
        for sub in session.subscriptions:
            subs = self._by_resource.get(sub.change_kind.resource)
            if subs is not None:
                subs.pop(sub, None)
                if not subs:
                    del self._by_resource[sub.change_kind.resource]
        self.disconnects_total += 1
        return True

    def dispatch(
        self, entries: Iterable[FeedEntry], encode: Callable[[FeedEntry], str]
    ) -> tuple[int, list[ListenerSession]]:
        """Offer each entry to every matching subscription's outbox.

        Returns:
            the number of frames queued, and the sessions evicted because their
            outbox was full (already removed from the registry and marked closing).
        """
        queued = 0
        evicted: list[ListenerSession] = []
        for entry in entries:
            subs = self._by_resource.get(entry.resource)
            if not subs:
                continue
            frame: str | None = None
            entry_subs = entry.sub_resources
            position = entry.position
            for sub in subs:
                if position <= sub.skip_until:
                    continue
                wanted = sub.sub_resources
                if entry_subs and wanted and wanted.isdisjoint(entry_subs):
                    continue
                session = sub.session
                if session.closing is not None:
                    continue
                if frame is None:
                    frame = encode(entry)
                if session.outbox.offer(frame):
                    sub.delivered += 1
                    queued += 1
                else:
                    sub.dropped += 1
                    evicted.append(session)
                    session.close(
                        Closing(
                            4009,
                            "slow_listener",
                            f"send queue full ({session.outbox.capacity} frames): evicted",
                        )
                    )
        for session in evicted:
            if self.remove(session):
                self.evictions_total += 1
        return queued, evicted

    def registrations(self) -> list[dict[str, Any]]:
        """Per-registration stats in the /changefeeds/stats shape."""
        rows = []
        for session in self._sessions.values():
            for sub in session.subscriptions:
                rows.append(
                    {
                        "instance": session.instance,
                        "service": session.service,
                        "changeKind": sub.change_kind.to_json(),
                        "connectedSince": session.connected_since.isoformat(
                            timespec="milliseconds"
                        ),
                        "peer": session.peer,
                        "resumed": session.resumed,
                        "batch": session.batch,
                        "delivered": sub.delivered,
                        "dropped": sub.dropped,
                        "queueDepth": len(session.outbox),
                    }
                )
        return rows
