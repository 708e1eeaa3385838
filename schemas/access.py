"""What the outcome of a bearer-token check means for a request: one decision, one answer.

Every route that takes a token (the websocket's handshake and registration,
``/changefeeds``, ``/changefeeds/stats``, the dashboard, and the embedding
API's bootstrap routes) turns the outcome of a check into an answer through
``decide`` and ``AccessDenied``, so that no two of them can disagree:

* no token, or one nobody knows: ``unauthorized``, HTTP 401 with
  ``WWW-Authenticate``, websocket close 4003; changefeed.listener stops;
* a known token that may not read the resource: ``forbidden``, HTTP 403,
  close 4004; the listener stops;
* the authorizer failed or did not answer in time: ``unavailable``, HTTP 503
  with ``Retry-After``, close 4010 with ``retryAfter``; the listener retries.

Pure code: no I/O. The adapters (publisher/routes.py, dashboard.py,
connection.py, bootstrap/route.py) only render what is decided here.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Literal

from .closecodes import ERROR_CLOSE_CODES, CloseCode
from .models import ErrorFrame

__all__ = [
    "ACCESS_STATUS",
    "AUTH_RETRY_AFTER",
    "BOOTSTRAP_ROUTE_STATE",
    "PRIVATE_HEADERS",
    "AccessDenied",
    "AccessGranted",
    "allows",
    "decide",
]

ACCESS_STATUS: dict[str, int] = {"unauthorized": 401, "forbidden": 403, "unavailable": 503}
"""The HTTP status of each way a token check refuses."""

AUTH_RETRY_AFTER = 1
"""Seconds a refusal for an unavailable authorizer asks the client to wait (``Retry-After``,
``retryAfter``): a lower bound; listeners add their own growing, jittered back-off."""

PRIVATE_HEADERS: Mapping[str, str] = MappingProxyType(
    {"Cache-Control": "no-store", "X-Content-Type-Options": "nosniff"}
)
"""Headers of every answer that depends on the token (what it may read, a refusal): no
cache keeps it for the next client, and no browser takes the JSON for another type."""

BOOTSTRAP_ROUTE_STATE = "changefeed_bootstrap_route"
"""The ``request.state`` attribute a ``BootstrapRoute`` sets to its own path before it
calls its ``authorize``: the request reads one of the feed's resources, so a check
that cannot tell which one refuses it rather than let any known token read it."""

_QUOTED = 64


def allows(resources: frozenset[str], resource: str) -> bool:
    """Whether a token that may read ``resources`` (``"*"``: all) may read ``resource``."""
    return "*" in resources or resource in resources


@dataclass(frozen=True, slots=True)
class AccessGranted:
    """The request may go on; ``resources`` are those its token may read (``{"*"}``: all)."""

    resources: frozenset[str]


@dataclass(frozen=True, slots=True)
class AccessDenied:
    """A request refused by the token check, and how each transport answers it.

    It is false in a boolean context, so that ``if await publisher.authorize_request(...)``
    reads it as the refusal it is.
    """

    code: Literal["unauthorized", "forbidden", "unavailable"]
    message: str
    retry_after: int | None = None
    """Seconds before trying again may succeed (``unavailable`` only)."""

    @classmethod
    def unauthorized(cls) -> AccessDenied:
        return cls("unauthorized", "missing or invalid bearer token")

    @classmethod
    def forbidden(cls, resource: str) -> AccessDenied:
        shown = repr(resource)
        if len(shown) > _QUOTED:
            shown = shown[: _QUOTED - 1] + "…"
        return cls("forbidden", f"this token may not read resource {shown}")

    @classmethod
    def unavailable(cls, why: str = "authorization is unavailable") -> AccessDenied:
        return cls("unavailable", f"{why}; retry later", AUTH_RETRY_AFTER)

    def __bool__(self) -> bool:
        return False

    @property
    def status(self) -> int:
        """The HTTP status: 401, 403 or 503."""
        return ACCESS_STATUS[self.code]

    @property
    def close_code(self) -> CloseCode:
        """The websocket close code: 4003, 4004 or 4010."""
        return ERROR_CLOSE_CODES[self.code]

    def headers(self, challenge: str = "Bearer") -> dict[str, str]:
        """HTTP headers of the answer: the challenge (``WWW-Authenticate``) of an
        unauthorized request, ``Retry-After`` of an unavailable one."""
        if self.code == "unauthorized":
            return {"WWW-Authenticate": challenge}
        if self.retry_after is not None:
            return {"Retry-After": str(self.retry_after)}
        return {}

    def frame(self) -> ErrorFrame:
        """The error body (HTTP) or frame (websocket); with ``retryAfter`` when unavailable."""
        return ErrorFrame(self.code, self.message, self.retry_after)


def decide(
    resources: frozenset[str] | None, resource: str | None = None
) -> AccessGranted | AccessDenied:
    """The outcome of a token check.

    Args:
        resources: what the token may read (``{"*"}``: all); None: no token, or
            one that is not known.
        resource: the resource the request reads, when it reads one.
    """
    if resources is None:
        return AccessDenied.unauthorized()
    if resource is not None and not allows(resources, resource):
        return AccessDenied.forbidden(resource)
    return AccessGranted(resources)
