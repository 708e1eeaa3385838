"""The VM API of RFD 5: a small API that owns ``vm`` resources and embeds the publisher.

It is the example the tests, the demo and the benchmarks run against, and the
pattern any API follows to publish its changes:

* every write and its feed entry commit in **one transaction** (``publish``
  on the same connection, inside ``conn.transaction()``), so a change is
  announced exactly when it becomes visible, and a rolled-back write announces
  nothing;
* the change's sub-resources are exactly what changed: ``alias``, ``nic``;
  creation and deletion name none (the resource as a whole); a PATCH that
  changes nothing publishes nothing;
* ``GET /vms`` is the bootstrap route (keyset pagination and ``?ids=``, from
  ``changefeed.bootstrap``, with admission control), ``GET /vms/{uuid}`` the
  per-id route; both honour the publisher's bearer tokens, as do the writes.

Routes: ``POST /vms``, ``GET /vms``, ``GET|PATCH|DELETE /vms/{uuid}``, plus the
publisher's ``/changefeeds`` routes. Its table is ``vmapi.vms``, created at
start-up (idempotent).

It must never write without publishing in the same transaction, never
publish an entry for a change that did not happen, and never answer a
database outage with a traceback (503 ``unavailable`` instead).
"""

from __future__ import annotations

import contextlib
import dataclasses
import ipaddress
import logging
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import asyncpg
import orjson
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from changefeed.bootstrap import (
    DB_UNAVAILABLE,
    Admission,
    BootstrapRoute,
    Filter,
    KeysetQuery,
    encode_json,
    error_response,
    unavailable_response,
)
from changefeed.logs import log_event
from changefeed.publisher import Publisher, PublisherConfig, ResourceConfig, publish

__all__ = [
    "MAX_ALIAS_LENGTH",
    "MAX_NICS",
    "SCHEMA_SQL",
    "VM_RESOURCE",
    "InvalidBody",
    "VmApi",
    "VmChange",
    "changed_sub_resources",
    "create_app",
    "ensure_schema",
    "parse_create",
    "parse_patch",
]

log = logging.getLogger(__name__)

VM_RESOURCE = ResourceConfig("vm", "/vms", ("nic", "alias"))
"""The change feed this API publishes: ``vm``, sub-resources ``nic`` and ``alias``."""

MAX_ALIAS_LENGTH = 255
MAX_NICS = 32
MAX_BODY_BYTES = 65536

SCHEMA_SQL = """
CREATE SCHEMA IF NOT EXISTS vmapi;
CREATE TABLE IF NOT EXISTS vmapi.vms (
    uuid    uuid PRIMARY KEY,
    alias   text NOT NULL,
    nics    jsonb NOT NULL DEFAULT '[]',
    created timestamptz NOT NULL DEFAULT now(),
    updated timestamptz NOT NULL DEFAULT now()
);
"""
"""The API's own table; its primary key is the bootstrap route's sort key."""

_SCHEMA_LOCK = 0x766D_6170_6900  # "vmapi": concurrent start-ups create the table once

_SELECT_FOR_UPDATE = "SELECT alias, nics FROM vmapi.vms WHERE uuid = $1 FOR UPDATE"
_INSERT = "INSERT INTO vmapi.vms (uuid, alias, nics) VALUES ($1, $2, $3::jsonb)"
_UPDATE = "UPDATE vmapi.vms SET alias = $2, nics = $3::jsonb, updated = now() WHERE uuid = $1"
_DELETE = "DELETE FROM vmapi.vms WHERE uuid = $1 RETURNING uuid"


# -- pure: bodies and what changed ------------------------------------------------


class InvalidBody(ValueError):
    """A request body that breaks the VM API's contract (answered with 400)."""


@dataclass(frozen=True, slots=True)
class VmChange:
    """The fields a PATCH sets (None: left alone)."""

    alias: str | None = None
    nics: list[dict[str, str]] | None = None


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


def _fields(doc: Any, allowed: Sequence[str]) -> dict[str, Any]:
    if not isinstance(doc, dict):
        raise InvalidBody("body: expected a JSON object")
    unknown = sorted(set(doc) - set(allowed))
    if unknown:
        raise InvalidBody(f"unknown fields {unknown} (known: {', '.join(allowed)})")
    return doc


def parse_create(doc: Any) -> tuple[str, list[dict[str, str]]]:
    """The alias and nics of a ``POST /vms`` body (both required).

    Raises:
        InvalidBody: a field is missing, unknown or of the wrong type.
    """
    fields = _fields(doc, ("alias", "nics"))
    for name in ("alias", "nics"):
        if name not in fields:
            raise InvalidBody(f"{name}: required")
    return _alias(fields["alias"]), _nics(fields["nics"])


