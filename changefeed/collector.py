"""Pausing Python's cyclic garbage collector around bulk decoding.

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

__all__ = ["collector_paused"]


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
