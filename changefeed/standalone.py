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
import msgspec
from starlette.applications import Starlette

from changefeed.publisher import ConfigError, Publisher
from changefeed.publisher.config import load_service_config
from changefeed.schemas import apply_schema, outdated, schema_version
from changefeed.serving import DrainingServer, server_config

__all__ = ["build_app", "check_database", "check_same_feed", "run_standalone"]


def build_app(publisher: Publisher) -> Starlette:
    """The standalone publisher's app: only the publisher's routes."""
    return Starlette(routes=publisher.routes, lifespan=publisher.lifespan)


async def check_database(
    dsn: str,
    source: str | None,
    *,
    schema: str | None = None,
    create: str | None = None,
    key: str = "publisher.dsn",
) -> None:
    """Fail fast, naming the key: the database must be reachable and, when ``schema`` is
    given, already hold the feed schema; ``create``: the schema to create or migrate
    now (what the publisher would do as it starts, where a role without the right
    would end the start-up with a traceback).

    Raises:
        ConfigError: naming ``key`` (or ``publisher.create_schema``) and ``source``.
    """
    conn = await _connect(dsn, key, source)
    try:
        if create is not None:
            try:
                await apply_schema(conn, create)
            except asyncpg.PostgresError as exc:  # e.g. no CREATE on the database
                why = f"is true, and the feed schema cannot be created or migrated: {exc}"
                raise ConfigError("publisher.create_schema", why, source) from None
        try:
            version = await schema_version(conn, schema) if schema is not None else None
        except asyncpg.PostgresError as exc:  # e.g. a role without the grants of roles.sql
            why = f"cannot read the feed schema's version: {exc}"
            raise ConfigError(key, why, source) from None
        if version is not None and (stale := outdated(schema or "", version)) is not None:
            raise ConfigError("publisher.create_schema", f"is false and {stale}", source)
    finally:
        await conn.close()


async def _connect(dsn: str, key: str, source: str | None) -> asyncpg.Connection:
    try:
        return await asyncpg.connect(dsn, timeout=10)
    except (OSError, TimeoutError, asyncpg.PostgresError) as exc:
        raise ConfigError(key, f"database unreachable: {exc}", source) from None
    except ValueError as exc:  # a DSN asyncpg cannot parse (ClientConfigurationError is one)
        raise ConfigError(key, f"not a usable PostgreSQL DSN: {exc}", source) from None


async def check_same_feed(
    dsn: str,
    read_dsn: str,
    source: str | None,
    *,
    keys: tuple[str, str] = ("publisher.dsn", "publisher.read_dsn"),
) -> None:
    """Fail fast, naming the second of ``keys``, when ``read_dsn`` is not the database
    ``dsn`` writes, on a hot standby of its server (or that server itself): another
    database or another cluster would be tailed as if it were, and no change written
    through ``dsn`` would ever reach a listener. A physical standby has its primary's
    system identifier (``pg_control_system()``; not compared where it may not be
    read) and the same databases; a standby that has not yet replayed the latest
    changes is no mistake, so nothing of the feed's content is compared.

    Raises:
        ConfigError: naming the key and ``source``.
    """
    found: list[tuple[str, int | None]] = []
    for where, target in zip(keys, (dsn, read_dsn), strict=True):
        conn = await _connect(target, where, source)
        try:
            database = str(await conn.fetchval("SELECT current_database()"))
            try:
                system = await conn.fetchval("SELECT system_identifier FROM pg_control_system()")
            except asyncpg.PostgresError:  # EXECUTE revoked: a hardened server
                system = None
            found.append((database, None if system is None else int(system)))
        finally:
            await conn.close()
    (database, system), (read_database, read_system) = found
    if system is not None and read_system is not None and system != read_system:
        raise ConfigError(
            keys[1],
            f"is not a hot standby of the server {keys[0]} names (system identifier"
            f" {read_system}, not {system}): no change written there would reach it",
            source,
        )
    if read_database != database:
        raise ConfigError(
            keys[1],
            f"reads database {read_database!r}, not {database!r} that {keys[0]} writes:"
            " name the same database on the standby",
            source,
        )


async def run_standalone(path: str, *, host: str | None = None, port: int | None = None) -> int:
    """Load ``path``, check the database, and serve until SIGTERM/SIGINT."""
    config, server = load_service_config(path)
    if not config.dsn:
        raise ConfigError("publisher.dsn", "is required for 'changefeed serve'", path)
    if not config.resources:
        raise ConfigError("resources", "at least one [[resources]] table is required", path)
    await check_database(
        config.dsn,
        path,
        schema=None if config.create_schema else config.schema,
        create=config.schema if config.create_schema else None,
    )
    if config.read_dsn:
        await check_database(config.read_dsn, path, key="publisher.read_dsn")
        await check_same_feed(config.dsn, config.read_dsn, path)
    # The server bounds its own sockets ([server] notsent_lowat, 0: the host's
    # setting): the publisher leaves them as the server has them.
    publisher = Publisher(msgspec.structs.replace(config, notsent_lowat=server.notsent_lowat))
    uvicorn_config = server_config(
        publisher.listeners_first(build_app(publisher)),
        host or server.host,
        port if port is not None else server.port,
        fast_path=True,
        head_timeout=server.header_timeout or None,
        max_head_bytes=server.header_max_bytes,
        ws_ping_interval=server.ping_interval,
        ws_ping_timeout=server.ping_timeout,
    )

    def announce(address: str) -> None:
        names = [r.name for r in config.resources]
        print(f"changefeed publisher for {names} on http://{address}", file=sys.stderr, flush=True)

    runner = DrainingServer(
        uvicorn_config,
        [publisher],
        grace=server.drain_grace,
        owns_process=True,
        notsent_lowat=server.notsent_lowat,
        announce=announce,
    )
    await runner.serve()
    await asyncio.sleep(0)
    return 0 if runner.started else 1
