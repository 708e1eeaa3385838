"""Limits and bad input (invariant I6): every violation gets its error frame and its
documented close code (schemas/closecodes.py), and the publisher keeps serving
everyone else: a listener registered before each violation still receives items.

Also: the HTTP routes' query parameters, per-registration stats and Prometheus
metrics under churn (connects and disconnects counted exactly, nothing leaked).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import random
import socket
import struct
from typing import Any

import httpx
import orjson
import pytest
from helpers import metric_value, wait_until
from publisher_fixtures import (
    PublisherUnderTest,
    receive_items,
    register,
    registration,
    running_publisher,
    write,
)
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed

from changefeed.publisher.registry import Session
from changefeed.schemas import ERROR_CLOSE_CODES, validate


async def expect_refusal(ws: ClientConnection, code: str, first: Any = None) -> None:
    """The next frame is an error with ``code``, then the close with its documented code."""
    error = first if first is not None else orjson.loads(await asyncio.wait_for(ws.recv(), 10))
    validate("error", error)
    assert error["error"]["code"] == code, error
    with pytest.raises(ConnectionClosed) as closed:
        await asyncio.wait_for(ws.recv(), 10)
    assert closed.value.rcvd is not None
    assert closed.value.rcvd.code == ERROR_CLOSE_CODES[code]


async def still_serving(pub: PublisherUnderTest, good: ClientConnection, tag: str) -> None:
    """The listener registered before the bad input still gets new items."""
    await write(pub.dsn, [("vm", ["nic"], tag)])
    async with asyncio.timeout(10):
        while (await receive_items(good, 1))[0]["changedResourceId"] != tag:
            pass


def _long(n: int) -> str:
    return "x" * n


BAD_REGISTRATIONS: list[tuple[str, Any, str]] = [
    # (name, frame document or raw text, expected error code)
    ("instance too long", {"instance": _long(257)}, "invalid_registration"),
    ("service too long", {"service": _long(257)}, "invalid_registration"),
    ("empty instance", {"instance": ""}, "invalid_registration"),
    ("instance not a string", {"instance": 42}, "invalid_registration"),
    ("service not a string", {"service": ["tcns"]}, "invalid_registration"),
    (
        "resource name too long",
        {"changeKind": {"resource": _long(65), "subResources": []}},
        "invalid_registration",
    ),
    (
        "resource not a string",
        {"changeKind": {"resource": None, "subResources": []}},
        "invalid_registration",
    ),
    (
        "subResources not a list",
        {"changeKind": {"resource": "vm", "subResources": "nic"}},
        "invalid_registration",
    ),
    (
        "too many subResources",
        {"changeKind": {"resource": "vm", "subResources": ["nic"] * 33}},
        "invalid_registration",
    ),
    (
        "subResource not a name",
        {"changeKind": {"resource": "vm", "subResources": ["n i c"]}},
        "invalid_registration",
    ),
    ("changeKind missing", {"changeKind": None}, "invalid_registration"),
    ("service missing", {"service": None}, "invalid_registration"),
    ("instance missing", {"instance": None}, "invalid_registration"),
    ("extra field", {"extra": 1}, "invalid_registration"),
    ("batch not a boolean", {"batch": "yes"}, "invalid_registration"),
    ("since not a string", {"since": 12}, "invalid_registration"),
    ("since too long", {"since": _long(129)}, "invalid_registration"),
    ("since not a cursor", {"since": "AAAA"}, "bad_cursor"),
    ("both forms", {"resources": [{"resource": "vm", "subResources": []}]}, "invalid_registration"),
    (
        "unknown resource",
        {"changeKind": {"resource": "disk", "subResources": []}},
        "unknown_resource",
    ),
    ("not an object", "[]", "invalid_registration"),
    ("not JSON", "{", "bad_frame"),
    ("huge string", {"instance": _long(60000)}, "invalid_registration"),
]


def _frame(doc: Any) -> str:
    if isinstance(doc, str):
        return doc
    base = orjson.loads(registration())
    for key, value in doc.items():
        if value is None:
            base.pop(key, None)
        else:
            base[key] = value
    return orjson.dumps(base).decode()


async def test_every_bad_registration_gets_its_error_and_close_code(feed_dsn: str) -> None:
    async with running_publisher(feed_dsn) as pub:
        good, _ = await register(pub.ws_url, registration(subs=["nic"]))
        for name, doc, code in BAD_REGISTRATIONS:
            ws, first = await register(pub.ws_url, _frame(doc))
            try:
                await expect_refusal(ws, code, first)
            except AssertionError as exc:
                raise AssertionError(f"{name}: {exc}") from exc
        await still_serving(pub, good, "after-bad-registrations")
        refused = pub.publisher.stats()["counters"]["refused"]
        assert sum(refused.values()) == len(BAD_REGISTRATIONS)
        await good.close()


async def test_an_undeclared_sub_resource_is_accepted_and_warned_about(feed_dsn: str) -> None:
    """The config's sub-resources are advertised, not enforced on writers: a listener
    asking for another one (an RFD 5 listener, a typo) is served, and logged."""
    records: list[logging.LogRecord] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    logger = logging.getLogger("changefeed")
    handler = Collect(logging.WARNING)
    logger.addHandler(handler)
    try:
        async with running_publisher(feed_dsn) as pub:
            ws, ack = await register(pub.ws_url, registration(subs=["tags"]))
            assert ack["bootstrapRoute"] == "/vms"
            await write(feed_dsn, [("vm", ["tags"], "tagged")])
            (item,) = await receive_items(ws, 1)
            assert item["changedResourceId"] == "tagged"
            await ws.close()
    finally:
        logger.removeHandler(handler)
    (warning,) = [r for r in records if r.getMessage() == "registration.undeclared_sub_resources"]
    assert warning.cf_fields["undeclared"] == ["tags"]  # type: ignore[attr-defined]


async def test_frame_size_limits(feed_dsn: str) -> None:
    async with running_publisher(feed_dsn, max_frame_bytes=1024) as pub:
        good, _ = await register(pub.ws_url, registration(subs=["nic"]))
        # A registration over the limit...
        ws, first = await register(pub.ws_url, registration(service="s" * 2000))
        await expect_refusal(ws, "frame_too_large", first)
        # ...and any later frame over it (the 1024 bytes are in UTF-8).
        ws, _ = await register(pub.ws_url, registration())
        await ws.send("é" * 600)
        await expect_refusal(ws, "frame_too_large")
        ws, _ = await register(pub.ws_url, registration())
        await ws.send(b"\0" * 2000)
        await expect_refusal(ws, "frame_too_large")
        # Small frames of any kind after registration are fine (heartbeats).
        ws, _ = await register(pub.ws_url, registration())
        await ws.send("heartbeat")
        await ws.send(b"\x01\x02")
        await still_serving(pub, good, "after-big-frames")
        (item,) = await receive_items(ws, 1)
        assert item["changedResourceId"] == "after-big-frames"
        # Each violation is counted, before registration and after it.
        assert pub.publisher.stats()["counters"]["refused"]["frame_too_large"] == 3
        await ws.close()
        await good.close()


async def test_a_frame_over_the_servers_own_limit_gets_the_same_refusal(feed_dsn: str) -> None:
    """Past uvicorn's ws_max_size the server refuses the frame from its header,
    before the publisher could see it: the listener still gets the error frame and
    4006, not a bare 1009 (changefeed.serving.FanoutWebSocketProtocol)."""
    limit = 256 * 1024
    async with running_publisher(feed_dsn, server={"ws_max_size": limit}) as pub:
        good, _ = await register(pub.ws_url, registration(subs=["nic"]))
        # As the registration...
        ws = await connect(pub.ws_url, open_timeout=10)
        await ws.send(registration(service="s" * limit))
        await expect_refusal(ws, "frame_too_large")
        assert pub.publisher.stats()["counters"]["refused"]["frame_too_large"] == 1
        # ...and once registered, in text or in binary.
        for frame in ("é" * limit, b"\0" * (limit + 1)):
            ws, _ = await register(pub.ws_url, registration())
            await ws.send(frame)
            await expect_refusal(ws, "frame_too_large")
        await still_serving(pub, good, "after-oversized-frames")
        stats = pub.publisher.stats()
        assert stats["listeners"] == 1, stats
        assert stats["counters"]["refused"]["frame_too_large"] == 3
        await good.close()


async def send_text_bytes(ws: ClientConnection, data: bytes) -> None:
    """Send ``data`` as a text frame as it is, UTF-8 or not (websockets' own
    ``send`` encodes a str and cannot send a text frame that is not UTF-8)."""
    async with ws.send_context():
        ws.protocol.send_text(data)


@pytest.mark.parametrize("ws_kind", ["direct", "asgi"])
async def test_a_text_frame_that_is_not_utf8_is_a_bad_frame(feed_dsn: str, ws_kind: str) -> None:
    """With changefeed's protocol, as the registration or after it: the publisher's
    error frame and 4000, counted, and no error logged (uvicorn's own protocol logs
    a traceback for each and closes with a bare 1007)."""
    records: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    keep = Keep(logging.ERROR)
    logging.getLogger().addHandler(keep)
    try:
        async with running_publisher(feed_dsn, ws=ws_kind) as pub:
            good, _ = await register(pub.ws_url, registration(subs=["nic"]))
            ws = await connect(pub.ws_url, open_timeout=10)
            await send_text_bytes(ws, b'{"instance": "\xff\xfe"}')
            if ws_kind == "direct":
                await expect_refusal(ws, "bad_frame")
                ws, _ = await register(pub.ws_url, registration())
                await send_text_bytes(ws, b"\xc0\xaf")
                await expect_refusal(ws, "bad_frame")
                assert pub.publisher.stats()["counters"]["refused"]["bad_frame"] == 2
            else:
                with pytest.raises(ConnectionClosed) as closed:
                    await asyncio.wait_for(ws.recv(), 10)
                assert closed.value.rcvd is not None and closed.value.rcvd.code == 1007
            await still_serving(pub, good, "after-bad-utf8")
            await good.close()
    finally:
        logging.getLogger().removeHandler(keep)
    if ws_kind == "direct":
        assert not records, [r.getMessage() for r in records]


@pytest.mark.parametrize(
    "padding",
    [
        b"X-Pad: " + b"x" * 9000 + b"\r\n",  # a header line websockets will not read
        b"".join(b"X-Pad-%d: x\r\n" % n for n in range(200)),  # too many headers
    ],
    ids=["long-line", "many-headers"],
)
async def test_a_handshake_websockets_cannot_parse_is_answered_and_closed(
    feed_dsn: str, padding: bytes
) -> None:
    """httptools takes such a head and hands it to the websocket protocol, which
    ends the head's deadline; websockets refuses it without an event, and uvicorn
    would neither answer nor close: a peer without a token would hold the socket
    for good. FanoutWebSocketProtocol writes websockets' answer and closes."""
    async with running_publisher(feed_dsn) as pub:
        good, _ = await register(pub.ws_url, registration(subs=["nic"]))
        reader, writer = await asyncio.open_connection("127.0.0.1", pub.server.port)
        try:
            writer.write(
                b"GET /changefeeds HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\n"
                b"Connection: Upgrade\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n"
                b"Sec-WebSocket-Version: 13\r\n" + padding + b"\r\n"
            )
            answer = await asyncio.wait_for(reader.read(), 10)  # read() returns at EOF only
        finally:
            writer.close()
        assert answer.startswith(b"HTTP/1.1 431 "), answer
        await still_serving(pub, good, "after-unparsable-handshake")
        await good.close()


