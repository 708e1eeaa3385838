"""``changefeed serve``: a standalone publisher for feeds written by other services.

Services in any language append entries with ``SELECT changefeed.publish(...)``
inside their own transactions; this process tails the feed and serves
listeners. Bootstrap routes in its config are usually absolute URLs on the
APIs that own the resources.
"""

from __future__ import annotations

import asyncio
import sys

import asyncpg
from starlette.applications import Starlette

from changefeed.publisher import ConfigError, Publisher
from changefeed.publisher.config import load_service_config
from changefeed.schemas import schema_version
from changefeed.serving import DrainingServer, server_config

__all__ = ["build_app", "check_database", "run_standalone"]


def build_app(publisher: Publisher) -> Starlette:
    """The standalone publisher's app: only the publisher's routes."""
    return Starlette(routes=publisher.routes, lifespan=publisher.lifespan)


async def check_database(
    dsn: str, source: str | None, *, schema: str | None = None, key: str = "publisher.dsn"
) -> None:
    """Fail fast, naming the key: the database must be reachable and, when ``schema`` is
    given, already hold the feed schema.

    Raises:
        ConfigError: naming ``key`` (or ``publisher.create_schema``) and ``source``.
    """
    try:
        conn = await asyncpg.connect(dsn, timeout=10)
    except (OSError, TimeoutError, asyncpg.PostgresError) as exc:
        raise ConfigError(key, f"database unreachable: {exc}", source) from None
    try:
        try:
            version = await schema_version(conn, schema) if schema is not None else None
        except asyncpg.PostgresError as exc:  # e.g. a role without the grants of roles.sql
            why = f"cannot read the feed schema's version: {exc}"
            raise ConfigError(key, why, source) from None
        if version == 0:
            raise ConfigError(
                "publisher.create_schema",
                f"is false and the feed schema {schema!r} does not exist: run "
                "'changefeed db init --dsn DSN' first",
                source,
            )
    finally:
        await conn.close()


async def run_standalone(path: str, *, host: str | None = None, port: int | None = None) -> int:
    """Load ``path``, check the database, and serve until SIGTERM/SIGINT."""
    config, server = load_service_config(path)
    if not config.dsn:
        raise ConfigError("publisher.dsn", "is required for 'changefeed serve'", path)
    if not config.resources:
        raise ConfigError("resources", "at least one [[resources]] table is required", path)
    await check_database(config.dsn, path, schema=None if config.create_schema else config.schema)
    if config.read_dsn:
        await check_database(config.read_dsn, path, key="publisher.read_dsn")
    publisher = Publisher(config)
    uvicorn_config = server_config(
        publisher.listeners_first(build_app(publisher)),
        host or server.host,
        port if port is not None else server.port,
        fast_path=True,
        head_timeout=server.header_timeout,
        max_head_bytes=server.header_max_bytes,
        ws_ping_interval=server.ping_interval,
        ws_ping_timeout=server.ping_timeout,
    )
    runner = DrainingServer(
        uvicorn_config,
        [publisher],
        grace=server.drain_grace,
        owns_process=True,
        notsent_lowat=server.notsent_lowat,
    )
    print(
        f"changefeed publisher for {[r.name for r in config.resources]} on "
        f"http://{uvicorn_config.host}:{uvicorn_config.port}",
        file=sys.stderr,
        flush=True,
    )
    await runner.serve()
    await asyncio.sleep(0)
    return 0 if runner.started else 1
