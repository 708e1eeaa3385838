"""The publisher on every ASGI server it claims, installed from the built wheel.

Plain ASGI is the reference: the publisher must work on any ASGI server
through public interfaces. Each server below runs tests/embedding_app.py (an
existing API that embeds a publisher, as the README shows) from a clean venv
holding the wheel and that server, as its own process, against the tests'
PostgreSQL; this process is the listeners and the writer. Each runs the same
protocol conformance checks (the wire contract of docs/design.md: shapes,
matching, batch frames, resume, refusals and their close codes, auth at the
handshake, the HTTP routes, RFD 5's v2 registration and heartbeats) and the
burst test (100 listeners, each gets every item, none starved).

* ``uvicorn-0.35``: the oldest stack supported: uvicorn 0.35 with its
  defaults, and every other dependency of the publisher's install at the
  lower bound pyproject.toml gives it (websockets, starlette, asyncpg, msgspec...);
* ``uvicorn-newest`` with its defaults, on the newest uvicorn there is;
* ``uvicorn-newest-fast`` with the fast path (``--ws
  changefeed.serving:FanoutWebSocketProtocol``), on the newest uvicorn the
  fast path claims (changefeed.fast_path.TESTED_UVICORN);
* ``hypercorn`` (a FastAPI app) and ``granian``, newest.

What differs between servers is what the ASGI spec leaves to them, and the
checks say so where it shows: a server without the websocket denial response
refuses a token with 4003 after accepting, not with HTTP 401.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import shutil
import statistics
import sys
import tomllib
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import asyncpg
import httpx
import orjson
import pytest
import pytest_asyncio
from helpers import free_port
from publisher_fixtures import receive_items
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed, InvalidStatus
from wheel_envs import Served, Venvs, serve, server_command

from changefeed.fast_path import OLDEST_UVICORN, TESTED_UVICORN
from changefeed.publisher import publish_many
from changefeed.schemas import Ack, ChangeItem, apply_schema, validate

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
from common import ClientFleet

pytestmark = [pytest.mark.slow, pytest.mark.asyncio(loop_scope="module")]

HERE = Path(__file__).resolve().parent
TOKEN = "conformance-" + uuid.uuid4().hex
AUTH = {"Authorization": f"Bearer {TOKEN}"}
APP_SETTINGS = {
    "auth_tokens": [TOKEN],
    "registration_timeout": 1.0,
    "poll_interval": 0.2,
    "retention": False,
    "queue_size": 4096,
}


@dataclass(frozen=True)
class Server:
    venv: str
    extra: str
    requirements: tuple[str, ...]
    kind: str
    framework: str = "starlette"


def lower_bounds() -> tuple[str, ...]:
    """``name==floor.*`` for every dependency of the publisher's install (the base ones
    and the ``publisher`` extra's), from the ``>=`` bound pyproject.toml gives it: the
    oldest release series claimed (its newest patch: ``tenacity>=9.2`` has no 9.2.0)."""
    project = tomllib.loads((HERE.parent / "pyproject.toml").read_text())["project"]
    declared = [*project["dependencies"], *project["optional-dependencies"]["publisher"]]
    floors = []
    for requirement in declared:
        found = re.fullmatch(r"([A-Za-z0-9_.-]+)>=([0-9][0-9.]*)", requirement)
        assert found is not None, f"{requirement}: a lower bound only, as name>=version"
        floors.append(f"{found[1]}=={found[2]}.*")
    return tuple(floors)


_LOW, _HIGH = TESTED_UVICORN
FAST_UVICORN = f"uvicorn[standard]>={_LOW[0]}.{_LOW[1]},<{_HIGH[0]}.{_HIGH[1]}"
"""The newest uvicorn the fast path claims (the newest overall may be past it)."""

SERVERS = {
    "uvicorn-0.35": Server(
        "uvicorn-0.35",
        "publisher",
        (
            f"uvicorn[standard]=={OLDEST_UVICORN}",
            *lower_bounds(),
        ),
        "uvicorn",
    ),
    "uvicorn-newest": Server("uvicorn-newest", "serve", (), "uvicorn"),
    "uvicorn-newest-fast": Server("uvicorn-fast", "serve", (FAST_UVICORN,), "uvicorn-fast"),
    "hypercorn": Server("hypercorn", "publisher", ("hypercorn", "fastapi"), "hypercorn", "fastapi"),
    "granian": Server("granian", "publisher", ("granian",), "granian"),
}


@pytest.mark.parametrize("name", ["uvicorn-0.35", "uvicorn-newest"])
async def test_every_uvicorn_claimed_has_what_changefeeds_own_server_uses(
    name: str, wheel_venvs: Venvs, tmp_path: Path
) -> None:
    """The ``serve`` extra claims uvicorn from OLDEST_UVICORN on, with no upper bound:
    ``changefeed serve``'s server (its private names, changefeed.uvicorn_private)
    must start on the oldest and on the newest there is."""
    server = SERVERS[name]
    venv = await asyncio.to_thread(wheel_venvs.get, server.venv, server.extra, *server.requirements)
    code = (
        "import uvicorn\n"
        "from changefeed.uvicorn_private import missing\n"
        "print(uvicorn.__version__, missing('serve'))\n"
    )
    done = await asyncio.to_thread(venv.run, ["python", "-c", code], tmp_path)
    assert done.returncode == 0, done.stderr
    version, lacking = done.stdout.split(maxsplit=1)
    assert lacking.strip() == "[]", f"uvicorn {version}: {lacking}"
    if name == "uvicorn-0.35":
        assert version == OLDEST_UVICORN


@dataclass
class Running:
    name: str
    served: Served
    dsn: str

    @property
    def ws_url(self) -> str:
        return self.served.ws_url


@pytest_asyncio.fixture(scope="module", loop_scope="module", params=list(SERVERS))
async def running(
    request: pytest.FixtureRequest,
    pg_server: Any,
    wheel_venvs: Venvs,
    tmp_path_factory: pytest.TempPathFactory,
) -> AsyncIterator[Running]:
    name: str = request.param
    server = SERVERS[name]
    venv = await asyncio.to_thread(wheel_venvs.get, server.venv, server.extra, *server.requirements)
    database = f"servers_{name.replace('-', '_').replace('.', '_')}_{uuid.uuid4().hex[:8]}"
    admin = await asyncpg.connect(pg_server.dsn)
    try:
        await admin.execute(f'CREATE DATABASE "{database}"')
    finally:
        await admin.close()
    dsn = pg_server.dsn_for(database)
    conn = await asyncpg.connect(dsn)
    try:
        await apply_schema(conn)
    finally:
        await conn.close()
    cwd = tmp_path_factory.mktemp(name)
    shutil.copy(HERE / "embedding_app.py", cwd / "embedding_app.py")
    port = free_port()
    env = {
        "CHANGEFEED_DSN": dsn,
        "CHANGEFEED_APP_SETTINGS": orjson.dumps(APP_SETTINGS).decode(),
        "CHANGEFEED_APP_FRAMEWORK": server.framework,
    }
    command = server_command(venv, server.kind, "embedding_app:app", port)
    async with serve(command, cwd, env, port) as served:
        yield Running(name, served, dsn)


def _registration(resource: str = "vm", subs: tuple[str, ...] = (), **extra: Any) -> str:
    doc: dict[str, Any] = {
        "instance": str(uuid.uuid4()),
        "service": "conformance",
        "changeKind": {"resource": resource, "subResources": list(subs)},
        **extra,
    }
    return orjson.dumps(doc).decode()


async def _register(url: str, frame: str) -> tuple[ClientConnection, dict[str, Any]]:
    ws = await connect(url, open_timeout=10, additional_headers=AUTH)
    await ws.send(frame)
    ack = orjson.loads(await asyncio.wait_for(ws.recv(), 10))
    return ws, ack


async def _write(dsn: str, entries: list[tuple[str, list[str], str]]) -> None:
    conn = await asyncpg.connect(dsn)
    try:
        for i in range(0, len(entries), 1000):
            await publish_many(conn, entries[i : i + 1000])
    finally:
        await conn.close()


async def _refusal(ws: ClientConnection) -> tuple[str | None, int | None]:
    """The error frame's code (if one came first) and the close code."""
    error = None
    with contextlib.suppress(ConnectionClosed, TimeoutError):
        async with asyncio.timeout(10):
            while True:
                frame = orjson.loads(await ws.recv())
                if isinstance(frame, dict) and "error" in frame:
                    validate("error", frame)
                    error = frame["error"]["code"]
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(ws.wait_closed(), 10)
    return error, ws.close_code


