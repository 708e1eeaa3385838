"""The listener end to end: the example VM API with its publisher on a real uvicorn, real
PostgreSQL, real websockets; connection loss through a real TCP proxy."""

from __future__ import annotations

import asyncio
import logging
import random
import time
from datetime import timedelta
from http import HTTPStatus
from typing import Any

import asyncpg
import httpx
import orjson
import pytest
from helpers import wait_until
from prometheus_client import CollectorRegistry, generate_latest
from test_listener_support import (
    Proxy,
    VmApiServer,
    api_state,
    burst,
    capture_events,
    create_vms,
)
from websockets.asyncio.server import ServerConnection, serve

from changefeed.listener import (
    BackoffPolicy,
    ConnectionState,
    Controller,
    Listener,
    ListenerConfig,
    RegistrationRefused,
    Resynced,
)
from changefeed.publisher.retention import trim_expired
from changefeed.schemas import (
    Ack,
    ChangeItem,
    ChangeKind,
    CloseCode,
    ErrorFrame,
    Registration,
    ResourceRoute,
)

VM = ChangeKind("vm", ("nic", "alias"))
INSTANCE = "de1aac97-6f85-4ba9-b51e-514f48a6a46c"
FAST = BackoffPolicy(initial=0.02, maximum=0.2, reset_after=60.0)


def make_listener(url: str, **kwargs: Any) -> Listener:
    config = kwargs.pop("config", None) or ListenerConfig(backoff=FAST, page_limit=50)
    return Listener(
        url, instance=INSTANCE, service="tcns", change_kind=kwargs.pop("kind", VM),
        config=config, rng=random.Random(5), **kwargs,
    )  # fmt: skip


async def next_event(listener: Listener, timeout: float = 10.0) -> Any:
    return await asyncio.wait_for(anext(listener), timeout)


async def items(listener: Listener, count: int, timeout: float = 10.0) -> list[ChangeItem]:
    got: list[ChangeItem] = []
    async with asyncio.timeout(timeout):
        while len(got) < count:
            event = await anext(listener)
            assert isinstance(event, ChangeItem), event
            got.append(event)
    return got


async def test_bootstrap_then_live_items(dsn: str) -> None:
    registry = CollectorRegistry()
    async with VmApiServer(dsn) as api, httpx.AsyncClient(base_url=api.url) as client:
        ids = await create_vms(client, 120)
        with capture_events() as events:
            async with make_listener(api.ws_url, registry=registry) as listener:
                first = await next_event(listener)
                assert isinstance(first, Resynced) and first.initial
                assert sorted(vm["uuid"] for vm in first.items) == sorted(ids)
                assert first.pages == 3  # page_limit=50
                assert first.route == f"{api.url}/vms"
                assert listener.state is ConnectionState.LIVE
                response = await client.patch(f"/vms/{ids[0]}", json={"alias": "renamed"})
                response.raise_for_status()
                new = (await create_vms(client, 1, "late"))[0]
                got = await items(listener, 2)
                assert [i.changed_resource_id for i in got] == [ids[0], new]
                assert got[0].change_kind.sub_resources == ("alias",)
                status = listener.status()
                assert status.cursor == got[-1].cursor
                assert (status.attempts, status.registrations, status.bootstraps) == (1, 1, 1)
                assert status.items_received == status.items_delivered == 2
                assert status.buffer_capacity == 10_000 and status.last_error is None
                assert status.to_json()["state"] == "live"
                metrics = generate_latest(registry).decode()
                assert 'changefeed_listener_state{listener="tcns:vm",state="live"} 1.0' in metrics
                assert (
                    'changefeed_listener_items_delivered_total{listener="tcns:vm"} 2.0' in metrics
                )
            # mypy still holds listener.state to the LIVE asserted above; leaving the
            # `async with` stopped it.
            assert listener.state is ConnectionState.STOPPED  # type: ignore[comparison-overlap]
    names = [name for name, _ in events.records]
    for event in ("listener.connecting", "listener.registered", "listener.bootstrapped"):
        assert event in names
    (connecting,) = events.named("listener.connecting")
    assert connecting["attempt"] == 1 and connecting["buffer"] == 0
    assert connecting["state"] == "connecting" and connecting["since"] is None
    assert events.named("listener.registered")[0]["resumed"] is False


