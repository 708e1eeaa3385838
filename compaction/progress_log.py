"""The compaction job's progress as structured log lines (``changefeed.logs``), at a bounded rate.

For a job whose output is not a terminal (a timer, a CronJob, ``spark-submit``):

* ``compaction.phase_started`` -- phase, and for a phase that counts: total
  (None while unknown) and unit;
* ``compaction.progress`` -- phase, done, total, unit, percent, rate (units/s
  since the phase began), seconds_left, seconds: at most one line per
  ``interval`` seconds, however many batches or Spark tasks finish in between;
* ``compaction.phase_finished`` -- the same facts when the phase ends (for a
  step that counts nothing: phase and seconds);
* ``compaction.<note>`` -- the job's notes (``start``, ``snapshot``,
  ``planned``, ``done``) with their fields.

Lines go to the ``changefeed.compaction`` logger at INFO.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from typing import Any

from changefeed.logs import log_event

from .progress import Meter

__all__ = ["DEFAULT_INTERVAL", "LogProgress"]

DEFAULT_INTERVAL = 10.0
"""Seconds between two ``compaction.progress`` lines of one phase."""

_log = logging.getLogger("changefeed.compaction")


class LogProgress:
    """A ``Progress`` that logs.

    Args:
        interval: at least this many seconds between two progress lines.
        logger: where the lines go (default ``changefeed.compaction``).
        clock: monotonic seconds (a test passes its own).
    """

    def __init__(
        self,
        interval: float = DEFAULT_INTERVAL,
        logger: logging.Logger | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.interval = interval
        self.logger = logger or _log
        self.clock = clock
        self._meter: Meter | None = None
        self._logged = 0.0

    def phase(self, name: str, total: int | None = None, unit: str | None = None) -> None:
        self.end_phase()
        now = self.clock()
        self._meter = Meter(name, unit, now, total)
        self._logged = now
        counts: dict[str, Any] = {} if unit is None else {"total": total, "unit": unit}
        log_event(self.logger, "compaction.phase_started", phase=name, **counts)

    def advance(self, n: int) -> None:
        if self._meter is None:
            return
        self._meter.advance(n)
        now = self.clock()
        if now - self._logged >= self.interval:
            self._logged = now
            log_event(self.logger, "compaction.progress", **self._meter.fields(now))

    def add_total(self, n: int) -> None:
        if self._meter is not None:
            self._meter.add_total(n)

    def end_phase(self) -> None:
        meter, self._meter = self._meter, None
        if meter is not None:
            log_event(self.logger, "compaction.phase_finished", **meter.fields(self.clock()))

    def note(self, event: str, fields: Mapping[str, Any]) -> None:
        log_event(self.logger, f"compaction.{event}", **fields)