async def test_a_binary_registration_is_a_bad_frame(feed_dsn: str) -> None:
    async with running_publisher(feed_dsn) as pub:
        ws = await connect(pub.ws_url)
        await ws.send(registration().encode())
        await expect_refusal(ws, "bad_frame")


async def test_registration_limits_per_connection_and_process(feed_dsn: str) -> None:
    async with running_publisher(
        feed_dsn, max_registrations=2, max_connections=3, registration_timeout=0.5
    ) as pub:
        three = orjson.dumps(
            {
                "instance": "i",
                "service": "s",
                "resources": [
                    {"resource": "vm", "subResources": ["nic"]},
                    {"resource": "vm", "subResources": ["alias"]},
                    {"resource": "network", "subResources": []},
                ],
            }
        ).decode()
        ws, first = await register(pub.ws_url, three)
        await expect_refusal(ws, "too_many_registrations", first)
        held = [(await register(pub.ws_url, registration()))[0] for _ in range(3)]
        # Refused before the registration is read: the error comes unasked.
        ws = await connect(pub.ws_url)
        await expect_refusal(ws, "too_many_connections")
        await held[0].close()
        await wait_until(lambda: pub.publisher.connections == 2)
        ws, ack = await register(pub.ws_url, registration())  # room again
        assert ack["bootstrapRoute"] == "/vms"
        held[0] = ws
        # A silent connection is closed after registration_timeout: and it counted.
        await held[1].close()
        await wait_until(lambda: pub.publisher.connections == 2)
        silent = await connect(pub.ws_url)
        await expect_refusal(silent, "registration_timeout")
        await still_serving(pub, held[2], "after-limits")
        for ws in held:
            await ws.close()


