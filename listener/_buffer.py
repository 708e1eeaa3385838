"""The listener's buffer of change items: a small interface, and the in-memory kind.

RFD 5: "The listener module has a configurable buffer kind, defaulting to
in-memory ... The buffer size is configurable". Items wait here while the
listener bootstraps and whenever the application falls behind. The buffer
never grows past its capacity and never blocks the socket: ``put`` either
takes a whole frame's items or refuses them, and the listener turns a refusal
into an abort, a cleared buffer and a re-registration with back-off (RFD 5
"Back pressure").

Another kind (Redis, Memcached) implements ``Buffer`` and is registered with
``register_buffer_kind``; the listener only ever talks to the interface. The
methods are coroutines so that such a kind can do I/O; the in-memory kind
never awaits anything.

What this module must never do: block, drop part of a frame silently, or grow
without bound.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from typing import Protocol, runtime_checkable

from changefeed.schemas import ChangeItem

from ._checks import check_count
from ._errors import ListenerConfigError

__all__ = [
    "BUFFER_KINDS",
    "Buffer",
    "MemoryBuffer",
    "make_buffer",
    "register_buffer_kind",
]


@runtime_checkable
class Buffer(Protocol):
    """What the listener needs from a buffer kind."""

    @property
    def capacity(self) -> int:
        """The most items it holds."""
        ...

    def __len__(self) -> int:
        """Items held now (kept locally by remote kinds: it is read on every frame)."""
        ...

    async def put(self, items: Sequence[ChangeItem]) -> bool:
        """Append all of ``items``, in order, or none of them; False when they do not fit."""
        ...

    async def take(self, most: int) -> list[ChangeItem]:
        """Remove and return up to ``most`` of the oldest items (possibly none)."""
        ...

    async def clear(self) -> None:
        """Drop everything held."""
        ...


class MemoryBuffer:
    """The default kind: a bounded FIFO in this process's memory.

    Args:
        capacity: the most items it holds (at least 1).

    Raises:
        ListenerConfigError: a capacity that is not a whole number of at least 1.
    """

    def __init__(self, capacity: int) -> None:
        check_count("buffer_size", capacity)
        self._capacity = capacity
        self._items: deque[ChangeItem] = deque()
        self.peak = 0
        """The most items held at once since creation."""

    @property
    def capacity(self) -> int:
        return self._capacity

    def __len__(self) -> int:
        return len(self._items)

    async def put(self, items: Sequence[ChangeItem]) -> bool:
        if len(self._items) + len(items) > self._capacity:
            return False
        self._items.extend(items)
        self.peak = max(self.peak, len(self._items))
        return True

    async def take(self, most: int) -> list[ChangeItem]:
        held = self._items
        if most >= len(held):
            taken = list(held)
            held.clear()
            return taken
        return [held.popleft() for _ in range(most)]

    async def clear(self) -> None:
        self._items.clear()


BufferFactory = Callable[[int], Buffer]

BUFFER_KINDS: dict[str, BufferFactory] = {"memory": MemoryBuffer}
"""Buffer kinds by name; ``ListenerConfig.buffer_kind`` picks one."""


def register_buffer_kind(name: str, factory: BufferFactory) -> None:
    """Make ``factory(capacity)`` available as ``buffer_kind=name``."""
    BUFFER_KINDS[name] = factory


def make_buffer(kind: str, capacity: int) -> Buffer:
    """A new buffer of ``kind`` holding at most ``capacity`` items.

    Raises:
        ListenerConfigError: unknown kind, or a capacity the kind refuses.
    """
    factory = BUFFER_KINDS.get(kind)
    if factory is None:
        raise ListenerConfigError(
            "buffer_kind", f"unknown kind {kind!r} (known: {', '.join(sorted(BUFFER_KINDS))})"
        )
    return factory(capacity)
