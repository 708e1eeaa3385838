"""What the compaction job reads, as Spark DataFrames: partitioned reads of the feed.

What a run reads (``scope``):

* a **full** run reads the whole feed up to its head as ranges of heap pages
  (``ctid``, a TID range scan each): PostgreSQL first returns, per range, the
  garbage's bounds and the sub-resource names among the merge candidates
  (``survey_feed``, a row each); then the candidates themselves, split into
  the ordinary ids and the hot ones (``read_feed`` with ``hot_filter``);
* an **incremental** run reads what changed (``delta_predicates``): the
  merge candidates after the previous head by primary-key ranges, and those
  that aged into the merge by ranges of the ``published`` index (PostgreSQL
  itself returns the new garbage's bounds and the changes' sub-resource
  names: ``CompactionStore.delta_garbage``, ``delta_names``); then the
  previous keeper of every ``(resource, id)`` they touch (``write_touched``,
  ``old_keepers``), looked up in the index of kept entries, or found by a
  scan of the feed when they are many.

Nothing comes back to the driver but those few rows. What is done with the
members is in ``merge``; the PostgreSQL side is in ``apply``.
"""

from __future__ import annotations

import itertools
from datetime import datetime
from typing import Any

from changefeed.schemas import Position

from .apply import KEEPER_HASH, FeedSnapshot
from .jdbc import JdbcTarget
from .plan import GcRegion
from .scope import Cutoffs, Scope

__all__ = [
    "KEEPER_READS",
    "block_ranges",
    "delta_conditions",
    "delta_predicates",
    "head_bound",
    "hot_filter",
    "keepers_by_scan",
    "old_keepers",
    "read_feed",
    "read_predicates",
    "slices",
    "survey_feed",
    "write_touched",
]

_FETCH_SIZE = 10_000
_WRITE_BATCH = 10_000
_APP = "changefeed-compaction"


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
    return [" AND ".join([*_page_terms(lo, hi), head, condition]) for lo, hi in ranges]


def _page_terms(lo: int, hi: int | None, table: str = "") -> list[str]:
    """SQL: the row (of ``table``, where a query names several) is on a page in
    ``[lo, hi)`` (``hi`` None: to the end)."""
    ctid = f"{table}.ctid" if table else "ctid"
    terms = [f"{ctid} >= '({int(lo)},0)'::tid"] if lo > 0 else []
    if hi is not None:
        terms.append(f"{ctid} < '({int(hi)},0)'::tid")
    return terms


def hot_filter(hot_table: str, *, hot: bool) -> str:
    """SQL: the entry's ``(resource, changed_resource_id)`` is (``hot``) or is not one
    of the hot groups the run wrote to ``hot_table``: the two reads of a full run
    are split where PostgreSQL reads, without either reading the other's rows."""
    test = (
        f"SELECT 1 FROM {hot_table} h WHERE h.resource = feed.resource"
        " AND h.changed_resource_id = feed.changed_resource_id"
    )
    return f"{'' if hot else 'NOT '}EXISTS ({test})"


def _time_slices(band: tuple[datetime, datetime], parts: int) -> list[tuple[datetime, datetime]]:
    start, end = band
    step = (end - start) / parts
    cuts = [start + step * i for i in range(parts)] + [end]
    return list(itertools.pairwise(cuts))


def _changed_after(since: Position, now: Cutoffs) -> str:
    # The bare txid bounds let the planner scan a range of the primary key: it
    # estimates a row comparison too coarsely to prefer the index over the table.
    return (
        f"txid >= '{int(since.txid)}'::xid8 AND txid <= '{int(now.head.txid)}'::xid8"
        f" AND (txid, id) > {_pos(since)} AND (txid, id) <= {_pos(now.head)}"
        f" AND published >= {_ts(now.gc)} AND published < {_ts(now.lag)}"
    )


def _aged_into_merge(start: datetime, end: datetime, since: Position) -> str:
    return f"published >= {_ts(start)} AND published < {_ts(end)} AND (txid, id) <= {_pos(since)}"


def delta_conditions(scope: Scope, now: Cutoffs) -> list[str]:
    """SQL, one condition per range: the merge candidates among what changed since
    the previous run (see ``scope``), garbage left out. After the previous head,
    a range of the primary key, every entry published in ``[gc, lag)``; at or
    before it, the band of publication times that aged into the merge, a range
    of the ``published`` index."""
    assert not scope.full and scope.since is not None
    out = [_changed_after(scope.since, now)] if now.head > scope.since else []
    if scope.lag_band is not None:
        out.append(_aged_into_merge(*scope.lag_band, scope.since))
    return out


