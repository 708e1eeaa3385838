"""Figures: each counter and gauge of a status snapshot, declared once, on its field.

A snapshot dataclass (``ListenerStatus``, ``ControllerStats``, and the
``CheckpointStatus`` and ``BootstrapProgress`` inside a listener's) declares
each field that is also a metric with ``figure(help, kind, metric=...)``:
what it means, whether it is a counter or a gauge, and the Prometheus
metric's name. ``_metrics`` reads these declarations to describe the metric
families, and a snapshot's values at scrape time; the snapshot's
documentation is the same text. A counter is declared on a counts record
(``ListenerCounts``, ``ControllerCounts``), counted where it happens, and the
snapshot, a subclass of the record, copies it whole (``ListenerStatus.of``,
``ControllerStats.of``): it is named nowhere else, but for the listener's
properties that show a count as an attribute (``listener.attempts``).

Pure code: no Prometheus here.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import MISSING, dataclass, field, fields, is_dataclass
from typing import Any

__all__ = [
    "COUNTER",
    "GAUGE",
    "Family",
    "Figure",
    "Labels",
    "families",
    "figure",
    "nested",
    "samples",
]

COUNTER = "counter"
GAUGE = "gauge"

_KEY = "changefeed.figure"

Labels = tuple[tuple[str, str], ...]
"""(label name, value) pairs."""

Reader = Callable[[Any], Iterable[tuple[Labels, float]]]
"""A field's value as samples: (labels, value), for labelled or computed figures."""


@dataclass(frozen=True, slots=True)
class Figure:
    """One field's metric (``figure``), or a field holding snapshots with their own
    figures (``nested``)."""

    help: str
    kind: str = COUNTER
    metric: str | None = None
    """The metric's name after the family's prefix (None: the field's name)."""
    labels: tuple[str, ...] = ()
    read: Reader | None = None
    inner: type | None = None
    """For ``nested``: the snapshot class inside (alone, None, or a tuple of them)."""
    label: str | None = None
    """For ``nested``: each inner snapshot's field whose value labels its samples."""


def figure(
    help: str,
    kind: str = COUNTER,
    *,
    metric: str | None = None,
    labels: tuple[str, ...] = (),
    read: Reader | None = None,
    default: Any = MISSING,
    default_factory: Any = MISSING,
) -> Any:
    """A dataclass field that is also a metric.

    Args:
        help: what it counts or measures (the metric's help, the field's doc).
        kind: ``COUNTER`` or ``GAUGE``.
        metric: the metric's name after the family prefix (default: the field's).
        labels: the label names ``read`` gives values for.
        read: turns the field's value into samples (default: one, unlabelled).
    """
    return field(
        default=default,
        default_factory=default_factory,
        metadata={_KEY: Figure(help, kind, metric, labels, read)},
    )


def nested(
    inner: type, help: str, *, label: str | None = None, default: Any = MISSING,
    default_factory: Any = MISSING,
) -> Any:  # fmt: skip
    """A dataclass field holding one snapshot of ``inner`` (or None), or a tuple of them
    labelled by their field ``label``; their own figures count."""
    return field(
        default=default,
        default_factory=default_factory,
        metadata={_KEY: Figure(help, inner=inner, label=label)},
    )


@dataclass(frozen=True, slots=True)
class Family:
    """A metric family a snapshot class declares."""

    name: str
    kind: str
    help: str
    labels: tuple[str, ...]


def families(cls: type, labels: tuple[str, ...] = ()) -> Iterator[Family]:
    """Every metric family ``cls`` (a snapshot dataclass) declares, nested ones included."""
    for f in fields(cls):
        fig: Figure | None = f.metadata.get(_KEY)
        if fig is None:
            continue
        if fig.inner is not None:
            yield from families(fig.inner, labels + ((fig.label,) if fig.label else ()))
        else:
            yield Family(fig.metric or f.name, fig.kind, fig.help, labels + fig.labels)


def samples(snapshot: Any, labels: Labels = ()) -> Iterator[tuple[str, Labels, float]]:
    """Every sample of ``snapshot``: (metric name, labels, value)."""
    for f in fields(snapshot):
        fig: Figure | None = f.metadata.get(_KEY)
        if fig is None:
            continue
        value = getattr(snapshot, f.name)
        if fig.inner is not None:
            inner = value if isinstance(value, tuple) else () if value is None else (value,)
            for item in inner:
                assert is_dataclass(item)
                extra = ((fig.label, str(getattr(item, fig.label))),) if fig.label else ()
                yield from samples(item, labels + extra)
        elif fig.read is not None:
            for pairs, number in fig.read(value):
                yield fig.metric or f.name, labels + pairs, number
        else:
            yield fig.metric or f.name, labels, float(value)
