"""Durations as configuration files and command lines spell them: ``90``, ``500ms``,
``10m``, ``24h``, ``7d``. Pure code.

One spelling and one ceiling for the publisher's configuration and the compaction
job alike. The ceiling, 100 years, keeps a time computed as "now minus the
duration" a date that Python and PostgreSQL can hold: ``800000d`` is a slip of
the keyboard, and must be refused as one rather than fail inside the work.
"""

from __future__ import annotations

import re

__all__ = ["MAX_SECONDS", "MIN_SECONDS", "format_duration", "seconds_of", "too_long"]

MAX_SECONDS = 100 * 365 * 86400.0
"""The longest duration anything takes: 100 years (``36500d``)."""

MIN_SECONDS = 0.001
"""The shortest positive duration a cutoff takes: one millisecond, the smallest
unit spelled. Below a microsecond a duration rounds to nothing on the way to a
timestamp (Python's and PostgreSQL's resolution) and silently means zero, and
between the two none is of use to anyone."""

_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h|d)?\s*$")
_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, None: 1.0}


def seconds_of(text: str) -> float | None:
    """Seconds from ``text``, a number with an optional unit (ms, s, m, h, d); None
    when it is not one. The ceiling is checked apart (``too_long``)."""
    match = _DURATION.match(text)
    if match is None:
        return None
    return float(match.group(1)) * _UNITS[match.group(2)]


def too_long(seconds: float) -> str | None:
    """Why ``seconds`` is over the ceiling, or None."""
    if seconds > MAX_SECONDS:
        return f"must be at most 100 years ({format_duration(MAX_SECONDS)}), got {seconds:g}s"
    return None


def format_duration(seconds: float) -> str:
    """``86400`` -> ``"1d"``, ``600`` -> ``"10m"``, ``90`` -> ``"90s"``: the largest whole unit."""
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size and seconds % size == 0:
            return f"{int(seconds // size)}{unit}"
    return f"{seconds:g}s"
