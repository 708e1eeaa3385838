"""deploy/postgresql/: the server settings, the feed table's storage settings, the roles.

A PostgreSQL of its own (these settings need a restart, and roles are
cluster-wide) is started with ``deploy/postgresql/changefeed.conf``; every
setting must be accepted as written. ``feed-table.sql`` and ``roles.sql`` are
applied as an operator would, and then a publisher runs with nothing but the
``changefeed_publisher`` role while an API role that is only a
``changefeed_writer`` publishes: it tails, trims (retention) and sees the
writer's open transaction; neither role can do more than that. A standby of
that server made with ``deploy/postgresql/standby.conf`` accepts it as written,
and the same role reads the feed from it.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import asyncpg
import pytest
from helpers import fresh_database, standby_caught_up, wait_until
from test_deploy_support import DEPLOY

from changefeed.embedded import EmbeddedPostgres, standby_of, temporary
from changefeed.publisher import (
    ConfigError,
    Publisher,
    PublisherConfig,
    ResourceConfig,
    install_trigger,
)
from changefeed.standalone import check_database

SETTING = re.compile(r"^\s*([a-z_]+)\s*=\s*('(?:[^']*)'|[^#\s]+)\s*(?:#.*)?$")


def deploy_settings() -> dict[str, str]:
    """The settings of deploy/postgresql/changefeed.conf, quotes removed."""
    settings = {}
    for line in (DEPLOY / "postgresql" / "changefeed.conf").read_text().splitlines():
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        match = SETTING.match(line)
        assert match, f"unparsable line in changefeed.conf: {line!r}"
        settings[match.group(1)] = match.group(2).strip("'")
    return settings


@pytest.fixture(scope="module")
def deploy_pg() -> Iterator[EmbeddedPostgres]:
    """A PostgreSQL started with deploy/postgresql/changefeed.conf."""
    server = temporary(settings=deploy_settings())
    try:
        server.start()
        yield server
    finally:
        server.close()


@pytest.fixture
async def owner_dsn(deploy_pg: EmbeddedPostgres) -> AsyncIterator[str]:
    """A fresh database with the feed schema, as `changefeed db init` leaves it."""
    async with fresh_database(deploy_pg, feed_schema=True, prefix="deploy") as dsn:
        yield dsn


def read(path: Path) -> str:
    return path.read_text()


def as_role(dsn: str, role: str) -> str:
    return dsn.replace("postgresql://postgres@", f"postgresql://{role}@", 1)


async def run_sql_file(dsn: str, path: Path) -> None:
    sql = read(path)
    conn = await asyncpg.connect(dsn)
    try:
        await conn.execute(sql)
    finally:
        await conn.close()


async def test_server_settings_are_accepted(deploy_pg: EmbeddedPostgres) -> None:
    wanted = deploy_settings()
    assert "idle_in_transaction_session_timeout" in wanted
    conn = await asyncpg.connect(deploy_pg.dsn)
    try:
        rows = await conn.fetch(
            "SELECT name, source, pending_restart FROM pg_settings WHERE name = ANY($1::text[])",
            list(wanted),
        )
    finally:
        await conn.close()
    found = {r["name"]: r for r in rows}
    assert set(found) == set(wanted), set(wanted) - set(found)
    for name, row in found.items():
        assert row["source"] == "configuration file", (name, row["source"])
        assert row["pending_restart"] is False, name


async def test_feed_table_settings_apply_twice(owner_dsn: str) -> None:
    path = DEPLOY / "postgresql" / "feed-table.sql"
    await run_sql_file(owner_dsn, path)
    await run_sql_file(owner_dsn, path)  # re-running is harmless
    conn = await asyncpg.connect(owner_dsn)
    try:
        options = await conn.fetchval(
            "SELECT reloptions FROM pg_class WHERE oid = 'changefeed.feed'::regclass"
        )
    finally:
        await conn.close()
    got = dict(option.split("=", 1) for option in options)
    assert got["autovacuum_vacuum_cost_delay"] == "0"
    assert got["fillfactor"] == "100"
    assert got["autovacuum_vacuum_insert_scale_factor"] == "0.02"


async def test_least_privilege_roles_run_a_publisher(owner_dsn: str) -> None:
    roles = DEPLOY / "postgresql" / "roles.sql"
    await run_sql_file(owner_dsn, roles)
    await run_sql_file(owner_dsn, roles)  # re-running is harmless
    owner = await asyncpg.connect(owner_dsn)
    try:
        # An API's own role: a writer and nothing else in the feed's schema.
        await owner.execute(
            "DO $$ BEGIN CREATE ROLE vmapi LOGIN; EXCEPTION WHEN duplicate_object THEN NULL; "
            "END $$; GRANT changefeed_writer TO vmapi;"
            " CREATE SCHEMA IF NOT EXISTS vmapi AUTHORIZATION vmapi"
        )
    finally:
        await owner.close()

    # What `changefeed serve` checks first, as the role it runs as.
    await check_database(as_role(owner_dsn, "changefeed_publisher"), None, schema="changefeed")
    # create_schema = true with this role (it may not create one): named in one
    # line before the server starts, not a traceback and "Application startup failed".
    with pytest.raises(ConfigError, match=r"publisher\.create_schema: is true, and the feed"):
        await check_database(
            as_role(owner_dsn, "changefeed_publisher"), None, create="changefeed_other"
        )
    publisher = Publisher(
        PublisherConfig(
            dsn=as_role(owner_dsn, "changefeed_publisher"),
            resources=(ResourceConfig("vm", "/vms"),),
            create_schema=False,
            poll_interval=0.05,
            max_age=0.5,
            retention_interval=0.2,
        )
    )
    writer = await asyncpg.connect(as_role(owner_dsn, "vmapi"))
    reader = await asyncpg.connect(as_role(owner_dsn, "changefeed_publisher"))
    await publisher.start()
    try:
        await asyncio.wait_for(publisher.tailer.ready.wait(), 10)
        await writer.execute("SELECT changefeed.publish('vm', ARRAY['nic'], 'vm-1')")
        await writer.execute(
            "SELECT changefeed.publish_many(ARRAY['vm','vm'], ARRAY['','alias'], "
            "ARRAY['vm-2','vm-3'])"
        )
        # Or its own table does, through a publish_row trigger it attached itself.
        await writer.execute("CREATE TABLE vmapi.vms (uuid text PRIMARY KEY)")
        await install_trigger(writer, "vmapi.vms", "vm", "uuid")
        await writer.execute("INSERT INTO vmapi.vms VALUES ('vm-t')")
        await wait_until(lambda: publisher.tailer.entries_total == 4, 10, message="tailed")

        # Retention trims with the publisher's role and raises the low-water mark.
        async def trimmed() -> bool:
            count: int = await reader.fetchval("SELECT count(*) FROM changefeed.feed")
            return count == 0

        await wait_until(trimmed, 10, interval=0.05, message="retention trimmed")
        low_water = await reader.fetchval("SELECT low_water_id FROM changefeed.feed_state")
        assert low_water >= 4

        # The writer's open transaction is visible to the publisher (pg_read_all_stats).
        transaction = writer.transaction()
        await transaction.start()
        try:
            await writer.execute("SELECT changefeed.publish('vm', '{}', 'vm-4')")
            await wait_until(
                lambda: publisher.feed_health.oldest_writer_seconds > 0.5, 10, message="oldest xact"
            )
        finally:
            await transaction.rollback()

        # And no more than that.
        denied: list[tuple[asyncpg.Connection[Any], str]] = [
            (reader, "SELECT changefeed.publish('vm', '{}', 'forged')"),
            (
                reader,
                "INSERT INTO changefeed.feed (resource, changed_resource_id) VALUES ('vm','x')",
            ),
            (reader, "DROP TABLE changefeed.feed"),
            (writer, "SELECT count(*) FROM changefeed.feed"),
            (writer, "DELETE FROM changefeed.feed"),
            (writer, "UPDATE changefeed.feed_state SET low_water_id = 0"),
        ]
        for conn, sql in denied:
            with pytest.raises(asyncpg.InsufficientPrivilegeError):
                await conn.execute(sql)
    finally:
        await publisher.stop()
        await writer.close()
        await reader.close()


def standby_settings() -> dict[str, str]:
    """The settings of deploy/postgresql/standby.conf, quotes removed."""
    settings = {}
    for line in (DEPLOY / "postgresql" / "standby.conf").read_text().splitlines():
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        match = SETTING.match(line)
        assert match, f"unparsable line in standby.conf: {line!r}"
        settings[match.group(1)] = match.group(2).strip("'")
    return settings


async def test_least_privilege_publisher_reads_a_standby_made_with_standby_conf(
    deploy_pg: EmbeddedPostgres, owner_dsn: str
) -> None:
    """A real standby of the deploy server (``pg_basebackup -R``) with standby.conf: every
    setting accepted as written, and a publisher with nothing but the
    changefeed_publisher role tails it, hears the doorbell on the primary, and sees the
    primary's oldest writer there (the roles replicate with everything else)."""
    await run_sql_file(owner_dsn, DEPLOY / "postgresql" / "roles.sql")
    wanted = standby_settings()
    assert wanted["hot_standby_feedback"] == "on"
    standby = standby_of(deploy_pg, settings=wanted)
    try:
        standby.start()
        database = owner_dsn.rsplit("/", 1)[1]
        await standby_caught_up(owner_dsn, standby.dsn)
        conn = await asyncpg.connect(standby.dsn)
        try:
            rows = await conn.fetch(
                "SELECT name, setting, source, pending_restart FROM pg_settings"
                " WHERE name = ANY($1::text[])",
                list(wanted),
            )
            assert await conn.fetchval("SELECT pg_is_in_recovery()")
        finally:
            await conn.close()
        assert {r["name"] for r in rows} == set(wanted)
        for row in rows:
            assert row["source"] == "configuration file" and not row["pending_restart"], dict(row)

        publisher = Publisher(
            PublisherConfig(
                dsn=as_role(owner_dsn, "changefeed_publisher"),
                read_dsn=as_role(standby.dsn_for(database), "changefeed_publisher"),
                resources=(ResourceConfig("vm", "/vms"),),
                create_schema=False,
                retention=False,
                poll_interval=30.0,  # the doorbell, not the poll
            )
        )
        writer = await asyncpg.connect(owner_dsn)
        await publisher.start()
        try:
            await asyncio.wait_for(publisher.tailer.ready.wait(), 10)
            await writer.execute("SELECT changefeed.publish('vm', ARRAY['nic'], 'vm-1')")
            await wait_until(lambda: publisher.tailer.entries_total == 1, 10, message="tailed")
            assert publisher.stats()["tailer"]["doorbell"]["status"] == "listening"
            transaction = writer.transaction()
            await transaction.start()
            try:
                await writer.execute("SELECT changefeed.publish('vm', '{}', 'vm-2')")
                await wait_until(
                    lambda: publisher.feed_health.oldest_writer_seconds > 0.5, 10, message="writer"
                )
            finally:
                await transaction.rollback()
        finally:
            await publisher.stop()
            await writer.close()
    finally:
        standby.close()
