"""The Spark session the compaction job starts: quiet, on one machine, cleaned up after.

Loopback only, UI off, log level WARN, scratch space (and the log4j2 settings)
under the temp dir, removed when the session stops. A process killed outright
(SIGKILL, the OOM killer) cannot remove its own: the scratch directory names
its process, and the next session removes those whose process is gone. The
session active in the calling thread, when the application runs one, is used
as it is.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import shutil
import socket
import tempfile
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from changefeed.processes import pid_alive

from .errors import CompactionError
from .jdbc import find_jdbc_jar

__all__ = [
    "check_master_form",
    "check_master_reachable",
    "remove_abandoned_scratch",
    "session_conf",
    "spark_session",
    "standalone_masters",
]

_SCRATCH_PREFIX = "changefeed-spark-"
_SCRATCH_OF = re.compile(r"^changefeed-spark-(\d+)-")
_OWNER = ".owner"
"""The file in a session's scratch directory whose lock the session holds."""

_LOCAL_MASTER = re.compile(r"^local(\[(\d+|\*)(,\d+)?\])?$")
_MASTER_FORMS = re.compile(
    r"local(\[(\d+|\*)(,\d+)?\])?|local-cluster\[\d+,\d+,\d+\]|yarn|(spark|k8s|mesos)://\S+"
)
"""The master URLs Spark accepts (its "Master URLs" table)."""
_LOOPBACK_MASTER = re.compile(r"^spark://(127\.0\.0\.1|localhost)(:\d+)?$")

_LOG4J2 = """\
status = error
rootLogger.level = warn
rootLogger.appenderRef.stderr.ref = stderr
appender.stderr.type = Console
appender.stderr.name = stderr
appender.stderr.target = SYSTEM_ERR
appender.stderr.layout.type = PatternLayout
appender.stderr.layout.pattern = %d{yy/MM/dd HH:mm:ss} %p %c{1}: %m%n%ex
logger.nativecode.name = org.apache.hadoop.util.NativeCodeLoader
logger.nativecode.level = error
logger.sparkconf.name = org.apache.spark.SparkConf
logger.sparkconf.filter.localdir.type = RegexFilter
logger.sparkconf.filter.localdir.regex = .*spark[.]local[.]dir will be overridden.*
logger.sparkconf.filter.localdir.onMatch = DENY
logger.sparkconf.filter.localdir.onMismatch = NEUTRAL
"""


def remove_abandoned_scratch(root: Path) -> list[Path]:
    """Remove the scratch directories under ``root`` of sessions whose process is
    gone (killed before it could remove its own); the ones removed.

    Only this user's, and only where the session is certainly over: its process is
    not running (one this user may not signal counts as running), and the lock its
    session holds on the directory's ``.owner`` file is free. The lock is what tells
    a live session of another PID namespace (a container sharing the temp dir),
    where the PID means nothing.
    """
    removed = []
    uid = os.getuid()
    with contextlib.suppress(OSError):
        for entry in os.scandir(root):
            match = _SCRATCH_OF.match(entry.name)
            if match is None or not entry.is_dir(follow_symlinks=False):
                continue
            with contextlib.suppress(OSError):
                if entry.stat(follow_symlinks=False).st_uid != uid:
                    continue
                if pid_alive(int(match.group(1))) or _owned(Path(entry.path)):
                    continue
                shutil.rmtree(entry.path)
                removed.append(Path(entry.path))
    return removed


def _own(scratch: Path) -> int:
    """Lock ``scratch`` for this session: an open descriptor, locked until closed."""
    fd = os.open(scratch / _OWNER, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX)
    return fd


def _owned(scratch: Path) -> bool:
    """Whether a live session holds ``scratch``'s lock (a directory without one, of
    a session killed before it took it, is nobody's)."""
    try:
        fd = os.open(scratch / _OWNER, os.O_RDONLY | os.O_NOFOLLOW)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False


def _local_threads(master: str) -> int | None:
    match = _LOCAL_MASTER.match(master)
    if not match:
        return None
    threads = match.group(2)
    if threads is None:
        return 1
    if threads == "*":
        return os.cpu_count() or 1
    return int(threads)


def standalone_masters(master: str) -> list[tuple[str, int]]:
    """The host and port of each master a ``spark://`` URL names, in order.

    A standalone cluster with standby masters is named by all of them
    (``spark://h1:7077,h2:7077``); the port defaults to Spark's 7077. Any
    other master (``local``, ``yarn``, ``k8s://...``) names none.
    """
    if not master.startswith("spark://"):
        return []
    masters = []
    for part in master.removeprefix("spark://").split(","):
        try:
            address = urlsplit(f"spark://{part}")
            host, port = address.hostname, address.port
        except ValueError as exc:
            raise CompactionError(f"not a Spark master URL: {master!r} ({exc})") from None
        if not host:
            raise CompactionError(f"not a Spark master URL: {master!r} (no host in {part!r})")
        masters.append((host, port or 7077))
    return masters


def check_master_form(master: str) -> None:
    """Refuse, in one line, what is not a Spark master URL.

    Spark refuses it only once its JVM has started, seconds later, with a Java
    stack trace ("Could not parse Master URL").

    Raises:
        CompactionError: not one of Spark's forms, or a ``spark://`` URL that
            names no host.
    """
    if not _MASTER_FORMS.fullmatch(master):
        raise CompactionError(
            f"not a Spark master URL: {master!r} (local, local[N], local[*],"
            " spark://HOST:PORT[,HOST:PORT], yarn, k8s://URL)"
        )
    standalone_masters(master)