def parse_patch(doc: Any) -> VmChange:
    """What a ``PATCH /vms/{uuid}`` body sets (either field may be absent).

    Raises:
        InvalidBody: a field is unknown or of the wrong type.
    """
    fields = _fields(doc, ("alias", "nics"))
    return VmChange(
        alias=_alias(fields["alias"]) if "alias" in fields else None,
        nics=_nics(fields["nics"]) if "nics" in fields else None,
    )


def changed_sub_resources(alias: str, nics: list[dict[str, str]], change: VmChange) -> list[str]:
    """The sub-resources ``change`` really changes on a VM with ``alias`` and ``nics``."""
    subs = []
    if change.alias is not None and change.alias != alias:
        subs.append("alias")
    if change.nics is not None and change.nics != nics:
        subs.append("nic")
    return subs


def _vm(vm_uuid: uuid.UUID | str, alias: str, nics: Any) -> dict[str, Any]:
    return {"uuid": str(vm_uuid), "alias": alias, "nics": nics}


def _vm_item(row: asyncpg.Record) -> dict[str, Any]:
    # jsonb arrives as its JSON text: embedded as it is, never parsed and re-encoded.
    return {"uuid": str(row["uuid"]), "alias": row["alias"], "nics": orjson.Fragment(row["nics"])}


def _parse_uuid(text: str) -> uuid.UUID:
    return uuid.UUID(text)


# -- I/O ---------------------------------------------------------------------------


async def ensure_schema(conn: Any) -> None:
    """Create ``vmapi.vms`` if it does not exist (safe when several start at once)."""
    async with conn.transaction():
        await conn.execute("SELECT pg_advisory_xact_lock($1)", _SCHEMA_LOCK)
        await conn.execute(SCHEMA_SQL)


Handler = Callable[[Request], Awaitable[Response]]


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
            "/vms",
            KeysetQuery(
                "vms",
                table="vmapi.vms",
                key="uuid",
                columns=("uuid", "alias", "nics"),
                filters={"alias": Filter("alias")},
                parse_id=_parse_uuid,
                default_limit=default_limit,
                max_limit=max_limit,
            ),
            self.pool,
            admission=admission,
            authorize=self._authorize,
            to_item=_vm_item,
        )

    async def _authorize(self, request: Request) -> bool:
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
        """Open the pool, create the table, run the publisher; undo it all on exit."""
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
        """The VM routes (the publisher's are added by ``create_app``)."""
        guarded = self._guarded
        return [
            Route("/vms", self.vms.list_endpoint, methods=["GET"]),
            Route("/vms", guarded(self.create), methods=["POST"]),
            Route("/vms/{id}", self.vms.item_endpoint, methods=["GET"]),
            Route("/vms/{id}", guarded(self.update), methods=["PATCH"]),
            Route("/vms/{id}", guarded(self.delete), methods=["DELETE"]),
        ]

    def _guarded(self, handler: Handler) -> Handler:
        """Auth, then the handler; database failures become 503 / 500 with the error body."""

        async def endpoint(request: Request) -> Response:
            if (refused := await self.vms.refuse_unauthorized(request)) is not None:
                return refused
            try:
                return await handler(request)
            except InvalidBody as exc:
                return error_response(400, "bad_request", str(exc))
            except DB_UNAVAILABLE as exc:
                log_event(log, "vmapi.unavailable", logging.WARNING, error=repr(exc))
                return unavailable_response(exc)
            except asyncpg.PostgresError as exc:
                log_event(log, "vmapi.failed", logging.ERROR, error=repr(exc))
                return error_response(
                    500, "internal", f"the write failed and was rolled back ({exc.sqlstate})"
                )

        return endpoint

    async def _body(self, request: Request) -> Any:
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > self.max_body_bytes:
            raise _TooLarge(self.max_body_bytes)
        body = bytearray()
        async for chunk in request.stream():
            body += chunk
            if len(body) > self.max_body_bytes:
                raise _TooLarge(self.max_body_bytes)
        try:
            return orjson.loads(body)
        except orjson.JSONDecodeError as exc:
            raise InvalidBody(f"body is not valid JSON: {exc}") from None

    async def _read(self, request: Request) -> Any | Response:
        try:
            return await self._body(request)
        except _TooLarge as exc:
            return error_response(413, "too_large", f"request body larger than {exc.limit} bytes")

    def _uuid(self, request: Request) -> uuid.UUID:
        text = request.path_params["id"]
        try:
            return uuid.UUID(text)
        except ValueError:
            raise InvalidBody(f"{text!r} is not a valid VM uuid") from None

    @staticmethod
    def _json(document: Any, status: int = 200) -> Response:
        return Response(encode_json(document), status, None, "application/json")

    async def create(self, request: Request) -> Response:
        """``POST /vms``: 201 and the VM; feed entry ``vm`` with no sub-resources."""
        doc = await self._read(request)
        if isinstance(doc, Response):
            return doc
        alias, nics = parse_create(doc)
        vm_uuid = uuid.uuid4()
        async with self.pool().acquire(timeout=5.0) as conn, conn.transaction():
            await conn.execute(_INSERT, vm_uuid, alias, orjson.dumps(nics).decode())
            await publish(conn, "vm", [], str(vm_uuid), schema=self.feed_schema)
        log_event(log, "vm.created", logging.DEBUG, uuid=str(vm_uuid))
        return self._json(_vm(vm_uuid, alias, nics), 201)

    async def update(self, request: Request) -> Response:
        """``PATCH /vms/{uuid}``: 200 and the VM; publishes only what changed."""
        vm_uuid = self._uuid(request)
        doc = await self._read(request)
        if isinstance(doc, Response):
            return doc
        change = parse_patch(doc)
        async with self.pool().acquire(timeout=5.0) as conn, conn.transaction():
            row = await conn.fetchrow(_SELECT_FOR_UPDATE, vm_uuid)
            if row is None:
                return error_response(404, "not_found", f"no VM {vm_uuid}")
            alias, nics = row["alias"], orjson.loads(row["nics"])
            subs = changed_sub_resources(alias, nics, change)
            if change.alias is not None:
                alias = change.alias
            if change.nics is not None:
                nics = change.nics
            if subs:
                await conn.execute(_UPDATE, vm_uuid, alias, orjson.dumps(nics).decode())
                await publish(conn, "vm", subs, str(vm_uuid), schema=self.feed_schema)
        log_event(log, "vm.updated", logging.DEBUG, uuid=str(vm_uuid), changed=subs)
        return self._json(_vm(vm_uuid, alias, nics))

    async def delete(self, request: Request) -> Response:
        """``DELETE /vms/{uuid}``: 204; feed entry ``vm`` with no sub-resources."""
        vm_uuid = self._uuid(request)
        async with self.pool().acquire(timeout=5.0) as conn, conn.transaction():
            if await conn.fetchval(_DELETE, vm_uuid) is None:
                return error_response(404, "not_found", f"no VM {vm_uuid}")
            await publish(conn, "vm", [], str(vm_uuid), schema=self.feed_schema)
        log_event(log, "vm.deleted", logging.DEBUG, uuid=str(vm_uuid))
        return Response(status_code=204)


