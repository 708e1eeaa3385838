"""The merge as Spark DataFrames: members in, staging rows out, in one shuffle.

Each member becomes a slim row (``slim``): its position, "whole resource",
and its sub-resources as bitmasks over the names the run was given (63 a
word, built with ``array_contains``). No per-row set arrays: a union is a
``bit_or``. A member naming a sub-resource outside them is counted
(``unnamed``), never silently left out of a union.

* **Ordinary ids** go through one shuffle by ``(resource,
  changed_resource_id)`` and a window over each group, ordered newest first:
  the sort that brings a group together also puts its keeper (the latest
  position) first, so the window's scalar aggregates (size, keeper = the first
  row's position, "any member is the whole resource", union) cost no
  arithmetic per member, and every member learns its group's verdict where it
  stands.
* **Hot ids** -- at most ``HOT_KEYS`` groups of ``HOT_MIN`` members or more,
  found beforehand (bounded metadata) -- are not shuffled at all: a
  ``groupBy`` aggregates them on the map side (one partial row per task and
  id), and the totals, a few rows, are broadcast back to their members, in
  every task that read some. A hot id costs every task a share of it instead
  of one task all of it. Their keeper is the maximum of the position as one
  number (``txid * 2^63 + id``, a 38-digit decimal): an ordinary aggregate,
  where a maximum of a ``(txid, id)`` struct would sort the members.

Each member then yields one staging row (``merge_rows``): a group's keeper a
``KIND_KEEP`` row when its sub-resources change (its mask differs from the
union's; only then is the union turned back into names), a ``KIND_KEY`` row
when they do not (either names its group, for the index of kept entries);
every other member a ``KIND_DROP`` row naming its keeper. ``write_merge``
writes them to the staging table in one pass, counting them as they go
(``Observation``). The rules are the ones in ``plan``.
"""

from __future__ import annotations

from collections.abc import Sequence
from decimal import Decimal
from typing import Any

from changefeed.schemas import Position

from .apply import KIND_DROP, KIND_KEEP, KIND_KEY, STAGING_COLUMNS
from .jdbc import JdbcTarget

__all__ = [
    "HOT_KEYS",
    "HOT_MIN",
    "KEY",
    "MERGE_COUNTS",
    "group_sizes",
    "hot_groups",
    "merge_rows",
    "write_merge",
]

HOT_MIN = 10_000
"""A group of at least this many members is *hot*: its members are not shuffled."""
HOT_KEYS = 256
"""The largest groups taken as hot, at most."""
KEY = ("resource", "changed_resource_id")
"""What a group is."""
MERGE_COUNTS = ("groups", "keys", "members", "updates", "drops", "unnamed")
"""What ``write_merge`` counts (``groups``: groups of two or more; ``unnamed``:
members with a sub-resource missing from the names the merge was given, which
would be left out of a union -- the job applies nothing then)."""

_POSITION_SPAN = Decimal(1 << 63)
_TALLIED = ("members", "unnamed")  # beside the staging columns, counted, never written
_APP = "changefeed-compaction"
_WRITE_BATCH = 10_000


def group_sizes(members: Any) -> Any:
    """How many of ``members`` each group has: ``resource, changed_resource_id, count``,
    one row per group (one shuffle; an incremental run persists it, and takes both
    the groups it touches and its hot ones from it)."""
    return members.groupBy(*KEY).count()


def hot_groups(
    sizes: Any, *, hot_min: int = HOT_MIN, hot_keys: int = HOT_KEYS
) -> list[tuple[str, str]]:
    """The largest groups of ``sizes`` (``group_sizes``) with ``hot_min`` members or
    more (at most ``hot_keys``), counted by Spark: for members already at hand (an
    incremental run's). A full run asks PostgreSQL for a sample instead (``apply``).
    Which groups are hot decides only how they are merged, never the result."""
    from pyspark.sql import functions as F

    rows = sizes.where(F.col("count") >= hot_min).orderBy(F.desc("count")).limit(hot_keys).collect()
    return [(str(r["resource"]), str(r["changed_resource_id"])) for r in rows]


def _slim(
    members: Any, names: Sequence[str], checked: bool
) -> tuple[Any, list[str], list[list[str]]]:
    from pyspark.sql import functions as F

    words = [list(names[w : w + 63]) for w in range(0, len(names), 63)]
    known = F.array(*(F.lit(n) for n in names)).cast("array<string>")
    masks = [f"mask{w}" for w in range(len(words))]

    def mask(chunk: list[str]) -> Any:
        value = F.lit(0).cast("long")
        for bit, name in enumerate(chunk):
            value = value.bitwiseOR(
                F.when(F.array_contains("sub_resources", name), F.lit(1 << bit)).otherwise(0)
            )
        return value

    slim = members.select(
        *KEY,
        "txid",
        "id",
        (F.size("sub_resources") == 0).cast("int").alias("whole"),
        *(mask(chunk).alias(c) for chunk, c in zip(words, masks, strict=True)),
        (
            (F.size(F.array_except("sub_resources", known)) > 0).cast("int")
            if checked
            else F.lit(0)
        ).alias("unnamed"),
    )
    return slim, masks, words


