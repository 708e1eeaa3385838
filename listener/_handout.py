"""Handing out to the application: ``async for``, or the dispatch task of attached controllers.

Events go out in feed order: a bootstrap's ``Resynced`` events first (one per
change kind, all with the ack's cursor), then the change items the buffer
holds, all of them at a time (``_next_unit``). ``async for`` stages such a
batch and hands it out one item at a time (``Listener.__anext__``). When
controllers are attached, a dispatch task hands each of them its resource's
events instead, in runs of one resource, each chunk no larger than the
controller's work queue has room for (``max_pending``), waiting for room
otherwise: a controller that falls behind fills the buffer, which overflows
(abort, clear, re-bootstrap of every change kind) rather than grow. Items
taken from the buffer and not handed over yet still count against its
capacity (``_in_hand``).

The cursor follows what is handed out, so a reconnect resumes after the
last event the application got, and nothing that was buffered and then
cleared is lost. After a bootstrap it moves only with the last ``Resynced``
(one per change kind): a reconnect before that bootstraps every change kind
again rather than resume past the ``Resynced`` events not handed out yet.
For controllers, the position a checkpoint saves follows each chunk (their
mirrors take it in the same step), and after a bootstrap only once the
``Resynced`` of every resource is in.

It must never hand the application an item of a connection before that
connection's ``Resynced`` events, nor anything a clear dropped meanwhile.
"""

from __future__ import annotations

import logging

from changefeed.logs import log_event
from changefeed.schemas import ChangeItem

from ._events import Resynced
from ._listener_state import ListenerState, S, log

__all__ = ["HandingOut"]


def _runs(items: list[ChangeItem]) -> list[tuple[str, list[ChangeItem]]]:
    """``items`` cut into runs of one resource each, in feed order."""
    runs: list[tuple[str, list[ChangeItem]]] = []
    current = ""
    run: list[ChangeItem] = []
    for item in items:
        resource = item.change_kind.resource
        if resource != current:
            run = []
            runs.append((resource, run))
            current = resource
        run.append(item)
    return runs


class HandingOut(ListenerState):
    """The listener's part that hands events to the application."""

    async def _next_unit(self) -> Resynced | list[ChangeItem]:
        """Wait for what goes out next: a ``Resynced``, or every item the buffer holds.

        Raises:
            StopAsyncIteration: the listener was closed.
            RegistrationRefused, RetriesExhausted: it stopped for good.
        """
        while True:
            if self._resyncs:
                return self._resyncs.popleft()
            if self._fatal is not None:
                raise self._fatal
            state = self._lifecycle.state
            if state is S.STOPPED:
                raise StopAsyncIteration
            if state is S.LIVE and len(self._buffer):
                generation = self._generation
                taken = await self._buffer.take(self._buffer.capacity)
                if generation == self._generation and taken:  # not cleared meanwhile
                    return taken
                continue
            self._ready.clear()
            await self._ready.wait()

    async def _dispatch(self) -> None:
        """Hand every attached controller its resource's events until the listener stops."""
        ending: BaseException | None = None
        try:
            while True:
                unit = await self._next_unit()
                if isinstance(unit, Resynced):
                    self._handed = unit.cursor
                    for sink in self._sinks.get(unit.resource, ()):
                        sink.resynced(unit)
                    if not self._resyncs:  # every resource of the bootstrap is in
                        self._cursor = self._position = unit.cursor
                else:
                    self._in_hand = len(unit)
                    try:
                        await self._hand_over(unit)
                    finally:
                        self._in_hand = 0
        except StopAsyncIteration:
            pass
        except Exception as exc:
            if exc is not self._fatal:  # a bug here: stop loudly rather than hang the controllers
                log_event(
                    log, "listener.dispatch_crashed", logging.ERROR, exc=exc, **self._fields()
                )
                self._stop_with(exc)
                if self._task is not None:
                    self._task.cancel()
            ending = exc
        self._stop_sinks(ending)

    async def _hand_over(self, items: list[ChangeItem]) -> None:
        """Hand ``items`` to their controllers in feed order, each chunk no larger than
        its controller has room for; the cursor follows each chunk handed over."""
        generation = self._generation
        runs = _runs(items) if self._multi else [(self.resources[0], items)]
        for resource, run in runs:
            start, end = 0, len(run)
            while start < end:
                sinks = self._sinks.get(resource, ())
                room = min((sink.room() for sink in sinks), default=end)
                if room <= 0:
                    full = next(sink for sink in sinks if sink.room() <= 0)
                    await full.wait_room()
                    if generation != self._generation:
                        return  # the connection ended meanwhile: its items were dropped
                    continue
                chunk = run if start == 0 and room >= end else run[start : start + room]
                for sink in sinks:
                    sink.changed(chunk)
                start += len(chunk)
                self._in_hand -= len(chunk)
                self._dispatched += len(chunk)
                self._cursor = self._handed = self._position = chunk[-1].cursor

    def _stop_sinks(self, error: BaseException | None) -> None:
        if self._checkpointer is not None:  # while every mirror still follows the cursor
            self._checkpointer.final("listener stopped")
        for sinks in list(self._sinks.values()):
            for sink in sinks:
                sink.stopped(error)
