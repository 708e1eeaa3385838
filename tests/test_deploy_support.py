"""Real processes for the deployment tests: ``changefeed`` sub-commands and Debian's nginx.

Every process is started on 127.0.0.1 with its output in a log file (never a
pipe nobody reads), waited for with a bound, and stopped in a ``finally``:
``stop()`` sends SIGTERM, waits, then SIGKILLs. The nginx config under test is
the one in ``deploy/nginx/``, rendered with the test's ports into a prefix
directory of its own (pid file, logs and temp files stay inside it).

No tests here: ``test_deploy*.py``, ``test_health.py``, ``test_ha_nginx.py``
and ``test_soak.py`` import it (as ``test_listener_support`` is imported).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import httpx

__all__ = [
    "DEPLOY",
    "NGINX",
    "ROOT",
    "ChangefeedServer",
    "Nginx",
    "Process",
    "make_certificate",
    "render_nginx",
    "stopping",
    "toml_document",
]

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
NGINX: str | None = shutil.which("nginx") or (
    "/usr/sbin/nginx" if os.access("/usr/sbin/nginx", os.X_OK) else None
)


class Process:
    """One child process with its stdout and stderr in ``<log_dir>/<name>.log``.

    Args:
        name: name of the log file and in error messages.
        argv: the command.
        log_dir: where the log goes.
        env: extra environment variables.
    """

    def __init__(
        self, name: str, argv: Sequence[str], log_dir: Path, env: Mapping[str, str] | None = None
    ) -> None:
        self.name = name
        self.argv = list(argv)
        self.log_path = log_dir / f"{name}.log"
        self.env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        self.proc: subprocess.Popen[bytes] | None = None
        self.starts = 0

    def start(self) -> None:
        """Start (or start again, appending to the same log)."""
        if self.alive():
            raise RuntimeError(f"{self.name} is already running")
        with open(self.log_path, "ab") as log:
            log.write(f"--- start {self.starts + 1}: {' '.join(self.argv)}\n".encode())
            log.flush()
            self.proc = subprocess.Popen(
                self.argv,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=self.env,
                cwd=ROOT,
                start_new_session=True,  # the terminal's Ctrl-C is for pytest, not for these
            )
        self.starts += 1

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def send(self, sig: signal.Signals) -> None:
        """Send ``sig`` to the process (not to its group)."""
        assert self.proc is not None
        self.proc.send_signal(sig)

    def log(self, limit: int = 6000) -> str:
        """The tail of the process's output."""
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        return text[-limit:]

    async def wait_exit(self, timeout: float) -> int:
        """Wait for the process to exit; its exit status.

        Raises:
            AssertionError: still running after ``timeout`` seconds.
        """
        proc = self.proc
        assert proc is not None
        try:
            return await asyncio.to_thread(proc.wait, timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(
                f"{self.name} still running {timeout}s later\n{self.log()}"
            ) from None

    async def stop(self, timeout: float = 15.0) -> None:
        """SIGTERM, wait up to ``timeout``, then SIGKILL (and reap)."""
        proc = self.proc
        if proc is None or proc.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signal.SIGTERM)
        try:
            await asyncio.to_thread(proc.wait, timeout)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await asyncio.to_thread(proc.wait, 10)

    def kill_now(self) -> None:
        """SIGKILL and reap, synchronously (last-resort cleanup)."""
        proc = self.proc
        if proc is not None and proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(10)