async def test_resume_after_disconnect_skips_bootstrap_and_delivers_missed_items(dsn: str) -> None:
    async with VmApiServer(dsn) as api, httpx.AsyncClient(base_url=api.url) as client:
        ids = await create_vms(client, 5)
        async with Proxy(api.port or 0) as proxy, make_listener(proxy.ws_url) as listener:
            assert isinstance(await next_event(listener), Resynced)
            await client.patch(f"/vms/{ids[0]}", json={"alias": "before"})
            (seen,) = await items(listener, 1)
            assert listener.cursor == seen.cursor
            with capture_events() as events:
                with proxy.refuse():
                    proxy.cut()
                    await wait_until(lambda: listener.status().aborts == 1, 10)
                    # Missed while disconnected:
                    for n, vm in enumerate(ids[1:4]):
                        response = await client.patch(f"/vms/{vm}", json={"alias": f"missed-{n}"})
                        response.raise_for_status()
                    await client.delete(f"/vms/{ids[4]}")
                    await wait_until(lambda: listener.status().attempts >= 2, 10)
                missed = await items(listener, 4)
            assert [i.changed_resource_id for i in missed] == [*ids[1:4], ids[4]]
            status = listener.status()
            assert status.resumes == 1 and status.bootstraps == 1  # no second bootstrap
            assert events.named("listener.connecting")[-1]["since"] == seen.cursor
            assert events.named("listener.registered")[-1]["resumed"] is True
            assert events.named("listener.backoff")  # it waited before registering again


async def test_publisher_restart_is_resumed(dsn: str) -> None:
    async with VmApiServer(dsn) as api, httpx.AsyncClient(base_url=api.url) as client:
        ids = await create_vms(client, 3)
        with capture_events() as events:
            async with make_listener(api.ws_url) as listener:
                assert isinstance(await next_event(listener), Resynced)
                await api.stop()
                await wait_until(lambda: listener.status().aborts >= 1, 10)
                await burst(dsn, ids[:2], 1)  # written while no publisher runs
                await api.start()
                missed = await items(listener, 2, timeout=15)
                assert sorted(i.changed_resource_id for i in missed) == sorted(ids[:2])
                status = listener.status()
                assert status.resumes == 1 and status.bootstraps == 1
        first, *retries = events.named("listener.aborted")
        # 1001 from the publisher's drain, or 1012 when uvicorn closes sockets first.
        assert first["close_code"] in (1001, 1012) and first["state"] == "live"
        assert all("cannot connect" in r["reason"] for r in retries)  # refused while down


async def test_a_cursor_the_feed_no_longer_holds_means_a_full_bootstrap(dsn: str) -> None:
    async with VmApiServer(dsn) as api, httpx.AsyncClient(base_url=api.url) as client:
        ids = await create_vms(client, 4)
        async with make_listener(api.ws_url) as listener:
            assert isinstance(await next_event(listener), Resynced)
            await client.patch(f"/vms/{ids[0]}", json={"alias": "x"})
            await items(listener, 1)
            saved = listener.cursor
        await burst(dsn, ids, 2)
        conn = await asyncpg.connect(dsn)
        try:  # retention trims everything: the saved cursor is no longer resumable
            assert await trim_expired(conn, "changefeed", timedelta(0)) > 0
        finally:
            await conn.close()
        async with make_listener(api.ws_url, cursor=saved) as again:
            event = await next_event(again)
            assert isinstance(event, Resynced) and len(event.items) == 4
            assert again.status().resumes == 0
            assert event.initial  # the first bootstrap of this listener


