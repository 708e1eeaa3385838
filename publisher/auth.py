"""Bearer-token authentication of registrations and bootstrap routes (docs/security.md).

Static tokens from the config are looked up first, in constant time per
entry; a token they do not know goes to the embedding API's ``Authorizer``,
when it has one. Without either, everything is allowed.

A browser cannot add a bearer header to a page it navigates to, so the
routes meant for people (the dashboard and the stats it reads) also take the
token as the password of HTTP Basic credentials, the user name ignored:
``resolve(header, basic=True)``. The websocket never does: a browser adds
the Basic credentials it remembers to requests that other sites make it
send. The same-origin policy keeps those sites from reading the answer of an
HTTP GET, but not from using a websocket they opened that way.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import logging
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from typing import Any
from urllib.parse import urlsplit

from changefeed.logs import log_event
from changefeed.outside_check import answer_within
from changefeed.schemas import AccessDenied, AccessGranted, allows, decide

from .errors import PublisherError

__all__ = [
    "AuthUnavailable",
    "Authorizer",
    "BearerAuth",
    "presented_token",
    "resources_served_at",
    "routed_paths",
]

log = logging.getLogger(__name__)

Authorizer = Callable[[str], Awaitable[frozenset[str] | None]]
"""Maps a bearer token to the resources it may read (``frozenset({"*"})`` for all),
or None to refuse it. Raising (or taking longer than 5 s) refuses the request as
*unavailable* (HTTP 503 / close code 4010), which listeners retry, not as
unauthorized, which they do not."""

_AUTHORIZE_TIMEOUT = 5.0
_EVERYTHING = frozenset({"*"})


class AuthUnavailable(PublisherError):
    """Authentication cannot be decided now: the authorizer failed or timed out."""


class _Tokens:
    """The static bearer tokens of a config: token (or ``sha256:<hex>`` of it) -> resources.

    Comparison is constant-time per entry, and every entry is compared, so the
    time taken does not say which entry (or which prefix) came close.
    """

    def __init__(self, everything: Sequence[str], limited: Mapping[str, Sequence[str]]) -> None:
        self._plain: list[tuple[bytes, frozenset[str]]] = []
        self._hashed: list[tuple[bytes, frozenset[str]]] = []
        for token, resources in [(t, _EVERYTHING) for t in everything] + [
            (t, frozenset(r)) for t, r in limited.items()
        ]:
            if token.startswith("sha256:"):
                self._hashed.append((token[7:].lower().encode(), resources))
            else:
                self._plain.append((token.encode(), resources))

    def __bool__(self) -> bool:
        return bool(self._plain or self._hashed)

    def lookup(self, token: str) -> frozenset[str] | None:
        presented = token.encode()
        digest = hashlib.sha256(presented).hexdigest().encode()
        found: frozenset[str] | None = None
        for known, resources in self._plain:
            if hmac.compare_digest(known, presented):
                found = resources
        for known, resources in self._hashed:
            if hmac.compare_digest(known, digest):
                found = resources
        return found


def presented_token(authorization: str, *, basic: bool = False) -> str | None:
    """The token in an ``Authorization`` header: ``Bearer <token>``, or, with
    ``basic``, the password of ``Basic base64(user:password)``; None otherwise."""
    scheme, _, credentials = authorization.partition(" ")
    credentials = credentials.strip()
    if not credentials:
        return None
    if scheme.lower() == "bearer":
        return credentials
    if not basic or scheme.lower() != "basic":
        return None
    try:
        decoded = base64.b64decode(credentials, validate=True).decode()
    except (binascii.Error, UnicodeDecodeError):
        return None
    _user, colon, password = decoded.partition(":")
    return password if colon and password else None


class BearerAuth:
    """Who may read what, from the ``Authorization: Bearer`` header.

    Args:
        everything: tokens that may read every resource (``auth_tokens``).
        limited: token -> the resources it may read (``token_resources``).
        authorize: asked about any token the static ones do not know.
    """

    def __init__(
        self,
        everything: Sequence[str],
        limited: Mapping[str, Sequence[str]],
        authorize: Authorizer | None = None,
    ) -> None:
        self._tokens = _Tokens(everything, limited)
        self._authorize = authorize

    @property
    def required(self) -> bool:
        """Whether requests need a bearer token (static tokens or an authorizer)."""
        return bool(self._tokens) or self._authorize is not None

    async def resolve(self, authorization: str, *, basic: bool = False) -> frozenset[str] | None:
        """The resources an ``Authorization`` header's bearer token may read
        (``{"*"}``: all); None when it is missing or unknown. Without configured
        auth everything is allowed.

        Args:
            authorization: the header's value (empty when there is none).
            basic: also take ``Basic`` credentials, whose password is the token.

        Raises:
            AuthUnavailable: the authorizer raised or took longer than 5 s.
        """
        if not self.required:
            return _EVERYTHING
        token = presented_token(authorization, basic=basic)
        if token is None:
            return None
        found = self._tokens.lookup(token)
        if found is not None or self._authorize is None:
            return found
        try:
            answer = await answer_within(
                self._authorize(token), _AUTHORIZE_TIMEOUT, "the authorizer"
            )
            allowed = _resources(answer)
        except Exception as exc:
            # Past its deadline the authorizer is slow, not broken: no traceback to show.
            cause = None if isinstance(exc, TimeoutError) else exc
            log_event(log, "auth.unavailable", logging.ERROR, exc=cause, error=repr(exc))
            raise AuthUnavailable("authorization is unavailable; retry later") from exc
        return allowed

    async def check(
        self,
        authorization: str,
        *,
        basic: bool = False,
        any_of: Sequence[str] = (),
    ) -> AccessGranted | AccessDenied:
        """Whether a request with this ``Authorization`` header may go on: the one
        decision every route renders (``changefeed.schemas.access``). Never raises:
        an authorizer that fails or takes longer than 5 s is ``unavailable``.

        Args:
            authorization: the header's value (empty when there is none).
            basic: also take ``Basic`` credentials, whose password is the token.
            any_of: what the request reads, when it reads a resource: the token
                must be allowed one of them (one, or those that share a route);
                ``forbidden`` naming the first otherwise. Empty: a known token
                may go on.
        """
        try:
            allowed = await self.resolve(authorization, basic=basic)
        except AuthUnavailable:
            return AccessDenied.unavailable()
        resource = None
        if any_of and allowed is not None:
            resource = next((r for r in any_of if allows(allowed, r)), any_of[0])
        return decide(allowed, resource)


def _resources(allowed: object) -> frozenset[str] | None:
    """What an authorizer answered, checked: None, or resource names.

    Raises:
        TypeError: anything else (a bool, one bare string, a mapping, names that
            are not strings): a broken authorizer, which grants nothing by accident.
    """
    if allowed is None:
        return None
    # A mapping (a permission map: {"vm": False}) iterates as its keys, and a bare
    # string as its letters: neither is a list of names.
    if not isinstance(allowed, (str, Mapping)) and isinstance(allowed, Iterable):
        names = frozenset(allowed)
        if all(isinstance(name, str) for name in names):
            return names
    raise TypeError(
        f"the authorizer returned {allowed!r}: expected None (unknown token) "
        "or the resource names the token may read, such as {'vm'} or {'*'}"
    )


def routed_paths(scope: Mapping[str, Any], route: str | None = None) -> list[str]:
    """The paths a request may have been routed by, most literal first: the ASGI
    ``path`` (never ``Host``, which a client writes), that path without the
    ``root_path`` a proxy or a mount put before it (ASGI: ``path`` includes it), and
    ``route``, the path of the route that serves it when known."""
    path = str(scope.get("path") or "/")
    paths = [path]
    root = str(scope.get("root_path") or "").rstrip("/")
    if root and path.startswith(root + "/"):
        paths.append(path[len(root) :])
    if route is not None:
        paths.append(route)
    return paths


def resources_served_at(path: str, routes: Iterable[tuple[str, str]]) -> list[str]:
    """The resources whose bootstrap route serves ``path``: of ``routes`` (``(resource,
    bootstrap route)``; a route may be an absolute URL, whose path counts), those
    whose route is ``path`` or has it as an item (``{route}/{id}``), the longest
    route only. Empty: no bootstrap route serves it."""
    path = path.rstrip("/") or "/"
    found: list[str] = []
    longest = -1
    for resource, route in routes:
        prefix = urlsplit(route).path.rstrip("/") or "/"
        if path != prefix and not path.startswith(prefix.rstrip("/") + "/"):
            continue
        if len(prefix) > longest:
            found, longest = [resource], len(prefix)
        elif len(prefix) == longest:
            found.append(resource)
    return found
