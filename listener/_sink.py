"""What a listener hands its attached controllers, and reads from them for checkpoints.

``Sink`` is the one interface between a shared ``Listener`` and the
controllers attached to it: the listener's dispatch task (``_handout``)
hands each its resource's events, and its checkpointer reads and loads their
mirrors (``_checkpointer.MirrorSource`` is the part of it a checkpoint uses).
The controller's side is ``_controller_sink.ControllerSink``.

Pure typing: no code runs here.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from changefeed.schemas import ChangeItem

from ._checkpoint import MirrorCheckpoint
from ._events import Resynced

__all__ = ["Sink"]


class Sink(Protocol):
    """What a controller attached to a listener receives (``Listener._attach``), and
    what a checkpoint reads from it (``_checkpointer.MirrorSource``)."""

    @property
    def name(self) -> str:
        """The controller's name (its mirror's key in a checkpoint)."""

    @property
    def resource(self) -> str:
        """The resource it mirrors."""

    def room(self) -> int:
        """How many more change items it takes now (0 or less: none until ``wait_room``)."""

    async def wait_room(self) -> None:
        """Return once it takes items again (or has stopped)."""

    def resynced(self, event: Resynced) -> None:
        """A bootstrap of its resource."""

    def changed(self, items: Sequence[ChangeItem]) -> None:
        """Change items of its resource, in feed order (never more than ``room()``)."""

    def stopped(self, error: BaseException | None) -> None:
        """The listener stopped: closed (None), or for good with ``error``."""

    def resumed(self) -> None:
        """A connection resumed the cursor (no bootstrap)."""

    def checkpoint_problem(self) -> str | None:
        """Why its mirror cannot be checkpointed (None: it can)."""

    def restore(self, part: MirrorCheckpoint) -> None:
        """Start from a checkpoint's mirror."""

    def track_changes(self) -> None:
        """Count the ids a checkpoint saves again, from now on."""

    def take_changed(self) -> set[str]:
        """Ids changed since the last call."""

    def has_changed(self) -> bool:
        """Whether any id changed since ``take_changed``."""

    def checkpoint_part(self, changed: set[str] | None) -> MirrorCheckpoint:
        """Its part of a checkpoint taken now."""

    def size(self) -> int:
        """Resources in its mirror."""
