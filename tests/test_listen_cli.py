"""``changefeed listen``: several resources on one connection, the status line's bootstrap
progress, and clear usage errors. The command runs as a real process against the
example API (real uvicorn, real PostgreSQL)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import resource
import signal
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
from helpers import metric_value
from test_listener import seed_vms
from test_listener_shared import create_servers, publisher_stats
from test_listener_support import VmApiServer, create_vms

from changefeed.cli import main
from changefeed.listener import ChangeKind
from changefeed.snoop import UsageError, change_kinds

CHANGEFEED = str(Path(sys.executable).parent / "changefeed")


@contextlib.asynccontextmanager
async def listen(
    *args: str, file_size_limit: int | None = None
) -> AsyncIterator[asyncio.subprocess.Process]:
    """``changefeed listen ARGS`` in a child process; stopped with SIGTERM at the end.
    ``file_size_limit``: the most bytes the child may write to any one file (its
    RLIMIT_FSIZE; Python ignores SIGXFSZ, so a write past it fails with EFBIG)."""

    def limit_files() -> None:
        if file_size_limit is not None:
            resource.setrlimit(resource.RLIMIT_FSIZE, (file_size_limit, file_size_limit))

    process = await asyncio.create_subprocess_exec(
        CHANGEFEED,
        "--log-level",
        "warning",
        "listen",
        *args,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        preexec_fn=limit_files,
    )
    try:
        yield process
    finally:
        if process.returncode is None:
            process.send_signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(process.wait(), 15)
            except TimeoutError:
                process.kill()
                await process.wait()


async def read_lines_until(
    process: asyncio.subprocess.Process, done: Any, timeout: float = 60.0
) -> list[dict[str, Any]]:
    """Stdout's JSON lines until ``done(lines)`` holds (bounded by ``timeout``)."""
    assert process.stdout is not None
    lines: list[dict[str, Any]] = []
    async with asyncio.timeout(timeout):
        while not done(lines):
            line = await process.stdout.readline()
            if not line:
                raise AssertionError(f"listen exited early: {lines}")
            lines.append(orjson.loads(line))
    return lines


def test_resource_options() -> None:
    assert change_kinds(["vm:nic,alias", "server"]) == (
        ChangeKind("vm", ("nic", "alias")),
        ChangeKind("server"),
    )
    assert change_kinds(["vm"], "nic,alias") == (ChangeKind("vm", ("nic", "alias")),)
    for resources, subs, says in [
        (["vm", "server"], "nic", "goes with one --resource"),
        (["vm:nic"], "alias", "goes with one --resource"),
        (["vm", "vm:nic"], "", "vm given twice"),
        ([":nic"], "", "name is empty"),
    ]:
        with pytest.raises(UsageError, match=says):
            change_kinds(resources, subs)


def test_a_usage_error_is_one_line_and_status_2(capsys: pytest.CaptureFixture[str]) -> None:
    status = main(["listen", "http://127.0.0.1:9", "--resource", "vm", "--resource", "vm"])
    assert status == 2
    assert capsys.readouterr().err.strip() == "changefeed listen: --resource vm given twice"


