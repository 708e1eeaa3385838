"""Callers asking the same question at the same time share one answer, never one
asked before they came. Pure asyncio: no I/O of its own.

An answer is only as fresh as the snapshot it was read from. A query already
under way when a caller arrives may have read the database before something
the caller has seen: a cursor another publisher issued, a compaction's
announcement. Its answer is not the caller's. So a caller that finds a query
under way waits for the *next* round, started as soon as the one under way
ends, and shares it with every other caller that came meanwhile. A thousand
callers at once cost two queries, and each gets an answer read after it asked.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Awaitable, Callable, Hashable
from typing import Generic, TypeVar

__all__ = ["Rounds"]

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class Rounds(Generic[K, V]):
    """Rounds of one call per key (see the module docstring).

    A caller that gives up (is cancelled) leaves its round running for the
    others; an error of a round's call reaches every caller of that round.
    """

    def __init__(self) -> None:
        self._running: dict[K, asyncio.Future[V]] = {}
        self._next: dict[K, tuple[asyncio.Future[V], Callable[[], Awaitable[V]]]] = {}

    async def ask(
        self, key: K, call: Callable[[], Awaitable[V]], *, join_running: bool = False
    ) -> V:
        """``call()``'s answer for ``key``, shared with the callers of the same round.

        ``call`` is made now when no round of ``key`` is under way; otherwise the
        next round makes the ``call`` of the first caller that waits for it.
        ``join_running``: the round under way will do, for a key that itself
        says how fresh the answer must be (a replay target read after the
        caller came).
        """
        running = self._running.get(key)
        if running is not None and join_running:
            return await asyncio.shield(running)
        if running is None:
            return await asyncio.shield(self._start(key, call))
        queued = self._next.get(key)
        if queued is None:
            queued = self._next[key] = (asyncio.get_running_loop().create_future(), call)
        return await asyncio.shield(queued[0])

    def _start(self, key: K, call: Callable[[], Awaitable[V]]) -> asyncio.Future[V]:
        started = asyncio.ensure_future(call())
        self._running[key] = started
        started.add_done_callback(functools.partial(self._ended, key))
        return started

    def _ended(self, key: K, ended: asyncio.Future[V]) -> None:
        if self._running.get(key) is ended:
            del self._running[key]
        if not ended.cancelled():
            ended.exception()  # retrieved: every caller of the round has it too
        queued = self._next.pop(key, None)
        if queued is not None:
            waiting, call = queued
            self._start(key, call).add_done_callback(functools.partial(_chain, waiting))


def _chain(waiting: asyncio.Future[V], done: asyncio.Future[V]) -> None:
    """Hand a round's outcome to the future its callers wait on."""
    if waiting.done():
        return
    if done.cancelled():
        waiting.cancel()
    elif (exc := done.exception()) is not None:
        waiting.set_exception(exc)
        waiting.exception()  # retrieved here too: callers that all gave up leak nothing
    else:
        waiting.set_result(done.result())
