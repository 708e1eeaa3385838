"""The compaction plan as Spark DataFrames: partitioned reads, garbage chunks, merge, staging.

Each partition reads a range of heap pages (``ctid``) bounded to the
snapshot's head; garbage comes back as chunk bounds only, and the merge
verdicts go straight from the executors to the staging table (or, on a dry
run, come back as three counts). The rules are the ones in ``plan``; the
PostgreSQL side is in ``apply``.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from changefeed.schemas import Position

from .apply import KIND_DROP, KIND_KEEP, FeedSnapshot
from .jdbc import JdbcTarget
from .plan import GcChunk

__all__ = [
    "block_ranges",
    "head_bound",
    "merge_frame",
    "plan_garbage",
    "read_predicates",
    "staging_rows",
]

_FETCH_SIZE = 10_000
_WRITE_BATCH = 10_000


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
