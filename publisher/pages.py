"""Catch-up pages read from the feed table, shared by listeners at nearby positions.

A listener further behind than the window reads the feed itself, one keyset
page at a time (``FeedReader.read_page``: the entries of its resources after
its position, and the feed's low-water mark in the same snapshot). Pages are
kept, bounded by memory, and found by position: a page covers ``(after,
through]``, so every listener whose position lies in that interval reads on
from it, and listeners moving through the same stretch of the feed walk the
same pages. A read that is under way is awaited by every listener it may
cover instead of being made again: a thousand listeners that fell behind
together make one query per page, not a thousand.

A kept page is the table as it was when read. Every page read also brings the
compaction job's rewrites (``feed.Rewrites``, same snapshot): once a new run
has announced itself, every kept page is let go, and ``floor`` (the newest
entry any run has widened, or is about to) tells catch-up where copies held
in memory stop being trustworthy: a listener must never read an entry's
stretch of the table after a merge and the entry's keeper from a copy made
before it (``catchup``; docs/compaction.md, "Publishers' copies").

``PageCache`` is pure; ``FeedPages`` adds the reads.
"""

from __future__ import annotations

import asyncio
from bisect import bisect_right
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Sequence

from changefeed.schemas import Position

from .entries import Chunk, Encoder
from .feed import NO_REWRITES, PageOfFeed, Rewrites

__all__ = ["CursorExpired", "FeedPages", "PageCache", "PageRead"]

ResourceKey = tuple[str, ...]
"""The sorted resources a page holds entries of."""


class CursorExpired(Exception):
    """The feed was trimmed past a position (it is below the low-water mark)."""


PageRead = Callable[[Position, Position, ResourceKey, int], Awaitable["PageOfFeed"]]
"""Reads up to ``limit`` entries of some resources in ``(after, upto]``; returns them,
the feed's low-water mark and the compaction job's rewrites, all from one
snapshot (``FeedReader.read_page``)."""


class PageCache:
    """Pages by resources and position, the least recently used let go past ``max_bytes``.

    Args:
        max_bytes: about how much memory the pages may hold.
    """

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.nbytes = 0
        self._pages: dict[ResourceKey, list[Chunk]] = {}
        """Each key's pages, sorted by ``after``; they may overlap."""
        self._used: OrderedDict[int, tuple[ResourceKey, Chunk]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._used)

    def find(self, key: ResourceKey, position: Position) -> Chunk | None:
        """A page of ``key`` covering ``position``, if one is kept."""
        pages = self._pages.get(key)
        if not pages:
            return None
        i = bisect_right([p.after for p in pages], position)
        # Pages may overlap (two listeners read from nearby places at once): look
        # back for the one that reaches furthest.
        best: Chunk | None = None
        for page in reversed(pages[:i]):
            if page.covers(position) and (best is None or page.through > best.through):
                best = page
        if best is not None:
            self._used.move_to_end(id(best))
        return best

    def clear(self) -> None:
        """Let every page go."""
        self._pages.clear()
        self._used.clear()
        self.nbytes = 0

    def add(self, key: ResourceKey, page: Chunk) -> None:
        """Keep ``page``, letting the least recently used ones go past the bound."""
        pages = self._pages.setdefault(key, [])
        pages.insert(bisect_right([p.after for p in pages], page.after), page)
        self._used[id(page)] = (key, page)
        self.nbytes += page.nbytes
        while self.nbytes > self.max_bytes and len(self._used) > 1:
            _, (old_key, old) = self._used.popitem(last=False)
            self._pages[old_key].remove(old)
            if not self._pages[old_key]:
                del self._pages[old_key]
            self.nbytes -= old.nbytes


class FeedPages:
    """Reads catch-up pages, sharing them and the reads under way.

    Args:
        read: the page query (``FeedReader.read_page`` on a pooled connection).
        encode: the change item of an entry.
        page_size: entries per page.
        max_bytes: memory bound of the kept pages.
        concurrency: reads at once, at most (the pool serves registrations too).
    """

    def __init__(
        self,
        read: PageRead,
        encode: Encoder,
        *,
        page_size: int,
        max_bytes: int,
        concurrency: int = 2,
    ) -> None:
        self._read = read
        self._encode = encode
        self.page_size = page_size
        self.cache = PageCache(max_bytes)
        self._reads = asyncio.Semaphore(concurrency)
        self._under_way: dict[ResourceKey, list[tuple[Position, asyncio.Future[Chunk]]]] = {}
        self.reads_total = 0
        """Page queries made."""
        self.shared_total = 0
        """Pages served to a listener from what another one read."""
        self._rewrites = NO_REWRITES
        """The compaction job's rewrites as of the newest read: kept pages were read
        under its generation."""
        self._epoch = 0
        """Bumped by ``reset``: a read that began before is of the feed as it was."""

    @property
    def floor(self) -> Position:
        """The newest entry the compaction job has widened or announced: a copy in
        memory of an entry at or before it may be older than the table's."""
        return self._rewrites.through

    def observe(self, rewrites: Rewrites) -> None:
        """Take what a read of the feed says about the job's rewrites (a page, or a
        resume's facts): a newer run lets every kept page go and may raise ``floor``."""
        if rewrites.generation > self._rewrites.generation:
            self.cache.clear()
            self._rewrites = Rewrites(rewrites.generation, max(self.floor, rewrites.through))

    def reset(self) -> None:
        """Let every kept page go, and forget the job's rewrites (the feed changed
        under the publisher: a restored feed's may be lower)."""
        self.cache.clear()
        self._rewrites = NO_REWRITES
        self._epoch += 1

    async def page(self, resources: Sequence[str], position: Position, upto: Position) -> Chunk:
        """A page covering ``position`` for ``resources``, reading at most ``upto``.

        Raises:
            CursorExpired: the feed was trimmed past ``position``.
            Exception: whatever the read raised (the database is away): the caller retries.
        """
        key = tuple(sorted(resources))
        while True:
            page = self.cache.find(key, position)
            if page is not None:
                self.shared_total += 1
                return page
            pending = [f for start, f in self._under_way.get(key, ()) if start <= position]
            if not pending:
                return await self._read_page(key, position, upto)
            # A read from at or before this position is under way: it may cover it.
            await asyncio.wait(pending)

    async def _read_page(self, key: ResourceKey, after: Position, upto: Position) -> Chunk:
        future: asyncio.Future[Chunk] = asyncio.get_running_loop().create_future()
        under_way = self._under_way.setdefault(key, [])
        under_way.append((after, future))
        epoch = self._epoch
        try:
            async with self._reads:
                read = await self._read(after, upto, key, self.page_size)
            self.reads_total += 1
            if after < read.low_water:
                raise CursorExpired(f"the feed was trimmed past {after}")
            current = epoch == self._epoch  # else: of the feed before a ``reset``
            if current:
                self.observe(read.rewrites)
            entries = read.entries
            full = len(entries) == self.page_size
            through = entries[-1].position if full else upto
            page = Chunk(entries, after, through, self._encode)
            kept = read.rewrites.generation == self._rewrites.generation
            if current and kept and page.covers(after):
                self.cache.add(key, page)
            future.set_result(page)
            return page
        except BaseException as exc:
            future.set_exception(exc)
            future.exception()  # retrieved: waiters look again, nobody else needs it
            raise
        finally:
            under_way.remove((after, future))
            if not under_way:
                self._under_way.pop(key, None)
