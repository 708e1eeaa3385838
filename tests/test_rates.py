"""RateHistory: one reading per interval, rates over the monotonic clock, a bounded ring."""

from __future__ import annotations

import pytest

from changefeed.publisher.rates import RateHistory

WALL = 1_700_000_000.0


def test_one_reading_per_interval_and_rates_from_the_difference() -> None:
    history = RateHistory(interval=5.0, span=600.0)
    assert history.observe(100.0, WALL, {"entries": 0, "deliveries": 0})
    # Later calls in the same 5-second slot are not kept.
    assert not history.observe(101.0, WALL + 1, {"entries": 7, "deliveries": 70})
    assert not history.observe(104.9, WALL + 4.9, {"entries": 9, "deliveries": 90})
    assert history.observe(105.0, WALL + 5, {"entries": 50, "deliveries": 500})
    assert history.to_json() == {
        "intervalSeconds": 5.0,
        "spanSeconds": 600.0,
        "samples": [
            {
                "at": "2023-11-14T22:13:25.000Z",
                "seconds": 5.0,
                "entriesPerSecond": 10.0,
                "deliveriesPerSecond": 100.0,
            }
        ],
    }


def test_a_late_reading_spreads_its_increase_over_the_time_it_really_took() -> None:
    history = RateHistory(interval=5.0)
    history.observe(100.0, WALL, {"entries": 0})
    # The caller was held up: the next reading comes 12 s later, two slots skipped.
    history.observe(112.0, WALL + 12, {"entries": 120})
    (sample,) = history.samples()
    assert sample.seconds == 12.0
    assert sample.per_second == {"entries": 10.0}


def test_the_wall_clock_only_labels_the_samples() -> None:
    history = RateHistory(interval=1.0)
    history.observe(10.0, WALL, {"entries": 0})
    # NTP stepped the wall clock back an hour: the rate is still over 2 monotonic seconds.
    history.observe(12.0, WALL - 3600, {"entries": 8})
    (sample,) = history.samples()
    assert sample.per_second == {"entries": 4.0}
    assert sample.at == WALL - 3600


def test_a_counter_that_went_down_was_reset_and_counts_from_zero() -> None:
    history = RateHistory(interval=1.0)
    history.observe(0.0, WALL, {"entries": 1000, "evictions": 0})
    history.observe(2.0, WALL + 2, {"entries": 10, "evictions": 0})
    (sample,) = history.samples()
    assert sample.per_second == {"entries": 5.0, "evictions": 0.0}


def test_a_counter_seen_first_in_a_later_reading_counts_from_zero() -> None:
    history = RateHistory(interval=1.0)
    history.observe(0.0, WALL, {"entries": 0})
    history.observe(1.0, WALL + 1, {"entries": 3, "evictions": 2})
    assert history.samples()[0].per_second == {"entries": 3.0, "evictions": 2.0}


def test_the_ring_keeps_span_seconds_and_drops_the_oldest() -> None:
    history = RateHistory(interval=5.0, span=60.0)
    for step in range(100):
        history.observe(step * 5.0, WALL + step * 5.0, {"entries": step * step})
    samples = history.samples()
    assert len(samples) == 12  # 60 s of 5-second rates
    # The newest rates: readings 98 -> 99 (196 entries in 5 s), oldest kept: 87 -> 88.
    assert samples[-1].per_second["entries"] == (99 * 99 - 98 * 98) / 5
    assert samples[0].per_second["entries"] == (88 * 88 - 87 * 87) / 5
    assert [s.at for s in samples] == [WALL + step * 5.0 for step in range(88, 100)]


def test_no_rate_before_the_second_reading() -> None:
    history = RateHistory()
    assert history.to_json()["samples"] == []
    history.observe(0.0, WALL, {"entries": 5})
    assert history.samples() == []


@pytest.mark.parametrize(("interval", "span"), [(0.0, 60.0), (-1.0, 60.0), (10.0, 5.0)])
def test_a_nonsensical_interval_or_span_is_refused(interval: float, span: float) -> None:
    with pytest.raises(ValueError, match="interval"):
        RateHistory(interval=interval, span=span)
