"""From the tailer's batches to the listeners' queues: one publisher's delivery pipeline.

Each batch the tailer reads goes into the window of recent entries
(``window``), then to the live listeners that want it (``fanout``), whose
queues the flush rounds write out (``scheduler``). A listener that falls
behind, or starts behind (a resume), is refilled by its own connection from
the window or, further back, from pages of the feed table shared with the
listeners near it (``catchup``, ``pages``). An entry is encoded once for
every listener that gets it live or from the window, and once per page read
from the table. Nothing here awaits a listener (I2, I3).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Sequence

import asyncpg
import orjson

from changefeed.logs import log_event
from changefeed.schemas import Position, stamp_of

from .catchup import Catchup
from .config import PublisherConfig
from .counters import Counters
from .fanout import Fanout
from .feed import FeedEntry, FeedReader, PageOfFeed
from .identity import FeedIdentity
from .metrics import ENTRY_AGE_BUCKETS, FLUSH_BUCKETS, FastHistogram
from .pages import FeedPages
from .scheduler import FlushScheduler, LoopClock
from .window import Window

__all__ = ["Broadcast"]

log = logging.getLogger(__name__)

_FANNED_OUT_TIMEOUT = 1.0
_PAGE_READS = 2
"""Catch-up page reads at once, at most (the pool also serves registrations)."""
_ACQUIRE_TIMEOUT = 5.0
_PAGE_TIMEOUT = 30.0


class Broadcast:
    """The window, live dispatch, flush rounds and catch-up of one publisher.

    Args:
        config: sizes and intervals (``window_bytes``, ``tail_batch``, ``send_interval``).
        identity: the feed's cursors (each item carries one).
        counters: where live dispatch counts.
        reader: the feed's queries, for catch-up pages.
        pool: the publisher's pool, once started.
    """

    def __init__(
        self,
        config: PublisherConfig,
        *,
        identity: FeedIdentity,
        counters: Counters,
        reader: FeedReader,
        pool: Callable[[], asyncpg.Pool],
    ) -> None:
        self._identity = identity
        self._counters = counters
        self._reader = reader
        self._pool = pool
        self.fanout = Fanout()
        self.window = Window(
            Position(0, 0), config.window_bytes, self.encode, max_age=config.window_max_age
        )
        self.pages = FeedPages(
            self._read_page,
            self.encode,
            page_size=config.tail_batch,
            max_bytes=config.window_bytes // 4,
            concurrency=_PAGE_READS,
        )
        self.catchup = Catchup(self.window, self.fanout, self.pages)
        self.entry_age = FastHistogram(
            "changefeed_entry_age_seconds",
            "Age of each feed entry (now minus its published time, the database's clock)"
            " when the tailer handed it to the fan-out: the delay listeners see, before"
            " the flush and the network",
            ENTRY_AGE_BUCKETS,
        )
        self.flush_seconds = FastHistogram(
            "changefeed_flush_seconds",
            "Time one fan-out flush spent writing to listener connections (all its slices)",
            FLUSH_BUCKETS,
        )
        self.scheduler = FlushScheduler(
            LoopClock(), send_interval=config.send_interval, report=self._flushed
        )

    def encode(self, entry: FeedEntry) -> str:
        """The change item of ``entry``: encoded once, sent to every listener that wants it."""
        published = entry.published.isoformat(timespec="milliseconds").replace("+00:00", "Z")
        cursor = self._identity.codec.encode(entry.position, stamp_of(entry.published))
        return orjson.dumps(
            {
                "changeKind": {
                    "resource": entry.resource,
                    "subResources": list(entry.sub_resources),
                },
                "changedResourceId": entry.changed_resource_id,
                "cursor": cursor,
                "published": published,
            }
        ).decode()

    def dispatch(self, entries: Sequence[FeedEntry]) -> None:
        """The tailer's sink: one batch, in feed order, to the window and the live listeners."""
        now, observe = time.time(), self.entry_age.observe
        for entry in entries:
            observe(now - entry.published.timestamp())
        self.window.expire(now)
        chunk, start = self.window.append(entries)
        done = self.fanout.dispatch(chunk, start)
        self._counters.queued_live += done.queued
        self._counters.fell_behind += len(done.behind)
        if log.isEnabledFor(logging.DEBUG):
            log_event(
                log,
                "fanout.dispatched",
                logging.DEBUG,
                entries=len(entries),
                last=list(entries[-1].position),
                queued=done.queued,
                listeners=len(done.touched),
                fell_behind=len(done.behind),
            )
        if done.touched:
            self.scheduler.add(done.touched)

    async def fanned_out(self) -> None:
        """Return once every item dispatched so far has had its flush (the tailer
        waits for this between full batches; see Tailer). Bounded: a flush that
        never ends, which is a bug, must not stop the tailer for good."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(_FANNED_OUT_TIMEOUT):
                await self.scheduler.idle.wait()

    def stop(self) -> None:
        self.scheduler.stop()

    def _flushed(self, cost: float, listeners: int, to_senders: int) -> None:
        self.flush_seconds.observe(cost)
        if log.isEnabledFor(logging.DEBUG):
            log_event(
                log,
                "fanout.flushed",
                logging.DEBUG,
                through=list(self.window.head),
                listeners=listeners,
                written=listeners - to_senders,
                to_senders=to_senders,
                cost_ms=round(cost * 1e3, 3),
            )

    async def _read_page(
        self, after: Position, upto: Position, resources: Sequence[str], limit: int
    ) -> PageOfFeed:
        async with self._pool().acquire(timeout=_ACQUIRE_TIMEOUT) as conn:
            # Bounded: an embedding API's pool may have no statement timeout.
            async with asyncio.timeout(_PAGE_TIMEOUT):
                return await self._reader.read_page(conn, after, upto, resources, limit)
