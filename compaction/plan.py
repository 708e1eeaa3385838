"""The compaction algorithm as pure code: the rules the Spark job implements, and the I5 model.

Nothing here does I/O. The Spark job (``job``) computes the same plan at scale
and the tests hold it to this reference; the tests also use the notification
model below to check invariant I5 against real resumes.

Rules, for a snapshot of the feed bounded by ``head`` (entries after it are
never looked at):

* **garbage** -- an entry published before ``now - max_age``. It is deleted and
  the low-water mark is raised to the newest deleted position.
* **compaction** -- among entries published before ``now - compaction_lag`` that
  are not garbage, the entries of one ``(resource, changed_resource_id)``
  collapse into the latest of them (the *keeper*), which carries the union of
  their sub-resources. An entry with no sub-resources means "the whole
  resource" and absorbs the rest: the union is then empty. The low-water mark
  does not move.

A removed entry is always *covered*: either the low-water mark is at or after
it (no resumable cursor precedes it), or a later entry of the same resource id
still in the feed carries every sub-resource it carried (see ``covers``).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from changefeed.schemas import Position

__all__ = [
    "GcRegion",
    "Notification",
    "Plan",
    "PlanEntry",
    "covers",
    "merge_subs",
    "normalize_subs",
    "notifications",
    "plan_feed",
    "simulate",
    "uncovered",
]


def normalize_subs(subs: Iterable[str]) -> tuple[str, ...]:
    """Sub-resources as a sorted tuple without duplicates (the stored form of a union)."""
    return tuple(sorted(set(subs)))


def merge_subs(sets: Iterable[Sequence[str]]) -> tuple[str, ...]:
    """The union of sub-resource sets; ``()`` (the whole resource) absorbs every other set."""
    union: set[str] = set()
    for subs in sets:
        if not subs:
            return ()
        union.update(subs)
    return tuple(sorted(union))


def covers(keeper: Sequence[str], subs: Sequence[str]) -> bool:
    """True when an entry with sub-resources ``keeper`` notifies everything ``subs`` does.

    ``()`` is the whole resource: it covers everything, and only it covers ``()``.
    """
    if not keeper:
        return True
    return bool(subs) and set(subs) <= set(keeper)


@dataclass(frozen=True, slots=True)
class PlanEntry:
    """One feed entry as the planner sees it.

    Attributes:
        garbage: published before ``now - max_age``.
        candidate: published before ``now - compaction_lag`` (garbage or not).
    """

    position: Position
    resource: str
    changed_resource_id: str
    sub_resources: tuple[str, ...]
    garbage: bool
    candidate: bool


@dataclass(frozen=True, slots=True)
class Plan:
    """What one run changes.

    Attributes:
        garbage: positions to delete as older than the max age.
        updates: keeper position -> the union it must carry (only keepers whose
            sub-resources change).
        drops: position -> its keeper (entries merged away).
        groups: ``(resource, id)`` groups with more than one entry to merge.
        scanned: entries the plan looked at (garbage and compaction candidates).
    """

    garbage: frozenset[Position]
    updates: Mapping[Position, tuple[str, ...]]
    drops: Mapping[Position, Position]
    groups: int
    scanned: int


def plan_feed(entries: Iterable[PlanEntry], head: Position) -> Plan:
    """Plan garbage collection and compaction for the entries at or before ``head``."""
    garbage: set[Position] = set()
    groups: dict[tuple[str, str], list[PlanEntry]] = {}
    scanned = 0
    for entry in entries:
        if entry.position > head:
            continue
        if entry.garbage:
            garbage.add(entry.position)
            scanned += 1
        elif entry.candidate:
            groups.setdefault((entry.resource, entry.changed_resource_id), []).append(entry)
            scanned += 1
    updates: dict[Position, tuple[str, ...]] = {}
    drops: dict[Position, Position] = {}
    merged_groups = 0
    for members in groups.values():
        if len(members) < 2:
            continue
        merged_groups += 1
        keeper = max(members, key=lambda e: e.position)
        union = merge_subs(e.sub_resources for e in members)
        if normalize_subs(keeper.sub_resources) != union:
            updates[keeper.position] = union
        for member in members:
            if member is not keeper:
                drops[member.position] = keeper.position
    return Plan(frozenset(garbage), updates, drops, merged_groups, scanned)


@dataclass(frozen=True, slots=True)
class GcRegion:
    """A stretch of the feed, in feed order, holding ``rows`` garbage entries.

    The apply step walks ``[first, last]`` along the primary key, ``batch_size``
    entries (garbage or not) per transaction, deleting the garbage among them:
    however sparse the ids and however long a writer kept its transaction open,
    no transaction reaches further than that many index entries, and their
    number is what the stretch holds divided by the batch size.
    """

    first: Position
    last: Position
    rows: int


def simulate(
    entries: Iterable[PlanEntry], plan: Plan, low_water: Position
) -> tuple[dict[Position, tuple[str, str, tuple[str, ...]]], Position]:
    """The feed and low-water mark after ``plan`` (the reference result of one run).

    Returns:
        position -> (resource, changed_resource_id, sorted sub-resources), and
        the new low-water mark.
    """
    feed: dict[Position, tuple[str, str, tuple[str, ...]]] = {}
    for e in entries:
        if e.position in plan.garbage or e.position in plan.drops:
            continue
        subs = plan.updates.get(e.position, normalize_subs(e.sub_resources))
        feed[e.position] = (e.resource, e.changed_resource_id, subs)
    newest = max(plan.garbage, default=low_water)
    return feed, max(low_water, newest)


Notification = tuple[str, str, str | None]
"""``(resource, changed_resource_id, sub-resource)``; ``None`` is the whole resource."""


def notifications(entries: Iterable[tuple[str, str, Sequence[str]]]) -> set[Notification]:
    """The notifications ``(resource, id, sub_resources)`` entries deliver, as pairs.

    An entry with no sub-resources delivers ``(resource, id, None)``: the whole resource.
    """
    found: set[Notification] = set()
    for resource, changed_id, subs in entries:
        if not subs:
            found.add((resource, changed_id, None))
        else:
            found.update((resource, changed_id, s) for s in subs)
    return found


def uncovered(before: set[Notification], after: set[Notification]) -> set[Notification]:
    """The notifications of ``before`` that ``after`` does not deliver.

    ``(r, i, s)`` is delivered by ``(r, i, s)`` itself or by ``(r, i, None)``
    (the whole resource reaches every registration for ``r``).
    """
    return {
        (r, i, s) for (r, i, s) in before if (r, i, s) not in after and (r, i, None) not in after
    }
