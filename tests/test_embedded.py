"""The embedded PostgreSQL server: real binaries, loopback TCP, restart, reuse, clean stop.

One throwaway data directory serves the whole module (initdb runs once); each
test starts the server if it needs it running.
"""

from __future__ import annotations

import os
import shutil
import socket
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import asyncpg
import psutil
import pytest
from helpers import standby_caught_up

from changefeed import embedded_host
from changefeed.embedded import (
    EmbeddedPostgres,
    EmbeddedPostgresError,
    default_data_dir,
    find_postgres_bindir,
    standby_of,
    temporary,
)
from changefeed.schemas.migrations import apply_schema, load_migrations

IS_ROOT = os.geteuid() == 0


@pytest.fixture(scope="module")
def server() -> Iterator[EmbeddedPostgres]:
    pg = temporary(settings={"work_mem": "7MB"})
    try:
        yield pg
    finally:
        pg.close()
    assert not pg.data_dir.exists()


def processes_of(data_dir: Path) -> list[psutil.Process]:
    """Live processes whose command line names ``data_dir``."""
    found = []
    for proc in psutil.process_iter(["cmdline", "status"]):
        cmdline = proc.info["cmdline"] or []
        if proc.info["status"] != psutil.STATUS_ZOMBIE and any(
            str(data_dir) in part for part in cmdline
        ):
            found.append(proc)
    return found


def server_tree(pg: EmbeddedPostgres) -> list[psutil.Process]:
    """The postmaster and all its children."""
    pid = int((pg.data_dir / "postmaster.pid").read_text().split()[0])
    postmaster = psutil.Process(pid)
    return [postmaster, *postmaster.children(recursive=True)]


def assert_all_gone(procs: list[psutil.Process], timeout: float = 5.0) -> None:
    """Every process in ``procs`` has exited (a zombie waiting to be reaped counts)."""

    def running(proc: psutil.Process) -> bool:
        try:
            return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return False

    deadline = time.monotonic() + timeout
    while alive := [p for p in procs if running(p)]:
        assert time.monotonic() < deadline, f"processes left behind: {alive}"
        time.sleep(0.02)


def test_find_postgres_bindir_has_the_programs() -> None:
    bindir = find_postgres_bindir()
    for name in ("initdb", "pg_ctl", "postgres"):
        assert os.access(bindir / name, os.X_OK)


def test_find_postgres_bindir_honours_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    real = find_postgres_bindir()
    monkeypatch.setenv("CHANGEFEED_PG_BINDIR", str(real))
    assert find_postgres_bindir() == real
    monkeypatch.setenv("CHANGEFEED_PG_BINDIR", str(tmp_path))
    with pytest.raises(EmbeddedPostgresError, match="CHANGEFEED_PG_BINDIR"):
        find_postgres_bindir()


def test_find_postgres_bindir_says_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CHANGEFEED_PG_BINDIR", raising=False)
    monkeypatch.setattr(embedded_host, "_has_programs", lambda bindir: False)
    with pytest.raises(EmbeddedPostgresError, match="apt-get install postgresql"):
        find_postgres_bindir()