async def test_bad_cursor_is_dropped_and_the_listener_bootstraps(dsn: str) -> None:
    async with VmApiServer(dsn) as api, httpx.AsyncClient(base_url=api.url) as client:
        await create_vms(client, 2)
        with capture_events() as events:
            async with make_listener(api.ws_url, cursor="not-a-cursor") as listener:
                event = await next_event(listener)
                assert isinstance(event, Resynced) and len(event.items) == 2
        aborted = events.named("listener.aborted")
        assert aborted[0]["error_code"] == "bad_cursor"
        assert aborted[0]["disposition"] == "retry_fresh"
        assert events.named("listener.connecting")[-1]["since"] is None


async def test_unknown_resource_stops_with_a_clear_error(dsn: str) -> None:
    async with VmApiServer(dsn) as api:
        listener = make_listener(api.ws_url, kind=ChangeKind("vmz"))
        async with listener:
            with pytest.raises(RegistrationRefused) as info:
                await next_event(listener)
        assert info.value.code == "unknown_resource"
        assert info.value.close_code is None or info.value.close_code == 4001
        assert "vmz" in str(info.value)
        assert listener.state is ConnectionState.STOPPED
        assert listener.status().attempts == 1  # not retried


async def test_bearer_token_on_the_handshake_and_the_bootstrap(dsn: str) -> None:
    async with VmApiServer(dsn, auth_tokens=("s3cret",)) as api:
        headers = {"Authorization": "Bearer s3cret"}
        async with httpx.AsyncClient(base_url=api.url, headers=headers) as client:
            await create_vms(client, 3)
        async with make_listener(api.ws_url, token="s3cret") as listener:
            event = await next_event(listener)
            assert isinstance(event, Resynced) and len(event.items) == 3
        async with make_listener(api.ws_url) as anonymous:
            with pytest.raises(RegistrationRefused) as info:
                await next_event(anonymous)
        assert info.value.code in ("unauthorized", "http_401", "http_403")
        assert anonymous.status().attempts == 1


async def test_overflow_aborts_backs_off_with_growing_capped_jitter_and_converges(
    dsn: str,
) -> None:
    """Buffer of 100, burst of 10,000 changes: abort, clear, back off, re-register, converge."""
    policy = BackoffPolicy(initial=0.05, maximum=0.4, reset_after=60.0)
    config = ListenerConfig(buffer_size=100, backoff=policy, page_limit=500)
    async with VmApiServer(dsn) as api, httpx.AsyncClient(base_url=api.url) as client:
        ids = await create_vms(client, 200)
        with capture_events() as events:
            async with make_listener(api.ws_url, config=config) as listener:
                state: dict[str, Any] = {}

                async def consume() -> None:
                    async for event in listener:
                        if isinstance(event, Resynced):
                            state.clear()
                            state.update({vm["uuid"]: vm for vm in event.items})
                        else:
                            # The application is slow: it fetches each changed VM.
                            vm = event.changed_resource_id
                            response = await client.get(f"/vms/{vm}")
                            if response.status_code == 404:
                                state.pop(vm, None)
                            else:
                                state[vm] = response.json()

                consumer = asyncio.create_task(consume())
                await wait_until(lambda: listener.state is ConnectionState.LIVE, 10)
                # 10,000 changes in 40 transactions of 250, spread over a second or two.
                conn = await asyncpg.connect(dsn)
                try:
                    for part in range(40):
                        chunk = ids[(part * 50) % 200 : (part * 50) % 200 + 50]
                        await burst(conn, chunk, 5, per_transaction=250)
                        await asyncio.sleep(0.02)  # spreads the burst; not a synchronisation
                finally:
                    await conn.close()
                expected = await api_state(dsn)
                await wait_until(lambda: state == expected, 30, message="converged")
                status = listener.status()
                consumer.cancel()
                await asyncio.gather(consumer, return_exceptions=True)
    assert status.overflows >= 3
    assert status.bootstraps >= 2 and status.registrations >= 3
    overflows = events.named("listener.overflow")
    assert len(overflows) == status.overflows
    assert all(o["capacity"] == 100 for o in overflows)
    aborted = [a for a in events.named("listener.aborted") if "BufferOverflow" in a["reason"]]
    assert len(aborted) == status.overflows
    backoffs = events.named("listener.backoff")
    ceilings = [b["ceiling"] for b in backoffs]
    delays = [b["delay"] for b in backoffs]
    assert ceilings[: min(4, len(ceilings))] == [0.05, 0.1, 0.2, 0.4][: len(ceilings[:4])]
    assert ceilings == sorted(ceilings)  # growing (no healthy reset in between) ...
    assert max(ceilings) <= 0.4  # ... and capped
    assert all(0 <= d <= c for d, c in zip(delays, ceilings, strict=True))  # full jitter
    assert len(set(delays)) == len(delays)  # jittered, not a fixed sequence
    assert all(b["resume"] is False for b in backoffs)  # overflow -> full re-bootstrap


