"""Bearer tokens: static tokens with per-token resources, a pluggable authorizer,
refusal at the websocket handshake (HTTP 401) and on the HTTP routes, counting.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import logging
import traceback
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
from helpers import LogRecords, wait_until
from publisher_fixtures import VM, receive_items, register, registration, running_publisher, write
from starlette.applications import Starlette
from starlette.types import Receive, Scope, Send
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed, InvalidStatus

from changefeed.publisher import ConfigError, Publisher, PublisherConfig
from changefeed.publisher.auth import presented_token, resources_served_at
from changefeed.publisher.config import load_config
from changefeed.schemas import BOOTSTRAP_ROUTE_STATE, AccessDenied, CloseCode, validate

OPS = "ops-token-all-resources"
DNS = "dns-token-vm-only"
HASHED = "hashed-token-network-only"
TOKENS: dict[str, Any] = {
    "auth_tokens": (OPS,),
    "token_resources": {
        DNS: ("vm",),
        "sha256:" + hashlib.sha256(HASHED.encode()).hexdigest(): ("network",),
    },
}


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


async def test_the_handshake_without_a_good_token_is_refused_with_401(feed_dsn: str) -> None:
    async with running_publisher(feed_dsn, **TOKENS) as pub:
        # Added once uvicorn has configured its loggers (which drops other handlers).
        server_errors = LogRecords(logging.ERROR)
        uvicorn_log = logging.getLogger("uvicorn.error")
        uvicorn_log.addHandler(server_errors)
        try:
            await _refuse_four_bad_tokens(pub.ws_url)
        finally:
            uvicorn_log.removeHandler(server_errors)
        # A refused token is the publisher's answer, counted below, not a server error.
        assert [r.getMessage() for r in server_errors.records] == []
        stats = pub.publisher.stats()
        assert stats["counters"]["refused"] == {"unauthorized": 4}
        assert stats["connections"] == 0 and stats["counters"]["registrations"] == 0
        text = pub.publisher.metrics.render().decode()
        assert 'changefeed_refusals_total{code="unauthorized",endpoint="websocket"} 4.0' in text


async def test_refusals_anyone_can_cause_do_not_set_the_log_volume(
    feed_dsn: str, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """60 handshakes without a token: every one is refused and counted, but only the
    first 20 of the window are logged one by one; the rest go out as one summary at
    the same level (here when the publisher stops, before its window ends). A refusal
    of another code in the same window is still logged: each code has its budget."""
    from changefeed.publisher import sessions

    assert sessions.REFUSALS_LOGGED == 20
    monkeypatch.setattr(sessions, "REFUSALS_WINDOW", 3600.0)  # one window, however slow
    caplog.set_level(logging.WARNING, logger="changefeed")
    async with running_publisher(feed_dsn, **TOKENS) as pub:
        for _ in range(60):
            with pytest.raises(InvalidStatus):
                await connect(pub.ws_url)
        ws, first = await register(pub.ws_url, "not json", additional_headers=bearer(OPS))
        assert first["error"]["code"] == "bad_frame", first
        await ws.close()
        assert pub.publisher.stats()["counters"]["refused"] == {"unauthorized": 60, "bad_frame": 1}
    logged = [
        r.cf_fields["code"]  # type: ignore[attr-defined]
        for r in caplog.records
        if r.getMessage() == "registration.refused"
    ]
    assert logged == ["unauthorized"] * 20 + ["bad_frame"], logged
    (summary,) = [r for r in caplog.records if r.getMessage() == "refusals_held"]
    held = summary.cf_fields["held"]  # type: ignore[attr-defined]
    assert held == {"registration.refused unauthorized": 40} and summary.levelno == logging.WARNING


async def _refuse_four_bad_tokens(url: str) -> None:
    for headers in ({}, bearer("wrong"), {"Authorization": f"Basic {OPS}"}, bearer("")):
        with pytest.raises(InvalidStatus) as refused:
            await connect(url, additional_headers=headers)
        response = refused.value.response
        assert response.status_code == 401
        assert response.headers["WWW-Authenticate"] == "Bearer"
        body = orjson.loads(response.body)
        validate("error", body)
        assert body["error"]["code"] == "unauthorized"


async def test_tokens_read_only_their_resources(feed_dsn: str) -> None:
    async with running_publisher(feed_dsn, **TOKENS) as pub:
        ops, ack = await register(
            pub.ws_url, registration("network", ["subnet"]), additional_headers=bearer(OPS)
        )
        assert ack["bootstrapRoute"] == "/networks"
        dns, ack = await register(pub.ws_url, registration(), additional_headers=bearer(DNS))
        assert ack["bootstrapRoute"] == "/vms"
        hashed, ack = await register(
            pub.ws_url, registration("network", []), additional_headers=bearer(HASHED)
        )
        assert ack["bootstrapRoute"] == "/networks"
        for token, frame in ((DNS, registration("network", [])), (HASHED, registration())):
            ws, error = await register(pub.ws_url, frame, additional_headers=bearer(token))
            assert error["error"]["code"] == "forbidden"
            with pytest.raises(ConnectionClosed) as closed:
                await asyncio.wait_for(ws.recv(), 5)
            assert closed.value.rcvd is not None
            assert closed.value.rcvd.code == CloseCode.FORBIDDEN
        await write(feed_dsn, [("vm", ["nic"], "v1"), ("network", ["subnet"], "n1")])
        assert [i["changedResourceId"] for i in await receive_items(dns, 1)] == ["v1"]
        assert [i["changedResourceId"] for i in await receive_items(ops, 1)] == ["n1"]
        assert [i["changedResourceId"] for i in await receive_items(hashed, 1)] == ["n1"]
        for ws in (ops, dns, hashed):
            await ws.close()


async def test_http_routes_need_the_token_and_show_only_its_resources(feed_dsn: str) -> None:
    async with (
        running_publisher(feed_dsn, **TOKENS) as pub,
        httpx.AsyncClient(base_url=pub.server.url) as http,
    ):
        for path in ("/changefeeds", "/changefeeds/stats"):
            response = await http.get(path)
            assert response.status_code == 401, path
            assert response.headers["WWW-Authenticate"] == "Bearer"
            assert response.json()["error"]["code"] == "unauthorized"
            assert (await http.get(path, headers=bearer("nope"))).status_code == 401
        everything = (await http.get("/changefeeds", headers=bearer(OPS))).json()
        assert [r["resource"] for r in everything["resources"]] == ["vm", "network"]
        vm_only = (await http.get("/changefeeds", headers=bearer(DNS))).json()
        assert [r["resource"] for r in vm_only["resources"]] == ["vm"]
        ws, _ = await register(
            pub.ws_url, registration("network", []), additional_headers=bearer(OPS)
        )
        stats = (await http.get("/changefeeds/stats", headers=bearer(DNS))).json()
        assert stats["listeners"] == 1 and stats["registrations"] == []
        stats = (await http.get("/changefeeds/stats", headers=bearer(OPS))).json()
        assert len(stats["registrations"]) == 1
        forbidden = await http.get("/changefeeds/stats?resource=network", headers=bearer(DNS))
        assert forbidden.status_code == 403
        # Probes and scrapers need no token.
        for path in ("/metrics", "/healthz", "/readyz"):
            assert (await http.get(path)).status_code == 200, path
        assert pub.publisher.stats()["counters"]["refused"]["unauthorized"] == 4
        await ws.close()


async def test_answers_that_depend_on_the_token_are_neither_cached_nor_sniffed(
    feed_dsn: str,
) -> None:
    """/changefeeds and /changefeeds/stats answer with ``Cache-Control: no-store`` and
    ``X-Content-Type-Options: nosniff``, refusals and a wrong method's 405 included (the
    dashboard has both)."""
    async with (
        running_publisher(feed_dsn, **TOKENS) as pub,
        httpx.AsyncClient(base_url=pub.server.url) as http,
    ):
        answers = [
            await http.get("/changefeeds/stats", headers=bearer(OPS)),
            await http.get("/changefeeds/stats", headers=basic_credentials(OPS)),
            await http.get("/changefeeds/stats"),
            await http.get("/changefeeds/stats?resource=network", headers=bearer(DNS)),
            await http.get("/changefeeds/stats?limit=x", headers=bearer(OPS)),
            await http.get("/changefeeds", headers=bearer(OPS)),
            await http.get("/changefeeds"),
            await http.post("/changefeeds/stats", headers=bearer(OPS)),
            await http.delete("/changefeeds"),
        ]
        assert [a.status_code for a in answers] == [200, 200, 401, 403, 400, 200, 401, 405, 405]
        assert answers[-1].headers["Allow"] == "GET, HEAD"
        assert answers[-1].json()["error"]["code"] == "method_not_allowed"
        for answer in answers:
            assert answer.headers["Cache-Control"] == "no-store", answer.request.url
            assert answer.headers["X-Content-Type-Options"] == "nosniff", answer.request.url


def basic_credentials(password: str) -> dict[str, str]:
    return {"Authorization": "Basic " + base64.b64encode(f"ops:{password}".encode()).decode()}


async def test_bootstrap_routes_use_authorize_request_with_a_resource(feed_dsn: str) -> None:
    async with (
        running_publisher(feed_dsn, **TOKENS) as pub,
        httpx.AsyncClient(base_url=pub.server.url) as http,
    ):
        publisher = pub.publisher

        def request(token: str | None) -> Any:
            from starlette.requests import Request

            headers = [(b"authorization", f"Bearer {token}".encode())] if token else []
            return Request({"type": "http", "headers": headers, "path": "/vms", "client": None})

        assert await publisher.authorize_request(request(OPS))
        assert await publisher.authorize_request(request(DNS), resource="vm")
        assert not await publisher.authorize_request(request(DNS), resource="network")
        assert await publisher.authorize_request(request(DNS))  # authenticated, any route
        assert not await publisher.authorize_request(request(None))
        refused = publisher.stats()["counters"]["refused"]
        assert refused == {"forbidden": 1, "unauthorized": 1}
        assert (await http.get("/healthz")).status_code == 200


async def test_a_bootstrap_route_built_as_documented_checks_the_resource_it_serves(
    feed_dsn: str,
) -> None:
    """``BootstrapRoute("/vms", ..., authorize=publisher.authorize_request)``, as
    docs/bootstrap.md builds it, names no resource: the publisher finds the one whose
    ``bootstrap_route`` serves the path. A token allowed only ``network`` gets 403 on
    the list and on an item (it got 200, and every VM), one allowed ``vm`` gets them;
    none of those answers may be cached or sniffed."""
    import uuid

    import asyncpg
    from servers import serve_app

    from changefeed.bootstrap import BootstrapRoute, KeysetQuery
    from changefeed.publisher import ResourceConfig

    table = f"vms_{uuid.uuid4().hex[:8]}"
    vm_id = uuid.uuid4()
    conn = await asyncpg.connect(feed_dsn)
    try:
        await conn.execute(f"CREATE TABLE {table} (uuid uuid PRIMARY KEY, alias text)")
        await conn.execute(f"INSERT INTO {table} VALUES ($1, 'web')", vm_id)
    finally:
        await conn.close()
    network = ResourceConfig("network", "http://127.0.0.1:1/networks", ("subnet",))
    publisher = Publisher(
        PublisherConfig(
            dsn=feed_dsn, resources=(VM, network), retention=False, poll_interval=0.2, **TOKENS
        )
    )
    pool = await asyncpg.create_pool(feed_dsn, min_size=1, max_size=2)
    try:
        vms = KeysetQuery("vms", table=table, key="uuid", parse_id=uuid.UUID)
        route = BootstrapRoute("/vms", vms, pool, authorize=publisher.authorize_request)
        app = Starlette(routes=[*publisher.routes, *route.routes()], lifespan=publisher.lifespan)
        async with serve_app(app) as served, httpx.AsyncClient(base_url=served.url) as http:
            for path in ("/vms", f"/vms/{vm_id}"):
                refused = await http.get(path, headers=bearer(HASHED))
                assert refused.status_code == 403, (path, refused.text)
                assert refused.json()["error"]["code"] == "forbidden"
                answers = [refused, await http.get(path)]
                for token in (DNS, OPS):
                    answers.append(await http.get(path, headers=bearer(token)))
                assert [a.status_code for a in answers] == [403, 401, 200, 200], path
                # What a token may read is for that token only, as on /changefeeds.
                for answer in answers:
                    assert answer.headers["Cache-Control"] == "no-store", path
                    assert answer.headers["X-Content-Type-Options"] == "nosniff", path
            listed = await http.get("/vms", headers=bearer(DNS))
            assert [item["uuid"] for item in listed.json()["items"]] == [str(vm_id)]
        # Behind a proxy that strips a prefix (uvicorn --root-path /api), and with a
        # Host header that is not a host: the path the check reads is the one routed,
        # never one a client writes (a token allowed only ``network`` read every VM).
        async with (
            serve_app(app, root_path="/api") as served,
            httpx.AsyncClient(base_url=served.url) as http,
        ):
            for headers in (bearer(HASHED), {**bearer(HASHED), "Host": "x/y?"}):
                refused = await http.get(f"/vms/{vm_id}", headers=headers)
                assert refused.status_code in (400, 403), (headers, refused.text)
            assert (await http.get("/vms", headers=bearer(DNS))).status_code == 200
        # A route given as an absolute URL counts by its path; a path no bootstrap
        # route serves needs a known token only, unless a bootstrap route asks: it
        # reads a resource, and one no check can name is refused.

        def request(path: str, token: str, **scope: Any) -> Any:
            from starlette.requests import Request

            headers = [(b"authorization", f"Bearer {token}".encode())]
            return Request(
                {"type": "http", "headers": headers, "path": path, "client": None, **scope}
            )

        assert await publisher.authorize_request(request("/networks/n1", HASHED))
        assert not await publisher.authorize_request(request("/networks/n1", DNS))
        assert await publisher.authorize_request(request("/version", HASHED))
        assert await publisher.authorize_request(request("/vmsx", HASHED))  # not under /vms
        assert not await publisher.authorize_request(request("/api/vms", HASHED, root_path="/api"))
        unnamed = request("/things", OPS, state={BOOTSTRAP_ROUTE_STATE: "/things"})
        outcome = await publisher.authorize_request(unnamed)
        assert isinstance(outcome, AccessDenied) and outcome.code == "forbidden", outcome
        assert "resource=" in outcome.message
    finally:
        await pool.close()


def test_the_page_token_key_is_known_once_the_publisher_has_read_its_feed() -> None:
    from changefeed.bootstrap import TokenKeyUnavailable

    publisher = Publisher(PublisherConfig(dsn="postgresql://127.0.0.1:9/x", resources=(VM,)))
    with pytest.raises(TokenKeyUnavailable):
        publisher.page_token_key()


def test_the_resource_a_path_reads_is_the_longest_bootstrap_route_serving_it() -> None:
    routes = [
        ("vm", "/vms"),
        ("nic", "/vms/nics"),
        ("network", "https://net.example/networks/"),
        ("vm-audit", "/vms"),
    ]
    assert resources_served_at("/vms", routes) == ["vm", "vm-audit"]  # a shared route
    assert resources_served_at("/vms/42", routes) == ["vm", "vm-audit"]
    assert resources_served_at("/vms/nics/7", routes) == ["nic"]
    assert resources_served_at("/networks", routes) == ["network"]
    assert resources_served_at("/vmsx", routes) == []
    assert resources_served_at("/", [("all", "/")]) == ["all"]
    assert resources_served_at("/anything", [("all", "/")]) == ["all"]


@pytest.mark.parametrize("answer", [True, "vm", [1, 2], {"vm": 1}.keys() | {3}, {"vm": False}])
async def test_an_authorizer_answering_nonsense_is_unavailable_never_a_grant(answer: Any) -> None:
    """A bare string would otherwise read as its letters, and a bool would crash
    the route: a broken authorizer is an outage (503, 4010), never a grant."""
    from changefeed.publisher.auth import BearerAuth

    async def authorize(token: str) -> Any:
        return answer

    auth = BearerAuth((), {}, authorize)
    denied = await auth.check("Bearer anyone", any_of=("vm",))
    assert isinstance(denied, AccessDenied) and denied.code == "unavailable"


async def test_a_request_cancelled_while_its_authorizer_runs_stays_cancelled() -> None:
    """Only a ``CancelledError`` the authorizer raises of its own is an outage: the
    request's own cancellation (a client gone, a server shutting down) goes on as one."""
    from changefeed.publisher.auth import BearerAuth

    asked = asyncio.Event()

    async def authorize(token: str) -> Any:
        asked.set()
        await asyncio.Event().wait()

    auth = BearerAuth((), {}, authorize)
    checking = asyncio.create_task(auth.check("Bearer anyone", any_of=("vm",)))
    async with asyncio.timeout(10):
        await asked.wait()
        checking.cancel()
        with pytest.raises(asyncio.CancelledError):
            await checking


