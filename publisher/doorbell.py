"""The doorbell of a tailer that reads a standby: a LISTEN on the primary.

A standby refuses LISTEN, and a primary's NOTIFY never reaches it. So a
publisher with ``read_dsn`` keeps one connection to the primary (``dsn``)
that does nothing but LISTEN on the feed's channel, and rings its tailer
with each notification. The notification names the writer's transaction
(schema migration 7): the tailer then reads its standby, and reads again,
briefly, until the standby has replayed that transaction (``Tailer``).

What this costs the primary is a connection per publisher and, per
committed write, the work of handing one notification to each listening
connection: some tens of microseconds. So the doorbell rests (UNLISTEN)
while the feed flows and the tailer reads on its own anyway (``pacing``),
and listens again once the feed is quiet. No feed table is read on the
primary (docs/capacity.md).

Each time it starts listening (at start-up, after a reconnect, after a rest)
it rings once naming the newest transaction that began before its LISTEN
took effect: the tailer then reads until its standby has replayed every such
transaction, so nothing committed while nobody listened waits for the poll.
While the primary is away (a restart, a failover) the tailer reads its
standby every ``poll_interval`` and the doorbell reconnects with back-off.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections.abc import Awaitable, Callable
from typing import Any

import asyncpg
from tenacity import RetryCallState

from changefeed.backoff import Backoff, FailureStreak, retrying
from changefeed.logs import log_event

from .feed import DB_ERRORS

__all__ = ["Doorbell"]

log = logging.getLogger(__name__)

_RECONNECT = Backoff(initial=0.1, maximum=5.0, jitter=0.5)
"""Waits before listening again on the primary (changefeed.backoff's policy): 100 ms
doubling to 5 s, the upper half of each drawn at random."""

RECONNECT_RESET = 5.0
"""Seconds a connection must stay up for the next failure to reconnect at
``_RECONNECT``'s start again (``FailureStreak``)."""

_CHECK_INTERVAL = 10.0
"""Seconds between two checks that the LISTEN connection still answers: an idle
connection to a primary that vanished (a failover, a cut network) fails no
statement, and would otherwise be taken for a quiet feed for good."""
_CHECK_TIMEOUT = 5.0


class Doorbell:
    """Rings ``ring`` with every notification of ``channel`` on the primary.

    Args:
        connect: opens a new connection to the primary.
        channel: the NOTIFY channel writers ring.
        ring: the tailer's doorbell (``Tailer.ring``), called with asyncpg's
            listener arguments, the payload last.
        rng: random source of the reconnections' back-off.
    """

    def __init__(
        self,
        connect: Callable[[], Awaitable[asyncpg.Connection]],
        channel: str,
        ring: Callable[..., None],
        *,
        rng: random.Random | None = None,
    ) -> None:
        self._connect = connect
        self._channel = channel
        self._ring = ring
        self.status = "starting"
        self.last_error: str | None = None
        self.reconnects_total = 0
        self.rests_total = 0
        self._resting = False
        self._changed = asyncio.Event()
        self._rng = rng or random.Random()
        self._failures = FailureStreak(RECONNECT_RESET)

    async def run(self) -> None:
        """LISTEN forever, reconnecting with back-off whenever the primary goes away."""
        reconnecting = retrying(
            _RECONNECT,
            retry=self._retryable,
            rng=self._rng,
            before_sleep=self._on_retry,
            failures=lambda _: self._failures.count,
        )
        async for attempt in reconnecting:
            with attempt:
                await self._listen()

    def _retryable(self, state: RetryCallState) -> bool:
        # The failure is counted here: tenacity asks this, then the wait (which reads
        # the count), then before_sleep.
        exc = state.outcome.exception() if state.outcome else None
        if not isinstance(exc, DB_ERRORS):
            return False
        self._failures.failed(time.monotonic())
        return True

    def _on_retry(self, state: RetryCallState) -> None:
        exc = state.outcome.exception() if state.outcome else None
        self.status = "reconnecting"
        self.last_error = f"{type(exc).__name__}: {exc}"
        self.reconnects_total += 1
        log_event(
            log,
            "doorbell.reconnecting",
            logging.WARNING,
            error=self.last_error,
            attempt=self._failures.count,
        )

    def rest(self, resting: bool) -> None:
        """Rest (UNLISTEN) while the tailer reads on its own, or listen again
        (``Tailer.on_rest``)."""
        self._resting = resting
        self._changed.set()

    async def _listen(self) -> None:
        conn = await self._connect()
        listening = False
        try:
            conn.add_termination_listener(lambda _: self._changed.set())
            if self.status != "starting":
                log_event(log, "doorbell.reconnected")
            self._failures.up(time.monotonic())
            self.last_error = None
            while True:
                self._changed.clear()
                if conn.is_closed():
                    raise ConnectionError("the doorbell's connection to the primary closed")
                if not self._resting and not listening:
                    await conn.add_listener(self._channel, self._ring)
                    listening = True
                    # Every transaction that began before the LISTEN took effect:
                    # its ring, if it commits later, is heard; if it committed
                    # before, the tailer waits until the standby has replayed it.
                    xmax = await conn.fetchval(
                        "SELECT pg_snapshot_xmax(pg_current_snapshot())::text::bigint"
                    )
                    self._ring(None, None, self._channel, str(int(xmax) - 1))
                elif self._resting and listening:
                    await conn.remove_listener(self._channel, self._ring)
                    listening = False
                    self.rests_total += 1
                self.status = "listening" if listening else "resting"
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(_CHECK_INTERVAL):
                        await self._changed.wait()
                if not self._changed.is_set():
                    async with asyncio.timeout(_CHECK_TIMEOUT):
                        await conn.fetchval("SELECT 1")
        finally:
            with contextlib.suppress(Exception):
                async with asyncio.timeout(2.0):
                    await conn.close()
            if not conn.is_closed():
                conn.terminate()

    def stats(self) -> dict[str, Any]:
        """The doorbell's part of the tailer's stats."""
        return {
            "status": self.status,
            "rests": self.rests_total,
            "reconnects": self.reconnects_total,
            "lastError": self.last_error,
        }
