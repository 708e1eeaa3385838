"""The wheel is the product: built (from the sdist), installed into clean venvs, run.

Nothing of this checkout is importable where these programs run: each runs
from a directory of its own with a venv that holds only the wheel (with an
extra or without) and what it depends on (tests/wheel_envs.py).

* A listener-only install (``pip install changefeed``) is light: no web
  server, no database driver, no Spark; the listener runs without loading
  any of them; a command that needs an extra says which.
* The README's publisher-embedding example runs under uvicorn as the README
  says, and a listener gets every change it publishes.
* The README's listener example, as a listener-only script, follows the
  example API (``changefeed example-api`` from the wheel).
"""

from __future__ import annotations

import asyncio
import json
import re
import tarfile
import uuid
import zipfile
from pathlib import Path
from typing import Any

import asyncpg
import httpx
import pytest
from helpers import free_port
from publisher_fixtures import receive_items, register, registration
from wheel_envs import Venv, Venvs, clean_env, serve, server_command

from changefeed.fast_path import OLDEST_UVICORN

pytestmark = pytest.mark.slow

README = Path(__file__).resolve().parent.parent / "README.md"
SERVER_SIDE = ("uvicorn", "starlette", "asyncpg", "pyspark", "prometheus_client")


def _readme_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README.read_text(), re.S)


@pytest.fixture
def light(wheel_venvs: Venvs) -> Venv:
    return wheel_venvs.get("light", None)


@pytest.fixture
def with_uvicorn(wheel_venvs: Venvs) -> Venv:
    return wheel_venvs.get("uvicorn-newest", "serve")


def test_the_sdist_and_the_wheel_built_from_it_hold_the_package(wheel_venvs: Venvs) -> None:
    dist = wheel_venvs.dist
    with tarfile.open(dist.sdist) as sdist:
        names = {name.split("/", 1)[1] for name in sdist.getnames() if "/" in name}
    assert {"README.md", "LICENSE", "pyproject.toml", "changefeed/publisher/service.py"} <= names
    # The tests need the checkout (its fixtures, deploy/, docs/): none ship half-way.
    assert not [n for n in names if n.startswith("tests/")]
    wheel = set(zipfile.ZipFile(dist.wheel).namelist())
    for needed in (
        "changefeed/py.typed",
        "changefeed/schemas/json/registration.schema.json",
        "changefeed/schemas/sql/0001_feed.sql",
        "changefeed/publisher/static/dashboard.html",
        "changefeed/uvicorn_fastpath.py",
        "changefeed/listener/_listener.py",
    ):
        assert needed in wheel, needed
    assert not [n for n in wheel if n.startswith(("tests/", "bench/", "docs/"))]
    assert "changefeed-0.1.0.dist-info/licenses/LICENSE" in wheel


