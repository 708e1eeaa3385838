"""The compaction plan as Spark DataFrames: partitioned reads, garbage regions, merge, staging.

What a run reads (``scope``):

* a **full** run reads the whole feed up to its head as ranges of heap pages
  (``ctid``, a TID range scan each): the garbage's bounds (``garbage_regions``)
  in one scan, the merge candidates in another;
* an **incremental** run reads what changed (``delta_predicates``): the
  entries after the previous head by primary-key ranges, and those that aged
  into garbage or into the merge by ranges of the ``published`` index; then
  the previous keeper of every ``(resource, id)`` they touch, looked up in the
  index of kept entries (``old_keepers``).

The merge (``merge_rows``) is a ``groupBy`` of the members by ``(resource,
changed_resource_id)`` -- partial aggregation on the map side, so a hot id
costs nothing extra there -- and a join of the members with their group's
keeper to name the drops. The join sends the members of the few largest
groups (at most ``HOT_KEYS``, bounded metadata) nowhere: their keepers are
broadcast to every task, so a hot id is split across all the read's tasks
instead of landing on one; the rest is an ordinary shuffled join. Nothing
comes back to the driver but a handful of rows and the observed counts; the
verdicts go from the executors to the staging table (or, on a dry run,
nowhere). The rules are the ones in ``plan``; the PostgreSQL side is in
``apply``.
"""

from __future__ import annotations

import itertools
from datetime import datetime
from typing import Any

from changefeed.schemas import Position

from .apply import KIND_DROP, KIND_KEEP, KIND_KEY, STAGING_COLUMNS, FeedSnapshot
from .jdbc import JdbcTarget
from .plan import GcRegion
from .scope import Cutoffs, Scope

__all__ = [
    "HOT_KEYS",
    "HOT_MIN",
    "MERGE_COUNTS",
    "block_ranges",
    "delta_predicates",
    "garbage_regions",
    "head_bound",
    "merge_rows",
    "old_keepers",
    "read_feed",
    "read_predicates",
    "slices",
    "write_rows",
    "write_touched",
]

_FETCH_SIZE = 10_000
_WRITE_BATCH = 10_000
_APP = "changefeed-compaction"

HOT_MIN = 10_000
"""A group of at least this many members is *hot*: its members are not shuffled."""
HOT_KEYS = 256
"""The largest groups taken as hot, at most: their keepers are broadcast to every task."""

MERGE_COUNTS = ("groups", "keys", "members", "updates", "drops")
"""What ``merge_rows`` counts while the staging rows are written (``write_rows``)."""

_COLUMNS = "txid::text::bigint AS txid, id, resource, changed_resource_id, sub_resources, published"


