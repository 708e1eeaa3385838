"""How a controller's mirror gets in sync and stays so: bootstraps, resumes, periodic resyncs.

* A ``Resynced`` (bootstrap) replaces the mirror in one step. Ids whose state
  changed are queued for the application's callbacks; ids missing from the
  fresh list are deletes. Ids being fetched right then are queued again with a
  fresh fetch, because a fetch that started before the list may finish after
  it with older state. What ``decode`` refuses keeps what the mirror held and
  is fetched again with back-off.
* A resume is, to a mirror loaded from a checkpoint, what a first bootstrap is
  to an empty one: the change items replayed for ``checkpoint_replay`` seconds
  after it are called back even when unchanged (``_forced``). When the
  publisher cannot resume, the bootstrap calls back the difference from the
  loaded mirror, like any other.
* With ``resync_period``, every resource of the mirror goes through the work
  queue again once a period, and the application is called with ``old ==
  new`` (client-go's resync): a change the application dropped is handed to
  it again, without listing anything again.
* The controller is synced once its first bootstrap (or resume) is in and
  every id queued then has been processed once (``_start_sync``): ids that
  change again meanwhile do not hold it back, so it syncs under steady load.

This part only queues ids; the workers (``_reconcile``) fetch them and call
the application back. It must never call the application itself, nor let a
fetch that started before a bootstrap be the last word.
"""

from __future__ import annotations

import asyncio
import logging
import time

from changefeed.logs import log_event

from ._controller_state import ControllerState, T, Undecodable, log
from ._events import Resynced
from ._listener import Listener

__all__ = ["Resyncing"]


class Resyncing(ControllerState[T]):
    """The controller's part that applies bootstraps, resumes and periodic resyncs."""

    def _apply_resync(self, event: Resynced) -> None:
        self._route = event.route
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
            if isinstance(value, Undecodable):
                # Not the application's type: keep what the mirror held, and fetch
                # it again (with back-off) until it decodes.
                refetch.append(key)
                if key in self._mirror:
                    fresh[key] = self._mirror[key]
                continue
            fresh[key] = value
        changes = self._mirror.replace(fresh)
        for change in changes:
            self._seen.setdefault(change.id, change.old)
            self.queue.add(change.id)
        if self._touched is not None:
            self._touched.update(change.id for change in changes)
        busy = self.queue.processing
        for key in busy:
            self._stale.add(key)
            self.queue.add(key)
        for key in refetch:
            self._stale.add(key)
            self.queue.add_rate_limited(key, self._retry.failure(key))
        self.resyncs += 1
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

    def _resumed(self) -> None:
        """The listener resumed: for a mirror loaded from a checkpoint, this is what
        a first bootstrap is to an empty one; the change items replayed now are
        called back even when unchanged (see ``_forced``)."""
        if not self._resynced_once:
            self._start_sync()
            if self._restored and isinstance(self.listener, Listener):
                self._replay_until = time.monotonic() + self.listener.config.checkpoint_replay

    async def _resync_every(self, period: float) -> None:
        await self._synced.wait()
        while True:
            await asyncio.sleep(period)
            self._resync_pass()

    def _resync_pass(self) -> None:
        """Queue every mirrored id for a callback with ``old == new`` (coalescing with
        real changes already queued)."""
        ids = list(self._mirror)
        self._resyncing.update(ids)
        self.queue.add_many(ids)
        self.periodic_resyncs += 1
        log_event(
            log,
            "controller.periodic_resync",
            logging.DEBUG,
            controller=self.name,
            ids=len(ids),
            pending=self.queue.pending,
        )