async def test_http_query_parameters_are_validated(feed_dsn: str) -> None:
    async with (
        running_publisher(feed_dsn) as pub,
        httpx.AsyncClient(base_url=pub.server.url) as http,
    ):
        good, _ = await register(pub.ws_url, registration())
        for path in (
            "/changefeeds?x=1",
            "/changefeeds/stats?limit=-1",
            "/changefeeds/stats?limit=abc",
            "/changefeeds/stats?limit=%C2%B2",  # '²': str.isdigit, but not int()
            "/changefeeds/stats?limit=1&limit=2",
            "/changefeeds/stats?resource=disk",
            "/changefeeds/stats?service=" + "s" * 300,
            "/changefeeds/stats?%00=1",
        ):
            response = await http.get(path)
            assert response.status_code == 400, path
            validate("error", response.json())
            assert response.json()["error"]["code"] == "bad_request"
        stats = (await http.get("/changefeeds/stats?resource=vm&service=tcns&limit=0")).json()
        assert stats["registrations"] == [] and stats["truncated"] is True
        # Each refusal names its peer and path, as a refused token's does.
        refusals = (await http.get("/changefeeds/stats")).json()["recentRefusals"]
        assert len(refusals) == 8 and all(r["code"] == "bad_request" for r in refusals)
        assert all(r["peer"].startswith("127.0.0.1:") for r in refusals), refusals
        assert refusals[-1]["reason"].startswith("/changefeeds/stats: "), refusals[-1]
        stats = (await http.get("/changefeeds/stats?resource=network")).json()
        assert stats["registrations"] == [] and stats["listeners"] == 1
        stats = (await http.get("/changefeeds/stats?resource=vm")).json()
        assert len(stats["registrations"]) == 1
        # /metrics, /healthz and /readyz take no parameters, and ignore them.
        assert (await http.get("/healthz?x=1")).status_code == 200
        await still_serving(pub, good, "after-bad-queries")
        await good.close()


