"""The inbox: a connection's frames in, the application's events out, through the buffer.

This is the listener's core between the socket and the application, in four parts:

* **Frames.** ``receive(frame)`` decodes a frame the session read (msgspec
  straight into ``ChangeItem`` objects, checked against the wire schema; the
  JSON Schema validator only for what that pass refuses, for its precise
  message) and puts its items into the buffer. An error frame from the
  publisher, or a frame that breaks the contract, ends the session.
* **The buffer** (RFD 5: "a configurable buffer kind, defaulting to
  in-memory ... The buffer size is configurable"): ``Buffer`` is the interface
  of a kind, ``MemoryBuffer`` the default one. Items are *held* from the moment
  they are decoded until they are handed out: in the buffer, staged for
  ``async for``, or taken by the dispatch and not handed over yet. All count
  against the buffer's capacity: a frame that does not fit is an overflow,
  which ends the session (abort, clear, back off, register again): the socket
  is read as fast as it delivers, never slower because the application is.
* **The cursor**: where the application is in the feed, moved only by what
  is handed out, and read two ways: ``resume`` (what a reconnect resumes
  from) and ``done`` (what the application is done with: what a checkpoint
  saves).
* **The hand-out**, in feed order: a bootstrap's ``Resynced`` events first
  (one per change kind, all with the ack's cursor), then the buffered items.
  ``async for`` takes the whole buffer at a time and hands it out one item at
  a time (``__anext__``); with controllers attached, ``dispatch`` hands each
  its resource's items instead, in runs of one resource, each chunk no larger
  than the controller's work queue has room for, waiting for room otherwise.

The inbox never awaits anything but the buffer (whose in-memory kind never
suspends) and the application's room; it knows nothing of websockets or of
the connection's state: the connection loop tells it when items may flow
(``live``), when a connection's items are void (``clear``) and when the
listener stopped (``stop``). It must never hand out an item of a connection
before that connection's ``Resynced`` events, nor anything a clear dropped,
never block the socket, and never hold more than the buffer's capacity.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol, Self, runtime_checkable

import msgspec
import orjson

from changefeed.logs import log_event
from changefeed.schemas import ChangeItem, ErrorFrame, ProtocolError, decode_change_frame

from ._checks import check_count
from ._errors import BadPublisherFrame, BufferOverflow, ListenerConfigError, PublisherClosed
from ._events import Event, ListenerCounts, Resynced
from ._log import log

__all__ = [
    "BUFFER_KINDS",
    "Buffer",
    "Inbox",
    "MemoryBuffer",
    "Sink",
    "decode_frame",
    "error_frame",
    "make_buffer",
    "publisher_error",
    "register_buffer_kind",
]

# -- frames -------------------------------------------------------------------------

_ITEMS = msgspec.json.Decoder(list[ChangeItem] | ChangeItem)


def decode_frame(raw: str | bytes) -> list[ChangeItem] | ErrorFrame:
    """Change items in a frame (one item or a batch), or the publisher's error frame.

    Frames may be ``bytes`` (the session reads text frames undecoded): msgspec
    checks the UTF-8 of every string it keeps.

    Raises:
        BadPublisherFrame: the frame breaks the wire contract (with the validator's message).
    """
    try:
        decoded = _ITEMS.decode(raw)
    except (msgspec.DecodeError, UnicodeDecodeError):
        return _refused(raw)
    return decoded if isinstance(decoded, list) else [decoded]


def error_frame(raw: str | bytes) -> ErrorFrame | None:
    """The publisher's error frame, if ``raw`` is one.

    Raises:
        BadPublisherFrame: it has an ``error`` member but not the error frame's shape.
    """
    if b'"error"' not in (raw.encode() if isinstance(raw, str) else raw)[:32]:
        return None
    return _as_error_frame(_json_or_none(raw))


def publisher_error(error: ErrorFrame, what: str) -> PublisherClosed:
    """The session's end an error frame means (its code, and ``retryAfter`` when given)."""
    return PublisherClosed(
        f"{what} {error.code}: {error.message}",
        None,
        error.code,
        retry_after=error.retry_after,
        explanation=error.message,
    )


def _refused(raw: str | bytes) -> list[ChangeItem] | ErrorFrame:
    """What the fast pass refused: the error frame, or the validator's verdict."""
    error = _as_error_frame(_json_or_none(raw))
    if error is not None:
        return error
    try:
        # The schema is the authority: should it accept what msgspec refused,
        # its items are taken.
        return decode_change_frame(raw)
    except ProtocolError as exc:
        raise BadPublisherFrame(f"bad change frame ({exc.code}): {exc.message}") from None


def _json_or_none(raw: str | bytes) -> object:
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError:
        return None


def _as_error_frame(doc: object) -> ErrorFrame | None:
    if not (isinstance(doc, dict) and "error" in doc):
        return None
    try:
        return ErrorFrame.from_json(doc)
    except ProtocolError as exc:
        raise BadPublisherFrame(f"malformed error frame: {exc.message}") from None


# -- the buffer -------------------------------------------------------------------------


@runtime_checkable
class Buffer(Protocol):
    """What the listener needs from a buffer kind.

    Another kind (Redis, Memcached) implements this and is registered with
    ``register_buffer_kind``; the listener only ever talks to the interface.
    The methods are coroutines so that such a kind can do I/O. A kind must
    never block, drop part of a frame silently, or grow past its capacity.
    """

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
    """The default kind: a bounded FIFO in this process's memory; it never suspends.

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


# -- the hand-out -------------------------------------------------------------------------


class Sink(Protocol):
    """What the dispatch hands an attached controller (its resource's events)."""

    def room(self) -> int:
        """How many more change items it takes now (0 or less: none until ``wait_room``)."""

    async def wait_room(self) -> None:
        """Return once it takes items again (or has stopped)."""

    def resynced(self, event: Resynced) -> None:
        """A bootstrap of its resource."""

    def changed(self, items: Sequence[ChangeItem]) -> None:
        """Change items of its resource, in feed order (never more than ``room()``)."""


_LOW_WATER = 0.5
"""The high-water warning re-arms once what is held drains below this fraction."""


class Inbox:
    """The frames of the current connection in, the events out to the application.

    The cursor is that of the last event handed out *whole*: a change item, or
    the last ``Resynced`` of a bootstrap (the others are not consistent with
    its cursor on their own). ``resume`` is that cursor, or None after a
    failure that calls for a fresh bootstrap (``forget``), until the next one
    is handed out. ``done`` is what the application is done with: for ``async
    for``, the cursor as of the moment it asked for the next event; for
    controllers, the same as ``resume`` (their mirrors take each chunk in the
    step that hands it over). ``async for`` hands a batch out by moving an
    index over it, and both readings are worked out from that index when read.

    Args:
        buffer: where items wait.
        cursor: the cursor to start from (a saved one).
        resources: the registered resources, in registration order.
        multi: several change kinds (v2): the dispatch cuts runs by resource.
        high_water: the fill (fraction of the capacity) logged as ``listener.buffer.high``.
        fields: the listener's fields for log events.
        counts: the listener's counts, whose frame, item and overflow counts the
            inbox keeps.
    """

    def __init__(
        self,
        buffer: Buffer,
        cursor: str | None = None,
        *,
        resources: tuple[str, ...],
        multi: bool,
        high_water: float,
        fields: Callable[[], dict[str, Any]],
        counts: ListenerCounts,
    ) -> None:
        self.buffer = buffer
        self._handed = cursor
        """The cursor of the last event handed out whole, before the staged batch."""
        self._done = cursor
        """What the application was done with, before the staged batch."""
        self._fresh = False
        """Resume from nothing: a failure called for a fresh bootstrap."""
        self._resources = resources
        self._registered = frozenset(resources)
        self._multi = multi
        self._high_water = high_water
        self._fields = fields
        self._resyncs: deque[Resynced] = deque()
        self._staged: list[ChangeItem] = []
        """The batch ``async for`` hands out, one item at a time ..."""
        self._next = 0
        """... and the index of its next item: those before it are handed out."""
        self._in_hand = 0
        """Items the dispatch took from the buffer and has not handed over yet."""
        self._live = False
        self._stopped = False
        self._error: BaseException | None = None
        self._generation = 0
        """Bumped by ``clear``: a hand-out that was waiting meanwhile drops what it took."""
        self._ready = asyncio.Event()
        self._halted = asyncio.Event()
        """Set when the listener stops for good: a hand-out waiting for room gives up."""
        self._high = False
        self.peak = 0
        """The most items held at once."""
        self.counts = counts
        """The listener's counts: the inbox keeps frames, items and overflows."""
        self._staged_total = 0
        self._dispatched = 0

    # -- in ---------------------------------------------------------------------------

    def held(self) -> int:
        """Items decoded and not handed out: buffered, staged, or in the dispatch's hand."""
        return len(self.buffer) + len(self._staged) - self._next + self._in_hand

    @property
    def items_delivered(self) -> int:
        """Change items handed to the application (``async for`` or controllers)."""
        return self._staged_total - (len(self._staged) - self._next) + self._dispatched

    # -- the cursor ---------------------------------------------------------------------

    @property
    def resume(self) -> str | None:
        """The cursor a reconnect resumes from (None: bootstrap)."""
        return None if self._fresh and not self._next else self._handed_now()

    @property
    def done(self) -> str | None:
        """The cursor of what the application is done with (what a checkpoint saves)."""
        k = self._next
        if k >= 2:
            return self._staged[k - 2].cursor
        return self._handed if k == 1 else self._done

    def _handed_now(self) -> str | None:
        k = self._next
        return self._staged[k - 1].cursor if k else self._handed

    def done_with_last(self) -> None:
        """The application is done with the last event handed out, as if it had asked
        for the next one."""
        self._fold()
        if not self._resyncs:
            self._done = self._handed

    def forget(self) -> None:
        """The next registration must bootstrap: resume from nothing."""
        self._fold()
        self._fresh = True

    def restore(self, cursor: str | None) -> None:
        """Start from ``cursor`` (a checkpoint's)."""
        self._fold()
        self._handed = self._done = cursor
        self._fresh = False

    def _fold(self) -> None:
        """Take what was handed out of the staged batch into the cursor."""
        k = self._next
        if k:
            self._done, self._handed = self.done, self._handed_now()
            self._fresh = False
            del self._staged[:k]
            self._next = 0

    async def receive(self, frame: str | bytes) -> None:
        """One frame of the connection: its items into the buffer.

        Raises:
            PublisherClosed: it is the publisher's error frame.
            BadPublisherFrame: it breaks the wire contract, or holds an item of a
                resource this connection did not register (a controller would
                fetch its id from another resource's route).
            BufferOverflow: its items do not fit.
        """
        self.counts.frames_received += 1
        items = decode_frame(frame)
        if isinstance(items, ErrorFrame):
            raise publisher_error(items, "publisher error")
        registered = self._registered
        for item in items:
            if item.change_kind.resource not in registered:
                raise BadPublisherFrame(
                    f"an item of resource {item.change_kind.resource!r}, "
                    "which this connection did not register"
                )
        self.counts.items_received += len(items)
        buffer = self.buffer
        held = self.held()
        if held + len(items) > buffer.capacity or not await buffer.put(items):
            self.counts.overflows += 1
            log_event(
                log,
                "listener.overflow",
                logging.WARNING,
                **self._fields(),
                incoming=len(items),
                overflows=self.counts.overflows,
            )
            raise BufferOverflow(buffer.capacity, held, len(items))
        self._check_water()
        self._ready.set()

    def _check_water(self) -> None:
        held = self.held()
        self.peak = max(self.peak, held)
        capacity = self.buffer.capacity
        if not self._high and held >= capacity * self._high_water:
            self._high = True
            log_event(log, "listener.buffer.high", logging.WARNING, **self._fields())
        elif self._high and held < capacity * _LOW_WATER:
            self._high = False
            log_event(log, "listener.buffer.normal", **self._fields())

    def bootstrapped(self, resyncs: Sequence[Resynced]) -> None:
        """A bootstrap's ``Resynced`` events: they go out before any buffered item."""
        self._resyncs.extend(resyncs)

    def live(self) -> None:
        """The connection resumed or bootstrapped: items flow to the application."""
        self._live = True
        self._ready.set()

    async def clear(self) -> int:
        """The connection ended: drop what it left (a reconnect resumes from the cursor,
        so the publisher sends it again). Returns how many items were dropped."""
        dropped = self.held()
        self._fold()
        self._live = False
        self._generation += 1
        self._in_hand = 0  # a hand-out waiting for room drops them (the generation moved)
        self._staged_total -= len(self._staged)
        self._staged = []
        self._resyncs.clear()
        self._high = False
        await self.buffer.clear()
        return dropped

    def stop(self, error: BaseException | None) -> None:
        """The listener stopped: closed (None), or for good with ``error``. The
        hand-out ends once what it has in hand went out (``Resynced`` events first)."""
        self._stopped = True
        if error is not None and self._error is None:  # the first error is what stopped it
            self._error = error
        if self._error is not None:
            self._halted.set()
        self._ready.set()

    # -- out --------------------------------------------------------------------------

    async def _next_unit(self) -> Resynced | list[ChangeItem]:
        """Wait for what goes out next: a ``Resynced``, or every item the buffer holds.

        Raises:
            StopAsyncIteration: the listener was closed.
            ListenerError: it stopped for good (``RegistrationRefused``, ...).
        """
        while True:
            if self._resyncs:
                return self._resyncs.popleft()
            if self._error is not None:
                raise self._error
            if self._stopped:
                raise StopAsyncIteration
            buffer = self.buffer
            if self._live and len(buffer):
                generation = self._generation
                taken = await buffer.take(buffer.capacity)
                if generation == self._generation and taken:  # not cleared meanwhile
                    return taken
                continue
            self._ready.clear()
            await self._ready.wait()

    def __aiter__(self) -> Self:
        return self

    async def __anext__(self) -> Event:
        """The next event for ``async for``: ``Resynced`` or ``ChangeItem``.

        Raises:
            StopAsyncIteration: the listener was closed.
            ListenerError: it stopped for good.
        """
        i = self._next
        staged = self._staged
        if i < len(staged):  # the per-item path: the next item of a batch taken already
            self._next = i + 1
            return staged[i]
        return await self._next_event()

    async def _next_event(self) -> Event:
        self._fold()
        # Asking for the next event means the application is done with the last one
        # (with a bootstrap's last ``Resynced``: the others do not count on their own).
        if not self._resyncs:
            self._done = self._handed
        unit = await self._next_unit()
        if isinstance(unit, Resynced):
            if not self._resyncs:  # a reconnect before the last one must bootstrap again
                self._handed = unit.cursor
                self._fresh = False
            return unit
        self._staged_total += len(unit)
        self._staged = unit
        self._next = 1
        return unit[0]

    async def dispatch(self, sinks: Mapping[str, Sequence[Sink]]) -> None:
        """Hand each attached controller its resource's events until the listener stops
        (``sinks``: by resource, kept current by the listener).

        Raises:
            ListenerError: the listener stopped for good.
        """
        try:
            while True:
                unit = await self._next_unit()
                if isinstance(unit, Resynced):
                    for sink in sinks.get(unit.resource, ()):
                        sink.resynced(unit)
                    if not self._resyncs:  # every resource of the bootstrap is in
                        self._handed = self._done = unit.cursor
                        self._fresh = False
                    continue
                self._in_hand = len(unit)
                try:
                    await self._hand_over(unit, sinks)
                finally:
                    self._in_hand = 0
        except StopAsyncIteration:
            return

    async def _hand_over(
        self, items: list[ChangeItem], sinks: Mapping[str, Sequence[Sink]]
    ) -> None:
        """Hand ``items`` to their controllers in feed order, each chunk no larger than
        its controllers have room for; the cursor follows each chunk handed over (their
        mirrors take it in the same step, so they are done with it too)."""
        generation = self._generation
        runs = _runs(items) if self._multi else [(self._resources[0], items)]
        for resource, run in runs:
            start, end = 0, len(run)
            while start < end:
                consumers = sinks.get(resource, ())
                room = min((sink.room() for sink in consumers), default=end)
                if room <= 0:
                    full = next(sink for sink in consumers if sink.room() <= 0)
                    await self._room_or_halt(full)
                    if generation != self._generation or self._halted.is_set():
                        # The connection ended meanwhile (its items were dropped), or
                        # the listener stopped for good (the dispatch raises why).
                        return
                    continue
                chunk = run if start == 0 and room >= end else run[start : start + room]
                for sink in consumers:
                    sink.changed(chunk)
                start += len(chunk)
                self._in_hand -= len(chunk)
                self._dispatched += len(chunk)
                self._handed = self._done = chunk[-1].cursor
                self._fresh = False

    async def _room_or_halt(self, sink: Sink) -> None:
        """Wait until ``sink`` has room, or the listener stops for good: a controller
        whose queue stays full (its callbacks keep failing) must still learn why."""
        if self._halted.is_set():
            return
        room = asyncio.ensure_future(sink.wait_room())
        halted = asyncio.ensure_future(self._halted.wait())
        try:
            await asyncio.wait((room, halted), return_when=asyncio.FIRST_COMPLETED)
        finally:
            room.cancel()
            halted.cancel()


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
