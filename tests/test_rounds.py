"""publisher.rounds: callers at the same time share one call, and never an answer asked
before they came (the rule resume facts and the standby's primary position rest on)."""

from __future__ import annotations

import asyncio

import pytest

from changefeed.publisher.rounds import Rounds


class Question:
    """A call whose answer is its round's number; each round waits to be let go."""

    def __init__(self) -> None:
        self.rounds = 0
        self.asked_at: list[int] = []
        self.go = asyncio.Event()
        self.arrived = 0
        self.fail: BaseException | None = None

    async def __call__(self) -> int:
        self.rounds += 1
        number = self.rounds
        self.asked_at.append(self.arrived)  # how many callers had come when it was asked
        await self.go.wait()
        self.go.clear()
        if self.fail is not None:
            raise self.fail
        return number


async def _ask(rounds: Rounds[str, int], question: Question) -> int:
    question.arrived += 1
    return await rounds.ask("key", question)


async def test_callers_during_a_round_share_the_next_one_asked_after_they_all_came() -> None:
    rounds: Rounds[str, int] = Rounds()
    question = Question()
    first = asyncio.create_task(_ask(rounds, question))
    await asyncio.sleep(0)
    late = [asyncio.create_task(_ask(rounds, question)) for _ in range(50)]
    await asyncio.sleep(0)
    assert question.rounds == 1  # the fifty wait; nothing more is asked yet
    question.go.set()
    assert await first == 1
    await asyncio.sleep(0)
    assert question.rounds == 2 and question.asked_at == [1, 51]
    question.go.set()
    assert await asyncio.gather(*late) == [2] * 50
    assert question.rounds == 2


async def test_a_caller_after_a_round_ended_gets_a_fresh_one() -> None:
    rounds: Rounds[str, int] = Rounds()
    question = Question()
    question.go.set()
    assert await _ask(rounds, question) == 1
    question.go.set()
    assert await _ask(rounds, question) == 2


async def test_other_keys_do_not_wait() -> None:
    rounds: Rounds[str, int] = Rounds()
    held, other = Question(), Question()
    first = asyncio.create_task(rounds.ask("held", held))
    await asyncio.sleep(0)
    other.go.set()
    assert await asyncio.wait_for(rounds.ask("other", other), 5) == 1
    held.go.set()
    assert await first == 1


async def test_an_error_reaches_every_caller_of_its_round_only() -> None:
    rounds: Rounds[str, int] = Rounds()
    question = Question()
    first = asyncio.create_task(_ask(rounds, question))
    await asyncio.sleep(0)
    late = [asyncio.create_task(_ask(rounds, question)) for _ in range(3)]
    await asyncio.sleep(0)
    question.fail = TimeoutError("the database did not answer")
    question.go.set()
    with pytest.raises(TimeoutError):
        await first
    await asyncio.sleep(0)
    question.go.set()
    for task in late:
        with pytest.raises(TimeoutError):
            await task
    question.fail = None
    question.go.set()
    assert await _ask(rounds, question) == 3


async def test_a_caller_that_gives_up_leaves_the_round_to_the_others() -> None:
    rounds: Rounds[str, int] = Rounds()
    question = Question()
    first = asyncio.create_task(_ask(rounds, question))
    await asyncio.sleep(0)
    late = [asyncio.create_task(_ask(rounds, question)) for _ in range(2)]
    await asyncio.sleep(0)
    first.cancel()
    late[0].cancel()
    question.go.set()
    with pytest.raises(asyncio.CancelledError):
        await first
    await asyncio.sleep(0)
    question.go.set()
    assert await asyncio.wait_for(late[1], 5) == 2
    with pytest.raises(asyncio.CancelledError):
        await late[0]
