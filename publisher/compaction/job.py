"""The Spark compaction and garbage-collection job: ``run_compaction``.

One run:

1. **lock + snapshot** (control connection, asyncpg): take the job's advisory
   lock; capture ``pg_snapshot_xmin`` (the horizon), the database clock, the
   head (newest entry below the horizon) and the table size. The run reads and
   changes nothing after the head; the age cutoffs are ``clock - max_age`` and
   ``clock - compaction_lag``.
2. **scan** (Spark, JDBC): the feed is read in parallel partitions, each a
   range of heap pages (``ctid`` ranges: a TID range scan each, no overlap),
   bounded to entries at or before the head and older than the compaction lag.
3. **plan** (Spark): garbage is grouped into id chunks of at most
   ``batch_size`` entries (only the chunk bounds travel back); compaction
   candidates are grouped by ``(resource, changed_resource_id)`` with one
   window (one shuffle): the latest entry keeps, carrying the union.
4. **stage** (Spark, JDBC): keeper updates and drops go to a per-run unlogged
   staging table (no index: the apply step walks it by page ranges).
5. **apply** (control connection): garbage chunks, then keeper updates, then
   drops, each batch its own short transaction (see ``apply``).

The job prints nothing; it reports through ``progress``. Spark is started
quietly on one machine (loopback only, UI off, log level WARN, scratch space
under the temp dir) unless a session is handed in.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import json
import os
import re
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import asyncpg

from changefeed.publisher.errors import CompactionError
from changefeed.schemas import ORIGIN, Position, quote_schema
from changefeed.schemas.errors import ProtocolError

from .apply import KIND_DROP, KIND_KEEP, CompactionStore, FeedSnapshot
from .jdbc import JdbcTarget, find_jdbc_jar, jdbc_from_dsn
from .plan import GcChunk

__all__ = [
    "CompactionSummary",
    "Progress",
    "run_compaction",
    "spark_session",
]

Progress = Callable[[str, dict[str, Any]], None]
"""``progress(event, fields)``: how the job reports (``start``, ``snapshot``,
``phase``, ``planned``, ``staged``, ``batch``, ``done``)."""

_FETCH_SIZE = 10_000
_WRITE_BATCH = 10_000
_BLOCKS_PER_PARTITION = 8192  # 64 MiB of heap per read partition
_MAX_PARTITIONS = 4096
_TID_RANGE_SCAN = 140000  # server_version_num with TID range scans
_CONNECT_TIMEOUT = 30.0
_LOCAL_MASTER = re.compile(r"^local(\[(\d+|\*)(,\d+)?\])?$")

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


@dataclass
class CompactionSummary:
    """What one run did (or, with ``dry_run``, would do).

    Attributes:
        scanned: entries read (garbage and compaction candidates).
        collected: entries deleted as older than the max age.
        merged: entries merged into a later entry of the same resource id and deleted.
        rewritten: keepers whose sub-resources became the union.
        groups: resource ids with entries merged.
        as_of: the database clock at the snapshot; the age cutoffs count from it.
        phases: seconds by phase, in order.
    """

    schema: str
    dry_run: bool
    max_age: float
    compaction_lag: float
    head: Position = ORIGIN
    low_water_before: Position = ORIGIN
    low_water_after: Position = ORIGIN
    scanned: int = 0
    collected: int = 0
    merged: int = 0
    rewritten: int = 0
    groups: int = 0
    partitions: int = 0
    gc_batches: int = 0
    run_id: int | None = None
    as_of: datetime | None = None
    phases: dict[str, float] = field(default_factory=dict)
    seconds: float = 0.0

    @property
    def rows_per_second(self) -> float:
        """Entries scanned per second of the whole run."""
        return self.scanned / self.seconds if self.seconds > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict (positions as ``[txid, id]``)."""
        return {
            "schema": self.schema,
            "dry_run": self.dry_run,
            "max_age": self.max_age,
            "compaction_lag": self.compaction_lag,
            "head": list(self.head),
            "low_water_before": list(self.low_water_before),
            "low_water_after": list(self.low_water_after),
            "scanned": self.scanned,
            "collected": self.collected,
            "merged": self.merged,
            "rewritten": self.rewritten,
            "groups": self.groups,
            "partitions": self.partitions,
            "gc_batches": self.gc_batches,
            "run_id": self.run_id,
            "as_of": self.as_of.isoformat() if self.as_of else None,
            "phases": {k: round(v, 3) for k, v in self.phases.items()},
            "seconds": round(self.seconds, 3),
            "rows_per_second": round(self.rows_per_second, 1),
        }

    def to_text(self) -> str:
        """A few lines for a terminal (what ``changefeed compact`` prints)."""
        verb = "would delete" if self.dry_run else "deleted"
        title = f"compaction of {self.schema}.feed" + (
            " (dry run: nothing changed)" if self.dry_run else ""
        )
        phases = "  ".join(f"{k} {v:.1f}s" for k, v in self.phases.items())
        return "\n".join(
            [
                title,
                f"  head          {_pos(self.head)}",
                f"  low water     {_pos(self.low_water_before)} -> {_pos(self.low_water_after)}",
                f"  scanned       {self.scanned:,} entries in {self.partitions} partitions"
                f" ({self.rows_per_second:,.0f} entries/s)",
                f"  collected     {verb} {self.collected:,} older than {_age(self.max_age)}"
                f" in {self.gc_batches:,} batches",
                f"  merged        {verb} {self.merged:,} into later entries of {self.groups:,}"
                f" resource ids ({self.rewritten:,} rewritten with the union),"
                f" older than {_age(self.compaction_lag)}",
                f"  time          {phases}  total {self.seconds:.1f}s",
            ]
        )


