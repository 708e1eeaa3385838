"""Checkpoints without a publisher: the pure rules (``_checkpoint``), and the SQLite store
on a real file, including processes killed with SIGKILL in the middle of their saves."""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
import os
import random
import signal
import sqlite3
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import orjson
import pytest

from changefeed.listener import (
    ChangeKind,
    Checkpoint,
    CheckpointError,
    CheckpointRefused,
    MirrorCheckpoint,
    SqliteCheckpointStore,
)
from changefeed.listener._checkpoint import (
    JsonItems,
    application_view,
    covers,
    next_save_is_whole,
    plan_restore,
)

WRITER = Path(__file__).with_name("checkpoint_writer.py")
VM, SERVER = ChangeKind("vm", ("nic", "alias")), ChangeKind("server")


def checkpoint(cursor: str | None = "c1", **mirrors: MirrorCheckpoint) -> Checkpoint:
    return Checkpoint(cursor, (VM, SERVER), mirrors, sequence=4)


# -- the rules -------------------------------------------------------------------------


def test_saved_change_kinds_cover_the_ones_registered_now() -> None:
    assert covers([VM, SERVER], [VM, SERVER])
    assert covers([VM], [ChangeKind("vm", ("nic",))])  # fewer sub-resources: still current
    assert covers([ChangeKind("vm")], [VM])  # everything was followed
    assert not covers([VM], [ChangeKind("vm")])  # all sub-resources now: alias, nic were not all
    assert not covers([VM], [ChangeKind("vm", ("nic", "server"))])
    assert not covers([VM], [VM, SERVER])  # a resource nobody followed


def test_a_checkpoint_resumes_only_when_every_controller_finds_its_mirror() -> None:
    vms, servers = MirrorCheckpoint("vm", {"a": 1}), MirrorCheckpoint("server", {"s": 2})
    both = {"vms": "vm", "servers": "server"}
    plan = plan_restore(checkpoint(vms=vms, servers=servers), change_kinds=[VM], controllers=both)
    assert plan.cursor == "c1" and plan.reason is None and plan.baseline
    assert plan.mirrors == {"vms": vms, "servers": servers} and plan.sequence == 4
    # One controller more than was saved: the others' mirrors are kept for the diff,
    # but the cursor would skip the newcomer's bootstrap.
    plan = plan_restore(checkpoint(vms=vms), change_kinds=[VM], controllers=both)
    assert plan.cursor is None and plan.reason == "no_mirror:servers"
    assert plan.mirrors == {"vms": vms} and not plan.baseline
    # A mirror of another resource under the same name is not this controller's.
    plan = plan_restore(checkpoint(vms=servers), change_kinds=[VM], controllers={"vms": "vm"})
    assert plan.mirrors == {} and plan.reason == "no_mirror:vms"
    # Fewer controllers than were saved: resumes, but the file must be rewritten whole.
    plan = plan_restore(
        checkpoint(vms=vms, servers=servers), change_kinds=[VM], controllers={"vms": "vm"}
    )
    assert plan.cursor == "c1" and not plan.baseline
    plan = plan_restore(
        checkpoint(vms=vms), change_kinds=[ChangeKind("vm")], controllers={"vms": "vm"}
    )
    assert plan.cursor is None and plan.reason == "change_kinds" and plan.mirrors
    plan = plan_restore(checkpoint(None, vms=vms), change_kinds=[VM], controllers={"vms": "vm"})
    assert plan.reason == "no_cursor"
    plan = plan_restore(
        checkpoint(vms=vms), change_kinds=[VM], controllers={"vms": "vm"}, resume=False
    )
    assert plan.reason == "resume_off"
    # async for (no controllers): the cursor is what the application was done with.
    assert plan_restore(checkpoint(), change_kinds=[VM], controllers={}).cursor == "c1"
    assert plan_restore(None, change_kinds=[VM], controllers={}).cursor is None


def test_saves_are_incremental_until_a_quarter_of_the_mirror_changed() -> None:
    assert next_save_is_whole(baseline=False, changed_since_whole=0, size=10)
    assert not next_save_is_whole(baseline=True, changed_since_whole=9_000, size=10)
    assert next_save_is_whole(baseline=True, changed_since_whole=10_001, size=10)
    assert not next_save_is_whole(baseline=True, changed_since_whole=200_000, size=1_000_000)
    assert next_save_is_whole(baseline=True, changed_since_whole=250_001, size=1_000_000)


