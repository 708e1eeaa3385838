"""Whether changefeed's optional uvicorn layers may run here: one verdict each, per process.

Plain ASGI is the default: the publisher works on any ASGI server through
public interfaces. On uvicorn it can do more, through private parts of
uvicorn (every one listed in changefeed.uvicorn_private):

* the **fast path** (``FanoutWebSocketProtocol``, changefeed.uvicorn_fastpath):
  fan-out frames written once for every listener straight to the transports,
  the publisher's own refusals of oversized and non-UTF-8 frames (4006, 4000),
  a keepalive that never cuts off a listener that reads, small buffers below
  the app, and aborting connections whose app is done;
* the request head's and body's **deadlines** (changefeed.http_timeouts), a
  job that is first the proxy's (docs/security.md).

Each is used only where it was tested, and checked before it is used:

1. the installed uvicorn is in ``TESTED_UVICORN``, the versions CI runs it on;
2. uvicorn still has every private name it uses (``uvicorn_private.missing``);
3. a **self-check** exercises it once, on a socket pair in a private event
   loop (a thread of its own, so that it can run from inside a running loop):
   uvicorn's own HTTP protocol hands a websocket upgrade to the fast path,
   which must offer direct writes, write a frame the client reads, see a
   ping answered, and refuse a non-UTF-8 frame (4000) and an oversized one
   (4006); the deadlines must answer half a request head, and a body that
   stopped arriving, with 408.

Anything that fails gives plain ASGI (uvicorn's own protocols), and one log
line naming what is missing: ``serving.fast_path`` / ``serving.deadlines``
(``path``, ``why``, ``uvicorn``). Both are logged once, at INFO when the layer
runs and WARNING when it was asked for and cannot.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import socket
import threading
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import Any

from changefeed.logs import log_event

__all__ = [
    "OLDEST_UVICORN",
    "TESTED_UVICORN",
    "Verdict",
    "deadlines",
    "fast_path",
    "uvicorn_version",
]

log = logging.getLogger("changefeed.serving")

OLDEST_UVICORN = "0.35.0"
"""The oldest uvicorn the publisher supports, through plain ASGI (the floor of the
``serve`` extra in pyproject.toml; tests/test_install_shape.py keeps the two
equal): CI and the benchmarks run it."""

TESTED_UVICORN = ((0, 54), (0, 55))
"""uvicorn versions the fast path and the deadlines were tested on: from the
first (inclusive) to the second (exclusive) ``(major, minor)``. CI runs them on
the newest uvicorn in this range (tests/test_asgi_servers.py); widen it only
together with a CI run on the new versions."""

_CHECK_TIMEOUT = 10.0
"""Seconds the self-check may take, at most (it takes milliseconds)."""
_PROBE_DEADLINE = 0.05
"""Seconds of the deadlines the self-check runs."""
_ANSWER_WITHIN = 1.0
"""Seconds the self-check waits for a deadline's 408 (twenty times the deadline)."""
_PROBE_MAX_SIZE = 1024
_PROBE_TEXT = "changefeed fast path self-check"


@dataclass(frozen=True)
class Verdict:
    """Whether a layer runs here, and if not, why."""

    why_not: str | None
    uvicorn: str

    @property
    def ok(self) -> bool:
        return self.why_not is None


def uvicorn_version() -> str:
    """The installed uvicorn's version ("" when there is none)."""
    try:
        import uvicorn
    except ImportError:
        return ""
    return str(uvicorn.__version__)


def _out_of_range(version: str) -> str | None:
    if not version:
        return "uvicorn is not installed"
    try:
        found = tuple(int(part) for part in version.split(".")[:2])
    except ValueError:
        return f"uvicorn {version} is not a version this check can read"
    low, high = TESTED_UVICORN
    if low <= found < high:
        return None
    tested = f">={low[0]}.{low[1]},<{high[0]}.{high[1]}"
    return f"uvicorn {version} is outside the tested versions ({tested})"