def _pos(p: Position) -> str:
    return f"({p.txid}, {p.id})"


def _age(seconds: float) -> str:
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size and seconds % size == 0:
            return f"{int(seconds // size)}{unit}"
    return f"{seconds:g}s"


# --------------------------------------------------------------------------- Spark session


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
            }
        )
    conf.update(extra or {})
    return conf


@contextlib.contextmanager
def spark_session(
    master: str = "local[*]",
    *,
    jdbc_jar: str | None = None,
    conf: Mapping[str, str] | None = None,
    app_name: str = "changefeed-compaction",
) -> Iterator[Any]:
    """Start a quiet SparkSession for the job; stop it (and remove its scratch space) after.

    When this process already runs a SparkContext, its session is used as it
    is and left running (``master``, ``jdbc_jar`` and ``conf`` do not apply).

    On a ``local`` master the driver binds to 127.0.0.1 only (``SPARK_LOCAL_IP``
    is set for this process if unset). ``jdbc_jar`` defaults to
    :func:`~changefeed.publisher.compaction.jdbc.find_jdbc_jar`.

    Raises:
        CompactionError: pyspark is not installed, or Java cannot start.
    """
    try:
        from pyspark.sql import SparkSession
    except ImportError as exc:
        raise CompactionError(
            "the compaction job needs pyspark (pip install 'changefeed[spark]') and Java 17+"
        ) from exc
    from pyspark import SparkContext

    if SparkContext._active_spark_context is not None:
        # A session already runs in this process: use it, leave it running.
        yield SparkSession.builder.getOrCreate()
        return
    jar = jdbc_jar if jdbc_jar is not None else find_jdbc_jar()
    scratch = Path(tempfile.mkdtemp(prefix="changefeed-spark-"))
    try:
        (scratch / "log4j2.properties").write_text(_LOG4J2)
        if _local_threads(master) is not None:
            os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
        builder = SparkSession.builder.appName(app_name).master(master)
        for key, value in session_conf(master, jar, scratch, conf).items():
            builder = builder.config(key, value)
        try:
            spark = builder.getOrCreate()
        except Exception as exc:  # py4j / JVM launch failures have no common base
            raise CompactionError(f"cannot start Spark ({master}): {exc}") from exc
        try:
            spark.sparkContext.setLogLevel("WARN")
            yield spark
        finally:
            spark.stop()
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


# --------------------------------------------------------------------------- planning in Spark


