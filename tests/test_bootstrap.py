"""changefeed.bootstrap: page tokens, keyset SQL, admission control, the route and the Pager.

Pure parts are tested directly; routes run on real uvicorn on 127.0.0.1
against real PostgreSQL (a fresh database per test). Failures are injected
by tiny inline apps, by stopping a real server, and by real table locks.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hmac
import logging
import random
import re
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from datetime import UTC, datetime
from typing import Any

import asyncpg
import httpx
import orjson
import pytest
from helpers import free_port, wait_until
from hypothesis import given, settings
from hypothesis import strategies as st
from servers import serve_app
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from changefeed import bootstrap
from changefeed.bootstrap import (
    Admission,
    BootstrapConfigError,
    BootstrapError,
    BootstrapRoute,
    Filter,
    KeysetQuery,
    Pager,
    PageRequest,
    PageRequestError,
    PagerProgress,
    PageToken,
    PageTokenCodec,
    PageTokenError,
    PagingError,
    QuerySlots,
    TokenKeyUnavailable,
    WalkRefused,
    WalkTable,
    error_response,
    fetch_many,
    fetch_one,
    fetchable_by_path,
)
from changefeed.bootstrap import pager as pager_module

ROWS = 50

# --------------------------------------------------------------------------- exports


def test_public_names() -> None:
    for name in ("Pager", "PagerProgress", "fetch_one", "fetch_many", "BootstrapError"):
        assert name in bootstrap.__all__
    assert all(hasattr(bootstrap, name) for name in bootstrap.__all__)
    for exc in (BootstrapConfigError, PageRequestError, PageTokenError, PagingError):
        assert issubclass(exc, BootstrapError)


# --------------------------------------------------------------------------- tokens

KEY_VALUES = st.one_of(
    st.integers(min_value=-(2**63), max_value=2**63 - 1),
    st.text(max_size=40),
    st.uuids(),
    st.datetimes(timezones=st.just(UTC)),
)


@settings(deadline=None)  # pure and fast, but the machine may be busy
@given(walk=st.text(alphabet="0123456789abcdef", min_size=1, max_size=12), key=KEY_VALUES)
def test_token_round_trip(walk: str, key: Any) -> None:
    codec = PageTokenCodec("items")
    token = codec.encode(walk, (key,))
    assert token.isascii() and "=" not in token
    decoded = codec.decode(token)
    assert decoded.walk == walk
    assert decoded.key == (key,)
    assert type(decoded.key[0]) is type(key)


def test_token_composite_key() -> None:
    codec = PageTokenCodec("items", key_length=2)
    when = datetime(2026, 11, 21, 23, 0, tzinfo=UTC)
    assert codec.decode(codec.encode("w", (when, 7))).key == (when, 7)
    with pytest.raises(BootstrapConfigError):
        codec.encode("w", (7,))


def test_token_refuses_unsupported_key_types() -> None:
    with pytest.raises(BootstrapConfigError):
        PageTokenCodec("items").encode("w", (True,))
    with pytest.raises(BootstrapConfigError):
        PageTokenCodec("items").encode("w", (1.5,))


def test_a_key_too_long_for_a_token_is_refused_when_encoded_not_on_the_next_page() -> None:
    codec = PageTokenCodec("items")
    fits = codec.encode("w", ("x" * 1400,))
    assert codec.decode(fits).key == ("x" * 1400,)
    with pytest.raises(BootstrapConfigError, match="over the 2048 a route accepts"):
        codec.encode("w", ("x" * 1600,))


def test_token_tampering_is_refused() -> None:
    codec = PageTokenCodec("items")
    token = codec.encode("abc", (12345,))
    alphabet = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_"
    for i, char in enumerate(token):
        for other in (
            alphabet[(alphabet.index(char) + 1) % 64],
            alphabet[(alphabet.index(char) + 7) % 64],
        ):
            edited = token[:i] + other + token[i + 1 :]
            with pytest.raises(PageTokenError):
                codec.decode(edited)
    for bad in ("", "x", token[:-1], token + "A", "!" * 20, "a" * 5000):
        with pytest.raises(PageTokenError):
            codec.decode(bad)
    with pytest.raises(PageTokenError, match="checksum"):
        PageTokenCodec("nics").decode(token)  # another route's token
    with pytest.raises(PageTokenError, match="checksum"):
        PageTokenCodec("items", key=b"other").decode(token)


def test_a_token_says_when_it_was_issued_and_a_first_version_one_is_read_as_untimed() -> None:
    codec = PageTokenCodec("items", key=b"k" * 32, clock=lambda: 1_800_000_000.7)
    assert codec.decode(codec.encode("w", (5,))).issued == 1_800_000_000
    # A token of the first version ([walk, key...], no time), as a publisher of that
    # version issues it: still read, as a token that does not say when.
    body = b"\x01" + orjson.dumps(["w", ["i", 5]])
    mac = hmac.new(b"k" * 32, len(b"items").to_bytes(2, "big") + b"items" + body, "blake2b")
    first = base64.urlsafe_b64encode(body + mac.digest()[:10]).rstrip(b"=").decode()
    assert codec.decode(first) == PageToken("w", (5,), None)
    for issued in ("x", True, 1.5, None):  # signed, but not a time: refused
        body = b"\x02" + orjson.dumps(["w", issued, ["i", 5]])
        mac = hmac.new(b"k" * 32, len(b"items").to_bytes(2, "big") + b"items" + body, "blake2b")
        bad = base64.urlsafe_b64encode(body + mac.digest()[:10]).rstrip(b"=").decode()
        with pytest.raises(PageTokenError, match="issue time"):
            codec.decode(bad)


def test_no_token_key_is_a_known_one() -> None:
    """Tokens were signed with a key anyone could read in the source, so anyone could
    mint continuations (walks the admission cap never counts). Without a key a codec
    makes its own: no other accepts its tokens. A key given as a callable is asked
    for each token, and one not known yet says so."""
    token = PageTokenCodec("items").encode("w", (5,))
    with pytest.raises(PageTokenError, match="checksum"):
        PageTokenCodec("items").decode(token)
    keys: list[bytes] = []

    def key() -> bytes:
        if not keys:
            raise TokenKeyUnavailable("not started")
        return keys[0]

    later = PageTokenCodec("items", key=key)
    with pytest.raises(TokenKeyUnavailable):
        later.encode("w", (5,))
    keys.append(b"k" * 32)
    assert later.decode(PageTokenCodec("items", key=b"k" * 32).encode("w", (5,))).key == (5,)


async def test_a_walk_goes_on_through_another_publisher_instance_and_forged_tokens_fail(
    dsn: str,
) -> None:
    """The example API's routes sign their page tokens with the publisher's
    ``page_token_key``: derived from the feed's key, the same on every instance (a
    walk behind a load balancer goes on wherever its next page lands), and known to
    nobody else (the old public key forges nothing)."""
    from test_listener_support import VmApiServer, create_vms

    async with (
        VmApiServer(dsn) as first,
        VmApiServer(dsn) as second,
        httpx.AsyncClient(base_url=first.url) as client,
    ):
        created = await create_vms(client, 5)
        status, page = await get_json(client, "/vms?limit=2")
        assert status == 200 and page["next"]
        async with httpx.AsyncClient(base_url=second.url) as other:
            status, rest = await get_json(other, page["next"])
            assert status == 200, rest
            seen = [vm["uuid"] for vm in page["items"] + rest["items"]]
            assert len(seen) == 4 and len(set(seen)) == 4 and set(seen) <= set(created)
        forged = PageTokenCodec("vms", key=b"changefeed-page-v1").encode("w", (uuid.uuid4(),))
        status, body = await get_json(client, f"/vms?limit=2&after={forged}")
        assert status == 400 and "checksum" in body["error"]["message"], body


# --------------------------------------------------------------------------- keyset query


def items_query(**kwargs: Any) -> KeysetQuery:
    options: dict[str, Any] = {
        "table": "public.items",
        "key": "id",
        "filters": {"grp": Filter("grp", int)},
        "parse_id": int,
        "default_limit": 10,
        "max_limit": 20,
        "max_ids": 5,
    }
    options.update(kwargs)
    return KeysetQuery("items", **options)


def test_identifiers_are_validated() -> None:
    for bad in ("items; DROP TABLE x", 'it"ems', "a.b.c", "1items", ""):
        with pytest.raises(BootstrapConfigError):
            items_query(table=bad)
    with pytest.raises(BootstrapConfigError):
        items_query(key="id desc")
    with pytest.raises(BootstrapConfigError):
        items_query(filters={"limit": "grp"})
    with pytest.raises(BootstrapConfigError):
        items_query(filters={"g": "grp; --"})
    with pytest.raises(BootstrapConfigError):
        items_query(default_limit=50)
    with pytest.raises(BootstrapConfigError):
        items_query(query="SELECT 1")  # both table and query
    with pytest.raises(BootstrapConfigError):
        items_query(columns=("name",))  # key not selected
    composite = KeysetQuery("c", table="t", key=("a", "b"))
    with pytest.raises(BootstrapConfigError):
        BootstrapRoute("/c", composite, lambda: None).routes()  # type: ignore[arg-type,return-value]
    assert len(BootstrapRoute("/c", composite, lambda: None).routes(item=False)) == 1  # type: ignore[arg-type,return-value]


def test_page_sql_is_keyset_with_bind_parameters() -> None:
    query = items_query()
    first = query.page_sql((), after=False)
    assert first == 'SELECT * FROM "public"."items" AS source ORDER BY "id" LIMIT $1'
    later = query.page_sql(("grp",), after=True)
    assert later == (
        'SELECT * FROM "public"."items" AS source WHERE "grp" = $1 AND "id" > $2'
        ' ORDER BY "id" LIMIT $3'
    )
    composite = KeysetQuery("c", query="SELECT * FROM t", key=("a", "b"), id_column="b")
    assert '("a", "b") > ($1, $2)' in composite.page_sql((), after=True)
    assert "OFFSET" not in first + later
    listed = items_query(columns=("id", "name")).page_sql((), after=False)
    assert listed.startswith('SELECT "id", "name" FROM')


def test_parse_request() -> None:
    query = items_query()
    assert query.parse_request([]) == PageRequest(10)
    assert query.parse_request([("limit", "3")]) == PageRequest(3)
    assert query.parse_request([("limit", "1000")]).limit == 20  # type: ignore[union-attr]
    parsed = query.parse_request([("grp", "2"), ("limit", "5")])
    assert isinstance(parsed, PageRequest)
    assert parsed.filters == (("grp", 2),)
    token = query.tokens.encode("w1", (42,))
    parsed = query.parse_request([("after", token)])
    assert isinstance(parsed, PageRequest) and parsed.after == (42,) and parsed.walk == "w1"
    link = query.next_link("/items", PageRequest(5, filter_text=(("grp", "2"),)), "w1", (42,))
    assert link == f"/items?limit=5&after={token}&grp=2"

    bad = [
        [("limit", "0")],
        [("limit", "-1")],
        [("limit", "ten")],
        [("limit", "1e3")],
        [("limit", "")],
        [("limit", "1"), ("limit", "2")],
        [("offset", "10")],
        [("after", "garbage")],
        [("grp", "two")],
        [("ids", "1,2"), ("after", token)],
        [("ids", "")],
        [("ids", "1,,2")],
        [("ids", "1,2,3,4,5,6")],
        [("ids", "1,x")],
        [("grp", "2\x00")],
        [("ids", "1,\x002")],
    ]
    for params in bad:
        with pytest.raises(PageRequestError):
            query.parse_request(params)
    batch = query.parse_request([("ids", "3,1,3")])
    assert isinstance(batch, bootstrap.BatchRequest) and batch.ids == (3, 1)


# --------------------------------------------------------------------------- admission (pure)


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_walk_table_caps_new_walks_only() -> None:
    clock = FakeClock()
    walks = WalkTable(2, idle_timeout=30.0, clock=clock)
    a, b = walks.start(), walks.start()
    assert a and b and a != b
    assert walks.start() is None and walks.refused == 1
    walks.touch(a)  # continuations are admitted at the cap
    walks.touch("from-another-process")
    assert len(walks) == 3
    walks.finish(a)
    walks.finish("from-another-process")
    assert len(walks) == 1 and walks.finished == 2
    assert walks.start() is not None  # b and the new one
    assert walks.start() is None and walks.refused == 2
    walks.abandon(b)
    assert len(walks) == 1 and walks.started == 2


def test_walk_table_forgets_idle_walks() -> None:
    clock = FakeClock()
    walks = WalkTable(1, idle_timeout=30.0, clock=clock)
    a = walks.start()
    assert a is not None and walks.start() is None
    clock.now = 29.0
    walks.touch(a)
    clock.now = 58.0
    assert walks.start() is None  # touched at 29: still active
    clock.now = 59.5
    assert walks.start() is not None
    assert walks.expired == 1


def test_a_continuation_whose_walk_every_process_forgot_is_admitted_as_a_new_walk() -> None:
    """A client that keeps continuation tokens aside opens no walk the cap does not
    count. A continuation of a walk this process does not know is taken as one only
    while its token is recent (the walk began on another instance); an older one is
    a new walk, under the cap."""
    clock, wall = FakeClock(), FakeClock()
    wall.now = 1_800_000_000.0
    admission = Admission(max_walks=1, walk_idle_timeout=30.0, clock=clock, wall_clock=wall)
    mine, new = admission.admit(None)
    assert new
    issued = int(wall.now)
    wall.now += 60.0  # a token kept for a minute: still this process's walk, in progress
    clock.now += 20.0
    assert admission.admit(mine, issued=issued) == (mine, False)
    # Another instance's walk, token issued 10 s ago: admitted as that walk, at the cap.
    assert admission.admit("theirs", issued=int(wall.now) - 10) == ("theirs", False)
    # A token from long ago, of the first version (which says nothing), or dated
    # ahead, of a walk no process knows any more: a new walk, refused at the cap.
    for stale in (int(wall.now) - 3600, None, int(wall.now) + 3600):
        with pytest.raises(WalkRefused):
            admission.admit("hoarded", issued=stale)
    admission.served(mine, last=True)
    admission.served("theirs", last=True)
    walk, new = admission.admit("hoarded", issued=None)
    assert new and walk != "hoarded"  # counted from here, under its own id


def test_the_tokens_of_a_walk_that_ended_here_do_not_bring_it_back_uncounted() -> None:
    """A walk that finished, or idled out, leaves tokens that still look recent for
    a while: taken up again, it is a new walk, under the cap, not the old one."""
    clock, wall = FakeClock(), FakeClock()
    wall.now = 1_800_000_000.0
    admission = Admission(max_walks=1, walk_idle_timeout=30.0, clock=clock, wall_clock=wall)
    short, _ = admission.admit(None)
    kept = int(wall.now)  # the token of its first page, kept aside
    admission.served(short, last=True)  # its second page was its last
    idle, _ = admission.admit(None)  # the one walk the cap allows
    clock.now = wall.now - 1_800_000_000.0 + 5.0
    with pytest.raises(WalkRefused):
        admission.admit(short, issued=kept)  # ended here 5 s ago: a new walk, refused
    clock.now += 25.0  # the idle walk is forgotten at 30 s; its token was issued at 0
    wall.now += 30.0
    assert idle not in admission.walks
    again, new = admission.admit(idle, issued=kept)
    assert new and again != idle  # the idled-out walk comes back counted
    with pytest.raises(WalkRefused):
        admission.admit(short, issued=kept)


async def test_query_slots_hand_over_and_time_out() -> None:
    slots = QuerySlots(1)
    assert await slots.acquire(0.01)
    assert not await slots.acquire(0.01)  # bounded wait, refused
    assert slots.waiting == 0
    waiter = asyncio.create_task(slots.acquire(5.0))
    await wait_until(lambda: slots.waiting == 1)
    slots.release()
    assert await waiter  # handed over, not re-counted
    assert slots.active == 1
    cancelled = asyncio.create_task(slots.acquire(5.0))
    await wait_until(lambda: slots.waiting == 1)
    cancelled.cancel()
    with pytest.raises(asyncio.CancelledError):
        await cancelled
    assert slots.waiting == 0
    slots.release()
    assert slots.active == 0


# --------------------------------------------------------------------------- real routes


async def create_items(dsn: str, rows: int = ROWS) -> None:
    conn = await asyncpg.connect(dsn)
    try:
        await conn.execute(
            "CREATE TABLE items (id int PRIMARY KEY, name text NOT NULL, grp int NOT NULL)"
        )
        await conn.execute(
            "INSERT INTO items SELECT i, 'item ' || i, i % 3 FROM generate_series(1, $1) AS i",
            rows,
        )
    finally:
        await conn.close()


@contextlib.asynccontextmanager
async def items_server(
    dsn: str,
    *,
    admission: Admission | None = None,
    authorize: Callable[[Request], Awaitable[bool]] | None = None,
    wrap: Callable[[BootstrapRoute], list[Route]] | None = None,
    query: KeysetQuery | None = None,
    authorize_timeout: float = 10.0,
) -> AsyncIterator[tuple[str, BootstrapRoute]]:
    """The ``items`` table as ``/items`` on a real server; yields (base URL, route)."""
    async with asyncpg.create_pool(dsn, min_size=1, max_size=4) as pool:
        route = BootstrapRoute(
            "/items",
            query or items_query(),
            pool,
            admission=admission or Admission(max_walks=None),
            authorize=authorize,
            authorize_timeout=authorize_timeout,
        )
        app = Starlette(routes=wrap(route) if wrap else route.routes())
        async with serve_app(app) as server:
            yield server.url, route


async def get_json(client: httpx.AsyncClient, url: str) -> tuple[int, Any]:
    response = await client.get(url)
    return response.status_code, orjson.loads(response.content)


async def test_pages_walk_the_table_in_key_order(dsn: str) -> None:
    await create_items(dsn, 49)
    async with items_server(dsn) as (url, _), httpx.AsyncClient(base_url=url) as client:
        status, page = await get_json(client, "/items?limit=7")
        assert status == 200
        assert [item["id"] for item in page["items"]] == list(range(1, 8))
        assert page["items"][0] == {"id": 1, "name": "item 1", "grp": 1}
        assert page["next"].startswith("/items?limit=7&after=")
        seen = [item["id"] for item in page["items"]]
        pages = 1
        while page["next"]:
            status, page = await get_json(client, page["next"])
            assert status == 200
            seen.extend(item["id"] for item in page["items"])
            pages += 1
        # 49 = 7 x 7: the last full page already says next = null (one row over-fetched).
        assert pages == 7 and seen == list(range(1, 50))
        status, page = await get_json(client, "/items")  # default limit
        assert len(page["items"]) == 10


async def test_filters_are_bound_and_kept_in_next(dsn: str) -> None:
    await create_items(dsn)
    async with items_server(dsn) as (url, _), httpx.AsyncClient(base_url=url) as client:
        status, page = await get_json(client, "/items?grp=2&limit=4")
        assert status == 200 and page["next"].endswith("&grp=2")
        ids: list[int] = []
        while True:
            assert all(item["grp"] == 2 for item in page["items"])
            ids.extend(item["id"] for item in page["items"])
            if not page["next"]:
                break
            _, page = await get_json(client, page["next"])
        assert ids == [i for i in range(1, ROWS + 1) if i % 3 == 2]
        # A filter value is a bind parameter: SQL in it is only a bad integer.
        status, body = await get_json(client, "/items?grp=1%20OR%201=1")
        assert status == 400 and body["error"]["code"] == "bad_request"


async def test_values_the_columns_refuse_are_400_and_a_plain_filter_compares_as_text(
    dsn: str,
) -> None:
    """A route built with the defaults over integer columns (ids parsed as text, a
    filter named by its column alone): an id the column refuses is a 400 with the
    error body (not a plain-text 500 the pager would retry), and a plain filter
    compares as text, so a good value matches."""
    await create_items(dsn)
    query = items_query(parse_id=str, filters={"grp": "grp"})
    async with (
        items_server(dsn, query=query) as (url, _),
        httpx.AsyncClient(base_url=url) as client,
    ):
        status, page = await get_json(client, "/items?grp=2&limit=20")
        assert status == 200 and page["items"] and all(i["grp"] == 2 for i in page["items"])
        for path in ("/items/abc", "/items?ids=abc"):
            response = await client.get(path)
            assert response.status_code == 400, (path, response.text)
            assert response.json()["error"]["code"] == "bad_request"
            assert response.headers["cache-control"] == "no-store"
        status, page = await get_json(client, "/items?limit=3")  # and it goes on serving
        assert status == 200 and len(page["items"]) == 3


async def test_a_route_that_breaks_answers_500_with_the_error_body_and_logs_why(
    dsn: str, caplog: pytest.LogCaptureFixture
) -> None:
    await create_items(dsn)
    query = items_query(table="public.no_such_table")
    async with (
        items_server(dsn, query=query) as (url, _),
        httpx.AsyncClient(base_url=url) as client,
    ):
        with caplog.at_level(logging.ERROR, "changefeed.bootstrap"):
            response = await client.get("/items?limit=3")
        assert response.status_code == 500
        assert response.json()["error"]["code"] == "internal"
        assert response.headers["x-content-type-options"] == "nosniff"
    (failed,) = [r for r in caplog.records if "bootstrap.failed" in r.getMessage()]
    assert failed.exc_info is not None  # with its traceback


async def test_an_id_that_is_not_one_path_segment_is_refused_not_misread() -> None:
    """``fetch_one`` refuses an id that is not one path segment: ``"."`` would fetch the
    list route (the page read as the item), and ``"a/b"`` a 404 read as a delete."""
    assert fetchable_by_path("vm-1") and fetchable_by_path("a b%")
    async with httpx.AsyncClient(base_url="http://127.0.0.1:9") as client:
        for odd in ("", ".", "..", "a/b"):
            assert not fetchable_by_path(odd)
            with pytest.raises(PagingError, match="fetch_many"):
                await fetch_one(client, "/vms", odd)


async def test_a_retry_after_that_is_not_ascii_digits_is_a_plain_retry() -> None:
    """``"²"`` passes ``str.isdigit`` but is no number: the pager retries as for a 503
    without the header, rather than fail with a ValueError. A real server on 127.0.0.1
    answers 503 with that header once, then the item."""
    calls = 0

    async def item(request: Request) -> Response:
        nonlocal calls
        calls += 1
        if calls == 1:
            response = Response(b"{}", 503, media_type="application/json")
            response.raw_headers.append((b"retry-after", "²".encode("latin-1")))
            return response
        return Response(b'{"uuid": "vm-1"}', 200, media_type="application/json")

    app = Starlette(routes=[Route("/vms/{id}", item)])
    async with serve_app(app) as server, httpx.AsyncClient(base_url=server.url) as client:
        assert await fetch_one(client, "/vms", "vm-1", max_wait=1.0) == {"uuid": "vm-1"}
    assert calls == 2


async def test_bad_requests_get_400_with_error_body(dsn: str) -> None:
    await create_items(dsn)
    async with items_server(dsn) as (url, route), httpx.AsyncClient(base_url=url) as client:
        _, page = await get_json(client, "/items?limit=5")
        token = page["next"].split("after=")[1]
        tampered = token[:-3] + ("AAA" if token[-3:] != "AAA" else "BBB")
        other = PageTokenCodec("other").encode("w", (5,))
        cases = {
            f"/items?after={tampered}": "after",
            f"/items?after={other}": "after",
            "/items?after=": "after",
            "/items?limit=0": "limit",
            "/items?limit=-5": "limit",
            "/items?limit=abc": "limit",
            "/items?limit=+5": "limit",
            "/items?limit=10000000000": "9 digits",
            "/items?limit=5&limit=6": "limit",
            "/items?offset=5": "offset",
            "/items?ids=1,2,3,4,5,6": "ids",
            "/items?ids=1,nope": "ids",
            "/items/nope": "nope",
        }
        for path, mentioned in cases.items():
            status, body = await get_json(client, path)
            assert status == 400, path
            assert body["error"]["code"] == "bad_request", path
            assert mentioned in body["error"]["message"], (path, body)
        # Over max_limit is clamped, not refused; next carries the effective limit.
        for limit in ("100000", "999999999"):
            status, page = await get_json(client, f"/items?limit={limit}")
            assert status == 200 and len(page["items"]) == route.query.max_limit == 20
            assert page["next"].startswith("/items?limit=20&after=")


async def test_nul_in_a_query_value_is_a_400_not_a_database_error(dsn: str) -> None:
    # PostgreSQL text cannot hold U+0000: bound as a parameter, it fails the query.
    await create_items(dsn, 3)
    query = items_query(filters={"name": Filter("name")}, parse_id=str, key="name")
    async with (
        items_server(dsn, query=query) as (url, _),
        httpx.AsyncClient(base_url=url) as client,
    ):
        for path in ("/items?name=a%00b", "/items?ids=item%001", "/items/item%001"):
            status, body = await get_json(client, path)
            assert status == 400, (path, body)
            assert body["error"]["code"] == "bad_request", path
            assert "NUL" in body["error"]["message"], (path, body)
        status, page = await get_json(client, "/items?name=item%201")
        assert status == 200 and [item["id"] for item in page["items"]] == [1]


async def test_ids_and_per_id_routes(dsn: str) -> None:
    await create_items(dsn)
    async with items_server(dsn) as (url, route), httpx.AsyncClient(base_url=url) as client:
        status, page = await get_json(client, "/items?ids=5,2,999,5")
        assert status == 200 and page["next"] is None
        assert [item["id"] for item in page["items"]] == [2, 5]
        status, page = await get_json(client, "/items?ids=1,2,3&grp=1")
        assert [item["id"] for item in page["items"]] == [1]
        status, item = await get_json(client, "/items/7")
        assert status == 200 and item == {"id": 7, "name": "item 7", "grp": 1}
        status, body = await get_json(client, "/items/999")
        assert status == 404 and body["error"]["code"] == "not_found"

        assert await fetch_one(client, "/items", "7") == item
        assert await fetch_one(client, "/items", "999") is None
        found = await fetch_many(
            client, "/items", [str(i) for i in range(1, 13)] + ["999"], chunk=5, id_field="id"
        )
        assert sorted(found, key=int) == [str(i) for i in range(1, 13)]
        assert found["3"]["name"] == "item 3"
        assert route.stats()["batchesServed"] == 5  # 13 ids in chunks of 5, plus the one above
        with pytest.raises(PagingError) as caught:
            await fetch_one(client, "/items", "not-an-int")
        assert caught.value.status == 400


async def test_composite_key_over_a_query(dsn: str) -> None:
    await create_items(dsn)
    query = KeysetQuery(
        "by-group",
        query="SELECT grp, id, name FROM items",
        key=("grp", "id"),
        id_column="id",
        parse_id=int,
    )
    async with items_server(dsn, query=query) as (url, _), httpx.AsyncClient(base_url=url) as c:
        items = [item async for item in Pager(c, "/items", limit=4)]
    expected = sorted(range(1, ROWS + 1), key=lambda i: (i % 3, i))
    assert [item["id"] for item in items] == expected


async def test_pager_walks_everything_and_reports_progress(dsn: str) -> None:
    await create_items(dsn)
    reports: list[PagerProgress] = []
    async with items_server(dsn) as (url, _), httpx.AsyncClient(base_url=url) as client:
        pager = Pager(client, "/items", limit=8, on_progress=reports.append)
        pages = [page async for page in pager.pages()]
        assert [len(p) for p in pages] == [8, 8, 8, 8, 8, 8, 2]
        assert [p.pages for p in reports] == list(range(1, 8))
        assert pager.progress.items == ROWS and pager.progress.pages == 7
        assert pager.progress.rate > 0 and pager.progress.elapsed > 0
        # Absolute routes and routes with filters work too; items one by one.
        filtered = [i async for i in Pager(client, f"{url}/items?grp=0", limit=3)]
        assert [i["id"] for i in filtered] == list(range(3, ROWS + 1, 3))
        # Leaving early cancels the prefetched page cleanly.
        async with contextlib.aclosing(Pager(client, "/items", limit=5).pages()) as walk:
            async for _ in walk:
                break


_json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**63 - 1) | st.text(),
    lambda children: (
        st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=8), children, max_size=3)
    ),
    max_leaves=10,
)


@settings(max_examples=200, deadline=None)
@given(items=st.lists(_json_values, max_size=5), link=st.none() | st.text())
def test_peek_reads_next_off_the_end_only_when_it_is_the_last_member(
    items: list[Any], link: str | None
) -> None:
    """Whatever the items and the link hold (quotes, backslashes, "next" keys of
    their own), the peek agrees with decoding, or declines when "next" is not last."""
    assert pager_module._peek_next(orjson.dumps({"items": items, "next": link})) == link
    assert pager_module._peek_next(orjson.dumps({"next": link, "items": items})) is False
    assert pager_module._peek_next(orjson.dumps({"items": items})) is False


async def test_pager_requests_the_next_page_before_decoding_this_one(
    dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With "next" last in the body, page n+1 is asked for before page n is
    decoded; with "next" first (another server), right after; and a peek that
    decoding contradicts is dropped. Every walk yields every item once, in order."""
    await create_items(dsn)
    requested: list[str] = []
    requested_at_decode: list[int] = []
    decode = pager_module._decode_page

    def counting_decode(response: httpx.Response) -> Any:
        requested_at_decode.append(len(requested))
        return decode(response)

    monkeypatch.setattr(pager_module, "_decode_page", counting_decode)

    def next_first(route: BootstrapRoute) -> list[Route]:
        async def endpoint(request: Request) -> Response:
            page = orjson.loads((await route.list_endpoint(request)).body)
            body = orjson.dumps({"next": page["next"], "items": page["items"]})
            return Response(body, 200, media_type="application/json")

        return [Route("/first", endpoint), *route.routes()]

    async def record(request: httpx.Request) -> None:
        requested.append(str(request.url))

    async with (
        items_server(dsn, wrap=next_first) as (url, _),
        httpx.AsyncClient(base_url=url, event_hooks={"request": [record]}) as client,
    ):
        ids = [item["id"] async for item in Pager(client, "/items", limit=8)]
        assert ids == list(range(1, ROWS + 1))
        # Decoding page n (of 7) finds n + 1 requests made, the last page's n.
        assert requested_at_decode == [2, 3, 4, 5, 6, 7, 7]

        requested.clear()
        requested_at_decode.clear()
        ids = [item["id"] async for item in Pager(client, "/first", limit=8)]
        assert ids == list(range(1, ROWS + 1))
        assert requested_at_decode == [1, 2, 3, 4, 5, 6, 7]

        # A peek that the decoded page contradicts: that request is dropped.
        requested.clear()
        peek = pager_module._peek_next
        monkeypatch.setattr(pager_module, "_peek_next", lambda body: "/items?limit=8&after=forged")
        ids = [item["id"] async for item in Pager(client, "/items", limit=8)]
        monkeypatch.setattr(pager_module, "_peek_next", peek)
        assert ids == list(range(1, ROWS + 1))
        assert sum("after=forged" in u for u in requested) == 7  # one per page, each dropped


