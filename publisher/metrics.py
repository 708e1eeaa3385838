"""Prometheus metrics of one publisher (invariant I7), on its own registry.

Each Publisher has its own CollectorRegistry, so several publishers (tests,
multi-feed processes) never clash; ``GET /metrics`` renders it. Counters
move as things happen; the gauges marked "at scrape time" are computed from
the publisher's state when /metrics is read, so they cost nothing between
scrapes.

Names (all prefixed ``changefeed_``): ``listeners``, ``open_connections``,
``active_registrations{resource}``, ``registrations_total{resource,resumed}``,
``connections_total``, ``refusals_total{code,endpoint}``,
``disconnects_total``, ``evictions_total``, ``dropped_total``,
``entries_tailed_total``, ``queued_total``, ``deliveries_total``,
``frames_total``, ``replayed_total``, ``queue_depth_max``, ``queued_items``,
``tailer_lag_seconds``, ``tailer_up``, ``tailer_position``,
``tailer_fanout_wait_seconds_total``, ``oldest_open_transaction_seconds``,
``feed_oldest_entry_seconds``, ``feed_max_age_seconds``, ``feed_bytes``,
``flush_seconds`` (histogram: the CPU time of each fan-out flush, all its
slices together), ``entry_age_seconds`` (histogram: how old each entry was
when the tailer handed it to the fan-out). Also the process's own
``process_*`` metrics (resident memory, open descriptors, CPU seconds; Linux).
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable, Iterator, Sequence

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    ProcessCollector,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

__all__ = ["AgeHistogram", "PublisherMetrics"]

_AGE_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
"""Seconds: from a doorbell's few milliseconds to an open transaction's minutes."""


class PublisherMetrics:
    """The publisher's counters and gauges."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        # process_resident_memory_bytes, process_open_fds, process_cpu_seconds_total...:
        # a slow leak or a descriptor per lingering socket shows on the same scrape.
        ProcessCollector(registry=r)
        self.listeners = Gauge(
            "changefeed_listeners", "Connected, registered listener sockets", registry=r
        )
        self.connections = Gauge(
            "changefeed_open_connections",
            "Open /changefeeds websocket connections, registered or not (at scrape time)",
            registry=r,
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
        self.connections_total = Counter(
            "changefeed_connections_total",
            "Websocket handshakes received on /changefeeds",
            registry=r,
        )
        self.refusals_total = Counter(
            "changefeed_refusals_total",
            "Requests and connections refused, by error code and endpoint (websocket, http)",
            ["code", "endpoint"],
            registry=r,
        )
        self.disconnects_total = Counter(
            "changefeed_disconnects_total",
            "Registered listeners gone, for any reason (evictions included)",
            registry=r,
        )
        self.evictions_total = Counter(
            "changefeed_evictions_total",
            "Listeners evicted because their send queue was full (close code 4009)",
            registry=r,
        )
        self.dropped_total = Counter(
            "changefeed_dropped_total",
            "Items not delivered because their listener was evicted or went away",
            registry=r,
        )
        self.replayed_total = Counter(
            "changefeed_replayed_total", "Change items replayed to resuming listeners", registry=r
        )
        self.queue_depth = Gauge(
            "changefeed_queue_depth_max",
            "Deepest listener send queue, in items (at scrape time)",
            registry=r,
        )
        self.queued_items = Gauge(
            "changefeed_queued_items",
            "Items waiting in all listener send queues (at scrape time)",
            registry=r,
        )
        self.tailer_lag = Gauge(
            "changefeed_tailer_lag_seconds",
            "Age of the newest entry at the time the tailer read it",
            registry=r,
        )
        self.tailer_up = Gauge(
            "changefeed_tailer_up", "1 while the tailer is connected and running", registry=r
        )
        self.tailer_position = Gauge(
            "changefeed_tailer_position",
            "Identity of the last entry the tailer read (grows while it makes progress)",
            registry=r,
        )
        self.oldest_xact = Gauge(
            "changefeed_oldest_open_transaction_seconds",
            "Age of the oldest open write transaction holding the horizon back",
            registry=r,
        )
        self.flush_seconds = Histogram(
            "changefeed_flush_seconds",
            "Time one fan-out flush spent writing to listener connections (all its slices)",
            buckets=(0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1),
            registry=r,
        )
        self.feed_oldest_entry = Gauge(
            "changefeed_feed_oldest_entry_seconds",
            "Age of the oldest entry in the feed table (retention keeps it near max_age)",
            registry=r,
        )
        self.feed_max_age = Gauge(
            "changefeed_feed_max_age_seconds",
            "Configured max_age: entries older than this are trimmed (inline or by the Spark job)",
            registry=r,
        )
        self.feed_bytes = Gauge(
            "changefeed_feed_bytes",
            "Size of the feed table on disk, indexes included",
            registry=r,
        )
        self.entry_age = AgeHistogram(
            "changefeed_entry_age_seconds",
            "Age of each feed entry (now minus its published time, the database's clock)"
            " when the tailer handed it to the fan-out: the delay listeners see, before"
            " the flush and the network",
            buckets=_AGE_BUCKETS,
        )
        r.register(self.entry_age)
        self._live = _LiveCounters(
            {
                "changefeed_entries_tailed": "Feed entries read by the tailer",
                "changefeed_queued": "Items queued to listener send queues",
                "changefeed_deliveries": (
                    "Change items written to listener sockets (replays included)"
                ),
                "changefeed_frames": (
                    "Websocket frames of live change items written (a batch frame counts once)"
                ),
                "changefeed_tailer_fanout_wait_seconds": (
                    "Time the tailer waited, between full batches, for the fan-out to reach"
                    " every listener"
                ),
            }
        )
        r.register(self._live)

    def bind(
        self,
        *,
        queue_depth: Callable[[], float],
        queued: Callable[[], float],
        connections: Callable[[], float],
        lag: Callable[[], float],
        up: Callable[[], float],
        oldest_xact: Callable[[], float],
        position: Callable[[], float],
        oldest_entry: Callable[[], float],
        feed_bytes: Callable[[], float],
    ) -> None:
        """Compute the live gauges from the publisher's state at scrape time."""
        self.queue_depth.set_function(queue_depth)
        self.queued_items.set_function(queued)
        self.connections.set_function(connections)
        self.tailer_lag.set_function(lag)
        self.tailer_up.set_function(up)
        self.oldest_xact.set_function(oldest_xact)
        self.tailer_position.set_function(position)
        self.feed_oldest_entry.set_function(oldest_entry)
        self.feed_bytes.set_function(feed_bytes)

    def count_live(
        self,
        *,
        entries: Callable[[], int],
        queued: Callable[[], int],
        deliveries: Callable[[], int],
        frames: Callable[[], int],
        fanout_wait: Callable[[], float],
    ) -> None:
        """Read the fan-out's hot counters from the publisher's plain integers at scrape
        time (a Prometheus ``inc`` per frame would cost more than the frame)."""
        self._live.sources = {
            "changefeed_entries_tailed": entries,
            "changefeed_queued": queued,
            "changefeed_deliveries": deliveries,
            "changefeed_frames": frames,
            "changefeed_tailer_fanout_wait_seconds": fanout_wait,
        }

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _LiveCounters(Collector):
    """Counters read from the publisher's integers when /metrics is scraped (0 until bound)."""

    def __init__(self, documentation: dict[str, str]) -> None:
        self._documentation = documentation
        self.sources: dict[str, Callable[[], float]] = {}

    def collect(self) -> Iterator[CounterMetricFamily]:
        for name, text in self._documentation.items():
            source = self.sources.get(name)
            yield CounterMetricFamily(name, text, value=source() if source else 0)


class AgeHistogram(Collector):
    """A Prometheus histogram observed once per feed entry on the tailer's path.

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
        self._sum = 0.0

    def observe(self, value: float) -> None:
        """Count one value (negative ones, from clock skew, count as 0)."""
        value = max(0.0, value)
        self._counts[bisect_left(self._bounds, value)] += 1
        self._sum += value

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
            self._name, self._documentation, buckets=buckets, sum_value=self._sum
        )
