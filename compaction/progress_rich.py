"""The compaction job's progress as bars on a terminal (rich), one line per phase.

A line shows the phase, its bar, done of total with the unit, the percentage,
the rate, the time left (while it runs) and the time spent::

    apply-gc     ━━━━━━━╸━━━━━━━  3,000/6,000 entries  50% 1,480 entries/s 0:00:02 0:00:02

A phase whose size the job cannot know (taking the lock, the snapshot,
starting Spark, counting the plan) pulses while it runs and reads ``done``
once it is over. The job's notes are not shown: the summary printed after the
run says the same. Needs ``rich`` (part of the ``spark`` extra).
"""

from __future__ import annotations

from collections.abc import Mapping
from types import TracebackType
from typing import Any

from rich.console import Console
from rich.progress import (
    BarColumn,
    ProgressColumn,
    Task,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
)
from rich.progress import Progress as Bars
from rich.text import Text

__all__ = ["RichProgress"]


def _counted(task: Task) -> bool:
    return task.total is not None and task.fields.get("unit") is not None


class _CountColumn(ProgressColumn):
    """``3,000/6,000 entries``; ``done`` for a phase without a count once it is over."""

    def render(self, task: Task) -> Text:
        unit = task.fields.get("unit", "")
        if _counted(task):
            return Text(f"{int(task.completed):,}/{int(task.total or 0):,} {unit}")
        return Text("done" if task.finished else "", style="progress.elapsed")


class _PercentColumn(ProgressColumn):
    def render(self, task: Task) -> Text:
        if not _counted(task):
            return Text("")
        percent = 100.0 if task.total == 0 else task.percentage
        return Text(f"{percent:>3.0f}%", style="progress.percentage")


class _RateColumn(ProgressColumn):
    """Units per second over rich's recent window (the last 30 s), or since the
    phase began while that window holds a single step."""

    def render(self, task: Task) -> Text:
        speed = task.finished_speed or task.speed
        if speed is None and task.completed and task.elapsed:
            speed = task.completed / task.elapsed
        if not _counted(task) or speed is None:
            return Text("")
        shown = f"{speed:,.1f}" if speed < 10 else f"{speed:,.0f}"
        return Text(f"{shown} {task.fields.get('unit', '')}/s", style="progress.data.speed")


class _LeftColumn(ProgressColumn):
    """Time left at the recent rate, while a counted phase runs (rich's own column
    caches its text for half a second, which can leave a stale last frame)."""

    def render(self, task: Task) -> Text:
        if not _counted(task) or task.finished:
            return Text("")
        left = task.time_remaining
        if left is None:
            return Text("-:--:--", style="progress.remaining")
        minutes, seconds = divmod(int(left), 60)
        hours, minutes = divmod(minutes, 60)
        return Text(f"{hours:d}:{minutes:02d}:{seconds:02d}", style="progress.remaining")


class RichProgress:
    """A ``Progress`` that draws bars; use it as a context manager around the run.

    Args:
        console: where to draw (default: a console on stderr).
    """

    def __init__(self, console: Console | None = None) -> None:
        self._bars = Bars(
            TextColumn("{task.description:<17}"),
            BarColumn(bar_width=30),
            _CountColumn(),
            _PercentColumn(),
            _RateColumn(),
            _LeftColumn(),
            TimeElapsedColumn(),
            console=console or Console(stderr=True),
        )
        self._task: TaskID | None = None

    def __enter__(self) -> RichProgress:
        self._bars.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def close(self) -> None:
        """End the current phase and stop drawing (the last frame stays on the terminal)."""
        self.end_phase()
        self._bars.stop()

    def phase(self, name: str, total: int | None = None, unit: str | None = None) -> None:
        self.end_phase()
        self._task = self._bars.add_task(name, total=total, unit=unit)

    def advance(self, n: int) -> None:
        if self._task is not None:
            self._bars.advance(self._task, n)

    def add_total(self, n: int) -> None:
        if self._task is None:
            return
        total = self._get(self._task).total or 0
        self._bars.update(self._task, total=total + n)

    def end_phase(self) -> None:
        if self._task is None:
            return
        task_id, self._task = self._task, None
        if _counted(self._get(task_id)):
            self._bars.update(task_id)  # marks it finished if all is done (even 0 of 0)
        else:  # a step, or a count that never got a total: a full bar reading ``done``
            self._bars.update(task_id, total=1, completed=1, unit=None)
        self._bars.stop_task(task_id)
        self._bars.refresh()

    def note(self, event: str, fields: Mapping[str, Any]) -> None:
        pass

    def _get(self, task_id: TaskID) -> Task:
        return next(t for t in self._bars.tasks if t.id == task_id)