async def test_pager_retries_a_failing_page_without_restarting(dsn: str) -> None:
    await create_items(dsn)
    served: list[tuple[str, int]] = []
    distinct: dict[str, int] = {}
    failures: Counter[str] = Counter()

    def flaky(route: BootstrapRoute) -> list[Route]:
        async def endpoint(request: Request) -> Response:
            query = request.url.query
            nth = distinct.setdefault(query, len(distinct))
            if nth in (0, 2) and failures[query] < 2:
                failures[query] += 1
                served.append((query, 503))
                return error_response(503, "unavailable", "injected", {"Retry-After": "0"})
            if nth == 4 and failures[query] < 1:
                failures[query] += 1
                served.append((query, 500))
                return Response("boom", 500)  # no body contract, no Retry-After
            served.append((query, 200))
            return await route.list_endpoint(request)

        return [Route("/items", endpoint)]

    async with items_server(dsn, wrap=flaky) as (url, _), httpx.AsyncClient(base_url=url) as c:
        pager = Pager(c, "/items", limit=6)
        ids = [item["id"] async for item in pager]
    assert ids == list(range(1, ROWS + 1))  # exactly once each, in order
    assert pager.retries == 5
    ok = [query for query, status in served if status == 200]
    assert len(ok) == len(set(ok)) == 9  # every page fetched once: the walk never restarted
    assert sum(1 for query, _ in served if "after" not in query) == 3  # page 1: 2 failures + 1


