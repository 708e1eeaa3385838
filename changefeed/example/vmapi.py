"""The VM API of RFD 5: a small API that owns ``vm`` and ``server`` resources and embeds
the publisher.

It is the example the tests, the demo and the benchmarks run against, and the
pattern any API follows to publish its changes:

* every write and its feed entry commit in **one transaction** (``publish``
  on the same connection, inside ``conn.transaction()``), so a change is
  announced exactly when it becomes visible, and a rolled-back write announces
  nothing;
* the change's sub-resources are exactly what changed: ``alias``, ``nic``,
  ``server`` (a migration); creation and deletion name none (the resource as a
  whole); a PATCH that changes nothing publishes nothing;
* ``GET /vms`` is the bootstrap route (keyset pagination and ``?ids=``, from
  ``changefeed.bootstrap``, with admission control), ``GET /vms/{uuid}`` the
  per-id route; both honour the publisher's bearer tokens, as do the writes.

A VM is ``{"uuid", "alias", "nics", "server_uuid"}``; ``server_uuid``, the server
it runs on (``changefeed.example.servers``), is a foreign key: naming a server
the API does not hold is a 422 ``unknown_server``. It is null for a VM not
placed yet (in Triton a VM exists before the allocator picks its server), so
it is optional at creation. A PATCH moves a VM to another server (a
migration, sub-resource ``server``) but cannot take it off every server.

Routes: ``POST /vms``, ``GET /vms`` (filters ``alias``, ``server_uuid``),
``GET|PATCH|DELETE /vms/{uuid}``, the server routes, and the publisher's
``/changefeeds`` routes, all on one feed. The tables, ``vmapi.servers`` and
``vmapi.vms``, are created at start-up (idempotent). Writes take
``application/json`` only (``changefeed.example.rest``).

It must never write without publishing in the same transaction, never
publish an entry for a change that did not happen, and never answer a
database outage with a traceback (503 ``unavailable`` instead).
"""

from __future__ import annotations

import contextlib
import ipaddress
import logging
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import asyncpg
import msgspec
import orjson
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from changefeed.bootstrap import Admission, BootstrapRoute, Filter, KeysetQuery
from changefeed.logs import log_event
from changefeed.publisher import Authorizer, Publisher, PublisherConfig, ResourceConfig, publish
from changefeed.schemas import AccessDenied, AccessGranted

from .rest import (
    MAX_BODY_BYTES,
    Handler,
    InvalidBody,
    Refused,
    fields,
    guard,
    json_response,
    path_uuid,
    read_json,
    uuid_field,
)
from .servers import SERVER_RESOURCE, SERVERS_SQL, ServerApi

__all__ = [
    "MAX_ALIAS_LENGTH",
    "MAX_NICS",
    "SCHEMA_SQL",
    "SERVER_RESOURCE",
    "VM_RESOURCE",
    "InvalidBody",
    "NewVm",
    "VmApi",
    "VmChange",
    "changed_sub_resources",
    "create_app",
    "ensure_schema",
    "parse_create",
    "parse_patch",
]

log = logging.getLogger(__name__)

VM_RESOURCE = ResourceConfig("vm", "/vms", ("nic", "alias", "server"))
"""The change feed of VMs: sub-resources ``nic``, ``alias`` and ``server`` (a migration)."""

MAX_ALIAS_LENGTH = 255
MAX_NICS = 32

SCHEMA_SQL = (
    SERVERS_SQL
    + """
CREATE TABLE IF NOT EXISTS vmapi.vms (
    uuid    uuid PRIMARY KEY,
    alias   text NOT NULL,
    nics    jsonb NOT NULL DEFAULT '[]',
    created timestamptz NOT NULL DEFAULT now(),
    updated timestamptz NOT NULL DEFAULT now()
);
ALTER TABLE vmapi.vms ADD COLUMN IF NOT EXISTS server_uuid uuid REFERENCES vmapi.servers (uuid);
CREATE INDEX IF NOT EXISTS vms_server_uuid ON vmapi.vms (server_uuid);
"""
)
"""The API's own tables; their primary keys are the bootstrap routes' sort keys.
``server_uuid`` is added apart so that a table made before servers existed gains it."""

_SCHEMA_LOCK = 0x766D_6170_6900  # "vmapi": concurrent start-ups create the table once

_COLUMNS = ("uuid", "alias", "nics", "server_uuid")
_SELECT_FOR_UPDATE = "SELECT alias, nics, server_uuid FROM vmapi.vms WHERE uuid = $1 FOR UPDATE"
_INSERT = "INSERT INTO vmapi.vms (uuid, alias, nics, server_uuid) VALUES ($1, $2, $3::jsonb, $4)"
_UPDATE = (
    "UPDATE vmapi.vms SET alias = $2, nics = $3::jsonb, server_uuid = $4, updated = now()"
    " WHERE uuid = $1"
)
_DELETE = "DELETE FROM vmapi.vms WHERE uuid = $1 RETURNING uuid"


