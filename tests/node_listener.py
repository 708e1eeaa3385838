"""Run Joyent's node-sdc-changefeed listener (tests/node/listener.js) against a publisher.

``NodeListener(url, ...)`` starts ``node tests/node/listener.js`` as a child
process and collects the JSON lines it prints (``bootstrap``, ``change``,
``connection-end``, ``error``...) as they come; ``wait_for`` awaits a
condition on them with a bounded wait, and leaving the block ends the process
(SIGTERM, then SIGKILL). The listener's own log (bunyan, on stderr) goes to a
file, shown when a wait fails.

``NODE_MISSING`` is the reason to skip when node itself is not installed;
``./dev`` installs node and npm from Debian and runs ``npm ci`` in tests/node.
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import signal
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import IO, Any

import orjson

__all__ = ["NODE_MISSING", "NodeListener"]

HARNESS = Path(__file__).resolve().parent / "node"
NODE = shutil.which("node") or shutil.which("nodejs")
NODE_MISSING = None if NODE else "node is not installed (./dev installs Debian's nodejs and npm)"


class NodeListener:
    """Joyent's listener, registered for ``resources`` (``{name: [sub-resources]}``): one
    resource registers the v1 way, several the v2 way.

    Args:
        url: the publisher's HTTP base URL, ``http://127.0.0.1:<port>``.
        resources: what to register for.
        log_path: where the listener's own log (stderr) goes.
    """

    def __init__(self, url: str, resources: Mapping[str, Sequence[str]], log_path: Path) -> None:
        self.url = url
        self.resources = resources
        self.log_path = log_path
        self.events: list[dict[str, Any]] = []
        self._changed = asyncio.Event()
        self._proc: asyncio.subprocess.Process | None = None
        self._reader: asyncio.Task[None] | None = None
        self._log: IO[bytes] | None = None

    @property
    def changes(self) -> list[dict[str, Any]]:
        """The change items received so far, in the order the listener yielded them."""
        return [e["item"] for e in self.events if e["event"] == "change"]

    def of(self, event: str) -> list[dict[str, Any]]:
        return [e for e in self.events if e["event"] == event]

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    async def __aenter__(self) -> NodeListener:
        if NODE is None:
            raise RuntimeError(NODE_MISSING)
        if not (HARNESS / "node_modules" / "changefeed").is_dir():
            raise RuntimeError(f"{HARNESS}/node_modules is missing: run ./dev setup (npm ci)")
        argv = [NODE, str(HARNESS / "listener.js"), "--url", self.url]
        for name, subs in self.resources.items():
            argv += ["--resource", f"{name}={','.join(subs)}" if subs else name]
        self._log = self.log_path.open("wb")
        self._proc = await asyncio.create_subprocess_exec(
            *argv,
            cwd=HARNESS,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=self._log,
        )
        self._reader = asyncio.create_task(self._read(self._proc))
        return self

    async def __aexit__(self, *exc: object) -> None:
        proc, self._proc = self._proc, None
        if proc is not None and proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(proc.wait(), 5)
            except TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
                await asyncio.wait_for(proc.wait(), 5)
        if self._reader is not None:
            await asyncio.wait_for(asyncio.gather(self._reader, return_exceptions=True), 5)
        if self._log is not None:
            self._log.close()

    async def _read(self, proc: asyncio.subprocess.Process) -> None:
        assert proc.stdout is not None
        while line := await proc.stdout.readline():
            self.events.append(orjson.loads(line))
            self._changed.set()
        self.events.append({"event": "exited"})
        self._changed.set()

    async def wait_for(
        self,
        condition: Callable[[NodeListener], bool],
        timeout: float,
        message: str = "condition",
    ) -> None:
        """Wait until ``condition(self)`` holds, re-checked as each line arrives.

        Raises:
            AssertionError: not within ``timeout`` seconds, or the process ended first;
                with the events' tail and the listener's log.
        """
        deadline = time.monotonic() + timeout
        while not condition(self):
            if self.events and self.events[-1]["event"] == "exited":
                raise AssertionError(f"the node listener exited before {message}\n{self._tail()}")
            self._changed.clear()
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise AssertionError(f"{message}: not within {timeout}s\n{self._tail()}")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait(), remaining)

    def _tail(self) -> str:
        kinds = [e["event"] for e in self.events]
        return (
            f"events: {len(kinds)} ({len(self.changes)} changes), last: {self.events[-5:]}\n"
            f"listener log (tail):\n{self.log()[-3000:]}"
        )
