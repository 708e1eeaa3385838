"""The compaction job's progress reporting without Spark: the meter's arithmetic, the
Spark task tally, the log lines and their bounded rate, and the terminal bars."""

from __future__ import annotations

import io
import logging
import re
from collections.abc import Iterator

import pytest
from helpers import LogRecords

from changefeed.compaction import LogProgress, NullProgress, Progress
from changefeed.compaction.progress import Meter
from changefeed.compaction.progress_rich import RichProgress
from changefeed.compaction.sparkwatch import StageState, TaskTally


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


# --------------------------------------------------------------------------- the meter


def test_meter_done_of_total_rate_and_time_left() -> None:
    meter = Meter("apply-gc", "entries", started=10.0, total=1000)
    assert meter.fraction() == 0.0 and meter.seconds_left(10.0) is None  # no rate yet
    meter.advance(250)
    assert meter.rate(15.0) == 50.0
    assert meter.seconds_left(15.0) == 15.0  # 750 left at 50/s
    assert meter.fields(15.0) == {
        "phase": "apply-gc",
        "done": 250,
        "total": 1000,
        "unit": "entries",
        "percent": 25.0,
        "rate": 50.0,
        "seconds_left": 15.0,
        "seconds": 5.0,
    }
    meter.advance(750)
    assert meter.fraction() == 1.0 and meter.seconds_left(30.0) == 0.0


def test_meter_without_a_total_and_with_nothing_to_do() -> None:
    step = Meter("lock", None, started=0.0)
    assert step.fields(2.0) == {"phase": "lock", "seconds": 2.0}
    unknown = Meter("scan-gc", "tasks", started=0.0)
    unknown.advance(3)
    assert unknown.fraction() is None and unknown.seconds_left(1.0) is None
    assert unknown.fields(1.0)["percent"] is None
    unknown.add_total(4)
    unknown.add_total(2)
    assert unknown.total == 6 and unknown.fraction() == 0.5
    empty = Meter("apply-keep", "entries", started=0.0, total=0)
    assert empty.fraction() == 1.0 and empty.seconds_left(0.0) == 0.0


def test_null_progress_is_a_progress() -> None:
    progress: Progress = NullProgress()
    progress.phase("lock")
    progress.advance(1)
    progress.add_total(1)
    progress.end_phase()
    progress.note("done", {})


# --------------------------------------------------------------------------- Spark's tasks


def test_task_tally_counts_stages_that_ran_once_and_skips_skipped_ones() -> None:
    tally = TaskTally()
    # Adaptive execution: the scan's map stage runs first; the job after it
    # lists that stage again (skipped: 0 completed, never active) and a new one.
    assert tally.update([StageState(0, 7, 0, active=False)]) == (0, 0)  # pending
    assert tally.update([StageState(0, 7, 3, active=True)]) == (7, 3)
    assert tally.update([StageState(0, 7, 7, active=False)]) == (0, 4)
    assert tally.update(
        [
            StageState(0, 7, 7, active=False),
            StageState(1, 7, 0, active=False),  # skipped
            StageState(2, 3, 0, active=True),
        ]
    ) == (3, 0)
    assert tally.update([StageState(1, 7, 0, active=False), StageState(2, 3, 3, False)]) == (0, 3)
    assert tally.update([StageState(2, 3, 3, False)]) == (0, 0)  # nothing twice


def test_task_tally_sees_a_stage_that_ran_between_two_reads() -> None:
    tally = TaskTally()
    assert tally.update([StageState(5, 4, 4, active=False)]) == (4, 4)
    # A count never exceeds the stage's tasks (a speculative copy finishing too).
    assert tally.update([StageState(6, 2, 3, active=False)]) == (2, 2)


# --------------------------------------------------------------------------- log lines


@pytest.fixture
def logged() -> Iterator[tuple[logging.Logger, LogRecords]]:
    """A logger of its own, and what reaches it."""
    logger = logging.getLogger("changefeed.compaction.test")
    records = LogRecords()
    logger.addHandler(records)
    logger.setLevel(logging.INFO)
    logger.propagate = False
    try:
        yield logger, records
    finally:
        logger.removeHandler(records)


def fields_of(records: list[logging.LogRecord]) -> list[tuple[str, dict[str, object]]]:
    return [(r.getMessage(), dict(getattr(r, "cf_fields", {}))) for r in records]