# -- pure: bodies and what changed ------------------------------------------------


@dataclass(frozen=True, slots=True)
class NewVm:
    """A ``POST /vms`` body; ``server_uuid`` None: not placed on a server yet."""

    alias: str
    nics: list[dict[str, str]]
    server_uuid: str | None = None


@dataclass(frozen=True, slots=True)
class VmChange:
    """The fields a PATCH sets (None: left alone)."""

    alias: str | None = None
    nics: list[dict[str, str]] | None = None
    server_uuid: str | None = None


def _alias(value: Any) -> str:
    if not isinstance(value, str) or not value.strip():
        raise InvalidBody("alias: expected a non-empty string")
    if len(value) > MAX_ALIAS_LENGTH:
        raise InvalidBody(f"alias: at most {MAX_ALIAS_LENGTH} characters")
    return value


def _nics(value: Any) -> list[dict[str, str]]:
    if not isinstance(value, list):
        raise InvalidBody('nics: expected a list of {"ip": "<address>"}')
    if len(value) > MAX_NICS:
        raise InvalidBody(f"nics: at most {MAX_NICS} nics")
    nics = []
    for i, nic in enumerate(value):
        if not isinstance(nic, dict) or set(nic) != {"ip"}:
            raise InvalidBody(f'nics[{i}]: expected exactly {{"ip": "<address>"}}')
        if not isinstance(nic["ip"], str):
            raise InvalidBody(f"nics[{i}].ip: expected a string")
        try:
            ip = ipaddress.ip_address(nic["ip"])
        except ValueError:
            raise InvalidBody(f"nics[{i}].ip: {nic['ip']!r} is not an IP address") from None
        nics.append({"ip": str(ip)})
    return nics


def _server_uuid(value: Any) -> str:
    return str(uuid_field(value, "server_uuid"))


def parse_create(doc: Any) -> NewVm:
    """A ``POST /vms`` body: ``alias`` and ``nics`` required, ``server_uuid`` optional.

    Raises:
        InvalidBody: a field is missing, unknown or of the wrong type.
    """
    body = fields(doc, ("alias", "nics", "server_uuid"))
    for name in ("alias", "nics"):
        if name not in body:
            raise InvalidBody(f"{name}: required")
    server = body.get("server_uuid")
    return NewVm(
        _alias(body["alias"]), _nics(body["nics"]), None if server is None else _server_uuid(server)
    )


def parse_patch(doc: Any) -> VmChange:
    """What a ``PATCH /vms/{uuid}`` body sets (any field may be absent).

    Raises:
        InvalidBody: a field is unknown or of the wrong type, or ``server_uuid``
            is null (a VM moves to another server; it is never taken off all).
    """
    body = fields(doc, ("alias", "nics", "server_uuid"))
    if "server_uuid" in body and body["server_uuid"] is None:
        raise InvalidBody("server_uuid: a VM moves to another server; it cannot be un-placed")
    return VmChange(
        alias=_alias(body["alias"]) if "alias" in body else None,
        nics=_nics(body["nics"]) if "nics" in body else None,
        server_uuid=_server_uuid(body["server_uuid"]) if "server_uuid" in body else None,
    )


def changed_sub_resources(
    alias: str, nics: list[dict[str, str]], change: VmChange, server_uuid: str | None = None
) -> list[str]:
    """The sub-resources ``change`` really changes on a VM with ``alias``, ``nics``
    and ``server_uuid``."""
    subs = []
    if change.alias is not None and change.alias != alias:
        subs.append("alias")
    if change.nics is not None and change.nics != nics:
        subs.append("nic")
    if change.server_uuid is not None and change.server_uuid != server_uuid:
        subs.append("server")
    return subs


def _vm(vm_uuid: uuid.UUID | str, alias: str, nics: Any, server: str | None) -> dict[str, Any]:
    return {"uuid": str(vm_uuid), "alias": alias, "nics": nics, "server_uuid": server}


def _vm_item(row: asyncpg.Record) -> dict[str, Any]:
    # jsonb arrives as its JSON text: embedded as it is, never parsed and re-encoded.
    server = row["server_uuid"]
    return _vm(row["uuid"], row["alias"], orjson.Fragment(row["nics"]), server and str(server))


def _unknown_server(server: str | None) -> Refused:
    return Refused(422, "unknown_server", f"server_uuid: no server {server}")