class ChangefeedServer(Process):
    """A ``changefeed`` sub-command serving HTTP on 127.0.0.1:``port`` (``example-api``
    or ``serve``), with ``/readyz``."""

    def __init__(
        self,
        name: str,
        args: Sequence[str],
        port: int,
        log_dir: Path,
        env: Mapping[str, str] | None = None,
    ) -> None:
        argv = [sys.executable, "-m", "changefeed.cli", "--log-json", *args]
        super().__init__(name, argv, log_dir, env)
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self.ws_url = f"ws://127.0.0.1:{port}/changefeeds"

    @classmethod
    def example_api(cls, name: str, dsn: str, port: int, log_dir: Path) -> ChangefeedServer:
        """``changefeed example-api``: the VM API with its publisher embedded."""
        return cls(name, ["example-api", "--dsn", dsn, "--port", str(port)], port, log_dir)

    @classmethod
    def standalone(cls, name: str, config: Path, port: int, log_dir: Path) -> ChangefeedServer:
        """``changefeed serve --config``: a standalone publisher."""
        return cls(name, ["serve", "--config", str(config), "--port", str(port)], port, log_dir)

    async def wait_ready(self, timeout: float = 30.0) -> None:
        """Wait until ``GET /readyz`` answers 200.

        Raises:
            AssertionError: the process exited, or was not ready within ``timeout``.
        """
        deadline = time.monotonic() + timeout
        async with httpx.AsyncClient(timeout=2.0) as client:
            while True:
                if not self.alive():
                    raise AssertionError(f"{self.name} exited before it was ready\n{self.log()}")
                with contextlib.suppress(httpx.HTTPError):
                    if (await client.get(self.url + "/readyz")).status_code == 200:
                        return
                if time.monotonic() > deadline:
                    raise AssertionError(f"{self.name} not ready within {timeout}s\n{self.log()}")
                await asyncio.sleep(0.05)

    async def stats(self) -> dict[str, Any]:
        """This instance's ``/changefeeds/stats``."""
        async with httpx.AsyncClient(timeout=5.0) as client:
            response = await client.get(self.url + "/changefeeds/stats")
        response.raise_for_status()
        doc: dict[str, Any] = response.json()
        return doc


@contextlib.asynccontextmanager
async def stopping(*processes: Process) -> AsyncIterator[None]:
    """Stop every process (SIGTERM, then SIGKILL) when the block exits, however it exits."""
    try:
        yield
    finally:
        try:
            await asyncio.gather(*(p.stop() for p in processes), return_exceptions=True)
        finally:
            for p in processes:
                p.kill_now()


# -- config files ---------------------------------------------------------------------


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(value, list | tuple):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    return repr(value)


def toml_document(
    publisher: Mapping[str, Any],
    resources: Sequence[Mapping[str, Any]],
    server: Mapping[str, Any] | None = None,
) -> str:
    """A ``changefeed serve`` config file (flat values only)."""
    lines = ["[publisher]", *(f"{k} = {_toml_value(v)}" for k, v in publisher.items())]
    for resource in resources:
        lines += ["", "[[resources]]", *(f"{k} = {_toml_value(v)}" for k, v in resource.items())]
    if server:
        lines += ["", "[server]", *(f"{k} = {_toml_value(v)}" for k, v in server.items())]
    return "\n".join(lines) + "\n"


# -- nginx ----------------------------------------------------------------------------

_UPSTREAM_SERVER = re.compile(
    r"^(?P<indent>[ \t]*)server[ \t]+[0-9.]+:\d+(?P<params>[^;\n]*);$", re.M
)
_TLS_SERVER = re.compile(
    r"^server \{\n(?:(?!^\}).*\n)*?[ \t]*listen 443 ssl;\n(?:(?!^\}).*\n)*?^\}\n", re.M
)


def _substitute(text: str, old: str, new: str, count: int = 1) -> str:
    found = text.count(old)
    if found != count:
        raise AssertionError(f"deploy/nginx: expected {count} x {old!r}, found {found}")
    return text.replace(old, new)