def test_a_value_that_begins_with_a_dash_is_shown_where_it_goes(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """argparse reads ``-1s`` after ``--compaction-lag`` as an option of its own and
    says only that a value is missing; the error shows how to give it."""
    with pytest.raises(SystemExit) as exited:
        main(["compact", "--compaction-lag", "-1s"])
    assert exited.value.code == 2
    assert (
        capsys.readouterr()
        .err.strip()
        .endswith(
            "argument --compaction-lag: expected one argument"
            " (a value that begins with '-' goes after '=': --compaction-lag=-1s)"
        )
    )
    with pytest.raises(SystemExit):
        main(["listen", "http://127.0.0.1:9", "--resource"])
    assert capsys.readouterr().err.strip().endswith("argument --resource: expected one argument")


def test_the_dash_hint_names_the_spelling_of_an_option_that_was_typed(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """An option with two spellings: argparse names both, the hint the one given."""
    from changefeed.cli import _Parser

    parser = _Parser(prog="p")
    parser.add_argument("-l", "--lag")
    with pytest.raises(SystemExit):
        parser.parse_args(["--lag", "-2s"])
    assert (
        capsys.readouterr()
        .err.strip()
        .endswith(
            "argument -l/--lag: expected one argument"
            " (a value that begins with '-' goes after '=': --lag=-2s)"
        )
    )


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (["compact", "--compaction-lag", "0"], "changefeed compact: --compaction-lag must be"),
        (["compact", "--max-age", "0s"], "changefeed compact: --max-age must be"),
        (
            ["compact", "--compaction-lag", "0.0000001ms"],
            "changefeed compact: --compaction-lag must be at least 1ms",
        ),
        (
            ["compact", "--max-age", "1m", "--compaction-lag", "10m"],
            "changefeed compact: --max-age (60s) must not be shorter than --compaction-lag",
        ),
        (["compact", "--keepers", "index"], "changefeed compact: --keepers must be one of"),
        (["db", "init", "--dsn", "not a dsn"], "changefeed db: --dsn: not a usable PostgreSQL DSN"),
        (
            ["db", "init", "--dsn", "postgresql://u@127.0.0.1:port/x"],
            "changefeed db: --dsn: not a usable PostgreSQL DSN",
        ),
        (
            ["db", "init", "--dsn", "postgresql://u@127.0.0.1:9/x", "--schema", "Bad-Schema"],
            "changefeed db: --schema: schema name 'Bad-Schema' must match",
        ),
        (
            ["listen", "http://127.0.0.1:9", "--resource", "v m"],
            "changefeed listen: change_kinds[0].resource: 'v m' does not match",
        ),
        (
            ["listen", "http://127.0.0.1:9", "--resource", "vm", "--since", ""],
            "changefeed listen: cursor: '' should be non-empty",
        ),
        # A checkpoint no save could write: refused at once, not failing every interval.
        (
            ["listen", "http://127.0.0.1:9", "--resource", "vm", "--checkpoint", "/no/such/cp"],
            "changefeed listen: --checkpoint: /no/such is not a directory that exists",
        ),
        (
            ["listen", "http://127.0.0.1:9", "--resource", "vm", "--checkpoint", "/"],
            "changefeed listen: --checkpoint: / is a directory",
        ),
    ],
)
def test_a_value_no_run_can_use_is_a_usage_error_naming_the_option(
    capsys: pytest.CaptureFixture[str], args: list[str], said: str
) -> None:
    dsn = ["--dsn", "postgresql://u@127.0.0.1:9/x"] if args[0] == "compact" else []
    assert main([*args, *dsn]) == 2
    err = capsys.readouterr().err
    assert err.startswith(said) and err.count("\n") == 1, err


@pytest.mark.parametrize(
    ("dsn", "said"),
    [
        ("notadsn", "changefeed demo: --dsn: not a usable PostgreSQL DSN"),
        ("postgresql://nobody@127.0.0.1:9/x", "changefeed demo: --dsn: database unreachable"),
    ],
)
def test_demo_with_a_dsn_it_cannot_use_says_so_in_one_line(
    capsys: pytest.CaptureFixture[str], dsn: str, said: str
) -> None:
    assert main(["demo", "--dsn", dsn]) == 1
    err = capsys.readouterr().err
    assert err.startswith(said) and err.count("\n") == 1, err