def merge_rows(cold: Any, hot: Any | None, names: Sequence[str], *, checked: bool = True) -> Any:
    """The staging rows of a merge of ``cold`` (ordinary ids) and ``hot`` (the hot
    ids' members, or None), whose sub-resources are among ``names``: one per member.

    Both are ``txid, id, resource, changed_resource_id, sub_resources``, no two
    rows at one position, and no group in both. Returns ``STAGING_COLUMNS`` plus
    ``members`` (a keeper's group size on its row, 0 on a drop) and ``unnamed``
    (1 on the row of a member with a sub-resource not in ``names``; always 0
    unless ``checked``: names listed from the members themselves need no
    check, and it costs every member an array).
    """
    from pyspark.sql import Window
    from pyspark.sql import functions as F

    slim, masks, words = _slim(cold, names, checked)
    group = (
        Window.partitionBy(*KEY)
        .orderBy(F.col("txid").desc(), F.col("id").desc())
        .rowsBetween(Window.unboundedPreceding, Window.unboundedFollowing)
    )
    shared = {
        "n": F.count(F.lit(1)),
        "any_whole": F.max("whole"),
        **{f"u{c}": F.bit_or(c) for c in masks},
    }
    keeper = {"keep_txid": F.first("txid"), "keep_id": F.first("id")}
    windowed = slim.select("*", *(t.over(group).alias(n) for n, t in {**shared, **keeper}.items()))
    rows = _rows(windowed, masks, words)
    if hot is not None:
        span = F.lit(_POSITION_SPAN).cast("decimal(38,0)")
        hot_slim = _slim(hot, names, checked)[0]
        position = (F.col("txid").cast("decimal(38,0)") * span + F.col("id")).cast("decimal(38,0)")
        summed = (
            hot_slim.groupBy(*KEY)
            .agg(F.max(position).alias("keep"), *(t.alias(n) for n, t in shared.items()))
            .select(
                "*",
                F.floor(F.col("keep") / span).cast("long").alias("keep_txid"),
                F.pmod(F.col("keep"), span).cast("long").alias("keep_id"),
            )
            .drop("keep")
        )
        rows = rows.unionByName(_rows(hot_slim.join(F.broadcast(summed), list(KEY)), masks, words))
    return rows


def _rows(verdicts: Any, masks: list[str], words: list[list[str]]) -> Any:
    """Each member with its group's verdict, as its staging row."""
    from pyspark.sql import functions as F

    kept = (F.col("txid") == F.col("keep_txid")) & (F.col("id") == F.col("keep_id"))
    whole = F.col("any_whole") == 1
    differs = F.lit(False)
    for c in masks:
        differs = differs | (F.col(c) != F.col(f"u{c}"))
    widened = kept & (F.col("n") > 1) & ((whole & (F.col("whole") == 0)) | (~whole & differs))
    empty = F.array().cast("array<string>")
    union = F.when(whole, empty).otherwise(
        F.concat(
            empty,
            *(
                F.when(F.col(f"u{c}").bitwiseAND(1 << bit) != 0, F.array(F.lit(name))).otherwise(
                    empty
                )
                for chunk, c in zip(words, masks, strict=True)
                for bit, name in enumerate(chunk)
            ),
        )
    )
    none_long, none_text = F.lit(None).cast("long"), F.lit(None).cast("string")
    none_subs = F.lit(None).cast("array<string>")

    def row(kind: int, **values: Any) -> Any:
        fields = {
            "kind": F.lit(kind).cast("short"),
            "txid": F.col("txid"),
            "id": F.col("id"),
            "keep_txid": none_long,
            "keep_id": none_long,
            "sub_resources": none_subs,
            "resource": none_text,
            "changed_resource_id": none_text,
            "members": F.lit(0).cast("long"),
            "unnamed": F.col("unnamed"),
            **values,
        }
        return F.struct(*(fields[c].alias(c) for c in (*STAGING_COLUMNS, *_TALLIED)))

    group = {
        "resource": F.col("resource"),
        "changed_resource_id": F.col("changed_resource_id"),
        "members": F.col("n"),
    }
    verdict = (
        F.when(~kept, row(KIND_DROP, keep_txid=F.col("keep_txid"), keep_id=F.col("keep_id")))
        .when(widened, row(KIND_KEEP, sub_resources=union, **group))
        .otherwise(row(KIND_KEY, **group))
    )
    return verdicts.select(verdict.alias("r")).select("r.*")


def write_merge(
    rows: Any, target: JdbcTarget | None, staging: str | None
) -> tuple[dict[str, int], Position | None]:
    """Write ``merge_rows``' rows to ``staging`` (None: a dry run, write nothing) and
    count them as they go.

    Returns:
        the counts of ``MERGE_COUNTS``, and the newest keeper whose sub-resources
        change (None: none does).
    """
    from pyspark.sql import Observation
    from pyspark.sql import functions as F

    kind = F.col("kind")
    keeper = kind.isin(KIND_KEY, KIND_KEEP)
    observed = Observation("merge")
    counted = rows.observe(
        observed,
        F.count(F.when(keeper & (F.col("members") > 1), 1)).alias("groups"),
        F.count(F.when(keeper, 1)).alias("keys"),
        F.coalesce(F.sum("members"), F.lit(0)).alias("members"),
        F.count(F.when(kind == KIND_KEEP, 1)).alias("updates"),
        F.count(F.when(kind == KIND_DROP, 1)).alias("drops"),
        F.max(F.when(kind == KIND_KEEP, F.struct("txid", "id"))).alias("through"),
        F.coalesce(F.sum("unnamed"), F.lit(0)).alias("unnamed"),
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
