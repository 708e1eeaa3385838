"""Who is listening to what on this publisher instance, and the fan-out to them.

Pure code: the registry never touches a socket or the database. ``dispatch``
takes one batch of entries from the tailer, encodes each entry that anyone
wants exactly once, and offers the frames to the bounded outbox of every
matching registration. A listener whose outbox cannot take them is evicted
(close code 4009) and returned to the caller, which logs and counts it; it is
never waited for, and nobody else waits for it (invariants I2, I3).

The batch is matched per registration, not per entry: the registrations of
one resource that want the same sub-resources share one list of frames, and
each outbox takes its list in one ``deque.extend``. An entry is encoded the
first time a registration wants it, and never again. Dispatching 1,000 entries
to 5,000 listeners is then 5,000 C-level extends, not five million Python
steps on the event loop.

Order: every connection receives its items in feed order, because the
cursor of the last item a listener saw is where it resumes. A connection
with several registrations (node-sdc-changefeed's v2) gets the union of what
they match, in feed order, each entry once.
"""

from __future__ import annotations

import itertools
from bisect import bisect_right
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from changefeed.schemas import ChangeKind, Position

from .feed import FeedEntry
from .outbox import Outbox

__all__ = ["Closing", "ListenerSession", "Registry", "Subscription"]

_session_ids = itertools.count(1)
_EVICTIONS_KEPT = 100


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
    queued: int = 0
    """Items queued for this registration (offered to the connection's outbox)."""


@dataclass(eq=False, slots=True)
class ListenerSession:
    """One registered listener websocket connection."""

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
    sent: int = 0
    """Items written to the socket (each item of a batch frame counts)."""
    frames: int = 0
    """Websocket frames written (a batch frame counts once)."""
    dropped: int = 0
    """Items this connection lost when it was closed: refused or still queued."""

    def close(self, closing: Closing) -> None:
        """Mark the session for closing (first reason wins), drop what is queued,
        and wake its connection's sender (closing the outbox does)."""
        if self.closing is None:
            self.closing = closing
            self.dropped += self.outbox.close()

    def summary(self) -> dict[str, Any]:
        """The session in the /changefeeds/stats vocabulary (for evictions)."""
        return {
            "instance": self.instance,
            "service": self.service,
            "peer": self.peer,
            "changeKinds": [s.change_kind.to_json() for s in self.subscriptions],
            "connectedSince": _timestamp(self.connected_since),
            "delivered": self.sent,
            "dropped": self.dropped,
        }


def _timestamp(moment: datetime) -> str:
    return moment.isoformat(timespec="milliseconds").replace("+00:00", "Z")


def _wants(entry_subs: tuple[str, ...], wanted: frozenset[str]) -> bool:
    return not entry_subs or not wanted or not wanted.isdisjoint(entry_subs)