class _TooLarge(Exception):
    def __init__(self, limit: int) -> None:
        super().__init__(f"body larger than {limit} bytes")
        self.limit = limit


def create_app(
    dsn: str,
    *,
    publisher_config: PublisherConfig | None = None,
    admission: Admission | None = None,
    pool_size: int = 10,
    max_body_bytes: int = MAX_BODY_BYTES,
    default_limit: int = 100,
    max_limit: int = 5000,
    **publisher_overrides: Any,
) -> Starlette:
    """The VM API as a Starlette app, with the publisher mounted and running in its lifespan.

    Args:
        dsn: the database of the VMs and of the feed.
        publisher_config: the publisher's config; default: resource ``vm``
            (``nic``, ``alias``, bootstrap route ``/vms``) on ``dsn``.
        admission: admission control of ``GET /vms`` walks (default ``Admission()``).
        pool_size, max_body_bytes, default_limit, max_limit: see ``VmApi``.
        publisher_overrides: PublisherConfig fields to replace, e.g.
            ``poll_interval=0.05`` or ``auth_tokens=("secret",)``.

    ``app.state.publisher`` is the Publisher and ``app.state.vmapi`` the VmApi
    (``app.state.vmapi.vms.stats()``: bootstrap counters).
    """
    config = publisher_config or PublisherConfig(dsn=dsn, resources=(VM_RESOURCE,))
    if config.dsn is None:
        publisher_overrides.setdefault("dsn", dsn)
    if publisher_overrides:
        config = dataclasses.replace(config, **publisher_overrides)
    publisher = Publisher(config)
    api = VmApi(
        dsn,
        publisher,
        admission=admission,
        pool_size=pool_size,
        max_body_bytes=max_body_bytes,
        default_limit=default_limit,
        max_limit=max_limit,
    )
    app = Starlette(routes=[*api.routes(), *publisher.routes], lifespan=api.lifespan)
    app.state.publisher = publisher
    app.state.vmapi = api
    return app
