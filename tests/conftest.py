"""Shared fixtures: one real PostgreSQL per test session, one fresh database per test.

``pg_server`` is an EmbeddedPostgres on a throwaway data directory (under the
system temp dir, so that it also works as root), started once per session.
With ``CHANGEFEED_TEST_DSN`` set, an external server is used instead; it
cannot be restarted, so tests that need ``restart()`` skip (use the
``restartable_pg_server`` fixture to say so).

``pg_standby`` is a real streaming standby of ``pg_server`` (``pg_basebackup
-R``), started once per session by the first test that asks for it;
``standby_dsn`` is the test's feed database there, once replicated.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from typing import Any

import asyncpg
import pytest
from helpers import dsn_with_database, standby_caught_up
from wheel_envs import Venvs, build_dist

from changefeed.embedded import EmbeddedPostgres, standby_of, temporary
from changefeed.schemas import apply_schema


@dataclass
class ExternalPostgres:
    """A server given by CHANGEFEED_TEST_DSN: usable, but not ours to restart."""

    dsn: str

    def dsn_for(self, database: str) -> str:
        return dsn_with_database(self.dsn, database)

    def is_running(self) -> bool:
        return True

    def start(self) -> str:
        return self.dsn

    def restart(self) -> str:
        pytest.skip("CHANGEFEED_TEST_DSN points at an external server: restart unsupported")

    def stop(self) -> None:
        pytest.skip("CHANGEFEED_TEST_DSN points at an external server: stop unsupported")


PgServer = EmbeddedPostgres | ExternalPostgres


@pytest.fixture(scope="session")
def pg_server() -> Iterator[PgServer]:
    """The session's PostgreSQL server (``.dsn``, ``.dsn_for(db)``, ``.restart()``)."""
    external = os.environ.get("CHANGEFEED_TEST_DSN")
    if external:
        yield ExternalPostgres(external)
        return
    server = temporary()
    try:
        server.start()
        yield server
    finally:
        server.close()


@pytest.fixture
def restartable_pg_server(pg_server: PgServer) -> EmbeddedPostgres:
    """``pg_server`` when it can be restarted; skips the test otherwise."""
    if not isinstance(pg_server, EmbeddedPostgres):
        pytest.skip("CHANGEFEED_TEST_DSN points at an external server: restart unsupported")
    return pg_server


@pytest.fixture(scope="session")
def pg_standby(pg_server: PgServer) -> Iterator[EmbeddedPostgres]:
    """A hot standby streaming from ``pg_server``, for tests that read one. Replay
    waits at most 500 ms for a conflicting query (then cancels it: SQLSTATE 40001),
    so that a conflict is quick to cause and to see."""
    if not isinstance(pg_server, EmbeddedPostgres):
        pytest.skip("CHANGEFEED_TEST_DSN points at an external server: no standby of it")
    standby = standby_of(pg_server, settings={"max_standby_streaming_delay": "500ms"})
    try:
        standby.start()
        yield standby
    finally:
        standby.close()


@pytest.fixture
async def standby_dsn(feed_dsn: str, pg_server: PgServer, pg_standby: EmbeddedPostgres) -> str:
    """``feed_dsn``'s database on ``pg_standby``, once the standby has replayed it."""
    dsn = pg_standby.dsn_for(feed_dsn.rsplit("/", 1)[1])
    await standby_caught_up(pg_server.dsn, pg_standby.dsn)
    return dsn


@pytest.fixture
async def dsn(pg_server: PgServer) -> AsyncIterator[str]:
    """DSN of a fresh database ``test_<hex>``, dropped after the test."""
    name = f"test_{uuid.uuid4().hex}"
    admin = await asyncpg.connect(pg_server.dsn)
    try:
        await admin.execute(f'CREATE DATABASE "{name}"')
    finally:
        await admin.close()
    try:
        yield pg_server.dsn_for(name)
    finally:
        if not pg_server.is_running():  # a test stopped it
            pg_server.start()
        admin = await asyncpg.connect(pg_server.dsn)
        try:
            await admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        finally:
            await admin.close()


@pytest.fixture
async def feed_dsn(dsn: str) -> str:
    """Like ``dsn``, with the feed schema (``changefeed``) applied."""
    conn = await asyncpg.connect(dsn)
    try:
        await apply_schema(conn)
    finally:
        await conn.close()
    return dsn


@pytest.fixture(scope="session")
def spark() -> Iterator[Any]:
    """One SparkSession on ``local[2]`` for every test that runs the compaction job in
    this process: starting the JVM is the slow part, so it is started once, when the
    first such test asks for it."""
    from changefeed.compaction import spark_session

    with spark_session("local[2]") as session:
        yield session


@pytest.fixture(scope="session")
def wheel_venvs(tmp_path_factory: pytest.TempPathFactory) -> Venvs:
    """The built wheel (from the sdist) and venvs made from it on first use
    (tests/wheel_envs.py): tests/test_wheel.py and tests/test_asgi_servers.py share them."""
    dist = build_dist(tmp_path_factory.mktemp("dist"))
    return Venvs(dist, tmp_path_factory.mktemp("venvs"))
