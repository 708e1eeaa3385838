"""What the embedded PostgreSQL needs from the machine: its programs, a user, ports, processes.

Kept apart from the server's life cycle (``embedded``) because this is where
machines differ: where PostgreSQL is installed (Debian, the ``pgserver``
package, ``PATH``), whether this process is root (then every program runs as
``postgres`` or ``nobody``, which must be able to enter the data directory),
and how to tell a live process from a zombie (Linux ``/proc``).
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import pwd
import re
import shutil
import socket
import stat
from pathlib import Path
from typing import Any

__all__ = ["EmbeddedPostgresError", "default_data_dir", "find_postgres_bindir"]

_PROGRAMS = ("initdb", "pg_ctl", "postgres")
_DEBIAN_ROOT = Path("/usr/lib/postgresql")


class EmbeddedPostgresError(Exception):
    """The embedded PostgreSQL server cannot be found, initialised, started or stopped."""


# --------------------------------------------------------------------------- binaries


def _has_programs(bindir: Path) -> bool:
    return all(os.access(bindir / name, os.X_OK) for name in _PROGRAMS)


def _version_key(name: str) -> tuple[int, ...]:
    return tuple(int(part) for part in re.findall(r"\d+", name))


def _pgserver_bindir() -> Path | None:
    # pgserver (PyPI; changefeed's `pgserver` extra) ships the binaries in
    # <package dir>/pginstall/bin. Only locate the package: importing it has
    # side effects (lock files).
    try:
        spec = importlib.util.find_spec("pgserver")
    except (ImportError, ValueError):
        return None
    if spec is None or spec.origin is None:
        return None
    return Path(spec.origin).parent / "pginstall" / "bin"


def find_postgres_bindir() -> Path:
    """Return the directory holding ``initdb``, ``pg_ctl`` and ``postgres``.

    Looked up in order: env ``CHANGEFEED_PG_BINDIR``; Debian's
    ``/usr/lib/postgresql/<highest version>/bin``; the binaries bundled in the
    ``pgserver`` wheel (changefeed's ``pgserver`` extra); ``pg_ctl`` on ``PATH``.

    Raises:
        EmbeddedPostgresError: nothing found, or ``CHANGEFEED_PG_BINDIR``
            names a directory without the programs.
    """
    configured = os.environ.get("CHANGEFEED_PG_BINDIR")
    if configured:
        bindir = Path(configured)
        if not _has_programs(bindir):
            raise EmbeddedPostgresError(
                f"CHANGEFEED_PG_BINDIR={configured!r} does not hold executable "
                f"{', '.join(_PROGRAMS)}"
            )
        return bindir
    debian = _DEBIAN_ROOT
    if debian.is_dir():
        versions = sorted(
            (p for p in debian.iterdir() if _version_key(p.name)),
            key=lambda p: _version_key(p.name),
            reverse=True,
        )
        for version in versions:
            if _has_programs(version / "bin"):
                return version / "bin"
    bundled = _pgserver_bindir()
    if bundled is not None and _has_programs(bundled):
        return bundled
    on_path = shutil.which("pg_ctl")
    if on_path is not None:
        bindir = Path(on_path).resolve().parent
        if _has_programs(bindir):
            return bindir
    raise EmbeddedPostgresError(
        "no PostgreSQL server binaries (initdb, pg_ctl, postgres) found: install them "
        "(Debian/Ubuntu: `apt-get install postgresql`; or the pgserver wheel that bundles "
        "them: pip install 'changefeed[pgserver]'), or set CHANGEFEED_PG_BINDIR to the "
        "directory holding them"
    )


# --------------------------------------------------------------------------- users and dirs


class _RunAs:
    """The system user that runs PostgreSQL programs (None: this process's user)."""

    def __init__(self) -> None:
        self.name: str | None = None
        self.uid = os.geteuid()
        self.gid = os.getegid()
        self.gids = set(os.getgroups()) | {self.gid}
        if self.uid != 0:
            return
        for name in ("postgres", "nobody"):
            try:
                entry = pwd.getpwnam(name)
            except KeyError:
                continue
            self.name, self.uid, self.gid = name, entry.pw_uid, entry.pw_gid
            self.gids = {entry.pw_gid, *os.getgrouplist(name, entry.pw_gid)}
            return
        raise EmbeddedPostgresError(
            "running as root, and neither a 'postgres' nor a 'nobody' system user exists "
            "to run PostgreSQL as (PostgreSQL refuses to run as root)"
        )

    @property
    def switches(self) -> bool:
        return self.name is not None

    def subprocess_kwargs(self) -> dict[str, Any]:
        if self.name is None:
            return {}
        return {"user": self.uid, "group": self.gid, "extra_groups": [], "umask": 0o077}

    def chown(self, path: Path) -> None:
        if self.switches:
            os.chown(path, self.uid, self.gid, follow_symlinks=False)

    def chown_tree(self, top: Path) -> None:
        if not self.switches:
            return
        self.chown(top)
        for root, dirs, files in os.walk(top):
            for name in (*dirs, *files):
                self.chown(Path(root) / name)

    def can_traverse(self, directory: Path) -> bool:
        st = directory.stat()
        if st.st_uid == self.uid:
            return bool(st.st_mode & stat.S_IXUSR)
        if st.st_gid in self.gids:
            return bool(st.st_mode & stat.S_IXGRP)
        return bool(st.st_mode & stat.S_IXOTH)


def _make_dirs(path: Path, mode: int = 0o755) -> None:
    """Create ``path`` and its missing parents with ``mode`` (not subject to umask)."""
    missing = []
    for candidate in (path, *path.parents):
        if candidate.exists():
            break
        missing.append(candidate)
    for directory in reversed(missing):
        with contextlib.suppress(FileExistsError):
            directory.mkdir()
            directory.chmod(mode)


def default_data_dir() -> Path:
    """The data directory the demo uses by default.

    ``$XDG_DATA_HOME/changefeed/pg`` (default ``~/.local/share/changefeed/pg``)
    for ordinary users; ``/var/tmp/changefeed/pg`` for root, since the server
    then runs as an unprivileged user that cannot enter ``/root``.
    """
    if os.geteuid() == 0:
        return Path("/var/tmp/changefeed/pg")
    base = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return Path(base) / "changefeed" / "pg"


def _port_is_free(host: str, port: int) -> bool:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        # PostgreSQL sets SO_REUSEADDR too: connections in TIME_WAIT from a
        # previous run must not make a port look taken.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def _free_port(host: str) -> int:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        port: int = sock.getsockname()[1]
    return port


def _children_of(pid: int) -> list[int]:
    """Direct children of ``pid`` (Linux /proc; empty elsewhere)."""
    children = []
    proc = Path("/proc")
    if not proc.is_dir():
        return []
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text(errors="replace").rsplit(")", 1)[-1].split()
        except OSError:
            continue
        if len(fields) > 1 and fields[1] == str(pid):
            children.append(int(entry.name))
    return children
