"""Support for the listener, controller and convergence tests (this module holds no tests).

* ``VmApiServer``: the example VM API (publisher mounted) on a real uvicorn on
  127.0.0.1, which can be stopped and started again on the same port
  (a publisher restart).
* ``Proxy``: a TCP proxy between a listener and the publisher, to drop every
  connection at once (``cut``) or refuse new ones for a while (``refuse``):
  real connection loss, seen by both ends as it would be in production.
* ``api_state``, ``create_vms``, ``burst``: the API's data read straight from
  its table; writes through its HTTP routes, or (for bursts) through the same
  SQL the API runs, rows and ``changefeed.publish`` in one transaction.
* ``Events``: a logging handler that collects the structured events.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import Sequence
from typing import Any

import asyncpg
import httpx
import orjson
from servers import RunningServer, serve_app

from changefeed.example.vmapi import create_app

__all__ = [
    "Events",
    "Proxy",
    "VmApiServer",
    "api_servers",
    "api_state",
    "burst",
    "capture_events",
    "create_vms",
]

PUBLISHER_SETTINGS: dict[str, Any] = {"poll_interval": 0.05, "retention": False}


class VmApiServer:
    """The example VM API on 127.0.0.1; ``restart()`` keeps its port."""

    def __init__(self, dsn: str, **overrides: Any) -> None:
        self.dsn = dsn
        self.overrides = {**PUBLISHER_SETTINGS, **overrides}
        self.port: int | None = None
        self.app: Any = None
        self._stack: contextlib.AsyncExitStack | None = None
        self.server: RunningServer | None = None
        self.restarts = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def ws_url(self) -> str:
        return f"ws://127.0.0.1:{self.port}/changefeeds"

    async def start(self) -> None:
        self.app = create_app(self.dsn, **self.overrides)
        stack = contextlib.AsyncExitStack()
        self.server = await stack.enter_async_context(serve_app(self.app, port=self.port))
        self.port = self.server.port
        publisher = self.app.state.publisher
        await asyncio.wait_for(publisher.tailer.ready.wait(), 15)
        self._stack = stack

    async def stop(self) -> None:
        stack, self._stack = self._stack, None
        if stack is not None:
            await stack.aclose()

    async def restart(self) -> None:
        """Stop uvicorn (the publisher closes its listeners with 1001) and start a new app."""
        await self.stop()
        await self.start()
        self.restarts += 1

    async def __aenter__(self) -> VmApiServer:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()


class Proxy:
    """A TCP proxy from 127.0.0.1:<port> to 127.0.0.1:<target_port>."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.port = 0
        self.refusing = False
        self.cuts = 0
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self._tasks: set[asyncio.Task[None]] = set()

    @property
    def ws_url(self) -> str:
        return f"ws://127.0.0.1:{self.port}/changefeeds"

    async def __aenter__(self) -> Proxy:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._server is not None
        self._server.close()
        self.cut()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self._server.wait_closed()

    @property
    def connections(self) -> int:
        return len(self._writers) // 2

    def cut(self) -> None:
        """Drop every proxied connection now (both sides see a reset)."""
        self.cuts += 1
        for writer in list(self._writers):
            writer.transport.abort()
        self._writers.clear()

    @contextlib.contextmanager
    def refuse(self) -> Any:
        """Within the block, new connections are closed as soon as they are accepted."""
        self.refusing = True
        try:
            yield
        finally:
            self.refusing = False

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self.refusing:
            writer.transport.abort()
            return
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target_port)
        except OSError:
            writer.transport.abort()
            return
        self._writers.update((writer, up_writer))
        for src, dst in ((reader, up_writer), (up_reader, writer)):
            task = asyncio.create_task(self._pipe(src, dst))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _pipe(self, src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
        try:
            while data := await src.read(65536):
                dst.write(data)
                await dst.drain()
        except (ConnectionError, OSError):
            pass
        finally:
            dst.transport.abort()
            self._writers.discard(dst)


async def api_state(dsn: str) -> dict[str, dict[str, Any]]:
    """Every VM the API holds, as its routes serve it:
    uuid -> {"uuid", "alias", "nics", "server_uuid"}."""
    conn = await asyncpg.connect(dsn, timeout=10)
    try:
        rows = await conn.fetch("SELECT uuid, alias, nics, server_uuid FROM vmapi.vms")
    finally:
        await conn.close()
    return {
        str(r["uuid"]): {
            "uuid": str(r["uuid"]),
            "alias": r["alias"],
            "nics": orjson.loads(r["nics"]),
            "server_uuid": r["server_uuid"] and str(r["server_uuid"]),
        }
        for r in rows
    }


async def api_servers(dsn: str) -> dict[str, dict[str, Any]]:
    """Every server the API holds, as its routes serve it:
    uuid -> {"uuid", "hostname", "status", "ram", "datacenter"}."""
    conn = await asyncpg.connect(dsn, timeout=10)
    try:
        rows = await conn.fetch("SELECT uuid, hostname, status, ram, datacenter FROM vmapi.servers")
    finally:
        await conn.close()
    return {str(r["uuid"]): {**dict(r), "uuid": str(r["uuid"])} for r in rows}


async def create_vms(
    client: httpx.AsyncClient, count: int, prefix: str = "vm", concurrency: int = 8
) -> list[str]:
    """Create ``count`` VMs through ``POST /vms`` (``concurrency`` at a time); return their
    uuids in the order of their aliases."""
    gate = asyncio.Semaphore(concurrency)

    async def one(n: int) -> str:
        body = {"alias": f"{prefix}-{n}", "nics": [{"ip": f"10.0.{n // 250}.{n % 250}"}]}
        async with gate:
            response = await client.post("/vms", json=body)
        response.raise_for_status()
        return str(response.json()["uuid"])

    return list(await asyncio.gather(*(one(n) for n in range(count))))


async def burst(
    db: str | asyncpg.Connection, ids: Sequence[str], rounds: int, *, per_transaction: int = 0
) -> int:
    """Rename each VM in ``ids`` ``rounds`` times, publishing one entry per change, as the
    API does (rows and entries in one transaction). ``per_transaction`` > 0 groups that
    many changes per transaction (a burst the tailer reads at once). ``db`` is a DSN or an
    open connection. Returns the number of changes."""
    conn = await asyncpg.connect(db, timeout=10) if isinstance(db, str) else db
    changes = [(vm, r) for r in range(rounds) for vm in ids]
    size = per_transaction or 1
    try:
        for start in range(0, len(changes), size):
            part = changes[start : start + size]
            final = dict(part)  # each VM's last rename in this part
            async with conn.transaction():
                # The rows end as the last change in the part left them ...
                await conn.execute(
                    "UPDATE vmapi.vms v SET alias = 'burst-' || c.r, updated = now()"
                    " FROM unnest($1::uuid[], $2::int[]) AS c(id, r) WHERE v.uuid = c.id",
                    [uuid.UUID(vm) for vm in final],
                    list(final.values()),
                )
                # ... and every change in it gets its own entry, in order.
                await conn.execute(
                    "SELECT changefeed.publish('vm', ARRAY['alias'], x)"
                    " FROM unnest($1::text[]) WITH ORDINALITY AS u(x, n) ORDER BY n",
                    [vm for vm, _ in part],
                )
    finally:
        if isinstance(db, str):
            await conn.close()
    return len(changes)


class Events(logging.Handler):
    """Collects ``(event, fields)`` of the structured log events."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[tuple[str, dict[str, Any]]] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append((record.getMessage(), dict(getattr(record, "cf_fields", {}))))

    def named(self, event: str) -> list[dict[str, Any]]:
        return [fields for name, fields in self.records if name == event]


@contextlib.contextmanager
def capture_events(logger: str = "changefeed") -> Any:
    """Collect the structured events of ``logger`` (and below) within the block."""
    handler = Events()
    log = logging.getLogger(logger)
    old_level = log.level
    log.addHandler(handler)
    log.setLevel(logging.DEBUG)
    try:
        yield handler
    finally:
        log.removeHandler(handler)
        log.setLevel(old_level)
