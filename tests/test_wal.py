"""WAL positions (changefeed.wal): the replay target a standby must reach."""

from __future__ import annotations

import pytest

from changefeed.wal import format_lsn, parse_lsn, replay_target

BLOCK = 8192


@pytest.mark.parametrize("text", ["0/0", "0/16B3740", "1/0", "FFFFFFFF/FFFFFFFF", "2A/E0000028"])
def test_positions_read_and_write_postgresqls_notation(text: str) -> None:
    assert format_lsn(parse_lsn(text)) == text


def test_high_and_low_halves() -> None:
    assert parse_lsn("1/10") == (1 << 32) | 0x10


@pytest.mark.parametrize(
    ("insert", "target"),
    [
        (5 * BLOCK, 5 * BLOCK),  # at a page's start: that is where the last record ended
        (5 * BLOCK + 24, 5 * BLOCK),  # past a page header: no record ends inside one
        (5 * BLOCK + 40, 5 * BLOCK),  # past a segment's first, longer page header
        (5 * BLOCK + 41, 5 * BLOCK + 41),  # inside a record's bytes: the position itself
        (6 * BLOCK - 1, 6 * BLOCK - 1),
    ],
)
def test_a_target_past_a_page_header_is_the_pages_start(insert: int, target: int) -> None:
    """A standby reports the end of the last record it replayed; the insert position
    after a record that filled its page is past the next page's header, where a
    standby that replayed everything would never report being."""
    assert replay_target(insert, BLOCK) == target