def test_default_data_dir(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_DATA_HOME", "/somewhere/data")
    if IS_ROOT:
        assert default_data_dir() == Path("/var/tmp/changefeed/pg")
    else:
        assert default_data_dir() == Path("/somewhere/data/changefeed/pg")


def test_starts_on_loopback_tcp_with_socket_in_data_dir(server: EmbeddedPostgres) -> None:
    dsn = server.start()
    assert dsn == f"postgresql://postgres@127.0.0.1:{server.port}/postgres"
    assert server.dsn == dsn
    assert server.is_running()
    postmaster = server_tree(server)[0]
    listening = {
        (c.laddr.ip, c.laddr.port)
        for c in postmaster.net_connections(kind="inet")
        if c.status == psutil.CONN_LISTEN
    }
    assert listening == {("127.0.0.1", server.port)}
    assert (server.data_dir / f".s.PGSQL.{server.port}").is_socket()
    assert not Path(f"/var/run/postgresql/.s.PGSQL.{server.port}").exists()
    if IS_ROOT:
        assert postmaster.username() in ("postgres", "nobody")


async def test_answers_queries_with_test_settings(server: EmbeddedPostgres) -> None:
    server.start()
    conn = await asyncpg.connect(server.dsn)
    try:
        assert await conn.fetchval("SELECT 1") == 1
        assert await conn.fetchval("SHOW fsync") == "off"
        assert await conn.fetchval("SHOW synchronous_commit") == "off"
        assert await conn.fetchval("SHOW max_connections") == "300"
        assert await conn.fetchval("SHOW work_mem") == "7MB"  # settings= extends the defaults
        assert await conn.fetchval("SHOW server_encoding") == "UTF8"
    finally:
        await conn.close()


async def test_restart_keeps_port_and_data(server: EmbeddedPostgres) -> None:
    server.start()
    port = server.port
    old_pid = server_tree(server)[0].pid
    conn = await asyncpg.connect(server.dsn)
    try:
        await conn.execute("CREATE TABLE IF NOT EXISTS kept (v text)")
        await conn.execute("INSERT INTO kept VALUES ('before restart')")
    finally:
        await conn.close()

    assert server.restart() == f"postgresql://postgres@127.0.0.1:{port}/postgres"
    assert server.port == port
    assert server_tree(server)[0].pid != old_pid
    conn = await asyncpg.connect(server.dsn)
    try:
        assert "before restart" in [r["v"] for r in await conn.fetch("SELECT v FROM kept")]
    finally:
        await conn.close()


async def test_stop_leaves_no_process_behind(server: EmbeddedPostgres) -> None:
    server.start()
    conn = await asyncpg.connect(server.dsn)  # a backend that stop() must end
    try:
        procs = server_tree(server)
        assert len(procs) > 2
        server.stop()
        assert not server.is_running()
        assert_all_gone(procs)
        assert processes_of(server.data_dir) == []
        server.stop()  # stopping a stopped server is fine
    finally:
        conn.terminate()


def test_stop_kills_when_pg_ctl_fails(
    server: EmbeddedPostgres, monkeypatch: pytest.MonkeyPatch
) -> None:
    server.start()
    procs = server_tree(server)

    def broken_pg_ctl(*args: object, **kwargs: object) -> None:
        raise EmbeddedPostgresError("pg_ctl broke")

    with monkeypatch.context() as m:
        m.setattr(server, "_pg_ctl", broken_pg_ctl)
        server.stop()
    assert not server.is_running()
    assert_all_gone(procs)
    assert processes_of(server.data_dir) == []
    server.start()  # the killed server's data dir still starts
    assert server.is_running()
    server.stop()


async def test_reuses_data_dir(server: EmbeddedPostgres) -> None:
    server.start()
    port = server.port
    server.stop()
    version_file = (server.data_dir / "PG_VERSION").stat()

    again = EmbeddedPostgres(server.data_dir)
    try:
        assert again.start() == f"postgresql://postgres@127.0.0.1:{port}/postgres"
        conn = await asyncpg.connect(again.dsn)
        try:
            assert await conn.fetchval("SELECT to_regclass('kept') IS NOT NULL")
        finally:
            await conn.close()
    finally:
        again.stop()
    after = (server.data_dir / "PG_VERSION").stat()
    assert (after.st_ino, after.st_mtime_ns) == (version_file.st_ino, version_file.st_mtime_ns)
    assert processes_of(server.data_dir) == []


def test_recorded_port_taken_picks_another(server: EmbeddedPostgres) -> None:
    server.start()
    port = server.port
    server.stop()
    with socket.socket() as squatter:
        squatter.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        squatter.bind(("127.0.0.1", port))
        squatter.listen()
        again = EmbeddedPostgres(server.data_dir)
        try:
            again.start()
            assert again.port != port
            assert again.is_running()
        finally:
            again.stop()
        server.start()  # start() after stop() prefers its last port, but not at any price
        assert server.port != port
        server.stop()


def test_adopts_running_server_of_same_data_dir(server: EmbeddedPostgres) -> None:
    server.start()
    other = EmbeddedPostgres(server.data_dir)
    assert other.start() == server.dsn
    other.stop()
    assert not server.is_running()


def test_start_failure_reports_server_log(server: EmbeddedPostgres) -> None:
    server.stop()
    broken = EmbeddedPostgres(server.data_dir, settings={"shared_buffers": "bogus"})
    with pytest.raises(EmbeddedPostgresError) as info:
        broken.start()
    assert 'invalid value for parameter "shared_buffers"' in str(info.value)
    assert str(server.log_file) in str(info.value)
    assert processes_of(server.data_dir) == []
    server.start()  # the next start rewrites the settings
    assert server.is_running()


def test_managed_settings_are_refused(tmp_path: Path) -> None:
    with pytest.raises(EmbeddedPostgresError, match="port"):
        EmbeddedPostgres(tmp_path, settings={"port": "5432"})
    with pytest.raises(EmbeddedPostgresError, match="plain identifier"):
        EmbeddedPostgres(tmp_path, settings={"x = 1\nfsync": "on"})


def test_refuses_to_initdb_over_foreign_files() -> None:
    root = Path(tempfile.mkdtemp(prefix="changefeed-test-"))
    try:
        root.chmod(0o755)
        (root / "data").mkdir()
        (root / "data" / "precious.txt").write_text("mine")
        with pytest.raises(EmbeddedPostgresError, match="refusing to initdb"):
            EmbeddedPostgres(root / "data").start()
        assert (root / "data" / "precious.txt").read_text() == "mine"
    finally:
        shutil.rmtree(root)


@pytest.mark.skipif(not IS_ROOT, reason="only root hands the server to another user")
def test_root_refuses_data_dir_the_server_user_cannot_enter() -> None:
    private = Path(tempfile.mkdtemp(prefix="changefeed-test-"))  # mode 700, owned by root
    try:
        with pytest.raises(EmbeddedPostgresError, match="cannot enter"):
            EmbeddedPostgres(private / "data").start()
    finally:
        shutil.rmtree(private)


@pytest.mark.skipif(not IS_ROOT, reason="only root hands the server to another user")
def test_root_refuses_server_programs_the_server_user_cannot_reach() -> None:
    private = Path(tempfile.mkdtemp(prefix="changefeed-test-"))  # mode 700, owned by root
    try:
        (private / "bin").symlink_to(find_postgres_bindir())
        pg = temporary(bindir=private / "bin")
        with pytest.raises(EmbeddedPostgresError, match=f"cannot enter {private} to run"):
            pg.start()
        pg.close()
    finally:
        shutil.rmtree(private)


# --------------------------------------------------------------------------- the pgserver wheel


def _without_debians_server(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """Make this machine look like one without Debian's postgresql package; return
    the pgserver wheel's program directory, which must then be the one found."""
    monkeypatch.delenv("CHANGEFEED_PG_BINDIR", raising=False)
    monkeypatch.setattr(embedded_host, "_DEBIAN_ROOT", tmp_path / "no-debian-postgresql")
    bindir = embedded_host._pgserver_bindir()
    assert bindir is not None, "the pgserver wheel is missing: ./dev setup installs that extra"
    return bindir


def test_without_debians_server_the_pgserver_wheel_is_found(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    bindir = _without_debians_server(monkeypatch, tmp_path)
    assert find_postgres_bindir() == bindir
    for name in ("initdb", "pg_ctl", "postgres"):
        assert os.access(bindir / name, os.X_OK)


async def test_the_embedded_server_runs_from_the_pgserver_wheel(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    bindir = _without_debians_server(monkeypatch, tmp_path)
    pg = temporary()
    try:
        run_as = embedded_host._RunAs()
        if run_as.switches and not all(run_as.can_traverse(d) for d in (*bindir.parents, bindir)):
            # Root, with the virtualenv where the server's user cannot go: say so.
            with pytest.raises(EmbeddedPostgresError, match=r"cannot enter .* server programs"):
                pg.start()
            return
        conn = await asyncpg.connect(pg.start())
        try:
            assert await apply_schema(conn) == [m.version for m in load_migrations()]
            await conn.execute("SELECT changefeed.publish('vm', ARRAY['nic'], 'x')")
            assert await conn.fetchval("SELECT count(*) FROM changefeed.feed") == 1
        finally:
            await conn.close()
        assert Path(server_tree(pg)[0].exe()).parent == bindir.resolve()
    finally:
        pg.close()


async def test_a_standby_follows_its_primary_and_is_promoted(server: EmbeddedPostgres) -> None:
    """clone_standby: a hot standby of a running server (its settings carried over),
    streaming its writes; promote() makes it a primary; close() leaves nothing behind."""
    server.start()
    standby = standby_of(server)
    try:
        standby.start()
        assert standby.port != server.port
        primary = await asyncpg.connect(server.dsn)
        replica = await asyncpg.connect(standby.dsn)
        try:
            assert await replica.fetchval("SELECT pg_is_in_recovery()")
            assert await replica.fetchval("SHOW work_mem") == "7MB"  # the primary's setting
            assert await replica.fetchval("SHOW hot_standby_feedback") == "on"
            await primary.execute("CREATE TABLE IF NOT EXISTS copied (x int)")
            await primary.execute("INSERT INTO copied VALUES (1)")
            await standby_caught_up(server.dsn, standby.dsn)
            assert await replica.fetchval("SELECT count(*) FROM copied") >= 1
        finally:
            await primary.close()
            await replica.close()
        standby.promote()
        promoted = await asyncpg.connect(standby.dsn)
        try:
            assert not await promoted.fetchval("SELECT pg_is_in_recovery()")
            await promoted.execute("INSERT INTO copied VALUES (2)")
        finally:
            await promoted.close()
        tree = server_tree(standby)
    finally:
        standby.close()
    assert_all_gone(tree)
    assert not standby.data_dir.exists()


def test_a_standby_needs_a_running_primary_and_an_empty_directory(
    server: EmbeddedPostgres, tmp_path: Path
) -> None:
    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "something").write_text("x")
    server.start()
    with pytest.raises(EmbeddedPostgresError, match="not empty"):
        server.clone_standby(taken)
    stopped = EmbeddedPostgres(tmp_path / "never-started")
    with pytest.raises(EmbeddedPostgresError, match="not running"):
        stopped.clone_standby(tmp_path / "standby")
