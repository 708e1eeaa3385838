"""Where a controller's events come in: its listener's dispatch task, or another source.

A Listener hands an attached controller its resource's events through a
``ControllerSink`` (the controller's side of ``_sink.Sink``; a separate
object, so that these calls are not part of the controller's public face):
a ``Resynced`` for each bootstrap, and change items never more than the work
queue has room for (``max_pending``). When the application falls that far
behind, the controller takes no more events, and the listener's buffer then
fills and, if it must, overflows (abort, back off, re-bootstrap). Any other
event source is read one event at a time, waiting for room the same way.
The sink also answers for the controller's mirror in checkpoints
(``_controller_checkpoint``).

Taking change items only marks their ids stale and queues them; the workers
(``_reconcile``) fetch. A controller that stopped while the listener goes on
(its checkpoints cover the others) is *parked*: it takes bootstraps into its
mirror and marks changed ids pending, without a worker or a callback, so
that a checkpoint taken later is still consistent for it, and a restart
resumes it too. It must never hold the listener up for anything but room in
the work queue, nor for a controller that stopped.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from typing import Any

from changefeed.schemas import ChangeItem

from ._checkpoint import MirrorCheckpoint
from ._controller_checkpoint import Checkpointing
from ._controller_state import T
from ._events import Resynced
from ._listener import Listener
from ._resync import Resyncing

__all__ = ["ControllerSink", "Intake"]


class Intake(Resyncing[T], Checkpointing[T]):
    """The controller's part that takes events in, as far as its work queue has room."""

    async def _follow_listener(self, sink: ControllerSink) -> None:
        """Wait while the listener's dispatch task feeds ``sink``; raise how it stopped."""
        assert isinstance(self.listener, Listener)
        stopped = sink.running()
        self.listener._controller_running(sink)
        await stopped

    async def _consume(self) -> None:
        """Read another event source one event at a time."""
        source = self.listener
        assert not isinstance(source, Listener)
        resource = self.resource
        async for event in source:
            if isinstance(event, Resynced):
                if resource is None or event.resource in ("", resource):
                    self._apply_resync(event)
            elif isinstance(event, ChangeItem):
                if resource is not None and event.change_kind.resource != resource:
                    continue
                while self._room_left() <= 0:
                    await self._wait_room()
                self._take_items((event,))

    def _room_left(self) -> int:
        return self.max_pending - self.queue.pending

    async def _wait_room(self, gone: Callable[[], bool] | None = None) -> None:
        """Return once there is room, the controller ended, or ``gone()`` says so."""
        while self._room_left() <= 0 and not self._ended.is_set():
            if gone is not None and gone():
                return
            self._room.clear()
            await self._room.wait()

    def _take_items(self, items: Sequence[ChangeItem]) -> None:
        self.items += len(items)
        ids = [item.changed_resource_id for item in items]
        self._stale.update(ids)
        if self._replay_until is not None:
            if time.monotonic() < self._replay_until:
                self._forced.update(ids)
            else:
                self._replay_until = None
        self.queue.add_many(ids)


class ControllerSink:
    """The controller's side of ``_sink.Sink``: what the listener's dispatch task
    hands it. A separate object, so that these calls are not part of the
    controller's public face."""

    __slots__ = ("_controller", "_stopped")

    def __init__(self, controller: Intake[Any]) -> None:
        self._controller = controller
        self._stopped: asyncio.Future[None] | None = None

    def running(self) -> asyncio.Future[None]:
        """A future that ends the way the listener stops (``Controller.run`` awaits it)."""
        self._stopped = asyncio.get_running_loop().create_future()
        return self._stopped

    def _gone(self) -> bool:
        return self._stopped is None or self._stopped.done() or self._controller._ended.is_set()

    def room(self) -> int:
        if self._gone():
            return 1 << 30  # a stopped controller never holds the others up
        return self._controller._room_left()

    async def wait_room(self) -> None:
        await self._controller._wait_room(self._gone)

    def resynced(self, event: Resynced) -> None:
        # A controller that stopped while the listener goes on still takes its
        # bootstraps into its mirror (no callbacks: its workers are gone), so that the
        # listener's checkpoints stay consistent for it; see ``changed``.
        if not self._gone() or self._parked():
            self._controller._apply_resync(event)

    def changed(self, items: Sequence[ChangeItem]) -> None:
        if not self._gone():
            self._controller._take_items(items)
        elif self._parked():
            # Only marked pending: a checkpoint then saves these ids as pending, and
            # a restart fetches and calls them back, as if the controller had run on.
            self._controller._stale.update(item.changed_resource_id for item in items)

    def _parked(self) -> bool:
        """It ran and stopped, and its listener still hands it events (for checkpoints)."""
        return self._stopped is not None and self._controller._ended.is_set()

    @property
    def name(self) -> str:
        return self._controller.name

    @property
    def resource(self) -> str:
        return self._controller.resource or ""

    def checkpoint_problem(self) -> str | None:
        controller = self._controller
        if controller._decode is not None and controller._encode is None:
            return f"controller {controller.name} has decode but no encode: give encode"
        return None

    def resumed(self) -> None:
        if not self._gone():
            self._controller._resumed()

    def restore(self, part: MirrorCheckpoint) -> None:
        self._controller._restore(part)

    def track_changes(self) -> None:
        self._controller._track_changes()

    def take_changed(self) -> set[str]:
        return self._controller._take_touched()

    def has_changed(self) -> bool:
        return bool(self._controller._touched)

    def checkpoint_part(self, changed: set[str] | None) -> MirrorCheckpoint:
        return self._controller._checkpoint_part(changed)

    def size(self) -> int:
        return len(self._controller._mirror)

    def stopped(self, error: BaseException | None) -> None:
        stopped = self._stopped
        if stopped is None or stopped.done():
            return
        if error is None:
            stopped.set_result(None)
        else:
            stopped.set_exception(error)
        self._controller._room.set()
