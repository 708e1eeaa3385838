"""One writer per checkpoint: an exclusive ``flock`` on a lock file beside the store's file.

A store claims ``<file>.<name>.lock`` when it opens the file and holds it
until it closes (or the process ends, however it ends): a second store on
the same file and name, in this process or another, finds the lock taken and
is refused, so two listeners can never overwrite each other's checkpoints.
Stores of other names in the same file hold lock files of their own, which
``held_by_others`` looks at before the file is moved aside.

The lock goes with the open file description, so the kernel lets go of it
when the holder dies; the file itself is left behind (it names the last
holder's process) and is taken over by the next store.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import re
from pathlib import Path
from typing import IO

from tenacity import Retrying, retry_if_exception_type, stop_after_attempt

from changefeed.backoff import Backoff, WaitBackoff

__all__ = ["FileClaim", "FileHeld"]

_SLUG = re.compile(r"[A-Za-z0-9._-]{1,64}")

_CLAIM_TRIES = 5
_CLAIM_PAUSE = Backoff(initial=0.01, maximum=0.04, jitter=0.0)
"""The waits between two tries to lock (changefeed.backoff's policy: 10, 20, 40 and
40 ms, 0.11 s in all, without jitter, since a refusal is final): another store's
look at whether the file is held (``held_by_others``) takes a shared lock for an
instant; only a lock still held after the tries is another listener's."""


class FileHeld(Exception):
    """Another store holds the claim; ``holder`` is the process its lock file names."""

    def __init__(self, holder: str) -> None:
        super().__init__(holder)
        self.holder = holder


def _flock_soon(lock: IO[str]) -> None:
    """An exclusive lock on ``lock``, tried a few times over about 0.1 s (tenacity's
    loop sleeps: the store calls this in its worker thread, never the event loop's).

    Raises:
        BlockingIOError: another store holds it.
    """
    for attempt in Retrying(
        wait=WaitBackoff(_CLAIM_PAUSE),
        stop=stop_after_attempt(_CLAIM_TRIES),
        retry=retry_if_exception_type(BlockingIOError),
        reraise=True,
    ):
        with attempt:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)


class FileClaim:
    """The claim of one store (``name``) on one file (``file``, links resolved).

    Blocking calls: the store makes them in its worker thread.
    """

    def __init__(self, file: Path, name: str) -> None:
        slug = name if _SLUG.fullmatch(name) else hashlib.sha256(name.encode()).hexdigest()[:16]
        self.file = file
        self.lock_path = Path(f"{file}.{slug}.lock")
        """The file whose lock says this store holds the checkpoint."""
        self._lock: IO[str] | None = None

    def claim(self) -> None:
        """Take the lock, and write this process's id into the lock file (nothing when
        this claim holds it already: a store that failed to reopen its file claims it
        again on its next use, and must not be refused by its own lock).

        Raises:
            FileHeld: another store holds it.
        """
        if self._lock is not None:
            return
        lock = open(self.lock_path, "a+", encoding="utf-8")  # noqa: SIM115 - held until release
        try:
            _flock_soon(lock)
        except BlockingIOError:
            lock.seek(0)
            holder = lock.read().strip() or "unknown"
            lock.close()
            raise FileHeld(holder) from None
        except BaseException:
            lock.close()
            raise
        lock.seek(0)
        lock.truncate()
        lock.write(f"{os.getpid()}\n")
        lock.flush()
        self._lock = lock

    def release(self) -> None:
        """Let go of the lock (nothing when it is not held)."""
        lock, self._lock = self._lock, None
        if lock is not None:
            lock.close()  # the lock goes with the file description

    def held_by_others(self) -> list[str]:
        """The lock files beside the file that other stores hold now: listeners of
        other names using the same file, in this process or another."""
        prefix, held = f"{self.file.name}.", []
        try:
            entries = os.listdir(self.file.parent)
        except OSError:
            return []
        for entry in sorted(entries):
            lock_path = self.file.parent / entry
            if not (entry.startswith(prefix) and entry.endswith(".lock")) or (
                lock_path == self.lock_path
            ):
                continue
            try:
                with open(lock_path, encoding="utf-8") as lock:
                    try:
                        fcntl.flock(lock, fcntl.LOCK_SH | fcntl.LOCK_NB)
                    except BlockingIOError:
                        held.append(entry)
            except OSError:
                continue
        return held
