"""A run of feed entries in feed order, each encoded at most once. Pure code.

The fan-out, the window of recent entries and the catch-up pages read from
the feed table all hold entries as ``Chunk``s. A chunk *covers* an interval of
the feed, ``(after, through]``: it holds every entry of that interval that its
reader asked for (the tailer asks for all of them; a catch-up page for some
resources). A listener whose position lies in that interval can read on from
the chunk, and when it reaches ``through`` it has missed nothing.

An entry's change item (``Item``) is encoded the first time anybody wants it,
and its websocket frame serialised the first time a direct write wants it;
both are then shared by every listener that gets the entry, whatever path it
takes (live, catch-up, resume). Send queues hold references to items, never
copies.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Callable, Sequence
from typing import NamedTuple

from changefeed.schemas import Position

from .feed import FeedEntry
from .matching import Interest
from .wire import text_frame

__all__ = ["Chunk", "Encoder", "Item", "Selection", "entry_bytes"]

Encoder = Callable[[FeedEntry], str]
"""The change item of an entry, as JSON text."""

_SELECTIONS_KEPT = 8
"""Interests whose selection a chunk remembers (see Chunk.selection)."""

_ENTRY_OVERHEAD = 950
"""Bytes an entry costs beyond its id, estimated: the row's objects, its item,
its serialised frame and its places in cached selections (a 36-character id
gives items of about 200 bytes; tracemalloc measured about 1,060 bytes per
such entry in a full window). Used to bound the window and the page cache by
memory."""


class Item:
    """One entry's change item: its JSON text, and its frame once a direct write wants it."""

    __slots__ = ("_wire", "published", "text")

    def __init__(self, text: str, published: float) -> None:
        self.text = text
        self.published = published
        """When the entry was published (POSIX seconds): a queue's lag in seconds."""
        self._wire: bytes | None = None

    @property
    def wire(self) -> bytes:
        """The server's websocket text frame carrying this one item."""
        wire = self._wire
        if wire is None:
            wire = self._wire = text_frame(self.text)
        return wire


class Selection(NamedTuple):
    """The entries of a chunk one interest wants: their indexes, positions and items."""

    indexes: list[int]
    positions: list[Position]
    items: list[Item]


def entry_bytes(entry: FeedEntry) -> int:
    """About how much memory one entry holds once encoded and framed."""
    return _ENTRY_OVERHEAD + 3 * len(entry.changed_resource_id) + 8 * len(entry.sub_resources)


class Chunk:
    """Entries covering ``(after, through]`` of the feed, in feed order.

    Args:
        entries: the entries, in feed order, all after ``after``.
        after: the position the chunk starts after (exclusive).
        through: the last position it covers; at least the last entry's.
        encode: the change item of an entry.
    """

    __slots__ = (
        "_encode",
        "_items",
        "_selections",
        "after",
        "entries",
        "nbytes",
        "oldest",
        "positions",
        "through",
    )

    def __init__(
        self,
        entries: Sequence[FeedEntry],
        after: Position,
        through: Position,
        encode: Encoder,
    ) -> None:
        self.entries: list[FeedEntry] = list(entries)
        self.positions = [entry.position for entry in self.entries]
        self.after = after
        self.through = through
        self._encode = encode
        self._items: list[Item | None] = [None] * len(self.entries)
        self._selections: dict[Interest, Selection] = {}
        self.nbytes = sum(map(entry_bytes, self.entries))
        self.oldest = min((e.published.timestamp() for e in self.entries), default=float("inf"))
        """When its oldest entry was published (POSIX time). Not always the first:
        an entry is stamped when its statement ran, and a long transaction commits
        it late."""

    def __len__(self) -> int:
        return len(self.entries)

    def extend(self, entries: Sequence[FeedEntry], through: Position) -> None:
        """Append the entries that follow (the tailer's next read)."""
        self.entries.extend(entries)
        self.positions.extend(entry.position for entry in entries)
        self._items.extend([None] * len(entries))
        self._selections.clear()
        self.nbytes += sum(map(entry_bytes, entries))
        self.oldest = min(self.oldest, *(e.published.timestamp() for e in entries))
        self.through = through

    def covers(self, position: Position) -> bool:
        """True when a listener at ``position`` can read on from this chunk."""
        return self.after <= position < self.through

    def index_after(self, position: Position) -> int:
        """Index of the first entry after ``position``."""
        return bisect_right(self.positions, position)

    def item(self, i: int) -> Item:
        """Entry ``i``'s change item, encoded on first use."""
        item = self._items[i]
        if item is None:
            entry = self.entries[i]
            item = self._items[i] = Item(self._encode(entry), entry.published.timestamp())
        return item

    def selection(self, interest: Interest) -> Selection:
        """The entries ``interest`` wants, in feed order.

        Remembered for a few interests: listeners of one interest catching up
        through the same chunk select once, then each takes its part by
        bisection and a slice, as cheaply as live delivery does.
        """
        selection = self._selections.get(interest)
        if selection is None:
            if len(self._selections) >= _SELECTIONS_KEPT:
                del self._selections[next(iter(self._selections))]
            wants = interest.wants
            chosen = [i for i, entry in enumerate(self.entries) if wants(entry)]
            selection = Selection(
                chosen, [self.positions[i] for i in chosen], [self.item(i) for i in chosen]
            )
            self._selections[interest] = selection
        return selection
