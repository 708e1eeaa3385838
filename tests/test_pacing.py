"""The pace of a tailer on a standby (publisher/pacing.py): pure, on a made-up clock."""

from __future__ import annotations

import pytest

from changefeed.publisher.pacing import (
    FOLLOW_EVERY,
    FOLLOW_FOR,
    REST_AFTER,
    REST_RATE,
    StandbyPacing,
)

POLL = 0.5


def test_a_rung_transaction_is_read_for_at_once_then_sooner_than_the_poll() -> None:
    pacing = StandbyPacing(POLL)
    pacing.rung(100, now=0.0)
    assert pacing.read(horizon=100, found=False, now=0.0) is None  # not replayed yet
    assert [pacing.delay() for _ in range(8)] == [
        0.0,
        0.001,
        0.002,
        0.004,
        0.008,
        0.016,
        0.032,
        0.032,
    ]
    pacing.read(horizon=101, found=True, now=0.01)  # replayed: 100 is below the horizon
    assert pacing.delay() == POLL
    assert pacing.replay_waits == 8


def test_a_transaction_is_awaited_at_most_a_poll_interval() -> None:
    pacing = StandbyPacing(POLL)
    pacing.rung(100, now=0.0)
    pacing.read(horizon=50, found=False, now=POLL - 0.01)
    assert pacing.awaited
    pacing.read(horizon=50, found=False, now=POLL + 0.01)  # a long open writer holds it back
    assert not pacing.awaited and pacing.delay() == POLL


def test_a_ring_without_a_transaction_only_wakes() -> None:
    pacing = StandbyPacing(POLL)
    pacing.rung(None, now=0.0)
    assert not pacing.awaited and pacing.delay() == POLL


def flow(pacing: StandbyPacing, start: float, seconds: float, rate: float) -> list[bool]:
    """Rings at ``rate`` a second for ``seconds``, each followed by a read that finds
    its entry; the changes of rest the pacing asked for."""
    asked = []
    n = int(seconds * rate)
    for i in range(n):
        now = start + i / rate
        pacing.rung(i, now)
        wish = pacing.read(horizon=i + 1, found=True, now=now)
        if wish is not None:
            asked.append(wish)
    return asked


def test_the_doorbell_rests_while_a_busy_feed_flows_and_listens_once_it_is_quiet() -> None:
    pacing = StandbyPacing(POLL)
    assert flow(pacing, 0.0, REST_AFTER + 0.1, rate=2 * REST_RATE) == [True]
    assert pacing.resting and pacing.rests == 1
    assert pacing.delay() == FOLLOW_EVERY  # reads on its own meanwhile
    now = REST_AFTER + 0.1
    assert pacing.read(horizon=None, found=False, now=now + FOLLOW_FOR / 2) is None
    assert pacing.read(horizon=None, found=False, now=now + FOLLOW_FOR) is False
    assert not pacing.resting and pacing.delay() == POLL


def test_a_slow_feed_keeps_its_doorbell() -> None:
    """Below REST_RATE rings a second, reading every FOLLOW_EVERY would cost the
    standby more than the rings cost the primary."""
    pacing = StandbyPacing(POLL)
    assert flow(pacing, 0.0, 3 * REST_AFTER, rate=REST_RATE / 2) == []
    assert not pacing.resting


def test_a_gap_restarts_the_flow() -> None:
    pacing = StandbyPacing(POLL)
    assert flow(pacing, 0.0, REST_AFTER * 0.9, rate=2 * REST_RATE) == []
    gap = REST_AFTER * 0.9 + FOLLOW_FOR * 2
    assert flow(pacing, gap, REST_AFTER * 0.9, rate=2 * REST_RATE) == []
    assert not pacing.resting


@pytest.mark.parametrize("payloads", [5000])
def test_awaited_transactions_are_bounded(payloads: int) -> None:
    pacing = StandbyPacing(POLL)
    for txid in range(payloads):
        pacing.rung(txid, now=0.0)
    assert len(pacing.awaited) == 4096


def test_a_ring_the_standby_has_not_replayed_ages_until_a_read_passes_it() -> None:
    """A stalled replay delivers nothing: what shows it is how long the oldest rung
    transaction has waited, kept past the poll interval's hurry, until a horizon passes it."""
    pacing = StandbyPacing(POLL)
    assert pacing.unreplayed_for(now=5.0) == 0.0
    pacing.rung(100, now=1.0)
    pacing.rung(101, now=2.0)
    pacing.rung(100, now=3.0)  # rung again: it has waited since the first ring
    pacing.read(horizon=100, found=False, now=10.0)  # long past the poll's hurry
    assert pacing.awaited == {} and pacing.unreplayed_for(now=10.0) == 9.0
    pacing.read(horizon=None, found=False, now=11.0)  # a horizon not known passes nothing
    assert pacing.unreplayed_for(now=11.0) == 10.0
    pacing.read(horizon=101, found=True, now=12.0)  # 100 replayed; 101 rang at 2.0
    assert pacing.unreplayed_for(now=12.0) == 10.0
    pacing.read(horizon=102, found=True, now=13.0)
    assert pacing.unreplayed_for(now=13.0) == 0.0


def test_a_join_forgets_rings_from_before_it() -> None:
    """Rings of transactions a promoted server never had (lost in a failover) must not
    age into a lag that grows for as long as the feed is quiet."""
    pacing = StandbyPacing(POLL)
    pacing.rung(100, now=1.0)
    pacing.forget()
    assert pacing.awaited == {} and pacing.unreplayed_for(now=60.0) == 0.0
    assert pacing.delay() == POLL