# --------------------------------------------------------------------------- the contract


async def test_acks_and_items_have_the_contract_shapes_and_match(running: Running) -> None:
    tag = uuid.uuid4().hex[:8]
    ws_alias, ack = await _register(running.ws_url, _registration(subs=("alias",)))
    ws_everything, _ = await _register(running.ws_url, _registration())
    try:
        validate("ack", ack)
        assert Ack.decode(orjson.dumps(ack)).resumed is False
        assert ack["bootstrapRoute"] == "/vms"
        # Each entry that must not reach a listener comes before one that must:
        # a wrong delivery shows up in the order received.
        entries = [
            ("vm", ["nic"], f"{tag}-nic"),  # not alias: only the one with no sub-resources
            ("vm", [], f"{tag}-whole"),  # the resource as a whole: both
            ("network", [], f"{tag}-net"),  # another resource: neither
            ("vm", ["alias", "nic"], f"{tag}-both"),  # intersects: both
        ]
        await _write(running.dsn, entries)
        got_alias = await receive_items(ws_alias, 2)
        got_all = await receive_items(ws_everything, 3)
        for item in got_alias + got_all:
            validate("change_item", item)
            ChangeItem.from_json(item)
        assert [i["changedResourceId"] for i in got_alias] == [f"{tag}-whole", f"{tag}-both"]
        assert [i["changedResourceId"] for i in got_all] == [
            f"{tag}-nic",
            f"{tag}-whole",
            f"{tag}-both",
        ]
    finally:
        await ws_alias.close()
        await ws_everything.close()