# -- I/O ---------------------------------------------------------------------------


async def ensure_schema(conn: Any) -> None:
    """Create ``vmapi.servers`` and ``vmapi.vms`` if they do not exist (safe when
    several start at once)."""
    async with conn.transaction():
        await conn.execute("SELECT pg_advisory_xact_lock($1)", _SCHEMA_LOCK)
        await conn.execute(SCHEMA_SQL)


class VmApi:
    """The VM API's state and endpoints.

    Args:
        dsn: PostgreSQL DSN of the API's database (the feed is in the same one).
        publisher: the embedded publisher (its config names the feed schema).
        admission: admission control of ``GET /vms`` walks.
        pool_size: connections of the API's own pool; keep it above
            ``admission.slots.size`` so ordinary requests find one during a storm.
        max_body_bytes: larger request bodies are refused with 413.
        default_limit: page size of ``GET /vms`` without ``limit``.
        max_limit: larger ``limit`` values are clamped to this.
    """

    def __init__(
        self,
        dsn: str,
        publisher: Publisher,
        *,
        admission: Admission | None = None,
        pool_size: int = 10,
        max_body_bytes: int = MAX_BODY_BYTES,
        default_limit: int = 100,
        max_limit: int = 5000,
    ) -> None:
        self.dsn = dsn
        self.publisher = publisher
        self.pool_size = pool_size
        self.max_body_bytes = max_body_bytes
        self._pool: asyncpg.Pool[asyncpg.Record] | None = None
        self.vms = BootstrapRoute(
            VM_RESOURCE.bootstrap_route,
            KeysetQuery(
                "vms",
                table="vmapi.vms",
                key="uuid",
                columns=_COLUMNS,
                filters={
                    "alias": Filter("alias"),
                    "server_uuid": Filter("server_uuid", uuid.UUID),
                },
                parse_id=uuid.UUID,
                default_limit=default_limit,
                max_limit=max_limit,
                token_key=publisher.page_token_key,  # the same on every instance
            ),
            self.pool,
            admission=admission,
            authorize=self._authorize,
            to_item=_vm_item,
        )

    async def _authorize(self, request: Request) -> AccessGranted | AccessDenied:
        # The publisher's bearer tokens, and the token must be allowed to read ``vm``.
        return await self.publisher.authorize_request(request, VM_RESOURCE.name)

    @property
    def feed_schema(self) -> str:
        return self.publisher.config.schema

    def pool(self) -> asyncpg.Pool[asyncpg.Record]:
        if self._pool is None:
            raise asyncpg.InterfaceError("the VM API is not started")
        return self._pool

    @contextlib.asynccontextmanager
    async def lifespan(self, app: Any = None) -> AsyncIterator[None]:
        """Open the pool, create the tables, run the publisher; undo it all on exit."""
        self._pool = await asyncpg.create_pool(
            self.dsn, min_size=1, max_size=self.pool_size, timeout=5.0
        )
        try:
            async with self._pool.acquire() as conn:
                await ensure_schema(conn)
            async with self.publisher.lifespan(app):
                yield
        finally:
            pool, self._pool = self._pool, None
            await pool.close()

    def routes(self) -> list[Route]:
        """The VM routes (the server routes and the publisher's are added by ``create_app``)."""

        def guarded(handler: Handler) -> Handler:
            return guard(handler, self.vms.refuse_unauthorized)

        return [
            Route("/vms", self.vms.list_endpoint, methods=["GET"]),
            Route("/vms", guarded(self.create), methods=["POST"]),
            Route("/vms/{id}", self.vms.item_endpoint, methods=["GET"]),
            Route("/vms/{id}", guarded(self.update), methods=["PATCH"]),
            Route("/vms/{id}", guarded(self.delete), methods=["DELETE"]),
        ]

    async def create(self, request: Request) -> Response:
        """``POST /vms``: 201 and the VM; feed entry ``vm`` with no sub-resources."""
        new = parse_create(await read_json(request, self.max_body_bytes))
        vm_uuid = uuid.uuid4()
        server = None if new.server_uuid is None else uuid.UUID(new.server_uuid)
        try:
            async with self.pool().acquire(timeout=5.0) as conn, conn.transaction():
                await conn.execute(
                    _INSERT, vm_uuid, new.alias, orjson.dumps(new.nics).decode(), server
                )
                await publish(conn, "vm", [], str(vm_uuid), schema=self.feed_schema)
        except asyncpg.ForeignKeyViolationError:
            raise _unknown_server(new.server_uuid) from None
        log_event(log, "vm.created", logging.DEBUG, uuid=str(vm_uuid))
        return json_response(_vm(vm_uuid, new.alias, new.nics, new.server_uuid), 201)

    async def update(self, request: Request) -> Response:
        """``PATCH /vms/{uuid}``: 200 and the VM; publishes only what changed."""
        vm_uuid = path_uuid(request, "VM")
        change = parse_patch(await read_json(request, self.max_body_bytes))
        try:
            async with self.pool().acquire(timeout=5.0) as conn, conn.transaction():
                row = await conn.fetchrow(_SELECT_FOR_UPDATE, vm_uuid)
                if row is None:
                    raise Refused(404, "not_found", f"no VM {vm_uuid}")
                alias, nics = row["alias"], orjson.loads(row["nics"])
                server = row["server_uuid"] and str(row["server_uuid"])
                subs = changed_sub_resources(alias, nics, change, server)
                alias = change.alias if change.alias is not None else alias
                nics = change.nics if change.nics is not None else nics
                server = change.server_uuid if change.server_uuid is not None else server
                if subs:
                    placed = server and uuid.UUID(server)
                    await conn.execute(_UPDATE, vm_uuid, alias, orjson.dumps(nics).decode(), placed)
                    await publish(conn, "vm", subs, str(vm_uuid), schema=self.feed_schema)
        except asyncpg.ForeignKeyViolationError:
            raise _unknown_server(change.server_uuid) from None
        log_event(log, "vm.updated", logging.DEBUG, uuid=str(vm_uuid), changed=subs)
        return json_response(_vm(vm_uuid, alias, nics, server))

    async def delete(self, request: Request) -> Response:
        """``DELETE /vms/{uuid}``: 204; feed entry ``vm`` with no sub-resources.

        No Content-Type is asked of a DELETE: it has no body, and no web page
        can make a browser send one to another site without a CORS preflight.
        """
        vm_uuid = path_uuid(request, "VM")
        async with self.pool().acquire(timeout=5.0) as conn, conn.transaction():
            if await conn.fetchval(_DELETE, vm_uuid) is None:
                raise Refused(404, "not_found", f"no VM {vm_uuid}")
            await publish(conn, "vm", [], str(vm_uuid), schema=self.feed_schema)
        log_event(log, "vm.deleted", logging.DEBUG, uuid=str(vm_uuid))
        return Response(status_code=204)