async def test_a_publisher_that_stops_answering_pings_is_detected_in_bounded_time() -> None:
    """A raw websockets server that acks the registration, then stops reading the socket
    (so it never answers a ping). The listener must notice within ping_interval +
    ping_timeout + close_timeout and register again."""
    stalled = asyncio.Event()
    connections: list[int] = []

    async def handler(ws: ServerConnection) -> None:
        registration = Registration.decode(await ws.recv())
        connections.append(1)
        route = ResourceRoute("vm", ("nic", "alias"), "/vms")
        ack = Ack((route,), registration.since or "c0", resumed=registration.since is not None)
        await ws.send(ack.encode())
        if len(connections) == 1:
            ws.transport.pause_reading()  # never reads again: pings go unanswered
            stalled.set()
        await ws.wait_closed()

    config = ListenerConfig(backoff=FAST, ping_interval=0.2, ping_timeout=0.3, close_timeout=0.3)
    async with serve(handler, "127.0.0.1", 0, ping_interval=None, close_timeout=0.5) as server:
        port = server.sockets[0].getsockname()[1]
        url = f"ws://127.0.0.1:{port}/changefeeds"
        with capture_events() as events:
            async with make_listener(url, config=config, cursor="c0") as listener:
                await asyncio.wait_for(stalled.wait(), 10)
                started = time.monotonic()
                await wait_until(lambda: listener.status().aborts >= 1, 10)
                detected = time.monotonic() - started
                await wait_until(lambda: len(connections) >= 2, 10)
                await wait_until(lambda: listener.state is ConnectionState.LIVE, 10)
    bound = config.ping_interval + config.ping_timeout + config.close_timeout  # type: ignore[operator]
    assert detected <= bound + 0.5, detected
    (aborted, *_) = events.named("listener.aborted")
    assert aborted["state"] == "live" and aborted["disposition"] == "retry"
    assert aborted["close_code"] in (None, 1006, 1011)


