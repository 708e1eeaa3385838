"""Prometheus metrics of listeners and controllers, on a registry the application chooses.

Nothing is counted twice: a collector reads each listener's ``status()`` and
each controller's ``stats()`` at scrape time. One collector per registry
serves every listener and controller registered on it, told apart by the
``listener`` / ``controller`` label (their ``name``, which must therefore be
unique per registry).

It must never keep a listener or controller alive (weak references only) or
register the same metric name twice on one registry.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:  # prometheus-client is needed only by whoever passes a registry
    from prometheus_client import CollectorRegistry
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

__all__ = ["MetricSource", "Sample", "register_controller", "register_listener"]


@dataclass(frozen=True, slots=True)
class Sample:
    """One value of one metric family."""

    name: str
    value: float
    labels: tuple[tuple[str, str], ...] = ()


class MetricSource(Protocol):
    """A listener or a controller: a name, and its samples at scrape time."""

    name: str

    def metric_samples(self) -> list[Sample]: ...


_Spec = tuple[str, str, str] | tuple[str, str, str, tuple[str, ...]]
# name, kind ("gauge"/"counter"), help[, labels besides the listener's / controller's name]

_LISTENER: tuple[_Spec, ...] = (
    (
        "changefeed_listener_state",
        "gauge",
        "1 for the listener's current lifecycle state",
        ("state",),
    ),
    ("changefeed_listener_connection_attempts", "counter", "Connection attempts"),
    ("changefeed_listener_registrations", "counter", "Acks received"),
    ("changefeed_listener_resumes", "counter", "Registrations with since answered resumed=true"),
    ("changefeed_listener_bootstraps", "counter", "Bootstrap walks completed"),
    ("changefeed_listener_aborts", "counter", "Connections that ended (any reason)"),
    ("changefeed_listener_overflows", "counter", "Buffer overflows (each one an abort)"),
    ("changefeed_listener_buffer_items", "gauge", "Items buffered for the application"),
    ("changefeed_listener_buffer_capacity", "gauge", "Items the buffer holds at most"),
    ("changefeed_listener_backoff_seconds", "gauge", "Current or last back-off delay"),
    ("changefeed_listener_backoff_failures", "gauge", "Consecutive failed attempts"),
    ("changefeed_listener_items_received", "counter", "Change items read from the socket"),
    ("changefeed_listener_items_delivered", "counter", "Change items handed to the application"),
    (
        "changefeed_listener_not_resumed",
        "counter",
        "Acks that did not resume the since given, by the ack's reason",
        ("reason",),
    ),
    ("changefeed_listener_checkpoint_saves", "counter", "Checkpoints saved"),
    ("changefeed_listener_checkpoint_save_failures", "counter", "Checkpoint saves that failed"),
    (
        "changefeed_listener_checkpoint_failing_saves",
        "gauge",
        "Checkpoint saves failed since the last that succeeded (above 0: the store is behind)",
    ),
    ("changefeed_listener_checkpoint_save_seconds", "gauge", "How long the last save took"),
    (
        "changefeed_listener_checkpoint_age_seconds",
        "gauge",
        "Seconds since the last checkpoint saved was taken (what a restart now replays)",
    ),
    (
        "changefeed_listener_bootstrap_items",
        "gauge",
        "Items of the bootstrap walk under way, or of the last one",
        ("resource",),
    ),
    (
        "changefeed_listener_bootstrap_pages",
        "gauge",
        "Pages of the bootstrap walk under way, or of the last one",
        ("resource",),
    ),
    (
        "changefeed_listener_bootstrap_items_per_second",
        "gauge",
        "Items per second of the bootstrap walk under way, or of the last one",
        ("resource",),
    ),
)

_CONTROLLER: tuple[_Spec, ...] = (
    ("changefeed_workqueue_depth", "gauge", "Ids ready to be processed"),
    ("changefeed_workqueue_pending", "gauge", "Ids queued, requeued or waiting out a retry"),
    ("changefeed_workqueue_processing", "gauge", "Ids being processed"),
    ("changefeed_workqueue_adds", "counter", "Ids added to the work queue"),
    ("changefeed_workqueue_coalesced", "counter", "Adds of an id already queued"),
    ("changefeed_workqueue_retries", "counter", "Rate-limited re-adds after a failure"),
    ("changefeed_controller_fetches", "counter", "Resources fetched"),
    ("changefeed_controller_fetch_requests", "counter", "HTTP fetch requests (batched)"),
    ("changefeed_controller_fetch_errors", "counter", "Failed fetch requests"),
    ("changefeed_controller_decode_errors", "counter", "Resources the decoder refused"),
    ("changefeed_controller_reconciles", "counter", "Callbacks completed"),
    ("changefeed_controller_reconcile_errors", "counter", "Callbacks that raised"),
    ("changefeed_controller_resyncs", "counter", "Bootstraps applied to the mirror"),
    (
        "changefeed_controller_periodic_resyncs",
        "counter",
        "Passes handing every mirrored resource to the callbacks again",
    ),
    ("changefeed_controller_mirror_items", "gauge", "Resources in the mirror"),
)


class _Collector:
    """A prometheus_client collector (its ``describe`` and ``collect``)."""

    def __init__(self) -> None:
        self._sources: weakref.WeakSet[MetricSource] = weakref.WeakSet()

    def add(self, source: MetricSource) -> None:
        self._sources.add(source)

    def _families(self) -> dict[str, CounterMetricFamily | GaugeMetricFamily]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        families: dict[str, CounterMetricFamily | GaugeMetricFamily] = {}
        for specs, label in ((_LISTENER, "listener"), (_CONTROLLER, "controller")):
            for name, kind, doc, *rest in specs:
                extra = list(rest[0]) if rest else []
                if kind == "counter":
                    families[name] = CounterMetricFamily(name, doc, labels=[label, *extra])
                else:
                    families[name] = GaugeMetricFamily(name, doc, labels=[label, *extra])
        return families

    def describe(self) -> Iterator[Metric]:
        return iter(self._families().values())

    def collect(self) -> Iterator[Metric]:
        families = self._families()
        for source in list(self._sources):
            for sample in source.metric_samples():
                family = families[sample.name]
                values = [source.name, *(v for _, v in sample.labels)]
                family.add_metric(values, sample.value)
        return iter(families.values())


_COLLECTORS: weakref.WeakKeyDictionary[CollectorRegistry, _Collector] = weakref.WeakKeyDictionary()


def _collector(registry: CollectorRegistry) -> _Collector:
    collector = _COLLECTORS.get(registry)
    if collector is None:
        collector = _Collector()
        registry.register(collector)
        _COLLECTORS[registry] = collector
    return collector


def register_listener(registry: CollectorRegistry, listener: MetricSource) -> None:
    """Expose ``listener``'s status as ``changefeed_listener_*`` metrics on ``registry``."""
    _collector(registry).add(listener)


def register_controller(registry: CollectorRegistry, controller: MetricSource) -> None:
    """Expose ``controller``'s stats as ``changefeed_workqueue_*`` / ``changefeed_controller_*``."""
    _collector(registry).add(controller)
