"""The controller's workers: fetch what changed, write it to the mirror, call the application back.

* Change items (``_controller_sink``) mark their ids stale and queue them
  (a batch at a time). A worker fetches the current state (``GET route/id``,
  or ``GET route?ids=a,b,c`` for several at once; absent means deleted),
  writes it to the mirror and calls ``on_add`` / ``on_update`` /
  ``on_delete`` (or one ``reconcile``) with the state the application last
  saw and the new one.
* The work queue coalesces repeated changes to one id into one fetch and
  never processes one id concurrently; fetch concurrency is bounded by the
  number of workers. A failed fetch or callback is retried per id with
  exponential back-off; the application's view advances only when its
  callback returns, so a failed callback is called again with the same ``old``.
* Duplicate and out-of-order items are harmless: every fetch reads current state.
* An id handed out again although the mirror did not change (a periodic
  resync, a forced id after a restore) is called back with ``old == new``.
  One whose state went back to what the application saw while a callback
  for it kept failing is called back from the state that callback was
  given: the application may hold part of it.

It must never call back for an id concurrently, lose a change that arrived
while its id was being fetched, or let a stale fetch be the last word.
"""

from __future__ import annotations

import inspect
import logging
import math
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

from changefeed.bootstrap import fetch_many, fetch_one
from changefeed.logs import log_event

from ._controller_state import ControllerState, T, Undecodable, log
from ._errors import ListenerError
from ._listener import Listener

__all__ = ["Reconciling"]

_NOTHING = object()
"""No failed callback is on record for an id."""


async def _call(callback: Callable[..., Awaitable[None] | None], *args: Any) -> None:
    result = callback(*args)
    if inspect.isawaitable(result):
        await result