async def test_batch_listeners_get_arrays_and_rfd5_listeners_one_item_a_frame(
    running: Running,
) -> None:
    tag = uuid.uuid4().hex[:8]
    batch, ack = await _register(running.ws_url, _registration(batch=True))
    single, _ = await _register(running.ws_url, _registration())
    try:
        assert ack["batch"] is True
        await _write(running.dsn, [("vm", [], f"{tag}-{i}") for i in range(50)])
        frames: list[Any] = []
        async with asyncio.timeout(10):
            while sum(len(f) for f in frames) < 50:
                frames.append(orjson.loads(await batch.recv()))
        assert all(isinstance(f, list) for f in frames)
        assert [i["changedResourceId"] for f in frames for i in f] == [
            f"{tag}-{i}" for i in range(50)
        ]
        async with asyncio.timeout(10):
            singles = [orjson.loads(await single.recv()) for _ in range(50)]
        assert all(isinstance(f, dict) for f in singles)
    finally:
        await batch.close()
        await single.close()


async def test_a_resume_replays_exactly_what_was_missed(running: Running) -> None:
    tag = uuid.uuid4().hex[:8]
    ws, ack = await _register(running.ws_url, _registration())
    await _write(running.dsn, [("vm", [], f"{tag}-seen")])
    (seen,) = await receive_items(ws, 1)
    await ws.close()
    await _write(running.dsn, [("vm", [], f"{tag}-missed-{i}") for i in range(5)])
    again, ack = await _register(running.ws_url, _registration(since=seen["cursor"]))
    try:
        assert ack["resumed"] is True
        assert ack["cursor"] == seen["cursor"]
        items = await receive_items(again, 5)
        assert [i["changedResourceId"] for i in items] == [f"{tag}-missed-{i}" for i in range(5)]
    finally:
        await again.close()


@pytest.mark.parametrize(
    ("frame", "error", "close"),
    [
        ("not json", "bad_frame", 4000),
        ('{"instance": "x"}', "invalid_registration", 4000),
        (_registration("vmz"), "unknown_resource", 4001),
        (_registration(since="garbage"), "bad_cursor", 4005),
        (b'{"instance": "binary"}', "bad_frame", 4000),
        ("x" * (70 * 1024), "frame_too_large", 4006),
    ],
    ids=["not-json", "invalid", "unknown-resource", "bad-cursor", "binary", "too-large"],
)
async def test_a_bad_registration_gets_its_error_frame_and_close_code(
    running: Running, frame: str | bytes, error: str, close: int
) -> None:
    ws = await connect(running.ws_url, open_timeout=10, additional_headers=AUTH, max_size=None)
    await ws.send(frame)
    assert await _refusal(ws) == (error, close)


async def test_a_silent_connection_is_closed_after_the_registration_timeout(
    running: Running,
) -> None:
    ws = await connect(running.ws_url, open_timeout=10, additional_headers=AUTH)
    assert await _refusal(ws) == ("registration_timeout", 4002)


async def test_a_missing_token_is_refused_at_the_handshake(running: Running) -> None:
    try:
        ws = await connect(running.ws_url, open_timeout=10)
    except InvalidStatus as exc:  # the ASGI websocket denial response
        assert exc.response.status_code == 401
        assert exc.response.headers["WWW-Authenticate"] == "Bearer"
    else:  # a server without it: accept, error frame, 4003
        await ws.send(_registration())
        assert await _refusal(ws) == ("unauthorized", 4003)
    async with httpx.AsyncClient(base_url=running.served.url, timeout=10) as http:
        assert (await http.get("/changefeeds")).status_code == 401
        resources = (await http.get("/changefeeds", headers=AUTH)).json()
        validate("resources", resources)
        assert [r["resource"] for r in resources["resources"]] == ["vm", "network"]
        stats = await http.get("/changefeeds/stats", headers=AUTH)
        assert stats.status_code == 200
        validate("stats", stats.json())
        assert (await http.get("/version")).json() == {"api": "1"}  # the API's own route


