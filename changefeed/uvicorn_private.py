"""Every private uvicorn name changefeed uses, in one place, each with its check.

uvicorn documents its settings (``uvicorn.Config``), ``uvicorn.Server``'s
``serve()``, and that ``ws`` and ``http`` take a protocol class (an import
string on the command line since 0.36). Everything else below is uvicorn's
own business and may change in any release. changefeed uses these names only
on its optional paths, never on the default one (plain ASGI):

* ``fast``: the fan-out's direct writes and the websocket protections of
  ``changefeed.uvicorn_fastpath.FanoutWebSocketProtocol``, a subclass of
  uvicorn's websockets sans-I/O protocol;
* ``deadlines``: the request head's and body's deadlines of
  ``changefeed.http_timeouts``, subclasses of uvicorn's HTTP protocols;
* ``serve``: ``changefeed.serving.DrainingServer`` (the CLI's own server),
  which drains publishers between uvicorn's start-up and shut-down steps.

``missing(path)`` says which of a path's names the installed uvicorn lacks
(checked on uvicorn's classes and their source, without running anything);
changefeed.fast_path uses it before its self-check, ``DrainingServer`` refuses
to start without the methods it extends (``UnsupportedUvicorn``), and
tests/test_uvicorn_private.py checks each name on its own, so that a uvicorn
that renames one fails the test that names it.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import re
from dataclasses import dataclass
from typing import Literal

__all__ = ["PRIVATE", "Kind", "Path", "Private", "missing"]

Path = Literal["fast", "deadlines", "serve"]
Kind = Literal["class", "method", "attribute"]

_SANSIO = "uvicorn.protocols.websockets.websockets_sansio_impl:WebSocketsSansIOProtocol"
_HTTPTOOLS = "uvicorn.protocols.http.httptools_impl:HttpToolsProtocol"
_H11 = "uvicorn.protocols.http.h11_impl:H11Protocol"
_CYCLE_HTTPTOOLS = "uvicorn.protocols.http.httptools_impl:RequestResponseCycle"
_CYCLE_H11 = "uvicorn.protocols.http.h11_impl:RequestResponseCycle"
_FLOW = "uvicorn.protocols.http.flow_control:FlowControl"
_SERVER = "uvicorn.server:Server"
_STATE = "uvicorn.server:ServerState"
_CONFIG = "uvicorn.config:Config"


@dataclass(frozen=True)
class Private:
    """One private name: ``owner`` (``module:Class``), and ``name`` in it."""

    path: Path
    owner: str
    name: str
    kind: Kind
    use: str
    """What changefeed does with it."""
    parameters: tuple[str, ...] = ()
    """A method's parameters after ``self`` that changefeed passes or receives."""

    def __str__(self) -> str:
        return self.owner if self.kind == "class" else f"{self.owner}.{self.name}"

    def absent_library(self) -> str | None:
        """The library (not uvicorn) that ``owner``'s module needs and that is not
        installed, such as ``httptools`` without ``uvicorn[standard]``; None when
        the module loads, or fails for another reason."""
        try:
            _load(self.owner)
        except ModuleNotFoundError as exc:
            if exc.name is not None and exc.name.split(".")[0] != "uvicorn":
                return exc.name
        except (ImportError, AttributeError):
            pass
        return None

    def check(self) -> str | None:
        """None when the installed uvicorn has it as described; else what differs."""
        if (library := self.absent_library()) is not None:
            module = self.owner.partition(":")[0]
            return f"{module} needs {library}, which is not installed (uvicorn[standard] has it)"
        try:
            owner = _load(self.owner)
        except (ImportError, AttributeError) as exc:
            return f"{self.owner} is gone ({exc})"
        if self.kind == "class":
            return None if inspect.isclass(owner) else f"{self.owner} is not a class"
        if self.kind == "method":
            method = getattr(owner, self.name, None)
            if not callable(method):
                return f"{self} is not a method"
            found = tuple(inspect.signature(method).parameters)[1 : 1 + len(self.parameters)]
            if found != self.parameters:
                return f"{self} takes {found}, not {self.parameters}"
            return None
        assigned = _assigned(self.owner)
        if assigned is not None and self.name not in assigned:
            return f"{self} is no longer an attribute"
        return None


