"""``changefeed stats``: a publisher's /changefeeds/stats, for a person at a terminal. Pure code.

The sections follow the runbook's questions in order: is the publisher up and
serving (tailer, draining, failed work), is the feed moving (head, low-water
mark, oldest open transaction, age and size), who is listening and how far
behind each one is, and what went wrong lately (evictions, refusals). Every
figure is the stats document's; nothing is computed that stats does not say.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from changefeed.visible import visible

__all__ = ["render_stats"]


def render_stats(doc: dict[str, Any], *, width: int | None = None) -> str:
    """The stats document as aligned text sections (``width``: cut longer lines, as
    for a terminal of that many columns; None: never cut)."""
    lines: list[str] = []
    lines += _overview(doc)
    lines += ["", *_listeners(doc.get("registrations") or [])]
    evictions = doc.get("recentEvictions") or []
    refusals = doc.get("recentRefusals") or []
    if evictions:
        lines += ["", *_evictions(evictions)]
    if refusals:
        lines += ["", *_refusals(refusals)]
    # Names and reasons come from listeners and clients: no control or format
    # character of theirs reaches the terminal as itself.
    lines = [visible(line) for line in lines]
    if width is None:
        return "\n".join(lines)
    return "\n".join(line if len(line) <= width else line[: width - 1] + "…" for line in lines)


def _overview(doc: dict[str, Any]) -> list[str]:
    tailer = doc.get("tailer") or {}
    feed = doc.get("feed") or {}
    window = doc.get("window") or {}
    counters = doc.get("counters") or {}
    catching_up = doc.get("catchingUp")
    rows = [
        (
            "publisher",
            f"listeners {doc.get('listeners', 0)}"
            + (f" ({catching_up} catching up)" if catching_up else "")
            + f", connections {doc.get('connections', '?')}"
            + (", DRAINING" if doc.get("draining") else ""),
        ),
        (
            "tailer",
            f"{tailer.get('status', '?')}, at {_position(tailer.get('position'))},"
            f" {_count(tailer.get('entries'))} entries read,"
            f" lag {_seconds(tailer.get('lagSeconds'))},"
            f" {_count(tailer.get('reconnects'))} reconnects",
        ),
        ("last error", tailer.get("lastError") or "none"),
        (
            "horizon",
            f"oldest open transaction {_seconds(tailer.get('oldestOpenTransactionSeconds'))}"
            f", fan-out wait {_seconds(tailer.get('fanoutWaitSeconds'))}",
        ),
        (
            "feed",
            f"head {_position(feed.get('head'))}, low-water {_position(feed.get('lowWater'))},"
            f" oldest entry {_seconds(feed.get('oldestEntrySeconds'))},"
            f" {_bytes(feed.get('bytes'))}",
        ),
    ]
    doorbell = tailer.get("doorbell")
    if tailer.get("reads") == "read_dsn" and isinstance(doorbell, dict):
        rows.append(
            (
                "standby",
                f"reads read_dsn; doorbell {doorbell.get('status', '?')}"
                f" ({_count(doorbell.get('rests'))} rests,"
                f" {_count(doorbell.get('reconnects'))} reconnects);"
                f" {_count(tailer.get('replayWaits'))} replay waits,"
                f" {_count(tailer.get('replayConflicts'))} replay conflicts",
            )
        )
        if doorbell.get("lastError"):
            rows.append(("doorbell error", str(doorbell["lastError"])))
    if window:
        rows.append(
            (
                "window",
                f"{_count(window.get('entries'))} entries after {_position(window.get('base'))},"
                f" {_bytes(window.get('bytes'))} of {_bytes(window.get('maxBytes'))}",
            )
        )
    latest = ((doc.get("rates") or {}).get("samples") or [None])[-1]
    if latest:
        rows.append(
            (
                "rates",
                f"{_rate(latest.get('entriesPerSecond'))} entries/s,"
                f" {_rate(latest.get('deliveriesPerSecond'))} deliveries/s,"
                f" {_rate(latest.get('evictionsPerSecond'))} evictions/s",
            )
        )
    failed = doc.get("failed") or {}
    rows.append(("failed", ", ".join(f"{k}: {v}" for k, v in failed.items()) or "none"))
    by_code = counters.get("evictionsByCode") or {}
    rows += [
        (
            "counters",
            f"connections {_count(counters.get('connections'))}"
            f" (closed {_count(counters.get('connectionsClosed'))}),"
            f" listeners {_count(counters.get('listeners'))},"
            f" registrations {_count(counters.get('registrations'))},"
            f" disconnects {_count(counters.get('disconnects'))}",
        ),
        (
            "",
            f"evictions {_count(counters.get('evictions'))}"
            + (f" ({_pairs(by_code)})" if by_code else "")
            + f", fell behind {_count(counters.get('fellBehind'))},"
            f" rejoined {_count(counters.get('rejoined'))}",
        ),
        (
            "",
            f"sent {_count(counters.get('sent'))} items in {_count(counters.get('frames'))}"
            f" frames, dropped {_count(counters.get('dropped'))},"
            f" caught up {_count(counters.get('caughtUpFromWindow'))} from the window and"
            f" {_count(counters.get('caughtUpFromFeed'))} from the feed"
            f" ({_count(counters.get('pageReads'))} page reads,"
            f" {_count(counters.get('pagesShared'))} shared)",
        ),
        ("refused", _pairs(counters.get("refused") or {}) or "none"),
    ]
    label = max(len(name) for name, _ in rows)
    return [f"{name:<{label}}  {text}" for name, text in rows]


def _listeners(rows: Sequence[dict[str, Any]]) -> list[str]:
    if not rows:
        return ["LISTENERS  none"]
    table = [
        (
            str(r.get("service", "")),
            _short(str(r.get("instance", "")), 36),
            _kind(r.get("changeKind") or {}),
            str(r.get("peer", "")),
            str(r.get("connectedSince", "")).replace("T", " ")[:19],
            str(r.get("state", "live")).replace("_", " "),
            _count(r.get("delivered")),
            _count(r.get("queueDepth")),
            _count(r.get("lagEntries")),
            _seconds(r.get("lagSeconds")),
        )
        for r in rows
    ]
    head = (
        "SERVICE", "INSTANCE", "CHANGE KIND", "PEER", "CONNECTED (UTC)", "STATE",
        "DELIVERED", "QUEUE", "LAG", "LAG TIME",
    )  # fmt: skip
    return [f"LISTENERS  {len(rows)} registrations", *_table(head, table, numeric=6)]


def _evictions(rows: Sequence[dict[str, Any]]) -> list[str]:
    table = [
        (
            str(e.get("at", "")).replace("T", " ")[:23],
            str(e.get("code", "")),
            f"{e.get('service', '')}/{_short(str(e.get('instance', '')), 36)}",
            str(e.get("peer", "")),
            _count(e.get("delivered")),
        )
        for e in reversed(rows)
    ]
    head = ("AT (UTC)", "CODE", "LISTENER", "PEER", "DELIVERED")
    return [f"RECENT EVICTIONS  {len(rows)}, newest first", *_table(head, table, numeric=4)]


def _refusals(rows: Sequence[dict[str, Any]]) -> list[str]:
    table = [
        (
            str(r.get("at", "")).replace("T", " ")[:23],
            str(r.get("code", "")),
            str(r.get("endpoint", "")),
            str(r.get("peer", "")),
            _short(str(r.get("reason", "")), 60),
        )
        for r in reversed(rows)
    ]
    head = ("AT (UTC)", "CODE", "ENDPOINT", "PEER", "REASON")
    return [f"RECENT REFUSALS  {len(rows)}, newest first", *_table(head, table)]


def _table(
    head: Sequence[str], rows: Iterable[Sequence[str]], *, numeric: int | None = None
) -> list[str]:
    """Columns aligned; those from index ``numeric`` on (numbers) to the right. Cells
    are escaped (``visible``) before they are measured: an escape is wider than the
    character it stands for."""
    head = [visible(c) for c in head]
    rows = [[visible(c) for c in r] for r in rows]
    widths = [max(len(c) for c in column) for column in zip(head, *rows, strict=True)]

    def line(cells: Sequence[str]) -> str:
        return "  ".join(
            c.rjust(w) if numeric is not None and i >= numeric else c.ljust(w)
            for i, (c, w) in enumerate(zip(cells, widths, strict=True))
        ).rstrip()

    return [line(head), *(line(r) for r in rows)]


def _kind(kind: dict[str, Any]) -> str:
    subs = ",".join(kind.get("subResources") or []) or "*"
    return f"{kind.get('resource', '?')}[{subs}]"


def _short(text: str, most: int) -> str:
    return text if len(text) <= most else text[: most - 1] + "…"


def _position(position: Any) -> str:
    return f"{position[0]}:{position[1]}" if position else "-"


def _count(value: Any) -> str:
    return f"{value:,}" if isinstance(value, int) else "-"


def _rate(value: Any) -> str:
    return f"{value:,.1f}" if isinstance(value, int | float) else "-"


def _seconds(value: Any) -> str:
    if not isinstance(value, int | float):
        return "-"
    if value < 1:
        return f"{value * 1000:.0f} ms"
    if value < 120:
        return f"{value:.1f} s"
    if value < 7200:
        return f"{value / 60:.0f} min"
    return f"{value / 3600:.1f} h"


def _bytes(value: Any) -> str:
    if not isinstance(value, int | float):
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return "-"  # pragma: no cover - the loop returns


def _pairs(counts: dict[str, Any]) -> str:
    return ", ".join(f"{name} {_count(count)}" for name, count in sorted(counts.items()))
