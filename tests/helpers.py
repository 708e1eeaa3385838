"""Small helpers shared by the tests (import as ``from helpers import ...``).

Tests never sleep to synchronise without a bound: they wait for a condition
with :func:`wait_until`, which fails with a message when the bound is reached.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Protocol
from urllib.parse import urlsplit, urlunsplit

from prometheus_client.parser import text_string_to_metric_families

__all__ = [
    "LogRecords",
    "dsn_with_database",
    "free_port",
    "fresh_database",
    "metric_value",
    "standby_caught_up",
    "wait_until",
]


class LogRecords(logging.Handler):
    """Keeps every record at or above ``level`` that reaches it (add it to a logger)."""

    def __init__(self, level: int = logging.NOTSET) -> None:
        super().__init__(level)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago on ``host`` (bind to port 0)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        port: int = sock.getsockname()[1]
    return port


async def wait_until(
    predicate: Callable[[], bool | Awaitable[bool]],
    timeout: float = 10.0,
    interval: float = 0.01,
    message: str | None = None,
) -> None:
    """Wait until ``predicate()`` (sync or async) is true.

    Raises:
        AssertionError: the condition did not hold within ``timeout`` seconds.
    """
    deadline = time.monotonic() + timeout
    while True:
        result = predicate()
        if inspect.isawaitable(result):
            result = await result
        if result:
            return
        if time.monotonic() >= deadline:
            what = message or getattr(predicate, "__name__", repr(predicate))
            raise AssertionError(f"condition not met within {timeout}s: {what}")
        await asyncio.sleep(interval)


def dsn_with_database(dsn: str, database: str) -> str:
    """``dsn`` with its database (the URL path) replaced by ``database``."""
    parts = urlsplit(dsn)
    return urlunsplit(parts._replace(path="/" + database))


class _Server(Protocol):
    @property
    def dsn(self) -> str: ...

    def dsn_for(self, database: str) -> str: ...


@contextlib.asynccontextmanager
async def fresh_database(
    server: _Server, *, feed_schema: bool = False, prefix: str = "test"
) -> AsyncIterator[str]:
    """A new, uniquely named database on ``server`` (with the feed schema when asked);
    yields its DSN and drops it (``WITH (FORCE)``) afterwards."""
    import asyncpg

    from changefeed.schemas import apply_schema

    name = f"{prefix}_{uuid.uuid4().hex}"
    admin = await asyncpg.connect(server.dsn)
    try:
        await admin.execute(f'CREATE DATABASE "{name}"')
    finally:
        await admin.close()
    dsn = server.dsn_for(name)
    try:
        if feed_schema:
            conn = await asyncpg.connect(dsn)
            try:
                await apply_schema(conn)
            finally:
                await conn.close()
        yield dsn
    finally:
        admin = await asyncpg.connect(server.dsn)
        try:
            await admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        finally:
            await admin.close()


def metric_value(text: str, name: str, **labels: str) -> float:
    """The value of sample ``name`` (with ``labels``) in a /metrics page.

    Raises:
        KeyError: no such sample.
    """
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return float(sample.value)
    raise KeyError(f"{name} {labels} not in /metrics")


async def standby_caught_up(primary_dsn: str, standby_dsn: str, timeout: float = 30.0) -> None:
    """Wait until the standby at ``standby_dsn`` has replayed everything the primary at
    ``primary_dsn`` has written so far (its WAL insert position now)."""
    import asyncpg

    from changefeed.wal import insert_target

    primary = await asyncpg.connect(primary_dsn)
    try:
        target = await insert_target(primary)
    finally:
        await primary.close()
    standby = await asyncpg.connect(standby_dsn)
    try:

        async def replayed() -> bool:
            query = "SELECT NOT pg_is_in_recovery() OR pg_last_wal_replay_lsn() >= $1::text::pg_lsn"
            return bool(await standby.fetchval(query, target))

        await wait_until(replayed, timeout, message=f"standby replayed {target}")
    finally:
        await standby.close()


def run_python(code: str) -> subprocess.CompletedProcess[str]:
    """Run ``code`` in a fresh interpreter (for process-wide state: imports, logging,
    the garbage collector); its output as text, within 60 s."""
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False
    )


async def terminate_tailer(dsn: str) -> None:
    """Terminate the backend of the one publisher tailer reading ``dsn``'s database
    (other tests' tailers, on other databases of the server, are left alone)."""
    import asyncpg

    conn = await asyncpg.connect(dsn)
    try:
        killed = await conn.fetchval(
            "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity"
            " WHERE application_name = 'changefeed-tailer' AND datname = current_database()"
        )
    finally:
        await conn.close()
    assert killed == 1, f"{killed} tailers found"
