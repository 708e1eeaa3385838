"""Starlette routes of the publisher; the embedding app mounts ``publisher.routes``.

Thin adapter: each endpoint renders state the publisher already keeps, seen
through ``PublisherView``. The /changefeeds websocket is ``ListenerEndpoint``,
a plain ASGI app (see connection.py), and the dashboard has its own module
(dashboard.py). /changefeeds and /changefeeds/stats need the bearer token when
auth is configured and show only the resources the token may read (stats
also takes it as a Basic password, for the dashboard's browser); /metrics,
/healthz and /readyz never do (scrapers and probes; they show counts, not
listeners). The answers of the first two carry ``Cache-Control: no-store``
and ``X-Content-Type-Options: nosniff``, as the dashboard's do. Query
parameters are validated: an unknown one, or a bad value, is a 400 with the
protocol's error body, never ignored.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any, Protocol

from prometheus_client import CONTENT_TYPE_LATEST
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Route, WebSocketRoute
from starlette.types import ASGIApp, Receive, Scope, Send

from changefeed.bootstrap.route import PrivateRoute, error_response
from changefeed.schemas import AccessDenied, allows, decide

from .auth import BearerAuth
from .config import PublisherConfig
from .connection import ListenerEndpoint
from .dashboard import dashboard_routes
from .host import ListenerHost
from .metrics import PublisherMetrics
from .tailer import Tailer

__all__ = ["ListenersFirst", "PublisherView", "error_response", "publisher_routes"]


class PublisherView(Protocol):
    """What the HTTP routes need of a publisher."""

    config: PublisherConfig
    tailer: Tailer
    metrics: PublisherMetrics
    failed: dict[str, str]

    @property
    def sessions(self) -> ListenerHost: ...

    @property
    def auth(self) -> BearerAuth: ...

    @property
    def draining(self) -> bool: ...

    def refused(self, code: str, endpoint: str, peer: str, reason: str) -> None: ...

    def stats(self, allowed: frozenset[str] | None = None) -> dict[str, Any]: ...


# A running tailer reads at least once per poll interval; one that has not read
# for this long is stuck (a query blocked on a lock, a half-open connection).
_STUCK_AFTER_MIN = 5.0
_STUCK_AFTER_POLLS = 10

_STATS_LIMIT_MAX = 100_000


class _BadQuery(Exception):
    pass


def _peer(request: Request) -> str:
    client = request.client
    return f"{client.host}:{client.port}" if client else ""


def _query(request: Request, allowed: Mapping[str, int]) -> dict[str, str]:
    """The query parameters of ``request``, each at most once and at most so many characters.

    Raises:
        _BadQuery: an unknown or repeated parameter, or one that is too long.
    """
    values: dict[str, str] = {}
    for name, value in request.query_params.multi_items():
        if name not in allowed:
            known = ", ".join(sorted(allowed)) or "none"
            raise _BadQuery(f"unknown query parameter {name[:64]!r} (known: {known})")
        if name in values:
            raise _BadQuery(f"query parameter {name!r} given more than once")
        if len(value) > allowed[name]:
            raise _BadQuery(f"query parameter {name!r} is longer than {allowed[name]} characters")
        values[name] = value
    return values


def publisher_routes(publisher: PublisherView) -> list[BaseRoute]:
    """Routes for ``publisher``: /changefeeds (GET + websocket), /changefeeds/stats,
    /metrics, /healthz, /readyz, and the dashboard (dashboard.py)."""

    def refusal(request: Request, denied: AccessDenied) -> Response:
        """Count a refused request and answer it (``changefeed.schemas.access`` decided)."""
        publisher.refused(
            denied.code, "http", _peer(request), f"{request.url.path}: {denied.message}"
        )
        return error_response(
            denied.status, denied.code, denied.message, denied.headers(), denied.retry_after
        )

    async def access(request: Request, *, basic: bool = False) -> frozenset[str] | Response:
        """The resources the request's token may read, or the refusal to answer with."""
        # basic: the dashboard's browser sends the token as a Basic password.
        header = request.headers.get("authorization", "")
        outcome = await publisher.auth.check(header, basic=basic)
        if isinstance(outcome, AccessDenied):
            return refusal(request, outcome)
        return outcome.resources

    def bad_request(request: Request, message: str) -> Response:
        publisher.refused("bad_request", "http", _peer(request), f"{request.url.path}: {message}")
        return error_response(400, "bad_request", message)

    async def resources(request: Request) -> Response:
        allowed = await access(request)
        if isinstance(allowed, Response):
            return allowed
        try:
            _query(request, {})
        except _BadQuery as exc:
            return bad_request(request, str(exc))
        return JSONResponse(
            {
                "resources": [
                    {
                        "resource": r.name,
                        "subResources": list(r.sub_resources),
                        "bootstrapRoute": r.bootstrap_route,
                    }
                    for r in publisher.config.resources
                    if allows(allowed, r.name)
                ]
            }
        )

    async def stats(request: Request) -> Response:
        allowed = await access(request, basic=True)
        if isinstance(allowed, Response):
            return allowed
        try:
            query = _query(request, {"resource": 64, "service": 256, "limit": 7})
        except _BadQuery as exc:
            return bad_request(request, str(exc))
        limit: int | None = None
        if "limit" in query:
            text = query["limit"]
            if not (text.isascii() and text.isdigit()) or not 0 <= int(text) <= _STATS_LIMIT_MAX:
                message = f"limit must be an integer from 0 to {_STATS_LIMIT_MAX}"
                return bad_request(request, message)
            limit = int(text)
        if "resource" in query:
            name = query["resource"]
            if publisher.config.resource(name) is None:
                return bad_request(request, f"no change feed for resource {name!r}")
            outcome = decide(allowed, name)
            if isinstance(outcome, AccessDenied):
                return refusal(request, outcome)
            allowed = frozenset({name})
        document = publisher.stats(allowed)
        rows = document["registrations"]
        if "service" in query:
            rows = [row for row in rows if row["service"] == query["service"]]
        if limit is not None:
            document["truncated"] = len(rows) > limit
            rows = rows[:limit]
        document["registrations"] = rows
        return JSONResponse(document)

    async def metrics(request: Request) -> Response:
        return Response(publisher.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    async def healthz(request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    async def readyz(request: Request) -> Response:
        tailer = publisher.tailer
        stuck_after = max(_STUCK_AFTER_MIN, _STUCK_AFTER_POLLS * publisher.config.poll_interval)
        read_ago = None if tailer.last_read_at is None else time.monotonic() - tailer.last_read_at
        stuck = read_ago is None or read_ago > stuck_after
        failed = dict(publisher.failed)
        ready = tailer.status == "running" and not stuck and not publisher.draining
        ready = ready and not failed
        body = {
            "status": "ready" if ready else "not ready",
            "tailer": tailer.status,
            "lastReadSecondsAgo": None if read_ago is None else round(read_ago, 3),
            "stuck": stuck,
            "draining": publisher.draining,
            "lastError": tailer.last_error,
            "failed": failed,
        }
        return JSONResponse(body, status_code=200 if ready else 503)

    return [
        PrivateRoute("/changefeeds", resources),
        WebSocketRoute("/changefeeds", ListenerEndpoint(publisher.sessions)),
        PrivateRoute("/changefeeds/stats", stats),
        Route("/metrics", metrics, methods=["GET"]),
        Route("/healthz", healthz, methods=["GET"]),
        Route("/readyz", readyz, methods=["GET"]),
        *dashboard_routes(publisher.auth, publisher.refused),
    ]


class ListenersFirst:
    """``app``, with the listener websocket (``/changefeeds``) handed straight to the
    publisher, past ``app``'s middleware and router.

    A listener's connection lives as long as the listener, and every frame of the
    ASGI calls it passed through stays allocated meanwhile: under Starlette's
    error and exception middleware and its router, about 1.5 KB per idle
    listener, 15 MB for ten thousand. Everything else (HTTP, lifespan, other
    websockets) goes to ``app`` as before.
    """

    __slots__ = ("_app", "_listeners")

    def __init__(self, app: ASGIApp, listeners: ASGIApp) -> None:
        self._app = app
        self._listeners = listeners

    def __getattr__(self, name: str) -> Any:
        # Anything else is the app's (``state``, ``url_path_for``, ...): code written
        # against the app, such as ``lambda: app.state.pool``, keeps working where
        # ``app`` is rebound to this wrapper.
        if name in ListenersFirst.__slots__:
            raise AttributeError(name)  # not yet set (copying): never the app's
        return getattr(self._app, name)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "websocket" and scope["path"] == "/changefeeds":
            await self._listeners(scope, receive, send)
        else:
            await self._app(scope, receive, send)