async def test_rfd5_v2_registrations_and_heartbeats_are_served(running: Running) -> None:
    tag = uuid.uuid4().hex[:8]
    v2 = {
        "instance": str(uuid.uuid4()),
        "service": "conformance",
        "resources": [
            {"resource": "vm", "subResources": ["nic"]},
            {"resource": "network", "subResources": []},
        ],
    }
    ws, ack = await _register(running.ws_url, orjson.dumps(v2).decode())
    try:
        assert [r["bootstrapRoute"] for r in ack["bootstrapRoutes"]] == ["/vms", "/networks"]
        assert "bootstrapRoute" not in ack
        for _ in range(3):
            await ws.send("heartbeat")
        await _write(running.dsn, [("vm", ["nic"], f"{tag}-vm"), ("network", [], f"{tag}-net")])
        items = await receive_items(ws, 2)
        assert [i["changedResourceId"] for i in items] == [f"{tag}-vm", f"{tag}-net"]
    finally:
        await ws.close()


# --------------------------------------------------------------------------- the burst


@pytest.mark.parametrize("batch", [True, False], ids=["batch", "rfd5"])
async def test_a_burst_reaches_100_listeners_fairly(running: Running, batch: bool) -> None:
    """tests/test_fanout.py's burst test, on this server: every listener gets
    every item, and none is starved."""
    items = 3000 if batch else 1000
    tag = uuid.uuid4().hex[:8]
    async with ClientFleet() as fleet:
        result = await fleet.connect(
            running.ws_url,
            100,
            _registration(batch=batch),
            headers=[("Authorization", AUTH["Authorization"])],
        )
        assert result["connected"] == 100, result
        await fleet.reset(items)
        await _write(running.dsn, [("vm", ["nic"], f"{tag}-{i}") for i in range(items)])
        report = await fleet.wait(120)
        await fleet.close_all()
    assert report["complete"] and report["items"] == [items] * 100
    began = min(report["first_at"])
    done = sorted(t - began for t in report["done_at"])
    first = sorted(t - began for t in report["first_at"])
    total = done[-1]
    print(
        f"\n{running.name}, {'batch' if batch else 'RFD 5'}: {items} items x 100 listeners in "
        f"{total:.2f}s; completion spread {(done[-1] - done[0]) / total:.0%}, first item: "
        f"median {statistics.median(first) * 1000:.0f} ms, last {first[-1] * 1000:.0f} ms"
    )
    assert first[-1] <= 0.5 * total + 0.05
    assert done[-1] - done[0] <= 0.5 * total + 0.05
    async with httpx.AsyncClient(base_url=running.served.url, timeout=10) as http:
        counters = (await http.get("/changefeeds/stats", headers=AUTH)).json()["counters"]
    assert counters["evictions"] == 0


async def test_a_text_frame_that_is_not_utf8_ends_only_its_connection(running: Running) -> None:
    """The fast path refuses it as the publisher refuses any bad frame; plain ASGI
    leaves it to the server (uvicorn: 1007; others differ). Either way only that
    connection ends."""
    ws, _ = await _register(running.ws_url, _registration())
    await ws.send(b"\xff\xfe", text=True)
    error, close = await _refusal(ws)
    if running.name.endswith("-fast"):
        assert (error, close) == ("bad_frame", 4000)
    else:
        assert error is None
    tag = uuid.uuid4().hex[:8]
    good, _ = await _register(running.ws_url, _registration())
    await _write(running.dsn, [("vm", [], tag)])
    assert [i["changedResourceId"] for i in await receive_items(good, 1)] == [tag]
    await good.close()


async def test_the_server_log_has_the_fan_out_path_and_no_error(running: Running) -> None:
    """Runs last on each server: the fan-out path is the one this server can give
    (direct writes only on the fast path), and nothing above made changefeed log
    an error. (The server's own lines are its business: plain uvicorn logs each
    non-UTF-8 frame as an error with its traceback.)"""
    events = [
        orjson.loads(line)
        for line in running.served.output().splitlines()
        if line.startswith('{"ts"')
    ]
    paths = [e["path"] for e in events if e["event"] == "fanout.path"]
    assert paths == ["direct writes" if running.name.endswith("-fast") else "ASGI sends"]
    if not running.name.endswith("-fast"):
        # Through plain ASGI the publisher found the port's listening socket in its
        # process and bounded what the kernel holds unsent (changefeed.port_sockets).
        bounded = [e for e in events if e["event"].startswith("serving.notsent_")]
        assert [e["event"] for e in bounded] == ["serving.notsent_lowat"], bounded
        assert bounded[0]["listening"] >= 1
    errors = [e for e in events if e["logger"].startswith("changefeed") and e["level"] == "error"]
    assert errors == []
