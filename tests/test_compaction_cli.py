"""``changefeed compact`` end to end: its progress on a terminal and in a log.

The command runs as a child process against a real PostgreSQL, with real
Spark on ``local[2]``: once on a pseudo-terminal, where it must draw a bar per
phase that ends full (N/N, 100%), and once with its output going to pipes,
where it must write plain structured lines with done and total instead.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import glob
import json
import os
import pty
import re
import select
import signal
import struct
import subprocess
import sys
import tempfile
import termios
import time
from typing import Any

import asyncpg
import pytest

pytestmark = pytest.mark.spark

TIMEOUT = 300.0
PHASES = [
    "lock",
    "snapshot",
    "spark",
    "scan-gc",
    "scan-merge+stage",
    "survey",
    "apply-keep",
    "apply-merge",
    "apply-gc",
    "apply-keys",
]
COUNTED = {"scan-gc": "tasks", "scan-merge+stage": "tasks"} | {
    name: "entries" for name in ("apply-gc", "apply-keep", "apply-merge", "apply-keys")
}
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]|\x1b[()][A-Z0-9]")


async def seed(dsn: str) -> None:
    """400 garbage entries (30-40 h old) and 400 merge candidates (2-20 h old) over
    40 resource ids with mixed sub-resources, so every apply phase has work."""
    conn = await asyncpg.connect(dsn)
    try:
        await conn.execute(
            """
            INSERT INTO changefeed.feed (resource, sub_resources, changed_resource_id, published)
            SELECT 'vm',
                   CASE (g / 40) % 4 WHEN 0 THEN ARRAY['nic'] WHEN 1 THEN ARRAY['alias']
                        WHEN 2 THEN ARRAY['disk', 'nic'] ELSE ARRAY['alias'] END,
                   'vm-' || (g % 40),
                   CASE WHEN g < 400 THEN now() - interval '40 hours' + g * interval '90 seconds'
                        ELSE now() - interval '20 hours' + (g - 400) * interval '160 seconds'
                   END
            FROM generate_series(0, 799) AS g
            """
        )
    finally:
        await conn.close()


def command(dsn: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "changefeed.cli",
        "compact",
        "--dsn",
        dsn,
        "--master",
        "local[2]",
        "--max-age",
        "24h",
        "--compaction-lag",
        "1h",
        "--batch-size",
        "50",
    ]


def child_env(**extra: str) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in {"NO_COLOR", "FORCE_COLOR", "TTY_COMPATIBLE", "TTY_INTERACTIVE"}
    }
    return {**env, **extra}


async def start(dsn: str, stdout: int = subprocess.PIPE) -> asyncio.subprocess.Process:
    """``changefeed compact`` on ``dsn``, its stderr a pipe, in a session of its own
    (so that it can be killed as a group)."""
    return await asyncio.create_subprocess_exec(
        *command(dsn),
        stdin=subprocess.DEVNULL,
        stdout=stdout,
        stderr=subprocess.PIPE,
        env=child_env(),
        start_new_session=True,
    )


def run_on_terminal(argv: list[str], columns: int = 160, lines: int = 50) -> tuple[int, str]:
    """Run ``argv`` with a pseudo-terminal as stdin, stdout and stderr; return its
    exit status and everything it wrote to the terminal."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", lines, columns, 0, 0))
    env = child_env(TERM="xterm-256color", COLUMNS=str(columns), LINES=str(lines))
    proc = subprocess.Popen(
        argv, stdin=slave, stdout=slave, stderr=slave, env=env, start_new_session=True
    )
    os.close(slave)
    output = bytearray()
    deadline = time.monotonic() + TIMEOUT
    try:
        while True:
            left = deadline - time.monotonic()
            assert left > 0, f"no end after {TIMEOUT}s: {output[-3000:].decode(errors='replace')}"
            ready, _, _ = select.select([master], [], [], min(left, 1.0))
            if not ready:
                continue
            try:
                data = os.read(master, 65536)
            except OSError:  # EIO: every process holding the terminal has closed it
                break
            if not data:
                break
            output.extend(data)
        status = proc.wait(timeout=60)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # the child's Spark JVM, if still there
        if proc.returncode is None:
            proc.wait()
        os.close(master)
    return status, output.decode(errors="replace")


def final_bars(screen: str) -> dict[str, str]:
    """The last line drawn for each phase (the final frame of its bar)."""
    text = ANSI.sub("", screen)
    last: dict[str, str] = {}
    for line in re.split(r"[\r\n]", text):
        words = line.split()
        if words and words[0] in PHASES and "━" in line:
            last[words[0]] = line
    return last


async def test_on_a_terminal_every_phase_bar_ends_full(feed_dsn: str) -> None:
    await seed(feed_dsn)
    status, screen = await asyncio.to_thread(run_on_terminal, command(feed_dsn))
    assert status == 0, screen[-3000:]
    assert "\x1b[" in screen  # drawn as a live display, not printed as lines
    assert '"event"' not in screen and "compaction.phase_started" not in screen
    assert "compaction of changefeed.feed" in screen  # the summary follows the bars

    bars = final_bars(screen)
    assert list(bars) == PHASES, screen[-3000:]
    for name, line in bars.items():
        if name not in COUNTED:
            assert re.search(r"━\s+done\b", line), line
            continue
        match = re.search(rf"([\d,]+)/([\d,]+) {COUNTED[name]}\s+(\d+)%", line)
        assert match, line
        done, total = (int(g.replace(",", "")) for g in match.group(1, 2))
        assert done == total > 0 and match.group(3) == "100", line
        assert re.search(rf"{COUNTED[name]}/s", line), line  # and a rate


