"""The controller's mirror store: resource id -> the resource as the publisher last served it.

Like client-go's Store: ``replace`` swaps in a fresh bootstrap in one step
(no reader ever sees half of an old and half of a new list) and reports what
changed; ``put`` and ``delete`` apply the result of one fetch. Readers get a
read-only live view (``view``).

Pure code: a dict and its bookkeeping. It must never be written by anyone
but the controller, and never hands out a mutable reference to its dict.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Generic, TypeVar

__all__ = ["Change", "Mirror"]

V = TypeVar("V")


@dataclass(frozen=True, slots=True)
class Change(Generic[V]):
    """One id whose mirrored state changed: ``old``/``new`` are None when absent."""

    id: str
    old: V | None
    new: V | None


class Mirror(Mapping[str, V]):
    """id -> resource; a read-only Mapping to everyone, written by its controller."""

    def __init__(self) -> None:
        self._items: dict[str, V] = {}
        self._view = MappingProxyType(self._items)
        self.replaces = 0
        """How many times a bootstrap replaced the whole store."""
        self.writes = 0
        """Single-id writes (put and delete) that changed something."""

    # -- Mapping ------------------------------------------------------------

    def __getitem__(self, key: str) -> V:
        return self._items[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._items)

    def __len__(self) -> int:
        return len(self._items)

    def __contains__(self, key: object) -> bool:
        return key in self._items

    def get(self, key: str, default: Any = None) -> Any:
        """The resource under ``key``, or ``default`` (the dict's own ``get``: no
        KeyError raised and caught for a missing id, as ``Mapping.get`` would)."""
        return self._items.get(key, default)

    def view(self) -> Mapping[str, V]:
        """A read-only live view of the store."""
        return self._view

    # -- writes -------------------------------------------------------------

    def replace(self, items: Mapping[str, V]) -> list[Change[V]]:
        """Swap in ``items`` as the whole store; return every id that was added, changed or
        removed (in that order: fresh ids first, in ``items`` order, then removed ids)."""
        old = self._items
        changes = [
            Change(key, old.get(key), value)
            for key, value in items.items()
            if key not in old or old[key] != value
        ]
        changes.extend(Change(key, value, None) for key, value in old.items() if key not in items)
        # Swap contents in place: the view keeps pointing at the live dict.
        fresh = dict(items)
        old.clear()
        old.update(fresh)
        self.replaces += 1
        return changes

    def restore(self, items: Mapping[str, V]) -> None:
        """Make ``items`` the whole store, as loaded from a checkpoint: no changes are
        reported (the application saw them before it stopped)."""
        self._items.clear()
        self._items.update(items)

    def copy(self) -> dict[str, V]:
        """A shallow copy of the store (a checkpoint's snapshot)."""
        return dict(self._items)

    def put(self, key: str, value: V) -> V | None:
        """Store ``value`` under ``key``; return the previous value (None if absent)."""
        previous = self._items.get(key)
        if previous is None or previous != value:
            self.writes += 1
        self._items[key] = value
        return previous

    def delete(self, key: str) -> V | None:
        """Remove ``key``; return the removed value (None if absent)."""
        previous = self._items.pop(key, None)
        if previous is not None:
            self.writes += 1
        return previous
