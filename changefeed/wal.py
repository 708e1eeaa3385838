"""WAL positions: how far a standby must replay to hold what a primary has written.

A standby is waited for by the publishers that read it (a cursor issued on a
fresher server) and by the compaction job (its widened keepers, before any
drop). Both ask the primary the same question, answered here once: the
position a standby's ``pg_last_wal_replay_lsn()`` (or the primary's
``pg_stat_replication.replay_lsn``) must reach to hold every record inserted
so far. It is the WAL **insert** position, not ``pg_current_wal_lsn()`` (the
write position): with ``synchronous_commit`` off a committed transaction's
records may not be written yet, and a target below them would be reached
before they are replayed.
"""

from __future__ import annotations

from changefeed.schemas import PgConnection

__all__ = ["format_lsn", "insert_target", "parse_lsn", "replay_target"]

_LONG_PAGE_HEADER = 40
"""Bytes of the longest WAL page header (a segment's first page; others have 24)."""


def parse_lsn(text: str) -> int:
    """A WAL position from PostgreSQL's ``X/Y`` notation."""
    high, _, low = text.partition("/")
    return (int(high, 16) << 32) | int(low, 16)


def format_lsn(lsn: int) -> str:
    """A WAL position in PostgreSQL's ``X/Y`` notation."""
    return f"{lsn >> 32:X}/{lsn & 0xFFFFFFFF:X}"


def replay_target(insert_lsn: int, block_size: int) -> int:
    """The replay position a standby must reach to have every record inserted before
    ``insert_lsn`` (``pg_current_wal_insert_lsn()``).

    A standby reports the end of the last record it replayed. The insert position
    right after a record that filled its WAL page to the end is past the next
    page's header instead, where no record ends: a standby that has replayed
    everything would wait for it until some other record is written. No record
    ends inside a page header, so the page's start is the same target.
    """
    offset = insert_lsn % block_size
    return insert_lsn - offset if offset <= _LONG_PAGE_HEADER else insert_lsn


async def insert_target(conn: PgConnection) -> str:
    """The replay target (``replay_target``), in ``X/Y`` notation, covering every
    record ``conn``'s server (a primary) had inserted when this was asked."""
    row = await conn.fetchrow(
        "SELECT pg_current_wal_insert_lsn()::text AS lsn,"
        " current_setting('wal_block_size')::int AS block"
    )
    assert row is not None
    return format_lsn(replay_target(parse_lsn(row["lsn"]), row["block"]))