def block_ranges(blocks: int, partitions: int) -> list[tuple[int, int | None]]:
    """Split pages ``[0, blocks)`` into ``partitions`` ranges; the last one is open-ended."""
    parts = max(1, min(partitions, max(blocks, 1)))
    bounds = [blocks * i // parts for i in range(parts)]
    return [(lo, bounds[i + 1] if i + 1 < parts else None) for i, lo in enumerate(bounds)]


def slices(lo: int, hi: int, parts: int) -> list[tuple[int, int]]:
    """``[lo, hi]`` split into at most ``parts`` consecutive non-empty ranges ``[a, b)``
    (the last one ends at ``hi + 1``)."""
    parts = max(1, min(parts, hi - lo + 1))
    bounds = [lo + (hi + 1 - lo) * i // parts for i in range(parts + 1)]
    return list(itertools.pairwise(bounds))


def _ts(value: datetime) -> str:
    # A datetime from the server's own clock, formatted: never text from input.
    return f"'{value.isoformat()}'::timestamptz"


def _pos(p: Position) -> str:
    return f"('{int(p.txid)}'::xid8, {int(p.id)})"


def head_bound(snapshot: FeedSnapshot) -> str:
    """SQL: the entry is at or before the snapshot's head."""
    return f"(txid, id) <= {_pos(snapshot.head)}"


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


def _time_slices(band: tuple[datetime, datetime], parts: int) -> list[tuple[datetime, datetime]]:
    start, end = band
    step = (end - start) / parts
    cuts = [start + step * i for i in range(parts)] + [end]
    return list(itertools.pairwise(cuts))


def delta_predicates(scope: Scope, now: Cutoffs, parts: int) -> list[str]:
    """One ``WHERE`` clause per partition of an incremental run's read (see ``scope``).

    After the previous head: ``parts`` ranges of transaction ids, each a range of
    the primary key, every entry older than the lag. At or before it: ``parts``
    slices of each band of publication times, each a range of the ``published``
    index.
    """
    assert not scope.full and scope.since is not None
    since, head = scope.since, now.head
    out = []
    if head > since:
        for lo, hi in slices(since.txid, head.txid, parts):
            out.append(
                f"(txid, id) > {_pos(since)} AND (txid, id) <= {_pos(head)}"
                f" AND txid >= '{int(lo)}'::xid8 AND txid < '{int(hi)}'::xid8"
                f" AND published < {_ts(now.lag)}"
            )
    for band in (scope.gc_band, scope.lag_band):
        if band is None:
            continue
        for start, end in _time_slices(band, parts):
            out.append(
                f"published >= {_ts(start)} AND published < {_ts(end)}"
                f" AND (txid, id) <= {_pos(since)}"
            )
    return out


def read_feed(spark: Any, target: JdbcTarget, table: str, predicates: list[str]) -> Any:
    """Entries of ``table`` (``txid`` as a number), one partition per predicate (each
    a ``WHERE`` clause on the table itself)."""
    from pyspark.sql import functions as F

    return spark.read.jdbc(
        url=target.url,
        table=table,
        predicates=predicates,
        properties=target.with_properties(fetchsize=str(_FETCH_SIZE), ApplicationName=_APP),
    ).select(
        F.col("txid").cast("long").alias("txid"),
        "id",
        "resource",
        "changed_resource_id",
        "sub_resources",
        "published",
    )


def garbage_regions(garbage: Any, since: Position | None = None) -> list[GcRegion]:
    """The stretches of the feed that hold ``garbage`` (rows with ``txid``, ``id``):
    one, or with ``since`` two -- at or before it, and after it (they may be far
    apart, and the walk between them would look at every entry in the gap).
    One row per stretch comes back to the driver."""
    from pyspark.sql import functions as F

    pos = F.struct("txid", "id")
    txid, id_ = F.col("txid"), F.col("id")
    side = (
        F.lit(False)
        if since is None
        else (txid > since.txid) | ((txid == since.txid) & (id_ > since.id))
    )
    rows = (
        garbage.groupBy(side.alias("after"))
        .agg(F.min(pos).alias("first"), F.max(pos).alias("last"), F.count(F.lit(1)).alias("rows"))
        .collect()
    )
    return sorted(
        (
            GcRegion(
                Position(int(r["first"]["txid"]), int(r["first"]["id"])),
                Position(int(r["last"]["txid"]), int(r["last"]["id"])),
                int(r["rows"]),
            )
            for r in rows
        ),
        key=lambda r: r.first,
    )


def old_keepers(
    spark: Any,
    target: JdbcTarget,
    *,
    feed: str,
    keys: str,
    touched: str,
    pages: int,
    parts: int,
    scope: Scope,
    now: Cutoffs,
) -> Any:
    """The previous keeper of every touched ``(resource, id)`` that is still a merge
    candidate outside the bands read already (``scope.kept_until``): one read per
    range of the touched table's pages, each looking the keys up by their index
    and the entries by the primary key."""
    assert scope.since is not None and scope.kept_until is not None
    reads: list[Any] = []
    for lo, hi in block_ranges(pages, parts):
        pages_of = f"t.ctid >= '({int(lo)},0)'::tid" + (
            f" AND t.ctid < '({int(hi)},0)'::tid" if hi is not None else ""
        )
        query = (
            f"(SELECT f.txid::text::bigint AS txid, f.id, f.resource, f.changed_resource_id,"
            f" f.sub_resources, f.published FROM {touched} t"
            f" JOIN {keys} k ON k.resource = t.resource"
            " AND k.changed_resource_id = t.changed_resource_id"
            f" JOIN {feed} f ON f.txid = k.txid::text::xid8 AND f.id = k.id"
            f" WHERE {pages_of} AND (f.txid, f.id) <= {_pos(scope.since)}"
            f" AND f.published >= {_ts(now.gc)} AND f.published < {_ts(scope.kept_until)}"
            f") AS kept_{len(reads)}"
        )
        reads.append(
            spark.read.jdbc(
                url=target.url,
                table=query,
                properties=target.with_properties(fetchsize=str(_FETCH_SIZE), ApplicationName=_APP),
            )
        )
    frame = reads[0]
    for read in reads[1:]:
        frame = frame.unionByName(read)
    return frame


def merge_rows(members: Any, *, hot_min: int = HOT_MIN, hot_keys: int = HOT_KEYS) -> Any:
    """The staging rows of a merge of ``members`` (``txid, id, resource,
    changed_resource_id, sub_resources``; no two rows at one position).

    Per ``(resource, changed_resource_id)``: the keeper (latest position), the
    union of sub-resources (none when any member is "whole resource"), and:

    * a ``KIND_KEY`` row: the group's keeper, for the index of kept entries;
    * a ``KIND_KEEP`` row when the keeper's sub-resources change;
    * a ``KIND_DROP`` row, with its keeper, for every other member.

    Returns ``STAGING_COLUMNS`` plus ``members`` (the group's size on its key
    row, 0 on the others), for the counts ``write_rows`` observes.
    """
    from pyspark.sql import functions as F

    pos = F.struct("txid", "id")
    m = members.select(
        "txid",
        "id",
        "resource",
        "changed_resource_id",
        F.array_sort(F.array_distinct("sub_resources")).alias("subs"),
    )
    key = ["resource", "changed_resource_id"]
    groups = (
        m.groupBy(*key)
        .agg(
            F.count(F.lit(1)).alias("n"),
            F.max(pos).alias("keep"),
            F.max_by("subs", pos).alias("keep_subs"),
            F.max((F.size("subs") == 0).cast("int")).alias("whole"),
            F.collect_set("subs").alias("sets"),
        )
        .select(
            *key,
            "n",
            "keep",
            "keep_subs",
            F.when(F.col("whole") == 1, F.array().cast("array<string>"))
            .otherwise(F.array_sort(F.array_distinct(F.flatten("sets"))))
            .alias("union"),
        )
    )
    none_long, none_subs, none_text = (
        F.lit(None).cast("long"),
        F.lit(None).cast("array<string>"),
        F.lit(None).cast("string"),
    )

    def rows(kind: int, frame: Any, **columns: Any) -> Any:
        values = {
            "kind": F.lit(kind).cast("short"),
            "txid": F.col("keep.txid"),
            "id": F.col("keep.id"),
            "keep_txid": none_long,
            "keep_id": none_long,
            "sub_resources": none_subs,
            "resource": none_text,
            "changed_resource_id": none_text,
            "members": F.lit(0).cast("long"),
            **columns,
        }
        return frame.select(*(values[c].alias(c) for c in (*STAGING_COLUMNS, "members")))

    keys = rows(
        KIND_KEY,
        groups,
        resource=F.col("resource"),
        changed_resource_id=F.col("changed_resource_id"),
        members=F.col("n"),
    )
    merged = groups.where(F.col("n") > 1)
    keepers = rows(
        KIND_KEEP,
        merged.where(F.col("keep_subs") != F.col("union")),
        sub_resources=F.col("union"),
    )
    hot = merged.where(F.col("n") >= hot_min).orderBy(F.desc("n")).limit(hot_keys)
    hot_keepers = F.broadcast(hot.select(*key, "keep"))
    cold = m.join(F.broadcast(hot.select(*key)), key, "left_anti").join(
        merged.select(*key, "keep"), key
    )
    dropped = m.join(hot_keepers, key).unionByName(cold).where(pos != F.col("keep"))
    drops = rows(
        KIND_DROP,
        dropped,
        txid=F.col("txid"),
        id=F.col("id"),
        keep_txid=F.col("keep.txid"),
        keep_id=F.col("keep.id"),
    )
    return keys.unionByName(keepers).unionByName(drops)


def write_rows(
    rows: Any, target: JdbcTarget | None, staging: str | None
) -> tuple[dict[str, int], Position | None]:
    """Write ``merge_rows``' rows to ``staging`` (None: a dry run, write nothing)
    and count them as they go.

    Returns:
        the counts of ``MERGE_COUNTS`` (``groups``: groups of two or more), and
        the newest keeper whose sub-resources change (None: none does).
    """
    from pyspark.sql import Observation
    from pyspark.sql import functions as F

    kind = F.col("kind")
    observed = Observation("merge")
    counted = rows.observe(
        observed,
        F.count(F.when((kind == KIND_KEY) & (F.col("members") > 1), 1)).alias("groups"),
        F.count(F.when(kind == KIND_KEY, 1)).alias("keys"),
        F.coalesce(F.sum("members"), F.lit(0)).alias("members"),
        F.count(F.when(kind == KIND_KEEP, 1)).alias("updates"),
        F.count(F.when(kind == KIND_DROP, 1)).alias("drops"),
        F.max(F.when(kind == KIND_KEEP, F.struct("txid", "id"))).alias("through"),
    ).select(*STAGING_COLUMNS)
    if staging is None or target is None:
        counted.write.format("noop").mode("overwrite").save()
    else:
        counted.write.jdbc(
            url=target.url,
            table=staging,
            mode="append",
            properties=target.with_properties(
                batchsize=str(_WRITE_BATCH),
                reWriteBatchedInserts="true",
                # No transaction per partition: each batch of inserts commits by
                # itself. A write transaction holds an xid, and while it is open
                # pg_snapshot_xmin -- the publishers' tailing horizon (I1) --
                # cannot pass it: one long staging transaction would stall every
                # tailer. A retried task may then stage a row twice; the apply
                # step is idempotent, and the summary counts what it applied.
                isolationLevel="NONE",
                ApplicationName=_APP,
            ),
        )
    got = observed.get
    through = got.get("through")
    return (
        {name: int(got[name] or 0) for name in MERGE_COUNTS},
        None if through is None else Position(int(through["txid"]), int(through["id"])),
    )


def write_touched(delta: Any, target: JdbcTarget, table: str) -> None:
    """Write the ``(resource, changed_resource_id)`` pairs of ``delta`` to ``table``, once each."""
    delta.select("resource", "changed_resource_id").distinct().write.jdbc(
        url=target.url,
        table=table,
        mode="append",
        properties=target.with_properties(
            batchsize=str(_WRITE_BATCH),
            reWriteBatchedInserts="true",
            isolationLevel="NONE",  # as for staging: no xid held open
            ApplicationName=_APP,
        ),
    )
