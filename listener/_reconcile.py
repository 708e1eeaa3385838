"""A controller's core: its mirror, its work queue, where each id stands, and its workers.

client-go's informer + controller for RFD 5 feeds, which say *that* a
resource changed, never *what*:

* **In.** Change items (``take``) queue their ids, a batch at a time; a
  bootstrap (``resynced``) replaces the mirror in one step and queues every id
  whose state changed, with the state the application last saw; ids missing
  from the fresh list are deletes. Ids being fetched right then are queued
  again with a fresh fetch: a fetch that started before the list may finish
  after it with older state, and must never be the last word.
* **The work queue** (``_workqueue``) coalesces repeated changes to one id
  into one fetch and never hands one id to two workers at once.
* **Out.** A worker takes a batch of ids, fetches the current state of those
  that need it (``GET route/id``, or ``GET route?ids=a,b,c``; absent means
  deleted), writes it to the mirror and calls the application back with the
  state it last saw and the new one. A failed fetch or callback is retried
  per id with back-off; the application's view advances only when its
  callback returns, so a failed callback is called again with the same ``old``.

**Where an id stands** is one record, ``IdState``, kept only for ids with
something to remember: an id queued without a record was queued by a change
item, and is fetched and called back if its state changed. The record says
when an id needs a fetch although no item named it (a restore, a decode
that failed), when it needs none although it is queued (a bootstrap already
gave its state), what the application last saw of it, and why it is called
back although its state did not change (a periodic resync, a restore, a
callback that failed). What is in flight is the workers' ``_Batch`` objects;
the ids a checkpoint must save again are a change log (``_touched``).

Also here: periodic resyncs (``resync_pass``: every mirrored id handed to
the callbacks again with ``old == new``), resumes, and the mirror in and out
of checkpoints (``restore``, ``checkpoint_part``). The controller is synced
once its first bootstrap (or resume) is in and every id queued then has been
processed once (``_start_sync``): ids that change again meanwhile do not hold
it back.

Every change of this state happens in a step that does not wait, which is
what lets a checkpoint take every mirror with the cursor in one synchronous
step. It must never call back for an id concurrently, lose a change that
arrived while its id was being fetched, or let a stale fetch be the last word.
"""

from __future__ import annotations

import asyncio
import enum
import inspect
import logging
import math
import random
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import Any, Generic

import orjson
from typing_extensions import TypeVar

from changefeed.bootstrap import BootstrapError
from changefeed.logs import log_event
from changefeed.schemas import ChangeItem

from ._backoff import BackoffPolicy
from ._checkpoint import JsonItems, MirrorCheckpoint, application_view
from ._errors import ListenerError, RegistrationRefused
from ._events import ControllerCounts, Resynced
from ._handlers import AddHandler, DeleteHandler, Fetcher, ReconcileHandler, UpdateHandler
from ._idstate import NOTHING, UNSEEN, IdState
from ._lifecycle import FATAL_HTTP_STATUSES
from ._mirror import Mirror
from ._workqueue import WorkQueue

__all__ = ["Intake", "Reconciler", "T", "log"]

# The controller's logger: its events keep one logger name, whichever part logs them.
log = logging.getLogger("changefeed.listener.controller")

T = TypeVar("T", default=Any)


class _Undecodable:
    """What ``decode`` refused."""


UNDECODABLE = _Undecodable()


class Intake(enum.Enum):
    """Whether a controller on a shared listener takes the events its dispatch hands it."""

    WAITING = "waiting"
    """It has not run yet: the dispatch does not wait for it."""
    OPEN = "open"
    """It runs: it takes events as far as its work queue has room."""
    CLOSED = "closed"
    """The listener stopped it."""
    PARKED = "parked"
    """It ran and stopped, and its listener goes on for the others: it takes
    bootstraps into its mirror and marks changed ids pending (no workers, no
    callbacks), so that the listener's later checkpoints stay consistent for it."""


class _Batch:
    """The ids one worker holds: all of them are "processing" in the work queue."""

    __slots__ = ("fetching", "ids", "stale", "unsettled")

    def __init__(self, ids: list[str]) -> None:
        self.ids = ids
        self.fetching: Sequence[str] = ()
        """Ids whose fetch is under way."""
        self.unsettled: Sequence[str] = ids
        """Ids not processed through yet (the rest of the batch is)."""
        self.stale: Sequence[str] = ()
        """Ids whose completion here does not count towards ``synced`` (they were
        queued again by the first bootstrap, from data newer than this batch's)."""


