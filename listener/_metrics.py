"""Prometheus metrics of listeners and controllers, on a registry the application chooses.

Nothing is counted twice, nor declared twice: a collector reads each
listener's ``status()`` and each controller's ``stats()`` at scrape time, and
the families, their kinds and their help come from the figures those
snapshots declare on their fields (``_figures``). One collector per registry
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
from typing import TYPE_CHECKING, Any, Protocol

from ._events import ControllerStats, ListenerStatus
from ._figures import COUNTER, families, samples

if TYPE_CHECKING:  # prometheus-client is needed only by whoever passes a registry
    from prometheus_client import CollectorRegistry
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

__all__ = [
    "MetricSource",
    "Sample",
    "register_controller",
    "register_listener",
    "samples_of",
]


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


_FAMILIES: tuple[tuple[str, str, type], ...] = (
    ("changefeed_listener_", "listener", ListenerStatus),
    ("changefeed_", "controller", ControllerStats),
)
"""Prefix, the source's label, and the snapshot class that declares the figures."""


def samples_of(prefix: str, snapshot: Any) -> list[Sample]:
    """A snapshot's figures as samples of the families ``prefix`` names."""
    return [Sample(prefix + name, value, labels) for name, labels, value in samples(snapshot)]


class _Collector:
    """A prometheus_client collector (its ``describe`` and ``collect``)."""

    def __init__(self) -> None:
        self._sources: weakref.WeakSet[MetricSource] = weakref.WeakSet()

    def add(self, source: MetricSource) -> None:
        self._sources.add(source)

    def _families(self) -> dict[str, CounterMetricFamily | GaugeMetricFamily]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        made: dict[str, CounterMetricFamily | GaugeMetricFamily] = {}
        for prefix, label, snapshot in _FAMILIES:
            for family in families(snapshot):
                name, labels = prefix + family.name, [label, *family.labels]
                if family.kind == COUNTER:
                    made[name] = CounterMetricFamily(name, family.help, labels=labels)
                else:
                    made[name] = GaugeMetricFamily(name, family.help, labels=labels)
        return made

    def describe(self) -> Iterator[Metric]:
        return iter(self._families().values())

    def collect(self) -> Iterator[Metric]:
        made = self._families()
        for source in list(self._sources):
            for sample in source.metric_samples():
                values = [source.name, *(v for _, v in sample.labels)]
                made[sample.name].add_metric(values, sample.value)
        return iter(made.values())


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
