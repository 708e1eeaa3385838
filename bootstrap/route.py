"""Serve a keyset-paginated bootstrap route from an asyncpg pool, as Starlette endpoints.

Thin adapter around ``KeysetQuery`` (the SQL and request parsing) and
``Admission`` (walk and query limits)::

    vms = KeysetQuery(
        "vms", table="vmapi.vms", key="uuid", parse_id=uuid.UUID,
        token_key=publisher.page_token_key,  # shared by every instance, known to nobody else
    )
    route = BootstrapRoute("/vms", vms, pool, authorize=publisher.authorize_request)
    app = Starlette(routes=[*route.routes(), ...])

``GET /vms?limit=N[&after=<token>]`` answers ``{"items": [...], "next": ...}``,
``GET /vms?ids=a,b`` the items found among the ids (``next`` null), and
``GET /vms/{id}`` one item or 404. Every answer carries ``Cache-Control:
no-store`` and ``X-Content-Type-Options: nosniff`` (what a token may read is
for that token only, and a page is stale the moment it is served). Every
failure is an HTTP status with the
protocol's error body: 400 ``bad_request``, 401 ``unauthorized``, 403
``forbidden``, 404 ``not_found``, 405 ``method_not_allowed``, 429 ``busy`` and
503 ``unavailable`` (both
with ``Retry-After``; the database, or the authorizer, cannot answer now), 500
``internal``.

It must never format a request value into SQL, never hold more than one page
in memory per request, and never let a database outage surface as a traceback.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Awaitable, Callable, Sequence
from decimal import Decimal
from typing import Any

import asyncpg
import orjson
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from changefeed.budgeted_log import BudgetedLines
from changefeed.log_budget import LogBudget
from changefeed.logs import log_event
from changefeed.outside_check import answer_within
from changefeed.schemas import (
    BOOTSTRAP_ROUTE_STATE,
    PRIVATE_HEADERS,
    AccessDenied,
    AccessGranted,
    ErrorFrame,
    PgConnection,
)
from changefeed.schemas.validation import bounded

from .admission import Admission
from .errors import PageRequestError, TokenKeyUnavailable, WalkRefused
from .keyset import BatchRequest, KeysetQuery, PageRequest

__all__ = [
    "DB_UNAVAILABLE",
    "BootstrapRoute",
    "ItemEncoder",
    "PoolSource",
    "PrivateRoute",
    "RequestCheck",
    "encode_json",
    "error_response",
    "private_answers",
    "unavailable_response",
]

log = logging.getLogger(__name__)

DB_UNAVAILABLE: tuple[type[BaseException], ...] = (
    OSError,
    TimeoutError,
    asyncpg.InterfaceError,
    asyncpg.PostgresConnectionError,
    asyncpg.exceptions.OperatorInterventionError,
    asyncpg.exceptions.InsufficientResourcesError,
)
"""Failures meaning the database is unreachable, restarting or overloaded: 503, not 500."""

OUTAGE_LINES = 5
OUTAGE_WINDOW = 60.0
"""A route writes at most ``OUTAGE_LINES`` ``bootstrap.unavailable`` lines a minute,
then one ``bootstrap.unavailable_held`` line with the count of the others."""

PoolSource = Callable[[], "asyncpg.Pool[asyncpg.Record]"]
"""Returns the pool to use; called per request, so an app may create its pool in
its lifespan, after the routes exist."""

RequestCheck = Callable[[Request], Awaitable[AccessGranted | AccessDenied | bool]]
"""Whether a request may go on: true, or a refusal (``AccessDenied``: how to answer it;
a plain False: 401). ``Publisher.authorize_request`` is one."""

ItemEncoder = Callable[[asyncpg.Record], Any]
"""Turns a result row into the JSON-ready item a client sees."""


def _default(value: Any) -> Any:
    # asyncpg returns its own uuid.UUID subclass, which orjson does not take as a UUID.
    if isinstance(value, Decimal | uuid.UUID):
        return str(value)
    raise TypeError(f"{type(value).__name__} is not JSON serializable")


def encode_json(document: Any) -> bytes:
    """JSON bytes of ``document``; UUIDs and datetimes as strings, Decimals as strings."""
    return orjson.dumps(document, default=_default)


def error_response(
    status: int,
    code: str,
    message: str,
    headers: dict[str, str] | None = None,
    retry_after: float | None = None,
) -> JSONResponse:
    """An HTTP error with the protocol's error body ``{"error": {"code", "message"}}``
    (and ``retryAfter`` when given).

    The message is ``bounded``: it may quote what the request sent (a value, a key,
    a header, a query parameter), and an answer never echoes 60 KB of it back.
    """
    frame = ErrorFrame(code, bounded(message), retry_after)
    return JSONResponse(frame.to_json(), status_code=status, headers=headers)


def private_answers(
    endpoint: Callable[[Request], Awaitable[Response]],
) -> Callable[[Request], Awaitable[Response]]:
    """``endpoint`` with the ``PRIVATE_HEADERS`` on each of its answers."""

    async def answer(request: Request) -> Response:
        response = await endpoint(request)
        response.headers.update(PRIVATE_HEADERS)
        return response

    return answer


class PrivateRoute(Route):
    """A GET route whose every answer carries the ``PRIVATE_HEADERS``, a wrong
    method's 405 included: Starlette answers that before the endpoint runs, in
    plain text and without them, so this route answers it itself (with the
    protocol's error body; the application's own 405 handler is not asked)."""

    def __init__(self, path: str, endpoint: Callable[[Request], Awaitable[Response]]) -> None:
        super().__init__(path, private_answers(endpoint), methods=["GET"], name=endpoint.__name__)

    async def handle(self, scope: Scope, receive: Receive, send: Send) -> None:
        allowed = self.methods or set()
        if scope["type"] == "http" and scope["method"] not in allowed:
            response = error_response(
                405,
                "method_not_allowed",
                f"{scope['method']} is not allowed here; use GET",
                {"Allow": ", ".join(sorted(allowed)), **PRIVATE_HEADERS},
            )
            await response(scope, receive, send)
            return
        await super().handle(scope, receive, send)


def unavailable_response(exc: BaseException, retry_after: int = 1) -> JSONResponse:
    """503 for a database that cannot be reached (``exc`` is named, not traced)."""
    return error_response(
        503,
        "unavailable",
        f"database unavailable ({type(exc).__name__}); retry in {retry_after}s",
        {"Retry-After": str(retry_after)},
    )


class BootstrapRoute:
    """The list, batch and per-id endpoints of one keyset-paginated source.

    Args:
        path: the list route, e.g. ``/vms``; the per-id route is ``{path}/{id}``.
        query: the source's statements and request parsing.
        pool: the pool to query, or a callable returning it.
        admission: walk and query limits (default: ``Admission()``).
        authorize: optional check of each request, e.g. the publisher's
            ``authorize_request`` (which checks the resource whose bootstrap
            route serves the request's path), whose refusal (an ``AccessDenied``)
            is answered 401, 403 or 503 as it says; a plain False answers 401.
        to_item: row → item (default: ``dict(row)``).
        acquire_timeout: how long a request waits for a pool connection before 503.
        authorize_timeout: how long ``authorize`` may take before the request is
            answered 503 ``unavailable`` (the publisher's own check gives up
            after 5 s, within this).
    """

    def __init__(
        self,
        path: str,
        query: KeysetQuery,
        pool: asyncpg.Pool[asyncpg.Record] | PoolSource,
        *,
        admission: Admission | None = None,
        authorize: RequestCheck | None = None,
        to_item: ItemEncoder = dict,
        acquire_timeout: float = 5.0,
        authorize_timeout: float = 10.0,
    ) -> None:
        self.path = path.rstrip("/") or "/"
        self.query = query
        self._pool = pool
        self.admission = admission if admission is not None else Admission()
        self._authorize = authorize
        self.to_item = to_item
        self.acquire_timeout = acquire_timeout
        self.authorize_timeout = authorize_timeout
        self.batches_served = 0
        self.items_served = 0
        self._item_sql = query.item_statement() if query.id_column is not None else None
        self._outage_lines = BudgetedLines(
            LogBudget(OUTAGE_LINES, OUTAGE_WINDOW),
            log,
            "bootstrap.unavailable_held",
            logging.WARNING,
        )
        """Every request during an outage is a 503: a few lines say so, then a count."""

    def pool(self) -> asyncpg.Pool[asyncpg.Record]:
        if isinstance(self._pool, asyncpg.Pool):
            return self._pool
        return self._pool()

    def routes(self, *, item: bool = True) -> list[Route]:
        """Starlette routes: ``GET {path}`` and, unless ``item=False``, ``GET {path}/{id}``.

        Raises:
            BootstrapConfigError: ``item`` for a composite key without ``id_column``.
        """
        routes: list[Route] = [PrivateRoute(self.path, self.list_endpoint)]
        if item:
            self.query.item_statement()  # refuses a source without an id column
            routes.append(PrivateRoute(f"{self.path}/{{id}}", self.item_endpoint))
        return routes

    def stats(self) -> dict[str, Any]:
        """Admission counters plus batch and per-id counts."""
        return {
            **self.admission.stats(),
            "batchesServed": self.batches_served,
            "itemsServed": self.items_served,
        }

    # -- queries (no HTTP) -----------------------------------------------------

    async def fetch_page(
        self, conn: PgConnection, request: PageRequest, walk: str, path: str
    ) -> tuple[list[Any], str | None]:
        """Run one page query on ``conn``: the items and the ``next`` link (None: last)."""
        sql, args = self.query.page_statement(request)
        rows: Sequence[asyncpg.Record] = await conn.fetch(sql, *args)
        if len(rows) > request.limit:
            rows = rows[: request.limit]
            link = self.query.next_link(path, request, walk, self.query.sort_key(rows[-1]))
        else:
            link = None
        return [self.to_item(r) for r in rows], link

    async def fetch_batch(self, conn: PgConnection, request: BatchRequest) -> list[Any]:
        """The items found among ``request.ids``, in key order."""
        sql, args = self.query.batch_statement(request)
        return [self.to_item(r) for r in await conn.fetch(sql, *args)]

    async def fetch_item(self, conn: PgConnection, item_id: Any) -> Any | None:
        """The item with id ``item_id`` (already parsed), or None."""
        assert self._item_sql is not None
        row = await conn.fetchrow(self._item_sql, item_id)
        return None if row is None else self.to_item(row)

    # -- endpoints -------------------------------------------------------------

    async def refuse_unauthorized(self, request: Request) -> Response | None:
        """The answer to a request ``authorize`` refuses (None: it may proceed): 401,
        403 or 503 with ``Retry-After`` as the refusal says
        (``changefeed.schemas.access``), 401 for a plain False. An ``authorize``
        that raises, or takes longer than ``authorize_timeout``, is unavailable
        (503), never unauthorized: a client must not give up because a check
        could not be made."""
        if self._authorize is None:
            return None
        # Which route this is, for a check that finds the resource from it
        # (``Publisher.authorize_request``).
        setattr(request.state, BOOTSTRAP_ROUTE_STATE, self.path)
        try:
            outcome = await answer_within(
                self._authorize(request), self.authorize_timeout, "authorize"
            )
        except Exception as exc:
            log_event(log, "bootstrap.authorize_failed", logging.ERROR, exc=exc, route=self.path)
            outcome = AccessDenied.unavailable()
        if not isinstance(outcome, AccessDenied):
            if outcome:
                return None
            outcome = AccessDenied.unauthorized()
        return error_response(
            outcome.status, outcome.code, outcome.message, outcome.headers(), outcome.retry_after
        )

    async def list_endpoint(self, request: Request) -> Response:
        """``GET {path}``: a page, or a batch with ``?ids=``."""
        if (refused := await self.refuse_unauthorized(request)) is not None:
            return refused
        try:
            parsed = self.query.parse_request(request.query_params.multi_items())
        except PageRequestError as exc:
            return error_response(400, "bad_request", exc.message)
        except TokenKeyUnavailable as exc:
            return self._failed(exc)
        if isinstance(parsed, BatchRequest):
            return await self._batch(parsed)
        return await self._page(request, parsed)

    async def _batch(self, parsed: BatchRequest) -> Response:
        try:
            async with self.pool().acquire(timeout=self.acquire_timeout) as conn:
                items = await self.fetch_batch(conn, parsed)
        except DB_UNAVAILABLE as exc:
            return self._unavailable(exc)
        except Exception as exc:
            return self._failed(exc)
        self.batches_served += 1
        return Response(encode_json({"items": items, "next": None}), 200, None, "application/json")

    async def _page(self, request: Request, parsed: PageRequest) -> Response:
        admission = self.admission
        try:
            walk, new = admission.admit(parsed.walk, issued=parsed.issued)
        except WalkRefused as exc:
            log_event(log, "bootstrap.refused", logging.DEBUG, route=self.path, reason="walks")
            return self._busy(exc)
        try:
            async with (
                admission.query_slot(),
                self.pool().acquire(timeout=self.acquire_timeout) as conn,
            ):
                items, link = await self.fetch_page(conn, parsed, walk, request.url.path)
        except WalkRefused as exc:
            if new:
                admission.walks.abandon(walk)
            log_event(log, "bootstrap.refused", logging.DEBUG, route=self.path, reason="queries")
            return self._busy(exc)
        except DB_UNAVAILABLE as exc:
            if new:
                admission.walks.abandon(walk)
            return self._unavailable(exc)
        except Exception as exc:
            if new:
                admission.walks.abandon(walk)
            return self._failed(exc)
        except BaseException:
            if new:
                admission.walks.abandon(walk)
            raise
        admission.served(walk, last=link is None)
        if new:
            log_event(log, "bootstrap.walk_started", logging.DEBUG, route=self.path, walk=walk)
        return Response(encode_json({"items": items, "next": link}), 200, None, "application/json")

    def _unavailable(self, exc: BaseException) -> Response:
        """The answer while the database cannot be reached: 503 with ``Retry-After``
        (logged without a traceback: the outage, not this route, is the story)."""
        if self._outage_lines.due("unavailable", asyncio.get_running_loop()):
            log_event(
                log, "bootstrap.unavailable", logging.WARNING, route=self.path, error=repr(exc)
            )
        return unavailable_response(exc, self.admission.retry_after or 1)

    def _failed(self, exc: Exception) -> Response:
        """The answer to a read that failed otherwise than the database being away.
        The page tokens' key not known yet (the publisher is starting) is 503. A
        value the column's type refuses (an id or a filter that is not a number,
        say) is the request's fault: 400, which a client does not retry. Anything
        else is a bug or a misconfiguration: logged with its traceback, 500."""
        if isinstance(exc, TokenKeyUnavailable):
            return error_response(503, "unavailable", str(exc), {"Retry-After": "1"}, 1)
        if isinstance(exc, asyncpg.DataError):
            return error_response(400, "bad_request", f"the database refused a value: {exc}")
        log_event(log, "bootstrap.failed", logging.ERROR, exc=exc, route=self.path)
        return error_response(500, "internal", "the route failed (the server's log says why)")

    def _busy(self, exc: WalkRefused) -> Response:
        return error_response(429, "busy", exc.message, {"Retry-After": str(exc.retry_after)})

    async def item_endpoint(self, request: Request) -> Response:
        """``GET {path}/{id}``: one item, or 404."""
        if (refused := await self.refuse_unauthorized(request)) is not None:
            return refused
        text = request.path_params["id"]
        try:
            item_id = self.query.parse_id_text(text)
        except PageRequestError as exc:
            return error_response(400, "bad_request", exc.message)
        try:
            async with self.pool().acquire(timeout=self.acquire_timeout) as conn:
                item = await self.fetch_item(conn, item_id)
        except DB_UNAVAILABLE as exc:
            return self._unavailable(exc)
        except Exception as exc:
            return self._failed(exc)
        if item is None:
            return error_response(404, "not_found", f"no item {text!r} at {self.path}")
        self.items_served += 1
        return Response(encode_json(item), 200, None, "application/json")