async def test_a_route_two_resources_share_lets_in_a_token_allowed_either() -> None:
    from changefeed.publisher.auth import BearerAuth

    auth = BearerAuth((), {"v": ("vm",), "n": ("network",), "d": ("disk",)})
    assert await auth.check("Bearer v", any_of=("vm", "network"))
    assert await auth.check("Bearer n", any_of=("vm", "network"))
    refused = await auth.check("Bearer d", any_of=("vm", "network"))
    assert isinstance(refused, AccessDenied) and refused.code == "forbidden"
    assert "vm" in refused.message
    unknown = await auth.check("Bearer x", any_of=("vm",))
    assert isinstance(unknown, AccessDenied) and unknown.code == "unauthorized"


Authorize = Callable[[str], Awaitable[frozenset[str] | None]]


async def _with_authorizer(dsn: str, authorize: Authorize) -> Any:
    from servers import serve_app

    publisher = Publisher(
        PublisherConfig(dsn=dsn, resources=(VM,), retention=False, poll_interval=0.2),
        authorize=authorize,
    )
    app = Starlette(routes=publisher.routes, lifespan=publisher.lifespan)
    return publisher, serve_app(app)


async def test_a_pluggable_authorizer_decides_and_its_failures_are_retryable(
    feed_dsn: str,
) -> None:
    calls: list[str] = []

    async def authorize(token: str) -> frozenset[str] | None:
        calls.append(token)
        if token == "broken":
            raise RuntimeError("identity service down")
        if token == "slow":
            await asyncio.sleep(30)
        return frozenset({"vm"}) if token == "good" else None

    publisher, serving = await _with_authorizer(feed_dsn, authorize)
    async with serving as server, httpx.AsyncClient(base_url=server.url) as http:
        await asyncio.wait_for(publisher.tailer.ready.wait(), 10)
        url = server.ws_url + "/changefeeds"
        ws, ack = await register(url, registration(), additional_headers=bearer("good"))
        assert ack["bootstrapRoute"] == "/vms"
        with pytest.raises(InvalidStatus) as refused:
            await connect(url, additional_headers=bearer("bad"))
        assert refused.value.response.status_code == 401
        # An authorizer that fails is "unavailable" (4010, retry), never "unauthorized".
        code, error = await refused_after_handshake(url, bearer("broken"))
        assert code == CloseCode.UNAVAILABLE and error["code"] == "unavailable"
        response = await http.get("/changefeeds", headers=bearer("broken"))
        assert response.status_code == 503
        assert (await http.get("/changefeeds", headers=bearer("good"))).status_code == 200
        assert calls.count("good") == 2
        await write(feed_dsn, [("vm", ["nic"], "still-delivered")])
        (item,) = await receive_items(ws, 1)
        assert item["changedResourceId"] == "still-delivered"
        await ws.close()


