"""Checkpoints: a listener's cursor and its controllers' mirrors, saved together.

A checkpoint lets a restarted service resume from where it was instead of
bootstrapping: it loads the mirrors, registers with the saved cursor, and the
publisher replays only what it missed.

**The consistency rule.** The saved cursor is never ahead of what the saved
mirrors reflect. A controller's fetches complete out of order and coalesce,
so its mirror at any moment is a mix of states; what makes a snapshot
consistent is that it is taken in one synchronous step of the event loop
(the cursor and every mirror at once) and that every id whose state may be
newer than the mirror says is saved as *pending*: ids marked stale by a
change item and not fetched yet, ids being fetched, and ids whose new state
the application has not been told yet. The mirror saved is the
*application's* view (what its callbacks last saw), so that after a restart
the callbacks are called for what changed since, with the right ``old``.
Loading queues the pending ids for a fresh fetch: a few changes are replayed
(a controller fetches the current state of an id, so that is harmless),
none is skipped.

**Whole and incremental saves.** A save carries either every resource
(``whole``) or what changed since the previous save (``items`` changed,
``deleted`` gone), so that a save of a large, slowly changing mirror costs
what changed, not the mirror. ``next_save_is_whole`` decides which.

Pure code: the data a store keeps, the interface of a store, and the
decisions (what a loaded checkpoint may be used for, whether a save is
whole). No I/O; the adapter is ``_checkpointer``, the SQLite store
``_sqlite_store``. A store must never hand back a mix of two saves.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

import orjson

from changefeed.schemas import ChangeKind

from ._figures import GAUGE, Labels, figure

__all__ = [
    "WHOLE_SAVE_FLOOR",
    "WHOLE_SAVE_RATIO",
    "Checkpoint",
    "CheckpointStatus",
    "CheckpointStore",
    "JsonItems",
    "MirrorCheckpoint",
    "RestorePlan",
    "application_view",
    "covers",
    "next_save_is_whole",
    "plan_restore",
]

V = TypeVar("V")

_MISSING: Any = object()

WHOLE_SAVE_RATIO = 0.25
"""An incremental save becomes whole once the ids changed since the last whole
save pass this fraction of the mirrors' size: a store that keeps changes
beside its last whole copy then loads at most that much more."""

WHOLE_SAVE_FLOOR = 10_000
"""... but never for fewer changed ids than this (small mirrors save incrementally too)."""


@dataclass(frozen=True, slots=True)
class MirrorCheckpoint:
    """One controller's part of a checkpoint.

    Attributes:
        resource: the resource the controller mirrors.
        items: id -> the resource as JSON (the controller's ``encode`` applied):
            every resource of the mirror when the checkpoint is ``whole``,
            otherwise only those changed since the previous save. Read it as a
            Mapping; a ``JsonItems`` (what the controller hands over, and what
            ``SqliteCheckpointStore`` loads) also gives them as JSON bytes.
        deleted: ids gone since the previous save (empty when ``whole``).
        pending: ids whose state may be newer than ``items`` says; every one
            is fetched again after a load. Always complete (not a change).
    """

    resource: str
    items: Mapping[str, Any]
    deleted: Collection[str] = ()
    pending: Collection[str] = ()


@dataclass(frozen=True, slots=True)
class Checkpoint:
    """What a listener saves: its cursor and the mirrors of its controllers.

    Attributes:
        cursor: the feed position every mirror reflects (None: none yet).
        change_kinds: what the listener registered when it saved.
        mirrors: controller name -> its part (empty for a listener iterated
            with ``async for``: then the cursor is what the application is done with).
        whole: ``mirrors`` hold every resource, and replace whatever the store
            holds. Otherwise they hold the changes since the save numbered ``base``.
        sequence: this save's number; each save of a listener is numbered one
            higher than the last one it made or loaded.
        base: for an incremental save, the number of the save its changes are
            relative to (the store holds that one, or a later one of the same
            listener that this checkpoint also covers); None when ``whole``.
        saved_at: when it was taken (seconds since the epoch).
    """

    cursor: str | None
    change_kinds: tuple[ChangeKind, ...]
    mirrors: Mapping[str, MirrorCheckpoint]
    whole: bool = True
    sequence: int = 1
    base: int | None = None
    saved_at: float = 0.0

    def items_count(self) -> int:
        """Resources in (or changed by) this checkpoint, over every mirror."""
        return sum(len(part.items) for part in self.mirrors.values())


class CheckpointStore(Protocol):
    """Where a listener keeps its checkpoint: ``SqliteCheckpointStore``, or your own.

    Both methods are coroutines: run blocking I/O off the event loop. A store may
    also have a ``close()`` coroutine: the listener awaits it when it closes (the
    SQLite store closes its connection and lets go of its file then); ``load``
    and ``save`` may be called again after it.
    """

    async def load(self) -> Checkpoint | None:
        """The checkpoint last saved, whole (None: there is none).

        Raises:
            Exception: it cannot be read. The listener logs it and bootstraps.
        """

    async def save(self, checkpoint: Checkpoint) -> None:
        """Keep ``checkpoint``, atomically: after a crash at any moment, ``load``
        returns this checkpoint or the one before it, never a mix. When it is
        not ``whole``, apply its changes on top of what is held (each mirror's
        ``items`` replace those ids, ``deleted`` ids go, ``pending`` is replaced).

        Raises:
            Exception: it was not kept (a store may refuse an incremental save
                whose ``base`` it does not hold). The listener logs it and makes
                its next save cover everything since the last one that succeeded.
        """


def _age(saved_at: float | None) -> list[tuple[Labels, float]]:
    return [((), 0.0 if saved_at is None else max(0.0, time.time() - saved_at))]


@dataclass(frozen=True, slots=True)
class CheckpointStatus:
    """A listener's checkpoint, in ``listener.status().checkpoint``; its counters and
    gauges are also ``changefeed_listener_checkpoint_*`` metrics.

    Attributes:
        loaded: a checkpoint was loaded at start.
        loaded_items: resources it held, over every mirror.
        load_seconds: how long loading it took.
        resumed_from: the registration at start carried the checkpoint's cursor.
        not_resumed: why the loaded checkpoint's cursor was not used (None: it
            was, or none was loaded).
        whole_saves: saves that were whole.
        last_save_items: resources the last successful save wrote.
        last_error: the last failure to load or save, as text.
        frozen: the listener or its last controller stopped: no further
            checkpoint is taken.

    ``consecutive_failures`` above 0 means the store does not hold where the
    listener got to: a restart replays (or bootstraps) more; ``failing`` says so.
    """

    loaded: bool = False
    loaded_items: int = 0
    load_seconds: float = 0.0
    resumed_from: bool = False
    not_resumed: str | None = None
    saves: int = figure("Checkpoints saved", metric="checkpoint_saves", default=0)
    whole_saves: int = 0
    save_failures: int = figure(
        "Checkpoint saves that failed", metric="checkpoint_save_failures", default=0
    )
    consecutive_failures: int = figure(
        "Checkpoint saves failed since the last that succeeded (above 0: the store is behind)",
        GAUGE,
        metric="checkpoint_failing_saves",
        default=0,
    )
    last_save_seconds: float = figure(
        "How long the last successful save took", GAUGE, metric="checkpoint_save_seconds",
        default=0.0,
    )  # fmt: skip
    last_save_items: int = 0
    last_saved_at: float | None = figure(
        "Seconds since the last checkpoint saved was taken (what a restart now replays)",
        GAUGE,
        metric="checkpoint_age_seconds",
        read=_age,
        default=None,
    )
    last_error: str | None = None
    frozen: bool = False

    @property
    def failing(self) -> bool:
        """The last save failed: what the store holds is behind (see ``last_error``)."""
        return self.consecutive_failures > 0

    def to_json(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in self.__slots__}


@dataclass(frozen=True, slots=True)
class RestorePlan:
    """What a listener does with a loaded checkpoint.

    Attributes:
        cursor: register with this ``since`` (None: bootstrap).
        mirrors: controller name -> the mirror it starts from (the callbacks then
            see only what differs from it, after a resume or a bootstrap alike).
        reason: why the checkpoint's cursor is not used (None: it is, or there
            was no checkpoint).
        baseline: the store holds exactly what the listener starts from, so the
            first save may be incremental.
        sequence: the loaded checkpoint's number (0: none).
    """

    cursor: str | None = None
    mirrors: dict[str, MirrorCheckpoint] = field(default_factory=dict)
    reason: str | None = None
    baseline: bool = False
    sequence: int = 0


def covers(saved: Sequence[ChangeKind], wanted: Sequence[ChangeKind]) -> bool:
    """Whether entries matching ``saved`` include every entry matching ``wanted``: a mirror
    kept current for ``saved`` is current for ``wanted`` too. An empty sub-resource list
    means all of them."""
    by_resource = {kind.resource: set(kind.sub_resources) for kind in saved}
    for kind in wanted:
        subs = by_resource.get(kind.resource)
        if subs is None:
            return False
        if subs and (not kind.sub_resources or not set(kind.sub_resources) <= subs):
            return False
    return True


def plan_restore(
    checkpoint: Checkpoint | None,
    *,
    change_kinds: Sequence[ChangeKind],
    controllers: Mapping[str, str],
    resume: bool = True,
) -> RestorePlan:
    """Decide what a loaded checkpoint is used for.

    Each attached controller starts from its saved mirror when the checkpoint
    has one of its name and resource. The cursor is used only when that is
    true of every attached controller and the saved change kinds cover the
    ones registered now: otherwise a mirror would be missing changes the
    cursor has gone past. Without the cursor the listener bootstraps, and the
    callbacks see the difference from the loaded mirrors.

    Args:
        checkpoint: what the store loaded.
        change_kinds: what the listener registers now.
        controllers: attached controller name -> its resource.
        resume: the listener resumes at all (``ListenerConfig.resume``).
    """
    if checkpoint is None:
        return RestorePlan()
    mirrors = {
        name: part
        for name, part in checkpoint.mirrors.items()
        if controllers.get(name) == part.resource
    }
    missing = sorted(set(controllers) - set(mirrors))
    baseline = not missing and set(mirrors) == set(checkpoint.mirrors)
    plan = RestorePlan(mirrors=mirrors, baseline=baseline, sequence=checkpoint.sequence)
    if checkpoint.cursor is None:
        reason = "no_cursor"
    elif not resume:
        reason = "resume_off"
    elif missing:
        reason = "no_mirror:" + ",".join(missing)
    elif not covers(checkpoint.change_kinds, change_kinds):
        reason = "change_kinds"
    else:
        return RestorePlan(checkpoint.cursor, mirrors, None, baseline, checkpoint.sequence)
    return RestorePlan(None, plan.mirrors, reason, plan.baseline, plan.sequence)


def next_save_is_whole(
    *,
    baseline: bool,
    changed_since_whole: int,
    size: int,
    ratio: float = WHOLE_SAVE_RATIO,
    floor: int = WHOLE_SAVE_FLOOR,
) -> bool:
    """Whether the next save carries every resource.

    Args:
        baseline: the store holds a save of this listener (made or loaded) that
            incremental changes can go on top of.
        changed_since_whole: ids changed over the saves since the last whole one
            (this process's count).
        size: resources in the mirrors now.
    """
    return not baseline or changed_since_whole > max(floor, ratio * size)


def application_view(view: dict[str, V], seen: Mapping[str, V | None]) -> dict[str, V]:
    """``view``, a copy of the mirror, made (in place) what the application last saw:
    ``seen`` holds, for ids whose new state the callbacks have not been given yet,
    the state they last saw (None: absent)."""
    for key, old in seen.items():
        if old is None:
            view.pop(key, None)
        else:
            view[key] = old
    return view


class JsonItems(Mapping[str, Any]):
    """id -> resource as JSON, held partly as the mirror's values (``encode``, when given,
    turns one into JSON as it is read) and partly still encoded (JSON bytes, decoded as
    read): what a store reads, off the event loop, where encoding belongs.

    ``encoded_items`` gives every resource as JSON bytes, passing the encoded ones
    through untouched: a store that writes JSON text uses it to skip a decode and an
    encode of each resource loaded from a checkpoint and not read since.
    """

    __slots__ = ("_encode", "_encoded", "_values")

    def __init__(
        self,
        values: Mapping[str, Any] | None = None,
        encoded: Mapping[str, bytes] | None = None,
        encode: Callable[[Any], Any] | None = None,
    ) -> None:
        self._values: Mapping[str, Any] = values if values is not None else {}
        self._encoded: Mapping[str, bytes] = encoded if encoded is not None else {}
        self._encode = encode

    @property
    def encoded(self) -> Mapping[str, bytes]:
        """The resources held as JSON bytes."""
        return self._encoded

    @property
    def values_held(self) -> Mapping[str, Any]:
        """The resources held as the mirror's values (``encode`` not applied)."""
        return self._values

    def __getitem__(self, key: str) -> Any:
        value = self._values.get(key, _MISSING)
        if value is _MISSING:
            return orjson.loads(self._encoded[key])
        return value if self._encode is None else self._encode(value)

    def __iter__(self) -> Iterator[str]:
        yield from self._values
        yield from self._encoded

    def __len__(self) -> int:
        return len(self._values) + len(self._encoded)

    def __contains__(self, key: object) -> bool:
        return key in self._values or key in self._encoded

    def encoded_items(self) -> Iterator[tuple[str, bytes]]:
        """Every resource as ``(id, JSON bytes)``."""
        encode, dumps = self._encode, orjson.dumps
        for key, value in self._values.items():
            yield key, dumps(value if encode is None else encode(value))
        yield from self._encoded.items()
