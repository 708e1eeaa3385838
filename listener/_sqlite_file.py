"""The SQLite file a checkpoint store keeps: claimed, checked, and set aside when unusable.

``CheckpointFile`` owns the store's one connection and everything about the
file as a file; what the rows mean is ``_sqlite_store``'s. Blocking calls,
run in a worker thread, one at a time (``use``).

**One writer.** Opening the store claims the file under its name
(``_file_claim``: an exclusive lock on ``<file>.<name>.lock``), held until
``close`` (or the process's end, however it ends): a second store on the
same file and name, in this process or another, is refused with
``CheckpointRefused`` when it first loads or saves, so two listeners can
never overwrite each other's checkpoints, whole saves included. Other names
in the same file are not held up.

**A file it cannot use.** A file that is not a SQLite database, or one
SQLite finds corrupt, or one holding a checkpoint of a newer layout than this
store writes, or of an unknown one (the store's tables with other columns), or
one this process may not open for reading and writing, is renamed aside
(``<file>.corrupt-<time>``, ``<file>.v<N>-<time>``, ``<file>.unknown-<time>``,
``<file>.unreadable-<time>``, with its ``-wal`` and ``-shm``), logged at ERROR
(``listener.checkpoint.moved_aside``), and a new file is started: the
listener bootstraps once, and its saves succeed again instead of failing at
every interval. Not while another store holds a checkpoint of another name
in the same file (its lock file is held): moving the file would take that
listener's checkpoints with it, and its saves would go on into the renamed
file; the store refuses instead (``CheckpointRefused``). A newer- or unknown-layout file
that also holds tables that are not the store's (the application's own) is
not moved either: the store refuses it with ``CheckpointRefused`` naming the
file, so that an older version never takes an application's tables away.
A checkpoint whose rows do not decode (written over by something else) is
copied aside (``<file>.undecodable-<time>``, SQLite's backup, so that other
names' checkpoints stay where they are), logged the same way, and the load
answers None: the listener bootstraps, and its next whole save replaces it.

It must never write a file another store holds, nor move a file away from
under another listener.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import sqlite3
import stat
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from changefeed.logs import log_event

from ._errors import CheckpointRefused
from ._file_claim import FileClaim, FileHeld
from ._log import log

__all__ = ["FORMAT_VERSION", "CheckpointFile"]

R = TypeVar("R")

FORMAT_VERSION = 1
"""The layout's version; a file of another version is refused, not guessed at."""

_SCHEMA = """
CREATE TABLE IF NOT EXISTS changefeed_checkpoint (
    name         TEXT PRIMARY KEY,
    version      INTEGER NOT NULL,
    sequence     INTEGER NOT NULL,
    cursor       TEXT,
    change_kinds TEXT NOT NULL,
    saved_at     REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS changefeed_checkpoint_mirror (
    name       TEXT NOT NULL,
    controller TEXT NOT NULL,
    resource   TEXT NOT NULL,
    pending    BLOB NOT NULL,
    PRIMARY KEY (name, controller)
);
CREATE TABLE IF NOT EXISTS changefeed_checkpoint_chunk (
    name       TEXT NOT NULL,
    controller TEXT NOT NULL,
    seq        INTEGER NOT NULL,
    ids        BLOB NOT NULL,
    items      BLOB NOT NULL,
    PRIMARY KEY (name, controller, seq)
);
CREATE TABLE IF NOT EXISTS changefeed_checkpoint_change (
    name       TEXT NOT NULL,
    controller TEXT NOT NULL,
    id         TEXT NOT NULL,
    item       BLOB,
    PRIMARY KEY (name, controller, id)
) WITHOUT ROWID;
"""

_UNUSABLE = frozenset({sqlite3.SQLITE_NOTADB, sqlite3.SQLITE_CORRUPT})
"""SQLite's result codes for a file that is not a database, or a damaged one: moved aside.
Any other error (locked, cannot open, I/O) says nothing against the file itself."""


