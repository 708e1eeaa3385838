"""An outside check (an application's authorizer) awaited within a deadline.

The publisher asks an application's code whether a token, or a request, may
go on. Whatever goes wrong there means the check could not be made, never
that the answer is no: a listener told "unauthorized" gives up for good,
one told "unavailable" retries. Two ways of going wrong need care:

* a check that swallows its cancellation at the deadline and answers anyway
  could not check in time, whatever it says;
* a check that raises ``asyncio.CancelledError`` of its own (a call inside it
  cancelled by someone else) is a failure of the check, not a cancellation of
  the request: it must not pass through as one, which would answer 500, or
  cut the request's task short. Only a cancellation of the awaiting task
  itself (``Task.cancelling``) goes on as a cancellation.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

__all__ = ["CheckCancelled", "answer_within"]

T = TypeVar("T")


class CheckCancelled(Exception):
    """The check raised ``CancelledError`` while the task awaiting it was not cancelled."""


async def answer_within(check: Awaitable[T], seconds: float, what: str) -> T:
    """``check``'s answer, if it gives one within ``seconds``.

    Raises:
        TimeoutError: it took longer (or answered only after its deadline).
        CheckCancelled: it raised ``CancelledError`` of its own.
        asyncio.CancelledError: the awaiting task was cancelled.
        Exception: whatever else ``check`` raised.
    """
    try:
        async with asyncio.timeout(seconds) as deadline:
            answer = await check
    except asyncio.CancelledError as exc:
        task = asyncio.current_task()
        if task is not None and task.cancelling():
            raise
        raise CheckCancelled(f"{what} raised CancelledError") from exc
    if deadline.expired():
        raise TimeoutError(f"{what} took longer than {seconds:g}s")
    return answer
