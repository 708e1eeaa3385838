"""Every private uvicorn name changefeed uses is listed in one place, and each is checked.

changefeed.uvicorn_private lists them; a uvicorn that renames, removes or
re-signs one fails the test that names it here (CI runs this file on the
newest uvicorn the fast path claims). The last tests keep the list complete:
every ``self.<name>`` the fast path's and the deadlines' code reads of
uvicorn's classes must be in it.
"""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

import pytest

from changefeed import uvicorn_private
from changefeed.uvicorn_private import PRIVATE, Private

CHANGEFEED = Path(__file__).resolve().parent.parent / "changefeed"


@pytest.mark.parametrize("private", PRIVATE, ids=str)
def test_uvicorn_still_has_it(private: Private) -> None:
    assert private.check() is None


def test_a_renamed_name_is_reported_as_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    from uvicorn.protocols.websockets.websockets_sansio_impl import WebSocketsSansIOProtocol

    monkeypatch.delattr(WebSocketsSansIOProtocol, "keepalive_timeout")
    [why] = uvicorn_private.missing("fast")
    assert why.endswith("WebSocketsSansIOProtocol.keepalive_timeout is not a method")
    renamed = Private("fast", PRIVATE[0].owner, "handshake_finished", "attribute", "test")
    assert renamed.check() is not None


def _own_names(source: str) -> set[str]:
    """Names the module defines itself: methods, class attributes (assigned or only
    declared) and slots."""
    slots = re.findall(r"__slots__ = \(([^)]*)\)", source)
    return (
        set(re.findall(r"^\s+(?:async )?def (\w+)", source, re.M))
        | set(re.findall(r"^    (\w+)(?::[^=\n]+)?(?: =|$)", source, re.M))
        | {name for names in slots for name in re.findall(r'"(\w+)"', names)}
    )


def _registered(path: str, owner_suffix: str) -> set[str]:
    return {
        p.name
        for p in PRIVATE
        if p.path == path and p.owner.endswith(owner_suffix) and p.kind != "class"
    }


def test_the_fast_path_reads_no_uvicorn_name_that_is_not_listed() -> None:
    source = (CHANGEFEED / "uvicorn_fastpath.py").read_text()
    used = set(re.findall(r"\b(?:self|protocol)\.(\w+)", source))
    used -= _own_names(source) | set(dir(asyncio.Protocol))
    assert used - _registered("fast", ":WebSocketsSansIOProtocol") == set()


def test_the_deadlines_read_no_uvicorn_name_that_is_not_listed() -> None:
    source = (CHANGEFEED / "http_timeouts.py").read_text()
    used = set(re.findall(r"\bself\.(\w+)", source)) - _own_names(source)
    used -= set(dir(asyncio.Protocol))
    protocols = _registered("deadlines", ":HttpToolsProtocol") | _registered(
        "deadlines", ":H11Protocol"
    )
    assert used - protocols == set()
    cycle = set(re.findall(r"\bcycle\.(\w+)", source))
    assert cycle - _registered("deadlines", ":RequestResponseCycle") == set()
    flow = set(re.findall(r"\bflow\.(\w+)", source))
    assert flow - _registered("deadlines", ":FlowControl") == set()


def test_changefeeds_own_server_reads_no_uvicorn_name_that_is_not_listed() -> None:
    """DrainingServer's own uses of uvicorn.Server, and the CLI's servers' (cli,
    demo, standalone: whether start-up succeeded, the demo's stop and port)."""
    source = (CHANGEFEED / "serving.py").read_text()
    start = source.index("class DrainingServer")
    following = re.search(r"^(?:def|class|async def) ", source[start + 1 :], re.M)
    body = source[start:] if following is None else source[start : start + 1 + following.start()]
    used = set(re.findall(r"\bself\.(\w+)", body)) - _own_names(body)
    used -= set(re.findall(r"\bself\.(\w+)\s*(?::[^=\n]+)?=(?!=)", body))  # its own state
    server_names = uvicorn_private._assigned("uvicorn.server:Server")
    assert server_names is not None
    for module in ("cli.py", "demo.py", "standalone.py"):
        text = (CHANGEFEED / module).read_text()
        used |= set(re.findall(r"\b(?:server|runner)\.(\w+)", text)) & server_names
    assert {"servers", "started", "should_exit"} <= used  # the scan sees them
    assert used - _registered("serve", ":Server") == set()


def test_changefeeds_own_server_refuses_a_uvicorn_without_what_it_uses(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``changefeed serve``, ``example-api`` and the demo drain on uvicorn's private
    steps: a uvicorn without one is refused before anything is served, naming it,
    not found out at the first SIGTERM."""
    import uvicorn

    from changefeed.serving import DrainingServer, UnsupportedUvicorn

    async def app(scope: object, receive: object, send: object) -> None:
        raise AssertionError("never served")

    config = uvicorn.Config(app, host="127.0.0.1", port=0)
    DrainingServer(config, [])  # the installed uvicorn has them all
    monkeypatch.delattr(uvicorn.Server, "capture_signals")
    with pytest.raises(UnsupportedUvicorn, match=r"Server\.capture_signals is not a method"):
        DrainingServer(config, [])
    monkeypatch.undo()
    # An attribute its check cannot see in uvicorn's source is not refused at start:
    # that check is the tests' (above), on the newest uvicorn.
    monkeypatch.setattr(uvicorn_private, "_assigned", lambda owner: frozenset())
    DrainingServer(config, [])