async def test_resumes_count_only_registrations_that_sent_since_and_were_resumed() -> None:
    """A scripted publisher that answers ``resumed: true`` to every registration, one
    without ``since`` too: that first one is a bootstrap (nothing was resumed), not a
    resume; after a restart of the publisher (1001) the registration with the cursor
    is the one resume."""
    registrations: list[dict[str, Any]] = []
    got: list[Any] = []

    def page(connection: ServerConnection, request: Any) -> Any:
        if request.path.startswith("/vms"):
            return connection.respond(HTTPStatus.OK, '{"items": [], "next": null}')
        return None

    async def handler(ws: ServerConnection) -> None:
        registration = orjson.loads(await ws.recv())
        registrations.append(registration)
        ack = {"bootstrapRoute": "/vms", "cursor": "c0", "resumed": True}
        await ws.send(orjson.dumps(ack).decode())
        if len(registrations) == 1:
            await ws.send(ChangeItem(VM, "vm-1", "c1", "2026-11-21T23:00:00.000Z").encode())
            await wait_until(lambda: any(isinstance(e, ChangeItem) for e in got), 10)
            await ws.close(CloseCode.GOING_AWAY, "restarting")
            return
        await ws.wait_closed()

    async with serve(handler, "127.0.0.1", 0, process_request=page) as server:
        url = f"ws://127.0.0.1:{server.sockets[0].getsockname()[1]}/changefeeds"
        async with make_listener(url) as listener:

            async def consume() -> None:
                async for event in listener:
                    got.append(event)

            consumer = asyncio.create_task(consume())
            try:
                await wait_until(lambda: len(registrations) >= 2, 10, message="second")
                await wait_until(lambda: listener.state is ConnectionState.LIVE, 10)
                status = listener.status()
            finally:
                consumer.cancel()
                await asyncio.gather(consumer, return_exceptions=True)
    assert "since" not in registrations[0] and registrations[1]["since"] == "c1"
    assert isinstance(got[0], Resynced)  # the first registration bootstrapped
    assert (status.registrations, status.bootstraps, status.resumes) == (2, 1, 1)


async def seed_vms(dsn: str, count: int) -> None:
    """``count`` VMs written straight into the API's table (a bootstrap needs no feed)."""
    conn = await asyncpg.connect(dsn)
    try:
        await conn.execute(
            "INSERT INTO vmapi.vms (uuid, alias, nics) SELECT gen_random_uuid(), 'vm-' || n,"
            " '[]'::jsonb FROM generate_series(1, $1) AS n",
            count,
        )
    finally:
        await conn.close()


async def test_status_shows_bootstrap_progress_while_it_walks(dsn: str) -> None:
    """3,000 VMs in pages of 20: polled during the walk, ``status().bootstrap`` shows
    the pages, items and rate of the route rising; at the end, all of them."""
    config = ListenerConfig(backoff=FAST, page_limit=20)
    async with VmApiServer(dsn) as api:
        await seed_vms(dsn, 3000)
        seen: list[tuple[int, int, float]] = []
        async with make_listener(api.ws_url, config=config) as listener:
            first = asyncio.ensure_future(next_event(listener, 60))
            while not first.done():  # bounded by next_event's timeout
                status = listener.status()
                if status.state is ConnectionState.BOOTSTRAPPING and status.bootstrap:
                    (progress,) = status.bootstrap
                    seen.append((progress.items, progress.pages, progress.rate))
                await asyncio.sleep(0.005)
            event = first.result()
            final = listener.status().bootstrap
    assert isinstance(event, Resynced) and len(event.items) == 3000
    counts = [items for items, _, _ in seen]
    assert counts == sorted(counts)  # never goes back
    rising = sorted(set(counts))
    assert len(rising) >= 3 and 0 < rising[1] < 3000, rising  # seen part-way, more than once
    assert all(rate > 0 for items, _, rate in seen if items)
    (done,) = final
    assert (done.resource, done.items, done.done) == ("vm", 3000, True)
    assert done.pages >= 150 and done.route == f"{api.url}/vms" and done.rate > 0
    assert listener.status().to_json()["bootstrap"][0]["items"] == 3000