@functools.cache
def _load(owner: str) -> object:
    module, _, qualname = owner.partition(":")
    found: object = importlib.import_module(module)
    for part in qualname.split("."):
        found = getattr(found, part)
    return found


@functools.cache
def _assigned(owner: str) -> frozenset[str] | None:
    """Attributes ``self.<name> = ...`` that the class (and its uvicorn bases) assign;
    None when uvicorn was installed without its source: its attributes are then not
    checked (the fast path's self-check still runs it once)."""
    names: set[str] = set()
    cls = _load(owner)
    assert inspect.isclass(cls)
    for klass in cls.__mro__:
        if klass.__module__.startswith("uvicorn"):
            try:
                source = inspect.getsource(klass)
            except (OSError, TypeError):
                return None
            names.update(re.findall(r"self\.(\w+)\s*(?::[^=\n]+)?=(?!=)", source))
    return frozenset(names)


def _attrs(path: Path, owner: str, use: str, *names: str) -> tuple[Private, ...]:
    return tuple(Private(path, owner, name, "attribute", use) for name in names)


PRIVATE: tuple[Private, ...] = (
    # -- fast: FanoutWebSocketProtocol (changefeed.uvicorn_fastpath) ---------------
    Private("fast", _SANSIO, "", "class", "the websocket protocol FanoutWebSocketProtocol extends"),
    Private(
        "fast",
        _SANSIO,
        "__init__",
        "method",
        "built by uvicorn's HTTP protocol on an upgrade, and once by the self-check",
        ("config", "server_state", "app_state"),
    ),
    Private(
        "fast",
        _SANSIO,
        "data_received",
        "method",
        "answer a handshake websockets refused; hold reading while pongs pile up",
        ("data",),
    ),
    Private(
        "fast", _SANSIO, "handle_connect", "method", "offer direct writes in the scope", ("event",)
    ),
    Private("fast", _SANSIO, "handle_parser_exception", "method", "4006 instead of 1009"),
    Private(
        "fast", _SANSIO, "send_receive_event_to_app", "method", "4000 for a text frame not UTF-8"
    ),
    Private(
        "fast", _SANSIO, "send", "method", "a handshake refused with HTTP is complete", ("message",)
    ),
    Private(
        "fast", _SANSIO, "send_keepalive_ping", "method", "note the stream's progress at each ping"
    ),
    Private(
        "fast",
        _SANSIO,
        "keepalive_timeout",
        "method",
        "extend the ping's deadline while progressing",
    ),
    Private("fast", _SANSIO, "run_asgi", "method", "abort a connection whose app is done"),
    *_attrs(
        "fast",
        _SANSIO,
        "read by FanoutWebSocketProtocol and its frame writer",
        "config",
        "conn",
        "curr_msg_data_type",
        "close_timeout",
        "initial_response",
        "loop",
        "pending_ping_payload",
        "ping_timeout",
        "read_paused",
        "transport",
        "client",
    ),
    # Written, each as uvicorn itself writes it in the same situation:
    *_attrs(
        "fast",
        _SANSIO,
        "set once the fast path has written its own close frame (a refused frame), "
        "so that uvicorn sends no second one",
        "close_sent",
    ),
    *_attrs(
        "fast",
        _SANSIO,
        "set when the app answered the handshake with an HTTP response (a refused "
        "token): complete, where uvicorn would log an error",
        "handshake_complete",
    ),
    *_attrs(
        "fast",
        _SANSIO,
        "re-armed while the stream progresses: a ping's deadline extended",
        "pong_timer",
    ),
    *_attrs("fast", _SANSIO, "emptied when a text message that is not UTF-8 is refused", "frames"),
    *_attrs(
        "fast",
        _SANSIO,
        "replaced by a lighter object with the methods uvicorn calls (queue: put_nowait, "
        "get, empty; writable: set, clear, is_set, wait), or released once the handshake "
        "is done (request, response)",
        "queue",
        "writable",
        "request",
        "response",
    ),
    *_attrs(
        "fast",
        _SANSIO,
        "read, and its headers emptied once the app has accepted (it checked the token before)",
        "scope",
    ),
    # The self-check (changefeed.fast_path) runs a connection as uvicorn's server
    # would: the HTTP protocol it chose, on a socket pair, handing the upgrade over.
    Private("fast", _STATE, "", "class", "the self-check builds the protocols uvicorn builds"),
    *_attrs("fast", _CONFIG, "the HTTP protocol the self-check runs", "http_protocol_class"),
    *(
        Private(
            "fast",
            owner,
            "__init__",
            "method",
            "the self-check builds the HTTP protocol uvicorn builds",
            ("config", "server_state", "app_state"),
        )
        for owner in (_HTTPTOOLS, _H11)
    ),
    # -- deadlines: changefeed.http_timeouts ---------------------------------------
    Private("deadlines", _HTTPTOOLS, "", "class", "extended with the request head's deadline"),
    Private("deadlines", _H11, "", "class", "extended with the request head's deadline"),
    *(
        Private("deadlines", owner, name, "method", "arm or cancel a deadline", params)
        for owner in (_HTTPTOOLS, _H11)
        for name, params in (
            ("connection_made", ("transport",)),
            ("data_received", ("data",)),
            ("on_response_complete", ()),
            ("connection_lost", ("exc",)),
        )
    ),
    Private("deadlines", _HTTPTOOLS, "on_headers_complete", "method", "the head is in"),
    Private("deadlines", _HTTPTOOLS, "on_body", "method", "more of the body", ("body",)),
    Private("deadlines", _HTTPTOOLS, "on_message_complete", "method", "the body is in"),
    Private("deadlines", _H11, "handle_events", "method", "follow h11's state after each step"),
    *_attrs("deadlines", _HTTPTOOLS, "the deadlines' state", "loop", "transport", "client"),
    *_attrs("deadlines", _HTTPTOOLS, "the deadlines' state", "flow", "cycle", "pipeline"),
    *_attrs("deadlines", _H11, "the deadlines' state", "loop", "transport", "client"),
    *_attrs("deadlines", _H11, "the deadlines' state", "flow", "cycle", "conn"),
    *(
        attr
        for cycle in (_CYCLE_HTTPTOOLS, _CYCLE_H11)
        for attr in _attrs(
            "deadlines",
            cycle,
            "who waits for the body; end the request on a deadline",
            "waiting_for_100_continue",
            "response_started",
            "disconnected",
            "message_event",
        )
    ),
    *_attrs("deadlines", _FLOW, "reading paused: the server waits, not the peer", "read_paused"),
    # -- serve: changefeed.serving.DrainingServer ----------------------------------
    Private(
        "serve",
        _SERVER,
        "startup",
        "method",
        "bound the unsent bytes of each listening socket",
        ("sockets",),
    ),
    Private("serve", _SERVER, "shutdown", "method", "drain the publishers first", ("sockets",)),
    Private("serve", _SERVER, "capture_signals", "method", "a drained SIGTERM ends with status 0"),
    *_attrs("serve", _SERVER, "the listening sockets (asyncio servers)", "servers"),
    *_attrs("serve", _SERVER, "the settings it was made with (host, port)", "config"),
    # The CLI's servers (changefeed.cli, .standalone, .demo) on any uvicorn: whether
    # start-up succeeded (the exit status), and the demo's stop.
    *_attrs("serve", _SERVER, "start-up succeeded; ask the server to stop", "started"),
    *_attrs("serve", _SERVER, "ask the server to stop", "should_exit"),
)
"""Every private uvicorn name changefeed uses."""


def missing(path: Path, kinds: tuple[Kind, ...] = ("class", "method", "attribute")) -> list[str]:
    """What the installed uvicorn lacks of ``path``'s names of ``kinds`` (empty: nothing).

    For the fast path, an HTTP protocol whose library is not installed
    (httptools) is not lacking: uvicorn cannot choose it, and the self-check
    runs the one uvicorn chose. The deadlines extend both protocols.
    """
    lacking = [
        why
        for private in PRIVATE
        if private.path == path
        and private.kind in kinds
        and not (path == "fast" and private.absent_library() is not None)
        and (why := private.check())
    ]
    return list(dict.fromkeys(lacking))  # a missing library is said once, not per name
