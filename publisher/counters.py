"""The publisher's event counts, kept once. Pure code.

Every count the publisher shows lives in exactly one place: events of the
publisher here (``Counters``), each connection's deliveries on its
``Delivery``, the tailer's reads on the ``Tailer``, catch-up on ``Catchup``
and ``FeedPages``. ``/changefeeds/stats`` and ``/metrics`` both read those
places; nothing is counted twice. Totals over connections add what the gone
ones delivered (kept here when they go) to what the open ones have.
"""

from __future__ import annotations

from collections import Counter, deque
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

__all__ = ["Counters", "timestamp"]

_RECENT_KEPT = 100
"""Recent evictions and refusals kept for stats."""


def timestamp(moment: datetime | None = None) -> str:
    """``moment`` (default: now) as the stats' ISO 8601 UTC text, to the millisecond."""
    moment = moment or datetime.now(UTC)
    return moment.isoformat(timespec="milliseconds").replace("+00:00", "Z")


@dataclass(slots=True)
class Counters:
    """Counts of what happened to one publisher since it started."""

    connections_opened: int = 0
    """Websocket handshakes on /changefeeds (whatever became of them)."""
    connections_closed: int = 0
    sessions: int = 0
    """Listener connections registered."""
    registrations: Counter[tuple[str, bool]] = field(default_factory=Counter)
    """Change kinds registered, by (resource, resumed)."""
    disconnects: int = 0
    """Registered connections gone, for any reason."""
    evictions: Counter[str] = field(default_factory=Counter)
    """Connections the publisher closed, by error code (slow_listener, cursor_expired)."""
    refusals: Counter[tuple[str, str]] = field(default_factory=Counter)
    """Refused requests and registrations, by (error code, endpoint)."""
    fell_behind: int = 0
    """Times a live listener's queue could not take a batch and it went to catch-up."""
    queued_live: int = 0
    """Items queued by live dispatch."""
    gone_sent: int = 0
    """Items written to connections that are gone."""
    gone_frames: int = 0
    gone_dropped: int = 0
    """Items queued for connections that closed before they were written."""
    recent_evictions: deque[dict[str, Any]] = field(
        default_factory=lambda: deque(maxlen=_RECENT_KEPT)
    )
    recent_refusals: deque[dict[str, Any]] = field(
        default_factory=lambda: deque(maxlen=_RECENT_KEPT)
    )

    @property
    def connections_open(self) -> int:
        return self.connections_opened - self.connections_closed

    def refused(self, code: str, endpoint: str, peer: str, reason: str) -> None:
        """Count one refusal and remember it among the recent ones."""
        self.refusals[code, endpoint] += 1
        self.recent_refusals.append(
            {
                "at": timestamp(),
                "code": code,
                "endpoint": endpoint,
                "peer": peer,
                "reason": reason[:256],
            }
        )

    def refusals_by_code(self) -> dict[str, int]:
        """Refusals by error code, all endpoints together."""
        totals: Counter[str] = Counter()
        for (code, _), count in self.refusals.items():
            totals[code] += count
        return dict(sorted(totals.items()))