# --------------------------------------------------------------------------- churn


async def _abort(ws: ClientConnection) -> None:
    """Drop the TCP connection without a close handshake (RST)."""
    transport = ws.transport
    sock = transport.get_extra_info("socket")
    if sock is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    transport.abort()


async def test_stats_and_metrics_stay_exact_under_churn(feed_dsn: str) -> None:
    """Hundreds of connections end in every way a connection can end; afterwards
    every counter adds up, no session, task or registration is left behind, and
    the metrics agree with the stats."""
    rng = random.Random(5)
    # The silent ones wait out registration_timeout; 1 s, not less: on a loaded
    # machine a client's frame can take longer than 0.3 s to be read, and the
    # test is about counters adding up, not about that race.
    async with (
        running_publisher(feed_dsn, registration_timeout=1.0) as pub,
        httpx.AsyncClient(base_url=pub.server.url) as http,
    ):
        publisher = pub.publisher
        # max_queue=None: the keeper's client reads (and answers pings) whatever it holds.
        keeper, _ = await register(pub.ws_url, registration(subs=["nic"]), max_queue=None)
        tasks_before = len(asyncio.all_tasks())
        registered = 0
        cycles = 300

        async def one(i: int) -> int:
            ending = rng.choice(
                [
                    "close",
                    "abort",
                    "abort-before-registering",
                    "close-before-registering",
                    "bad",
                    "silent",
                    "close-during-items",
                    "v2",
                ]
            )
            if ending == "v2":
                frame = orjson.dumps(
                    {
                        "instance": f"i{i}",
                        "service": "churn",
                        "resources": [
                            {"resource": "vm", "subResources": []},
                            {"resource": "network", "subResources": []},
                        ],
                    }
                ).decode()
            else:
                frame = registration(subs=[], instance=f"i{i}", service="churn")
            ws = await connect(pub.ws_url, open_timeout=10)
            if ending == "abort-before-registering":
                await _abort(ws)
                return 0
            if ending == "close-before-registering":
                await ws.close()
                return 0
            if ending == "silent":
                with pytest.raises(ConnectionClosed):
                    async with asyncio.timeout(10):
                        while True:
                            await ws.recv()
                return 0
            await ws.send("{" if ending == "bad" else frame)
            reply = orjson.loads(await asyncio.wait_for(ws.recv(), 10))
            if ending == "bad":
                assert "error" in reply
                await ws.close()
                return 0
            if "error" in reply:
                # Only the race the comment above describes: a registration
                # read after registration_timeout is refused, and not counted.
                assert reply["error"]["code"] == "registration_timeout", reply
                await ws.close()
                return 0
            if ending == "close-during-items":
                await write(pub.dsn, [("vm", [], f"churn{i}")])
                await ws.recv()
            if ending == "abort":
                await _abort(ws)
            else:
                await ws.close()
            return 1

        for start in range(0, cycles, 25):
            registered += sum(await asyncio.gather(*(one(i) for i in range(start, start + 25))))
        await wait_until(lambda: publisher.connections == 1, timeout=30)
        await wait_until(lambda: len(publisher.registry) == 1, timeout=30)

        stats = (await http.get("/changefeeds/stats")).json()
        counters = stats["counters"]
        assert stats["listeners"] == 1 and stats["connections"] == 1
        assert counters["connections"] == cycles + 1
        assert counters["connectionsClosed"] == cycles
        # The keeper and every churn connection that registered; all but the keeper gone.
        assert counters["listeners"] == registered + 1
        assert counters["disconnects"] == registered
        metrics = (await http.get("/metrics")).text
        assert metric_value(metrics, "changefeed_listeners") == 1
        assert metric_value(metrics, "changefeed_open_connections") == 1
        assert metric_value(metrics, "changefeed_active_registrations", resource="vm") == 1
        assert metric_value(metrics, "changefeed_active_registrations", resource="network") == 0
        assert metric_value(metrics, "changefeed_connections_total") == cycles + 1
        assert metric_value(metrics, "changefeed_disconnects_total") == counters["disconnects"]
        # Nothing leaked: no session objects but the keeper's, no extra tasks.
        await wait_until(lambda: len(asyncio.all_tasks()) <= tasks_before, timeout=10)
        gc.collect()
        alive = [o for o in gc.get_objects() if isinstance(o, Session)]
        assert len(alive) == 1
        await still_serving(pub, keeper, "after-churn")
        await keeper.close()


