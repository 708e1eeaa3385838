"""The example API's servers: Triton's compute nodes, as CNAPI holds them.

A server is ``{"uuid", "hostname", "status", "ram", "datacenter"}``: ``status``
is ``running``, ``unavailable`` or ``unknown``, ``ram`` is in MiB, and the
datacenter is fixed once the server exists. VMs point at the server they run
on (``vmapi.vms.server_uuid``, a foreign key), so a server that still hosts VMs
cannot be deleted: 409 ``conflict`` until they are migrated or deleted.

Routes: ``POST /servers``, ``GET /servers`` (the bootstrap route, keyset
pagination, ``?ids=``, filters ``datacenter``, ``status``, ``hostname``),
``GET|PATCH|DELETE /servers/{uuid}``. Every write publishes on the feed of
resource ``server`` in its own transaction, as the VM routes do: creation and
deletion name no sub-resource, a PATCH names exactly the fields it changed
(``hostname``, ``status``, ``ram``) and publishes nothing when it changes
nothing.

It must never write without publishing in the same transaction, nor delete a
server a VM points at.
"""

from __future__ import annotations

import logging
import re
import uuid
from dataclasses import dataclass
from typing import Any

import asyncpg
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from changefeed.bootstrap import Admission, BootstrapRoute, Filter, KeysetQuery
from changefeed.bootstrap.route import PoolSource
from changefeed.logs import log_event
from changefeed.publisher import Publisher, ResourceConfig, publish
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

__all__ = [
    "MAX_RAM_MIB",
    "SERVERS_SQL",
    "SERVER_RESOURCE",
    "STATUSES",
    "NewServer",
    "ServerApi",
    "ServerChange",
    "changed_server_fields",
    "parse_server_create",
    "parse_server_patch",
]

log = logging.getLogger(__name__)

SERVER_RESOURCE = ResourceConfig("server", "/servers", ("hostname", "status", "ram"))
"""The change feed of servers: sub-resources ``hostname``, ``status`` and ``ram``."""

STATUSES = ("running", "unavailable", "unknown")
MAX_RAM_MIB = 1 << 24  # 16 TiB
_HOSTNAME = re.compile(
    r"^(?=.{1,253}$)[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
    r"(?:\.[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*$"
)
_DATACENTER = re.compile(r"^[a-z0-9](?:[a-z0-9-]{0,61}[a-z0-9])?$")

SERVERS_SQL = """
CREATE SCHEMA IF NOT EXISTS vmapi;
CREATE TABLE IF NOT EXISTS vmapi.servers (
    uuid       uuid PRIMARY KEY,
    hostname   text NOT NULL,
    status     text NOT NULL CHECK (status IN ('running', 'unavailable', 'unknown')),
    ram        integer NOT NULL CHECK (ram > 0),
    datacenter text NOT NULL,
    created    timestamptz NOT NULL DEFAULT now(),
    updated    timestamptz NOT NULL DEFAULT now()
);
"""
"""The servers' table; created before ``vmapi.vms``, whose ``server_uuid`` refers to it."""

_COLUMNS = ("uuid", "hostname", "status", "ram", "datacenter")
_INSERT = (
    "INSERT INTO vmapi.servers (uuid, hostname, status, ram, datacenter)"
    " VALUES ($1, $2, $3, $4, $5)"
)
# NO KEY UPDATE: a VM placed on the server meanwhile (its foreign key takes KEY SHARE)
# does not wait for a status change, nor the status change for it.
_SELECT_FOR_UPDATE = (
    "SELECT hostname, status, ram, datacenter FROM vmapi.servers WHERE uuid = $1 FOR NO KEY UPDATE"
)
_UPDATE = (
    "UPDATE vmapi.servers SET hostname = $2, status = $3, ram = $4, updated = now() WHERE uuid = $1"
)
# FOR UPDATE conflicts with the KEY SHARE a VM's foreign key takes: no VM can be
# placed on the server between the count and the delete.
_LOCK_FOR_DELETE = "SELECT 1 FROM vmapi.servers WHERE uuid = $1 FOR UPDATE"
_HOSTED = "SELECT count(*) FROM vmapi.vms WHERE server_uuid = $1"
_DELETE = "DELETE FROM vmapi.servers WHERE uuid = $1"


# -- pure: bodies and what changed ------------------------------------------------


