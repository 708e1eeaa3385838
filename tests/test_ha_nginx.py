"""High availability through deploy/nginx/: listeners fail over between publisher processes.

Two ``changefeed example-api`` processes (each a VM API with its publisher
embedded) share one PostgreSQL; Debian's nginx runs the config from
``deploy/nginx/`` in front of them (rendered with this test's ports). A DNS
controller and three plain controllers follow the feed through nginx while a
writer keeps creating, renaming, renumbering and deleting VMs through nginx.
Then, in turn: one publisher is killed (SIGKILL), the other is drained
(SIGTERM: its listeners are closed with 1001 and it exits within a bound),
and the first is killed again; each is restarted once the others hold every
listener, so there is always somewhere to fail over to.

Every listener must re-register through nginx after each failure, resume
from its cursor on the other instance, and end with a mirror equal to the
API's data (and the DNS records derived from it): nothing is lost.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import signal
import ssl
import time
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
from helpers import free_port, wait_until
from test_deploy_support import (
    NGINX,
    ChangefeedServer,
    Nginx,
    make_certificate,
    render_nginx,
    stopping,
)
from test_listener_support import api_state
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed

from changefeed.example.dns import DnsController, derive_records
from changefeed.listener import (
    BackoffPolicy,
    ConnectionState,
    Controller,
    Listener,
    ListenerConfig,
)
from changefeed.schemas import ChangeKind

pytestmark = [
    pytest.mark.nginx,
    pytest.mark.skipif(NGINX is None, reason="needs Debian's nginx (apt-get install nginx-light)"),
    pytest.mark.timeout(180),
]

LISTENER_CONFIG = ListenerConfig(
    backoff=BackoffPolicy(initial=0.05, maximum=0.5, reset_after=5.0),
    ping_interval=2.0,
    ping_timeout=2.0,
    open_timeout=3.0,
    ack_timeout=3.0,
    close_timeout=1.0,
    http_timeout=5.0,
)
RETRY = BackoffPolicy(initial=0.02, maximum=0.5)
REGISTRATION = {
    "instance": str(uuid.uuid4()),
    "service": "ha-probe",
    "changeKind": {"resource": "vm", "subResources": ["nic", "alias"]},
}
DRAIN_BOUND = 15.0  # seconds from SIGTERM to exit (drain_grace 5 s + uvicorn's shutdown)


class Writer:
    """Creates, renames, renumbers and deletes VMs through nginx until stopped.

    Writes that fail while a publisher dies (a 502 for a request in flight)
    are counted, not retried: the mirrors are compared with the database, which
    knows which writes happened.
    """

    def __init__(self, client: httpx.AsyncClient, seed: int = 7) -> None:
        self.client = client
        self.rng = random.Random(seed)
        self.ids: list[str] = []
        self.ok = 0
        self.failed = 0
        self.statuses: dict[int, int] = {}

    def _body(self) -> dict[str, Any]:
        rng = self.rng
        nics = [{"ip": f"10.2.{rng.randrange(8)}.{rng.randrange(1, 250)}"} for _ in range(2)]
        return {"alias": f"{rng.choice(('web', 'db', 'cache'))}-{rng.randrange(40)}", "nics": nics}

    async def step(self) -> None:
        rng = self.rng
        op = rng.choices(("create", "alias", "nics", "delete"), (4, 3, 2, 1))[0]
        if op == "create" or len(self.ids) < 5:
            response = await self.client.post("/vms", json=self._body())
            if response.status_code == 201:
                self.ids.append(response.json()["uuid"])
        elif op == "alias":
            vm = rng.choice(self.ids)
            response = await self.client.patch(f"/vms/{vm}", json={"alias": self._body()["alias"]})
        elif op == "nics":
            vm = rng.choice(self.ids)
            response = await self.client.patch(f"/vms/{vm}", json={"nics": self._body()["nics"]})
        else:
            vm = self.ids.pop(rng.randrange(len(self.ids)))
            response = await self.client.delete(f"/vms/{vm}")
        self.statuses[response.status_code] = self.statuses.get(response.status_code, 0) + 1
        if response.status_code < 300 or response.status_code == 404:
            self.ok += 1
        else:
            self.failed += 1

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            try:
                await self.step()
            except httpx.HTTPError:
                self.failed += 1
            await asyncio.sleep(0.01)  # pacing of the load, not a synchronisation


class Probe:
    """A bare websocket listener through nginx: which instance took it, and how it ended."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.instance = str(uuid.uuid4())
        self.close_code: int | None = None
        self.closed = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        ws = await connect(self.url, open_timeout=5, ping_interval=2, ping_timeout=2)
        await ws.send(orjson.dumps({**REGISTRATION, "instance": self.instance}).decode())
        ack = orjson.loads(await asyncio.wait_for(ws.recv(), 5))
        assert ack["bootstrapRoute"] == "/vms", ack
        self._task = asyncio.create_task(self._read(ws))

    async def _read(self, ws: Any) -> None:
        try:
            async for _ in ws:
                pass
        except ConnectionClosed:
            pass
        finally:
            self.close_code = ws.close_code
            self.closed.set()

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)