async def test_pager_gives_up_with_url_and_status(dsn: str) -> None:
    calls = Counter[str]()

    async def down(request: Request) -> Response:
        calls["down"] += 1
        return error_response(503, "unavailable", "always down", {"Retry-After": "0"})

    async def not_a_page(request: Request) -> Response:
        return Response(b'{"items": "nope"}', 200, media_type="application/json")

    async def forbidden(request: Request) -> Response:
        calls["forbidden"] += 1
        return error_response(403, "forbidden", "no")

    app = Starlette(
        routes=[Route("/down", down), Route("/bad", not_a_page), Route("/no", forbidden)]
    )
    async with serve_app(app) as server, httpx.AsyncClient(base_url=server.url) as client:
        with pytest.raises(BootstrapError) as caught:
            await anext(Pager(client, "/down", max_attempts=3).pages())
        assert caught.value.status == 503 and caught.value.url is not None
        assert caught.value.url.startswith(f"{server.url}/down?limit=500")
        assert calls["down"] == 3
        # It says how long it tried: the 503s' waits are counted, not only 429s'.
        waited = r"gave up after 3 failed attempts and ([0-9.]+)s of waiting"
        said = re.search(waited, str(caught.value))
        assert said is not None and float(said[1]) > 0, caught.value
        assert "busy" not in str(caught.value)
        with pytest.raises(PagingError, match="not a valid page") as caught:
            await anext(Pager(client, "/bad").pages())
        assert caught.value.status == 200
        with pytest.raises(PagingError, match="HTTP 403: no"):
            await anext(Pager(client, "/no").pages())
        assert calls["forbidden"] == 1  # a 4xx is never retried


