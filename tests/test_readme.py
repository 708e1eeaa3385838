"""The README's code examples run as written (only the DSN and URL are ours)."""

from __future__ import annotations

import asyncio
import re
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import asyncpg
import httpx
import pytest
from helpers import wait_until
from publisher_fixtures import receive_items, register, registration
from servers import serve_app

README = Path(__file__).resolve().parent.parent / "README.md"


def _blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README.read_text(), re.S)


def test_readme_has_the_two_examples_and_a_two_command_quickstart() -> None:
    assert len(_blocks()) == 2
    quickstart = README.read_text().split("## Quickstart", 1)[1].split("```sh\n", 1)[1]
    commands = [line for line in quickstart.split("```", 1)[0].splitlines() if line.strip()]
    assert [c.split()[0:2] for c in commands] == [["./dev", "demo"], ["./dev", "test"]]


async def test_publisher_example(feed_dsn: str, capsys: pytest.CaptureFixture[str]) -> None:
    """The API runs as written, and the README's own listener example follows it: it
    bootstraps from the example's route, then gets the change (a newcomer's
    listener got 404 from a route the example advertised and did not serve)."""
    source = _blocks()[0].replace('"postgresql://postgres@127.0.0.1:5432/postgres"', repr(feed_dsn))
    namespace: dict[str, Any] = {}
    exec(compile(source, "README.md", "exec"), namespace)
    listener: dict[str, Any] = {}
    exec(compile(_blocks()[1], "README.md", "exec"), listener)
    conn = await asyncpg.connect(feed_dsn)
    vm = str(uuid.uuid4())
    await conn.execute("CREATE TABLE vms (uuid text PRIMARY KEY, alias text)")
    await conn.execute("INSERT INTO vms VALUES ($1, 'old')", vm)
    async with serve_app(namespace["app"]) as server:
        ws, ack = await register(server.ws_url + "/changefeeds", registration(subs=["alias"]))
        assert ack["bootstrapRoute"] == "/vms"
        follower = asyncio.create_task(listener["follow_vms"](server.ws_url + "/changefeeds"))
        out: list[str] = []

        def printed(line: str) -> Callable[[], bool]:
            def seen() -> bool:
                out.append(capsys.readouterr().out)
                return line in "".join(out).splitlines()

            return seen

        try:
            await wait_until(printed(f"{vm} old"), timeout=20, message="the bootstrap")
            async with httpx.AsyncClient(base_url=server.url) as http:
                response = await http.patch(f"/vms/{vm}", json={"alias": "new"})
                assert response.status_code == 200
            (item,) = await receive_items(ws, 1)
            assert item["changeKind"] == {"resource": "vm", "subResources": ["alias"]}
            assert item["changedResourceId"] == vm
            await wait_until(printed(f"{vm} new"), timeout=20, message="the change")
        finally:
            follower.cancel()
            await asyncio.gather(follower, return_exceptions=True)
        await ws.close()
    assert await conn.fetchval("SELECT alias FROM vms") == "new"
    await conn.close()


async def test_listener_example(dsn: str, capsys: pytest.CaptureFixture[str]) -> None:
    from changefeed.example.vmapi import create_app

    namespace: dict[str, Any] = {}
    exec(compile(_blocks()[1], "README.md", "exec"), namespace)
    async with (
        serve_app(create_app(dsn, poll_interval=0.1)) as server,
        httpx.AsyncClient(base_url=server.url) as http,
    ):
        first = (await http.post("/vms", json={"alias": "web-1", "nics": []})).json()["uuid"]
        follower = asyncio.create_task(namespace["follow_vms"](server.ws_url + "/changefeeds"))
        try:
            await wait_until(
                lambda: f"{first} web-1" in capsys.readouterr().out,
                timeout=20,
                message="the bootstrap reaches reconcile",
            )
            second = (await http.post("/vms", json={"alias": "db-1", "nics": []})).json()["uuid"]
            out: list[str] = []

            def printed() -> bool:
                out.append(capsys.readouterr().out)
                return f"{second} db-1" in "".join(out)

            await wait_until(printed, timeout=20, message="a change reaches reconcile")
            assert (await http.delete(f"/vms/{second}")).status_code == 204

            def deleted() -> bool:
                out.append(capsys.readouterr().out)
                return f"{second} deleted" in "".join(out)

            await wait_until(deleted, timeout=20, message="a delete reaches reconcile")
        finally:
            follower.cancel()
            await asyncio.gather(follower, return_exceptions=True)
