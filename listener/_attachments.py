"""The controllers attached to one listener, and the two interfaces between them.

Several controllers share one Listener (one connection per publisher per
process, as client-go's shared informers): each attaches to one resource
before the listener starts; the listener starts once every attached
controller runs, and closes when the last one stops. One that stops while
others run on is *parked* when there are checkpoints: it stays attached and
takes its resource's events into its mirror, so that later checkpoints stay
consistent for it.

* ``Attached`` is what the listener needs of an attached controller: its
  ``Sink``, which the dispatch hands its resource's events (the controller's
  core itself), the checkpoint's ``MirrorSource``, and being told the
  listener resumed or stopped.
* ``ControllerLink`` is what a controller may ask of its listener, handed to
  it by ``Listener._attach``: its one way in.
* ``Attachments`` keeps who is attached, who runs and who is parked, and
  decides what the listener does when one starts or stops. Pure code: the
  listener acts on its answers.
"""

from __future__ import annotations

import enum
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Protocol

import httpx

from ._checkpoint import CheckpointStore
from ._checkpointer import MirrorSource
from ._inbox import Sink

__all__ = ["Attached", "Attachments", "ControllerLink", "Stopped"]


class Attached(MirrorSource, Protocol):
    """An attached controller, as its listener sees it."""

    @property
    def sink(self) -> Sink:
        """What the dispatch hands its resource's events."""

    def stopped(self, error: BaseException | None) -> None:
        """The listener stopped: closed (None), or for good with ``error``."""

    def resumed(self, replay: float) -> None:
        """A connection resumed the cursor (no bootstrap); ``replay``: seconds during
        which a mirror loaded from a checkpoint calls back the items replayed even
        when unchanged (``ListenerConfig.checkpoint_replay``)."""

    def checkpoint_problem(self) -> str | None:
        """Why its mirror cannot be checkpointed (None: it can)."""


@dataclass(frozen=True, slots=True)
class ControllerLink:
    """What an attached controller may ask of its listener (``Listener._attach``)."""

    running: Callable[[], None]
    """It runs: the listener starts once every attached controller does."""
    stopping: Callable[[], None]
    """It is about to stop taking events (the last one out takes the last checkpoint)."""
    done: Callable[[], Awaitable[None]]
    """It stopped, or was closed without running: it is parked or let go."""
    detach: Callable[[], None]
    """Its constructor failed after attaching: undo it."""
    use_checkpoint: Callable[[CheckpointStore], None]
    """Keep checkpoints in this store (``Controller(checkpoint=)``)."""
    registered: Callable[[], Awaitable[None]]
    """Return once the first ack named the routes."""
    routes: Callable[[], Mapping[str, str]]
    """Each resource's bootstrap route, as the latest ack named it."""
    http: Callable[[], httpx.AsyncClient]
    """The listener's HTTP client (once started)."""


class Stopped(enum.Enum):
    """What the listener does when an attached controller stopped (``Attachments.done``)."""

    NOTHING = "nothing"
    """It was let go; nothing else changes."""
    PARKED = "parked"
    """Others run on and checkpoints are kept: it stays attached, parked."""
    CLOSE = "close"
    """It was the last one running: the listener closes."""
    START_OTHERS = "start_others"
    """It never ran, and the others waited for it: they may start now."""


class Attachments:
    """Who is attached to one listener, for which resource, and who runs."""

    def __init__(self) -> None:
        self.by_resource: dict[str, list[Attached]] = {}
        """The controllers attached to each resource, in the order they attached."""
        self.consumers: dict[str, list[Sink]] = {}
        """Their sinks, by resource: what the dispatch reads (kept in step)."""
        self.running: set[Attached] = set()
        self.parked: set[Attached] = set()

    def __bool__(self) -> bool:
        return bool(self.by_resource)

    def all(self) -> list[Attached]:
        """Every attached controller (parked ones too), in the order they attached."""
        return [sink for sinks in self.by_resource.values() for sink in sinks]

    def attach(self, resource: str, sink: Attached) -> None:
        self.by_resource[resource] = [*self.by_resource.get(resource, ()), sink]
        self._sync()

    def _sync(self) -> None:
        # In place: the dispatch holds the dict.
        for resource, attached in self.by_resource.items():
            self.consumers[resource] = [a.sink for a in attached]
        for resource in self.consumers.keys() - self.by_resource.keys():
            del self.consumers[resource]

    def detach(self, sink: Attached) -> None:
        for resource, sinks in list(self.by_resource.items()):
            if sink in sinks:
                rest = [s for s in sinks if s is not sink]
                if rest:
                    self.by_resource[resource] = rest
                else:
                    del self.by_resource[resource]
        self._sync()

    def waited_for(self) -> list[Attached]:
        """Attached controllers the listener waits for: not running, not parked."""
        return [s for s in self.all() if s not in self.running and s not in self.parked]

    def start(self, sink: Attached) -> bool:
        """``sink`` runs; whether every attached controller now does."""
        self.running.add(sink)
        return not self.waited_for()

    def stop(self, sink: Attached, *, started: bool, checkpoints: bool) -> Stopped:
        """``sink`` stopped (or was closed without running).

        Args:
            started: the listener has started.
            checkpoints: the listener keeps checkpoints.
        """
        if sink in self.parked:
            return Stopped.NOTHING
        was_running = sink in self.running
        self.running.discard(sink)
        if was_running and self.running and started and checkpoints:
            self.parked.add(sink)
            return Stopped.PARKED
        for resource, sinks in self.by_resource.items():
            self.by_resource[resource] = [s for s in sinks if s is not sink]
        self._sync()
        if was_running:
            return Stopped.CLOSE if not self.running and started else Stopped.NOTHING
        if self.running and not started:
            return Stopped.START_OTHERS  # it may have been the one the others waited for
        return Stopped.NOTHING