@pytest.mark.parametrize(
    ("option", "value"),
    [
        ("--page-limit", "0"),
        ("--page-limit", "-5"),
        ("--page-limit", "2.5"),
        ("--count", "0"),
        ("--count", "-1"),
        ("--duration", "0"),
        ("--duration", "-3"),
        ("--duration", "nan"),
        ("--status-interval", "0"),  # a status line as fast as the loop turns
        ("--status-interval", "inf"),
    ],
)
def test_numeric_options_refuse_nonsense_as_usage_errors(option: str, value: str) -> None:
    """Refused by the parser, before anything connects: status 2 and a line naming the
    option (``--page-limit 0`` is not taken to ask for the default page size). A child
    process with a deadline: a command that took the value would listen on."""
    result = subprocess.run(
        [CHANGEFEED, "listen", "http://127.0.0.1:9", "--resource", "vm", option, value],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert result.returncode == 2, result
    assert f"argument {option}: must be " in result.stderr and repr(value) in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize(
    "args",
    [
        ["demo", "--rate", "0"],
        ["demo", "--duration", "-1"],
        ["demo", "--port", "70000"],
        ["example-api", "--port", "-1"],
        ["example-api", "--header-timeout", "-1"],
        ["compact", "--batch-size", "0"],
        ["compact", "--partitions", "-2"],
    ],
)
def test_other_commands_refuse_nonsense_numbers_as_usage_errors(args: list[str]) -> None:
    result = subprocess.run(
        [CHANGEFEED, *args], capture_output=True, text=True, timeout=30, check=False
    )
    assert result.returncode == 2, result
    assert f"argument {args[1]}: must be " in result.stderr and "Traceback" not in result.stderr


async def test_listen_status_shows_the_bootstrap_rising(dsn: str) -> None:
    """3,000 VMs in pages of 10: the status line on stderr shows the route's item
    count rising during the bootstrap."""
    async with VmApiServer(dsn) as api:
        await seed_vms(dsn, 3000)
        args = ["--resource", "vm", "--status", "--status-interval", "0.02", "--page-limit", "10"]
        async with listen(api.url, *args) as process:
            (done,) = await read_lines_until(process, bool)
            assert done["event"] == "bootstrapped" and done["items"] == 3000
        assert process.stderr is not None
        status = (await process.stderr.read()).decode()
    counts = [int(n) for n in re.findall(r"bootstrap vm (\d+) items \d+ pages [\d,]+/s", status)]
    assert counts == sorted(counts)
    rising = sorted(set(counts))
    assert len(rising) >= 3 and 0 < rising[1] < 3000, rising


async def test_listen_rides_out_an_authorizer_outage_during_its_bootstrap(dsn: str) -> None:
    """The API's identity service fails while ``listen`` walks its bootstrap route: the
    route answers 503 (not 401, on which ``listen`` would exit for good with
    "registration refused (http_401)"); the command retries, bootstraps, and follows."""
    registered = asyncio.Event()
    outage = {"left": 2}

    async def authorize(token: str) -> frozenset[str] | None:
        if token != "t":
            return None
        if registered.is_set() and outage["left"]:
            outage["left"] -= 1
            raise ConnectionError("identity service down")
        registered.set()  # the handshake: the calls after it are the bootstrap route's
        return frozenset({"*"})

    async with VmApiServer(dsn, authorize=authorize) as api:
        await seed_vms(dsn, 3)
        async with listen(api.url, "--resource", "vm", "--token", "t") as process:
            (done,) = await read_lines_until(process, bool)
            assert done["event"] == "bootstrapped" and done["items"] == 3
            assert process.returncode is None
            process.send_signal(signal.SIGTERM)
            assert await asyncio.wait_for(process.wait(), 15) == 0
        assert process.stderr is not None
        log = (await process.stderr.read()).decode()
    assert outage["left"] == 0
    assert "registration refused" not in log and "HTTP 503" in log, log


async def test_listen_follows_two_resources_on_one_connection(dsn: str) -> None:
    async with VmApiServer(dsn) as api, httpx.AsyncClient(base_url=api.url) as client:
        vms = await create_vms(client, 3)
        servers = await create_servers(client, 2)
        args = ["--resource", "vm:nic,alias", "--resource", "server:hostname", "--mirror"]
        async with listen(api.url, *args) as process:
            adds = await read_lines_until(process, lambda lines: len(lines) == 5)
            stats = await publisher_stats(api)
            assert stats["listeners"] == 1 and len(stats["registrations"]) == 2
            await client.patch(f"/servers/{servers[0]}", json={"status": "running"})  # not followed
            await client.patch(f"/servers/{servers[0]}", json={"hostname": "renamed"})
            (update,) = await read_lines_until(process, bool)
            process.send_signal(signal.SIGTERM)
            mirrors = await read_lines_until(process, lambda lines: len(lines) == 2)
            assert await asyncio.wait_for(process.wait(), 15) == 0
    assert sorted((a["resource"], a["op"], a["id"]) for a in adds) == sorted(
        [("vm", "add", vm) for vm in vms] + [("server", "add", s) for s in servers]
    )
    assert (update["resource"], update["op"], update["id"]) == ("server", "update", servers[0])
    assert update["state"]["hostname"] == "renamed"
    assert {(m["event"], m["resource"], m["size"]) for m in mirrors} == {
        ("mirror", "vm", 3),
        ("mirror", "server", 2),
    }


async def test_listen_prints_no_character_a_terminal_would_act_on_or_hide(dsn: str) -> None:
    """A state from the API with a right-to-left override, a C1 control (CSI) and a
    format character beyond the Basic Multilingual Plane reaches stdout escaped: the
    line parses to the same value, and none of them is in it raw."""
    alias = "evil\u202egnp.exe\x9b31m\U000e0001"
    async with VmApiServer(dsn) as api, httpx.AsyncClient(base_url=api.url) as client:
        (vm,) = await create_vms(client, 1)
        async with listen(api.url, "--resource", "vm:alias", "--mirror") as process:
            assert process.stdout is not None
            await read_lines_until(process, bool)  # the bootstrap's add
            patched = await client.patch(f"/vms/{vm}", json={"alias": alias})
            assert patched.status_code == 200, patched.text
            async with asyncio.timeout(60):
                raw = await process.stdout.readline()
    assert orjson.loads(raw)["state"]["alias"] == alias
    text = raw.decode()
    assert text.isascii() and text.endswith("\n") and text[:-1].isprintable(), text
    assert "\\u202e" in text and "\\udb40\\udc01" in text


async def test_listen_with_a_checkpoint_resumes_and_prints_only_what_changed(
    dsn: str, tmp_path: Path
) -> None:
    """``--mirror --checkpoint FILE``: stopped and run again, the command loads its
    mirror, resumes (the publisher counts a resumed registration), and prints only the
    changes made while it was away."""
    checkpoint = str(tmp_path / "listen.sqlite")
    args = ["--resource", "vm", "--mirror", "--checkpoint", checkpoint]
    async with VmApiServer(dsn) as api, httpx.AsyncClient(base_url=api.url) as client:
        vms = await create_vms(client, 4)
        async with listen(api.url, *args) as process:
            adds = await read_lines_until(process, lambda lines: len(lines) == 4)
            process.send_signal(signal.SIGTERM)
            assert await asyncio.wait_for(process.wait(), 15) == 0
        assert {(a["op"], a["id"]) for a in adds} == {("add", vm) for vm in vms}
        await client.patch(f"/vms/{vms[0]}", json={"alias": "renamed"})
        await client.delete(f"/vms/{vms[1]}")
        (added,) = await create_vms(client, 1, "new")
        async with listen(api.url, *args) as process:
            changes = await read_lines_until(process, lambda lines: len(lines) == 3)
            process.send_signal(signal.SIGTERM)
            (mirror,) = await read_lines_until(process, bool)
            assert await asyncio.wait_for(process.wait(), 15) == 0
        metrics = (await client.get("/metrics")).text
    assert sorted((c["op"], c["id"]) for c in changes) == sorted(
        [("update", vms[0]), ("delete", vms[1]), ("add", added)]
    )
    assert mirror["event"] == "mirror" and set(mirror["resources"]) == {
        vms[0],
        vms[2],
        vms[3],
        added,
    }
    assert (
        metric_value(metrics, "changefeed_registrations_total", resource="vm", resumed="true") == 1
    )


async def test_listen_mirror_refused_prints_no_mirror_and_exits_1(dsn: str) -> None:
    """A refused ``listen --mirror`` prints nothing before exiting 1, not an empty mirror,
    which a script reading stdout could take for a feed with nothing in it."""
    args = ["--resource", "vm", "--mirror", "--token", "revoked"]
    async with VmApiServer(dsn, auth_tokens=("s3cret",)) as api, listen(api.url, *args) as process:
        assert await asyncio.wait_for(process.wait(), 30) == 1
        assert process.stdout is not None and process.stderr is not None
        out, err = await process.stdout.read(), await process.stderr.read()
    assert out == b"", out
    assert "registration refused (http_401)" in err.decode()


async def test_listen_refuses_a_checkpoint_file_another_listen_holds(
    dsn: str, tmp_path: Path
) -> None:
    """Of two ``listen --checkpoint F``, the second exits at once with status 1 and says
    why, rather than both running, each overwriting the other's saves; the first goes
    on."""
    checkpoint = str(tmp_path / "listen.sqlite")
    args = ["--resource", "vm", "--mirror", "--checkpoint", checkpoint]
    async with VmApiServer(dsn) as api, httpx.AsyncClient(base_url=api.url) as client:
        await create_vms(client, 2)
        async with listen(api.url, *args) as first:
            await read_lines_until(first, lambda lines: len(lines) == 2)
            async with listen(api.url, *args) as second:
                assert await asyncio.wait_for(second.wait(), 30) == 1
                assert second.stderr is not None
                said = (await second.stderr.read()).decode()
            last = said.strip().splitlines()[-1]  # the log line before it has the traceback
            assert last.startswith("changefeed listen: ") and "in use by another listener" in last
            assert checkpoint in last, said
            (vm,) = await create_vms(client, 1, "later")
            (added,) = await read_lines_until(first, bool)
            assert added["id"] == vm and first.returncode is None
            first.send_signal(signal.SIGTERM)
            assert await asyncio.wait_for(first.wait(), 15) == 0


async def test_listen_moves_an_unreadable_checkpoint_aside_and_its_next_run_resumes(
    dsn: str, tmp_path: Path
) -> None:
    """A file that is not a database is moved aside (an ERROR line says where), and the
    next run resumes, rather than every save failing ("file is not a database") while
    the command exits 0, and every later run bootstrapping again."""
    checkpoint = tmp_path / "listen.sqlite"
    checkpoint.write_bytes(b"garbage" * 1000)
    args = ["--resource", "vm", "--mirror", "--checkpoint", str(checkpoint)]
    async with VmApiServer(dsn) as api, httpx.AsyncClient(base_url=api.url) as client:
        await create_vms(client, 3)
        async with listen(api.url, *args) as process:
            await read_lines_until(process, lambda lines: len(lines) == 3)
            process.send_signal(signal.SIGTERM)
            assert await asyncio.wait_for(process.wait(), 15) == 0
            assert process.stderr is not None
            log = (await process.stderr.read()).decode()
        assert '"event":"listener.checkpoint.moved_aside"' in log and '"level":"error"' in log
        assert "save_failed" not in log, log
        assert _moved_aside(tmp_path) == [b"garbage" * 1000]
        (vm,) = await create_vms(client, 1, "later")
        async with listen(api.url, *args) as process:
            (change,) = await read_lines_until(process, bool)  # only what changed
            assert (change["op"], change["id"]) == ("add", vm)
        metrics = (await client.get("/metrics")).text
    assert (
        metric_value(metrics, "changefeed_registrations_total", resource="vm", resumed="true") == 1
    )


async def test_listen_exits_1_when_its_checkpoint_saves_are_failing(
    dsn: str, tmp_path: Path
) -> None:
    """The file may not grow past 128 KiB (RLIMIT_FSIZE), and the mirror of 2,000 VMs
    needs more: every save fails. The command exits 1, saying its checkpoint does not
    hold where this run got to, rather than 0 all the same."""
    checkpoint = str(tmp_path / "listen.sqlite")
    args = ["--resource", "vm", "--mirror", "--checkpoint", checkpoint]
    async with VmApiServer(dsn) as api:
        await seed_vms(dsn, 2000)
        async with listen(api.url, *args, file_size_limit=128 * 1024) as process:
            await read_lines_until(process, lambda lines: len(lines) == 2000)
            process.send_signal(signal.SIGTERM)
            # communicate: the mirror it prints as it exits is more than a pipe holds.
            _, err = await asyncio.wait_for(process.communicate(), 30)
            assert process.returncode == 1
            said = err.decode()
    last = said.strip().splitlines()[-1]  # the log before it has each failure's traceback
    assert last.startswith(f"changefeed listen: checkpoint {checkpoint}: its last save failed")
    assert "does not hold where this run got to" in last, said


def _moved_aside(directory: Path) -> list[bytes]:
    """What the files moved aside as ``listen.sqlite.corrupt-*`` hold."""
    return [p.read_bytes() for p in sorted(directory.glob("listen.sqlite.corrupt-*"))]


def test_since_and_checkpoint_together_are_a_usage_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    checkpoint = str(tmp_path / "listen.sqlite")
    args = ["--resource", "vm", "--since", "x", "--checkpoint", checkpoint]
    assert main(["listen", "http://127.0.0.1:9", *args]) == 2
    assert "give --since or --checkpoint, not both" in capsys.readouterr().err


async def test_listen_count_prints_exactly_that_many_and_says_when_duration_ran_out(
    dsn: str,
) -> None:
    """``--count N`` prints N items (then, with ``--mirror``, the mirror), not whatever
    was buffered past N (30 items for ``--count 1`` after a resume, every bootstrap add
    with ``--mirror``); and a ``--duration`` that runs out before N items exits 1, not
    0 as if they had come."""
    async with VmApiServer(dsn) as api, httpx.AsyncClient(base_url=api.url) as client:
        await create_vms(client, 12)
        # --mirror: the bootstrap's 12 adds come in one go.
        async with listen(api.url, "--resource", "vm", "--count", "3", "--mirror") as process:
            assert await asyncio.wait_for(process.wait(), 30) == 0
            assert process.stdout is not None
            printed = [orjson.loads(line) for line in (await process.stdout.read()).splitlines()]
        assert [p.get("op") for p in printed] == ["add"] * 3 + [None], printed  # + the mirror
        # Change items: 12 changes made together after the bootstrap.
        async with listen(api.url, "--resource", "vm", "--count", "3") as process:
            await read_lines_until(process, bool)  # bootstrapped
            await create_vms(client, 12, "more")
            assert await asyncio.wait_for(process.wait(), 30) == 0
            assert process.stdout is not None
            printed = [orjson.loads(line) for line in (await process.stdout.read()).splitlines()]
        assert len(printed) == 3 and all("event" not in p for p in printed), printed
        args = ["--resource", "vm", "--count", "1000", "--duration", "2"]
        async with listen(api.url, *args) as process:
            assert await asyncio.wait_for(process.wait(), 30) == 1
            assert process.stderr is not None
            err = (await process.stderr.read()).decode()
    assert "of the 1000 items --count asked for within --duration 2s" in err, err


async def test_listen_count_with_a_checkpoint_goes_on_after_the_last_item_printed(
    dsn: str, tmp_path: Path
) -> None:
    """The last item printed counted as done only once the next was asked for, which
    ``--count`` never does: every run with ``--checkpoint`` printed it again."""
    checkpoint = str(tmp_path / "listen.sqlite")
    async with VmApiServer(dsn) as api, httpx.AsyncClient(base_url=api.url) as client:
        args = ["--resource", "vm", "--checkpoint", checkpoint, "--count", "2"]
        async with listen(api.url, *args) as process:
            await read_lines_until(process, bool)  # bootstrapped
            await create_vms(client, 3, concurrency=1)
            first = await read_lines_until(process, lambda lines: len(lines) == 2)
            assert await asyncio.wait_for(process.wait(), 30) == 0
        args = ["--resource", "vm", "--checkpoint", checkpoint, "--count", "1"]
        async with listen(api.url, *args) as process:
            (then,) = await read_lines_until(process, bool)
            assert await asyncio.wait_for(process.wait(), 30) == 0
    printed = [item["changedResourceId"] for item in first]
    assert then.get("changedResourceId") not in printed, (printed, then)
    assert "event" not in then  # a resume: no bootstrap


@pytest.mark.parametrize("mirror", [False, True])
async def test_listen_piped_into_head_stops_quietly_once_head_has_gone(
    dsn: str, mirror: bool
) -> None:
    """``listen --mirror | head -1``: a closed stdout ends the run, quietly, with status
    0, rather than the callback being retried for good against the closed pipe, logging
    a traceback each time."""
    extra = " --mirror" if mirror else ""
    async with VmApiServer(dsn) as api, httpx.AsyncClient(base_url=api.url) as client:
        await create_vms(client, 2)
        script = (
            f"{CHANGEFEED} --log-level warning listen {api.url} --resource vm{extra}"
            ' --duration 60 | head -1; echo "listen=${PIPESTATUS[0]}" >&2'
        )
        process = await asyncio.create_subprocess_exec(
            "bash",
            "-c",
            script,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            start_new_session=True,  # the pipeline is one process group, ended as one
        )
        try:
            assert process.stdout is not None and process.stderr is not None
            assert await asyncio.wait_for(process.stdout.readline(), 30)  # head's one line
            ended = asyncio.ensure_future(process.wait())
            for n in range(30):  # more lines, until one meets the closed pipe
                await create_vms(client, 1, f"more-{n}")
                done, _ = await asyncio.wait({ended}, timeout=1.0)
                if done:
                    break
            assert ended.done() and ended.result() == 0
            err = (await asyncio.wait_for(process.stderr.read(), 30)).decode()
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            await asyncio.wait_for(process.wait(), 30)
    assert err.strip().endswith("listen=0"), err
    assert "Traceback" not in err and "reconcile_failed" not in err, err
