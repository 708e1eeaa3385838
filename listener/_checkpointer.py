"""The listener's checkpoints at work: load at start, save at intervals and on a clean stop.

The adapter around the pure rules of ``_checkpoint``. A ``Checkpointer``
belongs to one listener (one connection, one cursor) and covers every
controller attached to it:

* ``restore`` loads the store's checkpoint before the first registration,
  hands each controller its mirror and returns the cursor to register with
  (``plan_restore`` decides; None: bootstrap).
* ``take`` snapshots the cursor and every mirror in one synchronous step,
  which is what makes the checkpoint consistent; ``save`` hands it to the
  store, one save at a time, off the event loop as far as the store goes.
* A periodic task saves every ``interval`` seconds when something changed;
  ``final`` takes the last checkpoint when the listener or its last
  controller running stops (a controller that stops before the others is
  parked by the listener, and its mirror goes on following the cursor).

Incremental saves carry the ids changed since the last save the store is
known to hold: ids of a save that failed, or is still under way, go into the
next one too, so a failure never leaves a change out. It must never save
before the load has run (that would replace a checkpoint nobody read), never
save a cursor ahead of the mirrors, and never let a failed save stop the
listener.
"""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import logging
import time
import weakref
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from changefeed.logs import log_event
from changefeed.schemas import ChangeKind

from ._checkpoint import (
    Checkpoint,
    CheckpointStatus,
    CheckpointStore,
    MirrorCheckpoint,
    next_save_is_whole,
    plan_restore,
)
from ._errors import CheckpointError, CheckpointRefused
from ._log import log

__all__ = ["CLOSE_WAIT", "Checkpointer", "MirrorSource"]

CLOSE_WAIT = 120.0
"""Seconds a stopping listener waits for its last checkpoint to be saved."""

_HOLDERS: weakref.WeakValueDictionary[int, Checkpointer] = weakref.WeakValueDictionary()
"""The checkpointer using each store object (by ``id``), from its load to its close:
two listeners handed one store would write one checkpoint over the other's, which
no file lock sees (a store's lock is its own)."""


class MirrorSource(Protocol):
    """What a checkpoint reads from (and loads into) one attached controller."""

    @property
    def name(self) -> str: ...

    @property
    def resource(self) -> str: ...

    def restore(self, part: MirrorCheckpoint) -> None:
        """Start from ``part``: no callbacks for it, its pending ids fetched again."""

    def track_changes(self) -> None:
        """Nothing was restored: count changed ids from now on."""

    def take_changed(self) -> set[str]:
        """The ids whose saved state may differ now, since the last call."""

    def has_changed(self) -> bool:
        """Whether ``take_changed`` would return any id."""

    def checkpoint_part(self, changed: set[str] | None) -> MirrorCheckpoint:
        """Its part of a checkpoint taken now: everything (None) or ``changed``."""

    def size(self) -> int:
        """Resources in its mirror."""


