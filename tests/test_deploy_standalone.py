"""``changefeed serve --config``, end to end, as the processes deploy/ runs.

The example VM API (``changefeed example-api``) owns the VMs and writes the
feed; a standalone publisher (``changefeed serve``) tails the same feed and
serves listeners, with the bootstrap route an absolute URL on the API. A
listener registered with the standalone publisher bootstraps from the API,
follows the writes, and its mirror converges to the API's data.

Bad configs end the process at once with one line naming the file and the
key: an unknown key, a wrong type, a database that cannot be reached.
"""

from __future__ import annotations

import asyncio
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import asyncpg
import httpx
import pytest
from helpers import free_port, fresh_database, wait_until
from test_deploy_support import ROOT, ChangefeedServer, stopping, toml_document
from test_listener_support import api_state

from changefeed.listener import BackoffPolicy, Controller, Listener, ListenerConfig
from changefeed.schemas import ChangeKind


async def test_standalone_publisher_with_an_absolute_bootstrap_route(
    dsn: str, tmp_path: Path
) -> None:
    api_port, port = free_port(), free_port()
    api = ChangefeedServer.example_api("api", dsn, api_port, tmp_path)
    config = tmp_path / "changefeed.toml"
    route = f"http://127.0.0.1:{api_port}/vms"
    config.write_text(
        toml_document(
            {"dsn": dsn, "poll_interval": "100ms", "cursor_key": "standalone-test-cursor-key"},
            [{"name": "vm", "sub_resources": ["nic", "alias"], "bootstrap_route": route}],
            {"port": port},
        )
    )
    publisher = ChangefeedServer.standalone("serve", config, port, tmp_path)
    async with stopping(publisher, api), httpx.AsyncClient(base_url=api.url, timeout=5) as http:
        api.start()
        await api.wait_ready()  # the API creates the feed schema; serve may then start
        publisher.start()
        await publisher.wait_ready()

        resources = (await http.get(f"{publisher.url}/changefeeds")).json()["resources"]
        assert resources == [
            {"resource": "vm", "subResources": ["nic", "alias"], "bootstrapRoute": route}
        ]
        ids = []
        for n in range(30):
            body = {"alias": f"before-{n}", "nics": [{"ip": f"10.3.0.{n + 1}"}]}
            ids.append((await http.post("/vms", json=body)).json()["uuid"])

        listener = Listener(
            publisher.ws_url,
            instance=str(uuid.uuid4()),
            service="standalone-test",
            change_kind=ChangeKind("vm", ("nic", "alias")),
            config=ListenerConfig(
                backoff=BackoffPolicy(initial=0.05, maximum=0.5), page_limit=7, http_timeout=5
            ),
        )
        async with Controller(listener, retry=BackoffPolicy(initial=0.02, maximum=0.5)) as mirror:
            await mirror.wait_synced(20)
            assert len(mirror.mirror) == 30
            for n, vm in enumerate(ids):
                if n % 3 == 0:
                    await http.delete(f"/vms/{vm}")
                else:
                    await http.patch(f"/vms/{vm}", json={"alias": f"after-{n}"})
            for n in range(10):
                await http.post("/vms", json={"alias": f"new-{n}", "nics": []})
            expected = await api_state(dsn)

            async def converged() -> bool:
                return dict(mirror.mirror) == expected

            await wait_until(converged, 20, interval=0.05, message="mirror converged")
            status = listener.status()
            assert status.bootstraps == 1 and status.registrations == 1, status

        stats = await publisher.stats()
        assert stats["tailer"]["status"] == "running"
        assert stats["tailer"]["entries"] >= 30 + 30 + 10


def run_serve(config: Path, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "changefeed.cli", "serve", "--config", str(config)],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
        cwd=ROOT,
    )


RESOURCE = {"name": "vm", "bootstrap_route": "/vms"}


@pytest.mark.parametrize(
    ("publisher", "resource", "key", "words"),
    [
        pytest.param(
            {"dsn": "postgresql://x@127.0.0.1/x", "max_agee": "1h"},
            RESOURCE,
            "publisher.max_agee",
            "unknown key",
            id="unknown-key",
        ),
        pytest.param(
            {"dsn": "postgresql://x@127.0.0.1:notaport/x"},
            RESOURCE,
            "publisher.dsn",
            "not a usable PostgreSQL DSN",
            id="dsn-bad-port",
        ),
        pytest.param(
            {"dsn": "not a dsn"},
            RESOURCE,
            "publisher.dsn",
            "not a usable PostgreSQL DSN",
            id="dsn-not-a-url",
        ),
        pytest.param(
            {"dsn": "postgresql://x@127.0.0.1/x", "queue_size": "big"},
            RESOURCE,
            "publisher.queue_size",
            "expected an integer",
            id="wrong-type",
        ),
        pytest.param(
            {"dsn": "postgresql://x@127.0.0.1/x"},
            {"name": "vm", "bootstrap_route": "/vms", "subresources": ["nic"]},
            "resources[0].subresources",
            "unknown key",
            id="unknown-resource-key",
        ),
    ],
)
def test_serve_refuses_a_bad_config_naming_file_and_key(
    tmp_path: Path, publisher: dict[str, str], resource: dict[str, object], key: str, words: str
) -> None:
    config = tmp_path / "bad.toml"
    config.write_text(toml_document(publisher, [resource]))
    result = run_serve(config)
    assert result.returncode == 1, result
    line = result.stderr.strip()
    assert line.startswith(f"changefeed serve: {config}: {key}: {words}"), line
    assert "Traceback" not in result.stderr and "\n" not in line