async def test_refusals_echo_a_bounded_part_of_the_input(
    feed_dsn: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A 60 KB instance, or a 5 KB unknown key, is refused without being sent back
    whole in the error frame or written whole in the log line."""
    caplog.set_level(logging.WARNING, logger="changefeed")
    registration_doc = {
        "instance": "de1aac97-6f85-4ba9-b51e-514f48a6a46c",
        "service": "tcns",
        "changeKind": {"resource": "vm", "subResources": []},
    }
    huge = [
        {**registration_doc, "instance": _long(60_000)},
        {**registration_doc, _long(5_000): True},
        {**registration_doc, "service": "\u00e9" * 20_000},
    ]
    async with running_publisher(feed_dsn) as pub:
        for doc in huge:
            ws, error = await register(pub.ws_url, _frame(doc))
            await expect_refusal(ws, "invalid_registration", error)
            assert len(error["error"]["message"]) <= 300, error
        reasons = [
            r.cf_fields["reason"]  # type: ignore[attr-defined]
            for r in caplog.records
            if r.getMessage() == "registration.refused"
        ]
        assert len(reasons) == len(huge) and all(len(r) <= 300 for r in reasons), reasons


def _client_frame(opcode: int, payload: bytes) -> bytes:
    """A masked client frame (payload under 64 KiB)."""
    mask = random.randbytes(4)
    data = bytes(b ^ mask[i % 4] for i, b in enumerate(payload))
    size = len(payload)
    head = bytes([0x80 | opcode])  # FIN
    length = bytes([0x80 | size]) if size < 126 else bytes([0x80 | 126]) + struct.pack("!H", size)
    return head + length + mask + data


@pytest.mark.parametrize("ws", ["direct", "asgi"])
async def test_a_listener_that_takes_not_even_its_ack_is_let_go_within_bounded_time(
    feed_dsn: str, ws: str
) -> None:
    """A client pings in a burst with its registration and never reads: the answers
    to its pings fill the server's buffers. Through plain ASGI the registration is
    read and the ack cannot be written: that send has a deadline, as nothing else can
    end the connection (without one, its socket and registration are held until the
    peer hangs up); it is an eviction like any other (``recentEvictions``) within
    ``stall_timeout``. The fast path stops reading a
    peer it cannot write to, so the registration never comes: the connection goes
    at ``registration_timeout`` plus ``close_timeout``."""
    async with running_publisher(
        feed_dsn,
        ws=ws,
        stall_timeout=1.0,
        registration_timeout=1.0,
        close_timeout=1.0,
        server={"ws_ping_interval": 1.0},
    ) as pub:
        port = pub.server.port

        def flood() -> socket.socket:
            sock = socket.socket()
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            sock.connect(("127.0.0.1", port))
            sock.sendall(
                b"GET /changefeeds HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\n"
                b"Connection: Upgrade\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n"
                b"Sec-WebSocket-Version: 13\r\n\r\n"
            )
            sock.recv(4096)  # the 101; nothing is read after it
            burst = _client_frame(0x9, b"p" * 125) * 30_000
            burst += _client_frame(0x1, registration().encode())
            sock.settimeout(10)
            with contextlib.suppress(OSError):  # the server may stop reading first
                sock.sendall(burst)
            return sock

        sock = await asyncio.to_thread(flood)
        try:
            publisher = pub.publisher
            await wait_until(
                lambda: publisher.stats()["connections"] == 0,
                timeout=30,
                message="the connection is let go",
            )
            assert len(publisher.registry) == 0
            if ws == "asgi":
                assert publisher.counters.evictions["slow_listener"] == 1
                (evicted,) = publisher.stats()["recentEvictions"]
                assert "ack" in evicted["reason"], evicted
        finally:
            sock.close()