async def test_without_the_denial_extension_the_refusal_is_an_error_frame_and_4003(
    feed_dsn: str,
) -> None:
    """Servers without the ASGI websocket denial response get the frame form."""
    from servers import serve_app

    publisher = Publisher(
        PublisherConfig(dsn=feed_dsn, resources=(VM,), retention=False, auth_tokens=(OPS,))
    )
    inner = Starlette(routes=publisher.routes, lifespan=publisher.lifespan)

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "websocket":
            scope = {**scope, "extensions": {}}
        await inner(scope, receive, send)

    async with serve_app(app) as server:
        await asyncio.wait_for(publisher.tailer.ready.wait(), 10)
        ws = await connect(server.ws_url + "/changefeeds")
        error = orjson.loads(await asyncio.wait_for(ws.recv(), 5))
        assert error["error"]["code"] == "unauthorized"
        with pytest.raises(ConnectionClosed) as closed:
            await asyncio.wait_for(ws.recv(), 5)
        assert closed.value.rcvd is not None
        assert closed.value.rcvd.code == CloseCode.UNAUTHORIZED
        await wait_until(lambda: publisher.connections == 0)


def test_token_config_from_toml_and_its_errors(tmp_path: Path) -> None:
    digest = hashlib.sha256(b"secret").hexdigest()
    path = tmp_path / "changefeed.toml"
    path.write_text(
        f"""
[publisher]
dsn = "postgresql://postgres@127.0.0.1/postgres"
auth_tokens = ["ops"]

[publisher.token_resources]
dns = ["vm"]
"sha256:{digest}" = ["vm", "network"]

[[resources]]
name = "vm"
bootstrap_route = "/vms"

[[resources]]
name = "network"
bootstrap_route = "/networks"
"""
    )
    config = load_config(path)
    assert config.auth_tokens == ("ops",)
    assert config.token_resources == {"dns": ("vm",), f"sha256:{digest}": ("vm", "network")}
    for bad, message in (
        ({"token_resources": {"dns": ("disk",)}}, "unknown resource 'disk'"),
        ({"token_resources": {"ops": ("vm",)}, "auth_tokens": ("ops",)}, "in auth_tokens too"),
        ({"auth_tokens": ("sha256:abc",)}, "64 hex digits"),
        ({"auth_tokens": ("two words",)}, "without whitespace"),
    ):
        with pytest.raises(ConfigError, match=message):
            PublisherConfig(resources=(VM,), **bad)


