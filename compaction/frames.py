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
from dataclasses import dataclass
from datetime import datetime
from decimal import Decimal
from typing import Any

from changefeed.schemas import Position

from .apply import KIND_DROP, KIND_KEEP, FeedSnapshot
from .jdbc import JdbcTarget
from .plan import GcRegion
from .scope import Cutoffs, Scope

__all__ = [
    "HOT_KEYS",
    "HOT_MIN",
    "MERGE_COUNTS",
    "Merge",
    "block_ranges",
    "delta_predicates",
    "garbage_regions",
    "head_bound",
    "merge_rows",
    "old_keepers",
    "read_feed",
    "read_predicates",
    "slices",
    "survey_feed",
    "vocabulary",
    "write_merge",
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


def survey_feed(
    spark: Any,
    target: JdbcTarget,
    table: str,
    garbage: list[str],
    candidates: list[str],
) -> tuple[list[GcRegion], list[str]]:
    """A full run's first look at the feed, partition by partition, done by
    PostgreSQL: the stretch that holds the garbage (``garbage[i]`` selects
    partition i's), and the sub-resource names among the merge candidates
    (``candidates[i]``). Each partition returns a row, and a row per name.

    The stretch is ``[(lowest txid, 0), (highest txid, highest id)]``: it holds
    every garbage entry, and the walk over it takes the few others at its
    ends in its stride.
    """
    from functools import reduce

    reads = [
        spark.read.jdbc(
            url=target.url,
            table=(
                "(SELECT min(txid::text::bigint) AS lo, max(txid::text::bigint) AS hi,"
                f" max(id) AS top, count(*) AS n, NULL::text AS name FROM {table}"
                f" WHERE {old} UNION ALL SELECT DISTINCT NULL::bigint, NULL::bigint,"
                f" NULL::bigint, NULL::bigint, s FROM {table}, unnest(sub_resources) AS u(s)"
                f" WHERE {young}) AS survey_{i}"
            ),
            properties=target.with_properties(ApplicationName=_APP),
        )
        for i, (old, young) in enumerate(zip(garbage, candidates, strict=True))
    ]
    rows = reduce(lambda a, b: a.unionByName(b), reads).collect()
    names = sorted({str(r["name"]) for r in rows if r["name"] is not None})
    counted = [r for r in rows if r["name"] is None and r["n"]]
    if not counted:
        return [], names
    region = GcRegion(
        Position(min(int(r["lo"]) for r in counted), 0),
        Position(max(int(r["hi"]) for r in counted), max(int(r["top"]) for r in counted)),
        sum(int(r["n"]) for r in counted),
    )
    return [region], names


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


_POSITION_SPAN = 1 << 63
"""A position as one number, ``txid * 2**63 + id`` (a decimal of 38 digits): its
maximum is an ordinary hash aggregate, where a maximum of a (txid, id) struct
falls back to sorting every group."""


def vocabulary(members: Any) -> list[str]:
    """Every sub-resource name among ``members``, sorted (bounded metadata: a feed
    names a handful)."""
    from pyspark.sql import functions as F

    rows = members.select(F.explode("sub_resources").alias("s")).distinct().collect()
    return sorted(str(r["s"]) for r in rows)


@dataclass(frozen=True, slots=True)
class Merge:
    """The merge of a set of members, as DataFrames (see ``merge_rows``).

    Attributes:
        keys: one row per ``(resource, changed_resource_id)``: its keeper after
            the merge (``txid``, ``id``) and its size (``members``).
        changes: ``STAGING_COLUMNS`` rows: keepers whose sub-resources change,
            and drops with their keeper.
        cached: what both read, cached; ``release`` it once both are written.
    """

    keys: Any
    changes: Any
    cached: tuple[Any, ...]

    def release(self) -> None:
        for frame in self.cached:
            frame.unpersist()


def merge_rows(
    members: Any, names: list[str], *, hot_min: int = HOT_MIN, hot_keys: int = HOT_KEYS
) -> Merge:
    """The merge of ``members`` (``txid, id, resource, changed_resource_id,
    sub_resources``; no two rows at one position), whose sub-resources are among
    ``names`` (``vocabulary``).

    Each member becomes a slim row: its position as one number, "whole
    resource", and its sub-resources as bitmasks over ``names`` (63 a word).
    Per ``(resource, changed_resource_id)``, one hash aggregate: the size, the
    keeper (the latest position), whether any member is the whole resource,
    and the union (``bit_or``). Then a hash join of the members with the groups
    of two or more names every drop's keeper, and finds the keepers whose
    sub-resources change (their masks differ from the union's); the largest
    groups' keepers are broadcast instead. Only the union of a keeper that
    changes is turned back into names.
    """
    from pyspark import StorageLevel
    from pyspark.sql import functions as F

    words = [names[w : w + 63] for w in range(0, len(names), 63)]
    masks = [f"mask{w}" for w in range(len(words))]
    span = F.lit(Decimal(_POSITION_SPAN)).cast("decimal(38,0)")
    key = ["resource", "changed_resource_id"]

    def mask(chunk: list[str]) -> Any:
        value = F.lit(0).cast("long")
        for bit, name in enumerate(chunk):
            value = value.bitwiseOR(
                F.when(F.array_contains("sub_resources", name), F.lit(1 << bit)).otherwise(0)
            )
        return value

    m = members.select(
        *key,
        "txid",
        "id",
        (F.col("txid").cast("decimal(38,0)") * span + F.col("id"))
        .cast("decimal(38,0)")
        .alias("pos"),
        (F.size("sub_resources") == 0).alias("whole"),
        *(mask(chunk).alias(c) for chunk, c in zip(words, masks, strict=True)),
    ).persist(StorageLevel.MEMORY_AND_DISK)
    groups = (
        m.groupBy(*key)
        .agg(
            F.count(F.lit(1)).alias("n"),
            F.max("pos").alias("keep"),
            F.max(F.col("whole").cast("int")).alias("any_whole"),
            *(F.bit_or(c).alias(f"u{c}") for c in masks),
        )
        # Once: the keys, the keepers and the drops all read it, and each would
        # otherwise aggregate the members again.
        .persist(StorageLevel.MEMORY_AND_DISK)
    )

    def position(column: str) -> tuple[Any, Any]:
        value = F.col(column)
        return F.floor(value / span).cast("long"), F.pmod(value, span).cast("long")

    keep_txid, keep_id = position("keep")
    keys = groups.select(
        *key, keep_txid.alias("txid"), keep_id.alias("id"), F.col("n").alias("members")
    )
    merged = groups.where(F.col("n") > 1).drop("n")
    hot = groups.where(F.col("n") >= hot_min).orderBy(F.desc("n")).limit(hot_keys).drop("n")
    cold = m.join(F.broadcast(hot.select(*key)), key, "left_anti").join(
        merged.hint("shuffle_hash"), key
    )
    joined = m.join(F.broadcast(hot), key).unionByName(cold)
    kept = F.col("pos") == F.col("keep")
    whole = F.col("any_whole") == 1
    differs = F.lit(False)
    for c in masks:
        differs = differs | (F.col(c) != F.col(f"u{c}"))
    widened = (whole & ~F.col("whole")) | (~whole & differs)
    union = F.concat(
        F.array().cast("array<string>"),
        *(
            F.when(F.col(f"u{c}").bitwiseAND(1 << bit) != 0, F.array(F.lit(name))).otherwise(
                F.array().cast("array<string>")
            )
            for chunk, c in zip(words, masks, strict=True)
            for bit, name in enumerate(chunk)
        ),
    )
    none_long = F.lit(None).cast("long")
    # One pass over the join: the keepers whose sub-resources change, and the drops.
    changes = joined.where(~kept | widened).select(
        F.when(kept, F.lit(KIND_KEEP)).otherwise(F.lit(KIND_DROP)).cast("short").alias("kind"),
        "txid",
        "id",
        F.when(kept, none_long).otherwise(keep_txid).alias("keep_txid"),
        F.when(kept, none_long).otherwise(keep_id).alias("keep_id"),
        F.when(kept & whole, F.array().cast("array<string>"))
        .when(kept, union)
        .otherwise(F.lit(None).cast("array<string>"))
        .alias("sub_resources"),
    )
    return Merge(keys, changes, (groups, m))


_JDBC_WRITE = {
    "batchsize": str(_WRITE_BATCH),
    "reWriteBatchedInserts": "true",
    # No transaction per partition: each batch of inserts commits by itself. A
    # write transaction holds an xid, and while it is open pg_snapshot_xmin -- the
    # publishers' tailing horizon (I1) -- cannot pass it: one long staging
    # transaction would stall every tailer. A retried task may then stage a row
    # twice; the apply step is idempotent, and the summary counts what it applied.
    "isolationLevel": "NONE",
    "ApplicationName": _APP,
}


def _write(frame: Any, target: JdbcTarget | None, table: str | None) -> None:
    if table is None or target is None:
        frame.write.format("noop").mode("overwrite").save()
    else:
        frame.write.jdbc(
            url=target.url,
            table=table,
            mode="append",
            properties=target.with_properties(**_JDBC_WRITE),
        )


def write_merge(
    merge: Merge, target: JdbcTarget | None, *, keys: str | None, staging: str | None
) -> tuple[dict[str, int], Position | None]:
    """Write the merge's keys to ``keys`` and its changes to ``staging`` (None: a dry
    run, write nothing), counting them as they go.

    Returns:
        the counts of ``MERGE_COUNTS`` (``groups``: groups of two or more), and
        the newest keeper whose sub-resources change (None: none does).
    """
    from pyspark.sql import Observation
    from pyspark.sql import functions as F

    counted_keys = Observation("keys")
    _write(
        # Sorted by key (a range-partitioned sort): the apply step then inserts
        # them in about the order of the index of kept entries.
        merge.keys.orderBy("resource", "changed_resource_id")
        .observe(
            counted_keys,
            F.count(F.lit(1)).alias("keys"),
            F.count(F.when(F.col("members") > 1, 1)).alias("groups"),
            F.coalesce(F.sum("members"), F.lit(0)).alias("members"),
        )
        .drop("members"),
        target,
        keys,
    )
    kind = F.col("kind")
    counted = Observation("changes")
    _write(
        merge.changes.observe(
            counted,
            F.count(F.when(kind == KIND_KEEP, 1)).alias("updates"),
            F.count(F.when(kind == KIND_DROP, 1)).alias("drops"),
            F.max(F.when(kind == KIND_KEEP, F.struct("txid", "id"))).alias("through"),
        ),
        target,
        staging,
    )
    got = {**counted_keys.get, **counted.get}
    through = got.get("through")
    return (
        {name: int(got[name] or 0) for name in MERGE_COUNTS},
        None if through is None else Position(int(through["txid"]), int(through["id"])),
    )


def write_touched(delta: Any, target: JdbcTarget, table: str) -> None:
    """Write the ``(resource, changed_resource_id)`` pairs of ``delta`` to ``table``, once each."""
    _write(delta.select("resource", "changed_resource_id").distinct(), target, table)
