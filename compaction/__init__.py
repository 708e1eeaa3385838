"""Compaction and garbage collection of the feed table with Spark, safe beside live publishers.

``run_compaction`` (module ``job``) is the entry point the ``changefeed compact``
command calls. The rules are in ``plan`` (pure code, also the reference the
tests hold the Spark job to), what a run reads -- the whole feed, or what
changed since the last run -- in ``scope`` (pure), the reads as Spark
DataFrames in ``frames`` and the merge in ``merge``, the Spark session in
``session``, the DSN-to-JDBC conversion in ``jdbc``, the PostgreSQL side
(snapshot, staging, batched apply) in ``apply``, the job's own state (run
log, index of kept entries) in ``runs``, what a run did in ``summary``, the
exceptions in ``errors``. The
job reports through a ``Progress`` (``progress``), rendered as log lines
(``progress_log``) or terminal bars (``progress_rich``, which needs rich and
is not imported here); ``sparkwatch`` feeds it Spark's task counts.
docs/compaction.md explains the algorithm and why invariant I5 holds.

The job depends on the feed's SQL (``changefeed.schemas``) and never on the
publisher: an API that embeds the publisher ships none of this. Importing this
package does not import pyspark; ``run_compaction`` does.
"""

from changefeed.extras import missing_extra

try:
    import asyncpg  # noqa: F401
except ModuleNotFoundError as exc:  # a listener-only install: say what to install
    raise missing_extra("changefeed.compaction", "spark", exc) from exc

from .apply import COMPACTION_LOCK_KEY, CompactionStore, FeedSnapshot
from .durations import parse_duration
from .errors import CompactionError
from .jdbc import JdbcTarget, find_jdbc_jar, jdbc_from_dsn
from .job import check_durations, check_keepers, run_compaction
from .plan import (
    GcRegion,
    Notification,
    Plan,
    PlanEntry,
    covers,
    merge_subs,
    notifications,
    plan_feed,
    simulate,
    uncovered,
)
from .progress import NullProgress, Progress
from .progress_log import LogProgress
from .runs import RunLog
from .scope import Cutoffs, PreviousRun, Scope, choose_scope
from .session import check_master_form, spark_session
from .summary import CompactionSummary

__all__ = [
    "COMPACTION_LOCK_KEY",
    "CompactionError",
    "CompactionStore",
    "CompactionSummary",
    "Cutoffs",
    "FeedSnapshot",
    "GcRegion",
    "JdbcTarget",
    "LogProgress",
    "Notification",
    "NullProgress",
    "Plan",
    "PlanEntry",
    "PreviousRun",
    "Progress",
    "RunLog",
    "Scope",
    "check_durations",
    "check_keepers",
    "check_master_form",
    "choose_scope",
    "covers",
    "find_jdbc_jar",
    "jdbc_from_dsn",
    "merge_subs",
    "notifications",
    "parse_duration",
    "plan_feed",
    "run_compaction",
    "simulate",
    "spark_session",
    "uncovered",
]