def test_the_saved_view_is_what_the_callbacks_last_saw() -> None:
    mirror = {"a": 1, "b": 2, "c": 3}
    # b changed (the callback saw 20), c is new (never seen), d was deleted (seen as 4).
    view = application_view(dict(mirror), {"b": 20, "c": None, "d": 4})
    assert view == {"a": 1, "b": 20, "d": 4} and mirror == {"a": 1, "b": 2, "c": 3}
    items = JsonItems({"x": (1, 2)}, {"y": b'{"a":1}'}, list)
    assert dict(items.items()) == {"x": [1, 2], "y": {"a": 1}} and len(items) == 2
    assert dict(items.encoded_items()) == {"x": b"[1,2]", "y": b'{"a":1}'}


# -- the SQLite store --------------------------------------------------------------------


def vms(n: int, count: int = 50) -> dict[str, Any]:
    return {f"vm-{k}": {"uuid": f"vm-{k}", "alias": f"a{n}-{k}", "nics": []} for k in range(count)}


async def test_whole_and_incremental_saves_load_back_as_one_checkpoint(tmp_path: Path) -> None:
    store = SqliteCheckpointStore(tmp_path / "cp.sqlite", chunk_items=7)
    assert await store.load() is None
    first = vms(1)
    await store.save(
        Checkpoint(
            "c1",
            (VM, SERVER),
            {
                "vms": MirrorCheckpoint("vm", first, (), {"vm-3"}),
                "servers": MirrorCheckpoint("server", {"s": {"uuid": "s"}}),
            },
            sequence=1,
        )
    )
    changed = {"vm-1": {"uuid": "vm-1", "alias": "renamed", "nics": []}, "vm-99": {"new": 1}}
    await store.save(
        Checkpoint(
            "c2",
            (VM, SERVER),
            {
                "vms": MirrorCheckpoint("vm", changed, ["vm-2", "vm-4"], {"vm-5"}),
                "servers": MirrorCheckpoint("server", {}, ["s"]),
            },
            whole=False,
            sequence=2,
            base=1,
        )
    )
    loaded = await store.load()
    assert loaded is not None and loaded.whole and loaded.sequence == 2
    assert loaded.cursor == "c2" and loaded.change_kinds == (VM, SERVER)
    want = {k: v for k, v in first.items() if k not in ("vm-2", "vm-4")} | changed
    assert dict(loaded.mirrors["vms"].items) == want
    assert set(loaded.mirrors["vms"].pending) == {"vm-5"}
    assert dict(loaded.mirrors["servers"].items) == {}
    # A whole save replaces everything, the changes kept beside the chunks included.
    await store.save(
        Checkpoint("c3", (VM,), {"vms": MirrorCheckpoint("vm", vms(3, 5))}, sequence=3)
    )
    loaded = await store.load()
    assert loaded is not None and set(loaded.mirrors) == {"vms"}
    assert dict(loaded.mirrors["vms"].items) == vms(3, 5) and loaded.cursor == "c3"
    # Two names in one file do not see each other.
    other = SqliteCheckpointStore(store.path, name="other")
    assert await other.load() is None
    assert store.size_on_disk() > 0


async def test_an_incremental_save_on_top_of_a_save_the_file_does_not_hold_is_refused(
    tmp_path: Path,
) -> None:
    store = SqliteCheckpointStore(tmp_path / "cp.sqlite")
    part = MirrorCheckpoint("vm", vms(1, 3))
    await store.save(Checkpoint("c5", (VM,), {"vms": part}, sequence=5))
    for base, sequence in ((3, 4), (6, 7), (5, 5)):
        with pytest.raises(CheckpointError, match="another listener"):
            await store.save(
                Checkpoint("cx", (VM,), {"vms": part}, whole=False, sequence=sequence, base=base)
            )
    with pytest.raises(CheckpointError, match="does not hold"):
        await store.save(Checkpoint("cx", (VM,), {"other": part}, whole=False, sequence=6, base=5))
    loaded = await store.load()  # nothing of the refused saves went in
    assert loaded is not None and loaded.cursor == "c5" and loaded.sequence == 5