def render_nginx(
    prefix: Path,
    upstream_ports: Sequence[int],
    port: int,
    tls: tuple[int, Path, Path] | None = None,
) -> Path:
    """Render deploy/nginx/ for a test into ``prefix``; the main config's path.

    The site file and the snippet are used as they are, except: the upstream
    servers become ``upstream_ports`` on 127.0.0.1 (same parameters), ``listen 80``
    becomes 127.0.0.1:``port``, and the TLS server listens on 127.0.0.1 with the
    given ``(port, certificate, key)`` (or is left out when ``tls`` is None). The
    main config is the test's own: one worker, logs and temp files inside ``prefix``.
    """
    site = (DEPLOY / "nginx" / "changefeed.conf").read_text()
    servers = _UPSTREAM_SERVER.findall(site)
    if len(servers) < 1:
        raise AssertionError("deploy/nginx/changefeed.conf: no upstream server lines")
    indent, params = servers[0]
    lines = "\n".join(f"{indent}server 127.0.0.1:{p}{params};" for p in upstream_ports)
    first = True

    def upstream(match: re.Match[str]) -> str:
        nonlocal first
        if first:
            first = False
            return lines
        return "\x00"  # removed below, with its line

    site = _UPSTREAM_SERVER.sub(upstream, site).replace("\x00\n", "")
    site = _substitute(site, "listen 80;", f"listen 127.0.0.1:{port};")
    if tls is None:
        site, found = _TLS_SERVER.subn("", site)
        if found != 1:
            raise AssertionError("deploy/nginx/changefeed.conf: expected one TLS server block")
    else:
        tls_port, cert, key = tls
        site = _substitute(site, "listen 443 ssl;", f"listen 127.0.0.1:{tls_port} ssl;")
        site = _substitute(site, "/etc/ssl/changefeed/fullchain.pem", str(cert))
        site = _substitute(site, "/etc/ssl/changefeed/privkey.pem", str(key))
    (prefix / "snippets").mkdir(parents=True, exist_ok=True)
    (prefix / "tmp").mkdir(exist_ok=True)
    shutil.copy(DEPLOY / "nginx" / "snippets" / "changefeed-proxy.conf", prefix / "snippets")
    (prefix / "changefeed.conf").write_text(site)
    temp = prefix / "tmp"
    # nginx run as root would switch its workers to `nobody`, who cannot enter a
    # pytest temp dir (mode 700): keep them root, as the test is.
    user = "user root;\n" if os.geteuid() == 0 else ""
    main = f"""{user}worker_processes 1;
events {{
    worker_connections 1024;
}}
http {{
    access_log {prefix}/access.log;
    client_body_temp_path {temp}/body;
    proxy_temp_path {temp}/proxy;
    fastcgi_temp_path {temp}/fastcgi;
    uwsgi_temp_path {temp}/uwsgi;
    scgi_temp_path {temp}/scgi;
    include changefeed.conf;
}}
"""
    conf = prefix / "nginx.conf"
    conf.write_text(main)
    return conf


class Nginx(Process):
    """Debian's nginx in the foreground with a rendered config (see ``render_nginx``)."""

    def __init__(self, prefix: Path, conf: Path, port: int, log_dir: Path) -> None:
        if NGINX is None:
            raise RuntimeError("nginx is not installed")
        argv = [
            NGINX,
            "-p",
            str(prefix),
            "-e",
            "stderr",
            "-c",
            str(conf),
            "-g",
            f"daemon off; pid {prefix}/nginx.pid; error_log stderr notice;",
        ]
        super().__init__("nginx", argv, log_dir)
        self.prefix = prefix
        self.conf = conf
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self.ws_url = f"ws://127.0.0.1:{port}/changefeeds"

    def test_config(self) -> subprocess.CompletedProcess[str]:
        """``nginx -t`` on the rendered config."""
        assert NGINX is not None
        return subprocess.run(
            [*self.argv[:7], "-t", "-g", f"pid {self.prefix}/nginx.pid; error_log stderr;"],
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )

    async def wait_ready(self, timeout: float = 15.0) -> None:
        """Wait until nginx answers ``GET /healthz`` (proxied to a publisher) with 200."""
        deadline = time.monotonic() + timeout
        async with httpx.AsyncClient(timeout=2.0) as client:
            while True:
                if not self.alive():
                    raise AssertionError(f"nginx exited\n{self.log()}")
                with contextlib.suppress(httpx.HTTPError):
                    if (await client.get(self.url + "/healthz")).status_code == 200:
                        return
                if time.monotonic() > deadline:
                    raise AssertionError(f"nginx not serving within {timeout}s\n{self.log()}")
                await asyncio.sleep(0.05)


def make_certificate(directory: Path) -> tuple[Path, Path] | None:
    """A self-signed certificate for 127.0.0.1 (``openssl`` CLI); None without openssl."""
    openssl = shutil.which("openssl")
    if openssl is None:
        return None
    cert, key = directory / "cert.pem", directory / "key.pem"
    subprocess.run(
        [
            openssl,
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-days",
            "1",
            "-subj",
            "/CN=127.0.0.1",
            "-addext",
            "subjectAltName=IP:127.0.0.1",
            "-keyout",
            str(key),
            "-out",
            str(cert),
        ],
        check=True,
        capture_output=True,
        timeout=60,
    )
    return cert, key