@pytest.mark.parametrize(
    ("header", "basic", "token"),
    [
        ("Bearer abc", False, "abc"),
        ("bearer  abc ", True, "abc"),
        ("Basic " + base64.b64encode(b"anyone:abc").decode(), True, "abc"),
        ("Basic " + base64.b64encode(b":abc:with:colons").decode(), True, "abc:with:colons"),
        ("Basic " + base64.b64encode(b"anyone:abc").decode(), False, None),  # not asked for
        ("Basic " + base64.b64encode(b"anyone:").decode(), True, None),  # no password
        ("Basic " + base64.b64encode(b"no colon").decode(), True, None),
        ("Basic " + base64.b64encode(b"u:\xff").decode(), True, None),  # not UTF-8
        ("Basic not*base64", True, None),
        ("Basic ops-token-all-resources", True, None),
        ("Bearer", True, None),
        ("", True, None),
        ("Digest abc", True, None),
    ],
)
def test_the_token_is_the_bearer_credential_or_when_asked_the_basic_password(
    header: str, basic: bool, token: str | None
) -> None:
    assert presented_token(header, basic=basic) == token


# -- one decision for every route: unavailable, unauthorized, forbidden ------------

OUTAGE_PATHS = (
    "/changefeeds",
    "/changefeeds/stats",
    "/changefeeds/dashboard",
    "/vms",
    "/vms/6a3e5d8e-3f4b-4a39-9a53-1b7f2a1d0c11",
    "/servers",
)
"""Every HTTP route behind the token: the publisher's and the example API's bootstrap
routes (built with ``authorize=publisher.authorize_request``)."""