def block_ranges(blocks: int, partitions: int) -> list[tuple[int, int | None]]:
    """Split pages ``[0, blocks)`` into ``partitions`` ranges; the last one is open-ended."""
    parts = max(1, min(partitions, max(blocks, 1)))
    bounds = [blocks * i // parts for i in range(parts)]
    return [(lo, bounds[i + 1] if i + 1 < parts else None) for i, lo in enumerate(bounds)]


def _ts(value: datetime) -> str:
    # A datetime from the server's own clock, formatted: never text from input.
    return f"'{value.isoformat()}'::timestamptz"


def head_bound(snapshot: FeedSnapshot) -> str:
    """SQL: the entry is at or before the snapshot's head."""
    return f"(txid, id) <= ('{int(snapshot.head.txid)}'::xid8, {int(snapshot.head.id)})"


def read_predicates(
    snapshot: FeedSnapshot, ranges: list[tuple[int, int | None]], condition: str
) -> list[str]:
    """One ``WHERE`` clause per partition: its page range, the head bound and ``condition``."""
    head = head_bound(snapshot)
    out = []
    for lo, hi in ranges:
        terms = []
        if lo > 0:
            terms.append(f"ctid >= '({int(lo)},0)'::tid")
        if hi is not None:
            terms.append(f"ctid < '({int(hi)},0)'::tid")
        out.append(" AND ".join([*terms, head, condition]))
    return out


def _read(spark: Any, target: JdbcTarget, table: str, predicates: list[str]) -> Any:
    return spark.read.jdbc(
        url=target.url,
        table=table,
        predicates=predicates,
        properties=target.with_properties(
            fetchsize=str(_FETCH_SIZE), ApplicationName="changefeed-compaction"
        ),
    )


def plan_garbage(
    spark: Any,
    target: JdbcTarget,
    table: str,
    predicates: list[str],
    *,
    width: int,
    count_condition: str,
) -> tuple[list[GcChunk], int]:
    """Garbage chunk bounds, and the number of compaction candidates, in one Spark job.

    Garbage is grouped by ``id div width`` (so a chunk holds at most ``width``
    entries); only the chunk bounds come back to the driver. The candidates are
    counted by PostgreSQL (``count_condition``), beside the garbage scan.
    """
    from pyspark.sql import functions as F

    garbage = _read(spark, target, table, predicates).select(
        F.col("txid").cast("long").alias("txid"), F.col("id")
    )
    chunks = garbage.groupBy(F.expr(f"id div {int(width)}").alias("chunk")).agg(
        F.min(F.struct("txid", "id")).alias("first"),
        F.max(F.struct("txid", "id")).alias("last"),
        F.count(F.lit(1)).alias("rows"),
    )
    counted = spark.read.jdbc(
        url=target.url,
        table=f"(SELECT count(*) AS n FROM {table} WHERE {count_condition}) AS changefeed_count",
        properties=target.with_properties(ApplicationName="changefeed-compaction"),
    ).select(
        F.lit(-1).cast("long").alias("chunk"),
        F.lit(None).cast("struct<txid:bigint,id:bigint>").alias("first"),
        F.lit(None).cast("struct<txid:bigint,id:bigint>").alias("last"),
        F.col("n").cast("long").alias("rows"),
    )
    rows = chunks.unionByName(counted).collect()
    candidates = sum(int(r["rows"]) for r in rows if r["chunk"] == -1)
    found = sorted((r for r in rows if r["chunk"] != -1), key=lambda r: int(r["chunk"]))
    return [
        GcChunk(
            Position(int(r["first"]["txid"]), int(r["first"]["id"])),
            Position(int(r["last"]["txid"]), int(r["last"]["id"])),
            int(r["chunk"]) * width,
            (int(r["chunk"]) + 1) * width,
            int(r["rows"]),
        )
        for r in found
    ], candidates


def merge_frame(candidates: Any) -> Any:
    """Every candidate entry with its group's verdict.

    One window over ``(resource, changed_resource_id)`` (one shuffle) gives each
    entry its group's size ``n``, keeper (latest position), whole-resource flag
    and distinct sub-resource sets. Returns ``txid, id, subs, n, k_txid, k_id,
    is_keep, union`` for every candidate (groups of one included).
    """
    from pyspark.sql import Window
    from pyspark.sql import functions as F

    w = Window.partitionBy("resource", "changed_resource_id")
    subs = F.array_sort(F.array_distinct(F.col("sub_resources")))
    grouped = candidates.select(
        F.col("txid").cast("long").alias("txid"),
        F.col("id"),
        F.col("resource"),
        F.col("changed_resource_id"),
        subs.alias("subs"),
    ).select(
        "*",
        F.count(F.lit(1)).over(w).alias("n"),
        F.max(F.struct("txid", "id")).over(w).alias("keep"),
        F.max((F.size("subs") == 0).cast("int")).over(w).alias("whole"),
        F.collect_set("subs").over(w).alias("sets"),
    )
    union = F.when(F.col("whole") == 1, F.array().cast("array<string>")).otherwise(
        F.array_sort(F.array_distinct(F.flatten(F.col("sets"))))
    )
    is_keep = (F.col("txid") == F.col("keep.txid")) & (F.col("id") == F.col("keep.id"))
    return grouped.select(
        "txid",
        "id",
        "subs",
        "n",
        F.col("keep.txid").alias("k_txid"),
        F.col("keep.id").alias("k_id"),
        is_keep.alias("is_keep"),
        union.alias("union"),
    )


def staging_rows(merged: Any) -> Any:
    """Keeper rows whose sub-resources change, and drop rows, in ``STAGING_COLUMNS`` order."""
    from pyspark.sql import functions as F

    keep = F.col("is_keep")
    null_long = F.lit(None).cast("long")
    return merged.where((F.col("n") > 1) & (~keep | (F.col("subs") != F.col("union")))).select(
        F.when(keep, F.lit(KIND_KEEP)).otherwise(F.lit(KIND_DROP)).cast("short").alias("kind"),
        F.col("txid"),
        F.col("id"),
        F.when(keep, null_long).otherwise(F.col("k_txid")).alias("keep_txid"),
        F.when(keep, null_long).otherwise(F.col("k_id")).alias("keep_id"),
        F.when(keep, F.col("union"))
        .otherwise(F.lit(None).cast("array<string>"))
        .alias("sub_resources"),
    )


def _plan_and_stage(
    spark: Any,
    target: JdbcTarget,
    table: str,
    predicates: list[str],
    staging: str | None,
) -> tuple[int, int, int] | None:
    """Plan compaction; write the staging rows to ``staging``, or with None (dry run) count.

    Returns:
        on a dry run (groups, keeper updates, drops); otherwise None (the
        counts are in the staging table).
    """
    from pyspark.sql import functions as F

    merged = merge_frame(_read(spark, target, table, predicates))
    if staging is None:
        in_group = F.col("n") > 1
        keep = F.col("is_keep")
        row = merged.agg(
            F.count(F.when(in_group & keep, 1)).alias("groups"),
            F.count(F.when(in_group & keep & (F.col("subs") != F.col("union")), 1)).alias(
                "updates"
            ),
            F.count(F.when(in_group & ~keep, 1)).alias("drops"),
        ).collect()[0]
        return (int(row["groups"]), int(row["updates"]), int(row["drops"]))
    staging_rows(merged).write.jdbc(
        url=target.url,
        table=staging,
        mode="append",
        properties=target.with_properties(
            batchsize=str(_WRITE_BATCH),
            reWriteBatchedInserts="true",
            # No transaction per partition: each batch of inserts commits by
            # itself. A write transaction holds an xid, and while it is open
            # pg_snapshot_xmin -- the publishers' tailing horizon (I1) -- cannot
            # pass it: one long staging transaction would stall every tailer.
            # A retried task may then stage a row twice; the apply step is
            # idempotent, and the summary counts what it applied.
            isolationLevel="NONE",
            ApplicationName="changefeed-compaction",
        ),
    )
    return None


# --------------------------------------------------------------------------- the run


class _Clock:
    def __init__(self, summary: CompactionSummary, progress: Progress | None) -> None:
        self.summary = summary
        self.progress = progress
        self.started = time.monotonic()

    def emit(self, event: str, **fields: Any) -> None:
        if self.progress is not None:
            self.progress(event, fields)

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        self.emit("phase", name=name, state="start")
        t0 = time.monotonic()
        try:
            yield
        finally:
            took = time.monotonic() - t0
            self.summary.phases[name] = self.summary.phases.get(name, 0.0) + took
            self.emit("phase", name=name, state="end", seconds=round(took, 3))


def _check_durations(max_age: float, compaction_lag: float, batch_size: int) -> None:
    for name, value in (("max_age", max_age), ("compaction_lag", compaction_lag)):
        if not isinstance(value, int | float) or isinstance(value, bool) or not value > 0:
            raise CompactionError(f"{name} must be a positive number of seconds, got {value!r}")
    if max_age < compaction_lag:
        raise CompactionError(
            f"max_age ({max_age:g}s) must not be shorter than compaction_lag "
            f"({compaction_lag:g}s): both keep the job away from the live head"
        )
    if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1:
        raise CompactionError(f"batch_size must be a positive integer, got {batch_size!r}")


def _spark_errors() -> tuple[type[BaseException], ...]:
    errors: list[type[BaseException]] = []
    with contextlib.suppress(ImportError):
        errors.append(importlib.import_module("py4j.protocol").Py4JError)
    with contextlib.suppress(ImportError):
        from pyspark.errors import PySparkException

        errors.append(PySparkException)
    return tuple(errors)


def _spark_message(exc: BaseException) -> str:
    """The innermost Java cause of a py4j error (e.g. the PSQLException), else the text."""
    java = getattr(exc, "java_exception", None)
    with contextlib.suppress(Exception):  # best effort: the JVM may be gone
        while java is not None and java.getCause() is not None:
            java = java.getCause()
        if java is not None:
            return str(java.toString())
    lines = str(exc).strip().splitlines()
    return lines[0] if lines else type(exc).__name__


_DB_ERRORS = (OSError, TimeoutError, asyncpg.PostgresError, asyncpg.InterfaceError)


def run_compaction(
    dsn: str,
    *,
    schema: str = "changefeed",
    max_age: float,
    compaction_lag: float,
    master: str = "local[*]",
    dry_run: bool = False,
    jdbc_jar: str | None = None,
    progress: Progress | None = None,
    spark: Any | None = None,
    batch_size: int = 5000,
    partitions: int | None = None,
    lock_wait: float = 30.0,
    spark_conf: Mapping[str, str] | None = None,
) -> CompactionSummary:
    """Garbage-collect and compact one feed table with Spark; return what was done.

    Args:
        dsn: ``postgresql://user:pw@host:port/db`` of the feed database.
        schema: the feed's schema.
        max_age: seconds; older entries are deleted (the low-water mark rises).
        compaction_lag: seconds; older entries of one resource id are merged.
            Must not exceed ``max_age``. Keep it well above the longest tailer
            lag and resume replay (see docs/compaction.md).
        master: Spark master when the job starts its own session.
        dry_run: plan and count only; nothing is written.
        jdbc_jar: the PostgreSQL JDBC driver jar (default: found automatically).
        progress: ``progress(event, fields)``; the job prints nothing itself.
        spark: an existing SparkSession to use (it is not stopped; its class
            path must hold the JDBC driver); default: start one on ``master``.
        batch_size: entries per apply transaction (and per garbage chunk).
        partitions: read partitions (default: one per 64 MiB of heap, at
            least the default parallelism).
        lock_wait: seconds to wait for another job's lock before giving up.
        spark_conf: extra Spark settings for a session the job starts.

    Must be called from a thread without a running event loop (in async code:
    ``await asyncio.to_thread(run_compaction, ...)``).

    Raises:
        CompactionError: bad arguments, another job running, or a failure on
            the way (the feed is consistent; run again to finish).
    """
    _check_durations(max_age, compaction_lag, batch_size)
    try:
        quote_schema(schema)
    except ProtocolError as exc:
        raise CompactionError(str(exc)) from None
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        pass
    else:
        raise CompactionError(
            "run_compaction blocks: call it from a thread without a running event loop "
            "(e.g. asyncio.to_thread)"
        )
    target = jdbc_from_dsn(dsn)
    jar = find_jdbc_jar(jdbc_jar) if spark is None else None
    summary = CompactionSummary(
        schema=schema, dry_run=dry_run, max_age=max_age, compaction_lag=compaction_lag
    )
    clock = _Clock(summary, progress)
    clock.emit("start", url=target.url, schema=schema, dry_run=dry_run, master=master)
    with asyncio.Runner() as runner:
        try:
            conn = runner.run(asyncpg.connect(dsn, timeout=_CONNECT_TIMEOUT))
        except _DB_ERRORS as exc:
            raise CompactionError(f"cannot connect to the feed database: {exc}") from exc
        try:
            _run(
                runner=runner,
                conn=conn,
                clock=clock,
                target=target,
                jar=jar,
                spark=spark,
                master=master,
                spark_conf=spark_conf,
                batch_size=batch_size,
                partitions=partitions,
                lock_wait=lock_wait,
            )
        except _DB_ERRORS as exc:
            raise CompactionError(f"feed database error: {exc}") from exc
        except _spark_errors() as exc:
            raise CompactionError(f"Spark failed: {_spark_message(exc)}") from exc
        finally:
            with contextlib.suppress(*_DB_ERRORS):
                runner.run(conn.close(timeout=5))
    summary.seconds = time.monotonic() - clock.started
    clock.emit("done", **summary.to_dict())
    return summary


def _run(
    *,
    runner: asyncio.Runner,
    conn: asyncpg.Connection,
    clock: _Clock,
    target: JdbcTarget,
    jar: str | None,
    spark: Any | None,
    master: str,
    spark_conf: Mapping[str, str] | None,
    batch_size: int,
    partitions: int | None,
    lock_wait: float,
) -> None:
    summary = clock.summary
    store = CompactionStore(conn, summary.schema)
    runner.run(store.prepare())
    if not summary.dry_run:
        with clock.phase("lock"):
            runner.run(store.lock(lock_wait))
    with clock.phase("snapshot"):
        snap = runner.run(store.snapshot())
    summary.head = snap.head
    summary.as_of = snap.taken
    summary.low_water_before = summary.low_water_after = snap.low_water
    gc_cutoff = snap.taken - timedelta(seconds=summary.max_age)
    lag_cutoff = snap.taken - timedelta(seconds=summary.compaction_lag)
    clock.emit(
        "snapshot",
        head=list(snap.head),
        horizon=snap.horizon,
        blocks=snap.blocks,
        low_water=list(snap.low_water),
        gc_cutoff=gc_cutoff.isoformat(),
        lag_cutoff=lag_cutoff.isoformat(),
    )
    if snap.head == ORIGIN:
        return
    with contextlib.ExitStack() as stack:
        if spark is None:
            with clock.phase("spark"):
                spark = stack.enter_context(spark_session(master, jdbc_jar=jar, conf=spark_conf))
        parallelism = int(spark.sparkContext.defaultParallelism)
        wanted = partitions or max(parallelism, -(-snap.blocks // _BLOCKS_PER_PARTITION))
        if snap.server_version < _TID_RANGE_SCAN:
            wanted = 1  # ctid ranges would each be a full scan before PostgreSQL 14
        ranges = block_ranges(snap.blocks, min(wanted, _MAX_PARTITIONS))
        summary.partitions = len(ranges)
        table = f"{store.q}.feed"
        candidate = f"published >= {_ts(gc_cutoff)} AND published < {_ts(lag_cutoff)}"
        with clock.phase("scan-gc"):
            chunks, candidates = plan_garbage(
                spark,
                target,
                table,
                read_predicates(snap, ranges, f"published < {_ts(gc_cutoff)}"),
                width=batch_size,
                count_condition=f"{head_bound(snap)} AND {candidate}",
            )
        garbage = sum(c.rows for c in chunks)
        cand_preds = read_predicates(snap, ranges, candidate)
        run_id: int | None = None
        staging: str | None = None
        if not summary.dry_run:
            run_id = runner.run(store.begin_run(snap))
            summary.run_id = run_id
            staging = runner.run(store.create_staging(run_id))
        try:
            with clock.phase("scan-merge" if summary.dry_run else "scan-merge+stage"):
                counted = _plan_and_stage(spark, target, table, cand_preds, staging)
            if counted is None:
                assert run_id is not None
                with clock.phase("count" if store.page_walk else "index+count"):
                    runner.run(store.index_staging(run_id))
                    counted = runner.run(store.staging_counts(run_id))
            groups, updates, drops = counted
            summary.scanned = garbage + candidates
            summary.groups = groups
            clock.emit(
                "planned",
                scanned=summary.scanned,
                garbage=garbage,
                gc_batches=len(chunks),
                groups=groups,
                updates=updates,
                drops=drops,
            )
            if summary.dry_run or run_id is None:
                summary.collected, summary.merged, summary.rewritten = garbage, drops, updates
                summary.gc_batches = len(chunks)
                return
            clock.emit("staged", run_id=run_id, rows=updates + drops)

            def report(phase: str, number: int, rows: int) -> None:
                clock.emit("batch", phase=phase, batch=number, rows=rows)

            with clock.phase("apply-gc"):
                summary.collected = runner.run(store.apply_gc(chunks, gc_cutoff, report))
                summary.gc_batches = len(chunks)
            with clock.phase("apply-keep"):
                summary.rewritten = runner.run(store.apply_keepers(run_id, batch_size, report))
            with clock.phase("apply-merge"):
                summary.merged = runner.run(store.apply_drops(run_id, batch_size, report))
            summary.low_water_after = runner.run(store.low_water())
            runner.run(store.drop_staging(run_id))
            staging = None
            summary.seconds = time.monotonic() - clock.started
            runner.run(store.finish_run(run_id, json.dumps(summary.to_dict())))
            runner.run(store.unlock())
        finally:
            if staging is not None and run_id is not None:
                with contextlib.suppress(*_DB_ERRORS):
                    runner.run(store.drop_staging(run_id))
