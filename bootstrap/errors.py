"""Exceptions of the bootstrap package.

Exception tree::

    BootstrapError           root of everything changefeed.bootstrap raises
    ├── BootstrapConfigError a configured identifier, limit or option is unusable
    ├── PageRequestError     a page request's query string is malformed (HTTP 400)
    │   └── PageTokenError   an ``after`` token this route did not issue
    ├── WalkRefused          admission control turned a page request away (HTTP 429)
    └── PagingError          a client walk or fetch gave up: retries ran out,
                             or a response body was not a valid page

Every BootstrapError carries ``url`` and ``status`` (the request and the last
HTTP status seen) when they are known; server-side errors leave them None.
"""

from __future__ import annotations

__all__ = [
    "BootstrapConfigError",
    "BootstrapError",
    "PageRequestError",
    "PageTokenError",
    "PagingError",
    "TokenKeyUnavailable",
    "WalkRefused",
]


class BootstrapError(Exception):
    """Root of the bootstrap package's exceptions.

    Args:
        message: what went wrong, for people.
        url: the URL being fetched, when a client request failed.
        status: the last HTTP status received (None: no response at all).
    """

    def __init__(self, message: str, *, url: str | None = None, status: int | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.url = url
        self.status = status


class BootstrapConfigError(BootstrapError):
    """A route, admission control or pager was configured with an unusable identifier,
    limit, key value or option."""


class PageRequestError(BootstrapError):
    """A page request is malformed: bad ``limit``, ``after``, ``ids`` or filter value.

    Routes answer it with HTTP 400 and ``{"error": {"code": "bad_request", ...}}``.
    """


class PageTokenError(PageRequestError):
    """An ``after`` token that this route did not issue: garbage, truncated or edited."""


class TokenKeyUnavailable(BootstrapError):
    """The key of a route's page tokens is not known yet (it comes from a service that
    has not started: ``Publisher.page_token_key`` before the publisher has read its
    feed). The route answers 503 with ``Retry-After``."""


class WalkRefused(BootstrapError):
    """Admission control turned a page request away; retry after ``retry_after`` seconds.

    Routes answer it with HTTP 429, ``Retry-After`` and ``{"error": {"code": "busy", ...}}``.
    """

    def __init__(self, message: str, retry_after: int) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class PagingError(BootstrapError):
    """A client-side walk or fetch failed for good (``url`` and ``status`` say where;
    ``retry_after``: the last ``Retry-After`` the server sent, seconds, if any)."""

    def __init__(
        self,
        message: str,
        *,
        url: str | None = None,
        status: int | None = None,
        retry_after: float | None = None,
    ) -> None:
        super().__init__(message, url=url, status=status)
        self.retry_after = retry_after
