"""The built wheel, installed into clean venvs, and ASGI servers run from them.

``build_dist`` builds the sdist and, from it, the wheel (``python -m build``),
as a release would. ``Venvs`` makes each venv once per test session: a venv
without pip, into which this checkout's pip installs the wheel (with an extra)
and a server at a given version, from the package index through pip's cache.
Nothing of the source tree is importable there: programs run from a
directory of their own.

``Served`` runs an ASGI app module from such a venv on a server on a free
loopback port, as its own process, and stops it with SIGTERM.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx
from helpers import free_port

ROOT = Path(__file__).resolve().parent.parent

VENV_INSTALL_TIMEOUT = 300.0


@dataclass(frozen=True)
class Dist:
    wheel: Path
    sdist: Path


def build_dist(out: Path) -> Dist:
    """The sdist of this checkout, and the wheel built from that sdist."""
    subprocess.run(
        [sys.executable, "-m", "build", "--outdir", str(out), str(ROOT)],
        check=True,
        capture_output=True,
        timeout=300,
    )
    (wheel,) = out.glob("changefeed-*.whl")
    (sdist,) = out.glob("changefeed-*.tar.gz")
    return Dist(wheel, sdist)


@dataclass(frozen=True)
class Venv:
    name: str
    path: Path

    @property
    def python(self) -> Path:
        return self.path / "bin" / "python"

    def bin(self, program: str) -> Path:
        return self.path / "bin" / program

    def run(
        self, args: Sequence[str], cwd: Path, timeout: float = 120
    ) -> subprocess.CompletedProcess[str]:
        """Run ``args`` (a program of this venv first) in ``cwd``, outside the checkout."""
        return subprocess.run(
            [str(self.bin(args[0])), *args[1:]],
            cwd=cwd,
            env=clean_env(),
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )

    def distributions(self) -> set[str]:
        """Names of every distribution installed (lower case, ``-`` for ``_``)."""
        code = (
            "import importlib.metadata as m; "
            "print('\\n'.join(d.metadata['Name'] for d in m.distributions()))"
        )
        done = self.run(["python", "-c", code], cwd=self.path)
        assert done.returncode == 0, done.stderr
        return {line.strip().lower().replace("_", "-") for line in done.stdout.split()}


def clean_env() -> dict[str, str]:
    """This process's environment, less what would make the checkout importable."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    return env


class Venvs:
    """Venvs with the wheel, each made once (per session), on first use."""

    def __init__(self, dist: Dist, root: Path) -> None:
        self.dist = dist
        self.root = root
        self._made: dict[str, Venv] = {}

    def get(self, name: str, extra: str | None, *requirements: str) -> Venv:
        venv = self._made.get(name)
        if venv is None:
            venv = self._make(name, extra, requirements)
            self._made[name] = venv
        return venv

    def _make(self, name: str, extra: str | None, requirements: Sequence[str]) -> Venv:
        path = self.root / name
        subprocess.run(
            [sys.executable, "-m", "venv", "--without-pip", str(path)], check=True, timeout=60
        )
        wheel = f"{self.dist.wheel}[{extra}]" if extra else str(self.dist.wheel)
        pip = [sys.executable, "-m", "pip", "--python", str(path / "bin" / "python")]
        done = subprocess.run(
            [*pip, "install", "--quiet", "--disable-pip-version-check", wheel, *requirements],
            capture_output=True,
            text=True,
            timeout=VENV_INSTALL_TIMEOUT,
            check=False,
        )
        assert done.returncode == 0, f"installing into {name} failed:\n{done.stderr[-3000:]}"
        return Venv(name, path)


@dataclass
class Served:
    """An app served by a server of a venv, in its own process."""

    url: str
    process: asyncio.subprocess.Process
    log: Path

    @property
    def ws_url(self) -> str:
        return self.url.replace("http://", "ws://", 1) + "/changefeeds"

    def output(self) -> str:
        return self.log.read_text(errors="replace")


def _tail(log: Path) -> str:
    return log.read_text(errors="replace")[-3000:]


async def _ready(url: str, process: asyncio.subprocess.Process, log: Path, within: float) -> None:
    deadline = time.monotonic() + within
    async with httpx.AsyncClient(timeout=2) as http:
        while True:
            if process.returncode is not None:
                raise AssertionError(f"the server exited:\n{_tail(log)}")
            with contextlib.suppress(httpx.HTTPError):
                if (await http.get(url + "/readyz")).status_code == 200:
                    return
            if time.monotonic() > deadline:
                raise AssertionError(f"not ready within {within}s:\n{_tail(log)}")
            await asyncio.sleep(0.1)


@contextlib.asynccontextmanager
async def serve(
    command: Sequence[str],
    cwd: Path,
    env: dict[str, str],
    port: int,
    *,
    ready_within: float = 60.0,
) -> AsyncIterator[Served]:
    """Run ``command`` (a server on 127.0.0.1:``port``) until the block exits."""
    log = cwd / f"server-{port}.log"
    with log.open("wb") as out:
        process = await asyncio.create_subprocess_exec(
            *command, cwd=cwd, env={**clean_env(), **env}, stdout=out, stderr=out
        )
    served = Served(f"http://127.0.0.1:{port}", process, log)
    try:
        await _ready(served.url, process, log, ready_within)
        yield served
    finally:
        if process.returncode is None:
            process.send_signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(process.wait(), 20)
            except TimeoutError:
                process.kill()
                await process.wait()


def server_command(venv: Venv, server: str, app: str, port: int) -> list[str]:
    """How each server runs ``app`` (``module:attribute``) from the working directory."""
    host = "127.0.0.1"
    if server == "uvicorn":  # uvicorn's defaults, as a newcomer would run it
        return [str(venv.python), "-m", "uvicorn", app, "--host", host, "--port", str(port)]
    if server == "uvicorn-fast":
        return [
            *(str(venv.python), "-m", "uvicorn", app, "--host", host, "--port", str(port)),
            *("--ws", "changefeed.serving:FanoutWebSocketProtocol"),
            *("--ws-per-message-deflate", "false"),
        ]
    if server == "hypercorn":
        return [str(venv.python), "-m", "hypercorn", app, "--bind", f"{host}:{port}"]
    if server == "granian":
        return [
            *(str(venv.bin("granian")), "--interface", "asgi"),
            *("--host", host, "--port", str(port), app),
        ]
    raise ValueError(server)


__all__ = [
    "Dist",
    "Served",
    "Venv",
    "Venvs",
    "build_dist",
    "clean_env",
    "free_port",
    "serve",
    "server_command",
]