async def registered(api: ChangefeedServer) -> set[str]:
    """Instance ids of the listeners registered on ``api`` now."""
    return {row["instance"] for row in (await api.stats())["registrations"]}


async def attach(url: str, api: ChangefeedServer, probes: list[Probe]) -> Probe:
    """Register a probe through nginx until nginx hands one to ``api``: the condition for
    "nginx sends traffic to this instance (again)". Probes that landed elsewhere close."""
    deadline = time.monotonic() + 20
    while True:
        probe = Probe(url)
        probes.append(probe)
        await probe.start()
        if probe.instance in await registered(api):
            return probe
        await probe.close()
        if time.monotonic() > deadline:
            raise AssertionError(f"nginx sent no new listener to {api.name} within 20s")
        await asyncio.sleep(0.2)  # nginx retries a failed instance after fail_timeout


async def check_tls(port: int, cert: Path) -> None:
    """TLS terminates at nginx: a wss registration and an https bootstrap page."""
    context = ssl.create_default_context(cafile=str(cert))
    async with connect(f"wss://127.0.0.1:{port}/changefeeds", ssl=context, open_timeout=5) as ws:
        await ws.send(orjson.dumps(REGISTRATION).decode())
        ack = orjson.loads(await asyncio.wait_for(ws.recv(), 5))
    assert ack["bootstrapRoute"] == "/vms" and ack["resumed"] is False, ack
    async with httpx.AsyncClient(verify=context, timeout=5) as client:
        page = await client.get(f"https://127.0.0.1:{port}/vms?limit=5")
    assert page.status_code == 200 and "items" in page.json()