def _outage_authorizer(outage: str, calls: list[str]) -> Authorize:
    """``good`` may read everything; any other token finds the identity service down:
    it raises, it never answers (the publisher's own bounded wait decides), it
    is broken and answers what no authorizer may (``True``), or a call inside it
    was cancelled by something else (``CancelledError`` while the request's task
    was not cancelled: an outage too, not a cancelled request)."""
    never = asyncio.Event()

    async def authorize(token: str) -> Any:
        calls.append(token)
        if token == "good":
            return frozenset({"*"})
        if outage == "raises":
            raise ConnectionError("identity service down")
        if outage == "broken":
            return True
        if outage == "cancelled":
            raise asyncio.CancelledError("a call to the identity service was cancelled")
        await never.wait()
        return None

    return authorize


async def refused_after_handshake(
    url: str, headers: dict[str, str]
) -> tuple[int | None, dict[str, Any]]:
    """Connect as a plain websocket client would, and read what the publisher says before
    it closes: the close code and the error frame (validated against its schema)."""
    async with asyncio.timeout(30):  # a hanging authorizer is given 5 s
        async with connect(url, additional_headers=headers) as ws:
            body = orjson.loads(await ws.recv())
            with pytest.raises(ConnectionClosed):
                await ws.recv()
    validate("error", body)
    return ws.close_code, body["error"]


