"""What one run reads: the whole feed (a full run), or what changed since the last run.

Pure code. A run is bounded by its snapshot: the head (the newest entry below
the snapshot horizon; every entry at or before it is final) and two cutoffs
on the database clock, ``gc`` (published before it: garbage) and ``lag``
(published before it: may be merged). A finished run leaves behind, for the
entries at or before its head:

* no garbage (everything published before its ``gc`` is deleted);
* at most one entry per ``(resource, changed_resource_id)`` among those
  published in ``[gc, lag)`` -- the group's *keeper*, which the job records
  in its index of kept entries (``compaction_keys``).

So the next run only has to look at what that does not cover, and nothing
else can have changed below the previous head (writers only append, and
every entry at or before it was final):

* **after the previous head**: every entry (new ones, and those of
  transactions that were still open), read by primary-key range;
* **at or before it**: the entries that have aged into garbage since
  (published in ``[previous gc, gc)``) and into the merge (published in
  ``[previous lag, lag)``), read by the ``published`` index;
* the previous keeper of every ``(resource, id)`` those entries touch,
  looked up in the index of kept entries.

Its merge needs every sub-resource name among those (``merge``): the names
of the changes, and those the previous run recorded, which hold its keepers'
(a keeper's sub-resources only ever come from a merge that knew them).

Merging those is exactly what a full run would do (``plan_feed`` on the whole
feed): every other group has one entry in ``[gc, lag)`` at most, which a full
run leaves alone too. ``choose_scope`` falls back to a full run whenever that
argument does not hold (no finished previous run, another feed, the index
lost with an unlogged table's crash or failover, no names recorded) and when
the index may have gone stale: once the last full run is older than the max
age, every entry it indexed has been collected.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta

from changefeed.schemas import Position

from .plan import PlanEntry

__all__ = ["Cutoffs", "PreviousRun", "Scope", "choose_scope", "delta_of"]


@dataclass(frozen=True, slots=True)
class Cutoffs:
    """The bounds of one run, from its snapshot.

    Attributes:
        head: the newest final entry; the run reads and changes nothing after it.
        gc: entries published before it are garbage.
        lag: entries published before it (and not garbage) may be merged.
    """

    head: Position
    gc: datetime
    lag: datetime


@dataclass(frozen=True, slots=True)
class PreviousRun:
    """The last run recorded in ``compaction_runs``, as the next one needs it.

    Attributes:
        finished: it ran to the end (a run that died may have left groups half merged).
        cutoffs: its bounds.
        horizon: its snapshot's ``pg_snapshot_xmin``: transaction ids only grow, so a
            lower one now means a database restored from an older backup.
        feed_id: the feed it ran on (a restored or recreated feed has another).
        index_intact: its index of kept entries is still there (an unlogged
            table: a crash or a failover empties it).
        last_full: when the newest finished full run started (None: never).
        names: the sub-resource names its merge knew, every one of its
            keepers' among them (None: not recorded).
    """

    run_id: int
    finished: bool
    cutoffs: Cutoffs
    horizon: int
    feed_id: uuid.UUID | None
    index_intact: bool
    last_full: datetime | None
    names: tuple[str, ...] | None = None


@dataclass(frozen=True, slots=True)
class Scope:
    """What a run reads.

    Attributes:
        full: read the whole feed (no other field applies).
        reason: why this kind of run, for the summary and the log.
        since: the previous run's head: entries after it are all read.
        gc_band: ``[from, to)`` publication times at or before ``since`` that
            became garbage since the previous run (None: nothing did).
        lag_band: ``[from, to)`` publication times at or before ``since`` that
            became old enough to merge since the previous run (None: nothing did).
        kept_until: a previous keeper (at or before ``since``) takes part when it
            was published in ``[gc, kept_until)``: still a candidate, and not in
            ``lag_band`` (read there already).
    """

    full: bool
    reason: str
    since: Position | None = None
    gc_band: tuple[datetime, datetime] | None = None
    lag_band: tuple[datetime, datetime] | None = None
    kept_until: datetime | None = None


def _band(start: datetime, end: datetime) -> tuple[datetime, datetime] | None:
    return (start, end) if start < end else None


def choose_scope(
    now: Cutoffs,
    previous: PreviousRun | None,
    *,
    horizon: int,
    feed_id: uuid.UUID,
    max_age: float,
    taken: datetime,
    full_requested: bool = False,
) -> Scope:
    """A full run, or the incremental scope after ``previous``, and why.

    Args:
        now: this run's bounds.
        previous: the last recorded run (None: there is none).
        horizon: this run's snapshot's ``pg_snapshot_xmin``.
        feed_id: the feed's identity now.
        max_age: seconds; a full run older than this has had everything it
            indexed collected.
        taken: the database clock at this run's snapshot.
        full_requested: ``--full``.
    """
    if full_requested:
        return Scope(True, "requested")
    if previous is None:
        return Scope(True, "no previous run")
    if not previous.finished:
        return Scope(True, f"run {previous.run_id} did not finish")
    if previous.feed_id != feed_id or previous.horizon > horizon:
        return Scope(True, "the feed is not the one the previous run saw (restored or recreated)")
    if not previous.index_intact:
        return Scope(True, "the index of kept entries is gone (database restarted or failed over)")
    if previous.last_full is None or previous.last_full < taken - timedelta(seconds=max_age):
        return Scope(True, "the last full run is older than the max age")
    if previous.names is None:
        return Scope(True, f"run {previous.run_id} did not record its sub-resource names")
    before = previous.cutoffs
    return Scope(
        False,
        f"after run {previous.run_id}",
        since=before.head,
        gc_band=_band(before.gc, now.gc),
        lag_band=_band(max(before.lag, now.gc), now.lag),
        kept_until=min(before.lag, now.lag),
    )


def delta_of(
    entries: Iterable[PlanEntry],
    published: Mapping[Position, datetime],
    scope: Scope,
    keys: Mapping[tuple[str, str], Position],
    head: Position,
) -> tuple[set[Position], list[PlanEntry]]:
    """The reference of an incremental run's reads: (garbage, members to merge).

    ``entries`` is the whole feed, ``published`` each entry's publication time,
    ``keys`` the index of kept entries. Garbage is what the run's two garbage
    reads find; members are the candidates among its reads, plus the indexed
    keeper of every ``(resource, id)`` they touch.
    """
    assert not scope.full and scope.since is not None and scope.kept_until is not None
    since = scope.since
    by_position = {}
    garbage: set[Position] = set()
    members: list[PlanEntry] = []
    for e in entries:
        by_position[e.position] = e
        if e.position > head:
            continue
        at = published[e.position]
        if e.position > since:
            read = True
        else:
            read = any(band and band[0] <= at < band[1] for band in (scope.gc_band, scope.lag_band))
        if not read:
            continue
        if e.garbage:
            garbage.add(e.position)
        elif e.candidate:
            members.append(e)
    touched = {(e.resource, e.changed_resource_id) for e in members}
    for key in sorted(touched):
        kept = by_position.get(keys.get(key, Position(-1, -1)))
        if (
            kept is not None
            and kept.position <= since
            and kept.candidate
            and not kept.garbage
            and published[kept.position] < scope.kept_until
        ):
            members.append(kept)
    return garbage, members
