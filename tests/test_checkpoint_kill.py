"""A checkpointed service killed with SIGKILL and started again resumes; it never bootstraps.

The service (tests/checkpoint_controller.py: one Listener, a Controller for
``vm`` and one for ``server``, one SQLite checkpoint) runs in a process of its
own against the example API (real uvicorn, real PostgreSQL). Each seeded
schedule writes through the API (creates, renames, renumbers, deletes,
migrations, SQL bursts, servers) while it kills the service with SIGKILL at
random moments and starts it again after a random pause. Then:

* every restart resumed: its listener's status shows a resumed registration
  and no bootstrap, the publisher's ``/metrics`` count resumed registrations,
  and the API's bootstrap routes were walked only by the very first start;
* after writes stop, the service's mirrors equal the API's tables (digests
  it prints), and so does the checkpoint it saves on SIGTERM, read from the
  file by the test;
* the callbacks, replayed from the log the service appends to, build the
  API's tables: across the kills, no change was lost.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import random
import signal
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
from helpers import metric_value
from test_convergence import Writer
from test_listener_support import VmApiServer, api_servers, api_state

from changefeed.listener import SqliteCheckpointStore

CHILD = Path(__file__).with_name("checkpoint_controller.py")
SCHEDULES = 6
KILLS = 3

pytestmark = pytest.mark.slow


def digest(mirror: Mapping[str, Any]) -> str:
    return hashlib.sha256(orjson.dumps(dict(mirror), option=orjson.OPT_SORT_KEYS)).hexdigest()


class Service:
    """One run of the service; its status lines are read as they come (so that its
    stdout never fills) and kept."""

    def __init__(self, process: asyncio.subprocess.Process) -> None:
        self.process = process
        self.statuses: list[dict[str, Any]] = []
        self._new = asyncio.Event()
        self._reader = asyncio.create_task(self._read())

    @classmethod
    async def start(cls, url: str, checkpoint: Path, callbacks: Path) -> Service:
        process = await asyncio.create_subprocess_exec(
            sys.executable,
            str(CHILD),
            url,
            str(checkpoint),
            str(callbacks),
            stdout=asyncio.subprocess.PIPE,
        )
        return cls(process)

    async def _read(self) -> None:
        assert self.process.stdout is not None
        while line := await self.process.stdout.readline():
            self.statuses.append(orjson.loads(line))
            self._new.set()

    async def wait_for(
        self, predicate: Callable[[dict[str, Any]], bool], timeout: float, what: str
    ) -> dict[str, Any]:
        try:
            async with asyncio.timeout(timeout):
                while True:
                    doc: dict[str, Any]  # reversed() of a list of Any-valued dicts is Any
                    for doc in reversed(self.statuses):
                        if predicate(doc):
                            return doc
                        break  # only the latest status counts
                    if self._reader.done():
                        raise AssertionError(f"the service exited: {self.statuses[-1:]}")
                    self._new.clear()
                    await self._new.wait()
        except TimeoutError:
            raise AssertionError(f"{what} within {timeout}s: {self.statuses[-1:]}") from None

    async def kill(self) -> None:
        self.process.send_signal(signal.SIGKILL)
        await self.process.wait()
        await self._reader

    async def stop(self) -> None:
        self.process.send_signal(signal.SIGTERM)
        async with asyncio.timeout(30):
            await self.process.wait()
            await self._reader


def replay(callbacks: Path) -> dict[str, dict[str, Any]]:
    """The tables the callbacks built, applied in order ("new" replaces, None deletes;
    after a restart, a replayed id may come with ``old == new``, None for both when it
    was created and deleted around the kill)."""
    built: dict[str, dict[str, Any]] = {"vm": {}, "server": {}}
    for line in callbacks.read_bytes().splitlines():
        call = orjson.loads(line)
        if call["new"] is None:
            built[call["resource"]].pop(call["id"], None)
        else:
            built[call["resource"]][call["id"]] = call["new"]
    return built


@pytest.mark.parametrize("seed", [pytest.param(s, id=f"seed-{s}") for s in range(SCHEDULES)])
async def test_killed_service_resumes_from_its_checkpoint(
    seed: int, dsn: str, tmp_path: Path
) -> None:
    rng = random.Random(f"kill-schedule-{seed}")
    checkpoint, callbacks = tmp_path / "checkpoint.sqlite", tmp_path / "callbacks.jsonl"
    async with contextlib.AsyncExitStack() as stack:
        api = await stack.enter_async_context(VmApiServer(dsn))
        client = await stack.enter_async_context(httpx.AsyncClient(base_url=api.url, timeout=5))
        writer = Writer(random.Random(f"kill-writes-{seed}"), client, dsn)
        for _ in range(rng.randint(1, 3)):
            await writer.create_server()
        for _ in range(rng.randint(10, 30)):
            await writer.create()

        def walks() -> int:  # both bootstrap routes (one admission for /vms and /servers)
            return int(api.app.state.vmapi.vms.stats()["walksStarted"])

        service = await Service.start(api.ws_url, checkpoint, callbacks)
        first = await service.wait_for(
            lambda d: d["synced"] and (d["checkpoint"] or {}).get("saves", 0) >= 1,
            60,
            "first sync and checkpoint",
        )
        assert first["bootstraps"] == 1 and not first["checkpoint"]["loaded"]
        walked = walks()
        assert walked == 2  # vm and server, once each
        runs: list[Service] = []
        writing = True

        async def write() -> None:
            while writing:
                try:
                    await writer.step()
                    writer.ok += 1
                except (httpx.HTTPError, OSError):
                    writer.failed += 1
                    await asyncio.sleep(0.02)

        writes = asyncio.create_task(write())
        try:
            for _ in range(KILLS):
                # Killed at the schedule's moment: mid-fetch, mid-callback, mid-save alike.
                await asyncio.sleep(rng.uniform(0.05, 0.8))
                await service.kill()
                await asyncio.sleep(rng.uniform(0.0, 0.5))  # down; writes go on
                service = await Service.start(api.ws_url, checkpoint, callbacks)
                runs.append(service)
                await service.wait_for(lambda d: d["state"] == "live", 60, "live again")
        finally:
            writing = False
            await writes
        assert writer.ok > 0

        # Writes have stopped: the service converges on the API's tables.
        vms, servers = await api_state(dsn), await api_servers(dsn)
        await service.wait_for(
            lambda d: d["vm_digest"] == digest(vms) and d["server_digest"] == digest(servers),
            60,
            f"schedule {seed} converged ({len(vms)} VMs, {len(servers)} servers)",
        )
        # No restart bootstrapped: each resumed, from the checkpoint it loaded.
        for run in runs:
            live = next(d for d in run.statuses if d["state"] == "live")
            assert live["resumes"] >= 1 and live["checkpoint"]["resumed_from"], live
            assert all(d["bootstraps"] == 0 for d in run.statuses), run.statuses[-1]
            assert live["checkpoint"]["loaded"] and live["checkpoint"]["not_resumed"] is None
        assert walks() == walked  # the bootstrap routes were not walked again
        metrics = (await client.get("/metrics")).text
        for resource in ("vm", "server"):
            resumed = metric_value(
                metrics, "changefeed_registrations_total", resource=resource, resumed="true"
            )
            assert resumed >= KILLS
            fresh = metric_value(
                metrics, "changefeed_registrations_total", resource=resource, resumed="false"
            )
            assert fresh == 1  # the first start only

        # A clean stop saves the last checkpoint: read from outside, it is the API's state.
        await service.stop()
        assert service.process.returncode == 0 and service.statuses[-1]["event"] == "stopped"
        saved = await SqliteCheckpointStore(checkpoint).load()
        assert saved is not None and saved.cursor is not None
        names = {part.resource: dict(part.items) for part in saved.mirrors.values()}
        assert names == {"vm": vms, "server": servers}
        assert not any(part.pending for part in saved.mirrors.values())
        # The callbacks, across every kill, built the same tables.
        built = replay(callbacks)
        wrong = {
            (r, k): (built[r].get(k), want.get(k))
            for r, want in (("vm", vms), ("server", servers))
            for k in set(built[r]) | set(want)
            if built[r].get(k) != want.get(k)
        }
        if wrong:
            lines = [orjson.loads(x) for x in callbacks.read_bytes().splitlines()]
            for (r, k), pair in wrong.items():
                print("WRONG", r, k, pair)
                for x in lines:
                    if x["id"] == k:
                        print("   ", x["old"], "->", x["new"])
        assert built == {"vm": vms, "server": servers}
