"""The controller's mirror store: resource id -> the resource as the publisher last served it.

Like client-go's Store: ``replace`` swaps in a fresh bootstrap in one step
(no reader ever sees half of an old and half of a new list) and reports what
changed; ``put`` and ``delete`` apply the result of one fetch. Readers get a
read-only live view (``view``): one object for the mirror's whole life, so a
view taken before a checkpoint is loaded shows what was loaded.

A mirror loaded from a checkpoint may hold its resources still encoded
(``restore_encoded``: id -> JSON bytes): each is decoded the first time it is
read, so that a restart does not build a million objects before it can go
live. Every way in (``[]``, ``get``, iteration, the view) decodes on the way.

Pure code: a dict and its bookkeeping. It must never be written by anyone
but the controller, and never hands out a mutable reference to its dicts.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

__all__ = ["Change", "Mirror"]

V = TypeVar("V")

_MISSING: Any = object()


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
        self._encoded: dict[str, bytes] = {}  # loaded from a checkpoint, not read yet
        self._load: Callable[[bytes], V] | None = None
        self._view = _View(self)
        self.replaces = 0
        """How many times a bootstrap replaced the whole store."""
        self.writes = 0
        """Single-id writes (put and delete) that changed something."""

    # -- Mapping ------------------------------------------------------------

    def __getitem__(self, key: str) -> V:
        value = self._items.get(key, _MISSING)
        if value is _MISSING:
            value = self._decode(key)
            if value is _MISSING:
                raise KeyError(key)
        result: V = value
        return result

    def __iter__(self) -> Iterator[str]:
        if not self._encoded:
            return iter(self._items)
        # Reading a value while iterating decodes it (moves it between the dicts).
        return iter([*self._items, *self._encoded])

    def __len__(self) -> int:
        return len(self._items) + len(self._encoded)

    def __contains__(self, key: object) -> bool:
        return key in self._items or key in self._encoded

    def get(self, key: str, default: Any = None) -> Any:
        """The resource under ``key``, or ``default`` (the dict's own ``get``: no
        KeyError raised and caught for a missing id, as ``Mapping.get`` would)."""
        value = self._items.get(key, _MISSING)
        if value is _MISSING:
            if not self._encoded:
                return default
            value = self._decode(key)
            if value is _MISSING:
                return default
        return value

    def holds_any(self, keys: Iterable[str]) -> bool:
        """Whether any of ``keys`` is in the store (set work in C: a batch of ids
        that were absent and still are costs no step per id)."""
        return not (self._items.keys().isdisjoint(keys) and self._encoded.keys().isdisjoint(keys))

    def view(self) -> Mapping[str, V]:
        """A read-only live view of the store (the same object every time)."""
        return self._view

    @property
    def encoded(self) -> int:
        """Resources loaded from a checkpoint and not decoded yet."""
        return len(self._encoded)

    def _decode(self, key: str) -> Any:
        raw = self._encoded.pop(key, None)
        if raw is None:
            return _MISSING
        assert self._load is not None
        value = self._items[key] = self._load(raw)
        return value

    def decode_all(self) -> None:
        """Decode every resource still encoded."""
        if self._encoded:
            assert self._load is not None
            load, items = self._load, self._items
            for key, raw in self._encoded.items():
                items[key] = load(raw)
            self._encoded.clear()

    # -- writes -------------------------------------------------------------

    def replace(self, items: Mapping[str, V]) -> list[Change[V]]:
        """Swap in ``items`` as the whole store; return every id that was added, changed or
        removed (in that order: fresh ids first, in ``items`` order, then removed ids)."""
        self.decode_all()
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
        self._encoded.clear()
        self._items.clear()
        self._items.update(items)

    def restore_encoded(self, encoded: dict[str, bytes], load: Callable[[bytes], V]) -> None:
        """Like ``restore``, with every resource still encoded: ``load`` decodes one when
        it is first read. The mirror takes ``encoded`` over (it is not copied)."""
        self._items.clear()
        self._encoded = encoded
        self._load = load

    def copy_parts(self) -> tuple[dict[str, V], dict[str, bytes]]:
        """Shallow copies of the store (a checkpoint's snapshot): the decoded resources,
        and those still encoded."""
        return dict(self._items), dict(self._encoded)

    def put(self, key: str, value: V) -> V | None:
        """Store ``value`` under ``key``; return the previous value (None if absent)."""
        previous: V | None = self.get(key)
        if previous is None or previous != value:
            self.writes += 1
        self._items[key] = value
        return previous

    def delete(self, key: str) -> V | None:
        """Remove ``key``; return the removed value (None if absent)."""
        if key in self._encoded:
            self._decode(key)
        previous = self._items.pop(key, None)
        if previous is not None:
            self.writes += 1
        return previous


class _View(Mapping[str, V]):
    """The read-only view of a mirror. Not a ``MappingProxyType`` of its dict: reads
    go through the mirror, which decodes what a checkpoint left encoded."""

    __slots__ = ("_mirror",)

    def __init__(self, mirror: Mirror[V]) -> None:
        self._mirror = mirror

    def __getitem__(self, key: str) -> V:
        return self._mirror[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._mirror)

    def __len__(self) -> int:
        return len(self._mirror)

    def __contains__(self, key: object) -> bool:
        return key in self._mirror

    def get(self, key: str, default: Any = None) -> Any:
        return self._mirror.get(key, default)
