"""What one compaction run did: ``CompactionSummary``, as a dict (the run log, the
``done`` note) and as the few lines ``changefeed compact`` prints. Pure code."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from changefeed.schemas import ORIGIN, Position

from .durations import format_duration

__all__ = ["CompactionSummary"]


@dataclass
class CompactionSummary:
    """What one run did (or, with ``dry_run``, would do).

    Attributes:
        full: the run read the whole feed (else what changed since the last run).
        scope: why a full or an incremental run (``scope.choose_scope``).
        scanned: entries read (garbage and compaction candidates; for an
            incremental run, what changed and the keepers it touches).
        collected: entries deleted as older than the max age.
        merged: entries merged into a later entry of the same resource id and deleted.
        rewritten: keepers whose sub-resources became the union.
        groups: resource ids with entries merged.
        hot: resource ids merged apart from the others as hot (their members not shuffled).
        keepers: how an incremental run found the previous keepers of the ids its
            changes touch: "looked up" (by the index of kept entries) or "scanned"
            (the feed, when they are many: ``frames.keepers_by_scan``); "" for a full run.
        gc_batches: transactions of the garbage walk.
        rewrite_generation, rewritten_through: the feed's rewrite horizon after
            the run announced its widened entries and sealed them before its
            drops (None when it did neither).
        standbys: the streaming standbys the drops waited for.
        as_of: the database clock at the snapshot; the age cutoffs count from it.
        phases: seconds by phase, in order.
    """

    schema: str
    dry_run: bool
    max_age: float
    compaction_lag: float
    full: bool = True
    scope: str = ""
    head: Position = ORIGIN
    low_water_before: Position = ORIGIN
    low_water_after: Position = ORIGIN
    scanned: int = 0
    collected: int = 0
    merged: int = 0
    rewritten: int = 0
    groups: int = 0
    partitions: int = 0
    hot: int = 0
    keepers: str = ""
    gc_batches: int = 0
    rewrite_generation: int | None = None
    rewritten_through: Position | None = None
    standbys: list[str] = field(default_factory=list)
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
            "full": self.full,
            "scope": self.scope,
            "head": list(self.head),
            "low_water_before": list(self.low_water_before),
            "low_water_after": list(self.low_water_after),
            "scanned": self.scanned,
            "collected": self.collected,
            "merged": self.merged,
            "rewritten": self.rewritten,
            "groups": self.groups,
            "partitions": self.partitions,
            "hot": self.hot,
            "keepers": self.keepers,
            "gc_batches": self.gc_batches,
            "rewrite_generation": self.rewrite_generation,
            "rewritten_through": list(self.rewritten_through) if self.rewritten_through else None,
            "standbys": self.standbys,
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
        keepers = f", previous keepers {self.keepers}" if self.keepers else ""
        return "\n".join(
            [
                title,
                f"  run           {'full' if self.full else 'incremental'} ({self.scope})",
                f"  head          {_pos(self.head)}",
                f"  low water     {_pos(self.low_water_before)} -> {_pos(self.low_water_after)}",
                f"  scanned       {self.scanned:,} entries in {self.partitions} read partitions"
                f"{keepers} ({self.rows_per_second:,.0f} entries/s)",
                f"  collected     {verb} {self.collected:,} older than"
                f" {format_duration(self.max_age)} in {self.gc_batches:,} transactions",
                f"  merged        {verb} {self.merged:,} into later entries of {self.groups:,}"
                f" resource ids, {self.hot} of them hot ({self.rewritten:,} rewritten with the"
                " union),"
                f" older than {format_duration(self.compaction_lag)}",
                f"  time          {phases}  total {self.seconds:.1f}s",
            ]
        )


def _pos(p: Position) -> str:
    return f"({p.txid}, {p.id})"
