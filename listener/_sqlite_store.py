"""A checkpoint store in one SQLite file: Python's own ``sqlite3``, nothing to run beside it.

Layout (tables prefixed ``changefeed_``, so the file may hold the
application's own tables too; several listeners share one file under
different ``name``s):

* ``changefeed_checkpoint``: one row per name: format version, save number,
  cursor, change kinds, when it was taken.
* ``changefeed_checkpoint_mirror``: one row per controller: its resource and
  its pending ids (a JSON array).
* ``changefeed_checkpoint_chunk``: a whole save's resources, ``chunk_items``
  to a row: their ids as one JSON array, and their JSON documents one to a
  line. Loading splits them without decoding them: the mirror decodes each
  resource when it is first read (``JsonItems``), so a restart does not wait
  for a million objects to be built.
* ``changefeed_checkpoint_change``: what incremental saves changed since,
  one row per id (NULL: deleted), replaced in place, so it never holds an id
  twice; loading applies it on top of the chunks. A whole save empties it,
  and so does an incremental save that finds a controller's change rows
  past ``FOLD_RATIO`` of its chunks: it folds them into new chunks in the
  same transaction. A listener decides on whole saves by its own count of
  changes, which starts again at each restart, so without the fold a service
  restarted often would only ever add rows (every id created and deleted
  since stays, as a row or a tombstone): the fold keeps the file about the
  size of the mirrors, however many saves and restarts there were.

Every save is one transaction, so a process killed at any moment (SIGKILL
included) leaves the previous checkpoint or the new one, never a mix; the
file is in WAL mode, and with ``synchronous=NORMAL`` a power loss may take
the last saves back but never tears one. Blocking SQLite calls run in a
worker thread, on the store's one connection (opened at the first load or
save, closed by ``close``); loading splits the chunks on the event loop one
at a time, with the garbage collector paused meanwhile (as the bootstrap
pager does), so the loop is never held for long.

**One writer.** Opening the store claims the file under its name
(``_file_claim``: an exclusive lock on ``<file>.<name>.lock``), held until
``close`` (or the process's end, however it ends): a second store on the
same file and name, in this process or another, is refused with
``CheckpointRefused`` when it first loads or saves, so two listeners can
never overwrite each other's checkpoints, whole saves included. Other names
in the same file are not held up.

**A file it cannot use.** A file that is not a SQLite database, or one
SQLite finds corrupt, or one holding a checkpoint of a newer layout than this
store writes, is renamed aside (``<file>.corrupt-<time>``, ``<file>.v<N>-<time>``,
with its ``-wal`` and ``-shm``), logged at ERROR
(``listener.checkpoint.moved_aside``), and a new file is started: the
listener bootstraps once, and its saves succeed again instead of failing at
every interval. Not while another store holds a checkpoint of another name
in the same file (its lock file is held): moving the file would take that
listener's checkpoints with it, and its saves would go on into the renamed
file; the store refuses instead (``CheckpointRefused``). A newer-layout file
that also holds tables that are not the store's (the application's own) is
not moved either: the store refuses it with ``CheckpointRefused`` naming the
file, so that an older version never takes an application's tables away.
A checkpoint whose rows do not decode (written over by something else) is
copied aside (``<file>.undecodable-<time>``, SQLite's backup, so that other
names' checkpoints stay where they are), logged the same way, and the load
answers None: the listener bootstraps, and its next whole save replaces it.

It must never apply an incremental save to a checkpoint it was not made
for (another listener's, or an older one: ``CheckpointError``), never
write a file another store holds, and never leave a save half-written.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import sqlite3
import stat
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any, TypeVar

import orjson

from changefeed.collector import collector_paused
from changefeed.logs import log_event
from changefeed.schemas import ChangeKind

from ._checkpoint import Checkpoint, JsonItems, MirrorCheckpoint
from ._errors import CheckpointError, CheckpointRefused
from ._file_claim import FileClaim, FileHeld
from ._log import log

__all__ = ["FOLD_FLOOR", "FOLD_RATIO", "FORMAT_VERSION", "SqliteCheckpointStore"]

R = TypeVar("R")

FORMAT_VERSION = 1
"""The layout's version; a file of another version is refused, not guessed at."""

FOLD_RATIO = 0.25
"""An incremental save folds a controller's change rows into its chunks once they
outnumber this fraction of the resources the chunks hold: the file then holds at
most about that much beside one copy of the mirror, and a fold (a rewrite of the
mirror) comes at most once per that many changed ids."""

