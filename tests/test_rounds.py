"""publisher.rounds: callers at the same time share one call, and never an answer asked
before they came (the rule resume facts and the standby's primary position rest on)."""

from __future__ import annotations

import asyncio

import pytest

from changefeed.publisher.rounds import Rounds

WAIT = 5.0
"""Seconds any step of these tests may take, at most (each takes microseconds)."""


class Question:
    """A call whose answer is its round's number. Each round says it was asked
    (``asked``), notes how many callers had come by then, and waits to be let go
    (``go``)."""

    def __init__(self) -> None:
        self.rounds = 0
        self.came = 0
        self.came_before: list[int] = []
        self.asked = asyncio.Event()
        self.go = asyncio.Event()
        self.everyone = asyncio.Event()
        self.expected = 0
        self.fail: BaseException | None = None

    async def __call__(self) -> int:
        self.rounds += 1
        number = self.rounds
        self.came_before.append(self.came)
        self.asked.set()
        await self.go.wait()
        self.go.clear()
        if self.fail is not None:
            raise self.fail
        return number

    async def next_round(self) -> None:
        """Let the round under way end, and wait until the next one was asked."""
        self.asked.clear()
        self.go.set()
        await asyncio.wait_for(self.asked.wait(), WAIT)


async def _ask(rounds: Rounds[str, int], question: Question) -> int:
    # No await between coming and asking: once ``everyone`` is set, all have asked.
    question.came += 1
    if question.came == question.expected:
        question.everyone.set()
    return await rounds.ask("key", question)


async def _round_and_latecomers(
    rounds: Rounds[str, int], question: Question, late: int
) -> tuple[asyncio.Task[int], list[asyncio.Task[int]]]:
    """A first caller whose round is under way, and ``late`` callers who came since."""
    question.expected = 1 + late
    first = asyncio.create_task(_ask(rounds, question))
    await asyncio.wait_for(question.asked.wait(), WAIT)
    latecomers = [asyncio.create_task(_ask(rounds, question)) for _ in range(late)]
    await asyncio.wait_for(question.everyone.wait(), WAIT)
    return first, latecomers


async def test_callers_during_a_round_share_the_next_one_asked_after_they_all_came() -> None:
    rounds: Rounds[str, int] = Rounds()
    question = Question()
    first, late = await _round_and_latecomers(rounds, question, 50)
    assert question.rounds == 1  # the fifty wait; nothing more is asked yet
    await question.next_round()
    assert await asyncio.wait_for(first, WAIT) == 1
    assert question.came_before == [1, 51]  # the second round: after all 51 came
    question.go.set()
    assert await asyncio.wait_for(asyncio.gather(*late), WAIT) == [2] * 50
    assert question.rounds == 2


async def test_a_caller_after_a_round_ended_gets_a_fresh_one() -> None:
    rounds: Rounds[str, int] = Rounds()
    question = Question()
    question.go.set()
    assert await asyncio.wait_for(_ask(rounds, question), WAIT) == 1
    question.go.set()
    assert await asyncio.wait_for(_ask(rounds, question), WAIT) == 2


async def test_other_keys_do_not_wait() -> None:
    rounds: Rounds[str, int] = Rounds()
    held, other = Question(), Question()
    first = asyncio.create_task(rounds.ask("held", held))
    await asyncio.wait_for(held.asked.wait(), WAIT)
    other.go.set()
    assert await asyncio.wait_for(rounds.ask("other", other), WAIT) == 1
    held.go.set()
    assert await asyncio.wait_for(first, WAIT) == 1


async def test_an_error_reaches_every_caller_of_its_round_only() -> None:
    rounds: Rounds[str, int] = Rounds()
    question = Question()
    first, late = await _round_and_latecomers(rounds, question, 3)
    question.fail = TimeoutError("the database did not answer")
    await question.next_round()
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(first, WAIT)
    question.go.set()
    for task in late:
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(task, WAIT)
    question.fail = None
    question.go.set()
    assert await asyncio.wait_for(_ask(rounds, question), WAIT) == 3


async def test_a_caller_that_gives_up_leaves_the_round_to_the_others() -> None:
    rounds: Rounds[str, int] = Rounds()
    question = Question()
    first, late = await _round_and_latecomers(rounds, question, 2)
    first.cancel()
    late[0].cancel()
    await question.next_round()  # the first round ran on without its caller
    with pytest.raises(asyncio.CancelledError):
        await first
    question.go.set()
    assert await asyncio.wait_for(late[1], WAIT) == 2
    with pytest.raises(asyncio.CancelledError):
        await late[0]


async def test_callers_that_may_join_share_the_round_under_way() -> None:
    rounds: Rounds[str, int] = Rounds()
    question = Question()
    first = asyncio.create_task(rounds.ask("key", question, join_running=True))
    await asyncio.wait_for(question.asked.wait(), WAIT)
    joined = asyncio.create_task(rounds.ask("key", question, join_running=True))
    question.go.set()
    assert list(await asyncio.wait_for(asyncio.gather(first, joined), WAIT)) == [1, 1]
    assert question.rounds == 1
