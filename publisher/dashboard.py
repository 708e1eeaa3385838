"""The publisher's dashboard: one page that reads /changefeeds/stats every second.

``GET /changefeeds/dashboard`` is the page, behind the same tokens as the
stats it reads; a browser that has none is asked for one (HTTP Basic: any
user name, the bearer token as the password; see auth.py). Its script, style
sheet and icon, under ``/changefeeds/dashboard/``, are the files in
``static/`` shipped with the package, served as they are and without a
token: they hold no data, and nothing is loaded from anywhere else, so the
page works on a publisher that cannot reach the internet.

The page is its own origin's only: it may not be framed, runs only the
script served here, and fetches only from here (the headers below). The
script inserts every value as text, never as markup: instance and service
names are whatever listeners sent.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from importlib import resources

from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response
from starlette.routing import BaseRoute, Route

from changefeed.schemas import PRIVATE_HEADERS, AccessDenied

from .auth import BearerAuth
from .figures import dashboard_labels

__all__ = ["DASHBOARD_PATH", "dashboard_routes"]

DASHBOARD_PATH = "/changefeeds/dashboard"

_ASSETS = {
    "dashboard.js": "text/javascript; charset=utf-8",
    "dashboard.css": "text/css; charset=utf-8",
    "icon.svg": "image/svg+xml",
}

_SECURITY_HEADERS = {
    "Content-Security-Policy": (
        "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; "
        "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
    ),
    "X-Frame-Options": "DENY",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cross-Origin-Opener-Policy": "same-origin",
    "Cross-Origin-Resource-Policy": "same-origin",
}

_CHALLENGE = 'Basic realm="changefeed", charset="UTF-8"'

_SIGN_IN = (
    "This dashboard needs a bearer token. Reload the page and sign in with any\n"
    "user name and the token as the password, or send it as\n"
    "'Authorization: Bearer <token>'.\n"
)

Refused = Callable[[str, str, str, str], None]
"""Counts a refusal: (error code, endpoint, peer, reason), as ``Publisher.refused``."""


def _static(name: str) -> bytes:
    return (resources.files(__name__.rpartition(".")[0]) / "static" / name).read_bytes()


def dashboard_routes(auth: BearerAuth, refused: Refused) -> list[BaseRoute]:
    """The dashboard's routes: the page at ``DASHBOARD_PATH`` and its files below it.

    Args:
        auth: the publisher's tokens (the page takes them as Bearer or as the
            Basic password, like the stats it reads).
        refused: counts a refused request (``Publisher.refused``).
    """
    # Data, not script: the CSP's script-src does not apply to it, and "<" is escaped
    # so that nothing in it can end the element.
    since_start = json.dumps(dashboard_labels()).replace("<", "\\u003c")
    page_bytes = _static("dashboard.html").replace(
        b'id="since-start">[]<', f'id="since-start">{since_start}<'.encode()
    )
    assets = {}
    for name, media_type in _ASSETS.items():
        content = _static(name)
        etag = f'"{hashlib.sha256(content).hexdigest()[:20]}"'
        assets[name] = (content, media_type, etag)

    async def page(request: Request) -> Response:
        outcome = await auth.check(request.headers.get("authorization", ""), basic=True)
        if isinstance(outcome, AccessDenied):
            peer = f"{request.client.host}:{request.client.port}" if request.client else ""
            refused(outcome.code, "http", peer, f"{request.url.path}: {outcome.message}")
            headers = {
                **_SECURITY_HEADERS,
                **outcome.headers(challenge=_CHALLENGE),
                **PRIVATE_HEADERS,
            }
            text = _SIGN_IN if outcome.code == "unauthorized" else f"{outcome.message}\n"
            return PlainTextResponse(text, outcome.status, headers)
        return Response(
            page_bytes,
            media_type="text/html; charset=utf-8",
            headers={**_SECURITY_HEADERS, **PRIVATE_HEADERS},
        )

    async def asset(request: Request) -> Response:
        found = assets.get(request.path_params["name"])
        if found is None:
            return PlainTextResponse("not found\n", 404, _SECURITY_HEADERS)
        content, media_type, etag = found
        # no-cache: revalidated (ETag) on each load, so an upgraded publisher's
        # page never runs the previous version's script.
        headers = {**_SECURITY_HEADERS, "Cache-Control": "no-cache", "ETag": etag}
        if request.headers.get("if-none-match") == etag:
            return Response(status_code=304, headers=headers)
        return Response(content, media_type=media_type, headers=headers)

    return [
        Route(DASHBOARD_PATH, page, methods=["GET"]),
        Route(DASHBOARD_PATH + "/{name}", asset, methods=["GET"]),
    ]