class _CountingRandom(random.Random):
    """A seeded ``random.Random`` that counts its draws."""

    def __init__(self) -> None:
        super().__init__(7)
        self.draws = 0

    def random(self) -> float:
        self.draws += 1
        return super().random()


async def test_pager_and_fetches_draw_their_jitter_from_the_rng_they_are_given() -> None:
    attempts = Counter[str]()

    async def once_down(request: Request) -> Response:
        attempts[str(request.url)] += 1
        if attempts[str(request.url)] == 1:
            return error_response(503, "unavailable", "once", {"Retry-After": "0"})
        if request.path_params.get("id"):
            return Response(b'{"id": "a"}', 200, media_type="application/json")
        return Response(
            b'{"items": [{"id": "a"}], "next": null}', 200, media_type="application/json"
        )

    app = Starlette(routes=[Route("/vms", once_down), Route("/vms/{id}", once_down)])
    async with serve_app(app) as server, httpx.AsyncClient(base_url=server.url) as client:
        walked, one, many = _CountingRandom(), _CountingRandom(), _CountingRandom()
        assert [item async for item in Pager(client, "/vms", rng=walked)] == [{"id": "a"}]
        assert await fetch_one(client, "/vms", "a", rng=one) == {"id": "a"}
        assert await fetch_many(client, "/vms", ["a"], rng=many) == {"a": {"id": "a"}}
    # Each retried once, its wait drawn from its own rng: none from a shared one.
    assert (walked.draws, one.draws, many.draws) == (1, 1, 1)


