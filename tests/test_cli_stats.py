"""``changefeed stats``: everything the runbook relies on, readably, from a real publisher."""

from __future__ import annotations

import asyncio
import contextlib
import io
import logging
import os
import sys
from typing import Any

import asyncpg
import orjson
import pytest
from helpers import wait_until
from publisher_fixtures import connect_not_reading, register, registration, running_publisher
from servers import serve_app
from websockets.exceptions import ConnectionClosed

from changefeed.cli import main
from changefeed.publisher import publish_many

TOKEN = "stats-reader-token-0123456789"


async def changefeed_stats(*args: str, env: dict[str, str] | None = None) -> str:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "changefeed.cli", "stats", *args,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        env=None if env is None else {**os.environ, **env},
    )  # fmt: skip
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode == 0, err.decode()
    return out.decode()


async def test_stats_shows_the_runbooks_figures_readably(feed_dsn: str) -> None:
    async with running_publisher(
        feed_dsn, auth_tokens=(TOKEN,), stall_timeout=1.0, queue_size=1000
    ) as pub:
        headers = {"Authorization": f"Bearer {TOKEN}"}
        reader, _ = await register(
            pub.ws_url, registration(subs=[], service="reader"), additional_headers=headers
        )
        stuck = await connect_not_reading(pub.ws_url, additional_headers=headers)
        await stuck.send(registration(subs=[], service="stuck"))
        await asyncio.wait_for(stuck.recv(), 10)
        bad, error = await register(
            pub.ws_url, orjson.dumps({"instance": "x"}).decode(), additional_headers=headers
        )
        assert error["error"]["code"] == "invalid_registration"

        async def read_on() -> None:
            with contextlib.suppress(ConnectionClosed):
                while True:
                    await reader.recv()

        reading = asyncio.create_task(read_on())
        # Enough that the stuck one's socket buffers fill: then it makes no progress.
        conn = await asyncpg.connect(feed_dsn)
        try:
            await publish_many(conn, [("vm", [], f"{'x' * 500}-{i}") for i in range(10_000)])
        finally:
            await conn.close()
        await wait_until(lambda: pub.publisher.stats()["counters"]["evictions"] == 1, timeout=30)
        # The reader keeps up: live again once it has read the burst.
        await wait_until(lambda: pub.publisher.stats()["catchingUp"] == 0, timeout=30)

        text = await changefeed_stats(pub.server.url, "--token", TOKEN)
        print(text)
        sections = {
            line.split("  ", 1)[0]: line.split("  ", 1)[1].strip()
            for line in text.splitlines()
            if line[:1].isalpha() and "  " in line
        }
        assert sections["tailer"].startswith("running, at ")
        assert sections["last error"] == "none" and sections["failed"] == "none"
        assert "oldest open transaction" in sections["horizon"]
        assert "low-water 0:0" in sections["feed"] and "oldest entry" in sections["feed"]
        assert sections["refused"] == "invalid_registration 1"
        assert "evictions 1 (slow_listener 1)" in text
        assert sections["RECENT EVICTIONS"].startswith("1, newest first")
        assert "RECENT REFUSALS" in sections
        assert "{" not in text  # no Python dicts
        (row,) = [line for line in text.splitlines() if line.startswith("reader ")]
        assert " live " in row
        await pub.publisher.drain(grace=0.1)
        # The token from the environment, where the process list does not show it.
        draining = await changefeed_stats(pub.server.url, env={"CHANGEFEED_TOKEN": TOKEN})
        assert "DRAINING" in draining
        stuck.transport.abort()
        reading.cancel()
        await asyncio.gather(reading, return_exceptions=True)
        await reader.close()
        await bad.close()


async def test_names_from_listeners_reach_the_terminal_escaped(feed_dsn: str) -> None:
    """A listener chooses its instance and service names: ``changefeed stats`` shows a
    right-to-left override or an escape sequence in them as its escape, never as
    itself (they were written raw)."""
    async with running_publisher(feed_dsn) as pub:
        frame = orjson.dumps(
            {
                "instance": "abc\u202egnp.exe",
                "service": "svc\x1b[2J\x1b]0;owned\x07",
                "changeKind": {"resource": "vm", "subResources": []},
            }
        ).decode()
        ws, ack = await register(pub.ws_url, frame)
        assert "error" not in ack
        text = await changefeed_stats(pub.server.url)
        assert "\u202e" not in text and "\x1b" not in text and "\x07" not in text
        (row,) = [line for line in text.splitlines() if line.startswith("svc")]
        assert row.startswith("svc\\x1b[2J\\x1b]0;owned\\x07  abc\\u202egnp.exe  "), row
        await ws.close()


