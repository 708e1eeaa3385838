"""Entry script for ``spark-submit``: run the job inside the session spark-submit made.

On a cluster, spark-submit owns the master, the executors and the class path
(``--packages org.postgresql:postgresql:<version>``); this script only builds
the session from that configuration and calls :func:`run_compaction` with it::

    spark-submit --master yarn --packages org.postgresql:postgresql:42.7.4 \\
        "$(python -c 'import changefeed.compaction.submit as m; print(m.__file__)')" \\
        --dsn postgresql://compactor@db.internal:5432/app --max-age 24h --compaction-lag 10m

The executors run no Python: every step is a DataFrame operation, so they need
the JDBC driver and network access to PostgreSQL, not changefeed. The driver
needs changefeed (and asyncpg) installed. The summary goes to stdout, and
with ``--progress`` the job's phases and progress go to stderr as JSON log
lines (``progress_log``).
"""

from __future__ import annotations

import argparse
import sys

from changefeed.compaction.durations import parse_duration
from changefeed.compaction.errors import CompactionError
from changefeed.compaction.frames import KEEPER_READS
from changefeed.compaction.job import run_compaction
from changefeed.compaction.progress_log import LogProgress
from changefeed.logs import configure_logging

__all__ = ["main"]


def _duration(text: str) -> float:
    try:
        return parse_duration(text)
    except CompactionError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def main(argv: list[str] | None = None) -> int:
    """Parse arguments, run the job in the spark-submit session; 0 on success, 1 on failure."""
    parser = argparse.ArgumentParser(
        prog="changefeed-compaction", description="Compact and garbage-collect a changefeed feed."
    )
    parser.add_argument("--dsn", required=True, help="postgresql://user@host:port/db (PGPASSWORD)")
    parser.add_argument("--schema", default="changefeed")
    parser.add_argument("--max-age", type=_duration, default=86400.0, help="default 24h")
    parser.add_argument("--compaction-lag", type=_duration, default=600.0, help="default 10m")
    parser.add_argument("--batch-size", type=int, default=5000)
    parser.add_argument("--partitions", type=int, default=None)
    parser.add_argument("--dry-run", action="store_true")
    parser.add_argument("--full", action="store_true", help="read the whole feed")
    parser.add_argument("--replay-wait", type=_duration, default=60.0, help="default 60s")
    parser.add_argument("--keepers", choices=KEEPER_READS, default="auto")
    parser.add_argument(
        "--progress", action="store_true", help="progress as JSON log lines on stderr"
    )
    args = parser.parse_args(argv)

    from pyspark.sql import SparkSession

    configure_logging("info", json_output=True)
    spark = SparkSession.builder.appName("changefeed-compaction").getOrCreate()
    try:
        summary = run_compaction(
            args.dsn,
            schema=args.schema,
            max_age=args.max_age,
            compaction_lag=args.compaction_lag,
            dry_run=args.dry_run,
            spark=spark,
            batch_size=args.batch_size,
            partitions=args.partitions,
            progress=LogProgress() if args.progress else None,
            full=args.full,
            replay_wait=args.replay_wait,
            keepers=args.keepers,
        )
    except CompactionError as exc:
        print(f"changefeed-compaction: {exc}", file=sys.stderr)
        return 1
    finally:
        spark.stop()
    print(summary.to_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
