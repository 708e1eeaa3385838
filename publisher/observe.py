"""The publisher's figures, as /changefeeds/stats and /metrics show them. Pure code.

Both read the same places (see counters): the stats document for people and
tools that want the live picture, the metrics snapshot for Prometheus. Every
counter is declared once, in ``figures.COUNTERS``, and both views are built
from that table.
"""

from __future__ import annotations

import time
from typing import Any, Protocol

from .broadcast import Broadcast
from .config import PublisherConfig
from .counters import Counters
from .doorbell import Doorbell
from .feed import FeedHealth
from .figures import COUNTERS, Reading
from .metrics import MetricsSnapshot
from .rates import RateHistory
from .registry import Registry
from .tailer import Tailer

__all__ = ["Observed", "metrics_snapshot", "rate_counters", "stats_document"]


class Observed(Protocol):
    """The parts of a publisher its figures come from."""

    @property
    def config(self) -> PublisherConfig: ...
    @property
    def counters(self) -> Counters: ...
    @property
    def registry(self) -> Registry: ...
    @property
    def broadcast(self) -> Broadcast: ...
    @property
    def tailer(self) -> Tailer: ...
    @property
    def doorbell(self) -> Doorbell | None: ...
    @property
    def feed_health(self) -> FeedHealth: ...
    @property
    def draining(self) -> bool: ...
    @property
    def failed(self) -> dict[str, str]: ...
    @property
    def rates(self) -> RateHistory: ...


def _reading(observed: Observed) -> Reading:
    counters, broadcast = observed.counters, observed.broadcast
    sent, frames = _sent(observed)
    dropped = counters.gone_dropped + sum(d.dropped for d in observed.registry.connected)
    return Reading(
        counters, broadcast.catchup, broadcast.pages, observed.tailer, sent, frames, dropped
    )


def _stats_counters(reading: Reading) -> dict[str, Any]:
    doc: dict[str, Any] = {}
    for figure in COUNTERS:
        if figure.stats is not None and figure.read is not None:
            doc[figure.stats] = figure.read(reading)
        if figure.stats_breakdown is not None and figure.breakdown is not None:
            doc[figure.stats_breakdown] = figure.breakdown(reading)
    return doc


def _sent(observed: Observed) -> tuple[int, int]:
    """Items taken by listeners (of connections open now, and gone) and frames written."""
    counters = observed.counters
    sent, frames = counters.gone_sent, counters.gone_frames
    for delivery in observed.registry.connected:
        sent += delivery.delivered()
        frames += delivery.frames
    return sent, frames


def rate_counters(observed: Observed) -> dict[str, int]:
    """The counters the dashboard charts as rates."""
    return {
        "entries": observed.tailer.entries_total,
        "deliveries": _sent(observed)[0],
        "evictions": sum(observed.counters.evictions.values()),
    }


def stats_document(observed: Observed, allowed: frozenset[str] | None = None) -> dict[str, Any]:
    """The /changefeeds/stats document.

    Args:
        observed: the publisher.
        allowed: show only registrations of these resources (None or ``{"*"}``: all).
    """
    counters, registry, window = observed.counters, observed.registry, observed.broadcast.window
    health = observed.feed_health
    catching_up = sum(1 for d in registry.deliveries if not d.live)
    everything = allowed is None or "*" in allowed
    return {
        "listeners": len(registry),
        "registrations": registry.rows(window.head, time.time(), allowed),
        "connections": counters.connections_open,
        "draining": observed.draining,
        "catchingUp": catching_up,
        "tailer": {
            **observed.tailer.stats(),
            "oldestOpenTransactionSeconds": round(health.oldest_writer_seconds, 3),
            # Where the feed is read: the primary (dsn), or a standby (read_dsn),
            # whose doorbell then rings from the primary.
            "reads": "dsn" if observed.doorbell is None else "read_dsn",
            **({} if observed.doorbell is None else {"doorbell": observed.doorbell.stats()}),
        },
        "feed": {
            "head": list(window.head),
            "lowWater": list(health.low_water),
            "oldestEntrySeconds": round(health.oldest_entry_seconds, 3),
            "bytes": health.feed_bytes,
        },
        "window": {
            "base": list(window.base),
            "entries": len(window),
            "bytes": window.nbytes,
            "maxBytes": window.max_bytes,
        },
        "failed": dict(observed.failed),
        "counters": _stats_counters(_reading(observed)),
        # A token limited to some resources sees those resources' listeners only,
        # and no refusals (they name peers and other resources).
        "recentEvictions": [
            e
            for e in counters.recent_evictions
            if everything or any(k["resource"] in (allowed or ()) for k in e["changeKinds"])
        ],
        "recentRefusals": list(counters.recent_refusals) if everything else [],
        "rates": observed.rates.to_json(),
    }


def metrics_snapshot(observed: Observed) -> MetricsSnapshot:
    """Every figure of /metrics, read now."""
    counters, registry, tailer = observed.counters, observed.registry, observed.tailer
    broadcast, health = observed.broadcast, observed.feed_health
    window = broadcast.window
    deliveries = list(registry.deliveries)
    by_resource = registry.registrations_by_resource()
    reading = _reading(observed)
    # What waits in a connection's buffers has not been delivered yet either.
    depths = [d.outstanding(d.untaken()) for d in deliveries]
    now = time.time()
    oldest = [t for d in deliveries if (t := d.oldest_untaken()) is not None]
    oldest += [d.queue[0].published for d in deliveries if d.queue]
    oldest += [
        d.cursor_published.timestamp() for d in deliveries if not d.live and d.cursor_published
    ]
    return MetricsSnapshot(
        counters={
            f.metric: f.read(reading)
            for f in COUNTERS
            if f.metric is not None and f.by_label is None and f.read is not None
        },
        labelled_counters={
            f.metric: (f.labels, f.by_label(reading))
            for f in COUNTERS
            if f.metric is not None and f.by_label is not None
        },
        gauges={
            "listeners": len(registry),
            "open_connections": counters.connections_open,
            "catching_up": sum(1 for d in deliveries if not d.live),
            "window_bytes": window.nbytes,
            "window_entries": len(window),
            "queue_depth_max": max(depths, default=0),
            "queued_items": sum(depths),
            "lag_seconds_max": max((now - t for t in oldest), default=0.0),
            "tailer_lag_seconds": tailer.lag_seconds,
            "tailer_up": 1.0 if tailer.status == "running" else 0.0,
            "doorbell_up": 1.0
            if observed.doorbell is None or observed.doorbell.status in ("listening", "resting")
            else 0.0,
            "tailer_position": float(tailer.position.id) if tailer.position else 0.0,
            "oldest_open_transaction_seconds": health.oldest_writer_seconds,
            "feed_oldest_entry_seconds": health.oldest_entry_seconds,
            "feed_max_age_seconds": observed.config.max_age,
            "feed_bytes": health.feed_bytes,
        },
        labelled_gauges={
            "active_registrations": (
                ("resource",),
                {
                    (resource.name,): by_resource.get(resource.name, 0)
                    for resource in observed.config.resources
                },
            ),
        },
    )