def _columns(conn: sqlite3.Connection, table: str) -> frozenset[str]:
    """The columns of ``table`` in the database of ``conn`` (none: no such table)."""
    return frozenset(
        name for (name,) in conn.execute("SELECT name FROM pragma_table_info(?)", (table,))
    )


@functools.cache
def _layout() -> dict[str, frozenset[str]]:
    """The layout this store writes: each of its tables and their columns, as
    ``_SCHEMA`` makes them. A file whose tables of these names have other columns
    was written by something else (moved aside, not guessed at)."""
    memory = sqlite3.connect(":memory:")
    try:
        memory.executescript(_SCHEMA)
        tables = [
            name
            for (name,) in memory.execute("SELECT name FROM sqlite_master WHERE type = 'table'")
        ]
        return {table: _columns(memory, table) for table in tables}
    finally:
        memory.close()


_EFFECTIVE_IDS = os.access in os.supports_effective_ids
"""Whether ``os.access`` can ask as the process's effective user (and capabilities)."""


class _MoveAside(Exception):
    """The file cannot be used as it is: move it aside (``suffix``) and start a new one."""

    def __init__(self, suffix: str, why: str) -> None:
        super().__init__(why)
        self.suffix = suffix
        self.why = why


def _unusable(exc: sqlite3.DatabaseError) -> bool:
    return (getattr(exc, "sqlite_errorcode", 0) & 0xFF) in _UNUSABLE