@pytest.mark.parametrize("link", ["another-port", "credentials"])
@pytest.mark.parametrize("prefetch", [True, False])
async def test_pager_never_follows_a_next_link_to_another_origin(prefetch: bool, link: str) -> None:
    """The walk sends the listener's token with every page: a page whose ``next``
    names another host or port is refused, and the token goes nowhere else; so is
    one to the same server that carries credentials of its own (httpx would send
    them instead of the token)."""
    seen: list[str | None] = []

    async def steal(request: Request) -> Response:
        seen.append(request.headers.get("authorization"))
        return Response(b'{"items": [], "next": null}', 200, media_type="application/json")

    async with serve_app(Starlette(routes=[Route("/steal", steal)])) as other:
        base = {"url": other.url}

        async def first_page(request: Request) -> Response:
            body = orjson.dumps({"items": [{"id": 1}], "next": f"{base['url']}/steal"})
            return Response(body, 200, media_type="application/json")

        app = Starlette(routes=[Route("/vms", first_page), Route("/steal", steal)])
        async with serve_app(app) as server, httpx.AsyncClient(base_url=server.url) as client:
            if link == "credentials":
                base["url"] = server.url.replace("//", "//u:p@")
            pager = Pager(client, f"{server.url}/vms", token="listener-secret", prefetch=prefetch)
            with pytest.raises(PagingError, match="next link leaves the route's origin") as caught:
                async for _ in pager.pages():
                    pass
            assert caught.value.status == 200
    assert seen == []


