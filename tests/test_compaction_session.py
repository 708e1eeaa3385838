"""The job's Spark session: an unreachable master, and an application's own session.

A standalone Spark master the job cannot reach fails the run at once, in one
line: Spark alone retries an unreachable master for about a minute, printing a Java
stack trace each time, and then fails with an error about a stopped
SparkContext that names neither the master nor the cause.
"""

from __future__ import annotations

import asyncio
import fcntl
import os
import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import asyncpg
import pytest
from test_compaction_cli import child_env, command, seed

from changefeed.compaction.errors import CompactionError
from changefeed.compaction.session import (
    check_master_form,
    check_master_reachable,
    remove_abandoned_scratch,
    spark_session,
    standalone_masters,
)


@pytest.fixture
def closed_port() -> int:
    """A port on 127.0.0.1 nothing listens on (bound, then released)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
    return port


@pytest.fixture
def listening_port() -> Iterator[int]:
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        yield server.getsockname()[1]


async def compact_on_seeded_feed(dsn: str, master: str) -> subprocess.CompletedProcess[str]:
    """``changefeed compact --master MASTER`` in a child process, on a seeded feed of
    800 entries."""
    await seed(dsn)
    argv = command(dsn)
    argv[argv.index("local[2]")] = master
    return await asyncio.to_thread(
        subprocess.run,
        argv,
        capture_output=True,
        text=True,
        timeout=60,
        env=child_env(),
        check=False,
    )


async def feed_entries(dsn: str) -> int:
    conn = await asyncpg.connect(dsn)
    try:
        count: int = await conn.fetchval("SELECT count(*) FROM changefeed.feed")
        return count
    finally:
        await conn.close()


@pytest.mark.parametrize(
    ("master", "expected"),
    [
        ("spark://10.0.0.5:7077", [("10.0.0.5", 7077)]),
        ("spark://master.example", [("master.example", 7077)]),
        ("spark://a:7077,b:7078", [("a", 7077), ("b", 7078)]),
        ("spark://[::1]:7077", [("::1", 7077)]),
        ("local[2]", []),
        ("yarn", []),
        ("k8s://https://10.0.0.1:6443", []),
    ],
)
def test_the_masters_a_url_names(master: str, expected: list[tuple[str, int]]) -> None:
    assert standalone_masters(master) == expected


@pytest.mark.parametrize("master", ["spark://", "spark://a:7077,", "spark://a:port"])
def test_a_malformed_master_url_is_named_in_the_error(master: str) -> None:
    with pytest.raises(CompactionError, match="not a Spark master URL"):
        standalone_masters(master)


@pytest.mark.parametrize(
    "master",
    [
        "local",
        "local[2]",
        "local[*]",
        "local[4,3]",
        "local-cluster[2,1,1024]",
        "yarn",
        "spark://a:7077,b:7078",
        "k8s://https://10.0.0.1:6443",
        "mesos://m:5050",
    ],
)
def test_every_form_of_spark_master_url_is_taken(master: str) -> None:
    check_master_form(master)


@pytest.mark.parametrize("master", ["bogus://x", "local[two]", "", "spark://", "Local", "yarn "])
def test_what_is_not_a_master_url_is_refused_before_spark(master: str) -> None:
    with pytest.raises(CompactionError, match="not a Spark master URL"):
        check_master_form(master)


async def test_the_command_refuses_a_bad_master_url_as_a_usage_error_and_changes_nothing(
    feed_dsn: str,
) -> None:
    """Spark itself refuses it only once its JVM has started, with a Java stack
    trace; the command says so in one line, exit 2, before anything starts."""
    done = await compact_on_seeded_feed(feed_dsn, "bogus://x")
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip().splitlines()[-1] == (
        "changefeed compact: --master: not a Spark master URL: 'bogus://x' (local, local[N],"
        " local[*], spark://HOST:PORT[,HOST:PORT], yarn, k8s://URL)"
    )
    assert "Exception" not in done.stderr  # no JVM started
    assert await feed_entries(feed_dsn) == 800  # the seeded feed, unchanged


def test_no_master_answering_is_one_error_naming_each(closed_port: int) -> None:
    master = f"spark://127.0.0.1:{closed_port},localhost:{closed_port}"
    with pytest.raises(CompactionError) as raised:
        check_master_reachable(master, timeout=5)
    message = str(raised.value)
    assert message.count("\n") == 0
    assert f"cannot reach the Spark master {master}" in message
    assert f"127.0.0.1:{closed_port}: Connection refused" in message
    assert f"localhost:{closed_port}" in message


def test_one_standby_master_answering_is_enough(closed_port: int, listening_port: int) -> None:
    check_master_reachable(f"spark://127.0.0.1:{closed_port},127.0.0.1:{listening_port}")
    check_master_reachable("local[*]")  # not a standalone master: nothing to reach


async def test_the_command_fails_at_once_and_changes_nothing(
    feed_dsn: str, closed_port: int
) -> None:
    done = await compact_on_seeded_feed(feed_dsn, f"spark://127.0.0.1:{closed_port}")
    assert done.returncode == 1, done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert last == (
        f"changefeed compact: cannot reach the Spark master spark://127.0.0.1:{closed_port}"
        f" (127.0.0.1:{closed_port}: Connection refused);"
        " is it running, and may this machine connect to it?"
    )
    assert "Exception" not in done.stderr  # no JVM started, no Java stack traces
    assert await feed_entries(feed_dsn) == 800  # the seeded feed, unchanged


@pytest.mark.spark
def test_the_applications_active_session_is_used_and_left_running(spark: Any) -> None:
    # Its master, not the one asked for, applies: nothing checks or starts one.
    with spark_session("spark://127.0.0.1:1") as session:
        assert session is spark
    assert spark.range(3).count() == 3


def test_only_scratch_of_a_session_that_is_over_is_removed(tmp_path: Path) -> None:
    """A scratch directory names its process, and its session holds a lock on it:
    the sweep removes the directories of sessions whose process is gone and whose
    lock is free, never a live one's, even of a process it cannot see (another PID
    namespace sharing the temp dir: its PID names nobody here)."""
    dead = subprocess.Popen(["true"])
    dead.wait()
    names = {
        "over": f"changefeed-spark-{dead.pid}-a",
        "elsewhere": f"changefeed-spark-{dead.pid}-b",  # locked: a live session elsewhere
        "running": f"changefeed-spark-{os.getpid()}-c",
        "unlocked-old": f"changefeed-spark-{dead.pid}-d",  # killed before it took its lock
        "not-ours": "changefeed-sparkle-1-e",
    }
    for name in names.values():
        (tmp_path / name).mkdir()
    for key in ("over", "elsewhere", "running"):
        (tmp_path / names[key] / ".owner").touch()
    held = os.open(tmp_path / names["elsewhere"] / ".owner", os.O_RDONLY)
    try:
        fcntl.flock(held, fcntl.LOCK_EX)
        removed = remove_abandoned_scratch(tmp_path)
    finally:
        os.close(held)
    assert sorted(p.name for p in removed) == sorted([names["over"], names["unlocked-old"]])
    left = sorted(p.name for p in tmp_path.iterdir())
    assert left == sorted([names["elsewhere"], names["running"], names["not-ours"]])
