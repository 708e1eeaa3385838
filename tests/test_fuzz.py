"""Fuzzing the publisher's inputs with hypothesis (invariant I6).

Registration frames (random JSON, registrations with fields of the wrong type
or size, random text and bytes, huge strings) and the query parameters of the
HTTP routes. The publisher runs on real uvicorn in a thread of its own, so that
hypothesis can drive plain synchronous websocket and HTTP clients against it
for hundreds of examples. Every bad frame must be answered with an error frame
and its documented close code, every bad query with a 400 and the error body;
nothing may crash (no error logged by uvicorn or the publisher), and a
listener registered before the fuzzing still receives items after it.
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import threading
import uuid
from collections.abc import Iterator
from typing import Any
from urllib.parse import quote_from_bytes

import asyncpg
import httpx
import orjson
import pytest
import uvicorn
from helpers import LogRecords
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from publisher_fixtures import NETWORK, VM, registration
from servers import leave_signals_to_pytest
from starlette.applications import Starlette
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import ClientConnection, connect

from changefeed.publisher import Publisher, PublisherConfig, publish
from changefeed.schemas import ERROR_CLOSE_CODES, apply_schema, validate

# The publisher's thread (and the websocket clients' keepalive threads) draw from
# the global ``random`` (websockets' keepalive ping payloads, among others) while
# hypothesis draws an example in this thread; hypothesis reads that as a strategy
# using ``random`` (its check compares the global state before and after a draw).
pytestmark = pytest.mark.filterwarnings(
    "ignore:Do not use the `random` module inside strategies"
    ":hypothesis.errors.HypothesisDeprecationWarning"
)


class ThreadedPublisher:
    """A publisher on uvicorn, on an event loop in its own thread."""

    def __init__(self, dsn: str, **overrides: Any) -> None:
        self.dsn = dsn
        self.config = PublisherConfig(
            dsn=dsn, resources=(VM, NETWORK), retention=False, poll_interval=0.2, **overrides
        )
        self.publisher: Publisher | None = None
        self.port = 0
        self._ready = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._thread = threading.Thread(target=self._run, name="fuzz-publisher", daemon=True)
        self._error: BaseException | None = None

    def _run(self) -> None:
        try:
            asyncio.run(self._serve())
        except BaseException as exc:
            self._error = exc
            self._ready.set()

    async def _serve(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        publisher = self.publisher = Publisher(self.config)
        app = Starlette(routes=publisher.routes, lifespan=publisher.lifespan)
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self.port = sock.getsockname()[1]
        server = uvicorn.Server(uvicorn.Config(app, log_level="warning", ws_max_size=1 << 20))
        leave_signals_to_pytest(server)
        task = asyncio.create_task(server.serve(sockets=[sock]))
        while not server.started:
            if task.done():
                task.result()
            await asyncio.sleep(0.01)
        await asyncio.wait_for(publisher.tailer.ready.wait(), 10)
        self._ready.set()
        await self._stop.wait()
        server.should_exit = True
        await asyncio.wait_for(task, 20)
        sock.close()

    def __enter__(self) -> ThreadedPublisher:
        self._thread.start()
        assert self._ready.wait(30), "publisher did not start"
        if self._error is not None:
            raise self._error
        return self

    def __exit__(self, *exc: object) -> None:
        if self._loop is not None and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(30)

    @property
    def ws_url(self) -> str:
        return f"ws://127.0.0.1:{self.port}/changefeeds"

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def write(self, changed_id: str) -> None:
        async def go() -> None:
            conn = await asyncpg.connect(self.dsn)
            try:
                await publish(conn, "vm", ["nic"], changed_id)
            finally:
                await conn.close()

        asyncio.run(go())


@pytest.fixture(scope="module")
def fuzzed(pg_server: Any) -> Iterator[tuple[ThreadedPublisher, ClientConnection, LogRecords]]:
    """One publisher for all examples, a good listener registered before them, and
    every error logged meanwhile."""
    name = f"fuzz_{uuid.uuid4().hex}"

    async def create() -> None:
        admin = await asyncpg.connect(pg_server.dsn)
        try:
            await admin.execute(f'CREATE DATABASE "{name}"')
        finally:
            await admin.close()
        conn = await asyncpg.connect(pg_server.dsn_for(name))
        try:
            await apply_schema(conn)
        finally:
            await conn.close()

    async def drop() -> None:
        admin = await asyncpg.connect(pg_server.dsn)
        try:
            await admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        finally:
            await admin.close()

    asyncio.run(create())
    errors = LogRecords(logging.ERROR)
    loggers = [logging.getLogger(n) for n in ("uvicorn.error", "uvicorn.asgi", "changefeed")]
    for logger in loggers:
        logger.addHandler(errors)
    try:
        with ThreadedPublisher(pg_server.dsn_for(name), max_frame_bytes=65536) as pub:
            with connect(pub.ws_url, open_timeout=10) as good:
                good.send(registration(subs=["nic"]))
                assert "bootstrapRoute" in orjson.loads(good.recv(timeout=10))
                yield pub, good, errors
                # After all the fuzzing: the good listener still gets items.
                pub.write("after-the-fuzzing")
                item = orjson.loads(good.recv(timeout=10))
                assert item["changedResourceId"] == "after-the-fuzzing"
            assert pub.publisher is not None
            stats = pub.publisher.stats()
            assert stats["counters"]["registrations"] >= 1
            assert not errors.records, [r.getMessage() for r in errors.records]
    finally:
        for logger in loggers:
            logger.removeHandler(errors)
        asyncio.run(drop())


# --------------------------------------------------------------------------- strategies

json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=40),
    lambda children: (
        st.lists(children, max_size=5) | st.dictionaries(st.text(max_size=12), children, max_size=5)
    ),
    max_leaves=20,
)
names = st.sampled_from(["vm", "network", "nic", "alias", "subnet", "vmz", "", "a" * 65])
wrong = json_values | st.text(min_size=200, max_size=3000) | names
change_kinds = st.fixed_dictionaries(
    {"resource": names | wrong, "subResources": st.lists(names, max_size=40) | wrong}
)
mutants = st.fixed_dictionaries(
    {},
    optional={
        "instance": st.text(min_size=1, max_size=300) | wrong,
        "service": st.text(min_size=1, max_size=300) | wrong,
        "changeKind": change_kinds | wrong,
        "resources": st.lists(change_kinds, max_size=40) | wrong,
        "since": st.text(max_size=200) | wrong,
        "batch": st.booleans() | wrong,
        "heartbeat": wrong,
    },
)
frames = st.one_of(
    mutants.map(json.dumps),
    json_values.map(json.dumps),
    st.text(max_size=500),
    st.binary(max_size=500),
    st.integers(60_000, 80_000).map(lambda n: '{"instance": "' + "x" * n + '"}'),
)


def _answer(ws: ClientConnection) -> tuple[dict[str, Any] | None, int | None]:
    """The publisher's first frame (None if it only closed) and the close code."""
    first: dict[str, Any] | None = None
    try:
        first = orjson.loads(ws.recv(timeout=10))
        if "bootstrapRoute" in first or "bootstrapRoutes" in first:
            return first, None  # a valid registration: acked
        ws.recv(timeout=10)
    except ConnectionClosed as closed:
        return first, closed.rcvd.code if closed.rcvd is not None else None
    raise AssertionError(f"no close after {first!r}")


