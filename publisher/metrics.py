"""Prometheus metrics of one publisher (invariant I7), on its own registry.

Each Publisher has its own CollectorRegistry, so several publishers (tests,
multi-feed processes) never clash; ``GET /metrics`` renders it.
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

__all__ = ["PublisherMetrics"]


class PublisherMetrics:
    """The publisher's counters and gauges."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.listeners = Gauge(
            "changefeed_listeners", "Connected, registered listener sockets", registry=r
        )
        self.registrations = Gauge(
            "changefeed_active_registrations", "Registrations by resource", ["resource"], registry=r
        )
        self.registrations_total = Counter(
            "changefeed_registrations_total",
            "Registrations accepted",
            ["resource", "resumed"],
            registry=r,
        )
        self.refusals_total = Counter(
            "changefeed_refusals_total", "Connections refused, by error code", ["code"], registry=r
        )
        self.disconnects_total = Counter(
            "changefeed_disconnects_total", "Listener disconnects", registry=r
        )
        self.evictions_total = Counter(
            "changefeed_evictions_total",
            "Listeners evicted because their send queue was full",
            registry=r,
        )
        self.entries_total = Counter(
            "changefeed_entries_tailed_total", "Feed entries read by the tailer", registry=r
        )
        self.deliveries_total = Counter(
            "changefeed_deliveries_total", "Change items sent to listeners", registry=r
        )
        self.replayed_total = Counter(
            "changefeed_replayed_total", "Change items replayed to resuming listeners", registry=r
        )
        self.queue_depth = Gauge(
            "changefeed_queue_depth_max", "Deepest listener send queue", registry=r
        )
        self.tailer_lag = Gauge(
            "changefeed_tailer_lag_seconds",
            "Age of the newest entry at the time the tailer read it",
            registry=r,
        )
        self.tailer_up = Gauge(
            "changefeed_tailer_up", "1 while the tailer is connected and running", registry=r
        )
        self.oldest_xact = Gauge(
            "changefeed_oldest_open_transaction_seconds",
            "Age of the oldest open write transaction holding the horizon back",
            registry=r,
        )

    def bind(
        self, queue_depth: Callable[[], float], lag: Callable[[], float], up: Callable[[], float]
    ) -> None:
        """Compute the live gauges from the publisher's state at scrape time."""
        self.queue_depth.set_function(queue_depth)
        self.tailer_lag.set_function(lag)
        self.tailer_up.set_function(up)

    def render(self) -> bytes:
        return generate_latest(self.registry)