async def test_unavailable_resumes_after_retry_after_and_cursor_expired_bootstraps() -> None:
    """A scripted publisher: ``unavailable`` (4010, retryAfter 0.4 s) keeps the cursor
    and waits at least 0.4 s; an ack that does not resume is counted with its
    reason; ``cursor_expired`` (4011) drops the cursor."""
    registrations: list[tuple[dict[str, Any], float]] = []
    closed_at: list[float] = []
    got: list[Any] = []

    def page(connection: ServerConnection, request: Any) -> Any:
        if request.path.startswith("/vms"):
            return connection.respond(HTTPStatus.OK, '{"items": [], "next": null}')
        return None

    async def handler(ws: ServerConnection) -> None:
        registration = orjson.loads(await ws.recv())
        registrations.append((registration, time.monotonic()))
        n = len(registrations)
        since = registration.get("since")
        ack: dict[str, Any] = {"bootstrapRoute": "/vms", "cursor": f"c{n}0", "resumed": False}
        if since is not None:  # the second registration: not resumed, with the reason
            ack["reason"] = "too_far_behind"
        await ws.send(orjson.dumps(ack).decode())
        item = ChangeItem(VM, f"vm-{n}", f"c{n}1", "2026-11-21T23:00:00.000Z")
        await ws.send(item.encode())
        if n == 1:
            error = ErrorFrame("unavailable", "feed database unreachable", retry_after=0.4)
            close = CloseCode.UNAVAILABLE
        elif n == 2:
            error = ErrorFrame("cursor_expired", "the feed was trimmed past your cursor")
            close = CloseCode.CURSOR_EXPIRED
        else:
            await ws.wait_closed()
            return
        # The listener hands the item out first: its cursor is then the item's.
        await wait_until(lambda: sum(isinstance(e, ChangeItem) for e in got) >= n, 10)
        await ws.send(error.encode())
        closed_at.append(time.monotonic())
        await ws.close(close, error.code)

    async with serve(handler, "127.0.0.1", 0, process_request=page) as server:
        url = f"ws://127.0.0.1:{server.sockets[0].getsockname()[1]}/changefeeds"
        with capture_events() as events:
            async with make_listener(url) as listener:

                async def consume() -> None:
                    async for event in listener:
                        got.append(event)

                consumer = asyncio.create_task(consume())
                await wait_until(lambda: len(registrations) >= 3, 15, message="third")
                await wait_until(lambda: listener.state is ConnectionState.LIVE, 10)
                status = listener.status()
                consumer.cancel()
                await asyncio.gather(consumer, return_exceptions=True)
    (first, _), (second, second_at), (third, _) = registrations[:3]
    assert "since" not in first
    assert second["since"] == "c11"  # 4010: the cursor of the last item handed out, kept
    assert second_at - closed_at[0] >= 0.4  # retryAfter is a floor of the back-off
    assert "since" not in third  # 4011: the cursor dropped, a full bootstrap
    assert status.not_resumed == {"too_far_behind": 1}
    assert status.bootstraps == 3
    aborted = events.named("listener.aborted")
    assert [(a["error_code"], a["disposition"]) for a in aborted[:2]] == [
        ("unavailable", "retry"),
        ("cursor_expired", "retry_fresh"),
    ]
    assert aborted[0]["retry_after"] == 0.4
    (not_resumed,) = events.named("listener.not_resumed")
    assert (
        not_resumed["reason"] == "too_far_behind" and "replay_limit" in not_resumed["explanation"]
    )
    assert events.named("listener.backoff")[0]["delay"] >= 0.4


async def test_an_unexpected_error_in_a_bootstrap_walk_is_logged_with_its_traceback() -> None:
    """A walk that fails with something else than a BootstrapError (a bug, in the
    pager or an injected transport) is retried like a failed walk; its traceback
    must reach a log line, or the bug can only be guessed at from its repr."""
    registrations: list[dict[str, Any]] = []

    async def handler(ws: ServerConnection) -> None:
        registrations.append(orjson.loads(await ws.recv()))
        ack = {"bootstrapRoute": "/vms", "cursor": "c0", "resumed": False}
        await ws.send(orjson.dumps(ack).decode())
        await ws.wait_closed()

    def broken(request: httpx.Request) -> httpx.Response:
        raise RuntimeError("a bug in the transport")

    http = httpx.AsyncClient(transport=httpx.MockTransport(broken))
    records: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    keep = Keep(logging.DEBUG)
    logging.getLogger("changefeed").addHandler(keep)
    try:
        async with serve(handler, "127.0.0.1", 0) as server:
            url = f"ws://127.0.0.1:{server.sockets[0].getsockname()[1]}/changefeeds"
            async with make_listener(url, http=http) as listener:
                await wait_until(lambda: listener.status().aborts >= 1, 10, message="abort")
    finally:
        logging.getLogger("changefeed").removeHandler(keep)
        await http.aclose()
    assert "RuntimeError" in (listener.status().last_error or "")
    tracebacks = [r for r in records if r.exc_info and isinstance(r.exc_info[1], RuntimeError)]
    assert tracebacks, [(r.getMessage(), r.exc_info) for r in records if r.levelno >= 30]


