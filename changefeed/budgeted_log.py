"""A ``LogBudget`` on an event loop: which lines to write now, and a summary of the rest.

``log_budget.LogBudget`` is the rule, with no clock and no I/O. ``BudgetedLines``
gives it both: it asks the budget with the monotonic clock, writes what an
ended window held back as one summary event, and schedules that summary on
the loop for when the window ends, so that a burst with nothing after it is
still reported.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time

from changefeed.log_budget import LogBudget
from changefeed.logs import log_event

__all__ = ["BudgetedLines"]


class BudgetedLines:
    """Lines under ``budget``: ``due`` says whether one may be written now; what the
    budget holds back goes out as one ``summary_event`` on ``log`` when its window
    ends.

    Not thread-safe: every ``due`` of one instance comes from one event loop.
    """

    __slots__ = ("_budget", "_level", "_log", "_summary_event", "_timer")

    def __init__(
        self,
        budget: LogBudget,
        log: logging.Logger,
        summary_event: str,
        level: int = logging.INFO,
    ) -> None:
        self._budget = budget
        self._log = log
        self._summary_event = summary_event
        self._level = level
        """The summary's level: that of the lines it stands for, so that a log that
        shows them shows it too."""
        self._timer: asyncio.TimerHandle | None = None

    def due(self, kind: str, loop: asyncio.AbstractEventLoop | None) -> bool:
        """A line of ``kind`` is due: whether to write it now (the caller does).

        Args:
            loop: where to schedule the held lines' summary; None writes it only
                when a later line or ``flush`` comes.
        """
        write, ended = self._budget.note(time.monotonic(), kind)
        if ended is not None:
            self._write_summary(ended)
        if not write and self._timer is None and loop is not None:
            self._schedule(loop)
        return write

    def flush(self) -> None:
        """Write the summary of what is held now, ending the window early (at shutdown)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        held = self._budget.close(math.inf)
        if held is not None:
            self._write_summary(held)

    def _schedule(self, loop: asyncio.AbstractEventLoop) -> None:
        """Write the summary when the window ends, even if no line comes after it
        (should this loop stop first, the next line or ``flush`` writes it)."""
        ends = self._budget.ends
        if ends is not None and not loop.is_closed():
            # A little late rather than early: the loop may run a timer before its time.
            delay = max(0.0, ends - time.monotonic()) + 0.01
            self._timer = loop.call_later(delay, self._window_ended, loop)

    def _window_ended(self, loop: asyncio.AbstractEventLoop) -> None:
        self._timer = None
        held = self._budget.close(time.monotonic())
        if held is not None:
            self._write_summary(held)
        elif self._budget.ends is not None:
            self._schedule(loop)  # woken early

    def _write_summary(self, held: dict[str, int]) -> None:
        log_event(
            self._log,
            self._summary_event,
            self._level,
            window=self._budget.window,
            logged=self._budget.burst,
            held=dict(sorted(held.items())),
        )
