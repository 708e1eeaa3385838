"""When a tailer that reads a hot standby reads next, and when its doorbell may rest. Pure code.

The doorbell (``doorbell``) rings from the primary, where each ring costs the
primary a wake-up of the doorbell's connection per committed write: some tens
of microseconds, per publisher. A fleet of publishers on standbys would make
the primary pay that for every publisher at every commit. So the doorbell
rings only while the feed is quiet:

* **Quiet** (the doorbell listens). A ring names the writer's transaction;
  the standby may not have replayed it yet, so the tailer reads, and reads
  again at once, then after 1, 2, 4 ... 32 ms, until the horizon of what it
  read has passed every transaction rung, for at most ``poll_interval``.
  Otherwise it reads every ``poll_interval``.
* **Flowing** (the doorbell rests: UNLISTEN). Once reads have kept finding
  entries, with no gap of ``FOLLOW_FOR``, for ``REST_AFTER``, while the
  doorbell rang at least ``REST_RATE`` times a second, the tailer stops
  waiting for rings and reads every ``FOLLOW_EVERY``: about as many reads as
  the rings caused, and nothing at all on the primary. The first time reads
  have found nothing for ``FOLLOW_FOR``, the doorbell listens again, and
  rings for every transaction that began before its LISTEN took effect
  (``Doorbell``): nothing committed meanwhile waits for the poll.

A rung transaction is also remembered, with when it rang, until a read's
horizon has passed it (``unreplayed_for``): a standby whose replay has stalled
delivers nothing, so the age of the newest entry read would not show it, but
the age of the oldest ring it has not replayed does.

So a publisher costs the primary a doorbell wake-up per commit only below
``REST_RATE`` commits a second, and the standby about ``1 / FOLLOW_EVERY``
reads a second above it.
"""

from __future__ import annotations

__all__ = ["FOLLOW_EVERY", "FOLLOW_FOR", "REST_AFTER", "REST_RATE", "StandbyPacing"]

FIRST_HURRY = 0.001
LONGEST_HURRY = 0.032
"""Seconds between two reads of a standby that has not yet replayed a transaction
the doorbell named, growing from the first to the longest (the very first read
again goes at once: replay usually takes less than a read's round trip, and an
event loop's timers cannot wait much less than a millisecond)."""
MOST_AWAITED = 4096
"""Rung transactions awaited at once, at most: past that (a standby far behind)
the poll reads what arrives."""
FOLLOW_EVERY = 0.001
"""Seconds between two reads while the feed flows and the doorbell rests."""
FOLLOW_FOR = 0.25
"""Reads that find nothing for this long: the feed is quiet (the doorbell listens).
Longer than the WAL writer's default delay (200 ms): a primary that commits
asynchronously sends standbys its WAL in steps that far apart."""
REST_AFTER = 1.0
"""The feed has flowed (no gap of FOLLOW_FOR) this long: the doorbell may rest ..."""
REST_RATE = 200.0
"""... if it rang at least this many times a second meanwhile (below that, reading
every FOLLOW_EVERY would cost the standby more than the rings cost the primary)."""


class StandbyPacing:
    """The pace of a tailer on a standby (see the module docstring).

    Args:
        poll_interval: seconds between reads while the feed is quiet and nothing
            rings; also how long a rung transaction is awaited at most.
    """

    def __init__(self, poll_interval: float) -> None:
        self._poll_interval = poll_interval
        self.awaited: dict[int, float] = {}
        """Rung transactions not yet replayed at the last read -> until when to
        read again for them."""
        self.resting = False
        """Whether the doorbell rests (the feed flows; the tailer reads on its own)."""
        self._hurry = 0.0
        self._found_at: float | None = None
        """When a read last found entries."""
        self._flowing_since: float | None = None
        """Since when reads have kept finding entries with no gap of FOLLOW_FOR."""
        self._rings = 0
        """Rings since ``_flowing_since``."""
        self._unreplayed: dict[int, float] = {}
        """Rung transactions no read's horizon has passed yet -> when they rang, in
        the order they rang (at most MOST_AWAITED: the oldest are what count)."""
        self.replay_waits = 0
        """Reads made again because a rung transaction had not been replayed."""
        self.rests = 0
        """Times the doorbell was let rest."""

    def rung(self, txid: int | None, now: float) -> None:
        """The doorbell rang, naming ``txid`` (None: it named nothing)."""
        self._rings += 1
        if txid is None:
            return
        if len(self.awaited) < MOST_AWAITED:
            self.awaited[txid] = now + self._poll_interval
        if len(self._unreplayed) < MOST_AWAITED:
            self._unreplayed.setdefault(txid, now)

    def read(self, horizon: int | None, found: bool, now: float) -> bool | None:
        """A read of the standby happened: its snapshot's ``horizon`` (None: not
        known), and whether it ``found`` entries.

        Returns:
            True when the doorbell may rest now, False when it must listen again,
            None when nothing changes.
        """
        if self.awaited:
            self.awaited = {
                t: until
                for t, until in self.awaited.items()
                if (horizon is None or t >= horizon) and until > now
            }
        if self._unreplayed and horizon is not None:
            self._unreplayed = {t: at for t, at in self._unreplayed.items() if t >= horizon}
        if found:
            if self._found_at is None or now - self._found_at > FOLLOW_FOR:
                self._flowing_since, self._rings = now, 0
            self._found_at = now
            flowed = 0.0 if self._flowing_since is None else now - self._flowing_since
            if not self.resting and flowed >= REST_AFTER and self._rings >= REST_RATE * flowed:
                self.resting = True
                self.rests += 1
                return True
            return None
        if self.resting and (self._found_at is None or now - self._found_at >= FOLLOW_FOR):
            self.resting = False
            self._flowing_since = None
            return False
        return None

    def forget(self) -> None:
        """Drop every awaited ring: the tailer joins the feed again (after a reconnect,
        on a server that may since have been promoted without those transactions)."""
        self.awaited.clear()
        self._unreplayed.clear()

    def unreplayed_for(self, now: float) -> float:
        """Seconds the oldest rung transaction has waited for a read past it (0: none
        waits): how far the standby, or a transaction still open before it, holds
        the feed back."""
        for rang_at in self._unreplayed.values():  # the first is the oldest ring
            return max(0.0, now - rang_at)
        return 0.0

    def delay(self) -> float:
        """Seconds until the next read, unless the doorbell rings first."""
        if self.awaited:
            self.replay_waits += 1
            pause = self._hurry
            self._hurry = min(max(pause * 2, FIRST_HURRY), LONGEST_HURRY)
            return pause
        self._hurry = 0.0
        return FOLLOW_EVERY if self.resting else self._poll_interval