async def _call(callback: Callable[..., Awaitable[None] | None], *args: Any) -> None:
    result = callback(*args)
    if inspect.isawaitable(result):
        await result


class Reconciler(Generic[T]):
    """One controller's mirror, work queue and workers (see the module docstring).

    Args:
        name: the controller's name, in logs.
        resource: the resource it mirrors ("": not said).
        fetch: fetches resources by id.
        key: the id of a listed resource, from its JSON.
        decode: turns a resource's JSON into ``T`` (None: ``T`` is the JSON).
        encode: turns a ``T`` back into JSON, for checkpoints.
        reconcile, on_add, on_update, on_delete: the callbacks.
        concurrency: workers.
        fetch_batch: ids per fetch at most.
        max_pending: ids waiting at most before it takes no more items.
        retry: the per-id retry schedule.
        rng: random source of the retry jitter.
    """

    def __init__(
        self,
        *,
        name: str,
        resource: str,
        fetch: Fetcher,
        key: Callable[[Any], str],
        decode: Callable[[Any], T] | None,
        encode: Callable[[T], Any] | None,
        reconcile: ReconcileHandler[T] | None,
        on_add: AddHandler[T] | None,
        on_update: UpdateHandler[T] | None,
        on_delete: DeleteHandler[T] | None,
        concurrency: int,
        fetch_batch: int,
        max_pending: int,
        retry: BackoffPolicy,
        rng: random.Random | None,
    ) -> None:
        self.name = name
        self.resource = resource
        self._fetch = fetch
        self._key = key
        self._decode = decode
        self._encode = encode
        self._reconcile = reconcile
        self._on_add = on_add
        self._on_update = on_update
        self._on_delete = on_delete
        self._concurrency = concurrency
        self._fetch_batch = fetch_batch
        self._max_pending = max_pending
        self._retry = retry
        self._rng = rng or random.Random()
        self.mirror: Mirror[T] = Mirror()
        self.queue: WorkQueue[str] = WorkQueue()
        self._ids: dict[str, IdState] = {}
        self._batches: set[_Batch] = set()
        self._touched: set[str] | None = None
        """Ids whose state as the application saw it may have changed since the last
        checkpoint (None: no checkpoint is kept)."""
        self._room = asyncio.Event()
        self._stopped = False
        self.refused: RegistrationRefused | None = None
        """Set when a fetch was refused for good (HTTP 401 or 403): the token may no
        longer read the resource, and retrying cannot heal that."""
        self._refusal = asyncio.Event()
        self.intake = Intake.WAITING
        """On a shared listener: whether it takes what the dispatch hands it."""
        self.route: str | None = None
        """The route of the last bootstrap (a default fetch asks the latest ack's first)."""
        self.synced = asyncio.Event()
        self._resynced_once = False
        self._awaiting = 0
        """Ids the first sync still waits for (``IdState.awaited``)."""
        self._restored = False
        self._replay_until: float | None = None
        """Until then (monotonic), change items make their ids ``forced``."""
        self.counts = ControllerCounts()

    def _record(self, key: str) -> IdState:
        """``key``'s record, made if it has none (an id queued without one was queued
        by a change item: it still needs its fetch)."""
        record = self._ids.get(key)
        if record is None:
            record = self._ids[key] = IdState(self.queue.is_queued(key))
        return record

    def _failed(self, record: IdState) -> float:
        """One more failure of an id: the delay before it is tried again."""
        record.failures += 1
        return self._retry.delay(record.failures, self._rng)

    async def until_refused(self) -> None:
        """Return never; raise ``refused`` once a fetch was refused for good.

        Raises:
            RegistrationRefused: code ``http_401`` or ``http_403``, the request's
                answer in its message.
        """
        await self._refusal.wait()
        assert self.refused is not None
        raise self.refused

    def close_intake(self) -> None:
        """The listener stopped: it takes nothing more, and the dispatch does not wait."""
        if self.intake is Intake.OPEN:
            self.intake = Intake.CLOSED
        self._room.set()

    def stop(self) -> None:
        """The controller stopped: no worker takes anything more, nobody waits for room;
        on a shared listener it ran on, it is parked."""
        self._stopped = True
        if self.intake in (Intake.OPEN, Intake.CLOSED):
            self.intake = Intake.PARKED
        self._room.set()
        self.queue.shut_down()

    # -- in -----------------------------------------------------------------------------

    def queue_room(self) -> int:
        """How many more change items it takes before its work queue is full."""
        return self._max_pending - self.queue.pending

    async def wait_queue_room(self) -> None:
        """Return once there is room, or it stopped."""
        while self.queue_room() <= 0 and not self._stopped:
            self._room.clear()
            await self._room.wait()

    # The dispatch of a shared listener (``_inbox.Sink``) asks ``room``, not
    # ``queue_room``: a controller that does not take events (not running yet,
    # stopped) never holds the others up.

    def room(self) -> int:
        return self.queue_room() if self.intake is Intake.OPEN else 1 << 30

    async def wait_room(self) -> None:
        while self.intake is Intake.OPEN and self.queue_room() <= 0 and not self._stopped:
            self._room.clear()
            await self._room.wait()

    def changed(self, items: Sequence[ChangeItem]) -> None:
        if self.intake is Intake.OPEN:
            self.take(items)
        elif self.intake is Intake.PARKED:
            self.mark(items)

    def resynced(self, event: Resynced) -> None:
        if self.intake in (Intake.OPEN, Intake.PARKED):
            self.resync(event)

    def take(self, items: Sequence[ChangeItem]) -> None:
        """Change items (never more than ``queue_room()``): their ids need a fetch."""
        self.counts.items += len(items)
        ids = [item.changed_resource_id for item in items]
        records = self._ids
        if records:
            for key in records.keys() & ids:
                records[key].fetch = True
        if self._replay_until is not None:
            if time.monotonic() < self._replay_until:
                for key in ids:
                    record = self._record(key)
                    record.fetch = record.forced = True
            else:
                self._replay_until = None
        self.queue.add_many(ids)

    def mark(self, items: Sequence[ChangeItem]) -> None:
        """Change items for a parked controller: only marked pending, so that a
        checkpoint saves their ids as pending, and a restart fetches them as if the
        controller had run on."""
        for item in items:
            self._record(item.changed_resource_id).fetch = True

    def resync(self, event: Resynced) -> None:
        """A bootstrap: the fresh list replaces the mirror; what changed is queued."""
        self.route = event.route
        fresh: dict[str, T] = {}
        refetch: list[str] = []
        for obj in event.items:
            try:
                key = self._key(obj)
            except (KeyError, TypeError, IndexError):
                log_event(
                    log, "controller.unkeyed", logging.WARNING, controller=self.name, item=obj
                )
                continue
            value = self._decoded(key, obj)
            if isinstance(value, _Undecodable):
                # Not the application's type: keep what the mirror held, and fetch
                # it again (with back-off) until it decodes.
                refetch.append(key)
                if key in self.mirror:
                    fresh[key] = self.mirror[key]
                continue
            fresh[key] = value
        changes = self.mirror.replace(fresh)
        for change in changes:
            record = self._record(change.id)
            if record.seen is UNSEEN:
                record.seen = change.old
        self.queue.add_many(change.id for change in changes)
        if self._touched is not None:
            self._touched.update(change.id for change in changes)
        busy = self.queue.processing
        for key in busy:
            self._record(key).fetch = True
            self.queue.add(key)
        for key in refetch:
            record = self._record(key)
            record.fetch = True
            self.queue.add_rate_limited(key, self._failed(record))
        self.counts.resyncs += 1
        log_event(
            log,
            "controller.resynced",
            controller=self.name,
            items=len(fresh),
            changed=len(changes),
            undecodable=len(refetch),
            initial=event.initial,
            pending=self.queue.pending,
        )
        self._start_sync(busy)

    def resumed(self, replay: float) -> None:
        """The listener resumed: for a mirror loaded from a checkpoint, this is what a
        first bootstrap is to an empty one; the change items replayed for ``replay``
        seconds are called back even when unchanged (``IdState.forced``)."""
        if not self._resynced_once:
            self._start_sync()
            if self._restored:
                self._replay_until = time.monotonic() + replay

    def resync_pass(self) -> None:
        """Queue every mirrored id for a callback with ``old == new`` (coalescing with
        real changes already queued)."""
        ids = list(self.mirror)
        for key in ids:
            self._record(key).resync = True
        self.queue.add_many(ids)
        self.counts.periodic_resyncs += 1
        log_event(
            log,
            "controller.periodic_resync",
            logging.DEBUG,
            controller=self.name,
            ids=len(ids),
            pending=self.queue.pending,
        )

    # -- synced -------------------------------------------------------------------------

    def _start_sync(self, busy: Iterable[str] = ()) -> None:
        """The first bootstrap (or resume) is in: synced once every id queued now has
        been processed once. A snapshot, so that a steady stream of new changes does
        not keep the controller from ever being synced. ``busy``: ids a worker holds
        with a fetch that started before, queued again; their next completion is that
        stale one and does not count."""
        if self._resynced_once:
            return
        self._resynced_once = True
        unsettled = {key for batch in self._batches for key in batch.unsettled}
        snapshot = self.queue.queued() | unsettled
        for key in snapshot:
            self._record(key).awaited = True
        busy = set(busy)
        for batch in self._batches:
            batch.stale = [key for key in batch.unsettled if key in busy]
            for key in batch.stale:
                self._ids[key].skip = True
        self._awaiting = len(snapshot)
        if not snapshot:
            self._set_synced()

    def _settled(self, record: IdState) -> None:
        """The id was processed through (fetched if it needed it, called back if due)."""
        if record.awaited:
            if record.skip:
                record.skip = False
                return
            record.awaited = False
            self._awaiting -= 1
            if not self._awaiting:
                self._set_synced()

    def _set_synced(self) -> None:
        self.synced.set()
        log_event(log, "controller.synced", controller=self.name, items=len(self.mirror))

    # -- out: the workers ----------------------------------------------------------------

    async def work(self) -> None:
        """One worker: take batches of ids until the queue shuts down."""
        queue = self.queue
        while True:
            share = math.ceil(len(queue) / self._concurrency)
            ids = await queue.get(max(1, min(self._fetch_batch, share)))
            if not ids:
                return
            if queue.pending < self._max_pending:
                self._room.set()
            batch = _Batch(ids)
            self._batches.add(batch)
            try:
                await self._process(batch)
            except Exception as exc:  # a bug in this module: keep the ids, keep going
                log_event(log, "controller.crashed", logging.ERROR, exc=exc, controller=self.name)
                for key in ids:
                    record = self._record(key)
                    record.fetch = True
                    queue.add_rate_limited(key, self._failed(record))
            finally:
                self._batches.discard(batch)
                for key in batch.stale:
                    # Its stale completion is over, whatever came of it (a failed
                    # fetch or callback never settles): the next one counts.
                    if (stale := self._ids.get(key)) is not None:
                        stale.skip = False
                queue.done_many(ids)
                if queue.pending < self._max_pending:
                    self._room.set()

    async def _process(self, batch: _Batch) -> None:
        ids, records = batch.ids, self._ids
        special = bool(records) and not records.keys().isdisjoint(ids)
        if special:
            fetch = [key for key in ids if (r := records.get(key)) is None or r.fetch]
        else:
            fetch = ids  # the common case: every id was named by a change item
        failed = await self._refresh(batch, fetch) if fetch else set()
        # Ids with a record are due a callback (a change was just written, or a resync,
        # a restore, a failure says so) or awaited; the others are done.
        due = (
            [key for key in ids if key in records and key not in failed]
            if records and not records.keys().isdisjoint(ids)
            else []
        )
        batch.unsettled = due
        for i, key in enumerate(due):
            record = records.get(key)
            if record is not None:
                if record.seen is UNSEEN and not record.resync and not record.forced:
                    record.failures = 0  # fetched: nothing for the application
                elif not await self._notify(key, record):
                    batch.unsettled = due[i + 1 :]
                    continue  # retried later
                self._settled(record)
                if record.idle and not self.queue.is_queued(key):
                    # (Kept while queued, e.g. a retry still due: an id queued without a
                    # record would read as one a change item named.)
                    del records[key]
            batch.unsettled = due[i + 1 :]

    async def _refresh(self, batch: _Batch, ids: list[str]) -> set[str]:
        """Fetch ``ids`` into the mirror; return the ids whose fetch failed."""
        records = self._ids
        if records:
            # Unmark first: an item arriving during the fetch marks the id again.
            for key in records.keys() & ids:
                records[key].fetch = False
        batch.fetching = ids
        debug = log.isEnabledFor(logging.DEBUG)
        started = time.monotonic() if debug else 0.0
        try:
            found = await self._fetch(ids)
        except BaseException as exc:
            # Cut short or failed: the ids need their fetch still (a checkpoint counts
            # them as pending).
            batch.fetching = ()
            for key in ids:
                self._record(key).fetch = True
            if not isinstance(exc, Exception):
                raise
            self.counts.fetch_errors += 1
            for key in ids:
                self.queue.add_rate_limited(key, self._failed(self._ids[key]))
            # The default fetch's failures are said in full by their message; anything
            # else (an application's fetch that broke) needs its traceback.
            expected = isinstance(exc, (BootstrapError, ListenerError))
            status = getattr(exc, "status", None) if isinstance(exc, BootstrapError) else None
            refused = status in FATAL_HTTP_STATUSES
            log_event(
                log,
                "controller.fetch_refused" if refused else "controller.fetch_failed",
                logging.ERROR if refused else logging.WARNING,
                exc=None if expected else exc,
                controller=self.name,
                ids=len(ids),
                error=f"{type(exc).__name__}: {exc}",
            )
            if refused and self.refused is None:
                self.refused = RegistrationRefused(f"http_{status}", str(exc))
                self._refusal.set()
            return set(ids)
        batch.fetching = ()
        self.counts.fetch_requests += 1
        self.counts.fetches += len(ids)
        if debug:  # per batch: not even its arguments otherwise
            log_event(
                log,
                "controller.fetched",
                logging.DEBUG,
                controller=self.name,
                ids=len(ids),
                found=len(found),
                elapsed=round(time.monotonic() - started, 4),
            )
        if not found and not self.mirror.holds_any(ids):
            return set()  # absent before and after: nothing changed
        return self._write(ids, found)

    def _write(self, ids: list[str], found: Any) -> set[str]:
        """Write what was fetched to the mirror, remembering what the application saw;
        return the ids ``decode`` refused."""
        failed: set[str] = set()
        mirror, decode, touched = self.mirror, self._decode, self._touched
        for key in ids:
            raw = found.get(key)
            new: Any = raw
            if raw is not None and decode is not None:
                new = self._decoded(key, raw)
            if isinstance(new, _Undecodable):
                failed.add(key)
                record = self._record(key)
                record.fetch = True
                self.queue.add_rate_limited(key, self._failed(record))
                continue
            old = mirror.get(key)
            if new == old:
                continue
            record = self._record(key)
            if record.seen is UNSEEN:
                record.seen = old
            if new is None:
                mirror.delete(key)
            else:
                mirror.put(key, new)
            if touched is not None:
                touched.add(key)
        return failed

    def _done_with(self, record: IdState) -> None:
        record.resync = record.forced = False
        record.failures = 0

    async def _notify(self, key: str, record: IdState) -> bool:
        """Call the application back for ``key`` if it is due; False: the callback
        raised and is retried later."""
        new = self.mirror.get(key)
        forced = record.forced
        resync = forced or record.resync
        # A forced id absent before and after may have existed in between (created
        # and deleted after the checkpoint): reconcile(id, None, None) says it is gone.
        absent_too = forced and self._reconcile is not None
        if record.seen is not UNSEEN:
            seen = old = record.seen
            if old == new:
                attempted = record.attempted
                if attempted is NOTHING or attempted == new:
                    record.seen = UNSEEN
                    record.attempted = NOTHING
                    if not resync or (new is None and not absent_too):
                        self._done_with(record)
                        return True
                else:
                    # A failed callback for this id may have applied part of its
                    # change, and the mirror is back where it was: undo from there.
                    old = attempted
        elif new is None:  # a resync of an id deleted meanwhile: its delete went out
            if not absent_too:
                self._done_with(record)
                return True
            seen = old = None
        else:
            seen = old = new  # a periodic resync (or a forced id): old == new
        try:
            await self._callback(key, old, new)
        except Exception as exc:
            if old == seen and record.seen is not UNSEEN:
                record.attempted = new
            self.counts.reconcile_errors += 1
            delay = self._failed(record)
            self.queue.add_rate_limited(key, delay)
            log_event(
                log,
                "controller.reconcile_failed",
                logging.WARNING,
                exc=exc,
                controller=self.name,
                id=key,
                failures=record.failures,
                retry_in=round(delay, 4),
            )
            return False
        self.counts.reconciles += 1
        self._done_with(record)
        record.attempted = NOTHING
        # The mirror may have moved on during the callback (a resync): the
        # application now holds ``new``; the id is already queued again.
        record.seen = UNSEEN if self.mirror.get(key) == new else new
        if self._touched is not None and seen != new:
            self._touched.add(key)  # what the application saw changed
        return True

    async def _callback(self, key: str, old: T | None, new: T | None) -> None:
        if self._reconcile is not None:
            await _call(self._reconcile, key, old, new)
        elif old is None:
            if self._on_add is not None:
                await _call(self._on_add, key, new)
        elif new is None:
            if self._on_delete is not None:
                await _call(self._on_delete, key, old)
        elif self._on_update is not None:
            await _call(self._on_update, key, old, new)

    def _decoded(self, key: str, obj: Any) -> T | _Undecodable:
        """``obj`` as the application's type, or ``UNDECODABLE`` when ``decode`` refuses it."""
        if self._decode is None:
            decoded: T = obj  # no decoder: T is the JSON itself
            return decoded
        try:
            return self._decode(obj)
        except Exception as exc:
            self.counts.decode_errors += 1
            log_event(
                log,
                "controller.decode_failed",
                logging.WARNING,
                exc=exc,
                controller=self.name,
                id=key,
            )
            return UNDECODABLE

    # -- checkpoints ----------------------------------------------------------------------

    def restore(self, part: MirrorCheckpoint) -> None:
        """Start from a checkpoint's mirror (no callbacks for it); its pending ids, and
        any ``decode`` refuses, are fetched again and called back if they changed.
        Without ``decode``, the resources stay encoded until first read."""
        refetch = set(part.pending)
        held = part.items
        if self._decode is None:
            if isinstance(held, JsonItems) and not held.values_held:
                # Decoded as they are read: going live does not wait for a million objects.
                encoded = held.encoded
                self.mirror.restore_encoded(
                    encoded if isinstance(encoded, dict) else dict(encoded), orjson.loads
                )
            else:
                self.mirror.restore(held)  # the JSON itself is T
        else:
            decoded: dict[str, T] = {}
            for key, raw in held.items():
                value = self._decoded(key, raw)
                if isinstance(value, _Undecodable):
                    refetch.add(key)
                else:
                    decoded[key] = value
            self.mirror.restore(decoded)
        self._touched = set()
        self._restored = True
        for key in refetch:
            record = self._record(key)
            record.fetch = record.forced = True
        self.queue.add_many(refetch)
        log_event(
            log,
            "controller.restored",
            controller=self.name,
            items=len(self.mirror),
            pending=len(refetch),
        )

    def track_changes(self) -> None:
        """Start counting the ids a checkpoint must save again (nothing was restored)."""
        if self._touched is None:
            self._touched = set()

    def take_touched(self) -> set[str]:
        """The ids whose saved state may differ now, since the last call."""
        touched = self._touched or set()
        self._touched = set()
        return touched

    def has_touched(self) -> bool:
        return bool(self._touched)

    def pending(self) -> set[str]:
        """Every id whose state may be newer than the application's view: queued by a
        change item, being fetched, or with a record that says so."""
        ids = self._ids
        pending = {key for key, record in ids.items() if record.pending}
        pending.update(key for key in self.queue.queued() if key not in ids)
        for batch in self._batches:
            pending.update(batch.fetching)
        return pending

    def checkpoint_part(self, changed: set[str] | None) -> MirrorCheckpoint:
        """This controller's part of a checkpoint taken now: every resource as the
        application saw it (``changed`` None), or those of ``changed`` (ids absent
        from the view are deleted), and every id with work outstanding."""
        seen = {key: r.seen for key, r in self._ids.items() if r.seen is not UNSEEN}
        deleted: list[str] = []
        encoded: dict[str, bytes] = {}
        if changed is None:
            values, encoded = self.mirror.copy_parts()
            for key in seen:
                encoded.pop(key, None)  # what the application saw instead, or nothing
            view = application_view(values, seen)
        else:
            view = {}
            get = self.mirror.get
            for key in changed:
                value = seen[key] if key in seen else get(key)
                if value is None:
                    deleted.append(key)
                else:
                    view[key] = value
        return MirrorCheckpoint(
            self.resource, JsonItems(view, encoded, self._encode), deleted, self.pending()
        )
