"""What a listener hands to the application, and the snapshot of its state.

``async for event in listener`` yields two kinds of event, in feed order:

* ``Resynced`` when a bootstrap (the first, or a re-bootstrap after a cursor
  could not be resumed) has been walked: every resource of one change kind,
  as of some moment after the registration. A listener of several change
  kinds hands out one per kind, in registration order, all with the same
  cursor, before any change item. Apply it first; every change item after it
  is newer.
* ``ChangeItem`` (from ``changefeed.schemas``): resource ``changed_resource_id``
  changed. It says *that* it changed, never *what*: fetch it.

Pure data.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from changefeed.schemas import ChangeItem

from ._checkpoint import CheckpointStatus
from ._lifecycle import ConnectionState

__all__ = ["BootstrapProgress", "Event", "ListenerStatus", "Resynced"]


@dataclass(frozen=True, slots=True)
class Resynced:
    """A completed bootstrap of one change kind: the whole resource list.

    Attributes:
        items: every resource the bootstrap route listed.
        route: the absolute URL that was paged (also where single resources are
            fetched: ``{route}/{id}``).
        cursor: the feed position the list is consistent with; change items
            after this event are newer than it.
        pages: pages walked.
        elapsed: seconds the walk took.
        initial: True for the listener's first bootstrap, False for a re-bootstrap.
        resource: the change kind's resource (``""``: not said, from a source
            other than a Listener).
    """

    items: list[Any]
    route: str
    cursor: str
    pages: int = 0
    elapsed: float = 0.0
    initial: bool = True
    resource: str = ""

    def __repr__(self) -> str:
        return (
            f"Resynced(resource={self.resource!r}, items=<{len(self.items)}>, "
            f"route={self.route!r}, pages={self.pages}, initial={self.initial})"
        )


Event = Resynced | ChangeItem
"""What ``async for event in listener`` yields."""


@dataclass(frozen=True, slots=True)
class BootstrapProgress:
    """One route's bootstrap walk: the one under way, or the last one.

    Attributes:
        resource: the change kind's resource.
        route: the absolute URL being paged.
        pages: pages received so far.
        items: resources received so far.
        elapsed: seconds since the walk started (until it ended, once done).
        rate: items per second over the walk.
        done: the walk ended (its items went, or will go, out as ``Resynced``).
    """

    resource: str
    route: str
    pages: int = 0
    items: int = 0
    elapsed: float = 0.0
    rate: float = 0.0
    done: bool = False

    def to_json(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in self.__slots__}


@dataclass(frozen=True, slots=True)
class ListenerStatus:
    """A snapshot of one listener (``listener.status()``); also what its metrics show.

    Attributes:
        name: the listener's name (metrics label).
        state: where the connection lifecycle is.
        attempts: connection attempts since start.
        failures: consecutive failed attempts (the back-off exponent).
        registrations: acks received.
        resumes: registrations that sent ``since`` and were answered ``resumed: true``.
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
        route: the (first) bootstrap route's absolute URL, once known.
        resources: the resources of the change kinds this listener registers.
        bootstrap: per route, the walk under way or the last one (empty before
            the first bootstrap).
        not_resumed: acks that did not resume a ``since``, by the ack's
            ``reason`` (``"unknown"`` when the publisher gave none).
        checkpoint: loads and saves of the checkpoint store (None: no store).
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
    resources: tuple[str, ...] = ()
    bootstrap: tuple[BootstrapProgress, ...] = ()
    not_resumed: dict[str, int] = field(default_factory=dict)
    checkpoint: CheckpointStatus | None = None

    def to_json(self) -> dict[str, Any]:
        """The snapshot as a JSON-ready dict (``state`` as its string value)."""
        doc = {name: getattr(self, name) for name in self.__slots__}
        doc["state"] = self.state.value
        doc["resources"] = list(self.resources)
        doc["bootstrap"] = [progress.to_json() for progress in self.bootstrap]
        doc["not_resumed"] = dict(self.not_resumed)
        doc["checkpoint"] = None if self.checkpoint is None else self.checkpoint.to_json()
        return doc