def json_lines(text: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in text.splitlines() if line.startswith("{")]


async def test_without_a_terminal_progress_is_plain_lines_with_done_and_total(
    feed_dsn: str,
) -> None:
    dsn = feed_dsn
    await seed(dsn)
    proc = await asyncio.create_subprocess_exec(
        *command(dsn),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=child_env(TERM="xterm-256color"),
        start_new_session=True,
    )
    try:
        out, err = await asyncio.wait_for(proc.communicate(), TIMEOUT)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        if proc.returncode is None:
            await proc.wait()
    stdout, stderr = out.decode(), err.decode()
    assert proc.returncode == 0, stderr[-3000:]
    assert "\x1b" not in stdout + stderr and "\r" not in stdout + stderr
    assert "━" not in stderr
    assert stdout.startswith("compaction of changefeed.feed")

    lines = [doc for doc in json_lines(stderr) if doc["logger"] == "changefeed.compaction"]
    started = [d["phase"] for d in lines if d["event"] == "compaction.phase_started"]
    finished = {d["phase"]: d for d in lines if d["event"] == "compaction.phase_finished"}
    assert started == PHASES and list(finished) == PHASES
    for name, doc in finished.items():
        if name in COUNTED:
            assert doc["unit"] == COUNTED[name]
            assert doc["done"] == doc["total"] > 0 and doc["percent"] == 100.0, doc
            assert doc["rate"] > 0
        else:
            assert set(doc) >= {"phase", "seconds"} and "total" not in doc, doc
    for doc in lines:
        if doc["event"] == "compaction.progress":
            assert doc["done"] >= 0 and doc["total"] is not None, doc
    planned = next(d for d in lines if d["event"] == "compaction.planned")
    assert planned["garbage"] == finished["apply-gc"]["total"]
    assert planned["drops"] == finished["apply-merge"]["total"]
    done = next(d for d in lines if d["event"] == "compaction.done")
    assert done["collected"] == planned["garbage"] and done["merged"] > 0
    assert done["full"] is True and "run           full (no previous run)" in stdout

    # The next run reads what changed since (nothing here): an incremental run.
    again = await start(dsn)
    try:
        out, err = await asyncio.wait_for(again.communicate(), TIMEOUT)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(again.pid, signal.SIGKILL)
        if again.returncode is None:
            await again.wait()
    assert again.returncode == 0, err.decode()[-3000:]
    assert "run           incremental (after run 1)" in out.decode()
    started = [
        d["phase"] for d in json_lines(err.decode()) if d["event"] == "compaction.phase_started"
    ]
    assert "scan-delta" in started and "scan-gc" not in started


async def test_sigterm_stops_the_run_and_leaves_no_spark_scratch_behind(feed_dsn: str) -> None:
    """SIGTERM (systemd stopping the unit, a CronJob's deadline) unwinds the command like
    Ctrl-C, exiting 143: the session stops and takes Spark's scratch and spill directory
    in /tmp along, rather than the command dying where it stood and leaving it behind."""
    await seed(feed_dsn)
    before = _scratch()
    proc = await start(feed_dsn, stdout=subprocess.DEVNULL)
    try:
        mine = await _scratch_while_running(proc, before)
        proc.send_signal(signal.SIGTERM)
        assert proc.stderr is not None
        await proc.stderr.read()
        assert await asyncio.wait_for(proc.wait(), TIMEOUT) == 128 + signal.SIGTERM
        assert not mine & _scratch(), mine
    finally:
        await _killed(proc)


async def test_the_scratch_of_a_killed_run_is_removed_by_the_next(feed_dsn: str) -> None:
    """SIGKILL (the OOM killer, a node going away) leaves no chance to clean up: the
    scratch directory stayed in /tmp for good. It names its process, and the next
    run removes it once that process is gone."""
    await seed(feed_dsn)
    before = _scratch()
    proc = await start(feed_dsn, stdout=subprocess.DEVNULL)
    try:
        mine = await _scratch_while_running(proc, before)
        os.killpg(proc.pid, signal.SIGKILL)
        await asyncio.wait_for(proc.wait(), TIMEOUT)
        assert mine <= _scratch(), "a killed run cannot remove its own scratch"
    finally:
        await _killed(proc)
    again = await start(feed_dsn, stdout=subprocess.DEVNULL)
    try:
        _, err = await asyncio.wait_for(again.communicate(), TIMEOUT)
        assert again.returncode == 0, err.decode()[-3000:]
        assert not mine & _scratch(), mine
    finally:
        await _killed(again)


def _scratch() -> set[str]:
    return set(glob.glob(os.path.join(tempfile.gettempdir(), "changefeed-spark-*")))


async def _scratch_while_running(proc: asyncio.subprocess.Process, before: set[str]) -> set[str]:
    """The scratch directory ``proc``'s session made, once Spark has started."""
    assert proc.stderr is not None
    async with asyncio.timeout(TIMEOUT):
        while b'"phase":"scan-gc"' not in (line := await proc.stderr.readline()):
            assert line, "the command ended before Spark started"
    mine = _scratch() - before
    assert mine, "the session's scratch directory exists while it runs"
    return mine


async def _killed(proc: asyncio.subprocess.Process) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    if proc.returncode is None:
        await proc.wait()
