"""Where one id stands in a controller, beyond "queued because a change item named it".

The controller's core (``_reconcile.py``) keeps one ``IdState`` per id with
something to remember, and drops it once the id is idle again: per-id state
is this one record, not a set per flag.
"""

from __future__ import annotations

from typing import Any

__all__ = ["NOTHING", "UNSEEN", "IdState"]

UNSEEN: Any = object()
"""``IdState.seen``: the application's view is the mirror's."""
NOTHING: Any = object()
"""``IdState.attempted``: no failed callback is on record."""


class IdState:
    """Where one id stands, beyond "queued because a change item named it".

    Attributes:
        fetch: fetch it before its next callback. An id queued without a
            record needs a fetch; one with a record, only when this says so.
        seen: the state the application last saw, once the mirror has moved
            past it: its next callback's ``old`` (``UNSEEN``: the mirror's).
        attempted: the ``new`` of a callback that raised: the application may
            hold part of it, even if the mirror goes back to what it saw.
        resync: a periodic resync hands it out again (``old == new``).
        forced: called back even when unchanged, after a restore: the process
            that saved the checkpoint may have told the application of a state
            in between.
        failures: consecutive failed fetches or callbacks (the back-off exponent).
        awaited: the first sync waits for it to be processed once.
        skip: ... and its completion by the batch holding it now does not count
            (a fetch that started before the bootstrap: it is queued again). The
            batch's end clears it, whatever came of that batch.
    """

    __slots__ = ("attempted", "awaited", "failures", "fetch", "forced", "resync", "seen", "skip")

    def __init__(self, fetch: bool) -> None:
        self.fetch = fetch
        self.seen: Any = UNSEEN
        self.attempted: Any = NOTHING
        self.resync = False
        self.forced = False
        self.failures = 0
        self.awaited = False
        self.skip = False

    @property
    def pending(self) -> bool:
        """Its state may be newer than the application's view: a checkpoint lists it."""
        return self.fetch or self.forced or self.seen is not UNSEEN or self.attempted is not NOTHING

    @property
    def idle(self) -> bool:
        """Nothing to remember: the record can go."""
        return not (self.pending or self.resync or self.failures or self.awaited or self.skip)