@pytest.mark.parametrize("route", ["http://[::1/vms", "http://host:port/vms"])
async def test_an_ack_whose_bootstrap_route_is_not_a_url_is_a_bad_frame(route: str) -> None:
    """A publisher's ack naming a route that is not a URL (urljoin or httpx refuses
    it) ends that session like any other bad frame: the listener backs off and
    registers again, it does not stop."""
    registrations: list[dict[str, Any]] = []

    async def handler(ws: ServerConnection) -> None:
        registrations.append(orjson.loads(await ws.recv()))
        ack = {"bootstrapRoute": route, "cursor": "c0", "resumed": False}
        await ws.send(orjson.dumps(ack).decode())
        await ws.wait_closed()

    async with serve(handler, "127.0.0.1", 0) as server:
        url = f"ws://127.0.0.1:{server.sockets[0].getsockname()[1]}/changefeeds"
        async with make_listener(url) as listener:
            await wait_until(lambda: len(registrations) >= 2, 10, message="registers again")
            status = listener.status()
    assert listener.state is ConnectionState.STOPPED  # closed by the block, not crashed
    assert status.aborts >= 1 and "BadPublisherFrame" in (status.last_error or "")
    assert "is not a URL" in (status.last_error or "")


async def test_a_controller_fetches_from_the_route_the_latest_ack_names() -> None:
    """An API that moved its route between two publisher restarts: after a resumed
    reconnect, the default fetch must ask the route the new ack names. The old one
    answers 404, which the controller would take for a delete."""
    registrations: list[dict[str, Any]] = []
    paths: list[str] = []
    vm = {"uuid": "vm-1", "alias": "before"}

    def http(connection: ServerConnection, request: Any) -> Any:
        if not request.path.startswith(("/old/", "/new/")):
            return None  # the websocket
        paths.append(request.path)
        if request.path.startswith("/old/vms?"):
            page = {"items": [vm], "next": None}
            return connection.respond(HTTPStatus.OK, orjson.dumps(page).decode())
        if request.path == "/new/vms/vm-1":
            return connection.respond(HTTPStatus.OK, orjson.dumps(vm).decode())
        return connection.respond(HTTPStatus.NOT_FOUND, '{"error": "not here"}')

    async def handler(ws: ServerConnection) -> None:
        registrations.append(orjson.loads(await ws.recv()))
        first = len(registrations) == 1
        route = "/old/vms" if first else "/new/vms"
        ack = {"bootstrapRoute": route, "cursor": f"c{len(registrations)}", "resumed": not first}
        await ws.send(orjson.dumps(ack).decode())
        if first:
            await wait_until(lambda: bool(controller.mirror), 10, message="bootstrapped")
            await ws.close(CloseCode.GOING_AWAY, "restarting")
            return
        vm["alias"] = "after"
        await ws.send(ChangeItem(VM, "vm-1", "c3", "2026-11-21T23:00:00.000Z").encode())
        await ws.wait_closed()

    async with serve(handler, "127.0.0.1", 0, process_request=http) as server:
        port = server.sockets[0].getsockname()[1]
        listener = make_listener(f"ws://127.0.0.1:{port}/changefeeds")
        controller = Controller(listener)
        async with controller:
            await wait_until(
                lambda: dict(controller.mirror).get("vm-1", {}).get("alias") == "after",
                10,
                message="fetched from the new route",
            )
    assert registrations[1].get("since") == "c1"
    assert "/old/vms/vm-1" not in paths