class Registry:
    """The sessions connected to this instance, indexed by resource."""

    def __init__(self) -> None:
        self._sessions: dict[int, ListenerSession] = {}
        self._by_resource: dict[str, dict[Subscription, None]] = {}
        self.registrations_total = 0
        """Registrations (change kinds) accepted; a v2 connection may make several."""
        self.sessions_total = 0
        """Listener connections registered."""
        self.disconnects_total = 0
        """Registered listener connections gone, for any reason."""
        self.evictions_total = 0
        self.recent_evictions: deque[dict[str, Any]] = deque(maxlen=_EVICTIONS_KEPT)

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
        self.sessions_total += 1
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
        self,
        entries: Sequence[FeedEntry],
        encode: Callable[[FeedEntry], str],
        touched: list[Outbox] | None = None,
    ) -> tuple[int, list[ListenerSession]]:
        """Offer a batch of entries (in feed order) to every matching registration.

        Args:
            entries: what the tailer read, in feed order.
            encode: the frame of an entry (called at most once per entry).
            touched: when given, outboxes are not woken: each one that received
                frames is appended here for the caller to wake.

        Returns:
            the number of items queued, and the sessions evicted because their
            outbox was full (already removed from the registry and closing with 4009).
        """
        wake = touched is None
        by_resource: dict[str, list[int]] = {}
        for i, entry in enumerate(entries):
            if entry.resource in self._by_resource:
                by_resource.setdefault(entry.resource, []).append(i)
        if not by_resource:
            return 0, []
        frames: dict[int, str] = {}

        def frame(i: int) -> str:
            """Entry i's frame, encoded the first time anyone wants it."""
            text = frames.get(i)
            if text is None:
                text = frames[i] = encode(entries[i])
            return text

        queued = 0
        overflowing: list[tuple[ListenerSession, int]] = []
        several: dict[int, ListenerSession] = {}
        for resource, indexes in by_resource.items():
            # Registrations asking for the same sub-resources share one selection.
            selections: dict[frozenset[str], tuple[list[Position], list[str]]] = {}
            for sub in self._by_resource[resource]:
                session = sub.session
                if session.closing is not None:
                    continue
                if len(session.subscriptions) > 1:
                    several[session.id] = session
                    continue
                wanted = sub.sub_resources
                selection = selections.get(wanted)
                if selection is None:
                    chosen = [i for i in indexes if _wants(entries[i].sub_resources, wanted)]
                    selection = ([entries[i].position for i in chosen], [frame(i) for i in chosen])
                    selections[wanted] = selection
                sub_positions, sub_frames = selection
                if sub_frames and sub.skip_until >= sub_positions[0]:
                    sub_frames = sub_frames[bisect_right(sub_positions, sub.skip_until) :]
                if not sub_frames:
                    continue
                if session.outbox.offer_many(sub_frames, wake):
                    sub.queued += len(sub_frames)
                    queued += len(sub_frames)
                    if touched is not None:
                        touched.append(session.outbox)
                else:
                    overflowing.append((session, len(sub_frames)))
        wanted_by_several = sorted(i for indexes in by_resource.values() for i in indexes)
        for session in several.values():
            offered = self._offer_in_feed_order(
                session, entries, wanted_by_several, frame, overflowing=overflowing, wake=wake
            )
            if offered and touched is not None:
                touched.append(session.outbox)
            queued += offered
        # Evict only now: removing registrations while iterating them would not do.
        evicted = [session for session, refused in overflowing if self._evict(session, refused)]
        return queued, evicted

    def _offer_in_feed_order(
        self,
        session: ListenerSession,
        entries: Sequence[FeedEntry],
        indexes: list[int],
        frame: Callable[[int], str],
        *,
        overflowing: list[tuple[ListenerSession, int]],
        wake: bool,
    ) -> int:
        chosen: list[str] = []
        counted: list[Subscription] = []
        for i in indexes:
            entry = entries[i]
            for sub in session.subscriptions:
                if (
                    sub.change_kind.resource == entry.resource
                    and entry.position > sub.skip_until
                    and _wants(entry.sub_resources, sub.sub_resources)
                ):
                    chosen.append(frame(i))
                    counted.append(sub)
                    break
        if not chosen:
            return 0
        if not session.outbox.offer_many(chosen, wake):
            overflowing.append((session, len(chosen)))
            return 0
        for sub in counted:
            sub.queued += 1
        return len(chosen)

    def _evict(self, session: ListenerSession, refused: int) -> bool:
        """Close ``session`` with 4009 and forget it; False if it was already gone."""
        session.dropped += refused
        session.close(
            Closing(
                4009,
                "slow_listener",
                f"send queue full ({session.outbox.capacity} items): evicted; register again",
            )
        )
        if not self.remove(session):
            return False
        self.evictions_total += 1
        self.recent_evictions.append({"at": _timestamp(datetime.now(UTC)), **session.summary()})
        return True

    def registrations(self, allowed: frozenset[str] | None = None) -> list[dict[str, Any]]:
        """Per-registration stats in the /changefeeds/stats shape.

        Args:
            allowed: only registrations of these resources (None or ``"*"``: all).
        """
        only = None if allowed is None or "*" in allowed else allowed
        rows = []
        for session in self._sessions.values():
            for sub in session.subscriptions:
                if only is not None and sub.change_kind.resource not in only:
                    continue
                rows.append(
                    {
                        "instance": session.instance,
                        "service": session.service,
                        "changeKind": sub.change_kind.to_json(),
                        "connectedSince": _timestamp(session.connected_since),
                        "peer": session.peer,
                        "resumed": session.resumed,
                        "batch": session.batch,
                        "queued": sub.queued,
                        "delivered": session.sent,
                        "frames": session.frames,
                        "dropped": session.dropped,
                        "queueDepth": len(session.outbox),
                    }
                )
        return rows