@settings(
    max_examples=250,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(frame=frames)
def test_every_registration_frame_is_acked_or_refused_with_its_close_code(
    fuzzed: tuple[ThreadedPublisher, ClientConnection, LogRecords], frame: str | bytes
) -> None:
    pub, _, errors = fuzzed
    with connect(pub.ws_url, open_timeout=10, close_timeout=2, max_size=None) as ws:
        ws.send(frame)
        first, code = _answer(ws)
    assert first is not None, f"closed ({code}) without an error frame"
    if code is None:
        return  # acked: the fuzzer made a valid registration
    validate("error", first)
    assert code == ERROR_CLOSE_CODES[first["error"]["code"]], (first, code)
    assert not errors.records, [r.getMessage() for r in errors.records]


query_parts = st.lists(
    st.tuples(
        st.sampled_from(["resource", "service", "limit", "since", "x"]) | st.text(max_size=20),
        st.text(max_size=80) | st.integers().map(str) | st.text(min_size=200, max_size=2000),
    ),
    max_size=4,
)


@settings(
    max_examples=150,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    path=st.sampled_from(["/changefeeds", "/changefeeds/stats", "/metrics", "/readyz"]),
    params=query_parts,
    raw=st.binary(max_size=200),
)
def test_every_query_is_answered_or_refused_with_a_400(
    fuzzed: tuple[ThreadedPublisher, ClientConnection, LogRecords],
    path: str,
    params: list[tuple[str, str]],
    raw: bytes,
) -> None:
    pub, _, errors = fuzzed
    query = "&".join(
        f"{quote_from_bytes(k.encode())}={quote_from_bytes(v.encode())}" for k, v in params
    )
    if raw:
        query = (query + "&" if query else "") + quote_from_bytes(raw, safe="=&")
    with httpx.Client(base_url=pub.url, timeout=10) as http:
        response = http.get(httpx.URL(path, query=query.encode()))
    assert response.status_code in (200, 400), (path, query, response.status_code)
    if response.status_code == 400:
        validate("error", response.json())
        assert response.json()["error"]["code"] == "bad_request"
    assert not errors.records, [r.getMessage() for r in errors.records]
