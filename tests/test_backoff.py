"""The one back-off policy (changefeed.backoff), the listener's re-registration schedule, and
tenacity retrying by it (pure: time is passed in, jitter is seeded)."""

from __future__ import annotations

import random

import pytest
from tenacity import RetryCallState, retry_if_exception_type, stop_after_attempt

from changefeed.backoff import MAX_RETRY_AFTER, Backoff, BackoffError, FailureStreak, retrying
from changefeed.listener import BackoffPolicy, ListenerConfigError, ListenerError
from changefeed.listener._backoff import DEFAULT_ITEM_BACKOFF, RegistrationBackoff


def test_default_is_client_go_reflector_schedule() -> None:
    policy = BackoffPolicy()
    assert (policy.initial, policy.maximum, policy.factor) == (0.8, 30.0, 2.0)
    assert policy.jitter == 1.0
    assert policy.reset_after == 120.0


def test_ceiling_grows_by_factor_and_is_capped() -> None:
    policy = BackoffPolicy(initial=0.8, maximum=30.0, factor=2.0)
    ceilings = [policy.ceiling(n) for n in range(1, 10)]
    assert ceilings == pytest.approx([0.8, 1.6, 3.2, 6.4, 12.8, 25.6, 30.0, 30.0, 30.0])
    assert policy.ceiling(10_000) == 30.0  # no overflow for huge exponents


def test_full_jitter_stays_within_zero_and_ceiling_and_varies() -> None:
    backoff = RegistrationBackoff(BackoffPolicy(initial=0.8, maximum=30.0), random.Random(1))
    delays, ceilings = [], []
    for _ in range(200):
        delays.append(backoff.failure(now=0.0))
        ceilings.append(backoff.ceiling)
    assert all(0.0 <= d <= c for d, c in zip(delays, ceilings, strict=True))
    capped = delays[10:]
    assert len(set(capped)) > 150  # really random, not a constant
    assert min(capped) < 10.0 < max(capped)  # spread over the window


@pytest.mark.parametrize("jitter", [0.0, 0.25, 0.5])
def test_partial_jitter_bounds(jitter: float) -> None:
    policy = BackoffPolicy(initial=1.0, maximum=8.0, jitter=jitter)
    rng = random.Random(7)
    for failures in range(1, 8):
        delay, ceiling = policy.draw(failures, rng)
        assert ceiling * (1 - jitter) - 1e-9 <= delay <= ceiling + 1e-9
    assert BackoffPolicy(initial=1.0, jitter=0.0).draw(3, rng) == (4.0, 4.0)
    assert BackoffPolicy(initial=1.0, jitter=0.0).delay(3, rng) == 4.0


def test_seeded_schedules_are_reproducible() -> None:
    def run(seed: int) -> list[float]:
        backoff = RegistrationBackoff(BackoffPolicy(initial=0.1, maximum=5.0), random.Random(seed))
        return [backoff.failure(now=float(i)) for i in range(12)]

    assert run(3) == run(3)
    assert run(3) != run(4)


def test_reset_after_a_healthy_period() -> None:
    backoff = RegistrationBackoff(
        BackoffPolicy(initial=1.0, maximum=64.0, reset_after=120.0), random.Random()
    )
    for i in range(5):
        backoff.failure(now=float(i))
    assert backoff.failures == 5
    assert backoff.ceiling == 16.0

    # Live for less than reset_after: the schedule keeps growing.
    backoff.healthy(now=100.0)
    backoff.failure(now=219.0)
    assert backoff.failures == 6 and backoff.ceiling == 32.0 and backoff.resets == 0

    # Live for reset_after: the next failure starts over from the first delay.
    backoff.healthy(now=300.0)
    assert backoff.healthy_for(now=360.0) == 60.0
    backoff.failure(now=420.0)
    assert backoff.failures == 1 and backoff.ceiling == 1.0 and backoff.resets == 1
    assert backoff.healthy_for(now=500.0) == 0.0  # not live any more


def test_healthy_keeps_the_first_moment() -> None:
    backoff = RegistrationBackoff(BackoffPolicy(initial=1.0, reset_after=10.0))
    backoff.failure(now=0.0)
    backoff.healthy(now=1.0)
    backoff.healthy(now=9.0)  # a second call does not restart the healthy period
    backoff.failure(now=11.0)
    assert backoff.failures == 1 and backoff.resets == 1


def test_explicit_reset() -> None:
    backoff = RegistrationBackoff(BackoffPolicy(initial=1.0))
    backoff.failure(now=0.0)
    backoff.failure(now=0.0)
    backoff.reset()
    assert (backoff.failures, backoff.delay, backoff.ceiling) == (0, 0.0, 0.0)


def test_a_servers_retry_after_is_a_floor_with_the_jitter_on_top() -> None:
    """Honoured, capped, and spread: the clients one server turned away together do
    not all come back at the same moment."""
    policy = BackoffPolicy(initial=0.1, maximum=0.4)
    rng = random.Random(5)
    waits = [policy.delay(1, rng, retry_after=2.0) for _ in range(100)]
    assert all(2.0 <= w <= 2.1 for w in waits) and len(set(waits)) > 90
    assert policy.delay(1, rng, retry_after=10**9) <= MAX_RETRY_AFTER + 0.1
    for nothing in (None, 0, -1, float("nan")):
        assert policy.delay(1, rng, retry_after=nothing) <= 0.1


