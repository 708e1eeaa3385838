"""Create and upgrade the feed schema: idempotent, versioned, safe to run concurrently.

Migrations are the numbered files in ``sql/``; ``<schema>.schema_migrations``
records which ones ran. Every run takes a transaction-scoped advisory lock, so
several publishers starting at once apply each migration exactly once.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from importlib import resources
from typing import TYPE_CHECKING, Any, TypeAlias

if TYPE_CHECKING:  # asyncpg comes with changefeed[publisher]; the listener needs none of it
    import asyncpg
    from asyncpg.pool import PoolConnectionProxy

from .errors import ProtocolError

__all__ = [
    "Migration",
    "PgConnection",
    "apply_schema",
    "load_migrations",
    "needed_version",
    "notify_channel",
    "outdated",
    "quote_schema",
    "schema_version",
]

PgConnection: TypeAlias = "asyncpg.Connection[Any] | PoolConnectionProxy[Any]"
"""A plain asyncpg connection or one borrowed from a pool."""

_IDENTIFIER = re.compile(r"^[a-z_][a-z0-9_]{0,62}$")
_LOCK_KEY = 0x6366_6565_6400  # "cfeed": serializes schema changes cluster-wide


@dataclass(frozen=True, slots=True)
class Migration:
    version: int
    name: str
    sql: str


def quote_schema(schema: str) -> str:
    """Return ``schema`` as a quoted SQL identifier.

    Schema names come from configuration, not requests; they are still
    checked against a strict pattern, since identifiers cannot be bound as
    query parameters.

    Raises:
        ProtocolError: the name is not a plain lower-case identifier.
    """
    if not _IDENTIFIER.match(schema):
        raise ProtocolError(
            "bad_config", f"schema name {schema!r} must match {_IDENTIFIER.pattern}"
        )
    return f'"{schema}"'


def notify_channel(schema: str) -> str:
    """The LISTEN/NOTIFY channel that rings the tailers of ``schema``'s feed."""
    quote_schema(schema)
    return f"changefeed_{schema}"


def load_migrations(schema: str = "changefeed") -> list[Migration]:
    """Return the migrations for ``schema`` in version order."""
    quoted = quote_schema(schema)
    channel = "'" + notify_channel(schema) + "'"
    found = []
    for entry in resources.files(__package__).joinpath("sql").iterdir():
        match = re.match(r"^(\d{4})_(\w+)\.sql$", entry.name)
        if match:
            sql = entry.read_text().replace("{schema}", quoted).replace("{channel}", channel)
            found.append(Migration(int(match.group(1)), match.group(2), sql))
    return sorted(found, key=lambda m: m.version)


async def apply_schema(conn: PgConnection, schema: str = "changefeed") -> list[int]:
    """Create or upgrade the feed schema on ``conn``; return the versions applied now."""
    quoted = quote_schema(schema)
    applied_now = []
    async with conn.transaction():
        await conn.execute("SELECT pg_advisory_xact_lock($1)", _LOCK_KEY)
        await conn.execute(f"CREATE SCHEMA IF NOT EXISTS {quoted}")
        await conn.execute(
            f"CREATE TABLE IF NOT EXISTS {quoted}.schema_migrations ("
            " version integer PRIMARY KEY, name text NOT NULL,"
            " applied timestamptz NOT NULL DEFAULT now())"
        )
        done = {
            r["version"]
            for r in await conn.fetch(f"SELECT version FROM {quoted}.schema_migrations")
        }
        for migration in load_migrations(schema):
            if migration.version in done:
                continue
            await conn.execute(migration.sql)
            await conn.execute(
                f"INSERT INTO {quoted}.schema_migrations (version, name) VALUES ($1, $2)",
                migration.version,
                migration.name,
            )
            applied_now.append(migration.version)
    return applied_now


def needed_version() -> int:
    """The version this code reads and writes the feed at: its newest migration."""
    return load_migrations()[-1].version


def outdated(schema: str, version: int) -> str | None:
    """Why a feed schema at ``version`` cannot be served by this code, or None."""
    needed = needed_version()
    if version == 0:
        return f"the feed schema {schema!r} does not exist: run 'changefeed db init --dsn DSN'"
    if version < needed:
        return (
            f"the feed schema {schema!r} is at version {version}, this changefeed needs"
            f" {needed}: run 'changefeed db init --dsn DSN' to migrate it"
        )
    return None


async def schema_version(conn: PgConnection, schema: str = "changefeed") -> int:
    """Return the highest applied migration, 0 when the schema does not exist."""
    quoted = quote_schema(schema)
    exists = await conn.fetchval(
        "SELECT to_regclass($1) IS NOT NULL", f"{quoted}.schema_migrations"
    )
    if not exists:
        return 0
    return int(
        await conn.fetchval(f"SELECT coalesce(max(version), 0) FROM {quoted}.schema_migrations")
    )
