"""What a listener hands to the application, and the snapshot of its state.

``async for event in listener`` yields two kinds of event, in feed order:

* ``Resynced`` when a bootstrap (the first, or a re-bootstrap after a cursor
  could not be resumed) has been walked: every resource, as of some moment
  after the registration. Apply it first; every change item after it is newer.
* ``ChangeItem`` (from ``changefeed.schemas``): resource ``changed_resource_id``
  changed. It says *that* it changed, never *what*: fetch it.

Pure data.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from changefeed.schemas import ChangeItem

from ._lifecycle import ConnectionState

__all__ = ["Event", "ListenerStatus", "Resynced"]


@dataclass(frozen=True, slots=True)
class Resynced:
    """A completed bootstrap: the whole resource list.

    Attributes:
        items: every resource the bootstrap route listed.
        route: the absolute URL that was paged (also where single resources are
            fetched: ``{route}/{id}``).
        cursor: the feed position the list is consistent with; change items
            after this event are newer than it.
        pages: pages walked.
        elapsed: seconds the walk took.
        initial: True for the listener's first bootstrap, False for a re-bootstrap.
    """

    items: list[Any]
    route: str
    cursor: str
    pages: int = 0
    elapsed: float = 0.0
    initial: bool = True

    def __repr__(self) -> str:
        return (
            f"Resynced(items=<{len(self.items)}>, route={self.route!r}, "
            f"pages={self.pages}, initial={self.initial})"
        )


Event = Resynced | ChangeItem
"""What ``async for event in listener`` yields."""


@dataclass(frozen=True, slots=True)
class ListenerStatus:
    """A snapshot of one listener (``listener.status()``); also what its metrics show.

    Attributes:
        name: the listener's name (metrics label).
        state: where the connection lifecycle is.
        attempts: connection attempts since start.
        failures: consecutive failed attempts (the back-off exponent).
        registrations: acks received.
        resumes: registrations answered ``resumed: true``.
        bootstraps: bootstrap walks completed.
        buffer_size: items held, waiting for the application.
        buffer_capacity: the most items the buffer holds.
        buffer_peak: the most items held at once.
        overflows: times the buffer overflowed (each one an abort).
        aborts: connections that ended (overflows, drops, closes, timeouts).
        backoff_delay: the current or last back-off delay, seconds.
        backoff_ceiling: the ceiling that delay was drawn under, seconds.
        backoff_resets: times a healthy period reset the schedule.
        last_error: the last failure, as text.
        cursor: the cursor a reconnect resumes from (the last event handed out).
        items_received: change items decoded from the socket.
        items_delivered: change items handed to the application.
        frames_received: websocket frames received.
        live_for: seconds the current connection has been live.
        route: the bootstrap route's absolute URL, once known.
    """

    name: str
    state: ConnectionState
    attempts: int
    failures: int
    registrations: int
    resumes: int
    bootstraps: int
    buffer_size: int
    buffer_capacity: int
    buffer_peak: int
    overflows: int
    aborts: int
    backoff_delay: float
    backoff_ceiling: float
    backoff_resets: int
    last_error: str | None
    cursor: str | None
    items_received: int
    items_delivered: int
    frames_received: int
    live_for: float
    route: str | None

    def to_json(self) -> dict[str, Any]:
        """The snapshot as a JSON-ready dict (``state`` as its string value)."""
        doc = {name: getattr(self, name) for name in self.__slots__}
        doc["state"] = self.state.value
        return doc