def test_a_name_shown_escaped_keeps_the_listeners_table_aligned() -> None:
    from changefeed.stats_view import render_stats

    kind = {"resource": "vm", "subResources": []}
    rows = [
        {"service": "dns", "instance": "plain", "changeKind": kind, "delivered": 1},
        {"service": "a\u202eb", "instance": "x\x1by", "changeKind": kind, "delivered": 22},
    ]
    text = render_stats({"registrations": rows})
    table = text[text.index("SERVICE") :].splitlines()[:3]
    # Every row's change kind starts in the header's column, escaped names or not.
    assert len({line.index("vm[*]") for line in table[1:]} | {table[0].index("CHANGE")}) == 1, table


def _logged(formatter: logging.Formatter, **fields: Any) -> str:
    """The one line ``formatter`` writes for a ``registration`` event with ``fields``."""
    from changefeed.logs import log_event

    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(formatter)
    logger = logging.getLogger("changefeed.test_visible")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False
    try:
        log_event(logger, "registration", **fields)
    finally:
        logger.removeHandler(handler)
    (line,) = stream.getvalue().splitlines()
    return line


def test_the_view_shows_every_counter_the_publisher_declares() -> None:
    from changefeed.publisher.figures import COUNTERS
    from changefeed.stats_view import render_stats

    keys = [figure.stats for figure in COUNTERS if figure.stats]
    counters = {key: 70_001 + i for i, key in enumerate(keys)}
    text = render_stats({"counters": counters})
    missing = [key for key, n in counters.items() if f"{n:,}" not in text]
    assert not missing, f"changefeed stats does not show {missing}:\n{text}"


def test_the_human_log_keeps_an_event_on_one_line_whatever_its_fields_hold() -> None:
    from changefeed.logs import HumanFormatter

    line = _logged(HumanFormatter(), instance="x\n12:00:00.000 info forged line\x1b[31m")
    assert line.endswith("instance=x\\n12:00:00.000 info forged line\\x1b[31m"), line


def test_the_json_log_writes_no_control_or_format_character_raw() -> None:
    """A JSON log line holds a peer's name as JSON escapes: the same value to a parser,
    and no right-to-left override or C1 control for a terminal tailing the log."""
    from changefeed.logs import JsonFormatter

    name = "abc\u202egnp.exe\x9b31m\u2028é"
    line = _logged(JsonFormatter(), instance=name)
    assert orjson.loads(line)["instance"] == name
    assert line.isprintable() and "\\u202e" in line and "\\u2028" in line and "é" in line, line


async def cli(*args: str) -> tuple[int, str, str]:
    """``changefeed ARGS``: its exit status, stdout and stderr."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "changefeed.cli", *args,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


@pytest.mark.parametrize("command", ["stats", "listen"])
@pytest.mark.parametrize(
    "url",
    [
        "http://127.0.0.1:notaport",
        "http://[::1",
        "http://127.0.0.1:99999",
        "ftp://h",
        "h",
        "http://127.0.0.1:1/\x1b",
        "http://xn--a:1",
        "http://ho st:1",
    ],
)
def test_a_url_that_is_not_one_is_a_usage_error(
    command: str, url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Refused by the command line's parser (status 2, a usage message), before any
    client is made: no traceback from httpx, no endless retries."""
    extra = ["--resource", "vm"] if command == "listen" else []
    with pytest.raises(SystemExit) as exited:
        main([command, url, *extra])
    err = capsys.readouterr().err
    assert exited.value.code == 2, err
    assert "must be an http(s):// or ws(s):// URL" in err and "Traceback" not in err, err


ANSWERS: dict[str, tuple[int, bytes]] = {
    "not-json": (200, b"<html>hello</html>"),
    "not-utf8": (200, b'{"listeners": "\xff\xfe"}'),
    "a-list": (200, b"[1, 2, 3]"),
    "null": (200, b"null"),
    "deep": (200, b"[" * 100_000 + b"]" * 100_000),
    "tailer-a-string": (200, b'{"tailer": "running", "listeners": 1}'),
    "kinds-a-string": (200, b'{"registrations": [{"changeKind": "vm"}]}'),
    "error-with-escapes": (503, b"down \x1b]0;pwned\x07\x1b[31m red"),
}


@pytest.mark.parametrize("answer", sorted(ANSWERS))
async def test_a_server_answering_nonsense_gets_one_clear_line(answer: str) -> None:
    """Whatever a server answers, ``changefeed stats`` says what it got in one line,
    with nothing of the server's reaching the terminal as a control sequence."""
    status_code, body = ANSWERS[answer]

    async def app(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        await send({"type": "http.response.start", "status": status_code, "headers": []})
        await send({"type": "http.response.body", "body": body})

    async with serve_app(app) as server:
        for extra in ([], ["--json"]):
            status, out, err = await cli("stats", server.url, *extra)
            if answer in ("tailer-a-string", "kinds-a-string") and extra:
                assert status == 0, err  # the raw document, as asked
                continue
            assert status == 1, (extra, out, err)
            assert "Traceback" not in err and err.count("\n") == 1, err
            assert "\x1b" not in err and "\x07" not in err, err
            assert err.startswith(f"changefeed stats: {server.url}/changefeeds/stats answered")
