"""Python's cyclic garbage collector: paused around bulk decoding, tuned for a server.

Decoding a page of a bootstrap walk, or a chunk of a checkpoint, allocates
thousands of containers that all live on. Collections triggered meanwhile
find no garbage, yet each traverses the young objects again, and the full
ones the whole heap. The block must not await: the pause covers synchronous
work only, and must never outlive it.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator

__all__ = ["collector_paused", "tune_collector"]

_YOUNG_THRESHOLD = 10_000


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """No cyclic garbage collection inside the block (unless it was off already)."""
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def tune_collector() -> None:
    """Garbage-collector settings for a long-running server process (CPython).

    Everything alive once the server has started (modules, the app, pools)
    lives as long as the process: ``gc.freeze`` takes it out of every later
    collection. Young collections then run after 10,000 new container objects
    instead of 700: a bootstrap page of thousands of rows (each a record, a
    dict) otherwise triggers several collections that find nothing to free,
    and each promotion brings the next full collection closer.
    """
    gc.collect()
    gc.freeze()
    young, middle, old = gc.get_threshold()
    gc.set_threshold(max(young, _YOUNG_THRESHOLD), middle, old)