class Reconciling(ControllerState[T]):
    """The controller's part that turns queued ids into fetches, mirror writes and callbacks."""

    async def _work(self) -> None:
        queue = self.queue
        while True:
            share = math.ceil(len(queue) / self.concurrency)
            ids = await queue.get(max(1, min(self.fetch_batch, share)))
            if not ids:
                return
            if queue.pending < self.max_pending:
                self._room.set()
            try:
                await self._process(ids)
            except Exception as exc:  # a bug in this module: keep the ids, keep going
                log_event(log, "controller.crashed", logging.ERROR, exc=exc, controller=self.name)
                for key in ids:
                    self._stale.add(key)
                    queue.add_rate_limited(key, self._retry.failure(key))
            finally:
                self._through.difference_update(ids)
                queue.done_many(ids)
                if queue.pending < self.max_pending:
                    self._room.set()

    async def _process(self, ids: list[str]) -> None:
        stale = self._stale
        failed = await self._refresh([key for key in ids if key in stale])
        seen, resyncing = self._seen, self._resyncing
        retrying = len(self._retry) > 0  # any id with failures on record
        for key in ids:
            if key in failed:
                continue
            if key not in seen and key not in resyncing and key not in self._forced:
                # nothing for the application
                if retrying:
                    self._retry.forget(key)
            elif not await self._notify(key):
                continue  # retried later
            self._settled(key)
            self._through.add(key)

    async def _refresh(self, stale: list[str]) -> set[str]:
        """Fetch ``stale`` ids into the mirror; return the ids whose fetch failed."""
        if not stale:
            return set()
        # Unmark first: an item arriving during the fetch marks the id again. Until
        # the result is in the mirror the ids are "fetching": a checkpoint counts
        # them as pending, and a fetch cut short (cancelled) marks them again.
        self._stale.difference_update(stale)
        self._fetching.update(stale)
        started = time.monotonic()
        try:
            found = await self._fetch(stale)
        except BaseException as exc:
            self._fetching.difference_update(stale)
            self._stale.update(stale)
            if not isinstance(exc, Exception):
                raise
            self.fetch_errors += 1
            for key in stale:
                self.queue.add_rate_limited(key, self._retry.failure(key))
            log_event(
                log,
                "controller.fetch_failed",
                logging.WARNING,
                controller=self.name,
                ids=len(stale),
                error=f"{type(exc).__name__}: {exc}",
            )
            return set(stale)
        self.fetch_requests += 1
        self.fetches += len(stale)
        log_event(
            log,
            "controller.fetched",
            logging.DEBUG,
            controller=self.name,
            ids=len(stale),
            found=len(found),
            elapsed=round(time.monotonic() - started, 4),
        )
        self._fetching.difference_update(stale)
        failed: set[str] = set()
        current = self._mirror.get
        decode = self._decode
        touched = self._touched
        for key in stale:
            raw = found.get(key)
            new: T | Undecodable | None = raw
            if raw is not None and decode is not None:
                new = self._decoded(key, raw)
            if isinstance(new, Undecodable):
                failed.add(key)
                self._stale.add(key)
                self.queue.add_rate_limited(key, self._retry.failure(key))
                continue
            old = current(key)
            if new == old:
                continue
            self._seen.setdefault(key, old)
            if new is None:
                self._mirror.delete(key)
            else:
                self._mirror.put(key, new)
            if touched is not None:
                touched.add(key)
        return failed

    def _done_with(self, key: str) -> None:
        self._resyncing.discard(key)
        self._forced.discard(key)
        self._retry.forget(key)

    async def _notify(self, key: str) -> bool:
        """Call the application back for ``key`` if it is due; False: the callback
        raised and is retried later."""
        new = self._mirror.get(key)
        forced = key in self._forced
        resync = forced or key in self._resyncing
        # A forced id absent before and after may have existed in between (created
        # and deleted after the checkpoint): reconcile(id, None, None) says it is gone.
        absent_too = forced and self._reconcile is not None
        if key in self._seen:
            seen = old = self._seen[key]
            if old == new:
                attempted = self._attempted.get(key, _NOTHING)
                if attempted is _NOTHING or attempted == new:
                    del self._seen[key]
                    self._attempted.pop(key, None)
                    if not resync or (new is None and not absent_too):
                        self._done_with(key)
                        return True
                else:
                    # A failed callback for this id may have applied part of its
                    # change, and the mirror is back where it was: undo from there.
                    old = attempted
        elif new is None:  # a resync of an id deleted meanwhile: its delete went out
            if not absent_too:
                self._done_with(key)
                return True
            seen = old = None
        else:
            seen = old = new  # a periodic resync (or a forced id): old == new
        try:
            await self._dispatch(key, old, new)
        except Exception as exc:
            if old == seen and key in self._seen:
                self._attempted[key] = new
            self.reconcile_errors += 1
            delay = self._retry.failure(key)
            self.queue.add_rate_limited(key, delay)
            log_event(
                log,
                "controller.reconcile_failed",
                logging.WARNING,
                exc=exc,
                controller=self.name,
                id=key,
                failures=self._retry.failures(key),
                retry_in=round(delay, 4),
            )
            return False
        self.reconciles += 1
        self._resyncing.discard(key)
        self._forced.discard(key)
        self._attempted.pop(key, None)
        self._retry.forget(key)
        # The mirror may have moved on during the callback (a resync): the
        # application now holds ``new``; the id is already queued again.
        if self._mirror.get(key) == new:
            self._seen.pop(key, None)
        else:
            self._seen[key] = new
        if self._touched is not None and seen != new:
            self._touched.add(key)  # what the application saw changed
        return True

    async def _dispatch(self, key: str, old: T | None, new: T | None) -> None:
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

    async def _default_fetch(self, ids: Sequence[str]) -> Mapping[str, Any]:
        listener = self.listener
        assert isinstance(listener, Listener) and self.resource is not None
        # The latest ack's route: a resumed reconnect may name another than the
        # last bootstrap's, and the old one may answer 404, which reads as a delete.
        route = listener.routes.get(self.resource) or self._route
        if route is None:
            # Ids loaded from a checkpoint as pending are fetched from the route
            # the first ack names.
            await listener._registered.wait()
            route = listener.routes.get(self.resource)
        if route is None:
            raise ListenerError("no resource route yet: the listener has not registered")
        if len(ids) == 1:
            one = await fetch_one(
                listener.http, route, ids[0], max_attempts=self.fetch_attempts, max_wait=30.0
            )
            return {} if one is None else {ids[0]: one}
        return await fetch_many(
            listener.http,
            route,
            ids,
            chunk=self.fetch_batch,
            id_field=self._id_field,
            max_attempts=self.fetch_attempts,
            max_wait=30.0,
        )