def test_log_progress_lines_at_a_bounded_rate(
    logged: tuple[logging.Logger, LogRecords],
) -> None:
    logger, records = logged
    clock = Clock()
    progress = LogProgress(interval=10.0, logger=logger, clock=clock)
    progress.phase("apply-gc", 10_000, "entries")
    for _ in range(100):  # 100 batches over 25 s: a line every 10 s, not 100
        clock.now += 0.25
        progress.advance(100)
    progress.end_phase()
    progress.note("done", {"collected": 10_000})
    lines = fields_of(records.records)
    assert [event for event, _ in lines] == [
        "compaction.phase_started",
        "compaction.progress",
        "compaction.progress",
        "compaction.phase_finished",
        "compaction.done",
    ]
    assert lines[0][1] == {"phase": "apply-gc", "total": 10_000, "unit": "entries"}
    first = lines[1][1]
    assert (first["done"], first["total"], first["percent"]) == (4000, 10_000, 40.0)
    assert (first["rate"], first["seconds_left"]) == (400.0, 15.0)
    finished = lines[3][1]
    assert (finished["done"], finished["total"], finished["percent"]) == (10_000, 10_000, 100.0)
    assert finished["seconds"] == 25.0
    assert lines[4][1] == {"collected": 10_000}


def test_log_progress_a_new_phase_ends_the_last_one(
    logged: tuple[logging.Logger, LogRecords],
) -> None:
    logger, records = logged
    progress = LogProgress(logger=logger, clock=Clock())
    progress.phase("scan-gc", unit="tasks")
    progress.add_total(5)
    progress.advance(5)
    progress.phase("count")
    progress.end_phase()
    progress.end_phase()  # nothing more
    lines = fields_of(records.records)
    assert [event for event, _ in lines] == [
        "compaction.phase_started",
        "compaction.phase_finished",
        "compaction.phase_started",
        "compaction.phase_finished",
    ]
    assert lines[0][1] == {"phase": "scan-gc", "total": None, "unit": "tasks"}
    assert lines[1][1]["done"] == lines[1][1]["total"] == 5
    assert lines[1][1]["unit"] == "tasks"
    # A step that counts nothing says so: no count, no rate.
    assert lines[2][1] == {"phase": "count"}
    assert lines[3][1] == {"phase": "count", "seconds": 0.0}


# --------------------------------------------------------------------------- terminal bars

ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


def test_rich_bars_end_full_with_counts_rates_and_done() -> None:
    out = io.StringIO()
    from rich.console import Console

    with RichProgress(Console(file=out, force_terminal=True, width=140)) as bars:
        bars.phase("lock")
        bars.phase("scan-gc", unit="tasks")
        bars.add_total(7)
        bars.advance(7)
        bars.phase("scan-merge", unit="tasks")  # Spark's tracker never answered
        bars.phase("apply-gc", 1200, "entries")
        for _ in range(4):
            bars.advance(300)
        bars.phase("apply-keep", 0, "entries")
        bars.phase("apply-merge", 900, "entries")
        bars.advance(600)  # left part-way, as by an error
    text = ANSI.sub("", out.getvalue())
    final = {}
    for line in re.split(r"[\r\n]", text):
        words = line.split()
        if words:
            final[words[0]] = line
    assert re.search(r"lock\s+━+\s+done", final["lock"])
    assert re.search(r"scan-merge\s+━+\s+done", final["scan-merge"])
    assert re.search(r"7/7 tasks\s+100%", final["scan-gc"])
    assert re.search(r"1,200/1,200 entries\s+100%\s+[\d,.]+ entries/s", final["apply-gc"])
    assert re.search(r"0/0 entries\s+100%", final["apply-keep"])
    assert re.search(r"600/900 entries\s+67%", final["apply-merge"])


@pytest.mark.parametrize("mode", ["log", "bar"])
def test_cli_parser_knows_the_progress_modes(mode: str) -> None:
    from changefeed.cli import _parser

    args = _parser().parse_args(
        ["compact", "--progress", mode, "--batch-size", "50", "--partitions", "3"]
    )
    assert (args.progress, args.batch_size, args.partitions) == (mode, 50, 3)


def test_cli_parser_knows_full_runs_and_the_replay_wait() -> None:
    from changefeed.cli import _parser

    args = _parser().parse_args(["compact", "--full", "--replay-wait", "2m"])
    assert (args.full, args.replay_wait) == (True, "2m")
    plain = _parser().parse_args(["compact"])
    assert (plain.full, plain.replay_wait) == (False, "60s")
