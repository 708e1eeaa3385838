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

This module runs the steps in order; the Spark DataFrames of steps 2-4 are
built in ``frames``, the PostgreSQL statements of steps 1 and 5 in ``apply``.

The job prints nothing; it reports through a ``Progress`` (module ``progress``):
each step above is a phase, with its total where the job knows it -- Spark
tasks for the scans (from Spark's status tracker, see ``sparkwatch``),
entries for the apply step. Spark is started
quietly on one machine (loopback only, UI off, log level WARN, scratch space
under the temp dir; see ``session``) unless a session is handed in.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import json
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

import asyncpg

from changefeed.schemas import ORIGIN, Position, quote_schema
from changefeed.schemas.errors import ProtocolError

from .apply import CompactionStore
from .durations import format_duration
from .errors import CompactionError
from .frames import _plan_and_stage, _ts, block_ranges, head_bound, plan_garbage, read_predicates
from .jdbc import JdbcTarget, find_jdbc_jar, jdbc_from_dsn
from .progress import NullProgress, Progress
from .session import spark_session
from .sparkwatch import watch_spark

__all__ = ["CompactionSummary", "run_compaction"]

_BLOCKS_PER_PARTITION = 8192  # 64 MiB of heap per read partition
_MAX_PARTITIONS = 4096
_TID_RANGE_SCAN = 140000  # server_version_num with TID range scans
_CONNECT_TIMEOUT = 30.0


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
                f"  collected     {verb} {self.collected:,} older than"
                f" {format_duration(self.max_age)} in {self.gc_batches:,} batches",
                f"  merged        {verb} {self.merged:,} into later entries of {self.groups:,}"
                f" resource ids ({self.rewritten:,} rewritten with the union),"
                f" older than {format_duration(self.compaction_lag)}",
                f"  time          {phases}  total {self.seconds:.1f}s",
            ]
        )


def _pos(p: Position) -> str:
    return f"({p.txid}, {p.id})"


# --------------------------------------------------------------------------- the run


class _Clock:
    """Times the phases into the summary and tells ``progress`` where the run is."""

    def __init__(self, summary: CompactionSummary, progress: Progress) -> None:
        self.summary = summary
        self.progress = progress
        self.started = time.monotonic()

    def note(self, event: str, **fields: Any) -> None:
        self.progress.note(event, fields)

    @contextlib.contextmanager
    def phase(self, name: str, total: int | None = None, unit: str | None = None) -> Iterator[None]:
        self.progress.phase(name, total, unit)
        t0 = time.monotonic()
        try:
            yield
        finally:
            took = time.monotonic() - t0
            self.summary.phases[name] = self.summary.phases.get(name, 0.0) + took
            self.progress.end_phase()

    @contextlib.contextmanager
    def spark_phase(self, name: str, spark: Any) -> Iterator[None]:
        """A phase of Spark actions, counted in Spark tasks as Spark plans them."""
        with self.phase(name, unit="tasks"), watch_spark(spark, self.progress):
            yield


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
        progress: told each phase, its total and what is done, and the
            run's facts (see ``progress.Progress``); the job prints nothing.
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
    clock = _Clock(summary, progress or NullProgress())
    clock.note("start", url=target.url, schema=schema, dry_run=dry_run, master=master)
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
    clock.note("done", **summary.to_dict())
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
    clock.note(
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
        with clock.spark_phase("scan-gc", spark):
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
            with clock.spark_phase("scan-merge" if summary.dry_run else "scan-merge+stage", spark):
                counted = _plan_and_stage(spark, target, table, cand_preds, staging)
            if counted is None:
                assert run_id is not None
                with clock.phase("count" if store.page_walk else "index+count"):
                    runner.run(store.index_staging(run_id))
                    counted = runner.run(store.staging_counts(run_id))
            groups, updates, drops = counted
            summary.scanned = garbage + candidates
            summary.groups = groups
            clock.note(
                "planned",
                run_id=run_id,
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
            report = clock.progress.advance
            with clock.phase("apply-gc", garbage, "entries"):
                summary.collected = runner.run(store.apply_gc(chunks, gc_cutoff, report))
                summary.gc_batches = len(chunks)
            with clock.phase("apply-keep", updates, "entries"):
                summary.rewritten = runner.run(store.apply_keepers(run_id, batch_size, report))
            with clock.phase("apply-merge", drops, "entries"):
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
