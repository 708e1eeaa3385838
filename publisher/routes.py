"""Starlette routes of the publisher; the embedding app mounts ``publisher.routes``.

Thin adapter: each endpoint renders state the Publisher already keeps.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from prometheus_client import CONTENT_TYPE_LATEST
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Route, WebSocketRoute
from starlette.websockets import WebSocket

from changefeed.schemas import ErrorFrame

from .websocket import serve_listener

if TYPE_CHECKING:
    from .service import Publisher

__all__ = ["error_response", "publisher_routes"]


def error_response(
    status: int, code: str, message: str, headers: dict[str, str] | None = None
) -> JSONResponse:
    """An HTTP error with the protocol's error body."""
    return JSONResponse(ErrorFrame(code, message).to_json(), status_code=status, headers=headers)


def publisher_routes(publisher: Publisher) -> list[BaseRoute]:
    """Routes for ``publisher``: /changefeeds (GET + websocket), /changefeeds/stats,
    /metrics, /healthz, /readyz."""

    async def guard(request: Request) -> Response | None:
        if not await publisher.authorize_request(request):
            publisher.metrics.refusals_total.labels("unauthorized").inc()
            return error_response(
                401,
                "unauthorized",
                "missing or invalid bearer token",
                {"WWW-Authenticate": "Bearer"},
            )
        return None

    async def resources(request: Request) -> Response:
        if (refused := await guard(request)) is not None:
            return refused
        return JSONResponse(
            {"resources": [publisher.route_of(r).to_json() for r in publisher.config.resources]}
        )

    async def stats(request: Request) -> Response:
        if (refused := await guard(request)) is not None:
            return refused
        return JSONResponse(publisher.stats())

    async def metrics(request: Request) -> Response:
        return Response(publisher.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    async def healthz(request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    async def readyz(request: Request) -> Response:
        tailer = publisher.tailer
        ready = tailer.status == "running" and not publisher.draining
        body = {
            "status": "ready" if ready else "not ready",
            "tailer": tailer.status,
            "draining": publisher.draining,
            "lastError": tailer.last_error,
        }
        return JSONResponse(body, status_code=200 if ready else 503)

    async def websocket(ws: WebSocket) -> None:
        await serve_listener(publisher, ws)

    return [
        Route("/changefeeds", resources, methods=["GET"]),
        WebSocketRoute("/changefeeds", websocket),
        Route("/changefeeds/stats", stats, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
        Route("/healthz", healthz, methods=["GET"]),
        Route("/readyz", readyz, methods=["GET"]),
    ]