def create_app(
    dsn: str,
    *,
    publisher_config: PublisherConfig | None = None,
    admission: Admission | None = None,
    pool_size: int = 10,
    max_body_bytes: int = MAX_BODY_BYTES,
    default_limit: int = 100,
    max_limit: int = 5000,
    authorize: Authorizer | None = None,
    **publisher_overrides: Any,
) -> Starlette:
    """The VM API as a Starlette app, with the publisher mounted and running in its lifespan.

    Args:
        dsn: the database of the VMs, the servers and the feed.
        publisher_config: the publisher's config; default: resources ``vm``
            (bootstrap route ``/vms``) and ``server`` (``/servers``) on ``dsn``.
        admission: admission control of ``GET /vms`` and ``GET /servers`` walks
            (default ``Admission()``, one for both).
        pool_size, max_body_bytes, default_limit, max_limit: see ``VmApi``.
        authorize: the publisher's authorizer of bearer tokens (``Authorizer``,
            docs/security.md), for the routes of the feed and of the API alike.
        publisher_overrides: PublisherConfig fields to replace, e.g.
            ``poll_interval=0.05`` or ``auth_tokens=("secret",)``.

    ``app.state.publisher`` is the Publisher, ``app.state.vmapi`` the VmApi
    (``app.state.vmapi.vms.stats()``: bootstrap counters) and
    ``app.state.servers`` the ServerApi.
    """
    config = publisher_config or PublisherConfig(dsn=dsn, resources=(VM_RESOURCE, SERVER_RESOURCE))
    if config.dsn is None:
        publisher_overrides.setdefault("dsn", dsn)
    if publisher_overrides:
        config = msgspec.structs.replace(config, **publisher_overrides)
    publisher = Publisher(config, authorize=authorize)
    admission = admission if admission is not None else Admission()
    limits: dict[str, Any] = {
        "admission": admission,
        "max_body_bytes": max_body_bytes,
        "default_limit": default_limit,
        "max_limit": max_limit,
    }
    api = VmApi(dsn, publisher, pool_size=pool_size, **limits)
    servers = ServerApi(api.pool, publisher, **limits)
    app = Starlette(
        routes=[*api.routes(), *servers.routes(), *publisher.routes], lifespan=api.lifespan
    )
    app.state.publisher = publisher
    app.state.vmapi = api
    app.state.servers = servers
    return app