async def test_a_checkpoint_of_an_older_layout_is_refused(tmp_path: Path) -> None:
    store = SqliteCheckpointStore(tmp_path / "cp.sqlite")
    await store.save(Checkpoint("c1", (VM,), {}, sequence=1))
    with sqlite3.connect(store.path) as conn:
        conn.execute("UPDATE changefeed_checkpoint SET version = 0")
    with pytest.raises(CheckpointError, match="layout version 0"):
        await store.load()
    await store.close()
    with pytest.raises(ValueError, match="chunk_items"):
        SqliteCheckpointStore(store.path, chunk_items=0)


def _contents(path: Path) -> bytes:
    return path.read_bytes()


def _aside(directory: Path, name: str) -> list[Path]:
    return sorted(directory.glob(f"{name}.*-*"))


def _damage(path: Path) -> None:
    """Overwrite every page of the file after the second with garbage."""
    data = bytearray(path.read_bytes())
    page = 4096
    assert len(data) > 4 * page
    data[2 * page :] = b"\xff" * (len(data) - 2 * page)
    path.write_bytes(bytes(data))
    for suffix in ("-wal", "-shm"):
        Path(f"{path}{suffix}").unlink(missing_ok=True)


def _moved_aside(records: list[logging.LogRecord]) -> list[dict[str, Any]]:
    return [
        dict(r.cf_fields)  # type: ignore[attr-defined]
        for r in records
        if r.getMessage() == "listener.checkpoint.moved_aside"
    ]


async def _load_moves_aside(
    store: SqliteCheckpointStore, caplog: pytest.LogCaptureFixture, prefix: str
) -> tuple[Path, dict[str, Any]]:
    """Loading finds no checkpoint, and the file was moved aside once, to a name starting
    with ``prefix`` (logged at ERROR): where it went, and the log line's fields."""
    with caplog.at_level(logging.ERROR, "changefeed.listener"):
        assert await store.load() is None
    (moved,) = _moved_aside(caplog.records)
    aside = Path(moved["moved_to"])
    assert aside.name.startswith(prefix), moved
    return aside, moved


