"""The uvicorn fast path: checked once, logged, and never required.

``FanoutWebSocketProtocol`` borrows private parts of uvicorn's websocket
protocol for direct frame writes. pyproject pins the uvicorn versions CI runs;
the parts are checked once per process, and the path in use is logged. A
uvicorn without them gets uvicorn's own behaviour and ASGI sends, and the
publisher serves the same.
"""

from __future__ import annotations

import logging

import pytest
from publisher_fixtures import receive_items, register, registration, running_publisher, write
from starlette.applications import Starlette

from changefeed import serving


def test_the_pinned_uvicorn_has_everything_direct_writes_borrow() -> None:
    assert serving.direct_writes_unsupported() is None


def test_server_config_logs_which_path_is_active(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="changefeed")
    serving.server_config(Starlette(), "127.0.0.1", 0)
    monkeypatch.setattr(serving, "direct_writes_unsupported", lambda: "uvicorn 9.9 lacks writable")
    serving.server_config(Starlette(), "127.0.0.1", 0)
    paths = [
        (r.cf_fields["path"], r.cf_fields["why"])  # type: ignore[attr-defined]
        for r in caplog.records
        if r.getMessage() == "serving.fanout_path"
    ]
    assert paths == [("direct writes", None), ("ASGI sends", "uvicorn 9.9 lacks writable")]


async def test_without_the_borrowed_parts_the_publisher_serves_through_asgi(
    feed_dsn: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="changefeed")
    monkeypatch.setattr(serving, "direct_writes_unsupported", lambda: "uvicorn 9.9 lacks writable")
    async with running_publisher(feed_dsn, ws="direct") as pub:
        ws, _ = await register(pub.ws_url, registration(subs=[]))
        await write(feed_dsn, [("vm", [], f"asgi-{i}") for i in range(20)])
        items = await receive_items(ws, 20)
        assert [i["changedResourceId"] for i in items] == [f"asgi-{i}" for i in range(20)]
        assert pub.publisher.sessions.direct_writes is False
        await ws.close()
    paths = [
        r.cf_fields["path"]  # type: ignore[attr-defined]
        for r in caplog.records
        if r.getMessage() == "fanout.path"
    ]
    assert paths == ["ASGI sends"]