def test_a_listener_only_install_is_light(light: Venv, tmp_path: Path) -> None:
    installed = light.distributions()
    assert "changefeed" in installed
    heavy = {"uvicorn", "starlette", "asyncpg", "pyspark", "prometheus-client", "httptools"}
    assert installed & heavy == set()
    code = (
        "import sys, changefeed.listener, changefeed.bootstrap, changefeed.schemas\n"
        "from changefeed.bootstrap import *\n"
        f"print(sorted(m for m in {SERVER_SIDE!r} if m in sys.modules))\n"
    )
    done = light.run(["python", "-c", code], cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"
    done = light.run(["changefeed", "serve", "--config", "changefeed.toml"], cwd=tmp_path)
    assert done.returncode == 1
    assert "pip install 'changefeed[serve]'" in done.stderr and "Traceback" not in done.stderr
    done = light.run(["python", "-c", "import changefeed.publisher"], cwd=tmp_path)
    assert "pip install 'changefeed[publisher]'" in done.stderr


async def _fresh_database(pg_server: Any, prefix: str) -> str:
    name = f"{prefix}_{uuid.uuid4().hex[:12]}"
    admin = await asyncpg.connect(pg_server.dsn)
    try:
        await admin.execute(f'CREATE DATABASE "{name}"')
    finally:
        await admin.close()
    dsn: str = pg_server.dsn_for(name)
    return dsn


async def test_the_readme_publisher_example_runs_from_the_wheel_under_uvicorn(
    pg_server: Any, with_uvicorn: Venv, tmp_path: Path
) -> None:
    dsn = await _fresh_database(pg_server, "wheel_readme")
    conn = await asyncpg.connect(dsn)
    vm = str(uuid.uuid4())
    try:
        await conn.execute("CREATE TABLE vms (uuid text PRIMARY KEY, alias text)")
        await conn.execute("INSERT INTO vms VALUES ($1, 'old')", vm)
        source = _readme_blocks()[0]
        source = source.replace('"postgresql://postgres@127.0.0.1:5432/postgres"', repr(dsn))
        (tmp_path / "vmapi.py").write_text(source)
        port = free_port()
        command = server_command(with_uvicorn, "uvicorn", "vmapi:app", port)
        async with serve(command, tmp_path, {}, port) as served:
            ws, ack = await register(served.ws_url, registration(subs=["alias"]))
            assert ack["bootstrapRoute"] == "/vms"
            async with httpx.AsyncClient(base_url=served.url, timeout=10) as http:
                listed = (await http.get("/vms", params={"limit": 10})).json()
                assert listed == {"items": [{"uuid": vm, "alias": "old"}], "next": None}
                response = await http.patch(f"/vms/{vm}", json={"alias": "new"})
                assert response.status_code == 200, response.text
            (item,) = await receive_items(ws, 1)
            assert item["changeKind"] == {"resource": "vm", "subResources": ["alias"]}
            assert item["changedResourceId"] == vm
            await ws.close()
        assert await conn.fetchval("SELECT alias FROM vms") == "new"
    finally:
        await conn.close()


_FOLLOW_SECONDS = 20
_FOLLOW = """
import asyncio
import contextlib
import signal
import sys

{block}

async def main() -> None:
    following = asyncio.ensure_future(follow_vms(sys.argv[1]))
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, following.cancel)
    with contextlib.suppress(asyncio.CancelledError, TimeoutError):
        async with asyncio.timeout(float(sys.argv[2])):
            await following
    loaded = sorted(m for m in {server_side!r} if m in sys.modules)
    print("server-side modules loaded:", loaded, flush=True)

asyncio.run(main())
"""


async def test_the_readme_listener_runs_from_a_listener_only_install(
    pg_server: Any, light: Venv, with_uvicorn: Venv, tmp_path: Path
) -> None:
    """The README's listener example as a script: it bootstraps, follows a change,
    and when stopped says which server-side modules it loaded (none)."""
    dsn = await _fresh_database(pg_server, "wheel_listener")
    script = _FOLLOW.format(block=_readme_blocks()[1], server_side=SERVER_SIDE)
    (tmp_path / "follow.py").write_text(script)
    port = free_port()
    api = [str(with_uvicorn.bin("changefeed")), "example-api", "--dsn", dsn]
    api += ["--host", "127.0.0.1", "--port", str(port)]
    async with (
        serve(api, tmp_path, {}, port) as served,
        httpx.AsyncClient(base_url=served.url, timeout=10) as http,
    ):
        first = (await http.post("/vms", json={"alias": "web-1", "nics": []})).json()["uuid"]
        follower = await asyncio.create_subprocess_exec(
            str(light.python),
            "follow.py",
            served.ws_url,
            str(_FOLLOW_SECONDS),
            cwd=tmp_path,
            env={**clean_env(), "PYTHONUNBUFFERED": "1"},
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
        )
        assert follower.stdout is not None
        out: list[str] = []

        async def printed(text: str) -> None:
            assert follower.stdout is not None
            while not any(text in line for line in out):
                line = (await follower.stdout.readline()).decode()
                assert line, "".join(out)
                out.append(line)

        try:
            async with asyncio.timeout(_FOLLOW_SECONDS):
                await printed(f"{first} web-1")  # the bootstrap reaches reconcile
                second = (await http.post("/vms", json={"alias": "db-1", "nics": []})).json()
                await printed(f"{second['uuid']} db-1")  # and so does a change
            follower.terminate()
            async with asyncio.timeout(_FOLLOW_SECONDS):
                rest, _ = await follower.communicate()
        finally:
            if follower.returncode is None:
                follower.kill()
                await follower.wait()
        # A refusal reaches a listener-only install's CLI as one line, like any other
        # install's (its error handler must not need the publisher's package).
        refused = await asyncio.to_thread(
            light.run, ["changefeed", "listen", served.url, "--resource", "nosuch"], cwd=tmp_path
        )
    assert "server-side modules loaded: []" in rest.decode(), "".join(out) + rest.decode()
    assert refused.returncode == 1, refused
    last = refused.stderr.splitlines()[-1]  # after the JSON log lines
    assert last == (
        "changefeed listen: registration refused (unknown_resource):"
        " no change feed for resource 'nosuch'"
    ), refused.stderr
    assert "Traceback" not in refused.stderr


def test_the_fast_path_asked_of_an_untested_uvicorn_is_plain_asgi_and_says_why(
    wheel_venvs: Venvs, tmp_path: Path
) -> None:
    """uvicorn 0.35 (supported, through plain ASGI) is outside the versions the fast
    path was tested on: asking for it gives uvicorn's own protocol and one warning."""
    old = wheel_venvs.get("uvicorn-0.35", "publisher", f"uvicorn[standard]=={OLDEST_UVICORN}")
    code = (
        "from changefeed.logs import configure_logging\n"
        "configure_logging('info', json_output=True)\n"
        "from changefeed.serving import FanoutWebSocketProtocol\n"
        "print(FanoutWebSocketProtocol.__module__)\n"
    )
    done = old.run(["python", "-c", code], cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "uvicorn.protocols.websockets.websockets_sansio_impl"
    [line] = [json.loads(x) for x in done.stderr.splitlines() if '"serving.fast_path"' in x]
    assert line["level"] == "warning" and line["path"] == "plain ASGI"
    assert line["why"] == f"uvicorn {OLDEST_UVICORN} is outside the tested versions (>=0.54,<0.55)"
    # Where the app has set up no logging, or not yet (uvicorn's --ws option imports
    # the class before the app), the warning still says why.
    bare = old.run(["python", "-c", code.split("\n", 2)[2]], cwd=tmp_path)
    assert bare.returncode == 0, bare.stderr
    assert f"why=uvicorn {OLDEST_UVICORN} is outside the tested versions" in bare.stderr


def test_without_httptools_the_fast_path_runs_on_h11_and_the_deadlines_name_it(
    wheel_venvs: Venvs, tmp_path: Path
) -> None:
    """``changefeed[publisher]`` with plain ``uvicorn`` (no ``[standard]``, so no
    httptools): uvicorn chooses h11, and the fast path, whose self-check runs the
    protocol uvicorn chose, runs on it: a library that is only not installed is not
    "uvicorn changed what it uses". The deadlines extend both HTTP protocols: they
    say which library they need."""
    plain = wheel_venvs.get("uvicorn-plain", "publisher", "uvicorn")
    assert "httptools" not in plain.distributions()
    code = (
        "from changefeed.fast_path import deadlines, fast_path\n"
        "print(fast_path().why_not)\n"
        "print(deadlines().why_not)\n"
    )
    done = plain.run(["python", "-c", code], cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    fast, without = done.stdout.splitlines()[-2:]
    assert fast == "None", done.stdout
    assert without.endswith(
        "lacks what it uses: uvicorn.protocols.http.httptools_impl needs httptools, "
        "which is not installed (uvicorn[standard] has it)"
    ), without