@pytest.mark.parametrize("outage", ["raises", "hangs", "broken", "cancelled"])
async def test_an_authorizer_outage_is_503_or_4010_with_retry_after_on_every_route(
    dsn: str, outage: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Never 401 (which makes listeners give up for good): 503, ``Retry-After`` and the
    error body ``unavailable`` with ``retryAfter`` on the publisher's routes and the
    API's bootstrap and write routes alike, and on the websocket the same error frame
    and close 4010 (not an HTTP 503 at the handshake, which a browser's websocket
    cannot read). The authorizer's error is logged with its traceback; its deadline
    passing, with none."""
    from test_listener_support import VmApiServer

    caplog.set_level(logging.ERROR, logger="changefeed")
    calls: list[str] = []
    authorize = _outage_authorizer(outage, calls)
    async with (
        VmApiServer(dsn, authorize=authorize) as api,
        httpx.AsyncClient(base_url=api.url, timeout=30) as http,
    ):
        headers = bearer("anyone")

        async with asyncio.timeout(30):  # a hanging authorizer is given 5 s, all at once
            responses, refused = await asyncio.gather(
                asyncio.gather(
                    *(http.get(path, headers=headers) for path in OUTAGE_PATHS),
                    http.post("/vms", headers=headers, json={"alias": "x"}),
                ),
                refused_after_handshake(api.ws_url, headers),
            )
        for path, response in zip((*OUTAGE_PATHS, "POST /vms"), responses, strict=True):
            assert response.status_code == 503, (path, response.text)
            assert response.headers["Retry-After"] == "1", path
            if path != "/changefeeds/dashboard":  # the page answers in text
                assert response.json()["error"] == {
                    "code": "unavailable",
                    "message": "authorization is unavailable; retry later",
                    "retryAfter": 1,
                }, path
        answered = len(responses) + 1
        close_code, error = refused
        assert close_code == CloseCode.UNAVAILABLE
        assert error == {
            "code": "unavailable",
            "message": "authorization is unavailable; retry later",
            "retryAfter": 1,
        }
        publisher = api.app.state.publisher
        assert publisher.stats()["counters"]["refused"] == {"unavailable": answered}
        # The same token once the service answers again: let in.
        assert (await http.get("/vms", headers=bearer("good"))).status_code == 200
    assert calls.count("anyone") == answered
    logged = [r for r in caplog.records if r.getMessage() == "auth.unavailable"]
    assert len(logged) == answered
    for record in logged:
        if outage != "hangs":
            assert record.exc_info is not None
            shown = "".join(traceback.format_exception(*record.exc_info))
            assert {
                "raises": "identity service down",
                "broken": "returned True",
                "cancelled": "a call to the identity service was cancelled",
            }[outage] in shown
        else:
            assert record.exc_info is None


async def test_without_the_denial_extension_an_outage_is_4010_with_retry_after(
    feed_dsn: str,
) -> None:
    """The frame form of the same refusal: error ``unavailable`` with ``retryAfter``
    (the delay the listener waits at least), close 4010."""
    from servers import serve_app

    publisher = Publisher(
        PublisherConfig(dsn=feed_dsn, resources=(VM,), retention=False),
        authorize=_outage_authorizer("raises", []),
    )
    inner = Starlette(routes=publisher.routes, lifespan=publisher.lifespan)

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "websocket":
            scope = {**scope, "extensions": {}}
        await inner(scope, receive, send)

    async with serve_app(app) as server:
        await asyncio.wait_for(publisher.tailer.ready.wait(), 10)
        ws = await connect(server.ws_url + "/changefeeds", additional_headers=bearer("anyone"))
        error = orjson.loads(await asyncio.wait_for(ws.recv(), 5))
        assert error["error"]["code"] == "unavailable" and error["error"]["retryAfter"] == 1
        with pytest.raises(ConnectionClosed) as closed:
            await asyncio.wait_for(ws.recv(), 5)
        assert closed.value.rcvd is not None
        assert closed.value.rcvd.code == CloseCode.UNAVAILABLE


async def test_a_token_not_allowed_the_resource_is_forbidden_on_every_route(dsn: str) -> None:
    """403 ``forbidden`` (4004 on the websocket) wherever a known token asks for a resource
    it may not read, bootstrap routes included (not 401, the answer for a token nobody
    knows); 401 stays for that."""
    from test_listener_support import VmApiServer

    async def authorize(token: str) -> frozenset[str] | None:
        return frozenset({"server"}) if token == "servers-only" else None

    async with (
        VmApiServer(dsn, authorize=authorize) as api,
        httpx.AsyncClient(base_url=api.url, headers=bearer("servers-only")) as http,
    ):
        for method, path in [
            ("GET", "/vms"),
            ("GET", "/vms/6a3e5d8e-3f4b-4a39-9a53-1b7f2a1d0c11"),
            ("POST", "/vms"),
            ("GET", "/changefeeds/stats?resource=vm"),
        ]:
            response = await http.request(method, path, json={} if method == "POST" else None)
            assert response.status_code == 403, (method, path, response.text)
            assert response.json()["error"]["code"] == "forbidden"
            assert "Retry-After" not in response.headers
        assert (await http.get("/servers")).status_code == 200
        unknown = await http.get("/vms", headers=bearer("nobody"))
        assert unknown.status_code == 401 and unknown.headers["WWW-Authenticate"] == "Bearer"
        ws, error = await register(
            api.ws_url, registration(), additional_headers=bearer("servers-only")
        )
        assert error["error"]["code"] == "forbidden"
        with pytest.raises(ConnectionClosed) as closed:
            await asyncio.wait_for(ws.recv(), 5)
        assert closed.value.rcvd is not None and closed.value.rcvd.code == CloseCode.FORBIDDEN
        refused = api.app.state.publisher.stats()["counters"]["refused"]
        assert refused == {"forbidden": 5, "unauthorized": 1}


async def test_a_listener_waits_out_an_authorizer_outage_and_then_goes_live(dsn: str) -> None:
    """The identity service is down when the listener first connects (4010 with
    ``retryAfter: 1``) and again for its first bootstrap page (503 there):
    it keeps its registration going, waits at least the ``Retry-After``, and goes
    live once the service answers."""
    from test_listener import make_listener, next_event, seed_vms
    from test_listener_support import VmApiServer, capture_events

    from changefeed.listener import Resynced

    failing = {"handshake": 1, "bootstrap": 1}
    registered = asyncio.Event()

    async def authorize(token: str) -> frozenset[str] | None:
        step = "bootstrap" if registered.is_set() else "handshake"
        if failing[step]:
            failing[step] -= 1
            raise ConnectionError("identity service down")
        if step == "handshake":
            registered.set()  # the next call is for the bootstrap route
        return frozenset({"vm"})

    async with VmApiServer(dsn, authorize=authorize) as api:
        await seed_vms(dsn, 3)
        with capture_events() as events:
            async with make_listener(api.ws_url, token="t") as listener:
                event = await next_event(listener, timeout=30)
                assert isinstance(event, Resynced) and len(event.items) == 3
        aborted = events.named("listener.aborted")
        assert [a["disposition"] for a in aborted] == ["retry"]
        assert aborted[0]["retry_after"] == 1.0
        assert events.named("listener.backoff")[0]["delay"] >= 1.0
        retried = events.named("bootstrap.retry")
        assert retried and "HTTP 503" in retried[0]["error"] and retried[0]["delay"] >= 1.0
    assert failing == {"handshake": 0, "bootstrap": 0}


@pytest.mark.parametrize(
    ("revoked", "code"), [(None, "http_401"), (frozenset({"server"}), "http_403")]
)
async def test_a_listener_stops_when_the_bootstrap_route_refuses_its_token(
    dsn: str, revoked: frozenset[str] | None, code: str
) -> None:
    """Registered with a good token, which is then revoked (401) or loses the resource
    (403) before the bootstrap: the listener stops for good, after one attempt, with
    ``RegistrationRefused``."""
    from test_listener import make_listener, next_event
    from test_listener_support import VmApiServer

    from changefeed.listener import RegistrationRefused

    registered = asyncio.Event()

    async def authorize(token: str) -> frozenset[str] | None:
        if registered.is_set():
            return revoked
        registered.set()
        return frozenset({"vm", "server"})

    async with VmApiServer(dsn, authorize=authorize) as api:
        async with make_listener(api.ws_url, token="t") as listener:
            with pytest.raises(RegistrationRefused) as refused:
                await next_event(listener, timeout=20)
        assert refused.value.code == code
        assert listener.status().attempts == 1