class CheckpointFile:
    """One SQLite file as a checkpoint store uses it, under one checkpoint ``name``.

    Args:
        path: the file; created with its tables when missing.
        name: the checkpoint's name in the file, the one this claims.
        timeout: seconds to wait for another connection's lock on the file.
    """

    def __init__(self, path: Path, name: str, timeout: float) -> None:
        self.path = path
        self.name = name
        self.timeout = timeout
        # The file itself, symbolic links resolved: two paths to one file share one
        # lock, and the file (not a link to it) is what is opened and moved aside. (A
        # hard link is a path of its own, with a lock of its own.)
        self._file = path.resolve()
        self._claim = FileClaim(self._file, name)
        self.lock_path = self._claim.lock_path
        """The file whose lock says this store holds the checkpoint."""
        self.moved_aside: list[Path] = []
        """Where files that could not be used were moved (newest last)."""
        self._conn: sqlite3.Connection | None = None
        self._mutex = threading.Lock()  # one worker thread at a time on the connection

    def use(
        self,
        work: Callable[[sqlite3.Connection], R],
        damaged: Callable[[sqlite3.Connection, sqlite3.DatabaseError], R],
    ) -> R:
        """``work`` on the file's connection (opened on first use), one thread at a
        time. When the file turns out damaged while in use, it is moved aside, a new
        one is started, and ``damaged`` runs on its connection with the error.

        Raises:
            CheckpointRefused: another store holds the file under this name, or it
                cannot be moved aside (other stores hold it, or it holds the
                application's tables too).
            sqlite3.Error: the file cannot be opened, read or written.
        """
        with self._mutex:
            conn = self._connection()
            try:
                return work(conn)
            except sqlite3.DatabaseError as exc:
                if not _unusable(exc):
                    raise
                return damaged(self._reopen_aside(exc), exc)

    def close(self) -> None:
        """Close the connection and let go of the file (the next ``use`` opens it again)."""
        with self._mutex:
            self._close()

    def copy_aside(self, suffix: str, why: str, cause: BaseException) -> None:
        """Copy the file aside (a consistent copy, SQLite's backup) and log it: what
        could not be read stays for someone to look at, and this file stays where it
        is for the next save and for other names' checkpoints."""
        unusable = _MoveAside(suffix, why)
        unusable.__cause__ = cause
        aside = self._aside_path(unusable)
        try:
            # Created as private as the file itself: it holds the same data.
            mode = stat.S_IMODE(os.stat(self._file).st_mode)
            os.close(os.open(aside, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode))
            with self._mutex:
                target = sqlite3.connect(aside)
                try:
                    self._connection().backup(target)
                finally:
                    target.close()
        except (OSError, sqlite3.Error) as exc:
            # No copy (a full disk, a directory it may not write): the load still
            # starts afresh, and says what was lost.
            with contextlib.suppress(OSError):
                os.unlink(aside)
            log_event(
                log,
                "listener.checkpoint.undecodable",
                logging.ERROR,
                exc=exc,
                file=str(self.path),
                name=self.name,
                why=unusable.why,
            )
            return
        self._report_aside(aside, unusable)

    def size_on_disk(self) -> int:
        """Bytes of the file and its write-ahead log."""
        total = 0
        for suffix in ("", "-wal"):
            with contextlib.suppress(FileNotFoundError):
                total += os.path.getsize(f"{self._file}{suffix}")
        return total

    # -- with the mutex held ------------------------------------------------------

    def _connection(self) -> sqlite3.Connection:
        """The store's connection, opened (the file claimed, checked, created or moved
        aside) on first use.

        Raises:
            CheckpointRefused: another store holds the file under this name.
            CheckpointRefused: a newer-layout file that holds the application's tables
                too, or an unusable file other stores hold.
            sqlite3.Error: the file cannot be opened (a missing directory, ...).
        """
        if self._conn is not None:
            return self._conn
        try:
            self._claim.claim()
        except FileHeld as held:
            raise CheckpointRefused(
                f"{self.path}: checkpoint {self.name!r} is in use by another listener"
                f" (process {held.holder}; lock {self.lock_path}): two listeners must not"
                " share a checkpoint; give each its own file or name"
            ) from None
        try:
            try:
                self._conn = self._open()
            except _MoveAside as unusable:
                self._move_aside(unusable)
                self._conn = self._open()
        except BaseException:
            self._claim.release()
            raise
        return self._conn

    def _close(self) -> None:
        conn, self._conn = self._conn, None
        try:
            if conn is not None:
                conn.close()
        finally:
            self._claim.release()

    def _open(self) -> sqlite3.Connection:
        """A connection to the file, set up and checked.

        Raises:
            _MoveAside: the file may not be opened, is not a database, is damaged, or
                holds a newer or an unknown layout.
        """
        self._check_openable()
        conn = sqlite3.connect(
            self._file, timeout=self.timeout, isolation_level=None, check_same_thread=False
        )
        try:
            # Checked before anything is written to the file: a file of a newer or an
            # unknown layout is left as it was (moved aside, or refused when the
            # application's tables are in it too).
            self._check_layout(conn)
            conn.execute("PRAGMA journal_mode=WAL")
            conn.execute("PRAGMA synchronous=NORMAL")
            # A whole save of a large mirror passes through the log: give the disk back after.
            conn.execute("PRAGMA journal_size_limit=67108864")
            conn.executescript(_SCHEMA)
        except sqlite3.DatabaseError as exc:
            conn.close()
            if _unusable(exc):
                raise _MoveAside("corrupt", f"{type(exc).__name__}: {exc}") from exc
            raise
        except BaseException:
            conn.close()
            raise
        return conn

    def _check_openable(self) -> None:
        """A file this process may not open for reading and writing (its mode, its
        owner) cannot be used, however long the listener runs: moved aside, so
        that a new one is started beside it.

        Raises:
            _MoveAside: the file exists, and opening it was refused.
        """
        # Asked of the kernel, not tried: closing a descriptor of the file would drop
        # the locks SQLite holds on it for other connections of this process.
        try:
            status = os.stat(self._file)
        except OSError:
            return  # missing (created): SQLite says what else is wrong
        if not stat.S_ISREG(status.st_mode) or os.access(
            self._file, os.R_OK | os.W_OK, effective_ids=_EFFECTIVE_IDS
        ):
            return
        raise _MoveAside(
            "unreadable",
            "this process may not open it for reading and writing"
            f" (mode {stat.filemode(status.st_mode)}, owner {status.st_uid})",
        )

    def _check_layout(self, conn: sqlite3.Connection) -> None:
        """Whether the store's tables in the file are the ones it writes.

        Raises:
            _MoveAside: they hold checkpoints of a newer layout version, or have
                other columns (the file's, not this store's layout).
            CheckpointRefused: either, in a file that holds the application's
                tables too.
        """
        layout = _layout()
        found = {table: _columns(conn, table) for table in layout}
        if "version" in found["changefeed_checkpoint"]:
            (newest,) = conn.execute("SELECT max(version) FROM changefeed_checkpoint").fetchone()
            if newest is not None and newest > FORMAT_VERSION:
                why = (
                    f"it holds checkpoints of layout version {newest}, this store writes"
                    f" {FORMAT_VERSION}"
                )
                self._refuse_if_shared(conn, why, "a newer changefeed")
                raise _MoveAside(f"v{newest}", why)
        for table, columns in found.items():
            if columns and columns != layout[table]:
                why = (
                    f"its table {table} has columns ({', '.join(sorted(columns))}), this store's"
                    f" has ({', '.join(sorted(layout[table]))})"
                )
                self._refuse_if_shared(conn, why, "the changefeed that wrote it")
                raise _MoveAside("unknown", why)

    def _refuse_if_shared(self, conn: sqlite3.Connection, why: str, remedy: str) -> None:
        """A file of a layout this store cannot use that also holds tables of the
        application's is not moved: the application's tables stay where they are."""
        others = [
            name
            for (name,) in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")
            if not name.startswith("changefeed_checkpoint")
        ]
        if others:
            conn.close()
            raise CheckpointRefused(
                f"{self.path}: {why}, beside other tables ({', '.join(sorted(others)[:5])}):"
                f" not moved aside; use another file, or {remedy}"
            )

    def _move_aside(self, unusable: _MoveAside) -> None:
        """Rename the file (and its log) aside, unless other listeners hold checkpoints
        in it: moving it would take theirs too, and their next saves would go on into
        the renamed file.

        Raises:
            CheckpointRefused: other stores hold the file.
        """
        others = self._claim.held_by_others()
        if others:
            raise CheckpointRefused(
                f"{self.path}: cannot be used ({unusable.why}), and other listeners hold"
                f" checkpoints in it ({', '.join(others)}): not moved aside; give this"
                " listener a file of its own"
            ) from unusable
        aside = self._aside_path(unusable)
        for suffix in ("", "-wal", "-shm"):
            with contextlib.suppress(FileNotFoundError):
                os.replace(f"{self._file}{suffix}", f"{aside}{suffix}")
        self._report_aside(aside, unusable)

    def _aside_path(self, unusable: _MoveAside) -> Path:
        """A name no file has yet: two in the same second get ``-2``, ``-3``..."""
        stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
        aside = Path(f"{self._file}.{unusable.suffix}-{stamp}")
        count = 1
        while any(os.path.lexists(f"{aside}{suffix}") for suffix in ("", "-wal", "-shm")):
            count += 1
            aside = Path(f"{self._file}.{unusable.suffix}-{stamp}-{count}")
        return aside

    def _report_aside(self, aside: Path, unusable: _MoveAside) -> None:
        self.moved_aside.append(aside)
        log_event(
            log,
            "listener.checkpoint.moved_aside",
            logging.ERROR,
            exc=unusable.__cause__ if isinstance(unusable.__cause__, BaseException) else None,
            file=str(self.path),
            name=self.name,
            moved_to=str(aside),
            why=unusable.why,
        )

    def _reopen_aside(self, exc: sqlite3.DatabaseError) -> sqlite3.Connection:
        """The file turned out damaged while in use: move it aside, start a new one."""
        conn, self._conn = self._conn, None
        if conn is not None:
            with contextlib.suppress(sqlite3.Error):
                conn.close()
        unusable = _MoveAside("corrupt", f"{type(exc).__name__}: {exc}")
        unusable.__cause__ = exc
        try:
            self._move_aside(unusable)
        except CheckpointRefused:
            self._claim.release()  # the next use claims the file again, and is refused again
            raise
        self._conn = self._open()
        return self._conn