def delta_predicates(scope: Scope, now: Cutoffs, parts: int) -> list[str]:
    """``delta_conditions`` split into one ``WHERE`` clause per partition of an
    incremental run's read of its changes (``CompactionStore.delta_garbage``
    bounds the garbage left out): after the previous head, ``parts`` ranges of
    transaction ids; at or before it, ``parts`` slices of the band of
    publication times that aged into the merge."""
    assert not scope.full and scope.since is not None
    since, head = scope.since, now.head
    out = []
    if head > since:
        for lo, hi in slices(since.txid, head.txid, parts):
            out.append(
                f"{_changed_after(since, now)}"
                f" AND txid >= '{int(lo)}'::xid8 AND txid < '{int(hi)}'::xid8"
            )
    if scope.lag_band is not None:
        out += [_aged_into_merge(a, b, since) for a, b in _time_slices(scope.lag_band, parts)]
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


LOOKUP_SHARE = 100
"""An incremental run looks its previous keepers up one by one (two index probes
each) while the pages of the ids its changes touch are at most 1/LOOKUP_SHARE of
the feed's pages; past that, it scans the feed once. A touched page holds some
185 ids (as many lookups) where a feed page holds some 74 entries to scan, and a
lookup costs about as much as scanning a few dozen entries. The threshold errs
towards the scan: where a third of the ids were touched, the two cost the same
(``bench/compaction.py --keepers both``; docs/compaction.md has the figures).
Both forms give the same result (tests/test_compaction_spark.py runs each)."""


KEEPER_READS = ("auto", "lookup", "scan")
"""The ways an incremental run may be told to find previous keepers (``keepers=``)."""


def keepers_by_scan(touched_pages: int, feed_pages: int) -> bool:
    """Whether ``old_keepers`` scans the feed (True) or looks each keeper up (False)."""
    return touched_pages * LOOKUP_SHARE > feed_pages


def old_keepers(
    spark: Any,
    target: JdbcTarget,
    *,
    feed: str,
    keys: str,
    touched: str,
    pages: int,
    feed_pages: int,
    scan: bool,
    parts: int,
    scope: Scope,
    now: Cutoffs,
) -> Any:
    """The previous keeper of every touched ``(resource, id)`` that is still a merge
    candidate outside the bands read already (``scope.kept_until``), in ``parts``
    reads.

    Where it was kept, a finished run left that group no other entry, so either
    way of finding it finds the same (``scan``: ``keepers_by_scan`` picks):

    * **looked up**: each read takes a range of the touched table's pages and
      looks the keys up by the index of kept entries, and the entries by the
      primary key;
    * **scanned**: each read takes a range of the feed's pages and keeps the
      entries of the touched groups (a hash of the touched table). Split by the
      touched table instead, every read would scan the whole feed.
    """
    assert scope.since is not None and scope.kept_until is not None
    band = (
        f"(f.txid, f.id) <= {_pos(scope.since)}"
        f" AND f.published >= {_ts(now.gc)} AND f.published < {_ts(scope.kept_until)}"
    )
    columns = (
        "f.txid::text::bigint AS txid, f.id, f.resource, f.changed_resource_id,"
        " f.sub_resources, f.published"
    )
    queries: list[str] = []
    if scan:
        for lo, hi in block_ranges(feed_pages, parts):
            where = " AND ".join([*_page_terms(lo, hi, "f"), band])
            queries.append(
                f"SELECT {columns} FROM {feed} f WHERE {where}"
                f" AND EXISTS (SELECT 1 FROM {touched} t WHERE t.resource = f.resource"
                " AND t.changed_resource_id = f.changed_resource_id)"
            )
    else:
        for lo, hi in block_ranges(pages, parts):
            where = " AND ".join([*_page_terms(lo, hi, "t"), band])
            queries.append(
                f"SELECT {columns} FROM {touched} t"
                f" JOIN {keys} k ON k.h = {KEEPER_HASH.format(table='t')}"
                f" JOIN {feed} f ON f.txid = k.txid::text::xid8 AND f.id = k.id"
                " AND f.resource = t.resource AND f.changed_resource_id = t.changed_resource_id"
                f" WHERE {where}"
            )
    reads = [
        spark.read.jdbc(
            url=target.url,
            table=f"({query}) AS kept_{i}",
            properties=target.with_properties(fetchsize=str(_FETCH_SIZE), ApplicationName=_APP),
        )
        for i, query in enumerate(queries)
    ]
    frame = reads[0]
    for read in reads[1:]:
        frame = frame.unionByName(read)
    return frame


def write_touched(groups: Any, target: JdbcTarget, table: str) -> None:
    """Write the ``(resource, changed_resource_id)`` pairs of ``groups`` (one row each
    already: ``merge.group_sizes``) to ``table``."""
    groups.select("resource", "changed_resource_id").write.jdbc(
        url=target.url,
        table=table,
        mode="append",
        properties=target.with_properties(
            batchsize=str(_WRITE_BATCH),
            reWriteBatchedInserts="true",
            isolationLevel="NONE",  # as for staging (merge.write_merge): no xid held open
            ApplicationName=_APP,
        ),
    )
