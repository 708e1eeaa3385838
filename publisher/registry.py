"""Who is connected to this publisher instance, and how each connection shows in stats. Pure code.

A ``Session`` is one registered websocket connection: who the listener said
it is, what it registered for, and its ``Delivery`` (where it is in the feed).
Registrations are ephemeral: a session lives as long as its connection.
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from changefeed.schemas import ChangeKind, Position

from .counters import timestamp
from .delivery import Closing, Delivery

__all__ = ["Registry", "Session"]

_session_ids = itertools.count(1)


@dataclass(eq=False, slots=True)
class Session:
    """One registered listener connection."""

    instance: str
    service: str
    kinds: tuple[ChangeKind, ...]
    delivery: Delivery
    peer: str = ""
    resumed: bool = False
    id: int = field(default_factory=lambda: next(_session_ids))
    connected_since: datetime = field(default_factory=lambda: datetime.now(UTC))

    @property
    def closing(self) -> Closing | None:
        return self.delivery.closing

    def close(self, closing: Closing) -> None:
        """Mark the connection for closing (the first reason wins)."""
        self.delivery.close(closing)

    def lag(self, head: Position, now: float) -> tuple[int, float | None]:
        """How far behind the head the listener is: entries (estimated from the
        entries' identities while it catches up) and seconds (the age of the
        oldest entry it has yet to take; None while unknown). Items written to
        its connection that it has not taken yet count as not delivered."""
        return self._lag(head, now, self.delivery.untaken())

    def _lag(self, head: Position, now: float, untaken: int) -> tuple[int, float | None]:
        delivery = self.delivery
        oldest = delivery.oldest_untaken() if untaken else None
        if oldest is None and delivery.queue:
            oldest = delivery.queue[0].published
        if oldest is not None:
            seconds: float | None = max(0.0, now - oldest)
        elif delivery.live:
            seconds = 0.0
        elif delivery.cursor_published is not None:
            seconds = max(0.0, now - delivery.cursor_published.timestamp())
        else:
            seconds = None
        behind = 0 if delivery.live else max(0, head.id - delivery.cursor.id)
        return delivery.outstanding(untaken) + behind, seconds

    def summary(self) -> dict[str, Any]:
        """The connection in the stats' vocabulary (for evictions and logs)."""
        return {
            "instance": self.instance,
            "service": self.service,
            "peer": self.peer,
            "changeKinds": [kind.to_json() for kind in self.kinds],
            "connectedSince": timestamp(self.connected_since),
            "delivered": self.delivery.delivered(),
            "dropped": self.delivery.dropped,
        }

    def rows(
        self, head: Position, now: float, allowed: frozenset[str] | None
    ) -> Iterator[dict[str, Any]]:
        """One stats row per registration (change kind) the token may see."""
        delivery = self.delivery
        untaken = delivery.untaken()
        lag_entries, lag_seconds = self._lag(head, now, untaken)
        for kind in self.kinds:
            if allowed is not None and kind.resource not in allowed:
                continue
            yield {
                "instance": self.instance,
                "service": self.service,
                "changeKind": kind.to_json(),
                "connectedSince": timestamp(self.connected_since),
                "peer": self.peer,
                "resumed": self.resumed,
                "batch": delivery.batch,
                "state": "live" if delivery.live else "catching_up",
                "delivered": delivery.sent - untaken,
                "frames": delivery.frames,
                "dropped": delivery.dropped,
                "queueDepth": delivery.outstanding(untaken),
                "lagEntries": lag_entries,
                "lagSeconds": None if lag_seconds is None else round(lag_seconds, 3),
            }


class Registry:
    """The sessions connected to this instance.

    A session the publisher evicted leaves the registry at once (it is no longer
    a registration), but its connection may take ``close_timeout`` to end: until
    then it is *retiring*, and what it delivers still counts.
    """

    def __init__(self) -> None:
        self._sessions: dict[int, Session] = {}
        self._retiring: dict[int, Session] = {}
        self._kinds: Counter[str] = Counter()

    def __len__(self) -> int:
        return len(self._sessions)

    def __iter__(self) -> Iterator[Session]:
        return iter(self._sessions.values())

    @property
    def deliveries(self) -> Iterable[Delivery]:
        """The registered sessions' deliveries."""
        return (session.delivery for session in self._sessions.values())

    @property
    def connected(self) -> Iterable[Delivery]:
        """Every connection's delivery, retiring ones included (for totals)."""
        for sessions in (self._sessions, self._retiring):
            for session in sessions.values():
                yield session.delivery

    def add(self, session: Session) -> None:
        self._sessions[session.id] = session
        self._kinds.update(kind.resource for kind in session.kinds)

    def retire(self, session: Session) -> bool:
        """Unregister ``session`` while its connection ends. True if it was registered."""
        if not self._unregister(session):
            return False
        self._retiring[session.id] = session
        return True

    def remove(self, session: Session) -> bool:
        """Forget ``session``, whose connection ended. True if it was still registered."""
        self._retiring.pop(session.id, None)
        return self._unregister(session)

    def _unregister(self, session: Session) -> bool:
        if self._sessions.pop(session.id, None) is None:
            return False
        self._kinds.subtract(kind.resource for kind in session.kinds)
        return True

    def registrations_by_resource(self) -> dict[str, int]:
        """Active registrations (change kinds) by resource."""
        return {resource: count for resource, count in self._kinds.items() if count}

    def rows(
        self, head: Position, now: float, allowed: frozenset[str] | None
    ) -> list[dict[str, Any]]:
        """Every registration as a stats row (``allowed``: only these resources; None: all)."""
        only = None if allowed is None or "*" in allowed else allowed
        return [row for session in self._sessions.values() for row in session.rows(head, now, only)]
