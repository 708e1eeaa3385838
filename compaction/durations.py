"""Durations as the job's command lines spell them (``changefeed.durations``), with the
job's errors. Pure code."""

from __future__ import annotations

from changefeed.durations import format_duration, seconds_of, too_long

from .errors import CompactionError

__all__ = ["format_duration", "parse_duration"]


def parse_duration(text: str, name: str = "duration") -> float:
    """Seconds from ``text``, a number with an optional unit (ms, s, m, h, d).

    Raises:
        CompactionError: not such a number, or over the ceiling (the message names
            ``name``).
    """
    seconds = seconds_of(text)
    if seconds is None:
        raise CompactionError(
            f'{name}: expected a duration such as 30, "500ms", "10m" or "24h", got {text!r}'
        )
    if (why := too_long(seconds)) is not None:
        raise CompactionError(f"{name}: {why}")
    return seconds