def _verdict(path: str, exercise: Callable[[], Awaitable[str | None]]) -> Verdict:
    version = uvicorn_version()
    why = _out_of_range(version)
    if why is None:
        from changefeed.uvicorn_private import missing

        lacking = missing("fast" if path == "fast" else "deadlines")
        if lacking:
            why = f"uvicorn {version} lacks what it uses: {'; '.join(lacking)}"
    if why is None:
        why = _run_self_check(exercise)
    return Verdict(why, version)


def _run_self_check(exercise: Callable[[], Awaitable[str | None]]) -> str | None:
    """Run ``exercise`` in an event loop of its own, in a thread of its own."""
    outcome: list[str | None] = []

    def run() -> None:
        try:
            with _quiet_in_this_thread():
                outcome.append(asyncio.run(_bounded(exercise)))
        except Exception as exc:  # whatever it is, the layer must not be used
            outcome.append(f"its self-check failed: {exc!r}")

    thread = threading.Thread(target=run, name="changefeed-self-check", daemon=True)
    thread.start()
    thread.join(_CHECK_TIMEOUT + 1)
    if not outcome:
        return f"its self-check did not finish within {_CHECK_TIMEOUT:g}s"
    return outcome[0]


async def _bounded(exercise: Callable[[], Awaitable[str | None]]) -> str | None:
    try:
        async with asyncio.timeout(_CHECK_TIMEOUT):
            return await exercise()
    except TimeoutError:
        return f"its self-check did not finish within {_CHECK_TIMEOUT:g}s"


class _ThisThread(logging.Filter):
    def __init__(self) -> None:
        super().__init__()
        self.thread = threading.get_ident()

    def filter(self, record: logging.LogRecord) -> bool:
        return record.thread != self.thread


_QUIETED = ("uvicorn.error", "changefeed.serving", "changefeed.http_timeouts")


@contextlib.contextmanager
def _quiet_in_this_thread() -> Iterator[None]:
    """The self-check's own connections are nobody's business in the logs."""
    quiet = _ThisThread()
    loggers = [logging.getLogger(name) for name in _QUIETED]
    for logger in loggers:
        logger.addFilter(quiet)
    try:
        yield
    finally:
        for logger in loggers:
            logger.removeFilter(quiet)


def _log(event: str, verdict: Verdict, on: str, off: str) -> None:
    log_event(
        log,
        event,
        logging.INFO if verdict.ok else logging.WARNING,
        path=on if verdict.ok else off,
        why=verdict.why_not,
        uvicorn=verdict.uvicorn,
    )


@functools.cache
def fast_path() -> Verdict:
    """Whether ``FanoutWebSocketProtocol`` runs here (checked, and logged, once)."""
    verdict = _verdict("fast", _exercise_fast_path)
    _log("serving.fast_path", verdict, "direct writes", "plain ASGI")
    return verdict


@functools.cache
def deadlines() -> Verdict:
    """Whether the request head's and body's deadlines run here (checked, and logged, once)."""
    verdict = _verdict("deadlines", _exercise_deadlines)
    _log("serving.deadlines", verdict, "changefeed.http_timeouts", "none (the proxy's job)")
    return verdict


# --------------------------------------------------------------------------- self-checks


async def _serve_one(config: Any, sock: socket.socket) -> Any:
    """Accept ``sock`` as uvicorn's server would: its HTTP protocol, with a fresh state."""
    from uvicorn.server import ServerState

    protocol = config.http_protocol_class(config=config, server_state=ServerState(), app_state={})
    await asyncio.get_running_loop().connect_accepted_socket(lambda: protocol, sock)
    return protocol


