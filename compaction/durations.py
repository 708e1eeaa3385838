"""Durations as the job's command lines spell them: ``90``, ``500ms``, ``10m``, ``24h``, ``7d``.

The same spelling as the publisher's configuration; kept here so that the job
(and ``spark-submit``'s entry script) never imports the publisher. Pure code.
"""

from __future__ import annotations

import re

from .errors import CompactionError

__all__ = ["format_duration", "parse_duration"]

_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h|d)?\s*$")
_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, None: 1.0}


def parse_duration(text: str, name: str = "duration") -> float:
    """Seconds from ``text``, a number with an optional unit (ms, s, m, h, d).

    Raises:
        CompactionError: not such a number (the message names ``name``).
    """
    match = _DURATION.match(text)
    if match is None:
        raise CompactionError(
            f'{name}: expected a duration such as 30, "500ms", "10m" or "24h", got {text!r}'
        )
    return float(match.group(1)) * _UNITS[match.group(2)]


def format_duration(seconds: float) -> str:
    """``86400`` -> ``"1d"``, ``600`` -> ``"10m"``, ``90`` -> ``"90s"``: the largest whole unit."""
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size and seconds % size == 0:
            return f"{int(seconds // size)}{unit}"
    return f"{seconds:g}s"
