"""The HTTP plumbing every resource of the example API shares.

* ``read_json`` reads a write's body: ``application/json`` only (415
  otherwise: an HTML form, which any web page can make a browser submit to
  another site, can only send ``text/plain``, ``application/x-www-form-urlencoded``
  or ``multipart/form-data``, and a cross-site ``fetch`` that sends JSON must
  first pass a CORS preflight this API never answers), at most ``max_bytes``
  (413), valid JSON (400), and no NUL character in any string, key or value
  (400: PostgreSQL text cannot hold U+0000, so the write would otherwise fail
  in the database, with a 500).
* ``guard`` wraps a write endpoint: the bearer token first, then the handler;
  ``InvalidBody`` becomes 400, ``Refused`` its own status, a database outage
  503 and any other database error 500, each with the protocol's error body.
* Pure helpers: ``fields``, ``is_json_media_type``, ``find_nul``, ``uuid_field``,
  ``path_uuid``.

It never formats a request value into SQL and never answers with a traceback.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import asyncpg
import orjson
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response

from changefeed.bootstrap import DB_UNAVAILABLE, encode_json, error_response, unavailable_response
from changefeed.budgeted_log import BudgetedLines
from changefeed.log_budget import LogBudget
from changefeed.logs import log_event

__all__ = [
    "MAX_BODY_BYTES",
    "Handler",
    "InvalidBody",
    "Refused",
    "fields",
    "find_nul",
    "guard",
    "is_json_media_type",
    "json_response",
    "path_uuid",
    "read_json",
    "uuid_field",
]

log = logging.getLogger(__name__)

MAX_BODY_BYTES = 65536

GONE_LINES = 10
GONE_WINDOW = 10.0
"""Clients gone mid-body logged one by one per window of this many seconds; the
rest are counted in one ``vmapi.clients_gone_held`` line when it ends."""

Handler = Callable[[Request], Awaitable[Response]]
Authorizer = Callable[[Request], Awaitable[Response | None]]
"""Returns the refusal of a request the token check turns away (401, 403 or 503, as
``BootstrapRoute.refuse_unauthorized`` answers it), or None."""


class InvalidBody(ValueError):
    """A request that breaks the API's contract (answered with 400 ``bad_request``)."""


class Refused(Exception):
    """A request the API answers with ``status`` and the error body ``code``/``message``."""

    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message

    def response(self) -> Response:
        return error_response(self.status, self.code, self.message)


# -- pure --------------------------------------------------------------------------


def is_json_media_type(content_type: str | None) -> bool:
    """Whether a Content-Type header names JSON: ``application/json``, in any case,
    with parameters allowed; a ``charset`` must be UTF-8 (RFC 8259: JSON is UTF-8)."""
    if not content_type:
        return False
    media_type, *params = content_type.split(";")
    if media_type.strip().lower() != "application/json":
        return False
    for param in params:
        name, _, value = param.partition("=")
        if name.strip().lower() == "charset" and value.strip().strip('"').lower() not in (
            "utf-8",
            "utf8",
        ):
            return False
    return True


def find_nul(doc: Any, where: str = "body") -> str | None:
    """Where in a parsed JSON document a string (value or key) holds U+0000, or None."""
    if isinstance(doc, str):
        return where if "\x00" in doc else None
    if isinstance(doc, list):
        for i, item in enumerate(doc):
            if (found := find_nul(item, f"{where}[{i}]")) is not None:
                return found
    elif isinstance(doc, dict):
        for key, value in doc.items():
            if "\x00" in key:
                return f"{where}: a key"
            if (found := find_nul(value, f"{where}.{key}")) is not None:
                return found
    return None


def fields(doc: Any, allowed: Sequence[str]) -> dict[str, Any]:
    """``doc`` as a JSON object with only ``allowed`` keys.

    Raises:
        InvalidBody: not an object, or a key is not allowed.
    """
    if not isinstance(doc, dict):
        raise InvalidBody("body: expected a JSON object")
    unknown = sorted(set(doc) - set(allowed))
    if unknown:
        raise InvalidBody(f"unknown fields {unknown} (known: {', '.join(allowed)})")
    return doc


def uuid_field(value: Any, name: str) -> uuid.UUID:
    """A body field that must be a UUID string.

    Raises:
        InvalidBody: it is not one.
    """
    if isinstance(value, str):
        try:
            return uuid.UUID(value)
        except ValueError:
            pass
    raise InvalidBody(f"{name}: expected a UUID, got {value!r}")


def path_uuid(request: Request, what: str) -> uuid.UUID:
    """The ``{id}`` path parameter as a UUID.

    Raises:
        InvalidBody: it is not one.
    """
    text = request.path_params["id"]
    try:
        return uuid.UUID(text)
    except ValueError:
        raise InvalidBody(f"{text!r} is not a valid {what} uuid") from None


def json_response(document: Any, status: int = 200) -> Response:
    return Response(encode_json(document), status, None, "application/json")


# -- I/O ---------------------------------------------------------------------------


async def read_json(request: Request, max_bytes: int = MAX_BODY_BYTES) -> Any:
    """The JSON body of a write.

    Raises:
        Refused: 415 for a body that is not ``application/json``, 413 for one
            larger than ``max_bytes`` (counted as it is read, whatever
            Content-Length says).
        InvalidBody: not valid JSON, or a string in it holds U+0000.
    """
    content_type = request.headers.get("content-type")
    if not is_json_media_type(content_type):
        raise Refused(
            415,
            "unsupported_media_type",
            f"writes take Content-Type: application/json, got {content_type or 'none'!r}",
        )
    declared = request.headers.get("content-length", "")
    too_large = Refused(413, "too_large", f"request body larger than {max_bytes} bytes")
    if declared.isdigit() and int(declared) > max_bytes:
        raise too_large
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > max_bytes:
            raise too_large
    try:
        doc = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise InvalidBody(f"body is not valid JSON: {exc}") from None
    if (where := find_nul(doc)) is not None:
        raise InvalidBody(f"{where}: text must not contain the NUL character (U+0000)")
    return doc


def guard(handler: Handler, refuse_unauthorized: Authorizer) -> Handler:
    """``handler`` behind the bearer token, with every failure answered by the error body."""
    # Any client can go away mid-body as often as it likes: it does not set the log
    # volume (at most GONE_LINES lines, then one summary, per GONE_WINDOW seconds).
    gone_lines = BudgetedLines(LogBudget(GONE_LINES, GONE_WINDOW), log, "vmapi.clients_gone_held")

    async def endpoint(request: Request) -> Response:
        if (refused := await refuse_unauthorized(request)) is not None:
            return refused
        try:
            return await handler(request)
        except ClientDisconnect:
            # The client went away mid-body, or stopped sending it and the server's
            # body deadline closed the connection (changefeed.http_timeouts, which
            # has answered 408). Nothing was written; nobody is left to answer.
            if gone_lines.due("vmapi.client_gone", asyncio.get_running_loop()):
                log_event(log, "vmapi.client_gone", route=request.url.path)
            return Response(status_code=400)
        except InvalidBody as exc:
            return error_response(400, "bad_request", str(exc))
        except Refused as exc:
            return exc.response()
        except DB_UNAVAILABLE as exc:
            log_event(log, "vmapi.unavailable", logging.WARNING, exc=exc, route=request.url.path)
            return unavailable_response(exc)
        except asyncpg.PostgresError as exc:
            log_event(log, "vmapi.failed", logging.ERROR, exc=exc, route=request.url.path)
            return error_response(
                500, "internal", f"the write failed and was rolled back ({exc.sqlstate})"
            )

    return endpoint
