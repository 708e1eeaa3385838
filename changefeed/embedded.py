"""An embedded PostgreSQL server for the demo and the tests.

What it is for: running the real PostgreSQL server binaries (``initdb``,
``pg_ctl``, ``postgres``; no Docker) on a private data directory, listening on
loopback TCP only, so that the demo and the integration tests have a real
database without any setup. It is not a way to run PostgreSQL in production;
``deploy/`` describes that.

What it does to the machine:

* It creates the data directory (and any missing parents) and runs ``initdb``
  there once; a data directory that already holds ``PG_VERSION`` is reused as
  it is. The server log is ``<data_dir>/server.log``; the settings it manages
  are written to ``<data_dir>/changefeed.conf`` (included from
  ``postgresql.conf``).
* The server listens on ``127.0.0.1`` (or the ``host`` given) on a free port,
  and puts its unix socket in the data directory, never in
  ``/var/run/postgresql``. Authentication is ``trust``: any local user can
  connect as ``postgres``. Durability is switched off (``fsync=off``,
  ``full_page_writes=off``): a machine crash can lose or corrupt the data.
* :func:`default_data_dir` is ``$XDG_DATA_HOME/changefeed/pg`` (default
  ``~/.local/share/changefeed/pg``) for ordinary users.
* PostgreSQL refuses to run as root. When this process is root, every
  PostgreSQL program runs as the ``postgres`` system user (``nobody`` when
  there is none), the data directory is chown'ed to that user, and every
  ancestor directory must be traversable by it. Since ``/root`` is mode 700,
  the default data directory for root is ``/var/tmp/changefeed/pg`` (created
  mode 755).

What it must never do: touch a PostgreSQL it did not start (the system's
cluster, ``/var/run/postgresql``), change the permissions of directories it did
not create, listen on anything but the given host, register anything global
(no ``atexit`` hooks, no signal handlers), or leave a server process behind
after :meth:`EmbeddedPostgres.stop`.

A standby (:meth:`EmbeddedPostgres.clone_standby`, :func:`standby_of`) is a
second server on a data directory of its own, made with ``pg_basebackup -R``
from a running one, which it then follows by streaming replication: the
shape a deployment with read replicas has, on one machine. It changes nothing
on the server it copies but what streaming replication does (a replication
connection while the copy runs, and one per standby afterwards).

This module is the server's life cycle; finding the binaries, the user the
programs run as, free ports and process checks are in ``embedded_host``.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path
from types import TracebackType
from typing import Any, Self

from .embedded_host import (
    EmbeddedPostgresError,
    _children_of,
    _free_port,
    _make_dirs,
    _port_is_free,
    _RunAs,
    default_data_dir,
    find_postgres_bindir,
)
from .processes import pid_alive, pid_exists

__all__ = [
    "DEFAULT_SETTINGS",
    "STANDBY_SETTINGS",
    "EmbeddedPostgres",
    "EmbeddedPostgresError",
    "default_data_dir",
    "find_postgres_bindir",
    "standby_of",
    "temporary",
]

DEFAULT_SETTINGS: dict[str, str] = {
    "fsync": "off",
    "synchronous_commit": "off",
    "full_page_writes": "off",
    "max_connections": "300",
    "shared_buffers": "128MB",
}
"""Settings for tests and the demo: fast, not durable."""

STANDBY_SETTINGS: dict[str, str] = {
    # Ask the primary to keep the rows a standby query still reads: no snapshot
    # conflicts, hence no cancelled reads, at the price of vacuum waiting for them.
    "hot_standby_feedback": "on",
    # How long replay waits for a conflicting standby query before cancelling it
    # (SQLSTATE 40001); what is left (locks) the publisher retries.
    "max_standby_streaming_delay": "5s",
    # Ask the primary again soon after it went away (a restart, a switchover).
    "wal_retrieve_retry_interval": "500ms",
}
"""Settings of a standby made by ``clone_standby``: those a publisher reading it relies on."""

_CONF_NAME = "changefeed.conf"
_INCLUDE_LINE = f"include_if_exists = '{_CONF_NAME}'"
_LOG_NAME = "server.log"
_SETTING_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_.]*$")
_MANAGED = ("listen_addresses", "port", "unix_socket_directories")
_SOCKET_PATH_MAX = 107  # sun_path is 108 bytes on Linux, NUL included
_BIND_RETRIES = 3


def _quote_setting(value: str) -> str:
    return "'" + value.replace("\\", "\\\\").replace("'", "''") + "'"


# --------------------------------------------------------------------------- the server


class EmbeddedPostgres:
    """A PostgreSQL server on a private data directory, listening on loopback TCP.

    Args:
        data_dir: the cluster's data directory; created and ``initdb``'ed when
            it holds no ``PG_VERSION``, reused otherwise.
        port: TCP port; None picks one: the port this data directory used last
            time if it is free, else a free one.
        host: the one address to listen on.
        settings: server settings; override and extend DEFAULT_SETTINGS.
            ``listen_addresses``, ``port`` and ``unix_socket_directories`` are
            managed here and cannot be set.
        bindir: where the server programs are; default find_postgres_bindir().
        start_timeout: seconds to wait for the server to accept connections.
        stop_timeout: seconds to wait for each way of stopping it.
        discard_on_close: close() (and leaving the ``with`` block) deletes
            ``discard_root`` (default: ``data_dir``) after stopping; set by
            :func:`temporary`.
    """

    def __init__(
        self,
        data_dir: Path,
        *,
        port: int | None = None,
        host: str = "127.0.0.1",
        settings: dict[str, str] | None = None,
        bindir: Path | None = None,
        start_timeout: float = 60.0,
        stop_timeout: float = 30.0,
        discard_on_close: bool = False,
        discard_root: Path | None = None,
    ) -> None:
        self.data_dir = Path(data_dir).absolute()
        self.host = host
        self._requested_port = port
        self._port: int | None = port
        self._settings = dict(DEFAULT_SETTINGS)
        for name, value in (settings or {}).items():
            if not _SETTING_NAME.match(name):
                raise EmbeddedPostgresError(f"setting name {name!r} is not a plain identifier")
            if name in _MANAGED:
                raise EmbeddedPostgresError(
                    f"setting {name!r} is managed by EmbeddedPostgres (use host= / port=)"
                )
            self._settings[name] = str(value)
        self._bindir = bindir
        self.start_timeout = start_timeout
        self.stop_timeout = stop_timeout
        self._discard_root = (discard_root or self.data_dir) if discard_on_close else None
        self._run_as: _RunAs | None = None

    # ----------------------------------------------------------------- public API

    @property
    def port(self) -> int:
        """The TCP port (known once started)."""
        if self._port is None:
            raise EmbeddedPostgresError("the server has no port yet: call start() first")
        return self._port

    @property
    def dsn(self) -> str:
        """``postgresql://postgres@HOST:PORT/postgres``."""
        return self.dsn_for("postgres")

    @property
    def log_file(self) -> Path:
        return self.data_dir / _LOG_NAME

    def dsn_for(self, database: str) -> str:
        """The DSN of ``database`` on this server."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"postgresql://postgres@{host}:{self.port}/{database}"

    def is_running(self) -> bool:
        """Whether a postmaster is alive for this data directory."""
        pid = self._postmaster_pid()
        return pid is not None and pid_alive(pid)

    def start(self) -> str:
        """Initialise the data directory if needed, start the server, return its DSN.

        Does nothing but return the DSN when the server of this data directory
        is already running (it is then adopted: stop() stops it).

        Raises:
            EmbeddedPostgresError: with the tail of the server log on failure.
        """
        return self._start(pinned_port=self._requested_port)

    def _start(self, pinned_port: int | None) -> str:
        bindir = self._bindir or find_postgres_bindir()
        run_as = self._user()
        self._prepare_data_dir(bindir, run_as)
        if self.is_running():
            self._adopt()
            return self.dsn
        for attempt in range(_BIND_RETRIES):
            port = self._choose_port(pinned_port, fresh=attempt > 0)
            self._write_conf(port, run_as)
            offset = self.log_file.stat().st_size if self.log_file.exists() else 0
            try:
                self._pg_ctl_start(bindir, run_as)
            except EmbeddedPostgresError as exc:
                log = self._log_since(offset)
                if pinned_port is None and ("could not bind" in log or "already in use" in log):
                    continue  # lost a race for the port; try another
                raise EmbeddedPostgresError(f"{exc}\n--- {self.log_file} ---\n{log}") from None
            self._port = port
            return self.dsn
        raise EmbeddedPostgresError(
            f"no free port found for PostgreSQL after {_BIND_RETRIES} attempts; see {self.log_file}"
        )

    def stop(self) -> None:
        """Stop the server and wait until no process of it is left.

        ``pg_ctl stop -m fast``, then ``-m immediate``, then SIGKILL of the
        postmaster and its children. Stopping a stopped server does nothing.
        """
        if not self.data_dir.exists():
            return
        bindir = self._bindir or find_postgres_bindir()
        run_as = self._user()
        for mode in ("fast", "immediate"):
            if not self.is_running():
                return
            with contextlib.suppress(EmbeddedPostgresError):
                self._pg_ctl(
                    bindir,
                    run_as,
                    ["stop", "-m", mode, "-w", "-t", str(int(self.stop_timeout))],
                    timeout=self.stop_timeout + 10,
                )
        self._kill()

    def crash(self) -> None:
        """Kill the server and all its processes at once (SIGKILL), as a machine that
        loses power would: nothing is flushed or sent to standbys first."""
        self._kill()

    def _kill(self) -> None:
        pid = self._postmaster_pid()
        if pid is None or not pid_alive(pid):
            return
        victims = [pid, *_children_of(pid)]
        for victim in victims:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(victim, signal.SIGKILL)
        deadline = time.monotonic() + self.stop_timeout
        while any(pid_alive(v) for v in victims):
            if time.monotonic() > deadline:
                raise EmbeddedPostgresError(
                    f"PostgreSQL processes {victims} of {self.data_dir} survived SIGKILL"
                )
            time.sleep(0.02)
        self._clear_stale_locks(victims)

    def restart(self) -> str:
        """Stop and start again on the same port and data directory; return the DSN.

        Raises:
            EmbeddedPostgresError: the port was taken meanwhile, or the start failed.
        """
        pinned = self._port if self._port is not None else self._requested_port
        self.stop()
        return self._start(pinned_port=pinned)

    def clone_standby(
        self,
        data_dir: Path,
        *,
        settings: dict[str, str] | None = None,
        **kwargs: Any,
    ) -> EmbeddedPostgres:
        """Copy this running server into ``data_dir`` as a streaming standby of it.

        ``pg_basebackup -R`` (WAL streamed alongside, a fast checkpoint) writes a
        ``standby.signal`` and a ``primary_conninfo`` naming this server's host and
        port, so the standby follows this server by streaming replication once
        started, and again after either of them restarts on the same port.

        Args:
            data_dir: a directory that does not exist yet, or is empty.
            settings: server settings of the standby, over this server's and
                ``STANDBY_SETTINGS``.
            kwargs: the standby's other EmbeddedPostgres arguments.

        Returns:
            the standby, not started.

        Raises:
            EmbeddedPostgresError: this server is not running, ``data_dir`` holds
                something, or ``pg_basebackup`` failed (its output included).
        """
        if not self.is_running():
            raise EmbeddedPostgresError(f"{self!r} is not running: nothing to copy")
        bindir = self._bindir or find_postgres_bindir()
        basebackup = bindir / "pg_basebackup"
        if not os.access(basebackup, os.X_OK):
            raise EmbeddedPostgresError(f"no pg_basebackup beside the server programs in {bindir}")
        run_as = self._user()
        data_dir = Path(data_dir).absolute()
        if data_dir.exists() and any(data_dir.iterdir()):
            raise EmbeddedPostgresError(f"{data_dir} is not empty: not copying a server into it")
        _make_dirs(data_dir.parent)
        data_dir.mkdir(mode=0o700, exist_ok=True)
        run_as.chown(data_dir)
        argv = [
            str(basebackup),
            f"--pgdata={data_dir}",
            f"--host={self.host}",
            f"--port={self.port}",
            "--username=postgres",
            "--write-recovery-conf",
            "--wal-method=stream",
            "--checkpoint=fast",
            "--no-sync",
        ]
        result = self._run(argv, run_as, timeout=max(self.start_timeout, 120.0))
        if result.returncode != 0:
            raise EmbeddedPostgresError(
                f"pg_basebackup of {self.data_dir} into {data_dir} failed "
                f"(exit {result.returncode}):\n{(result.stderr or result.stdout).strip()}"
            )
        # The copy holds this server's log and its managed settings; the standby
        # writes its own at every start.
        with contextlib.suppress(OSError):
            (data_dir / _LOG_NAME).unlink()
        # A hot standby refuses to run with less of some resources than its
        # primary (max_connections among them): it starts from this server's.
        merged = {**self._settings, **STANDBY_SETTINGS, **(settings or {})}
        return EmbeddedPostgres(data_dir, settings=merged, bindir=self._bindir, **kwargs)

    def promote(self) -> None:
        """Promote this standby to a primary (``pg_ctl promote``, waiting until it is).

        Raises:
            EmbeddedPostgresError: it is not a running standby, or did not finish.
        """
        bindir = self._bindir or find_postgres_bindir()
        self._pg_ctl(
            bindir,
            self._user(),
            ["promote", "-w", "-t", str(int(self.start_timeout))],
            timeout=self.start_timeout + 10,
        )

    def close(self) -> None:
        """Stop; delete the data directory too when it is a throwaway one."""
        try:
            self.stop()
        finally:
            if self._discard_root is not None:
                shutil.rmtree(self._discard_root, ignore_errors=True)

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"EmbeddedPostgres(data_dir={str(self.data_dir)!r}, port={self._port})"

    # ----------------------------------------------------------------- internals

    def _user(self) -> _RunAs:
        if self._run_as is None:
            self._run_as = _RunAs()
        return self._run_as

    def _run(
        self, argv: list[str], run_as: _RunAs, timeout: float
    ) -> subprocess.CompletedProcess[str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("PG")}
        env["LC_ALL"] = "C"
        try:
            return subprocess.run(
                argv,
                stdin=subprocess.DEVNULL,
                capture_output=True,
                text=True,
                timeout=timeout,
                check=False,
                cwd="/",
                env=env,
                **run_as.subprocess_kwargs(),
            )
        except subprocess.TimeoutExpired:
            raise EmbeddedPostgresError(
                f"{Path(argv[0]).name} did not finish within {timeout:.0f}s"
            ) from None
        except OSError as exc:
            raise EmbeddedPostgresError(f"cannot run {argv[0]}: {exc}") from None

    def _pg_ctl(
        self, bindir: Path, run_as: _RunAs, args: list[str], timeout: float
    ) -> subprocess.CompletedProcess[str]:
        argv = [str(bindir / "pg_ctl"), "-D", str(self.data_dir), *args]
        result = self._run(argv, run_as, timeout)
        if result.returncode != 0:
            output = (result.stderr or result.stdout).strip()
            raise EmbeddedPostgresError(
                f"pg_ctl {args[0]} failed (exit {result.returncode}): {output}"
            )
        return result

    def _pg_ctl_start(self, bindir: Path, run_as: _RunAs) -> None:
        self._pg_ctl(
            bindir,
            run_as,
            ["start", "-w", "-t", str(int(self.start_timeout)), "-l", str(self.log_file)],
            timeout=self.start_timeout + 10,
        )

    def _prepare_data_dir(self, bindir: Path, run_as: _RunAs) -> None:
        _make_dirs(self.data_dir.parent)
        if run_as.switches:
            blocked = [d for d in reversed(self.data_dir.parents) if not run_as.can_traverse(d)]
            if blocked:
                raise EmbeddedPostgresError(
                    f"PostgreSQL runs as {run_as.name!r} (this process is root), which "
                    f"cannot enter {blocked[0]}: put the data directory elsewhere "
                    f"(e.g. {default_data_dir()} or under /tmp)"
                )
            # The programs too: a virtualenv under /root holding the pgserver wheel
            # would otherwise fail later as a bare "permission denied".
            unreachable = [
                d for d in (*reversed(bindir.parents), bindir) if not run_as.can_traverse(d)
            ]
            if unreachable:
                raise EmbeddedPostgresError(
                    f"PostgreSQL runs as {run_as.name!r} (this process is root), which "
                    f"cannot enter {unreachable[0]} to run the server programs in {bindir}: "
                    "install Debian's postgresql package, or keep the programs where that "
                    "user can reach them (CHANGEFEED_PG_BINDIR)"
                )
        if (self.data_dir / "PG_VERSION").exists():
            if run_as.switches and self.data_dir.stat().st_uid != run_as.uid:
                run_as.chown_tree(self.data_dir)
            return
        if self.data_dir.exists() and any(self.data_dir.iterdir()):
            raise EmbeddedPostgresError(
                f"{self.data_dir} is neither empty nor a PostgreSQL data directory "
                "(no PG_VERSION); refusing to initdb over it"
            )
        self.data_dir.mkdir(mode=0o700, exist_ok=True)
        run_as.chown(self.data_dir)
        argv = [
            str(bindir / "initdb"),
            "-D",
            str(self.data_dir),
            "--auth=trust",
            "--username=postgres",
            "--encoding=UTF8",
            "--no-locale",
            "--no-sync",
        ]
        result = self._run(argv, run_as, timeout=max(self.start_timeout, 120.0))
        if result.returncode != 0:
            raise EmbeddedPostgresError(
                f"initdb {self.data_dir} failed (exit {result.returncode}):\n"
                f"{(result.stderr or result.stdout).strip()}"
            )

    def _postmaster_pid(self) -> int | None:
        try:
            first = (self.data_dir / "postmaster.pid").read_text().split("\n", 1)[0]
        except OSError:
            return None
        try:
            return int(first.strip())
        except ValueError:
            return None

    def _clear_stale_locks(self, victims: list[int]) -> None:
        """After SIGKILL: let the next start see that the old server is gone.

        The killed processes are orphans; until their new parent reaps them
        they are zombies, and PostgreSQL's lock-file check (``kill(pid, 0)``)
        takes a zombie for a running postmaster. Wait briefly for the reaping
        (PostgreSQL then cleans up after the dead server itself); past that,
        remove the lock files that name the dead postmaster.
        """
        deadline = time.monotonic() + min(self.stop_timeout, 5.0)
        while time.monotonic() < deadline:
            if not any(pid_exists(v) for v in victims):
                return
            time.sleep(0.02)
        dead = str(victims[0])
        for lock in [
            self.data_dir / "postmaster.pid",
            *self.data_dir.glob(".s.PGSQL.*.lock"),
        ]:
            with contextlib.suppress(OSError):
                if lock.read_text().split("\n", 1)[0].strip() == dead:
                    lock.unlink()

    def _adopt(self) -> None:
        # postmaster.pid: pid, data dir, start time, port, socket dir, listen addr, ...
        lines = (self.data_dir / "postmaster.pid").read_text().splitlines()
        if len(lines) > 3 and lines[3].strip().isdigit():
            self._port = int(lines[3].strip())

    def _recorded_port(self) -> int | None:
        try:
            text = (self.data_dir / _CONF_NAME).read_text()
        except OSError:
            return None
        match = re.search(r"^port = '?(\d+)'?$", text, re.MULTILINE)
        return int(match.group(1)) if match else None

    def _choose_port(self, pinned: int | None, *, fresh: bool) -> int:
        if pinned is not None:
            if not _port_is_free(self.host, pinned):
                raise EmbeddedPostgresError(f"port {self.host}:{pinned} is already in use")
            return pinned
        if not fresh:
            # The port of the last run (this instance's, or the data dir's record).
            recorded = self._recorded_port()
            if recorded is not None and _port_is_free(self.host, recorded):
                return recorded
        return _free_port(self.host)

    def _write_conf(self, port: int, run_as: _RunAs) -> None:
        socket_dir = str(self.data_dir)
        if len(f"{socket_dir}/.s.PGSQL.{port}") > _SOCKET_PATH_MAX:
            socket_dir = ""  # path too long for a unix socket: TCP only
        managed = {
            "listen_addresses": self.host,
            "port": str(port),
            "unix_socket_directories": socket_dir,
        }
        lines = [
            "# Written by changefeed.embedded at every start; edits here are lost.",
            *(f"{k} = {_quote_setting(v)}" for k, v in self._settings.items()),
            *(f"{k} = {_quote_setting(v)}" for k, v in managed.items()),
        ]
        conf = self.data_dir / _CONF_NAME
        conf.write_text("\n".join(lines) + "\n")
        run_as.chown(conf)
        main_conf = self.data_dir / "postgresql.conf"
        text = main_conf.read_text() if main_conf.exists() else ""
        if _INCLUDE_LINE not in text.splitlines():
            with main_conf.open("a") as f:
                f.write(("" if text.endswith("\n") or not text else "\n") + _INCLUDE_LINE + "\n")
            run_as.chown(main_conf)

    def _log_since(self, offset: int, limit: int = 4000) -> str:
        try:
            with self.log_file.open("rb") as f:
                f.seek(offset)
                data = f.read()
        except OSError as exc:
            return f"(no server log: {exc})"
        text = data.decode(errors="replace")
        return text[-limit:] if text else "(server log is empty)"


def standby_of(
    primary: EmbeddedPostgres, tmp_root: Path | None = None, **kwargs: Any
) -> EmbeddedPostgres:
    """A streaming standby of the running ``primary`` on a new throwaway data
    directory (``clone_standby``; not started yet). ``close()`` stops it and
    deletes the directory, as for :func:`temporary`. ``kwargs`` go to
    ``clone_standby``.
    """
    root = Path(tempfile.mkdtemp(prefix="changefeed-pg-standby-", dir=tmp_root))
    root.chmod(0o755)
    try:
        return primary.clone_standby(
            root / "data", discard_on_close=True, discard_root=root, **kwargs
        )
    except BaseException:
        shutil.rmtree(root, ignore_errors=True)
        raise


def temporary(tmp_root: Path | None = None, **kwargs: Any) -> EmbeddedPostgres:
    """An EmbeddedPostgres on a new throwaway data directory (not started yet).

    The directory is ``<tmp_root or the system temp dir>/changefeed-pg-XXXX/data``;
    its parent is mode 755 so that the unprivileged server user can enter it
    when this process is root. ``close()`` (or leaving the ``with`` block)
    stops the server and deletes the directory. ``kwargs`` go to
    EmbeddedPostgres.
    """
    root = Path(tempfile.mkdtemp(prefix="changefeed-pg-", dir=tmp_root))
    root.chmod(0o755)
    return EmbeddedPostgres(root / "data", discard_on_close=True, discard_root=root, **kwargs)