async def test_listeners_fail_over_through_nginx(dsn: str, tmp_path: Path) -> None:
    started = time.monotonic()
    logs = tmp_path / "logs"
    logs.mkdir()
    apis = [ChangefeedServer.example_api(f"api{n}", dsn, free_port(), logs) for n in (1, 2)]
    lb_port, tls_port = free_port(), free_port()
    prefix = tmp_path / "nginx"
    prefix.mkdir()
    certificate = make_certificate(tmp_path)
    tls = (tls_port, *certificate) if certificate else None
    conf = render_nginx(prefix, [api.port for api in apis], lb_port, tls)
    nginx = Nginx(prefix, conf, lb_port, logs)
    checked = nginx.test_config()
    assert checked.returncode == 0, checked.stderr

    stop_writing = asyncio.Event()
    async with stopping(nginx, *apis), contextlib.AsyncExitStack() as stack:
        for api in apis:
            api.start()
        await asyncio.gather(*(api.wait_ready() for api in apis))
        nginx.start()
        await nginx.wait_ready()
        if certificate is not None:
            await check_tls(tls_port, certificate[0])

        client = await stack.enter_async_context(httpx.AsyncClient(base_url=nginx.url, timeout=5))
        writer = Writer(client)
        for _ in range(20):
            await writer.step()

        dns = DnsController(
            nginx.ws_url, dsn, listener_config=LISTENER_CONFIG, retry=RETRY, name="dns"
        )
        mirrors = [
            Controller(
                Listener(
                    nginx.ws_url,
                    instance=str(uuid.uuid4()),
                    service=f"mirror-{n}",
                    change_kind=ChangeKind("vm", ("nic", "alias")),
                    config=LISTENER_CONFIG,
                    name=f"mirror-{n}",
                ),
                retry=RETRY,
                name=f"mirror-{n}",
            )
            for n in range(3)
        ]
        await stack.enter_async_context(dns)
        for mirror in mirrors:
            await stack.enter_async_context(mirror)
        controllers = [dns.controller, *mirrors]
        listeners = [dns.listener]
        for mirror in mirrors:
            assert isinstance(mirror.listener, Listener)  # each was given one above
            listeners.append(mirror.listener)
        for controller in controllers:
            await controller.wait_synced(20)

        async def holding() -> list[int]:
            counts = []
            for api in apis:
                counts.append((await api.stats())["listeners"] if api.alive() else 0)
            return counts

        assert sum(await holding()) == len(listeners)

        writing = asyncio.create_task(writer.run(stop_writing))

        async def stop_writer() -> None:
            await asyncio.gather(writing, return_exceptions=True)

        stack.push_async_callback(stop_writer)
        stack.callback(stop_writing.set)
        probes: list[Probe] = []

        async def close_probes() -> None:
            await asyncio.gather(*(p.close() for p in probes))

        stack.push_async_callback(close_probes)
        rounds: list[dict[str, Any]] = []

        async def fail_over(
            victim: ChangefeedServer, how: str, between: Callable[[], Awaitable[Any]] | None = None
        ) -> None:
            """Kill or drain ``victim``; wait until every listener is live on the survivor;
            call ``between``; restart the victim and wait until nginx uses it again."""
            survivor = apis[1 - apis.index(victim)]
            ok_before = writer.ok
            t0 = time.monotonic()
            if how == "kill":
                victim.send(signal.SIGKILL)
                status = await victim.wait_exit(10)
                assert status == -signal.SIGKILL
            else:
                victim.send(signal.SIGTERM)
                status = await victim.wait_exit(DRAIN_BOUND + 5)
                assert status == 0, victim.log()
            exited = time.monotonic() - t0
            assert exited < DRAIN_BOUND, f"{victim.name} took {exited:.1f}s to exit"
            ids = {listener.instance for listener in listeners}

            async def moved() -> bool:
                return ids <= await registered(survivor) and all(
                    listener.state is ConnectionState.LIVE for listener in listeners
                )

            await wait_until(moved, 30, interval=0.05, message=f"{how} {victim.name}: fail over")
            failover = time.monotonic() - t0
            if between is not None:
                await between()
            victim.start()
            await victim.wait_ready()
            await attach(nginx.ws_url, victim, probes)
            await wait_until(lambda: writer.ok > ok_before + 5, 20, message="writes continue")
            rounds.append(
                {
                    "how": how,
                    "victim": victim.name,
                    "exit_s": round(exited, 2),
                    "failover_s": round(failover, 2),
                }
            )

        # api1 is down during round 1's `between`: this probe lands on api2, which
        # round 2 drains; it must see the 1001 through nginx.
        drained: list[Probe] = []

        async def probe_api2() -> None:
            drained.append(await attach(nginx.ws_url, apis[1], probes))

        await fail_over(apis[0], "kill", probe_api2)
        await fail_over(apis[1], "drain")
        await asyncio.wait_for(drained[0].closed.wait(), 10)
        await fail_over(apis[0], "kill")

        stop_writing.set()
        await asyncio.wait_for(writing, 10)

        expected = await api_state(dsn)
        records = derive_records(expected.values(), dns.zone)

        async def converged() -> bool:
            return (
                all(dict(c.mirror) == expected for c in controllers)
                and dns.records() == records
                and await dns.stored_records() == records
            )

        try:
            await wait_until(converged, 30, interval=0.05, message="mirrors converged")
        except AssertionError:
            detail = [
                (
                    c.name,
                    len(set(expected) - set(c.mirror)),
                    len(set(c.mirror) - set(expected)),
                    c.listener.status() if isinstance(c.listener, Listener) else None,
                )
                for c in controllers
            ]
            raise AssertionError(f"not converged: {detail}; rounds={rounds}") from None

        for listener in listeners:
            status = listener.status()
            assert status.registrations >= 3, status
            assert status.resumes >= 2, status
        assert drained[0].close_code == 1001, drained[0].close_code
        assert writer.ok >= 100, (writer.ok, writer.failed, writer.statuses)
        elapsed = time.monotonic() - started
        print(
            f"\nHA through nginx: {rounds}; writes ok={writer.ok} failed={writer.failed} "
            f"statuses={writer.statuses}; {len(expected)} VMs; {elapsed:.1f}s"
        )