async def test_pager_reconnects_after_connection_refused(dsn: str) -> None:
    await create_items(dsn)
    async with asyncpg.create_pool(dsn, min_size=1, max_size=2) as pool:
        route = BootstrapRoute("/items", items_query(), pool, admission=Admission(max_walks=None))
        app = Starlette(routes=route.routes())
        port = free_port()
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as client:
            pager = Pager(client, "/items", limit=10, prefetch=False)
            async with contextlib.aclosing(pager.pages()) as walk:
                async with serve_app(app, port=port):
                    ids = [item["id"] for item in await anext(walk)]
                # Stopped: the next page meets a refused connection and backs off.
                restarted = asyncio.Event()

                async def restart_when_refused() -> None:
                    await wait_until(lambda: pager.retries >= 1, timeout=10)
                    async with serve_app(app, port=port):
                        restarted.set()
                        await wait_until(lambda: pager.progress.items == ROWS, timeout=30)

                task = asyncio.create_task(restart_when_refused())
                async for page in walk:
                    ids.extend(item["id"] for item in page)
                await asyncio.wait_for(task, 30)
    assert restarted.is_set()
    assert ids == list(range(1, ROWS + 1))
    assert pager.progress.pages == 5


async def test_database_down_is_503(dsn: str) -> None:
    dead = f"postgresql://postgres@127.0.0.1:{free_port()}/nothing"
    async with asyncpg.create_pool(dead, min_size=0, max_size=1) as pool:
        route = BootstrapRoute("/items", items_query(), pool, admission=Admission(max_walks=1))
        async with (
            serve_app(Starlette(routes=route.routes())) as server,
            httpx.AsyncClient(base_url=server.url) as client,
        ):
            for path in ("/items", "/items?ids=1", "/items/1", "/items?limit=3"):
                response = await client.get(path)
                assert response.status_code == 503, path
                assert response.headers["retry-after"] == "1"
                assert response.json()["error"]["code"] == "unavailable"
        # A walk that never got its first page does not hold an admission slot.
        assert len(route.admission.walks) == 0