async def _exercise_fast_path() -> str | None:
    import uvicorn
    from websockets.asyncio.client import connect
    from websockets.exceptions import ConnectionClosed

    from changefeed.publisher.wire import DIRECT_WRITES, DISCONNECT_CAUSE, Disconnect, text_frame
    from changefeed.uvicorn_fastpath import FanoutWebSocketProtocol

    problems: list[str] = []
    causes: list[object] = []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "websocket":
            return
        await receive()
        writer = scope.get("extensions", {}).get(DIRECT_WRITES)
        await send({"type": "websocket.accept"})
        if writer is None or not writer.open:
            problems.append("no direct writes were offered")
            await send({"type": "websocket.close", "code": 1011})
            return
        writer.write(text_frame(_PROBE_TEXT))
        protocol = writer._protocol
        protocol.send_keepalive_ping()
        async with asyncio.timeout(5):
            # uvicorn's pong handling sets nothing to await: poll its state.
            while protocol.pending_ping_payload is not None:  # noqa: ASYNC110
                await asyncio.sleep(0.001)
        if writer.buffered() < 0:
            problems.append("a negative buffer")
        writer.write(text_frame("pong seen"))
        message = await receive()
        causes.append(message.get(DISCONNECT_CAUSE))

    config = uvicorn.Config(
        app,
        ws=FanoutWebSocketProtocol,
        ws_per_message_deflate=False,
        ws_max_size=_PROBE_MAX_SIZE,
        # Its own pings would come after the check: it sends one by hand.
        ws_ping_interval=60.0,
        ws_ping_timeout=5.0,
        lifespan="off",
        log_config=None,
    )
    config.load()

    async def refused(data: Any, expected: int) -> str | None:
        ours, theirs = socket.socketpair()
        with ours, theirs:
            await _serve_one(config, ours)
            async with connect(
                "ws://self-check/changefeeds", sock=theirs, compression=None, max_size=None
            ) as ws:
                if await ws.recv() != _PROBE_TEXT or await ws.recv() != "pong seen":
                    return "the direct writes did not arrive"
                await ws.send(data, text=True)
                with contextlib.suppress(ConnectionClosed):
                    await ws.recv()  # the error frame
                    await ws.recv()
                code = ws.close_code
            if code != expected:
                return f"a bad frame was closed with {code}, not {expected}"
        return None

    for data, expected, cause in (
        (b"\xff\xfe", 4000, Disconnect.BAD_FRAME),
        ("x" * (_PROBE_MAX_SIZE + 1), 4006, Disconnect.FRAME_TOO_LARGE),
    ):
        why = await refused(data, expected)
        if why is not None or problems:
            return f"its self-check failed: {why or '; '.join(problems)}"
        await asyncio.sleep(0)  # the app's last receive
        if causes[-1:] != [cause]:
            return f"its self-check failed: the app was not told {cause.value}"
    return None


async def _exercise_deadlines() -> str | None:
    import uvicorn

    from changefeed.http_timeouts import head_timeout_protocol

    async def app(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        while (await receive()).get("more_body"):
            pass
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    for http in ("httptools", "h11"):
        with contextlib.suppress(ImportError):
            __import__(http)
            deadline = head_timeout_protocol(_PROBE_DEADLINE, http)
            config = uvicorn.Config(app, http=deadline, lifespan="off", log_config=None)
            config.load()
            for sent in (
                b"GET / HTTP/1.1\r\nHost: self-check\r\n",
                b"POST / HTTP/1.1\r\nHost: self-check\r\nContent-Length: 10\r\n\r\nabc",
            ):
                ours, theirs = socket.socketpair()
                with ours, theirs:
                    await _serve_one(config, ours)
                    reader, writer = await asyncio.open_connection(sock=theirs)
                    writer.write(sent)
                    try:
                        answer = await asyncio.wait_for(reader.read(), _ANSWER_WITHIN)
                    except TimeoutError:
                        answer = b""
                    writer.close()
                if not answer.startswith(b"HTTP/1.1 408"):
                    what = "half a head" if sent.startswith(b"GET") else "half a body"
                    return f"its self-check failed ({http}): {what} was not answered 408"
    return None
