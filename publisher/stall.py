"""Which listeners have stopped making progress. Pure code.

A listener is never closed for being slow: one that keeps reading is served
until it catches up (I3). It is closed only when it has had something to
take and took nothing at all for ``stall_timeout``. What it took is what TCP
lets the publisher see, and a receiver whose buffer is full reopens its
window only once a good part of it is free (at least one segment: 64 KiB on
loopback): a listener reading less than that per ``stall_timeout`` looks
stopped (docs/runbook.md, ChangefeedEvictions). Progress is
anything the listener took off the connection: items written to its socket,
or, where the server can tell (direct writes), bytes leaving the transport's
buffer, so that a listener draining a full buffer a few bytes at a time is
progressing too. A listener with nothing pending, or one waiting for a page
of the feed table (the database's delay, not the listener's), is not stalling.
"""

from __future__ import annotations

from collections.abc import Iterable

from .delivery import Delivery

__all__ = ["stalled"]


def stalled(deliveries: Iterable[Delivery], now: float, stall_timeout: float) -> list[Delivery]:
    """The deliveries that made no progress for ``stall_timeout`` seconds as of ``now``.

    Call it periodically (every few seconds); each call records progress made
    since the last one.
    """
    found = []
    for delivery in deliveries:
        buffered = delivery.buffered() if delivery.buffered is not None else 0
        mark = (delivery.sent, -buffered)
        idle = not delivery.pending and not buffered
        excused = delivery.waiting_on_feed or delivery.closing is not None
        if not delivery.progress_at or idle or excused or _moved_on(mark, delivery.progress_mark):
            delivery.progress_at = now
        elif now - delivery.progress_at >= stall_timeout:
            found.append(delivery)
        delivery.progress_mark = mark
    return found


def _moved_on(mark: tuple[int, int], before: tuple[int, int]) -> bool:
    # More items sent, or less left in the transport's buffer (-buffered grew).
    return mark[0] > before[0] or mark[1] > before[1]
