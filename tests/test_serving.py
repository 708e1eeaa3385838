"""The fast path on uvicorn: used only where it was tested, checked once, and never required.

Plain ASGI is the default (``server_config`` without ``fast_path``). The fast
path (``FanoutWebSocketProtocol``) and the request deadlines
(changefeed.http_timeouts) run only on a uvicorn in ``TESTED_UVICORN`` that
still has every private name they use and passes a self-check that runs
them once; anything else gets uvicorn's own protocols, and one log line
saying why (changefeed.fast_path).
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import Iterator
from pathlib import Path

import httpx
import orjson
import pytest
from helpers import free_port
from starlette.applications import Starlette
from test_deploy_support import ChangefeedServer, stopping, toml_document

from changefeed import fast_path, serving
from changefeed.file_limit import RESERVE
from changefeed.http_timeouts import head_timeout_protocol
from changefeed.uvicorn_fastpath import FanoutWebSocketProtocol


@pytest.fixture
def fresh_verdicts() -> Iterator[None]:
    """Verdicts are made once per process: each test here makes its own, and leaves
    the real ones to be made again."""
    fast_path.fast_path.cache_clear()
    fast_path.deadlines.cache_clear()
    yield
    fast_path.fast_path.cache_clear()
    fast_path.deadlines.cache_clear()


def _verdict_lines(
    caplog: pytest.LogCaptureFixture, event: str
) -> list[tuple[str, str, str | None]]:
    return [
        (r.levelname, r.cf_fields["path"], r.cf_fields["why"])  # type: ignore[attr-defined]
        for r in caplog.records
        if r.getMessage() == event
    ]


def test_the_newest_uvicorn_ci_runs_passes_every_check(
    fresh_verdicts: None, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="changefeed")
    assert fast_path.fast_path().ok, fast_path.fast_path().why_not
    assert fast_path.deadlines().ok, fast_path.deadlines().why_not
    fast_path.fast_path()  # once per process: no second line
    assert _verdict_lines(caplog, "serving.fast_path") == [("INFO", "direct writes", None)]
    assert serving.FanoutWebSocketProtocol is FanoutWebSocketProtocol


def test_server_config_is_plain_asgi_unless_asked() -> None:
    plain = serving.server_config(Starlette(), "127.0.0.1", 0)
    assert plain.ws == serving.PLAIN_WS
    assert plain.http == "auto"
    fast = serving.server_config(Starlette(), "127.0.0.1", 0, fast_path=True, head_timeout=7.5)
    assert fast.ws is FanoutWebSocketProtocol
    assert fast.http is head_timeout_protocol(7.5)
    with pytest.raises(ValueError, match="positive"):
        serving.server_config(Starlette(), "127.0.0.1", 0, head_timeout=0)


def test_a_uvicorn_outside_the_tested_range_gets_plain_asgi_and_one_warning(
    fresh_verdicts: None, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="changefeed")
    monkeypatch.setattr(fast_path, "uvicorn_version", lambda: "0.55.0")
    config = serving.server_config(Starlette(), "127.0.0.1", 0, fast_path=True, head_timeout=5)
    assert config.ws == serving.PLAIN_WS
    assert config.http == "auto"
    why = "uvicorn 0.55.0 is outside the tested versions (>=0.54,<0.55)"
    assert _verdict_lines(caplog, "serving.fast_path") == [("WARNING", "plain ASGI", why)]
    assert _verdict_lines(caplog, "serving.deadlines") == [
        ("WARNING", "none (the proxy's job)", why)
    ]
    from uvicorn.protocols.websockets.websockets_sansio_impl import WebSocketsSansIOProtocol

    assert serving.FanoutWebSocketProtocol is WebSocketsSansIOProtocol
    assert serving.fast_path_unavailable() == why


def test_a_uvicorn_without_a_name_the_fast_path_uses_gets_plain_asgi(
    fresh_verdicts: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    from uvicorn.protocols.websockets.websockets_sansio_impl import WebSocketsSansIOProtocol

    monkeypatch.delattr(WebSocketsSansIOProtocol, "send_keepalive_ping")
    why = serving.fast_path_unavailable()
    assert why is not None and "send_keepalive_ping is not a method" in why
    assert (
        serving.server_config(Starlette(), "127.0.0.1", 0, fast_path=True).ws == "websockets-sansio"
    )


def test_the_self_check_runs_the_fast_path_and_refuses_one_that_misbehaves(
    fresh_verdicts: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A uvicorn whose names all match but whose behaviour changed underneath: the
    self-check sees the bare 1009 it would now send instead of 4006."""
    from uvicorn.protocols.websockets.websockets_sansio_impl import WebSocketsSansIOProtocol

    monkeypatch.setattr(
        FanoutWebSocketProtocol,
        "handle_parser_exception",
        WebSocketsSansIOProtocol.handle_parser_exception,
    )
    why = serving.fast_path_unavailable()
    assert why == "its self-check failed: a bad frame was closed with 1009, not 4006"


