"""Every benchmark still runs: its ``--quick`` mode, against the tests' PostgreSQL.

The figures are not checked here (performance lives in bench/ and
docs/performance.md); what is checked is that a change to the code did not
leave a benchmark unable to run, which nothing else would notice.
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import pytest

from changefeed import fast_path

BENCH = Path(__file__).resolve().parent.parent / "bench"


async def run_bench(script: str, *args: str, timeout: float) -> str:
    """Run ``bench/<script>`` with ``args``; its output, once it exited 0."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, str(BENCH / script), *args,
        cwd=BENCH, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
    )  # fmt: skip
    try:
        out, _ = await asyncio.wait_for(proc.communicate(), timeout)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    text = out.decode()
    assert proc.returncode == 0, text[-3000:]
    return text


@pytest.mark.slow
@pytest.mark.parametrize(
    "bench",
    ["bootstrap", "catchup", "checkpoint", "fanout", "keepalive", "latency", "listener", "publish"],
)
async def test_the_benchmark_runs(bench: str, dsn: str) -> None:
    text = await run_bench(f"{bench}.py", "--quick", "--dsn", dsn, timeout=240)
    if bench in ("fanout", "latency"):
        # Plain ASGI beside the fast path, on every server the publisher is tested on
        # (the oldest uvicorn among them).
        sys.path.insert(0, str(BENCH))
        try:
            from common import OLDEST_UVICORN, SERVERS
        finally:
            sys.path.remove(str(BENCH))
        assert OLDEST_UVICORN == fast_path.OLDEST_UVICORN
        assert f"uvicorn {OLDEST_UVICORN}, plain ASGI" in SERVERS.values()
        for label in SERVERS.values():
            assert f"{label}, batch" in text and f"{label}, RFD 5" in text, (label, text[-3000:])


@pytest.mark.slow
async def test_the_fleet_benchmark_runs() -> None:
    """bench/fleet.py makes its own primary and standby (a standby cannot be made of
    the tests' server from outside), so it runs without ``--dsn``."""
    text = await run_bench("fleet.py", "--quick", timeout=300)
    assert "idle listeners on one publisher process" in text


@pytest.mark.slow
@pytest.mark.spark
async def test_the_compaction_benchmark_runs_on_a_two_worker_standalone_cluster(dsn: str) -> None:
    """bench/compaction.py on a small feed, with the job on a Spark standalone cluster of
    a master and two workers (bench/sparkcluster.py, on 127.0.0.1): the full and the
    incremental run each end in the same feed as plain SQL does."""
    from helpers import free_port

    port = str(free_port())
    text = await run_bench(
        "compaction.py", "--rows", "20000", "--standalone", "--cluster-port", port,
        "--dsn", dsn, "--no-warm-up", timeout=300,
    )  # fmt: skip
    assert "spark://127.0.0.1:" in text, text[-3000:]
    assert text.count("same feed after both: True") == 2, text[-3000:]
    assert "run           incremental" in text, text[-3000:]


@pytest.mark.slow
async def test_the_fan_out_benchmark_measures_a_baseline_commit_in_turn(dsn: str) -> None:
    """``--baseline REF`` serves REF's publisher from a worktree beside this tree's,
    each round, and prints the pair-by-pair ratio; the worktree is removed after."""
    text = await run_bench(
        "fanout.py", "--dsn", dsn, "--servers", "uvicorn-fast", "--baseline", "HEAD",
        "--rounds", "2", "--items", "300", "--listeners", "5", timeout=240,
    )  # fmt: skip
    assert "baseline HEAD (" in text, text[-3000:]
    for kind in ("batch", "RFD 5"):
        assert f"uvicorn, fast path, {kind}:" in text, text[-3000:]
    assert text.count("x baseline by pair") == 2, text[-3000:]
    worktrees = await asyncio.create_subprocess_exec(
        "git", "-C", str(BENCH), "worktree", "list", stdout=asyncio.subprocess.PIPE
    )
    listed, _ = await worktrees.communicate()
    assert b"cf-bench-baseline-" not in listed


@pytest.mark.slow
async def test_any_benchmark_runs_against_a_baseline_commit_in_pairs(dsn: str) -> None:
    """bench/ab.py runs a benchmark from this tree and from a worktree of REF in turn
    and pairs the figures of their result lines."""
    text = await run_bench(
        "ab.py", "--baseline", "HEAD", "--pairs", "2", "--", "publish.py", "--quick",
        "--dsn", dsn, timeout=240,
    )  # fmt: skip
    assert text.count(": this tree  result:") == 2 and text.count(": baseline   result:") == 2
    assert "this / base" in text, text[-3000:]
    ratios = [line for line in text.splitlines() if "[]" in line and line.rstrip().endswith("x")]
    assert ratios, text[-3000:]
