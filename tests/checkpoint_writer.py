"""Saves checkpoints into a SQLite file as fast as it can, until it is killed.

Run by tests/test_checkpoint_store.py: ``python checkpoint_writer.py FILE ITEMS``.
Save number ``n`` (counting on from what the file holds) has cursor ``c<n>``
and ``ITEMS`` resources ``{"n": n}`` under ids ``i0 ...``, but not id ``i<n %
ITEMS>`` (so every save also deletes and adds one); every third save is whole,
the others incremental (every id changed). It prints ``saved <n>`` after each
save. Whatever moment it is killed at, the file must then hold one of these
saves entirely: a cursor ``c<n>`` with exactly save ``n``'s resources.
"""

from __future__ import annotations

import asyncio
import sys

from changefeed.listener import ChangeKind, Checkpoint, MirrorCheckpoint, SqliteCheckpointStore


def expected(n: int, items: int) -> dict[str, dict[str, int]]:
    """Save ``n``'s resources."""
    return {f"i{k}": {"n": n} for k in range(items) if k != n % items}


async def main(path: str, items: int) -> None:
    store = SqliteCheckpointStore(path, chunk_items=max(1, items // 7))
    loaded = await store.load()
    n = loaded.sequence if loaded is not None else 0
    kinds = (ChangeKind("vm"),)
    while True:
        n += 1
        whole = n % 3 == 0 or loaded is None
        current = expected(n, items)
        previous = expected(n - 1, items)
        part = MirrorCheckpoint(
            "vm",
            current,
            () if whole else sorted(set(previous) - set(current)),
            {f"i{n % items}"},
        )
        await store.save(
            Checkpoint(
                f"c{n}",
                kinds,
                {"vms": part},
                whole=whole,
                sequence=n,
                base=None if whole else n - 1,
            )
        )
        loaded = loaded or Checkpoint(None, kinds, {})
        print(f"saved {n}", flush=True)


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], int(sys.argv[2])))
