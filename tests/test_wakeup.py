"""publisher.wakeup.Wakeup: what senders and connections need of an asyncio.Event."""

from __future__ import annotations

import asyncio

import pytest

from changefeed.publisher.wakeup import Wakeup


async def test_a_waiter_wakes_when_set_and_a_set_flag_does_not_block() -> None:
    flag = Wakeup()
    waiter = asyncio.create_task(flag.wait())
    await asyncio.sleep(0)
    assert not waiter.done()
    flag.set()
    await asyncio.wait_for(waiter, 1)
    await asyncio.wait_for(flag.wait(), 1)  # set: returns at once
    flag.clear()
    assert not flag.is_set()


async def test_one_waiter_cancelled_leaves_the_others_waiting() -> None:
    flag = Wakeup()
    first = asyncio.create_task(flag.wait())
    second = asyncio.create_task(flag.wait())
    await asyncio.sleep(0)
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(asyncio.shield(first), 0.01)
    first.cancel()
    await asyncio.gather(first, return_exceptions=True)
    flag.set()
    await asyncio.wait_for(second, 1)
    assert first.cancelled() and second.done() and not second.cancelled()