def test_serve_refuses_an_unreachable_database(tmp_path: Path) -> None:
    closed = free_port()  # nothing listens there
    config = tmp_path / "changefeed.toml"
    config.write_text(
        toml_document({"dsn": f"postgresql://postgres@127.0.0.1:{closed}/app"}, [RESOURCE])
    )
    started = time.monotonic()
    result = run_serve(config)
    elapsed = time.monotonic() - started
    assert result.returncode == 1, result
    line = result.stderr.strip()
    assert line.startswith(f"changefeed serve: {config}: publisher.dsn: database unreachable"), line
    assert "Traceback" not in result.stderr
    assert elapsed < 15, f"took {elapsed:.1f}s to give up"


async def test_serve_refuses_a_read_dsn_that_serves_another_feed(
    feed_dsn: str, pg_server: Any, tmp_path: Path
) -> None:
    """A read_dsn that is not the dsn's database on a replica of its server (here another
    database with a feed of its own) would be tailed instead of the feed the API
    writes: refused at start-up, naming the key, rather than serving a feed that
    never changes."""
    async with fresh_database(pg_server, feed_schema=True, prefix="other") as other:
        config = tmp_path / "changefeed.toml"
        config.write_text(toml_document({"dsn": feed_dsn, "read_dsn": other}, [RESOURCE]))
        result = await asyncio.to_thread(run_serve, config)
    name = other.rsplit("/", 1)[1]
    assert result.returncode == 1, result
    line = result.stderr.strip()
    assert line.startswith(
        f"changefeed serve: {config}: publisher.read_dsn: reads database {name!r}, not"
    ), line
    assert "Traceback" not in result.stderr and "\n" not in line


async def test_serve_refuses_a_read_dsn_on_another_cluster(feed_dsn: str, tmp_path: Path) -> None:
    """A server that is no standby of the dsn's (another cluster): refused by its system
    identifier, naming the key."""
    from changefeed.embedded import temporary

    server = temporary()
    server.start()
    try:
        async with fresh_database(server) as other:
            config = tmp_path / "changefeed.toml"
            config.write_text(toml_document({"dsn": feed_dsn, "read_dsn": other}, [RESOURCE]))
            result = await asyncio.to_thread(run_serve, config)
    finally:
        server.close()
    assert result.returncode == 1, result
    line = result.stderr.strip()
    assert line.startswith(
        f"changefeed serve: {config}: publisher.read_dsn: is not a hot standby of the server"
    ), line


async def test_a_schema_older_than_the_code_is_a_clear_error_not_a_tailer_retrying(
    feed_dsn: str, tmp_path: Path
) -> None:
    """With create_schema off, a feed schema one migration behind (code upgraded before
    'changefeed db init' ran): 'serve' refuses at start-up, and an embedded publisher's
    start raises, both saying which version and what to run, rather than a tailer
    retrying its query on a missing column forever, as if the database were away."""
    from starlette.applications import Starlette

    from changefeed.publisher import ConfigError, Publisher, PublisherConfig, ResourceConfig
    from changefeed.schemas.migrations import needed_version

    needed = needed_version()
    conn = await asyncpg.connect(feed_dsn)
    try:
        await conn.execute("DELETE FROM changefeed.schema_migrations WHERE version = $1", needed)
    finally:
        await conn.close()
    words = f"is at version {needed - 1}, this changefeed needs {needed}: run 'changefeed db init"
    config = tmp_path / "changefeed.toml"
    config.write_text(toml_document({"dsn": feed_dsn, "create_schema": False}, [RESOURCE]))
    result = await asyncio.to_thread(run_serve, config)
    assert result.returncode == 1, result
    line = result.stderr.strip()
    assert line.startswith(f"changefeed serve: {config}: publisher.create_schema: is false"), line
    assert words in line, line
    publisher = Publisher(
        PublisherConfig(
            dsn=feed_dsn, resources=(ResourceConfig("vm", "/vms"),), create_schema=False
        )
    )
    app = Starlette(routes=publisher.routes)
    with pytest.raises(ConfigError, match=words):
        async with publisher.lifespan(app):
            pass


async def test_serve_refuses_a_missing_database(pg_server: Any, tmp_path: Path) -> None:
    config = tmp_path / "changefeed.toml"
    dsn = pg_server.dsn_for(f"missing_{uuid.uuid4().hex}")
    config.write_text(toml_document({"dsn": dsn}, [RESOURCE]))
    result = await asyncio.to_thread(run_serve, config)
    assert result.returncode == 1, result
    line = result.stderr.strip()
    assert line.startswith(f"changefeed serve: {config}: publisher.dsn: database unreachable"), line
    assert "does not exist" in line and "Traceback" not in result.stderr


async def test_serve_on_a_port_in_use_says_so_in_one_line(feed_dsn: str, tmp_path: Path) -> None:
    """uvicorn exits the process when it cannot listen: the command ends with status 1
    and one line saying so, not status 3 and an asyncio traceback ("Task exception was
    never retrieved")."""
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    config = tmp_path / "changefeed.toml"
    text = toml_document({"dsn": feed_dsn, "create_schema": False}, [RESOURCE])
    config.write_text(text + f'\n[server]\nhost = "127.0.0.1"\nport = {port}\n')
    try:
        result = await asyncio.to_thread(run_serve, config)
    finally:
        taken.close()
    assert result.returncode == 1, result
    last = result.stderr.strip().splitlines()[-1]
    assert last == f"changefeed serve: cannot listen on 127.0.0.1:{port} (the line above says why)"
    assert "Traceback" not in result.stderr, result.stderr
