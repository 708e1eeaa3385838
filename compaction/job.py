"""The Spark compaction and garbage-collection job: ``run_compaction``.

One run:

1. **lock + snapshot** (control connection, asyncpg): take the job's advisory
   lock; capture ``pg_snapshot_xmin`` (the horizon), the database clock, the
   head (newest entry below the horizon) and the table size. The run reads and
   changes nothing after the head; the age cutoffs are ``clock - max_age`` and
   ``clock - compaction_lag``.
2. **scope** (``scope``): a full run, or an incremental one that reads only
   what changed since the previous run (``runs`` keeps the run log and the
   index of kept entries).
3. **scan** (Spark, JDBC): the feed is read in parallel partitions -- heap
   page ranges for a full run; primary-key and ``published`` ranges, then the
   touched ids' previous keepers, for an incremental one. Garbage comes back as
   the bounds of the stretches that hold it; the merge candidates are grouped
   by ``(resource, changed_resource_id)`` and joined with their keepers
   (``frames``), and the verdicts go to a per-run unlogged staging table.
4. **apply** (control connection): the garbage walk, the announcement of the
   entries about to be widened, the keepers, (once the standbys have replayed
   them) the drops, and the index of kept entries, each batch its own short
   transaction (see ``apply``).

This module runs the steps in order; the Spark DataFrames of step 3 are built
in ``frames``, the PostgreSQL statements of steps 1 and 4 in ``apply``.

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
import random
import time
from collections.abc import Callable, Coroutine, Iterator, Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import asyncpg

from changefeed.durations import MIN_SECONDS, too_long
from changefeed.schemas import ORIGIN, Position, quote_schema
from changefeed.schemas.errors import ProtocolError

from .apply import CompactionStore, FeedSnapshot, SharedWalk
from .errors import CompactionError
from .frames import (
    KEEPER_READS,
    _ts,
    block_ranges,
    delta_conditions,
    delta_predicates,
    hot_filter,
    keepers_by_scan,
    old_keepers,
    read_feed,
    read_predicates,
    survey_feed,
    write_touched,
)
from .jdbc import JdbcTarget, find_jdbc_jar, jdbc_from_dsn
from .merge import (
    HOT_KEYS,
    HOT_MIN,
    KEY,
    group_sizes,
    hot_groups,
    merge_rows,
    write_merge,
)
from .plan import GcRegion
from .progress import NullProgress, Progress
from .runs import RunLog
from .scope import Cutoffs, Scope, choose_scope
from .session import spark_session
from .sparkwatch import watch_spark
from .summary import CompactionSummary

__all__ = ["CompactionSummary", "run_compaction"]

_BLOCKS_PER_PARTITION = 8192  # 64 MiB of heap per read partition
_MAX_PARTITIONS = 4096
_TID_RANGE_SCAN = 140000  # server_version_num with TID range scans
_CONNECT_TIMEOUT = 30.0


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


def check_keepers(keepers: str, name: str = "keepers") -> None:
    """Refuse a ``keepers`` the job does not know (``name``: what the caller calls it).

    Raises:
        CompactionError: not one of ``frames.KEEPER_READS``.
    """
    if keepers not in KEEPER_READS:
        raise CompactionError(f"{name} must be one of {', '.join(KEEPER_READS)}, got {keepers!r}")


def check_durations(
    max_age: float,
    compaction_lag: float,
    batch_size: int,
    *,
    names: tuple[str, str, str] = ("max_age", "compaction_lag", "batch_size"),
) -> None:
    """The job's rules for its arguments, each error naming the argument as ``names``
    does (the CLI passes its flags).

    Raises:
        CompactionError: an argument breaks a rule.
    """
    age_name, lag_name, batch_name = names
    for name, value in ((age_name, max_age), (lag_name, compaction_lag)):
        if not isinstance(value, int | float) or isinstance(value, bool) or not value > 0:
            raise CompactionError(f"{name} must be a positive number of seconds, got {value!r}")
        if value < MIN_SECONDS:
            raise CompactionError(f"{name} must be at least 1ms, got {value:g}s")
        if (why := too_long(value)) is not None:
            raise CompactionError(f"{name} {why}")
    if max_age < compaction_lag:
        raise CompactionError(
            f"{age_name} ({max_age:g}s) must not be shorter than {lag_name} "
            f"({compaction_lag:g}s): both keep the job away from the live head"
        )
    if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1:
        raise CompactionError(f"{batch_name} must be a positive integer, got {batch_size!r}")


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
    full: bool = False,
    replay_wait: float = 60.0,
    rng: random.Random | None = None,
    keepers: str = "auto",
) -> CompactionSummary:
    """Garbage-collect and compact one feed table with Spark; return what was done.

    Args:
        dsn: ``postgresql://user:pw@host:port/db`` of the feed database.
        schema: the feed's schema.
        max_age: seconds; older entries are deleted (the low-water mark rises).
        compaction_lag: seconds; older entries of one resource id are merged.
            Must not exceed ``max_age``. Any value is safe for listeners (the
            publishers follow the job's rewrite horizon, docs/compaction.md);
            a short one only moves more of the publishers' catch-up to the table.
        master: Spark master when the job starts its own session.
        dry_run: plan and count only; nothing is written.
        jdbc_jar: the PostgreSQL JDBC driver jar (default: found automatically).
        progress: told each phase, its total and what is done, and the
            run's facts (see ``progress.Progress``); the job prints nothing.
        spark: an existing SparkSession to use (it is not stopped; its class
            path must hold the JDBC driver); default: start one on ``master``.
        batch_size: entries per apply transaction (and per step of the garbage walk).
        partitions: read partitions (default: one per 64 MiB of heap, at
            least the default parallelism; an incremental run splits each of
            its reads in as many, at most).
        lock_wait: seconds to wait for another job's lock before giving up.
        spark_conf: extra Spark settings for a session the job starts.
        full: read the whole feed even when the previous run allows an
            incremental one (a dry run always plans a full run).
        replay_wait: seconds the drops wait for streaming standbys to replay
            the widened keepers; past that the run stops before the drops.
        rng: random source of the waits before a batch that met a lock is
            tried again; seed it in tests. None: a fresh ``random.Random()``.
        keepers: how an incremental run finds the previous keepers of the ids
            its changes touch: ``"lookup"`` (by the index of kept entries),
            ``"scan"`` (one scan of the feed), or ``"auto"``, which picks by
            how much of the feed the touched ids fill (``frames.LOOKUP_SHARE``).
            Both find the same entries; only the time differs.

    Must be called from a thread without a running event loop (in async code:
    ``await asyncio.to_thread(run_compaction, ...)``).

    Raises:
        CompactionError: bad arguments, another job running, or a failure on
            the way (the feed is consistent; run again to finish).
    """
    check_durations(max_age, compaction_lag, batch_size)
    check_keepers(keepers)
    if not replay_wait >= 0:
        raise CompactionError(f"replay_wait must not be negative, got {replay_wait!r}")
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
    settings = _Settings(
        batch_size,
        partitions,
        lock_wait,
        full or dry_run,
        replay_wait,
        rng or random.Random(),
        keepers,
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
                connect=lambda: asyncpg.connect(dsn, timeout=_CONNECT_TIMEOUT),
                clock=clock,
                target=target,
                jar=jar,
                spark=spark,
                master=master,
                spark_conf=spark_conf,
                settings=settings,
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


@dataclass(frozen=True, slots=True)
class _Settings:
    batch_size: int
    partitions: int | None
    lock_wait: float
    full: bool
    replay_wait: float
    rng: random.Random
    keepers: str


_MEMBERS = ("txid", "id", "resource", "changed_resource_id", "sub_resources")
_MEMBER_SCHEMA = (
    "txid long, id long, resource string, changed_resource_id string, sub_resources array<string>"
)


def _run(
    *,
    runner: asyncio.Runner,
    conn: asyncpg.Connection,
    connect: Callable[[], Coroutine[Any, Any, asyncpg.Connection]],
    clock: _Clock,
    target: JdbcTarget,
    jar: str | None,
    spark: Any | None,
    master: str,
    spark_conf: Mapping[str, str] | None,
    settings: _Settings,
) -> None:
    summary = clock.summary
    store = CompactionStore(conn, summary.schema, rng=settings.rng)
    runs = RunLog(conn, summary.schema)
    runner.run(store.prepare())
    if not summary.dry_run:
        with clock.phase("lock"):
            runner.run(store.lock(settings.lock_wait))
            runner.run(runs.ensure())
    with clock.phase("snapshot"):
        snap = runner.run(store.snapshot())
        previous = None if summary.dry_run else runner.run(runs.previous())
    summary.head = snap.head
    summary.as_of = snap.taken
    summary.low_water_before = summary.low_water_after = snap.low_water
    now = Cutoffs(
        snap.head,
        snap.taken - timedelta(seconds=summary.max_age),
        snap.taken - timedelta(seconds=summary.compaction_lag),
    )
    assert snap.feed_id is not None
    scope = (
        Scope(True, "a dry run plans a full run")
        if summary.dry_run
        else choose_scope(
            now,
            previous,
            horizon=snap.horizon,
            feed_id=snap.feed_id,
            max_age=summary.max_age,
            taken=snap.taken,
            full_requested=settings.full,
        )
    )
    summary.full, summary.scope = scope.full, scope.reason
    clock.note(
        "snapshot",
        head=list(snap.head),
        horizon=snap.horizon,
        blocks=snap.blocks,
        low_water=list(snap.low_water),
        gc_cutoff=now.gc.isoformat(),
        lag_cutoff=now.lag.isoformat(),
        full=scope.full,
        scope=scope.reason,
    )
    if snap.head == ORIGIN:
        return
    with contextlib.ExitStack() as stack:
        if spark is None:
            with clock.phase("spark"):
                spark = stack.enter_context(spark_session(master, jdbc_jar=jar, conf=spark_conf))
        run = _Run(
            clock=clock,
            runner=runner,
            connect=connect,
            spark=spark,
            target=target,
            store=store,
            settings=settings,
            snap=snap,
            now=now,
            scope=scope,
        )
        if not summary.dry_run:
            runner.run(store.drop_stale_staging())
            run.run_id = runner.run(
                runs.begin(now, scope, horizon=snap.horizon, feed_id=snap.feed_id)
            )
            summary.run_id = run.run_id
            stack.callback(run.drop_staging)
            run.staging = runner.run(store.create_staging(run.run_id))
        if scope.full:
            regions, cold, hot = run.scan_full()
        else:
            assert previous is not None and previous.names is not None  # choose_scope
            regions, cold, hot = run.scan_delta(previous.names)
        counts, through = run.merge(cold, hot)
        garbage = sum(r.rows for r in regions)
        summary.scanned = garbage + counts["members"]
        summary.groups = counts["groups"]
        clock.note(
            "planned",
            run_id=run.run_id,
            scanned=summary.scanned,
            garbage=garbage,
            gc_regions=len(regions),
            groups=counts["groups"],
            keys=counts["keys"],
            updates=counts["updates"],
            drops=counts["drops"],
            rewrites_through=list(through) if through else None,
        )
        if run.run_id is None:
            summary.collected, summary.merged = garbage, counts["drops"]
            summary.rewritten = counts["updates"]
            return
        run.apply(regions, counts, through)
        summary.seconds = time.monotonic() - clock.started
        runner.run(
            runs.finish(
                run.run_id, json.dumps(summary.to_dict()), kept=counts["keys"], names=run.names
            )
        )
        runner.run(store.unlock())


class _Run:
    """One run's scans, merge and apply step, once it knows its snapshot and scope."""

    def __init__(
        self,
        *,
        clock: _Clock,
        runner: asyncio.Runner,
        connect: Callable[[], Coroutine[Any, Any, asyncpg.Connection]],
        spark: Any,
        target: JdbcTarget,
        store: CompactionStore,
        settings: _Settings,
        snap: FeedSnapshot,
        now: Cutoffs,
        scope: Scope,
    ) -> None:
        self.clock = clock
        self.summary = clock.summary
        self.runner = runner
        self.connect = connect
        """Opens another connection to the feed's database."""
        self.spark = spark
        self.target = target
        self.store = store
        self.settings = settings
        self.snap = snap
        self.now = now
        self.scope = scope
        self.parallelism = int(spark.sparkContext.defaultParallelism)
        self.run_id: int | None = None
        self.staging: str | None = None
        self.names: list[str] = []
        """Every sub-resource name among the members (found while scanning)."""
        self.cached: list[Any] = []
        """DataFrames persisted for the merge, unpersisted after it."""

    def drop_staging(self) -> None:
        if self.run_id is not None:
            with contextlib.suppress(*_DB_ERRORS):
                self.runner.run(self.store.drop_staging(self.run_id))

    def scan_full(self) -> tuple[list[GcRegion], Any, Any | None]:
        """The whole feed: the garbage's bounds, and the merge candidates (the
        ordinary ids' and the hot ones', or None when none is hot)."""
        snap, now = self.snap, self.now
        wanted = self.settings.partitions or max(
            self.parallelism, -(-snap.blocks // _BLOCKS_PER_PARTITION)
        )
        if snap.server_version < _TID_RANGE_SCAN:
            wanted = 1  # ctid ranges would each be a full scan before PostgreSQL 14
        ranges = block_ranges(snap.blocks, min(wanted, _MAX_PARTITIONS))
        self.summary.partitions = len(ranges)
        table = f"{self.store.q}.feed"
        candidate = f"published >= {_ts(now.gc)} AND published < {_ts(now.lag)}"
        predicates = read_predicates(snap, ranges, candidate)
        with self.clock.spark_phase("scan-gc", self.spark):
            regions, self.names = survey_feed(
                self.spark,
                self.target,
                table,
                read_predicates(snap, ranges, f"published < {_ts(now.gc)}"),
                predicates,
            )
        if self.run_id is None:  # a dry run writes nothing, not even the hot groups
            return regions, read_feed(self.spark, self.target, table, predicates), None
        hot = self.runner.run(
            self.store.hot_groups(snap, now.gc, now.lag, hot_min=HOT_MIN, most=HOT_KEYS)
        )
        self.summary.hot = len(hot)
        if not hot:
            return regions, read_feed(self.spark, self.target, table, predicates), None
        marks = self.runner.run(self.store.create_hot(self.run_id, hot))

        def split(is_hot: bool) -> Any:
            only = hot_filter(marks, hot=is_hot)
            return read_feed(
                self.spark, self.target, table, [f"{p} AND {only}" for p in predicates]
            )

        return regions, split(False), split(True)

    def scan_delta(self, known: tuple[str, ...]) -> tuple[list[GcRegion], Any, Any | None]:
        """What changed since the previous run: the new garbage's bounds, and the merge
        members (the changes that are candidates, and the previous keepers of the
        ids they touch), the ordinary ids' and the hot ones'. ``known``: the
        sub-resource names the previous run recorded (its keepers name no other)."""
        from pyspark import StorageLevel
        from pyspark.sql import functions as F

        spark, store, scope, now, runner = self.spark, self.store, self.scope, self.now, self.runner
        assert self.run_id is not None
        parts = self.settings.partitions or self.parallelism
        predicates = delta_predicates(scope, now, parts)
        self.summary.partitions = len(predicates)
        with self.clock.spark_phase("scan-delta", spark):
            # Bounds and names, PostgreSQL's answers: nothing the merge does not need
            # crosses to Spark.
            regions = runner.run(store.delta_garbage(scope, now))
            changed_names = runner.run(store.delta_names(delta_conditions(scope, now)))
            self.names = sorted(set(known).union(changed_names))
            if not predicates:
                return regions, spark.createDataFrame([], _MEMBER_SCHEMA), None
            touched = runner.run(store.create_touched(self.run_id))
            # Read once, by the count below and then by the merge (unpersisted after it).
            changed = read_feed(spark, self.target, f"{store.q}.feed", predicates).select(*_MEMBERS)
            changed = changed.persist(StorageLevel.MEMORY_AND_DISK)
            self.cached.append(changed)
            # One count per touched group gives the touched table and the hot groups
            # (by the changes alone: a group's keeper adds one member, and which
            # groups are hot decides only how they are merged).
            sizes = group_sizes(changed).persist(StorageLevel.MEMORY_AND_DISK)
            try:
                write_touched(sizes, self.target, touched)
                hot = hot_groups(sizes)
            finally:
                sizes.unpersist()
            pages = runner.run(store.table_pages(touched))
            chosen = self.settings.keepers
            if chosen == "auto":
                scan = keepers_by_scan(pages, self.snap.blocks)
            else:
                scan = chosen == "scan"
            self.summary.keepers = "scanned" if scan else "looked up"
            kept = old_keepers(
                spark,
                self.target,
                feed=f"{store.q}.feed",
                keys=f"{store.q}.compaction_keys",
                touched=touched,
                pages=pages,
                feed_pages=self.snap.blocks,
                scan=scan,
                parts=parts,
                scope=scope,
                now=now,
            )
            members = changed.unionByName(kept.select(*_MEMBERS))
        self.summary.hot = len(hot)
        if not hot:
            return regions, members, None
        marks = F.broadcast(
            spark.createDataFrame(hot, "resource string, changed_resource_id string")
        )
        key = list(KEY)
        return regions, members.join(marks, key, "left_anti"), members.join(marks, key, "left_semi")

    def merge(self, cold: Any, hot: Any | None) -> tuple[dict[str, int], Position | None]:
        """Plan the merge into the staging table (a dry run: count it)."""
        name = "scan-merge" if self.summary.dry_run else "scan-merge+stage"
        with self.clock.spark_phase(name, self.spark):
            try:
                # A full run's names are the candidates' own (survey_feed); an
                # incremental run's partly come from the run log, which is checked.
                rows = merge_rows(cold, hot, self.names, checked=not self.scope.full)
                counted = write_merge(rows, self.target, self.staging)
            finally:
                for frame in self.cached:
                    frame.unpersist()
        if counted[0]["unnamed"]:
            raise CompactionError(
                f"{counted[0]['unnamed']} entries name sub-resources the merge was not given"
                " (the run log's names are incomplete); nothing was applied, and the next"
                " run reads the whole feed"
            )
        if self.run_id is not None:
            with self.clock.phase("survey" if self.store.page_walk else "index"):
                self.runner.run(self.store.index_staging(self.run_id))
                self.runner.run(self.store.survey_staging(self.run_id))
        return counted

    def apply(
        self, regions: list[GcRegion], counts: Mapping[str, int], through: Position | None
    ) -> None:
        """The apply step, batch by batch (see ``apply``), on two connections: the
        keepers and the drops on the control connection, meanwhile the garbage, the
        index of kept entries and then whatever drops are left on a second one.
        Each batch is one connection's alone, and each statement is safe in any
        order (docs/compaction.md); the database's second core does the other half."""
        summary, runner, store = self.summary, self.runner, self.store
        run_id = self.run_id
        assert run_id is not None
        report = self.clock.progress.advance
        batch = self.settings.batch_size
        side = runner.run(self.connect())
        try:
            aside = CompactionStore(side, summary.schema, rng=self.settings.rng)
            runner.run(aside.prepare())
            aside.share_survey(store)
            garbage, keys = _Deferred(), _Deferred()
            collected = asyncio.Event()
            drops = SharedWalk()
            drops_open = asyncio.Event()  # the keepers are in (and replayed)
            side_idle = asyncio.Event()  # the side holds no drop batch
            side_idle.set()
            merged_aside = [0]

            async def on_the_side() -> None:
                done = await aside.apply_gc(regions, self.now.gc, batch, garbage.advance)
                summary.collected, summary.gc_batches = done
                collected.set()
                full = self.scope.full
                await aside.apply_keys(run_id, full=full, batch_size=batch, report=keys.advance)
                await drops_open.wait()
                side_idle.clear()
                try:
                    merged_aside[0] = await aside.apply_drops(run_id, batch, report, drops)
                finally:
                    side_idle.set()

            meanwhile = runner.get_loop().create_task(on_the_side())
            try:
                with self.clock.phase("apply-keep", counts["updates"], "entries"):
                    if through is not None:
                        # Before any entry is widened: publishers must know which
                        # copies they hold may be older than the table.
                        self._raise_generation("announced", through)
                    summary.rewritten = runner.run(store.apply_keepers(run_id, batch, report))
                with self.clock.phase("apply-merge", counts["drops"], "entries"):
                    if counts["drops"]:
                        # A page a publisher read while the keepers were being
                        # widened carries the generation announced above, and may
                        # hold a keeper as it was: a listener that read the table
                        # after a drop must never be handed that page. A new
                        # generation, committed before the first drop, lets it go
                        # (also what a run killed mid-widening left behind). The
                        # horizon stays where the announcement put it.
                        self._raise_generation("sealed", through or ORIGIN)
                        wait = self.settings.replay_wait
                        summary.standbys = runner.run(store.wait_for_standbys(wait))
                    drops_open.set()
                    merged = runner.run(store.apply_drops(run_id, batch, report, drops))
                    runner.run(_first(side_idle, meanwhile))  # its last drop batch
                    summary.merged = merged + merged_aside[0]
                with self.clock.phase("apply-gc", sum(r.rows for r in regions), "entries"):
                    garbage.attach(report)
                    runner.run(_first(collected, meanwhile))
                with self.clock.phase("apply-keys", counts["keys"], "entries"):
                    keys.attach(report)
                    runner.run(_wait(meanwhile))
            finally:
                if not meanwhile.done():
                    meanwhile.cancel()
                    with contextlib.suppress(asyncio.CancelledError, *_DB_ERRORS):
                        runner.run(_wait(meanwhile))
        finally:
            with contextlib.suppress(*_DB_ERRORS):
                runner.run(side.close(timeout=5))
        summary.low_water_after = runner.run(store.low_water())
        runner.run(store.drop_staging(run_id))

    def _raise_generation(self, event: str, through: Position) -> None:
        """Raise the feed's rewrite generation, and its horizon to at least ``through``
        (``store.announce``, committed at once); record and report both."""
        generation, horizon = self.runner.run(self.store.announce(through))
        self.summary.rewrite_generation = generation
        self.summary.rewritten_through = horizon
        self.clock.note(event, generation=generation, rewritten_through=list(horizon))


class _Deferred:
    """Progress made on the side before its phase began, told once it begins."""

    def __init__(self) -> None:
        self._pending: list[int] = []
        self._report: Callable[[int], None] | None = None

    def advance(self, n: int) -> None:
        if self._report is None:
            self._pending.append(n)
        else:
            self._report(n)

    def attach(self, report: Callable[[int], None]) -> None:
        self._report = report
        for n in self._pending:
            report(n)
        self._pending.clear()


async def _wait(task: asyncio.Task[None]) -> None:
    await task


async def _first(event: asyncio.Event, task: asyncio.Task[None]) -> None:
    """Until ``event`` is set, or ``task`` has ended (raising what it raised)."""
    waiting = asyncio.ensure_future(event.wait())
    try:
        await asyncio.wait({waiting, task}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        waiting.cancel()
    if task.done() and not event.is_set():
        task.result()  # it failed before the event: its error