def check_master_reachable(master: str, timeout: float = 5.0) -> None:
    """Fail at once, in one line, when no master of a ``spark://`` URL accepts a connection.

    Spark itself retries an unreachable standalone master for about a minute,
    printing a Java stack trace each time, and then fails with an error about a
    stopped SparkContext that names neither the master nor the cause.

    Raises:
        CompactionError: the URL is malformed, or no master it names answers.
    """
    check_master_form(master)
    failures = []
    for host, port in standalone_masters(master):
        try:
            with socket.create_connection((host, port), timeout=timeout):
                return
        except OSError as exc:
            failures.append(f"{host}:{port}: {exc.strerror or exc or type(exc).__name__}")
    if failures:
        raise CompactionError(
            f"cannot reach the Spark master {master} ({'; '.join(failures)});"
            " is it running, and may this machine connect to it?"
        )


def session_conf(
    master: str, jdbc_jar: str | None, scratch: Path, extra: Mapping[str, str] | None = None
) -> dict[str, str]:
    """The Spark settings the job starts with (``extra`` wins)."""
    log_conf = scratch / "log4j2.properties"
    conf = {
        "spark.ui.enabled": "false",
        "spark.ui.showConsoleProgress": "false",
        "spark.local.dir": str(scratch),
        "spark.sql.session.timeZone": "UTC",
        # A window over a resource id's entries holds them in memory up to this
        # many before spilling (Spark's default, 4,096, spills ordinary ids'
        # groups; hot ids, the large ones, are merged apart: compaction.merge).
        "spark.sql.windowExec.buffer.in.memory.threshold": "65536",
        "spark.driver.extraJavaOptions": f"-Dlog4j2.configurationFile=file:{log_conf}",
    }
    if jdbc_jar:
        conf["spark.jars"] = jdbc_jar
    threads = _local_threads(master)
    if threads is not None:
        conf.update(
            {
                "spark.driver.host": "127.0.0.1",
                "spark.driver.bindAddress": "127.0.0.1",
                "spark.driver.memory": "2g",
                "spark.sql.shuffle.partitions": str(max(4, 4 * threads)),
                # One machine: shuffle files and cached blocks never cross a
                # network, and compressing them costs the CPU the job lacks.
                "spark.shuffle.compress": "false",
                "spark.shuffle.spill.compress": "false",
                "spark.sql.inMemoryColumnarStorage.compressed": "false",
            }
        )
    elif _LOOPBACK_MASTER.match(master):
        # A cluster on this machine (a standalone master on 127.0.0.1): its
        # executors reach the driver on loopback, and nothing else can.
        conf.update({"spark.driver.host": "127.0.0.1", "spark.driver.bindAddress": "127.0.0.1"})
    conf.update(extra or {})
    return conf


def _headline(exc: BaseException) -> str:
    """The line of a launch failure that says what went wrong.

    A Java exception reaches Python as py4j's "An error occurred while
    calling ...", then ": " and the Java exception, then its stack trace
    (printed by the JVM already): keep the Java exception's line.
    """
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    for line in lines:
        if line.startswith(": "):
            return line[2:]
    return lines[0] if lines else type(exc).__name__


@contextlib.contextmanager
def spark_session(
    master: str = "local[*]",
    *,
    jdbc_jar: str | None = None,
    conf: Mapping[str, str] | None = None,
    app_name: str = "changefeed-compaction",
) -> Iterator[Any]:
    """Start a quiet SparkSession for the job; stop it (and remove its scratch space) after.

    When the calling thread has an active session
    (``SparkSession.getActiveSession()``), it is used as it is and left
    running (``master``, ``jdbc_jar`` and ``conf`` do not apply).

    On a ``local`` master, or a standalone one on 127.0.0.1, the driver binds to
    127.0.0.1 only (``SPARK_LOCAL_IP`` is set for this process if unset). ``jdbc_jar`` defaults to
    :func:`~changefeed.compaction.jdbc.find_jdbc_jar`.

    Raises:
        CompactionError: pyspark is not installed, no standalone master named
            answers (:func:`check_master_reachable`), or Java cannot start.
    """
    try:
        from pyspark.sql import SparkSession
    except ImportError as exc:
        raise CompactionError(
            "the compaction job needs pyspark (pip install 'changefeed[spark]') and Java 17+"
        ) from exc
    active = SparkSession.getActiveSession()
    if active is not None:
        # The application (a notebook, a service) runs a session: use it, leave it running.
        yield active
        return
    check_master_reachable(master)
    jar = jdbc_jar if jdbc_jar is not None else find_jdbc_jar()
    remove_abandoned_scratch(Path(tempfile.gettempdir()))
    scratch = Path(tempfile.mkdtemp(prefix=f"{_SCRATCH_PREFIX}{os.getpid()}-"))
    owner: int | None = None
    try:
        owner = _own(scratch)
        (scratch / "log4j2.properties").write_text(_LOG4J2)
        if _local_threads(master) is not None or _LOOPBACK_MASTER.match(master):
            os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
        builder = SparkSession.builder.appName(app_name).master(master)
        for key, value in session_conf(master, jar, scratch, conf).items():
            builder = builder.config(key, value)
        try:
            spark = builder.getOrCreate()
        except Exception as exc:  # py4j / JVM launch failures have no common base
            raise CompactionError(f"cannot start Spark ({master}): {_headline(exc)}") from exc
        try:
            spark.sparkContext.setLogLevel("WARN")
            yield spark
        finally:
            spark.stop()
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
        if owner is not None:
            os.close(owner)