async def test_authorization_is_enforced(dsn: str) -> None:
    await create_items(dsn)

    async def authorize(request: Request) -> bool:
        return request.headers.get("authorization") == "Bearer s3cret"

    async with (
        items_server(dsn, authorize=authorize) as (url, _),
        httpx.AsyncClient(base_url=url) as client,
    ):
        for path in ("/items", "/items/1", "/items?ids=1"):
            response = await client.get(path)
            assert response.status_code == 401
            assert response.json()["error"]["code"] == "unauthorized"
        with pytest.raises(PagingError) as caught:
            await anext(Pager(client, "/items").pages())
        assert caught.value.status == 401
        items = [i async for i in Pager(client, "/items", limit=20, token="s3cret")]
        assert len(items) == ROWS
        assert await fetch_one(client, "/items", "3", token="s3cret") is not None


@pytest.mark.parametrize("outage", ["raises", "hangs", "answers-when-cancelled"])
async def test_a_check_that_cannot_be_made_is_503_with_retry_after(dsn: str, outage: str) -> None:
    """A route's own ``authorize`` that raises, or does not answer within
    ``authorize_timeout``, is ``unavailable`` (retried by the pager), never 401 (for
    good) nor a 500 with a traceback. One that swallows its cancellation at the
    deadline and answers False is late all the same, not taken at its word (401)."""
    await create_items(dsn)
    down = True

    async def authorize(request: Request) -> bool:
        if not down:
            return True
        if outage == "raises":
            raise ConnectionError("identity service down")
        if outage == "answers-when-cancelled":
            try:
                await asyncio.Event().wait()
            except asyncio.CancelledError:
                return False  # an authorizer that must not do this, and does
        await asyncio.Event().wait()
        return False

    async with (
        items_server(dsn, authorize=authorize, authorize_timeout=0.2) as (url, _),
        httpx.AsyncClient(base_url=url) as client,
    ):
        for path in ("/items", "/items/1", "/items?ids=1"):
            response = await client.get(path)
            assert response.status_code == 503, (path, response.text)
            assert response.headers["retry-after"] == "1"
            assert response.json()["error"]["code"] == "unavailable"
            assert response.json()["error"]["retryAfter"] == 1
        pager = Pager(client, "/items", limit=5)
        walk = asyncio.create_task(anext(pager.pages()))
        await wait_until(lambda: pager.retries >= 1, 10, message="the pager retries the 503")
        down = False
        assert len(await asyncio.wait_for(walk, 20)) == 5


# --------------------------------------------------------------------------- admission (real)


async def test_new_walks_beyond_the_cap_get_429(dsn: str) -> None:
    await create_items(dsn)
    admission = Admission(max_walks=2, retry_after=1)
    async with (
        items_server(dsn, admission=admission) as (url, _),
        httpx.AsyncClient(base_url=url) as client,
    ):
        _, walk_a = await get_json(client, "/items?limit=10")
        _, walk_b = await get_json(client, "/items?limit=10")
        refused = await client.get("/items?limit=10")
        assert refused.status_code == 429
        assert refused.headers["retry-after"] == "1"
        assert refused.json()["error"]["code"] == "busy"
        # Walks already admitted continue at the cap.
        status, page = await get_json(client, walk_a["next"])
        assert status == 200
        # A Pager waits its turn (Retry-After) instead of failing ...
        waiting = Pager(client, "/items", limit=25)
        late = asyncio.create_task(_collect(waiting))
        await wait_until(lambda: waiting.retries >= 1, timeout=10)
        # ... and gets in once walk A finishes.
        while page["next"]:
            _, page = await get_json(client, page["next"])
        items = await asyncio.wait_for(late, 30)
        assert len(items) == ROWS
        stats = admission.stats()
        assert stats["walksFinished"] == 2 and stats["walksActive"] == 1  # walk B idles
        assert stats["pagesRefused"] >= 2 and stats["walksRefused"] >= 2
        assert walk_b["next"]


async def test_another_method_is_405_with_the_error_body_and_the_private_headers(
    dsn: str,
) -> None:
    await create_items(dsn)
    async with (
        items_server(dsn) as (url, _),
        httpx.AsyncClient(base_url=url) as client,
    ):
        for method, path in (("POST", "/items"), ("PUT", "/items/1"), ("DELETE", "/items/1")):
            response = await client.request(method, path)
            assert response.status_code == 405, (method, path)
            assert response.json()["error"]["code"] == "method_not_allowed"
            assert response.headers["allow"] == "GET, HEAD"
            assert response.headers["cache-control"] == "no-store"
            assert response.headers["x-content-type-options"] == "nosniff"
        assert (await client.head("/items?limit=1")).status_code == 200
        status, page = await get_json(client, "/items?limit=3")
        assert status == 200 and len(page["items"]) == 3


