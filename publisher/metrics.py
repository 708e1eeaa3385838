"""Prometheus metrics of one publisher (invariant I7), read from its state at scrape time.

Nothing is counted here, and no counter is declared here (``figures``): every
metric is read, when /metrics is scraped, from the one place that keeps it
(counters.Counters, the deliveries, the tailer, catch-up, the window), the
same places /changefeeds/stats reads. Each
publisher has its own CollectorRegistry, so several publishers in one process
(tests, multi-feed servers) never clash.

Names (all prefixed ``changefeed_``): ``listeners``, ``open_connections``,
``catching_up``, ``active_registrations{resource}``,
``registrations_total{resource,resumed}``, ``connections_total``,
``refusals_total{code,endpoint}``, ``disconnects_total``,
``evictions_total{code}``, ``dropped_total``, ``entries_tailed_total``,
``queued_total``, ``deliveries_total``, ``frames_total``,
``fell_behind_total``, ``rejoined_total``, ``catchup_items_total{source}``,
``catchup_page_reads_total``, ``catchup_pages_shared_total``,
``window_bytes``, ``window_entries``, ``queue_depth_max``, ``queued_items``,
``lag_seconds_max``, ``tailer_lag_seconds``, ``tailer_up``,
``tailer_position``, ``tailer_fanout_wait_seconds_total``, ``doorbell_up``,
``replay_waits_total``, ``replay_conflicts_total``,
``oldest_open_transaction_seconds``, ``feed_oldest_entry_seconds``,
``feed_max_age_seconds``, ``feed_bytes``, and the histograms
``flush_seconds`` (the CPU time of each fan-out flush) and
``entry_age_seconds`` (how old each entry was when the tailer handed it to
the fan-out). Also the process's own ``process_*`` metrics.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, ProcessCollector, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

from .figures import COUNTERS

__all__ = [
    "ENTRY_AGE_BUCKETS",
    "FLUSH_BUCKETS",
    "FastHistogram",
    "MetricsSnapshot",
    "PublisherMetrics",
]

ENTRY_AGE_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
"""Seconds: from a doorbell's few milliseconds to an open transaction's minutes."""

FLUSH_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1)


@dataclass(frozen=True, slots=True)
class MetricsSnapshot:
    """Every figure /metrics shows, read from the publisher's state at scrape time."""

    counters: dict[str, float]
    """Counter name (without ``changefeed_`` and ``_total``) -> value."""
    labelled_counters: dict[str, tuple[tuple[str, ...], dict[tuple[str, ...], float]]]
    """Counter name -> (label names, labels -> value)."""
    gauges: dict[str, float]
    labelled_gauges: dict[str, tuple[tuple[str, ...], dict[tuple[str, ...], float]]]


_GAUGE_HELP = {
    "listeners": "Connected, registered listener sockets",
    "open_connections": "Open /changefeeds websocket connections, registered or not",
    "catching_up": "Listeners catching up (behind the head) rather than served live",
    "active_registrations": "Registrations by resource",
    "window_bytes": "Estimated memory held by the window of recently tailed entries",
    "window_entries": "Entries in the window of recently tailed entries",
    "queue_depth_max": (
        "Most items any listener has yet to take of those queued for it (queued, being sent,"
        " or written and not acknowledged)"
    ),
    "queued_items": "Items waiting in all listener send queues",
    "lag_seconds_max": "Age of the oldest entry a listener has yet to take, over all listeners",
    "tailer_lag_seconds": (
        "Age of the newest entry at the time the tailer read it; on a standby, at least"
        " the wait of the oldest notified transaction not yet replayed"
    ),
    "tailer_up": "1 while the tailer is connected and running",
    "tailer_position": "Identity of the last entry the tailer read (grows while it makes progress)",
    "doorbell_up": (
        "1 while the doorbell of a tailer reading a standby is connected to the primary,"
        " listening or resting while the feed flows (always 1 for a tailer reading the primary)"
    ),
    "oldest_open_transaction_seconds": (
        "Age of the oldest open write transaction holding the horizon back"
    ),
    "feed_oldest_entry_seconds": (
        "Age of the oldest entry in the feed table (retention keeps it near max_age)"
    ),
    "feed_max_age_seconds": (
        "Configured max_age: entries older than this are trimmed (inline or by the Spark job)"
    ),
    "feed_bytes": "Size of the feed table on disk, indexes included",
}


_HELP = {**_GAUGE_HELP, **{f.metric: f.help for f in COUNTERS if f.metric is not None}}
"""Every metric's help: the gauges' here, the counters' where they are declared."""


class PublisherMetrics:
    """The publisher's /metrics: a registry that reads ``snapshot`` at each scrape.

    Args:
        snapshot: reads every figure from the publisher's state.
        histograms: histograms observed on the hot path (their own counts).
    """

    def __init__(
        self, snapshot: Callable[[], MetricsSnapshot], histograms: Iterable[FastHistogram]
    ) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        # process_resident_memory_bytes, process_open_fds, process_cpu_seconds_total...:
        # a slow leak or a descriptor per lingering socket shows on the same scrape.
        ProcessCollector(registry=self.registry)
        self.registry.register(_Snapshots(snapshot))
        for histogram in histograms:
            self.registry.register(histogram)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _Snapshots(Collector):
    def __init__(self, snapshot: Callable[[], MetricsSnapshot]) -> None:
        self._snapshot = snapshot

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        shot = self._snapshot()
        for name, value in shot.counters.items():
            yield CounterMetricFamily(f"changefeed_{name}", _HELP[name], value=value)
        for name, (labels, values) in shot.labelled_counters.items():
            counter = CounterMetricFamily(f"changefeed_{name}", _HELP[name], labels=labels)
            for key, value in values.items():
                counter.add_metric(list(key), value)
            yield counter
        for name, value in shot.gauges.items():
            yield GaugeMetricFamily(f"changefeed_{name}", _HELP[name], value=value)
        for name, (labels, values) in shot.labelled_gauges.items():
            gauge = GaugeMetricFamily(f"changefeed_{name}", _HELP[name], labels=labels)
            for key, value in values.items():
                gauge.add_metric(list(key), value)
            yield gauge


class FastHistogram(Collector):
    """A Prometheus histogram observed on the event loop's hot path.

    prometheus_client's ``Histogram.observe`` takes a lock and walks every
    bucket; a burst of a hundred thousand entries a second would pay that per
    entry. This one only bisects into plain counts, which the event loop's
    single thread owns, and builds the cumulative buckets at scrape time.

    Args:
        name: the metric's name.
        documentation: its help text.
        buckets: upper bounds, ascending (``+Inf`` is added).
    """

    def __init__(self, name: str, documentation: str, buckets: Sequence[float]) -> None:
        self._name = name
        self._documentation = documentation
        self._bounds = tuple(sorted(buckets))
        self._counts = [0] * (len(self._bounds) + 1)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        """Count one value (negative ones, from clock skew, count as 0)."""
        value = max(0.0, value)
        self._counts[bisect_left(self._bounds, value)] += 1
        self.sum += value

    @property
    def count(self) -> int:
        """Values observed so far."""
        return sum(self._counts)

    def collect(self) -> Iterator[HistogramMetricFamily]:
        buckets: list[tuple[str, float]] = []
        cumulative = 0
        for bound, count in zip((*self._bounds, float("inf")), self._counts, strict=True):
            cumulative += count
            buckets.append(("+Inf" if bound == float("inf") else repr(float(bound)), cumulative))
        yield HistogramMetricFamily(
            self._name, self._documentation, buckets=buckets, sum_value=self.sum
        )