FOLD_FLOOR = 1_000
"""... but never for fewer change rows than this (a small mirror is not rewritten
at every save)."""

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

_Raw = tuple[
    tuple[int, int, str | None, str, float],
    dict[str, tuple[str, bytes, list[tuple[bytes, bytes]], list[tuple[str, bytes | None]]]],
]
"""What a load reads: the checkpoint's row, and each controller's rows."""


class _MoveAside(Exception):
    """The file cannot be used as it is: move it aside (``suffix``) and start a new one."""

    def __init__(self, suffix: str, why: str) -> None:
        super().__init__(why)
        self.suffix = suffix
        self.why = why


def _unusable(exc: sqlite3.DatabaseError) -> bool:
    return (getattr(exc, "sqlite_errorcode", 0) & 0xFF) in _UNUSABLE


class SqliteCheckpointStore:
    """Keeps a listener's checkpoint in a SQLite file (``CheckpointStore``).

    Args:
        path: the file; created with its tables when missing.
        name: this checkpoint's name in the file (one per listener).
        chunk_items: resources per stored chunk of a whole save.
        timeout: seconds to wait for another connection's lock on the file.

    Raises:
        ValueError: ``chunk_items`` < 1, or an empty ``name``.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        name: str = "default",
        chunk_items: int = 10_000,
        timeout: float = 30.0,
    ) -> None:
        if chunk_items < 1:
            raise ValueError(f"chunk_items must be at least 1, got {chunk_items!r}")
        if not name:
            raise ValueError("name must not be empty")
        self.path = Path(path)
        self.name = name
        self.chunk_items = chunk_items
        self.timeout = timeout
        # The file itself, links resolved: two paths to one file share one lock, and
        # the file (not a link to it) is what is opened and moved aside.
        self._file = self.path.resolve()
        self._claim = FileClaim(self._file, name)
        self.lock_path = self._claim.lock_path
        """The file whose lock says this store holds the checkpoint."""
        self.moved_aside: list[Path] = []
        """Where files this store could not use were moved (newest last)."""
        self._conn: sqlite3.Connection | None = None
        self._mutex = threading.Lock()  # one worker thread at a time on the connection

    def __repr__(self) -> str:
        return f"SqliteCheckpointStore({str(self.path)!r}, name={self.name!r})"

    async def close(self) -> None:
        """Close the connection and let go of the file (a later load or save opens it
        again). The listener calls it when it closes."""
        await asyncio.to_thread(self._locked, self._close)

    def size_on_disk(self) -> int:
        """Bytes of the file and its write-ahead log."""
        total = 0
        for suffix in ("", "-wal"):
            with contextlib.suppress(FileNotFoundError):
                total += os.path.getsize(f"{self._file}{suffix}")
        return total

    # -- the connection (worker thread only) -------------------------------------

    def _locked(self, work: Callable[[], R]) -> R:
        with self._mutex:
            return work()

    def _connection(self) -> sqlite3.Connection:
        """The store's connection, opened (the file claimed, checked, created or moved
        aside) on first use.

        Raises:
            CheckpointRefused: another store holds the file under this name.
            CheckpointError: a newer-layout file that holds the application's tables.
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
            _MoveAside: the file is not a database, is damaged, or holds a newer layout.
        """
        conn = sqlite3.connect(
            self._file, timeout=self.timeout, isolation_level=None, check_same_thread=False
        )
        try:
            # Checked before anything is written to the file: a newer layout's file is
            # left as it was (moved aside, or refused when the application's tables
            # are in it too).
            held = conn.execute(
                "SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = ?",
                ("changefeed_checkpoint",),
            ).fetchone()
            if held is not None:
                (newest,) = conn.execute(
                    "SELECT max(version) FROM changefeed_checkpoint"
                ).fetchone()
                if newest is not None and newest > FORMAT_VERSION:
                    self._refuse_if_shared(conn, newest)
                    raise _MoveAside(
                        f"v{newest}",
                        f"it holds checkpoints of layout version {newest}, this store writes"
                        f" {FORMAT_VERSION}",
                    )
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

    def _refuse_if_shared(self, conn: sqlite3.Connection, version: int) -> None:
        """A newer-layout file that also holds tables of the application's is not moved."""
        others = [
            name
            for (name,) in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")
            if not name.startswith("changefeed_checkpoint")
        ]
        if others:
            conn.close()
            raise CheckpointRefused(
                f"{self.path}: holds checkpoints of layout version {version} (this store writes"
                f" {FORMAT_VERSION}) beside other tables ({', '.join(sorted(others)[:5])}):"
                " not moved aside; use another file, or a newer changefeed"
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

    def _reopen_aside(self, exc: sqlite3.DatabaseError) -> None:
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

    # -- load ----------------------------------------------------------------------

    async def load(self) -> Checkpoint | None:
        """The checkpoint last saved under ``name``, or None (also when the file could
        not be used and was moved aside).

        Raises:
            CheckpointRefused: another store holds the file under this name, or a
                newer-layout file holds the application's tables too.
            CheckpointError: the checkpoint has an older layout version.
            sqlite3.Error: the file cannot be read.
        """
        raw = await asyncio.to_thread(self._read)
        if raw is None:
            return None
        head, mirrors = raw
        version, sequence, cursor, kinds_json, saved_at = head
        if version != FORMAT_VERSION:
            raise CheckpointError(
                f"{self.path}: checkpoint {self.name!r} has layout version {version}, "
                f"this store reads {FORMAT_VERSION}"
            )
        try:
            kinds = tuple(ChangeKind.from_json(doc) for doc in orjson.loads(kinds_json))
            parts = {}
            for controller, (resource, pending, chunks, changes) in mirrors.items():
                items = JsonItems(encoded=await self._split_items(chunks, changes))
                parts[controller] = MirrorCheckpoint(
                    resource, items, (), frozenset(orjson.loads(pending))
                )
        except (orjson.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
            undecodable = _MoveAside("undecodable", f"checkpoint {self.name!r}: {exc}")
            undecodable.__cause__ = exc
            await asyncio.to_thread(self._copy_aside, undecodable)
            return None
        return Checkpoint(cursor, kinds, parts, whole=True, sequence=sequence, saved_at=saved_at)

    def _copy_aside(self, unusable: _MoveAside) -> None:
        """Copy the file aside (a consistent copy, SQLite's backup) and log it: what
        could not be read stays for someone to look at, and this file stays where it
        is for the next save and for other names' checkpoints."""
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

    @staticmethod
    async def _split_items(
        chunks: list[tuple[bytes, bytes]], changes: list[tuple[str, bytes | None]]
    ) -> dict[str, bytes]:
        """id -> JSON document, from the chunks and the changes on top of them."""
        items: dict[str, bytes] = {}
        for ids, body in chunks:
            with collector_paused():
                _add_chunk(items, ids, body)
            await asyncio.sleep(0)  # the loop runs between chunks
        _apply_changes(items, changes)
        return items

    def _read(self) -> _Raw | None:
        with self._mutex:
            conn = self._connection()
            try:
                return self._read_from(conn)
            except sqlite3.DatabaseError as exc:
                if not _unusable(exc):
                    raise
                self._reopen_aside(exc)
                return None

    def _read_from(self, conn: sqlite3.Connection) -> _Raw | None:
        conn.execute("BEGIN")  # one read snapshot: a save in between is seen whole or not
        try:
            head = conn.execute(
                "SELECT version, sequence, cursor, change_kinds, saved_at"
                " FROM changefeed_checkpoint WHERE name = ?",
                (self.name,),
            ).fetchone()
            if head is None:
                return None
            mirrors = {}
            for controller, resource, pending in conn.execute(
                "SELECT controller, resource, pending FROM changefeed_checkpoint_mirror"
                " WHERE name = ? ORDER BY controller",
                (self.name,),
            ).fetchall():
                chunks = conn.execute(
                    "SELECT ids, items FROM changefeed_checkpoint_chunk"
                    " WHERE name = ? AND controller = ? ORDER BY seq",
                    (self.name, controller),
                ).fetchall()
                changes = conn.execute(
                    "SELECT id, item FROM changefeed_checkpoint_change"
                    " WHERE name = ? AND controller = ?",
                    (self.name, controller),
                ).fetchall()
                mirrors[controller] = (resource, pending, chunks, changes)
            return head, mirrors
        finally:
            if conn.in_transaction:
                with contextlib.suppress(sqlite3.Error):  # it only read
                    conn.execute("ROLLBACK")

    # -- save ------------------------------------------------------------------------

    async def save(self, checkpoint: Checkpoint) -> None:
        """Keep ``checkpoint`` (one transaction, in a worker thread).

        Raises:
            CheckpointRefused: as ``load``.
            CheckpointError: an incremental checkpoint whose ``base`` this file does
                not hold (the file changed under the listener, or was damaged and
                moved aside), or whose fold finds a chunk that does not decode.
            sqlite3.Error: the file cannot be written (disk full, read-only, ...).
        """
        await asyncio.to_thread(self._write, checkpoint)

    def _write(self, checkpoint: Checkpoint) -> None:
        with self._mutex:
            conn = self._connection()
            try:
                self._write_to(conn, checkpoint)
            except sqlite3.DatabaseError as exc:
                if not _unusable(exc):
                    raise
                self._reopen_aside(exc)
                if not checkpoint.whole:
                    raise CheckpointError(
                        f"{self.path} was damaged and has been moved aside: an incremental"
                        " checkpoint has nothing to go on top of (the next save is whole)"
                    ) from exc
                assert self._conn is not None
                self._write_to(self._conn, checkpoint)

    def _write_to(self, conn: sqlite3.Connection, checkpoint: Checkpoint) -> None:
        name = self.name
        conn.execute("BEGIN IMMEDIATE")
        try:
            if checkpoint.whole:
                self._write_whole(conn, checkpoint)
            else:
                self._write_changes(conn, checkpoint)
            kinds = orjson.dumps([kind.to_json() for kind in checkpoint.change_kinds])
            conn.execute(
                "INSERT INTO changefeed_checkpoint"
                " (name, version, sequence, cursor, change_kinds, saved_at)"
                " VALUES (?, ?, ?, ?, ?, ?) ON CONFLICT (name) DO UPDATE SET"
                " version = excluded.version, sequence = excluded.sequence,"
                " cursor = excluded.cursor, change_kinds = excluded.change_kinds,"
                " saved_at = excluded.saved_at",
                (
                    name,
                    FORMAT_VERSION,
                    checkpoint.sequence,
                    checkpoint.cursor,
                    kinds.decode(),
                    checkpoint.saved_at or time.time(),
                ),
            )
        except BaseException:
            if conn.in_transaction:
                with contextlib.suppress(sqlite3.Error):  # the error that ended it goes on
                    conn.execute("ROLLBACK")
            raise
        conn.execute("COMMIT")

    def _write_whole(self, conn: sqlite3.Connection, checkpoint: Checkpoint) -> None:
        name = self.name
        for table in ("chunk", "change", "mirror"):
            conn.execute(f"DELETE FROM changefeed_checkpoint_{table} WHERE name = ?", (name,))
        for controller, part in checkpoint.mirrors.items():
            conn.execute(
                "INSERT INTO changefeed_checkpoint_mirror (name, controller, resource, pending)"
                " VALUES (?, ?, ?, ?)",
                (name, controller, part.resource, orjson.dumps(sorted(part.pending))),
            )
            self._write_chunks(conn, controller, part.items)

    def _write_chunks(
        self, conn: sqlite3.Connection, controller: str, items: Mapping[str, Any]
    ) -> None:
        """``items`` as the controller's chunks (it has none when this is called)."""
        for seq, (ids, documents) in enumerate(_chunks(items, self.chunk_items)):
            conn.execute(
                "INSERT INTO changefeed_checkpoint_chunk"
                " (name, controller, seq, ids, items) VALUES (?, ?, ?, ?, ?)",
                (self.name, controller, seq, orjson.dumps(ids), b"\n".join(documents)),
            )

    def _write_changes(self, conn: sqlite3.Connection, checkpoint: Checkpoint) -> None:
        name = self.name
        row = conn.execute(
            "SELECT sequence FROM changefeed_checkpoint WHERE name = ?", (name,)
        ).fetchone()
        held = None if row is None else row[0]
        base = checkpoint.base
        if held is None or base is None or not base <= held < checkpoint.sequence:
            raise CheckpointError(
                f"{self.path}: incremental checkpoint {checkpoint.sequence} of {name!r} goes "
                f"on save {base}, but the file holds save {held}: another listener may be "
                "writing under this name"
            )
        for controller, part in checkpoint.mirrors.items():
            updated = conn.execute(
                "UPDATE changefeed_checkpoint_mirror SET pending = ?"
                " WHERE name = ? AND controller = ? AND resource = ?",
                (orjson.dumps(sorted(part.pending)), name, controller, part.resource),
            )
            if updated.rowcount != 1:
                raise CheckpointError(
                    f"{self.path}: incremental checkpoint of {name!r} names controller "
                    f"{controller!r} ({part.resource}), which the file does not hold"
                )
            rows = itertools.chain(
                ((name, controller, key, item) for key, item in _encoded(part.items)),
                ((name, controller, key, None) for key in part.deleted),
            )
            conn.executemany(
                "INSERT INTO changefeed_checkpoint_change (name, controller, id, item)"
                " VALUES (?, ?, ?, ?) ON CONFLICT (name, controller, id)"
                " DO UPDATE SET item = excluded.item",
                rows,
            )
            self._fold_when_due(conn, controller)

    def _fold_when_due(self, conn: sqlite3.Connection, controller: str) -> None:
        """Rewrite the controller's chunks with its change rows applied, and drop those
        rows, once there are more of them than ``FOLD_RATIO`` of the chunks' resources
        (``FOLD_FLOOR`` at least). Part of the save's transaction: a save that is
        killed leaves the file as it was."""
        key = (self.name, controller)
        (changes,) = conn.execute(
            "SELECT count(*) FROM changefeed_checkpoint_change WHERE name = ? AND controller = ?",
            key,
        ).fetchone()
        if changes <= FOLD_FLOOR:
            return
        items: dict[str, bytes] = {}
        try:
            if changes <= FOLD_RATIO * _chunked_items(conn, key):
                return
            for ids, body in conn.execute(
                "SELECT ids, items FROM changefeed_checkpoint_chunk"
                " WHERE name = ? AND controller = ? ORDER BY seq",
                key,
            ):
                _add_chunk(items, ids, body)
        except (orjson.JSONDecodeError, TypeError, ValueError) as exc:
            # As a save that does not go on top of the file: the listener's next one is whole.
            raise CheckpointError(
                f"{self.path}: checkpoint {self.name!r}, controller {controller!r}: {exc}"
            ) from exc
        _apply_changes(
            items,
            conn.execute(
                "SELECT id, item FROM changefeed_checkpoint_change"
                " WHERE name = ? AND controller = ?",
                key,
            ).fetchall(),
        )
        for table in ("chunk", "change"):
            conn.execute(
                f"DELETE FROM changefeed_checkpoint_{table} WHERE name = ? AND controller = ?",
                key,
            )
        self._write_chunks(conn, controller, JsonItems(encoded=items))


def _chunked_items(conn: sqlite3.Connection, key: tuple[str, str]) -> int:
    """Resources in one controller's chunks. A save cuts them to one size, all but the
    last: the first and the last tell, without reading the others."""
    count, first, last = conn.execute(
        "SELECT count(*), min(seq), max(seq) FROM changefeed_checkpoint_chunk"
        " WHERE name = ? AND controller = ?",
        key,
    ).fetchone()
    if not count:
        return 0
    sizes = [
        len(orjson.loads(ids))
        for (ids,) in conn.execute(
            "SELECT ids FROM changefeed_checkpoint_chunk"
            " WHERE name = ? AND controller = ? AND seq IN (?, ?)",
            (*key, first, last),
        )
    ]
    return int((count - 1) * max(sizes) + min(sizes))


def _add_chunk(items: dict[str, bytes], ids: bytes, body: bytes) -> None:
    """Add one chunk's resources to ``items`` (id -> JSON document).

    Raises:
        ValueError: the chunk holds another number of documents than ids.
    """
    keys = orjson.loads(ids)
    documents = body.split(b"\n")
    if len(keys) != len(documents):
        raise ValueError(f"a chunk of {len(keys)} ids holds {len(documents)} items")
    items.update(zip(keys, documents, strict=True))


def _apply_changes(items: dict[str, bytes], changes: list[tuple[str, bytes | None]]) -> None:
    """Apply change rows to ``items``: a document replaces the id's, None deletes it."""
    for key, item in changes:
        if item is None:
            items.pop(key, None)
        else:
            items[key] = item


def _encoded(items: Mapping[str, Any]) -> Iterator[tuple[str, bytes]]:
    """Every ``(id, JSON document)`` of ``items`` (those already encoded as they are)."""
    if isinstance(items, JsonItems):
        return items.encoded_items()
    return ((key, orjson.dumps(value)) for key, value in items.items())


def _chunks(items: Mapping[str, Any], size: int) -> Iterator[tuple[list[str], list[bytes]]]:
    """``items`` as (ids, JSON documents) of at most ``size`` each. A document of orjson
    holds no line break (it escapes those in strings), so one to a line splits back."""
    ids: list[str] = []
    documents: list[bytes] = []
    for key, document in _encoded(items):
        ids.append(key)
        documents.append(document)
        if len(ids) >= size:
            yield ids, documents
            ids, documents = [], []
    if ids:
        yield ids, documents
