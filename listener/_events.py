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

import copy
from dataclasses import dataclass, fields
from typing import Any

from changefeed.schemas import ChangeItem

from ._checkpoint import CheckpointStatus
from ._figures import GAUGE, Labels, figure, nested
from ._lifecycle import ConnectionState

__all__ = [
    "BootstrapProgress",
    "ControllerCounts",
    "ControllerStats",
    "Event",
    "ListenerCounts",
    "ListenerStatus",
    "Resynced",
]


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
        elapsed: seconds since the walk started (until it ended, once done).
        done: the walk ended (its items went, or will go, out as ``Resynced``).

    ``pages``, ``items`` and ``rate`` are gauges, described where they are declared.
    """

    resource: str
    route: str
    pages: int = figure(
        "Pages of the bootstrap walk under way, or of the last one",
        GAUGE,
        metric="bootstrap_pages",
        default=0,
    )
    items: int = figure(
        "Items of the bootstrap walk under way, or of the last one",
        GAUGE,
        metric="bootstrap_items",
        default=0,
    )
    elapsed: float = 0.0
    rate: float = figure(
        "Items per second of the bootstrap walk under way, or of the last one",
        GAUGE,
        metric="bootstrap_items_per_second",
        default=0.0,
    )
    done: bool = False

    def to_json(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in self.__slots__}


def _one_hot(state: ConnectionState) -> list[tuple[Labels, float]]:
    return [((("state", each.value),), 1.0 if each is state else 0.0) for each in ConnectionState]


def _by_reason(counts: dict[str, int]) -> list[tuple[Labels, float]]:
    return [((("reason", reason),), float(n)) for reason, n in sorted(counts.items())]


@dataclass(slots=True)
class ListenerCounts:
    """What a listener counts, each where it happens: its connection loop (attempts,
    registrations, resumes, bootstraps, aborts, ``not_resumed``) and its inbox
    (overflows, items and frames received), both writing to the one record the
    listener hands them.

    Declared once, here, with each metric's help; ``ListenerStatus`` is these counts
    as of one moment, with the listener's state beside them.

    Attributes:
        frames_received: websocket frames received (error and bad frames too).
    """

    attempts: int = figure("Connection attempts", metric="connection_attempts", default=0)
    registrations: int = figure("Acks received", default=0)
    resumes: int = figure("Registrations with since answered resumed=true", default=0)
    bootstraps: int = figure("Bootstrap walks completed", default=0)
    overflows: int = figure("Buffer overflows (each one an abort)", default=0)
    aborts: int = figure(
        "Connections that ended, for any reason (overflows, drops, closes, timeouts)", default=0
    )
    items_received: int = figure("Change items decoded from the socket", default=0)
    frames_received: int = 0
    not_resumed: dict[str, int] = figure(
        "Acks that did not resume the since given, by the ack's reason"
        ' ("unknown" when the publisher gave none)',
        labels=("reason",),
        read=_by_reason,
        default_factory=dict,
    )


@dataclass(slots=True, kw_only=True)
class ListenerStatus(ListenerCounts):
    """A snapshot of one listener (``listener.status()``): its counts (``ListenerCounts``)
    and its state; also what its metrics show (``changefeed_listener_*``, each declared
    with its field, help and all).

    Attributes:
        name: the listener's name (the metrics' ``listener`` label).
        buffer_peak: the most items held at once.
        backoff_ceiling: the ceiling the back-off delay was drawn under, seconds.
        backoff_resets: times a healthy period reset the schedule.
        last_error: the last failure, as text.
        cursor: the cursor a reconnect resumes from (the last event handed out).
        live_for: seconds the current connection has been live.
        route: the (first) bootstrap route's absolute URL, once known.
        resources: the resources of the change kinds this listener registers.
    """

    name: str
    state: ConnectionState = figure(
        "1 for the listener's current lifecycle state", GAUGE, labels=("state",), read=_one_hot
    )
    failures: int = figure(
        "Consecutive failed attempts (the back-off's exponent)", GAUGE, metric="backoff_failures"
    )
    buffer_size: int = figure(
        "Items held for the application: buffered, or taken and not handed out yet",
        GAUGE,
        metric="buffer_items",
    )
    buffer_capacity: int = figure("Items the buffer holds at most", GAUGE)
    buffer_peak: int = 0
    backoff_delay: float = figure(
        "Current or last back-off delay, seconds", GAUGE, metric="backoff_seconds", default=0.0
    )
    backoff_ceiling: float = 0.0
    backoff_resets: int = 0
    last_error: str | None = None
    cursor: str | None = None
    items_delivered: int = figure("Change items handed to the application", default=0)
    live_for: float = 0.0
    route: str | None = None
    resources: tuple[str, ...] = ()
    bootstrap: tuple[BootstrapProgress, ...] = nested(
        BootstrapProgress,
        "Per route, the walk under way or the last one (empty before the first bootstrap)",
        label="resource",
        default=(),
    )
    checkpoint: CheckpointStatus | None = nested(
        CheckpointStatus, "Loads and saves of the checkpoint store (None: no store)", default=None
    )

    @classmethod
    def of(cls, counts: ListenerCounts, **now: Any) -> ListenerStatus:
        """``counts`` as they stand (copied: the snapshot does not move with them), with
        the figures of this moment (``now``) beside them."""
        copied = {f.name: copy.copy(getattr(counts, f.name)) for f in fields(ListenerCounts)}
        return cls(**copied, **now)

    def to_json(self) -> dict[str, Any]:
        """The snapshot as a JSON-ready dict (``state`` as its string value)."""
        doc = {f.name: getattr(self, f.name) for f in fields(self)}
        doc["state"] = self.state.value
        doc["resources"] = list(self.resources)
        doc["bootstrap"] = [progress.to_json() for progress in self.bootstrap]
        doc["not_resumed"] = dict(self.not_resumed)
        doc["checkpoint"] = None if self.checkpoint is None else self.checkpoint.to_json()
        return doc


@dataclass(slots=True)
class ControllerCounts:
    """What a controller's core counts, each where it happens (``Reconciler.counts``).

    Declared once, here, with each metric's help; ``ControllerStats`` is these
    counts as of one moment, with the work queue's figures beside them.

    Attributes:
        items: change items taken from the listener.
    """

    items: int = 0
    fetches: int = figure("Resources fetched", metric="controller_fetches", default=0)
    fetch_requests: int = figure(
        "Fetch calls (HTTP requests, batched)", metric="controller_fetch_requests", default=0
    )
    fetch_errors: int = figure(
        "Fetch calls that failed", metric="controller_fetch_errors", default=0
    )
    decode_errors: int = figure(
        "Resources the decoder refused (retried like a failed fetch)",
        metric="controller_decode_errors",
        default=0,
    )
    reconciles: int = figure("Callbacks completed", metric="controller_reconciles", default=0)
    reconcile_errors: int = figure(
        "Callbacks that raised", metric="controller_reconcile_errors", default=0
    )
    resyncs: int = figure(
        "Bootstraps applied to the mirror", metric="controller_resyncs", default=0
    )
    periodic_resyncs: int = figure(
        "Passes handing every mirrored resource to the callbacks again",
        metric="controller_periodic_resyncs",
        default=0,
    )


@dataclass(slots=True, kw_only=True)
class ControllerStats(ControllerCounts):
    """A snapshot of a controller (``controller.stats()``): its counts (``ControllerCounts``)
    and the work queue's figures; also what its metrics show (``changefeed_workqueue_*``,
    ``changefeed_controller_*``, each declared with its field, help and all).

    Attributes:
        synced: the first bootstrap has been applied and each id it queued processed once.
    """

    depth: int = figure("Ids ready to be processed", GAUGE, metric="workqueue_depth")
    pending: int = figure(
        "Ids queued, requeued behind a running worker, or waiting out a retry",
        GAUGE,
        metric="workqueue_pending",
    )
    processing: int = figure("Ids held by workers", GAUGE, metric="workqueue_processing")
    adds: int = figure("Ids added to the work queue", metric="workqueue_adds")
    coalesced: int = figure("Adds of an id already queued", metric="workqueue_coalesced")
    retries: int = figure(
        "Rate-limited re-adds after a failed fetch or callback", metric="workqueue_retries"
    )
    mirror_items: int = figure(
        "Resources in the mirror", GAUGE, metric="controller_mirror_items", default=0
    )
    synced: bool = False

    @classmethod
    def of(cls, counts: ControllerCounts, **now: Any) -> ControllerStats:
        """``counts`` as they stand, with the figures of this moment (``now``) beside them."""
        copied = {f.name: getattr(counts, f.name) for f in fields(ControllerCounts)}
        return cls(**copied, **now)

    def to_json(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}
