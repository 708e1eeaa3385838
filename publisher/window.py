"""The window: the most recently tailed entries, shared by every listener catching up. Pure code.

The tailer appends each batch it reads; the window keeps the newest chunks
whose entries fit in ``max_bytes``, and lets the oldest go, and those older
than ``max_age`` too (``expire``). Its entries are copies from when the tailer
read them: catch-up takes none at or before the compaction job's rewrite
floor (``catchup``; docs/compaction.md). It covers the feed
from ``base`` (exclusive) to ``head`` (inclusive) without a hole, so a
listener whose position lies in that interval catches up from memory, and one
further back reads the feed table instead (``pages``). Whatever the number of
listeners and however far behind they are, the window costs its bound once.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Sequence

from changefeed.schemas import Position, stamp_of

from .entries import Chunk, Encoder
from .feed import FeedEntry

__all__ = ["Window"]

_CHUNK_ENTRIES = 1024
"""A tailer read is appended to the newest chunk while that one then holds at most
this many entries (and a sixteenth of the window's bytes): a trickle of one-entry
reads makes few chunks, and the window still lets go of its oldest in small steps."""


class Window:
    """Recently tailed entries, bounded by memory.

    Args:
        start: the tailer's position when it started: the window begins there.
        max_bytes: about how much memory the entries may hold (see entries.entry_bytes).
        encode: the change item of an entry.
        max_age: seconds after its publication an entry is let go (``expire``).
    """

    def __init__(
        self, start: Position, max_bytes: int, encode: Encoder, max_age: float = float("inf")
    ) -> None:
        self.max_bytes = max_bytes
        self.max_age = max_age
        self._encode = encode
        self._chunks: list[Chunk] = []
        self._lasts: list[Position] = []
        """``through`` of each chunk, for bisection."""
        self._first = 0
        """Index of the oldest chunk still held (the list is trimmed in bulk)."""
        self.base = start
        """Everything after this position is held (up to ``head``)."""
        self.head = start
        """The last position appended."""
        self.head_stamp = 0
        """The stamp of the entry at ``head`` (for the cursors of acks)."""
        self.nbytes = 0

    def reset(self, start: Position, stamp: int = 0) -> None:
        """Begin afresh after ``start`` (the tailer's position when it starts; the
        entry there has ``stamp``)."""
        self._chunks.clear()
        self._lasts.clear()
        self._first = 0
        self.base = self.head = start
        self.head_stamp = stamp
        self.nbytes = 0

    def __len__(self) -> int:
        """Entries held."""
        return sum(len(c) for c in self._chunks[self._first :])

    def append(self, entries: Sequence[FeedEntry]) -> tuple[Chunk, int]:
        """Hold a batch the tailer read (it follows ``head``), letting the oldest go.

        Returns:
            the chunk the batch went into and the index of its first entry there.
        """
        through = entries[-1].position
        newest = self._chunks[-1] if len(self._chunks) > self._first else None
        if (
            newest is not None
            and len(newest) + len(entries) <= _CHUNK_ENTRIES
            and newest.nbytes * 16 <= self.max_bytes
            and self._young_enough(newest, entries[-1])
        ):
            start = len(newest)
            before = newest.nbytes
            newest.extend(entries, through)
            self._lasts[-1] = through
            self.nbytes += newest.nbytes - before
            chunk = newest
        else:
            chunk = Chunk(entries, self.head, through, self._encode)
            start = 0
            self._chunks.append(chunk)
            self._lasts.append(through)
            self.nbytes += chunk.nbytes
        self.head = through
        self.head_stamp = stamp_of(entries[-1].published)
        self._trim()
        return chunk, start

    def _trim(self) -> None:
        # The newest chunk always stays: it is what live delivery reads from.
        while self.nbytes > self.max_bytes and len(self._chunks) - self._first > 1:
            self._let_go_oldest()
        if self._first > 64 and self._first * 2 > len(self._chunks):
            del self._chunks[: self._first]
            del self._lasts[: self._first]
            self._first = 0

    def _young_enough(self, chunk: Chunk, entry: FeedEntry) -> bool:
        # A chunk spans at most a quarter of max_age: it leaves the window as a whole.
        return entry.published.timestamp() - chunk.oldest <= self.max_age / 4

    def expire(self, now: float) -> None:
        """Let go of every entry published more than ``max_age`` seconds before
        ``now`` (POSIX time). The window holds a stretch of the feed without a hole,
        so an old entry takes every chunk up to its own with it (an old entry late
        in the feed: a long transaction that committed late)."""
        cutoff = now - self.max_age
        last_old = -1
        for i in range(self._first, len(self._chunks)):
            if self._chunks[i].oldest < cutoff:
                last_old = i
        while self._first <= last_old:
            self._let_go_oldest()

    def _let_go_oldest(self) -> None:
        oldest = self._chunks[self._first]
        self._chunks[self._first] = _GONE
        self._first += 1
        self.nbytes -= oldest.nbytes
        self.base = oldest.through

    def find(self, position: Position) -> tuple[Chunk, int] | None:
        """The chunk to read on from after ``position``, and the index of the next
        entry in it; None when ``position`` is behind the window (read the feed
        table) or at its head (nothing to read)."""
        if not self.base <= position < self.head:
            return None
        i = bisect_right(self._lasts, position, lo=self._first)
        chunk = self._chunks[i]
        return chunk, chunk.index_after(position)


_GONE = Chunk((), Position(0, 0), Position(0, 0), lambda entry: "")
"""Stands in for a chunk let go until the list is trimmed."""
