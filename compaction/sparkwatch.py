"""Spark's own progress, told to the job's ``Progress``: tasks done of tasks planned.

A phase's Spark actions run under a job group of their own; a thread reads
Spark's status tracker (the driver's bookkeeping: no network, no executor)
a few times a second and turns what it sees into ``add_total`` and
``advance`` calls. Spark plans stages as it goes (adaptive execution submits
them one by one), so the phase's total grows as stages start.

``TaskTally`` is the pure part: a stage counts once it has run (it is active,
or has completed tasks), so a stage Spark skipped because it could reuse
shuffle output never counts, and no stage counts twice.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import uuid
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from changefeed.logs import log_event

from .progress import Progress

__all__ = ["POLL_INTERVAL", "StageState", "TaskTally", "watch_spark"]

POLL_INTERVAL = 0.25
"""Seconds between two reads of Spark's status tracker."""

_GROUP_PROPERTIES = ("spark.jobGroup.id", "spark.job.description", "spark.job.interruptOnCancel")

_log = logging.getLogger("changefeed.compaction")


@dataclass(frozen=True, slots=True)
class StageState:
    """One stage as the status tracker shows it."""

    stage_id: int
    tasks: int
    completed: int
    active: bool


class TaskTally:
    """Tasks planned and done in the stages seen so far."""

    def __init__(self) -> None:
        self._stages: dict[int, tuple[int, int]] = {}  # stage id -> (tasks, completed)

    def update(self, stages: Iterable[StageState]) -> tuple[int, int]:
        """Take in what the tracker shows now.

        Returns:
            (tasks planned, tasks done) since the last call.
        """
        planned = done = 0
        for stage in stages:
            known = self._stages.get(stage.stage_id)
            if known is None:
                if not (stage.active or stage.completed):
                    continue  # pending, or skipped: not (yet) work
                known = (stage.tasks, 0)
                planned += stage.tasks
            tasks, completed = known
            now = min(stage.completed, tasks)
            if now > completed:
                done += now - completed
            self._stages[stage.stage_id] = (tasks, max(now, completed))
        return planned, done


def _stages(tracker: Any, group: str) -> Iterator[StageState]:
    active = set(tracker.getActiveStageIds())
    for job_id in tracker.getJobIdsForGroup(group):
        job = tracker.getJobInfo(job_id)
        for stage_id in job.stageIds if job is not None else ():
            info = tracker.getStageInfo(stage_id)
            if info is not None:
                yield StageState(
                    stage_id, info.numTasks, info.numCompletedTasks, stage_id in active
                )


@contextlib.contextmanager
def watch_spark(spark: Any, progress: Progress, interval: float = POLL_INTERVAL) -> Iterator[None]:
    """Report the Spark tasks of the actions run in this block (from this thread).

    The block's actions run under a job group of their own; the thread's
    previous job group is restored afterwards (a session handed to the job is
    left as it was). After the block, one last read reports the stages'
    final counts.
    """
    context = spark.sparkContext
    saved = {key: context.getLocalProperty(key) for key in _GROUP_PROPERTIES}
    group = f"changefeed-compaction-{uuid.uuid4().hex}"
    context.setJobGroup(group, "changefeed compaction")
    tracker = context.statusTracker()
    tally = TaskTally()
    stop = threading.Event()

    def report() -> None:
        planned, done = tally.update(_stages(tracker, group))
        if planned:
            progress.add_total(planned)
        if done:
            progress.advance(done)

    def watch() -> None:
        while not stop.wait(interval):
            try:
                report()
            except Exception as exc:  # best effort: the progress must never fail the job
                log_event(_log, "compaction.spark_status_unreadable", logging.DEBUG, exc=exc)
                return

    watcher = threading.Thread(target=watch, name="changefeed-compaction-progress", daemon=True)
    watcher.start()
    try:
        yield
    finally:
        stop.set()
        watcher.join()
        with contextlib.suppress(Exception):
            report()
        for key, value in saved.items():
            context.setLocalProperty(key, value)  # None removes it