async def test_a_kept_continuation_waits_its_turn_and_goes_on_where_it_was(dsn: str) -> None:
    """A walk begun on one instance goes on through another (they share the token
    key); but a continuation token kept an hour is a new walk there: at the cap it
    gets 429 like one, and once admitted it goes on from its position, every row
    once."""
    await create_items(dsn)
    wall = FakeClock()
    wall.now = time.time()
    later = Admission(max_walks=1, walk_idle_timeout=30.0, retry_after=1, wall_clock=wall)
    key = b"k" * 32
    async with (
        items_server(dsn, query=items_query(token_key=key)) as (first_url, _),
        items_server(dsn, admission=later, query=items_query(token_key=key)) as (url, _),
        httpx.AsyncClient(base_url=url) as client,
    ):
        async with httpx.AsyncClient(base_url=first_url) as first_client:
            _, first = await get_json(first_client, "/items?limit=10")
        wall.now += 3600.0  # the client comes back an hour later with its token
        _, other = await get_json(client, "/items?limit=10")  # the one walk allowed
        refused = await client.get(first["next"])
        assert refused.status_code == 429 and refused.json()["error"]["code"] == "busy"
        while other["next"]:
            _, other = await get_json(client, other["next"])
        status, page = await get_json(client, first["next"])
        assert status == 200, page
        seen = [item["id"] for item in first["items"] + page["items"]]
        while page["next"]:
            _, page = await get_json(client, page["next"])
            seen += [item["id"] for item in page["items"]]
        assert seen == list(range(1, ROWS + 1))
        assert later.stats()["walksStarted"] == 2 and later.stats()["walksActive"] == 0


async def _collect(pager: Pager) -> list[Any]:
    return [item async for item in pager]


async def test_page_queries_beyond_the_slots_get_429(dsn: str) -> None:
    await create_items(dsn)
    admission = Admission(max_walks=None, max_queries=1, queue_timeout=0.2, retry_after=0)
    async with items_server(dsn, admission=admission) as (url, _):
        locker = await asyncpg.connect(dsn)
        try:
            async with httpx.AsyncClient(base_url=url) as client:
                tx = locker.transaction()
                await tx.start()
                await locker.execute("LOCK TABLE items IN ACCESS EXCLUSIVE MODE")
                blocked = asyncio.create_task(client.get("/items?limit=5"))
                await wait_until(lambda: admission.slots.active == 1, timeout=10)
                refused = await client.get("/items?limit=5")
                assert refused.status_code == 429
                assert refused.json()["error"]["code"] == "busy"
                # The refused walk was let go: only the blocked one is in progress.
                assert admission.stats()["walksActive"] == 1
                await tx.rollback()
                assert (await asyncio.wait_for(blocked, 10)).status_code == 200
                assert (await client.get("/items?limit=5")).status_code == 200
        finally:
            await locker.close()


# --------------------------------------------------------------------------- issue 5: stable walk

WALK_ROWS = 20_000
WALK_LIMIT = 50
WRITES_PER_PAGE = 3


async def test_walk_during_writes_sees_every_survivor_exactly_once(dsn: str) -> None:
    """Issue 5: 20,000 resources walked while writers insert, update and delete.

    Every resource that existed for the whole walk is seen exactly once, and
    no resource is seen twice. Keys are random UUIDs, so inserts and deletes
    land before, at and after the walk's position.
    """
    conn = await asyncpg.connect(dsn)
    try:
        await conn.execute(
            "CREATE TABLE res (id uuid PRIMARY KEY, version int NOT NULL DEFAULT 0,"
            " body text NOT NULL)"
        )
        initial = [uuid.uuid4() for _ in range(WALK_ROWS)]
        await conn.copy_records_to_table(
            "res", records=[(u, 0, "x" * 40) for u in initial], columns=["id", "version", "body"]
        )
    finally:
        await conn.close()

    query = KeysetQuery("res", table="res", key="id", parse_id=uuid.UUID, max_limit=1000)
    kinds = ("insert", "update", "delete")
    # Writers are paced by the walk, not by sleeps: each page served hands every
    # writer WRITES_PER_PAGE tickets, so writes land between (and during) page
    # queries all through the walk. None tells a writer to stop.
    tickets: dict[str, asyncio.Queue[bool | None]] = {k: asyncio.Queue() for k in kinds}
    deleted: set[uuid.UUID] = set()
    inserted: set[uuid.UUID] = set()
    writes = Counter[str]()
    candidates = list(initial)
    random.shuffle(candidates)

    def hand_out_tickets(progress: PagerProgress | None = None) -> None:
        for queue in tickets.values():
            for _ in range(WRITES_PER_PAGE):
                queue.put_nowait(True)

    async def writer(kind: str) -> None:
        async with asyncpg.create_pool(dsn, min_size=1, max_size=1) as pool:
            rng = random.Random(kind)
            while await tickets[kind].get():
                if kind == "insert":
                    new = uuid.uuid4()
                    await pool.execute("INSERT INTO res (id, body) VALUES ($1, 'new')", new)
                    inserted.add(new)
                elif kind == "update":
                    await pool.execute(
                        "UPDATE res SET version = version + 1, body = body || 'u' WHERE id = $1",
                        rng.choice(initial),
                    )
                else:
                    victim = candidates.pop()
                    deleted.add(victim)  # before the DELETE: it did not exist throughout
                    await pool.execute("DELETE FROM res WHERE id = $1", victim)
                writes[kind] += 1

    async with asyncpg.create_pool(dsn, min_size=1, max_size=4) as pool:
        route = BootstrapRoute("/res", query, pool, admission=Admission(max_walks=None))
        async with (
            serve_app(Starlette(routes=route.routes())) as server,
            httpx.AsyncClient(base_url=server.url) as client,
        ):
            writers = [asyncio.create_task(writer(k)) for k in kinds]
            hand_out_tickets()
            await wait_until(lambda: all(writes[k] > 0 for k in kinds))
            at_start = dict(writes)
            seen: Counter[uuid.UUID] = Counter()
            started = time.monotonic()
            pager = Pager(client, "/res", limit=WALK_LIMIT, on_progress=hand_out_tickets)
            try:
                async for item in pager:
                    seen[uuid.UUID(item["id"])] += 1
                at_end = dict(writes)
            finally:
                for queue in tickets.values():
                    queue.put_nowait(None)
                await asyncio.wait_for(asyncio.gather(*writers), 60)
            elapsed = time.monotonic() - started

    during = {k: at_end[k] - at_start[k] for k in kinds}
    print(
        f"\nwalked {pager.progress.items} items in {pager.progress.pages} pages, "
        f"{elapsed:.1f}s; writes during the walk: {during}"
    )
    assert all(n >= 200 for n in during.values()), during  # writes really interleaved
    twice = [u for u, n in seen.items() if n > 1]
    assert not twice, f"{len(twice)} ids seen more than once"
    survivors = set(initial) - deleted
    missing = survivors - seen.keys()
    assert not missing, f"{len(missing)} resources that existed throughout were skipped"
    assert seen.keys() <= set(initial) | inserted
