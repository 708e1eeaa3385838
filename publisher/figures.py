"""The publisher's counters, each declared once: its stats key, its metric, its help, its words.

Every count the publisher shows is *kept* in one place (``counters``: the
publisher's ``Counters``, each connection's ``Delivery``, the ``Tailer``,
``Catchup``, ``FeedPages``) and *declared* here, once: the key it has in the
``counters`` member of /changefeeds/stats, the name and help of its
Prometheus metric (``changefeed_<metric>_total``), the dashboard's words for
it in its "Since start" line, and how it is read. ``observe`` builds the
stats document's counters and the metrics snapshot from this table;
``metrics`` takes the help from it; the dashboard page carries the
``since_start`` words (``dashboard_labels``), and its script shows what
the table lists. Pure code.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .catchup import Catchup
from .counters import Counters
from .pages import FeedPages
from .tailer import Tailer

__all__ = ["COUNTERS", "CounterFigure", "Reading", "dashboard_labels"]


@dataclass(frozen=True, slots=True)
class Reading:
    """The places counters are kept, read once per stats document or scrape."""

    counters: Counters
    catchup: Catchup
    pages: FeedPages
    tailer: Tailer
    sent: int
    """Items taken by listeners: of connections open now, and gone."""
    frames: int
    dropped: int


Labelled = dict[tuple[str, ...], float]


@dataclass(frozen=True, slots=True)
class CounterFigure:
    """One counter, as every view of the publisher shows it.

    Attributes:
        help: what it counts (the metric's help).
        read: its value now (a total).
        stats: its key in the stats document's ``counters`` (None: not there).
        metric: its metric's name, without ``changefeed_`` and ``_total`` (None: none).
        labels: the metric's label names, when it is labelled ...
        by_label: ... and its values by label values.
        stats_breakdown: a key of the stats document's ``counters`` for its
            breakdown (``evictionsByCode``) ...
        breakdown: ... read this way.
        since_start: the dashboard's words for it (None: not shown there).
    """

    help: str
    read: Callable[[Reading], float] | None = None
    stats: str | None = None
    metric: str | None = None
    labels: tuple[str, ...] = ()
    by_label: Callable[[Reading], Labelled] | None = None
    stats_breakdown: str | None = None
    breakdown: Callable[[Reading], Any] | None = None
    since_start: str | None = None


def _registrations(r: Reading) -> Labelled:
    return {
        (resource, str(resumed).lower()): n
        for (resource, resumed), n in r.counters.registrations.items()
    }


COUNTERS: tuple[CounterFigure, ...] = (
    CounterFigure(
        "Websocket handshakes received on /changefeeds",
        lambda r: r.counters.connections_opened,
        stats="connections",
        metric="connections",
        since_start="connections opened",
    ),
    CounterFigure(
        "Websocket connections on /changefeeds that ended",
        lambda r: r.counters.connections_closed,
        stats="connectionsClosed",
    ),
    CounterFigure(
        "Listener connections registered",
        lambda r: r.counters.sessions,
        stats="listeners",
        since_start="listeners registered",
    ),
    CounterFigure(
        "Registrations accepted",
        lambda r: sum(r.counters.registrations.values()),
        stats="registrations",
        metric="registrations",
        labels=("resource", "resumed"),
        by_label=_registrations,
        since_start="registrations",
    ),
    CounterFigure(
        "Registered listeners gone, for any reason (evictions included)",
        lambda r: r.counters.disconnects,
        stats="disconnects",
        metric="disconnects",
        since_start="disconnects",
    ),
    CounterFigure(
        "Listeners the publisher closed: slow_listener (no progress for stall_timeout),"
        " keepalive_timeout (no pong and no progress through three ping_timeout deadlines),"
        " cursor_expired (trimmed past while catching up)",
        lambda r: sum(r.counters.evictions.values()),
        stats="evictions",
        metric="evictions",
        labels=("code",),
        by_label=lambda r: {(code,): n for code, n in r.counters.evictions.items()},
        stats_breakdown="evictionsByCode",
        breakdown=lambda r: dict(sorted(r.counters.evictions.items())),
        since_start="evictions",
    ),
    CounterFigure(
        "Times a live listener's queue could not take a batch and it went to catch-up",
        lambda r: r.counters.fell_behind,
        stats="fellBehind",
        metric="fell_behind",
    ),
    CounterFigure(
        "Times a listener that was behind reached the head and went live again",
        lambda r: r.catchup.rejoined,
        stats="rejoined",
        metric="rejoined",
    ),
    CounterFigure(
        "Items queued for listeners catching up from the window of recent entries",
        lambda r: r.catchup.from_window,
        stats="caughtUpFromWindow",
    ),
    CounterFigure(
        "Items queued for listeners catching up from pages of the feed table",
        lambda r: r.catchup.from_feed,
        stats="caughtUpFromFeed",
    ),
    CounterFigure(
        "Items queued for listeners catching up, by source (window, feed)",
        metric="catchup_items",
        labels=("source",),
        by_label=lambda r: {("window",): r.catchup.from_window, ("feed",): r.catchup.from_feed},
    ),
    CounterFigure(
        "Pages of the feed table read for listeners behind the window",
        lambda r: r.pages.reads_total,
        stats="pageReads",
        metric="catchup_page_reads",
    ),
    CounterFigure(
        "Catch-up pages served from what another listener's read brought",
        lambda r: r.pages.shared_total,
        stats="pagesShared",
        metric="catchup_pages_shared",
    ),
    CounterFigure(
        "Change items listeners took (with direct writes: acknowledged by their TCP;"
        " through ASGI: written)",
        lambda r: r.sent,
        stats="sent",
        metric="deliveries",
        since_start="items sent",
    ),
    CounterFigure(
        "Websocket frames of change items written (a batch frame counts once)",
        lambda r: r.frames,
        stats="frames",
        metric="frames",
        since_start="frames",
    ),
    CounterFigure(
        "Items queued for listeners whose connection closed before they were written",
        lambda r: r.dropped,
        stats="dropped",
        metric="dropped",
        since_start="items dropped",
    ),
    CounterFigure(
        "Requests and connections refused, by error code and endpoint (websocket, http)",
        stats_breakdown="refused",
        breakdown=lambda r: r.counters.refusals_by_code(),
        metric="refusals",
        labels=("code", "endpoint"),
        by_label=lambda r: dict(r.counters.refusals.items()),
    ),
    CounterFigure(
        "Feed entries read by the tailer",
        lambda r: r.tailer.entries_total,
        metric="entries_tailed",
    ),
    CounterFigure(
        "Items queued to listener send queues (live and catch-up)",
        lambda r: r.counters.queued_live + r.catchup.from_window + r.catchup.from_feed,
        metric="queued",
    ),
    CounterFigure(
        "Time the tailer waited, between full batches, for the fan-out to reach every listener",
        lambda r: r.tailer.fanout_wait_seconds,
        metric="tailer_fanout_wait_seconds",
    ),
    CounterFigure(
        "Reads of a standby made again because it had not yet replayed a transaction"
        " the doorbell named",
        lambda r: r.tailer.replay_waits_total,
        metric="replay_waits",
    ),
    CounterFigure(
        "Reads of a standby cancelled by a conflict with replay, and read again",
        lambda r: r.tailer.replay_conflicts_total,
        metric="replay_conflicts",
    ),
)
"""Every counter of the publisher, in the order the stats document lists them."""


def dashboard_labels() -> list[list[str]]:
    """The dashboard's "Since start" line: [stats key, words] of each counter it shows."""
    return [[f.stats, f.since_start] for f in COUNTERS if f.stats and f.since_start]
