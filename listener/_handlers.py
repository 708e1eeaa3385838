"""The signatures an application writes for a controller: callbacks, decoder, fetcher, source.

Each callback may be a coroutine function or a plain function; the
parameters are positional (any names will do). ``T`` is the type the
application keeps its resources as: ``dict[str, Any]`` (the JSON as served)
unless the controller is given a ``decode`` function::

    @dataclass(frozen=True)
    class VM:
        uuid: str
        alias: str

        @classmethod
        def from_json(cls, doc: Any) -> VM:
            return cls(doc["uuid"], doc["alias"])

    async def renamed(vm_uuid: str, old: VM, new: VM) -> None: ...

    Controller[VM](listener, decode=VM.from_json, on_update=renamed)

Pure typing: no code runs here.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Mapping, Sequence
from typing import Any, Protocol, TypeVar

from ._events import Event

__all__ = [
    "AddHandler",
    "DeleteHandler",
    "EventSource",
    "Fetcher",
    "ReconcileHandler",
    "UpdateHandler",
]

T_contra = TypeVar("T_contra", contravariant=True)


class ReconcileHandler(Protocol[T_contra]):
    """``reconcile(id, old, new)``: the one callback for every change. ``old`` is
    what the application last saw, ``new`` the current state; None: absent
    (added: ``old`` is None; deleted: ``new`` is None). Raise to be retried."""

    def __call__(
        self, id: str, old: T_contra | None, new: T_contra | None, /
    ) -> Awaitable[None] | None: ...


class AddHandler(Protocol[T_contra]):
    """``on_add(id, new)``: a resource appeared."""

    def __call__(self, id: str, new: T_contra, /) -> Awaitable[None] | None: ...


class UpdateHandler(Protocol[T_contra]):
    """``on_update(id, old, new)``: a resource changed. A periodic resync calls it
    with ``old == new`` for every resource in the mirror."""

    def __call__(self, id: str, old: T_contra, new: T_contra, /) -> Awaitable[None] | None: ...


class DeleteHandler(Protocol[T_contra]):
    """``on_delete(id, old)``: a resource disappeared; ``old`` is what was last seen."""

    def __call__(self, id: str, old: T_contra, /) -> Awaitable[None] | None: ...


class Fetcher(Protocol):
    """Fetches resources by id: returns the ones that exist, as JSON (absent ids are
    deleted). The default fetches from the listener's bootstrap route. Raising a
    ``BootstrapError`` with ``status`` 401 or 403 stops the controller (the token
    may no longer read); anything else is retried per id."""

    def __call__(self, ids: Sequence[str], /) -> Awaitable[Mapping[str, Any]]: ...


class EventSource(Protocol):
    """What else a controller can read events from: anything async-iterable like a
    Listener (a Listener itself is attached to, not iterated)."""

    def __aiter__(self) -> AsyncIterator[Event]: ...
