"""The re-registration and per-id retry schedules (pure: time is passed in, jitter is seeded)."""

from __future__ import annotations

import random

import pytest

from changefeed.listener import BackoffPolicy, ListenerConfigError, ListenerError
from changefeed.listener._backoff import DEFAULT_ITEM_BACKOFF, Backoff, ItemBackoff


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
    backoff = Backoff(BackoffPolicy(initial=0.8, maximum=30.0), random.Random(1))
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
        delay, ceiling = policy.delay(failures, rng)
        assert ceiling * (1 - jitter) - 1e-9 <= delay <= ceiling + 1e-9
    assert BackoffPolicy(initial=1.0, jitter=0.0).delay(3, rng) == (4.0, 4.0)


def test_seeded_schedules_are_reproducible() -> None:
    def run(seed: int) -> list[float]:
        backoff = Backoff(BackoffPolicy(initial=0.1, maximum=5.0), random.Random(seed))
        return [backoff.failure(now=float(i)) for i in range(12)]

    assert run(3) == run(3)
    assert run(3) != run(4)


def test_reset_after_a_healthy_period() -> None:
    backoff = Backoff(BackoffPolicy(initial=1.0, maximum=64.0, reset_after=120.0), random.Random())
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
    backoff = Backoff(BackoffPolicy(initial=1.0, reset_after=10.0))
    backoff.failure(now=0.0)
    backoff.healthy(now=1.0)
    backoff.healthy(now=9.0)  # a second call does not restart the healthy period
    backoff.failure(now=11.0)
    assert backoff.failures == 1 and backoff.resets == 1


def test_explicit_reset() -> None:
    backoff = Backoff(BackoffPolicy(initial=1.0))
    backoff.failure(now=0.0)
    backoff.failure(now=0.0)
    backoff.reset()
    assert (backoff.failures, backoff.delay, backoff.ceiling) == (0, 0.0, 0.0)


def test_item_backoff_is_per_key_and_forgotten_on_success() -> None:
    items = ItemBackoff(BackoffPolicy(initial=0.01, maximum=1.0, jitter=0.0))
    assert [items.failure("a") for _ in range(4)] == pytest.approx([0.01, 0.02, 0.04, 0.08])
    assert items.failure("b") == pytest.approx(0.01)
    assert items.failures("a") == 4 and len(items) == 2
    items.forget("a")
    assert items.failures("a") == 0
    assert items.failure("a") == pytest.approx(0.01)
    assert [items.failure("c") for _ in range(12)][-1] == 1.0  # capped


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