def test_the_policy_is_the_same_for_every_part() -> None:
    """The listener's BackoffPolicy is changefeed's one policy, with its own errors."""
    assert issubclass(BackoffPolicy, Backoff)
    assert DEFAULT_ITEM_BACKOFF.ceiling(3) == pytest.approx(0.2)
    with pytest.raises(BackoffError) as info:
        Backoff(initial=0)
    assert info.value.field == "initial" and not isinstance(info.value, ListenerError)


class _Busy(Exception):
    def __init__(self, retry_after: float | None) -> None:
        super().__init__("busy")
        self.retry_after = retry_after


async def test_tenacity_retries_a_call_by_the_policy_honouring_retry_after() -> None:
    """``retrying`` is tenacity's AsyncRetrying with the policy's wait: the jitter
    from the rng given, the Retry-After the failure carries added."""
    waits: list[float] = []
    calls = 0

    async def flaky() -> str:
        nonlocal calls
        calls += 1
        if calls < 4:
            raise _Busy(0.5 if calls == 2 else None)
        return "ok"

    def recorded(state: RetryCallState) -> None:
        assert state.next_action is not None
        waits.append(state.next_action.sleep)

    policy = Backoff(initial=0.001, maximum=0.004, jitter=0.0)
    retrying_ = retrying(
        policy,
        retry=retry_if_exception_type(_Busy),
        stop=stop_after_attempt(5),
        rng=random.Random(1),
        before_sleep=recorded,
    )
    async for attempt in retrying_:
        with attempt:
            result = await flaky()
    assert result == "ok" and calls == 4
    assert waits == pytest.approx([0.001, 0.502, 0.004])
    with pytest.raises(_Busy):  # gives up with the last error
        async for attempt in retrying(
            policy, retry=retry_if_exception_type(_Busy), stop=stop_after_attempt(2)
        ):
            with attempt:
                raise _Busy(None)


def test_default_item_backoff() -> None:
    assert DEFAULT_ITEM_BACKOFF.initial == 0.05
    assert DEFAULT_ITEM_BACKOFF.maximum == 30.0


@pytest.mark.parametrize(
    ("kwargs", "key"),
    [
        ({"initial": 0}, "backoff.initial"),
        ({"initial": 2.0, "maximum": 1.0}, "backoff.maximum"),
        ({"factor": 0.5}, "backoff.factor"),
        ({"jitter": 1.5}, "backoff.jitter"),
        ({"reset_after": -1}, "backoff.reset_after"),
        ({"initial": float("inf"), "maximum": float("inf")}, "backoff.initial"),
        ({"maximum": float("inf")}, "backoff.maximum"),
        ({"factor": float("nan")}, "backoff.factor"),
        ({"jitter": True}, "backoff.jitter"),
        ({"reset_after": float("nan")}, "backoff.reset_after"),
    ],
)
def test_policy_refuses_bad_values(kwargs: dict[str, float], key: str) -> None:
    with pytest.raises(ListenerConfigError) as info:
        BackoffPolicy(**kwargs)
    assert info.value.key == key
    assert isinstance(info.value, ListenerError) and isinstance(info.value, ValueError)


def test_a_failure_streak_starts_over_once_a_connection_stayed_up() -> None:
    streak = FailureStreak(reset_after=5.0)
    assert [streak.failed(now=float(i)) for i in range(3)] == [1, 2, 3]
    streak.up(now=10.0)
    assert streak.failed(now=12.0) == 4  # up 2 s: the outage goes on climbing
    streak.up(now=20.0)
    streak.up(now=24.0)  # a second call keeps the first moment
    assert streak.up_for(now=25.0) == 5.0
    assert streak.failed(now=25.0) == 1  # up 5 s: a blip starts the schedule over
    assert streak.resets == 1 and streak.up_for(now=26.0) == 0.0


async def test_a_connection_retried_for_its_whole_life_waits_by_its_failure_streak() -> None:
    """The tailer's and the doorbell's shape: one ``retrying`` loop around a
    connection's life, the failure counted by the retry predicate (tenacity asks
    it before the wait), the wait drawn for the streak: it climbs while attempts
    fail and starts over after a connection that stayed up."""
    streak = FailureStreak(reset_after=10.0)
    now = 0.0
    waits: list[float] = []
    lives = iter([0.0, 0.0, 0.0, 20.0, 0.0])  # how long each connection stays up

    def failed(state: RetryCallState) -> bool:
        streak.failed(now)
        return True

    def recorded(state: RetryCallState) -> None:
        assert state.next_action is not None
        waits.append(state.next_action.sleep)

    async def live() -> None:
        nonlocal now
        streak.up(now)
        now += next(lives)
        raise ConnectionError("dropped")

    with pytest.raises(ConnectionError):
        async for attempt in retrying(
            Backoff(initial=0.001, maximum=1.0, jitter=0.0),
            retry=failed,
            stop=stop_after_attempt(5),
            before_sleep=recorded,
            failures=lambda _: streak.count,
        ):
            with attempt:
                await live()
    # Up 20 s before the fourth failure: the schedule starts over there.
    assert waits == pytest.approx([0.001, 0.002, 0.004, 0.001])
    assert streak.resets == 1


def test_a_schedule_without_jitter_draws_nothing_from_the_rng() -> None:
    rng = random.Random(3)
    before = rng.getstate()
    assert Backoff(initial=0.5, maximum=2.0, jitter=0.0).delay(3, rng) == 2.0
    assert rng.getstate() == before  # a seeded rng shared with other schedules is untouched
