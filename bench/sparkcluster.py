"""A Spark standalone cluster on 127.0.0.1: one master and N workers, from the pyspark
distribution, for the compaction benchmark (``--standalone``) and its test.

It runs the same classes the Spark distribution's ``sbin/start-master.sh`` and
``sbin/start-worker.sh`` start as daemons (``org.apache.spark.deploy.master.Master``,
``...worker.Worker``), through pyspark's own ``bin/spark-class``, as child
processes of this one: they are stopped with it, by their own process group,
and leave nothing behind but their scratch directory, which is removed.

    with standalone_cluster(workers=2, cores=1, memory="1g", port=18270) as master:
        run_compaction(dsn, master=master, ...)   # master == "spark://127.0.0.1:18270"
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

__all__ = ["standalone_cluster"]

_HOST = "127.0.0.1"


def _spark_class() -> str:
    import pyspark

    return str(Path(pyspark.__file__).parent / "bin" / "spark-class")


def _wait_for_port(port: int, proc: subprocess.Popen[bytes], log: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"spark master exited: {log.read_text()[-2000:]}")
        with contextlib.suppress(OSError), socket.create_connection((_HOST, port), timeout=0.5):
            return
        time.sleep(0.2)
    raise RuntimeError(f"spark master not listening on {port} after {timeout:g}s")


def _wait_for_workers(log: Path, workers: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if log.read_text().count("Registering worker") >= workers:
            return
        time.sleep(0.2)
    raise RuntimeError(f"{workers} workers did not register: {log.read_text()[-2000:]}")


def _start(args: list[str], log: Path, env: dict[str, str]) -> subprocess.Popen[bytes]:
    with log.open("wb") as out:
        return subprocess.Popen(
            [_spark_class(), *args],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,  # its own process group: stopped as a whole
        )


def _stop(proc: subprocess.Popen[bytes]) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=15)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


@contextlib.contextmanager
def standalone_cluster(
    *, workers: int = 2, cores: int = 1, memory: str = "1g", port: int = 18270
) -> Iterator[str]:
    """Start a master on ``port`` (its web UI on ``port + 1``) and ``workers`` workers
    (UIs on the ports after), all on 127.0.0.1; yield the master URL; stop them all."""
    scratch = Path(tempfile.mkdtemp(prefix="changefeed-spark-cluster-"))
    env = {
        **os.environ,
        "SPARK_LOCAL_IP": _HOST,
        "SPARK_LOCAL_DIRS": str(scratch / "local"),
        "SPARK_WORKER_DIR": str(scratch / "work"),
        "SPARK_LOG_DIR": str(scratch / "logs"),
        "SPARK_NO_DAEMONIZE": "1",
    }
    procs: list[subprocess.Popen[bytes]] = []
    try:
        master_log = scratch / "master.log"
        master_args = ["--host", _HOST, "--port", str(port), "--webui-port", str(port + 1)]
        master = _start(["org.apache.spark.deploy.master.Master", *master_args], master_log, env)
        procs.append(master)
        _wait_for_port(port, master, master_log, 60)
        url = f"spark://{_HOST}:{port}"
        for i in range(workers):
            worker_args = ["--host", _HOST, "--webui-port", str(port + 2 + i)]
            worker_args += ["--cores", str(cores), "--memory", memory, url]
            worker = ["org.apache.spark.deploy.worker.Worker", *worker_args]
            procs.append(_start(worker, scratch / f"worker-{i}.log", env))
        _wait_for_workers(master_log, workers, 60)
        yield url
    finally:
        for proc in reversed(procs):
            _stop(proc)
        shutil.rmtree(scratch, ignore_errors=True)
