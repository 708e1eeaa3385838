"""Exceptions of the compaction job.

Exception tree::

    CompactionError          the compaction / garbage-collection job cannot run or failed

It derives from nothing publisher-specific: the job depends on the feed SQL
(``changefeed.schemas``), never on the publisher.
"""

from __future__ import annotations

__all__ = ["CompactionError"]


class CompactionError(Exception):
    """The compaction / garbage-collection job cannot run, or failed part-way.

    A job that failed part-way left the feed consistent (every step it applied
    is safe on its own); running it again finishes the work.
    """