async def test_a_file_that_is_not_a_database_or_is_damaged_is_moved_aside_and_started_afresh(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Moved aside and started afresh (logged at ERROR), rather than every load and every
    save failing for good ("file is not a database")."""
    path = tmp_path / "cp.sqlite"
    garbage = b"not a database at all" * 100
    path.write_bytes(garbage)
    store = SqliteCheckpointStore(path)
    with caplog.at_level(logging.ERROR, "changefeed.listener"):
        assert await store.load() is None
    (moved,) = _moved_aside(caplog.records)
    aside = Path(moved["moved_to"])
    assert aside.name.startswith("cp.sqlite.corrupt-") and _contents(aside) == garbage
    assert "file is not a database" in moved["why"] and store.moved_aside == [aside]
    assert caplog.records[0].levelno == logging.ERROR and caplog.records[0].exc_info
    part = MirrorCheckpoint("vm", vms(1, 400))
    await store.save(Checkpoint("c1", (VM,), {"vms": part}, sequence=1))
    loaded = await store.load()
    assert loaded is not None and dict(loaded.mirrors["vms"].items) == vms(1, 400)
    await store.close()

    _damage(path)  # pages overwritten: found when the checkpoint is read
    caplog.clear()
    damaged = SqliteCheckpointStore(path)
    with caplog.at_level(logging.ERROR, "changefeed.listener"):
        assert await damaged.load() is None
    (moved,) = _moved_aside(caplog.records)
    assert "malformed" in moved["why"] or "not a database" in moved["why"], moved
    await damaged.save(Checkpoint("c2", (VM,), {"vms": part}, sequence=2))
    loaded = await damaged.load()
    assert loaded is not None and loaded.cursor == "c2"
    await damaged.close()


async def test_a_checkpoint_whose_rows_do_not_decode_is_copied_aside_and_started_afresh(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A valid SQLite file whose checkpoint rows do not decode is copied aside before
    the next save could write over the evidence (the file stays: other names'
    checkpoints live in it), logged at ERROR, and the load starts afresh."""
    path = tmp_path / "cp.sqlite"
    store = SqliteCheckpointStore(path)
    other = SqliteCheckpointStore(path, name="other")
    part = MirrorCheckpoint("vm", vms(1, 50))
    await store.save(Checkpoint("c1", (VM,), {"vms": part}, sequence=1))
    await other.save(Checkpoint("o1", (VM,), {"vms": part}, sequence=1))
    with sqlite3.connect(path) as conn:
        conn.execute(
            "UPDATE changefeed_checkpoint SET change_kinds = '{not json' WHERE name = ?",
            (store.name,),
        )
    path.chmod(0o600)
    with caplog.at_level(logging.ERROR, "changefeed.listener"):
        assert await store.load() is None
        assert await store.load() is None  # again, before a save: a copy of its own
    first, second = _moved_aside(caplog.records)
    aside = Path(first["moved_to"])
    assert aside.name.startswith("cp.sqlite.undecodable-")
    assert store.moved_aside == [aside, Path(second["moved_to"])] and aside != store.moved_aside[1]
    assert (os.stat(aside).st_mode & 0o777) == 0o600  # as private as the file it copies
    assert first["why"].startswith(f"checkpoint {store.name!r}:")
    assert caplog.records[0].levelno == logging.ERROR and caplog.records[0].exc_info
    with sqlite3.connect(aside) as conn:  # the evidence, as it was
        [(kinds,)] = conn.execute(
            "SELECT change_kinds FROM changefeed_checkpoint WHERE name = ?", (store.name,)
        )
    assert kinds == "{not json"
    # The file stayed: the other name's checkpoint loads, and the next save replaces this one.
    loaded = await other.load()
    assert loaded is not None and loaded.cursor == "o1"
    await store.save(Checkpoint("c2", (VM,), {"vms": part}, sequence=2))
    again = await store.load()
    assert again is not None and again.cursor == "c2"
    await store.close()
    await other.close()


async def test_a_file_of_a_newer_layout_is_moved_aside_unless_it_holds_other_tables(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """An older version does not write over a newer one's checkpoints: it moves the file
    aside and starts afresh, or refuses a file that holds the application's tables."""
    path = tmp_path / "cp.sqlite"
    newer = SqliteCheckpointStore(path)
    await newer.save(Checkpoint("c9", (VM,), {"vms": MirrorCheckpoint("vm", vms(1))}, sequence=9))
    await newer.close()
    with contextlib.closing(sqlite3.connect(path)) as conn, conn:
        conn.execute("UPDATE changefeed_checkpoint SET version = 2")
    older = SqliteCheckpointStore(path, name="another")  # any name: the layout is the file's
    aside, moved = await _load_moves_aside(older, caplog, "cp.sqlite.v2-")
    assert "layout version 2" in moved["why"]
    with contextlib.closing(sqlite3.connect(aside)) as conn:
        assert conn.execute("SELECT version, cursor FROM changefeed_checkpoint").fetchall() == [
            (2, "c9")
        ]
    await older.save(Checkpoint("c1", (VM,), {}, sequence=1))
    await older.close()

    # Beside the application's own tables, the file is the application's: refused, kept.
    shared = tmp_path / "app.sqlite"
    store = SqliteCheckpointStore(shared)
    await store.save(Checkpoint("c9", (VM,), {}, sequence=9))
    await store.close()
    with contextlib.closing(sqlite3.connect(shared)) as conn, conn:
        conn.execute("CREATE TABLE app_orders (id INTEGER PRIMARY KEY)")
        conn.execute("UPDATE changefeed_checkpoint SET version = 2")
        conn.execute("DROP TABLE changefeed_checkpoint_change")  # not in "version 2"
    with pytest.raises(CheckpointRefused, match="app_orders"):
        await SqliteCheckpointStore(shared).load()
    assert _aside(tmp_path, "app.sqlite") == []
    with contextlib.closing(sqlite3.connect(shared)) as conn:  # left as it was
        tables = {name for (name,) in conn.execute("SELECT name FROM sqlite_master")}
        assert "changefeed_checkpoint_change" not in tables


async def test_a_file_of_an_unknown_layout_is_moved_aside_unless_it_holds_other_tables(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Tables of the store's names with other columns were written by something else:
    moved aside and started afresh, rather than every load and save failing on a
    missing column; beside the application's tables, refused and left as it was."""
    path = tmp_path / "cp.sqlite"
    with contextlib.closing(sqlite3.connect(path)) as conn, conn:
        conn.execute("CREATE TABLE changefeed_checkpoint (name TEXT PRIMARY KEY, cursor TEXT)")
        conn.execute("INSERT INTO changefeed_checkpoint VALUES ('default', 'c7')")
    store = SqliteCheckpointStore(path)
    aside, moved = await _load_moves_aside(store, caplog, "cp.sqlite.unknown-")
    assert "changefeed_checkpoint has columns (cursor, name)" in moved["why"], moved
    with contextlib.closing(sqlite3.connect(aside)) as conn:  # the evidence, as it was
        assert conn.execute("SELECT * FROM changefeed_checkpoint").fetchall() == [("default", "c7")]
    await store.save(
        Checkpoint("c1", (VM,), {"vms": MirrorCheckpoint("vm", vms(1, 5))}, sequence=1)
    )
    loaded = await store.load()
    assert loaded is not None and loaded.cursor == "c1"
    await store.close()

    shared = tmp_path / "app.sqlite"
    with contextlib.closing(sqlite3.connect(shared)) as conn, conn:
        conn.execute("CREATE TABLE app_orders (id INTEGER PRIMARY KEY)")
        conn.execute("CREATE TABLE changefeed_checkpoint_mirror (name TEXT, what TEXT)")
    with pytest.raises(CheckpointRefused, match="app_orders"):
        await SqliteCheckpointStore(shared).load()
    assert _aside(tmp_path, "app.sqlite") == []


def _without_file_capabilities() -> None:
    """Clear CAP_DAC_OVERRIDE and CAP_DAC_READ_SEARCH from this thread's effective
    capabilities (Linux keeps them per thread), so that a file's mode applies to root in
    it as to anyone; nothing to clear for another user."""
    if os.geteuid() != 0:
        return

    class Header(ctypes.Structure):
        _fields_ = (("version", ctypes.c_uint32), ("pid", ctypes.c_int))

    class Data(ctypes.Structure):
        _fields_ = (
            ("effective", ctypes.c_uint32),
            ("permitted", ctypes.c_uint32),
            ("inheritable", ctypes.c_uint32),
        )

    libc = ctypes.CDLL(None, use_errno=True)
    header, data = Header(0x20080522, 0), (Data * 2)()  # _LINUX_CAPABILITY_VERSION_3
    if libc.capget(ctypes.byref(header), data) != 0:
        raise OSError(ctypes.get_errno(), "capget")
    data[0].effective &= ~((1 << 1) | (1 << 2))  # CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH
    if libc.capset(ctypes.byref(header), data) != 0:
        raise OSError(ctypes.get_errno(), "capset")


async def test_a_file_the_process_may_not_open_is_moved_aside_and_started_afresh(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A checkpoint whose mode shuts this process out (left by another user, or chmod)
    would fail every load and save for as long as the listener runs, and at every
    restart: moved aside (the directory allows it) and started afresh. The store's
    file work runs in the event loop's default executor, here a thread without root's
    way past a file's mode."""
    path = tmp_path / "cp.sqlite"
    first = SqliteCheckpointStore(path)
    await first.save(
        Checkpoint("c1", (VM,), {"vms": MirrorCheckpoint("vm", vms(1, 5))}, sequence=1)
    )
    await first.close()
    path.chmod(0)
    loop = asyncio.get_running_loop()
    with ThreadPoolExecutor(1, initializer=_without_file_capabilities) as executor:
        loop.set_default_executor(executor)
        store = SqliteCheckpointStore(path)
        aside, moved = await _load_moves_aside(store, caplog, "cp.sqlite.unreadable-")
        assert "may not open it" in moved["why"] and "----------" in moved["why"], moved
        assert store.moved_aside == [aside]
        assert (os.stat(aside).st_mode & 0o777) == 0  # as it was, for someone to look at
        await store.save(Checkpoint("c2", (VM,), {}, sequence=2))
        loaded = await store.load()
        assert loaded is not None and loaded.cursor == "c2"
        await store.close()


async def test_a_file_another_listener_holds_is_not_moved_aside_under_it(
    tmp_path: Path,
) -> None:
    """Listener "b" finds the file it shares with a running listener "a" unusable (here:
    b's rows are of a newer layout). Moving it aside would take a's checkpoint with it,
    a's later saves would go on into the renamed file as successes, and a's next start
    would bootstrap: b is refused, and the file stays where a saves."""
    path = tmp_path / "shared.sqlite"
    a = SqliteCheckpointStore(path, name="a")
    await a.save(Checkpoint("a1", (VM,), {"vms": MirrorCheckpoint("vm", vms(1))}, sequence=1))
    b = SqliteCheckpointStore(path, name="b")
    await b.save(Checkpoint("b1", (VM,), {}, sequence=1))
    await b.close()
    with contextlib.closing(sqlite3.connect(path)) as conn, conn:
        conn.execute("UPDATE changefeed_checkpoint SET version = 99 WHERE name = 'b'")
    newer = SqliteCheckpointStore(path, name="b")
    with pytest.raises(CheckpointRefused, match=r"other listeners hold checkpoints in it"):
        await newer.load()
    assert _aside(tmp_path, "shared.sqlite") == []
    await a.save(Checkpoint("a2", (VM,), {"vms": MirrorCheckpoint("vm", vms(2))}, sequence=2))
    await a.close()
    with contextlib.closing(sqlite3.connect(path)) as conn:
        rows = conn.execute("SELECT name, cursor FROM changefeed_checkpoint ORDER BY name")
        assert rows.fetchall() == [("a", "a2"), ("b", "b1")]


async def test_a_second_store_on_the_same_file_and_name_is_refused(tmp_path: Path) -> None:
    """A second writer on one checkpoint is refused, rather than both running and the last
    whole save winning; another name in the same file is not held up."""
    path = tmp_path / "cp.sqlite"
    first = SqliteCheckpointStore(path)
    assert await first.load() is None
    second = SqliteCheckpointStore(path)
    with pytest.raises(
        CheckpointRefused, match=f"in use by another listener \\(process {os.getpid()}"
    ):
        await second.load()
    with pytest.raises(CheckpointRefused):
        await second.save(Checkpoint("c1", (VM,), {}, sequence=1))
    other_name = SqliteCheckpointStore(path, name="other")
    await other_name.save(Checkpoint("c1", (VM,), {}, sequence=1))  # not held up
    await first.close()
    assert await second.load() is None  # free once the first let go
    await second.close()
    await other_name.close()


def test_a_claim_held_is_claimed_again_without_refusing_itself(tmp_path: Path) -> None:
    """A store whose file was moved aside and whose reopening failed claims the file
    again on its next use, not refused by its own lock ("in use by another listener
    (process <its own>)") until it is closed."""
    from changefeed.listener._file_claim import FileClaim, FileHeld

    path = tmp_path / "cp.sqlite"
    mine = FileClaim(path, "default")
    mine.claim()
    mine.claim()  # still this store's: nothing to refuse
    with pytest.raises(FileHeld) as held:
        FileClaim(path, "default").claim()  # another store's is refused
    assert held.value.holder == str(os.getpid())
    mine.release()
    again = FileClaim(path, "default")
    again.claim()
    again.release()


def _descriptors_of(path: Path) -> int:
    """File descriptors of this process open on ``path``."""
    count = 0
    for fd in Path("/proc/self/fd").iterdir():
        with contextlib.suppress(OSError):
            count += os.readlink(fd) == str(path)
    return count


async def test_a_store_keeps_one_connection_until_it_is_closed(tmp_path: Path) -> None:
    """One connection serves every load and save, rather than one opened (and set up) for
    each; closing the store closes it."""
    path = tmp_path / "cp.sqlite"
    store = SqliteCheckpointStore(path)
    for n in range(1, 6):
        await store.save(Checkpoint(f"c{n}", (VM,), {}, sequence=n))
        assert await store.load() is not None
        assert _descriptors_of(path) == 1
    await store.close()
    assert _descriptors_of(path) == 0


@pytest.mark.parametrize("seed", range(3))
async def test_a_writer_killed_at_any_moment_leaves_one_whole_checkpoint(
    tmp_path: Path, seed: int
) -> None:
    """SIGKILL between or inside saves, whole and incremental alike: every load finds
    exactly one save, never a mix; the next writer goes on from it."""
    from checkpoint_writer import expected

    rng = random.Random(f"torn-{seed}")
    path, items = tmp_path / "cp.sqlite", 3000
    last_loaded = 0
    for _ in range(6):
        process = await asyncio.create_subprocess_exec(
            sys.executable,
            str(WRITER),
            str(path),
            str(items),
            stdout=asyncio.subprocess.PIPE,
        )
        assert process.stdout is not None
        try:
            async with asyncio.timeout(60):
                # A few saves in, then kill at a random moment within the next ones.
                for _ in range(rng.randint(1, 4)):
                    line = await process.stdout.readline()
                    assert line.startswith(b"saved "), line
                await asyncio.sleep(rng.uniform(0, 0.3))
        finally:
            process.send_signal(signal.SIGKILL)
            await process.wait()
        assert process.returncode == -signal.SIGKILL
        store = SqliteCheckpointStore(path)
        loaded = await store.load()
        await store.close()  # the next writer's, now
        assert loaded is not None
        n = loaded.sequence
        assert n > last_loaded and loaded.cursor == f"c{n}"
        assert dict(loaded.mirrors["vms"].items) == expected(n, items)
        assert set(loaded.mirrors["vms"].pending) == {f"i{n % items}"}
        last_loaded = n


def stored_rows(path: Path) -> tuple[int, int]:
    """(resources in the chunks, change rows) the file holds, over every checkpoint."""
    with contextlib.closing(sqlite3.connect(path)) as conn:
        chunked = sum(
            len(orjson.loads(ids))
            for (ids,) in conn.execute("SELECT ids FROM changefeed_checkpoint_chunk")
        )
        (changes,) = conn.execute("SELECT count(*) FROM changefeed_checkpoint_change").fetchone()
    return chunked, changes


async def test_restarts_that_save_only_incrementally_keep_the_file_proportional_to_the_mirror(
    tmp_path: Path,
) -> None:
    """A listener restarted often never reaches its own whole-save threshold (its count
    of changes starts again at each start): 60 restarts, each loading the file and
    saving once, incrementally, while the fleet churns (ids created and deleted) and
    some resources change. The store folds its change rows into its chunks as they
    grow: what the file holds stays about the mirror's size, and loads the latest state."""
    path, size, churn = tmp_path / "cp.sqlite", 4000, 100

    def vm(k: int, alias: str) -> dict[str, Any]:
        return {"uuid": f"vm-{k}", "alias": alias, "nics": []}

    mirror = {f"vm-{k}": vm(k, "a0") for k in range(size)}
    store = SqliteCheckpointStore(path, chunk_items=500)
    await store.save(Checkpoint("c1", (VM,), {"vms": MirrorCheckpoint("vm", mirror)}, sequence=1))
    await store.close()
    first_size = store.size_on_disk()
    assert stored_rows(path) == (size, 0)
    created, folds, last_changes = size, 0, 0
    for restart in range(2, 62):
        store = SqliteCheckpointStore(path, chunk_items=500)  # a new process
        loaded = await store.load()
        assert loaded is not None and loaded.sequence == restart - 1
        assert dict(loaded.mirrors["vms"].items) == mirror
        gone = sorted(mirror, key=lambda key: int(key[3:]))[:churn]
        for key in gone:
            del mirror[key]
        changed = {f"vm-{k}": vm(k, "new") for k in range(created, created + churn)}
        created += churn
        for key in sorted(mirror)[restart : restart + 2 * churn : 2]:
            changed[key] = {**mirror[key], "alias": f"a{restart}"}
        mirror.update(changed)
        part = MirrorCheckpoint("vm", changed, gone, {key for key in changed if key < "vm-2"})
        await store.save(
            Checkpoint(
                f"c{restart}", (VM,), {"vms": part}, whole=False, sequence=restart, base=restart - 1
            )
        )
        await store.close()  # the process ends
        chunked, changes = stored_rows(path)
        assert chunked + changes <= 1.6 * size, (restart, chunked, changes)
        folds += changes < last_changes
        last_changes = changes
    assert folds >= 3 and len(mirror) == size
    assert store.size_on_disk() <= 2 * first_size, (store.size_on_disk(), first_size)
    loaded = await SqliteCheckpointStore(path).load()
    assert loaded is not None and loaded.cursor == "c61" and loaded.sequence == 61
    assert dict(loaded.mirrors["vms"].items) == mirror
    assert set(loaded.mirrors["vms"].pending) == set(part.pending)