class Checkpointer:
    """Loads and saves one listener's checkpoints.

    Args:
        store: where they are kept.
        change_kinds: what the listener registers.
        position: the cursor every mirror reflects now (None: none yet).
        sources: the attached controllers whose mirrors go into a checkpoint.
        interval: seconds between periodic saves.
        load_timeout: seconds the store's ``load`` may take.
        name: the listener's name, for log events.
    """

    def __init__(
        self,
        store: CheckpointStore,
        change_kinds: tuple[ChangeKind, ...],
        position: Callable[[], str | None],
        sources: Callable[[], Sequence[MirrorSource]],
        *,
        interval: float,
        load_timeout: float,
        name: str,
    ) -> None:
        self.store = store
        self._change_kinds = change_kinds
        self._position = position
        self._sources = sources
        self._interval = interval
        self._load_timeout = load_timeout
        self._name = name
        self._restored = asyncio.Event()
        self._frozen = False
        self._last_save: asyncio.Task[bool] | None = None  # saves run one after another
        self._sequence = 0  # the last snapshot's number
        self._confirmed: int | None = None  # the number of a save the store holds
        self._unsaved: dict[str, set[str]] = {}  # changed since the save confirmed
        self._since_whole: dict[str, set[str]] = {}  # changed since the last whole save
        self._saved_position: str | None = None  # of the last save that succeeded
        self._saves: set[asyncio.Task[bool]] = set()
        self._periodic: asyncio.Task[None] | None = None
        self._status = CheckpointStatus()

    @property
    def name(self) -> str:
        """The listener's name."""
        return self._name

    @property
    def restored(self) -> bool:
        return self._restored.is_set()

    def status(self) -> CheckpointStatus:
        return self._status

    def _update(self, **changes: Any) -> None:
        self._status = dataclasses.replace(self._status, **changes)

    # -- loading ---------------------------------------------------------------

    async def restore(self, resume: bool) -> str | None:
        """Load the checkpoint and hand the controllers their mirrors; return the cursor
        to register with (None: bootstrap). A checkpoint that cannot be read, or
        not within ``load_timeout``, is logged and the listener bootstraps: it is
        a saving, never a requirement. A store that refuses this listener
        (``CheckpointRefused``: another holds it) is not: it is raised, and the
        listener stops with it.

        Args:
            resume: the listener resumes at all (``ListenerConfig.resume``).
        """
        started = time.monotonic()
        sources = self._sources()
        log_event(log, "listener.checkpoint.loading", listener=self._name)
        try:
            self._hold_store()
            checkpoint = await self._load()
        except CheckpointRefused as exc:
            self._update(last_error=f"load: {type(exc).__name__}: {exc}")
            # A refusal says all in its message, and it is raised to the caller,
            # which reports it (``changefeed listen`` in one line): no traceback here.
            log_event(
                log,
                "listener.checkpoint.refused",
                logging.ERROR,
                listener=self._name,
                error=str(exc),
            )
            raise
        except Exception as exc:
            checkpoint = None
            self._update(last_error=f"load: {type(exc).__name__}: {exc}")
            log_event(
                log, "listener.checkpoint.load_failed", logging.ERROR, exc=exc, listener=self._name
            )
        plan = plan_restore(
            checkpoint,
            change_kinds=self._change_kinds,
            controllers={source.name: source.resource for source in sources},
            resume=resume,
        )
        items = 0
        for source in sources:
            part = plan.mirrors.get(source.name)
            if part is None:
                source.track_changes()
            else:
                source.restore(part)
                items += len(part.items)
        self._sequence = plan.sequence
        self._confirmed = plan.sequence if plan.baseline else None
        self._saved_position = plan.cursor if plan.baseline else None
        elapsed = time.monotonic() - started
        self._update(
            loaded=checkpoint is not None,
            loaded_items=items,
            load_seconds=elapsed,
            resumed_from=plan.cursor is not None,
            not_resumed=plan.reason,
        )
        if checkpoint is not None:
            log_event(
                log,
                "listener.checkpoint.loaded",
                logging.INFO if plan.reason is None else logging.WARNING,
                listener=self._name,
                items=items,
                mirrors=sorted(plan.mirrors),
                cursor=plan.cursor,
                not_resumed=plan.reason,
                saved_at=checkpoint.saved_at,
                seconds=round(elapsed, 4),
            )
        self._restored.set()
        return plan.cursor

    async def _load(self) -> Checkpoint | None:
        """The store's checkpoint, within ``load_timeout``.

        Raises:
            CheckpointError: the store did not answer in time.
            Exception: what the store's ``load`` raised.
        """
        deadline = asyncio.timeout(self._load_timeout)
        try:
            async with deadline:
                return await self.store.load()
        except TimeoutError:
            if not deadline.expired():  # the store's own timeout: its error, as it said it
                raise
            raise CheckpointError(
                f"{self.store!r}: load did not finish within {self._load_timeout:g}s"
                " (ListenerConfig.checkpoint_load_timeout)"
            ) from None

    # -- saving ----------------------------------------------------------------

    def take(self) -> Checkpoint | None:
        """A checkpoint of the listener's position and every mirror, now (synchronous:
        nothing moves while it is taken). None before the load, or without a position."""
        position, sources = self._position(), self._sources()
        if not self._restored.is_set() or position is None:
            return None
        for source in sources:
            fresh = source.take_changed()
            self._unsaved.setdefault(source.name, set()).update(fresh)
            self._since_whole.setdefault(source.name, set()).update(fresh)
        whole = next_save_is_whole(
            baseline=self._confirmed is not None,
            changed_since_whole=sum(len(ids) for ids in self._since_whole.values()),
            size=sum(source.size() for source in sources),
        )
        parts = {
            source.name: source.checkpoint_part(
                None if whole else self._unsaved.get(source.name, set())
            )
            for source in sources
        }
        self._sequence += 1
        if whole:
            self._since_whole.clear()
        return Checkpoint(
            position,
            self._change_kinds,
            parts,
            whole=whole,
            sequence=self._sequence,
            base=None if whole else self._confirmed,
            saved_at=time.time(),
        )

    def due(self) -> bool:
        """Whether a periodic save has anything to save (what a failed one did not, too)."""
        return (
            self._position() != self._saved_position
            or any(self._unsaved.values())
            or any(source.has_changed() for source in self._sources())
        )

    def save(self, checkpoint: Checkpoint) -> asyncio.Task[bool]:
        """Hand ``checkpoint`` to the store once every save taken before it has ended
        (in the order they were taken: a later snapshot may build on an earlier one).
        The task's result: whether it was saved."""
        task = asyncio.create_task(
            self._save_after(self._last_save, checkpoint),
            name=f"changefeed-checkpoint-{self._name}",
        )
        self._last_save = task
        self._saves.add(task)
        task.add_done_callback(self._saves.discard)
        return task

    async def _save_after(
        self, previous: asyncio.Task[bool] | None, checkpoint: Checkpoint
    ) -> bool:
        if previous is not None:
            await asyncio.gather(previous, return_exceptions=True)
        started = time.monotonic()
        try:
            await self.store.save(checkpoint)
        except Exception as exc:
            if isinstance(exc, CheckpointError):
                # The store holds something else than the save ours would go on top
                # of (another writer): only a whole save can be right from here.
                self._confirmed = None
            self._update(
                save_failures=self._status.save_failures + 1,
                consecutive_failures=self._status.consecutive_failures + 1,
                last_error=f"save: {type(exc).__name__}: {exc}",
            )
            log_event(
                log,
                "listener.checkpoint.save_failed",
                logging.ERROR,
                exc=exc,
                listener=self._name,
                sequence=checkpoint.sequence,
                whole=checkpoint.whole,
            )
            return False
        elapsed = time.monotonic() - started
        self._confirmed = checkpoint.sequence
        self._saved_position = checkpoint.cursor
        if checkpoint.sequence == self._sequence:  # no later snapshot is under way
            self._unsaved.clear()
        items = checkpoint.items_count()
        self._update(
            saves=self._status.saves + 1,
            consecutive_failures=0,
            whole_saves=self._status.whole_saves + checkpoint.whole,
            last_save_seconds=elapsed,
            last_save_items=items,
            last_saved_at=checkpoint.saved_at,
        )
        log_event(
            log,
            "listener.checkpoint.saved",
            logging.DEBUG,
            listener=self._name,
            sequence=checkpoint.sequence,
            whole=checkpoint.whole,
            items=items,
            deleted=sum(len(part.deleted) for part in checkpoint.mirrors.values()),
            pending=sum(len(part.pending) for part in checkpoint.mirrors.values()),
            seconds=round(elapsed, 4),
        )
        return True

    # -- the periodic task and the end ---------------------------------------------

    def start(self) -> None:
        """Save every ``interval`` seconds while anything changed (idempotent)."""
        if self._periodic is None:
            self._periodic = asyncio.create_task(
                self._every_interval(), name=f"changefeed-checkpoints-{self._name}"
            )

    async def _every_interval(self) -> None:
        await self._restored.wait()
        while not self._frozen:
            await asyncio.sleep(self._interval)
            if self._frozen or self._saves or not self.due():
                continue
            checkpoint = self.take()
            if checkpoint is not None:
                self.save(checkpoint)

    def final(self, why: str) -> None:
        """Take the last checkpoint now and save it; no checkpoint is taken after it."""
        if self._frozen:
            return
        self._frozen = True
        self._update(frozen=True)
        checkpoint = self.take()
        log_event(
            log,
            "listener.checkpoint.final",
            listener=self._name,
            why=why,
            sequence=checkpoint.sequence if checkpoint is not None else None,
        )
        if checkpoint is not None:
            self.save(checkpoint)

    async def save_now(self) -> Checkpoint | None:
        """Take a checkpoint and save it now; the checkpoint, or None when none was
        taken (before the load, without a position, or after ``final``) or it failed."""
        if self._frozen:
            return None
        checkpoint = self.take()
        if checkpoint is None or not await self.save(checkpoint):
            return None
        return checkpoint

    async def close(self) -> None:
        """Stop the periodic task and wait for the saves under way (the final one too),
        at most ``CLOSE_WAIT`` seconds: a store that hangs must not hang the stop.
        Then close the store, if it has a ``close()`` (not when a save hung: its
        close would wait for it)."""
        periodic, self._periodic = self._periodic, None
        if periodic is not None:
            periodic.cancel()
            await asyncio.gather(periodic, return_exceptions=True)
        if await self._wait_for_saves():
            await self._close_store()
        elif _HOLDERS.get(id(self.store)) is self:
            del _HOLDERS[id(self.store)]  # not closed (a save hung), but no longer held

    def _hold_store(self) -> None:
        """Take the store for this listener.

        Raises:
            CheckpointRefused: another listener's checkpointer has it.
        """
        holder = _HOLDERS.setdefault(id(self.store), self)
        if holder is not self:
            raise CheckpointRefused(
                f"{self.store!r} is in use by listener {holder.name}: two listeners must"
                " not share a checkpoint store; give each its own store (file or name)"
            )

    async def _close_store(self) -> None:
        if _HOLDERS.get(id(self.store)) is not self:
            return  # never held (refused, or never loaded): another listener's, maybe
        del _HOLDERS[id(self.store)]
        close = getattr(self.store, "close", None)
        if close is None:
            return
        try:
            async with asyncio.timeout(CLOSE_WAIT):
                closing = close()
                if inspect.isawaitable(closing):
                    await closing
        except Exception as exc:
            log_event(
                log, "listener.checkpoint.close_failed", logging.ERROR, exc=exc, listener=self._name
            )

    async def _wait_for_saves(self) -> bool:
        """Whether every save under way ended within ``CLOSE_WAIT`` (the late ones are
        cancelled and logged)."""
        saves = list(self._saves)
        if not saves:
            return True
        _, late = await asyncio.wait(saves, timeout=CLOSE_WAIT)
        if late:
            log_event(
                log,
                "listener.checkpoint.abandoned",
                logging.ERROR,
                listener=self._name,
                saves=len(late),
                waited=CLOSE_WAIT,
            )
            for task in late:
                task.cancel()
            await asyncio.gather(*late, return_exceptions=True)
            # The file does not hold where the listener got to: a failure like any
            # other, which ``status()`` (and ``changefeed listen``'s exit) report.
            self._update(
                save_failures=self._status.save_failures + len(late),
                consecutive_failures=self._status.consecutive_failures + len(late),
                last_error=f"save: abandoned after {CLOSE_WAIT:g}s (the store hung)",
            )
        return not late