def test_the_deadlines_self_check_refuses_deadlines_that_never_fire(
    fresh_verdicts: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    from changefeed import http_timeouts

    monkeypatch.setattr(http_timeouts._HeadDeadline, "_arm_head_deadline", lambda self: None)
    why = fast_path.deadlines().why_not
    assert why is not None and "half a head was not answered 408" in why
    assert serving.server_config(Starlette(), "127.0.0.1", 0, head_timeout=5).http == "auto"


@pytest.mark.parametrize(("nofile", "raised"), [("200:20000", True), ("200:200", False)])
async def test_a_server_process_raises_its_file_limit_or_says_it_cannot(
    feed_dsn: str, tmp_path: Path, nofile: str, raised: bool
) -> None:
    """``changefeed serve`` holds up to ``max_connections`` (10,000) sockets: started
    with a soft limit of 200 files it raises it as far as its hard limit allows, and
    where that is too low it says so, once, at start (connections past the limit
    are dropped by accept() without a word)."""
    port = free_port()
    config = tmp_path / "changefeed.toml"
    config.write_text(
        toml_document(
            {"dsn": feed_dsn}, [{"name": "vm", "bootstrap_route": "/vms"}], {"port": port}
        )
    )
    server = ChangefeedServer.standalone("serve", config, port, tmp_path)
    server.argv = ["prlimit", f"--nofile={nofile}", "--", *server.argv]
    async with stopping(server):
        server.start()
        await server.wait_ready()
        limits = await asyncio.to_thread(Path(f"/proc/{server.pid}/limits").read_text)
        (line,) = [row for row in limits.splitlines() if row.startswith("Max open files")]
        soft = int(line.split()[3])
        warnings = [
            orjson.loads(row)
            for row in server.log().splitlines()
            if '"event":"serving.file_limit"' in row
        ]
        if raised:
            assert soft == 10_000 + RESERVE and warnings == []
        else:
            assert soft == 200
            (warning,) = warnings
            assert warning["level"] == "warning"
            assert warning["limit"] == 200 and warning["wanted"] == 10_000 + RESERVE


_ANNOUNCED = re.compile(r"on http://127\.0\.0\.1:(\d+)")


@pytest.mark.parametrize("command", ["example-api", "serve"])
async def test_a_server_asked_for_port_0_names_the_port_it_got(
    feed_dsn: str, tmp_path: Path, command: str
) -> None:
    """``--port 0`` lets the system pick a free port; the line a server prints once
    listening names that port (which is where it answers), not 0."""
    if command == "serve":
        config = tmp_path / "changefeed.toml"
        config.write_text(
            toml_document({"dsn": feed_dsn}, [{"name": "vm", "bootstrap_route": "/vms"}])
        )
        server = ChangefeedServer.standalone(command, config, 0, tmp_path)
    else:
        server = ChangefeedServer.example_api(command, feed_dsn, 0, tmp_path)
    async with stopping(server), httpx.AsyncClient(timeout=2.0) as client:
        server.start()
        async with asyncio.timeout(30):
            while not (found := _ANNOUNCED.search(server.log())):
                assert server.alive(), server.log()
                await asyncio.sleep(0.05)
            port = int(found.group(1))
            assert port != 0
            # Announced once listening: it answers at once.
            assert (await client.get(f"http://127.0.0.1:{port}/healthz")).status_code == 200