@dataclass(frozen=True, slots=True)
class NewServer:
    """A ``POST /servers`` body; ``uuid`` None: the API picks one."""

    hostname: str
    ram: int
    datacenter: str
    status: str = "unknown"
    uuid: uuid.UUID | None = None


@dataclass(frozen=True, slots=True)
class ServerChange:
    """The fields a ``PATCH /servers/{uuid}`` sets (None: left alone)."""

    hostname: str | None = None
    status: str | None = None
    ram: int | None = None


def _hostname(value: Any) -> str:
    if not isinstance(value, str) or not _HOSTNAME.match(value):
        raise InvalidBody(
            "hostname: expected a host name (letters, digits, inner '-', dot-separated "
            "labels of at most 63 characters, 253 in all)"
        )
    return value


def _status(value: Any) -> str:
    if value not in STATUSES:
        raise InvalidBody(f"status: expected one of {', '.join(STATUSES)}, got {value!r}")
    return str(value)


def _ram(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 < value <= MAX_RAM_MIB:
        raise InvalidBody(f"ram: expected an integer number of MiB, 1 to {MAX_RAM_MIB}")
    return value


def _datacenter(value: Any) -> str:
    if not isinstance(value, str) or not _DATACENTER.match(value):
        raise InvalidBody(
            "datacenter: expected a name of lowercase letters, digits and inner '-', "
            "at most 63 characters"
        )
    return value


def parse_server_create(doc: Any) -> NewServer:
    """A ``POST /servers`` body: ``hostname``, ``ram``, ``datacenter`` required;
    ``status`` (default ``unknown``) and ``uuid`` (the hardware's; default: a new one)
    optional.

    Raises:
        InvalidBody: a field is missing, unknown or invalid.
    """
    body = fields(doc, ("uuid", "hostname", "status", "ram", "datacenter"))
    for name in ("hostname", "ram", "datacenter"):
        if name not in body:
            raise InvalidBody(f"{name}: required")
    return NewServer(
        hostname=_hostname(body["hostname"]),
        ram=_ram(body["ram"]),
        datacenter=_datacenter(body["datacenter"]),
        status=_status(body["status"]) if "status" in body else "unknown",
        uuid=uuid_field(body["uuid"], "uuid") if "uuid" in body else None,
    )


def parse_server_patch(doc: Any) -> ServerChange:
    """What a ``PATCH /servers/{uuid}`` body sets (any field may be absent).

    Raises:
        InvalidBody: a field is unknown or invalid, or the body tries to move the
            server to another datacenter or change its uuid.
    """
    if isinstance(doc, dict):
        for fixed in ("uuid", "datacenter"):
            if fixed in doc:
                raise InvalidBody(f"{fixed}: fixed when the server is created")
    body = fields(doc, ("hostname", "status", "ram"))
    return ServerChange(
        hostname=_hostname(body["hostname"]) if "hostname" in body else None,
        status=_status(body["status"]) if "status" in body else None,
        ram=_ram(body["ram"]) if "ram" in body else None,
    )


def changed_server_fields(current: dict[str, Any], change: ServerChange) -> list[str]:
    """The sub-resources ``change`` really changes on a server that is ``current``."""
    return [
        name
        for name in SERVER_RESOURCE.sub_resources
        if (value := getattr(change, name)) is not None and value != current[name]
    ]


def _server(server_uuid: uuid.UUID, row: Any) -> dict[str, Any]:
    return {"uuid": str(server_uuid), **{name: row[name] for name in _COLUMNS[1:]}}


def _server_item(row: asyncpg.Record) -> dict[str, Any]:
    return _server(row["uuid"], row)


def _status_filter(text: str) -> str:
    if text not in STATUSES:
        raise ValueError(text)
    return text


# -- I/O ---------------------------------------------------------------------------


class ServerApi:
    """The server routes of the example API, on the VM API's pool and publisher.

    Args:
        pool: returns the API's pool (it is opened in the API's lifespan).
        publisher: the embedded publisher (its config names the feed schema).
        admission, max_body_bytes, default_limit, max_limit: as ``VmApi``'s.
    """

    def __init__(
        self,
        pool: PoolSource,
        publisher: Publisher,
        *,
        admission: Admission | None = None,
        max_body_bytes: int = MAX_BODY_BYTES,
        default_limit: int = 100,
        max_limit: int = 5000,
    ) -> None:
        self.pool = pool
        self.publisher = publisher
        self.max_body_bytes = max_body_bytes
        self.servers = BootstrapRoute(
            SERVER_RESOURCE.bootstrap_route,
            KeysetQuery(
                "servers",
                table="vmapi.servers",
                key="uuid",
                columns=_COLUMNS,
                filters={
                    "datacenter": Filter("datacenter"),
                    "status": Filter("status", _status_filter),
                    "hostname": Filter("hostname"),
                },
                parse_id=uuid.UUID,
                default_limit=default_limit,
                max_limit=max_limit,
                token_key=publisher.page_token_key,  # the same on every instance
            ),
            pool,
            admission=admission,
            authorize=self._authorize,
            to_item=_server_item,
        )

    async def _authorize(self, request: Request) -> AccessGranted | AccessDenied:
        return await self.publisher.authorize_request(request, SERVER_RESOURCE.name)

    def routes(self) -> list[Route]:
        def guarded(handler: Handler) -> Handler:
            return guard(handler, self.servers.refuse_unauthorized)

        return [
            Route("/servers", self.servers.list_endpoint, methods=["GET"]),
            Route("/servers", guarded(self.create), methods=["POST"]),
            Route("/servers/{id}", self.servers.item_endpoint, methods=["GET"]),
            Route("/servers/{id}", guarded(self.update), methods=["PATCH"]),
            Route("/servers/{id}", guarded(self.delete), methods=["DELETE"]),
        ]

    async def _publish(self, conn: Any, subs: list[str], server_uuid: uuid.UUID) -> None:
        schema = self.publisher.config.schema
        await publish(conn, SERVER_RESOURCE.name, subs, str(server_uuid), schema=schema)

    async def create(self, request: Request) -> Response:
        """``POST /servers``: 201 and the server; feed entry ``server``, no sub-resources."""
        new = parse_server_create(await read_json(request, self.max_body_bytes))
        server_uuid = new.uuid or uuid.uuid4()
        try:
            async with self.pool().acquire(timeout=5.0) as conn, conn.transaction():
                await conn.execute(
                    _INSERT, server_uuid, new.hostname, new.status, new.ram, new.datacenter
                )
                await self._publish(conn, [], server_uuid)
        except asyncpg.UniqueViolationError:
            raise Refused(409, "conflict", f"server {server_uuid} exists already") from None
        log_event(log, "server.created", logging.DEBUG, uuid=str(server_uuid))
        item = {"uuid": str(server_uuid), "hostname": new.hostname, "status": new.status}
        return json_response({**item, "ram": new.ram, "datacenter": new.datacenter}, 201)

    async def update(self, request: Request) -> Response:
        """``PATCH /servers/{uuid}``: 200 and the server; publishes only what changed."""
        server_uuid = path_uuid(request, "server")
        change = parse_server_patch(await read_json(request, self.max_body_bytes))
        async with self.pool().acquire(timeout=5.0) as conn, conn.transaction():
            row = await conn.fetchrow(_SELECT_FOR_UPDATE, server_uuid)
            if row is None:
                raise Refused(404, "not_found", f"no server {server_uuid}")
            current = dict(row)
            subs = changed_server_fields(current, change)
            for name in subs:
                current[name] = getattr(change, name)
            if subs:
                await conn.execute(
                    _UPDATE, server_uuid, current["hostname"], current["status"], current["ram"]
                )
                await self._publish(conn, subs, server_uuid)
        log_event(log, "server.updated", logging.DEBUG, uuid=str(server_uuid), changed=subs)
        return json_response(_server(server_uuid, current))

    async def delete(self, request: Request) -> Response:
        """``DELETE /servers/{uuid}``: 204; 409 while VMs still point at the server."""
        server_uuid = path_uuid(request, "server")
        async with self.pool().acquire(timeout=5.0) as conn, conn.transaction():
            if await conn.fetchval(_LOCK_FOR_DELETE, server_uuid) is None:
                raise Refused(404, "not_found", f"no server {server_uuid}")
            hosted = await conn.fetchval(_HOSTED, server_uuid)
            if hosted:
                raise Refused(
                    409,
                    "conflict",
                    f"server {server_uuid} still hosts {hosted} VM(s): migrate or delete "
                    f"them first (GET /vms?server_uuid={server_uuid})",
                )
            await conn.execute(_DELETE, server_uuid)
            await self._publish(conn, [], server_uuid)
        log_event(log, "server.deleted", logging.DEBUG, uuid=str(server_uuid))
        return Response(status_code=204)
