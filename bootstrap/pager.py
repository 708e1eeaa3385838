"""The client side of bootstrap: walk a keyset-paginated route, fetch items by id.

``Pager`` walks ``GET <route>?limit=N`` and follows each page's ``next`` until
it is null, holding at most two pages (the one being consumed and the next
one in flight). A page that fails (connection error, 5xx) is retried with
exponential back-off and jitter, *the same page*: the walk never restarts.
429 and 503 answers are retried after their ``Retry-After`` (a 503 is also what
a route answers while its authorizer cannot be asked); 429 (admission
control: the server is healthy, only busy) does not use up ``max_attempts``
but is bounded in time by ``max_wait``. ``fetch_one`` and ``fetch_many``
(the batch form ``?ids=``) use the same policy.

Every wait is changefeed's one back-off policy (``changefeed.backoff``),
inside tenacity's retry loop: failures wait a jittered exponential delay
plus the answer's Retry-After, busy answers their Retry-After plus up to a
second, spread over the herd. The jitter comes from the policy's
``random.Random`` (``RetryPolicy.rng``), never the global one.

It must never restart a walk on its own, hold more than two pages, retry
without a bound, or retry a request the server refused as malformed or not
allowed (4xx: 401 and 403 are for good).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import re
import time
from collections.abc import (
    AsyncGenerator,
    AsyncIterator,
    Awaitable,
    Callable,
    Iterable,
)
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote

import httpx
import orjson
from tenacity import AsyncRetrying, RetryCallState, retry_if_exception_type

from changefeed.backoff import Backoff, WaitBackoff, retry_after_floor
from changefeed.collector import collector_paused
from changefeed.logs import log_event
from changefeed.schemas import Page, ProtocolError
from changefeed.visible import visible

from .errors import BootstrapConfigError, PagingError

__all__ = [
    "Pager",
    "PagerProgress",
    "RetryPolicy",
    "bearer_headers",
    "fetch_many",
    "fetch_one",
    "fetchable_by_path",
]

log = logging.getLogger(__name__)

_INITIAL_BACKOFF = 0.1
_MAX_BACKOFF = 10.0

_BUSY = Backoff(initial=1.0, maximum=1.0, jitter=1.0)
"""The wait after a busy answer (429): its Retry-After plus up to a second, so that
the walkers it turned away together do not come back at the same moment."""

_JITTER = random.Random()
"""The draws of the pager's waits when its policy names no ``rng``."""


@dataclass(frozen=True, slots=True)
class PagerProgress:
    """How far a walk has got: items and pages received, seconds since it
    started, and items per second."""

    items: int = 0
    pages: int = 0
    elapsed: float = 0.0
    rate: float = 0.0


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    """How failed requests are retried.

    Args:
        max_attempts: attempts per request that may fail (connection errors, 5xx).
        max_wait: seconds one request may spend waiting on 429 (busy) answers.
        initial_backoff: first back-off, doubled after each failure ...
        max_backoff: ... up to this; each wait is jittered between half and all of
            it, plus the answer's Retry-After.
        rng: source of the jitter (default: the pager's own).
    """

    max_attempts: int = 8
    max_wait: float = 300.0
    initial_backoff: float = _INITIAL_BACKOFF
    max_backoff: float = _MAX_BACKOFF
    rng: random.Random | None = None

    @property
    def backoff(self) -> Backoff:
        """The schedule of failed attempts."""
        return Backoff(self.initial_backoff, self.max_backoff, jitter=0.5)


class _Retryable(Exception):
    """An answer worth asking again: 5xx, or 429 (``busy``)."""

    def __init__(self, status: int, retry_after: float | None) -> None:
        super().__init__(f"HTTP {status}")
        self.status = status
        self.retry_after = retry_after
        self.busy = status == 429


def _retry_after(response: httpx.Response) -> float | None:
    value = response.headers.get("retry-after", "").strip()
    if value.isascii() and value.isdigit():  # (str.isdigit takes "²" too)
        return retry_after_floor(float(value))
    return None  # HTTP dates are not worth honouring here: back off instead


class _Attempts:
    """Tenacity stop/wait for one request, counting failures and busy waits apart."""

    def __init__(self, policy: RetryPolicy, url: str, on_retry: Callable[[], None] | None) -> None:
        self.policy = policy
        self.url = url
        self.failures = 0
        self.busy_waited = 0.0
        self.waited = 0.0
        """Every wait, Retry-After included (busy_waited is the part after 429s)."""
        self.on_retry = on_retry
        self.rng = policy.rng or _JITTER
        self._failed = WaitBackoff(policy.backoff, self.rng, failures=lambda _: self.failures)

    def record(self, exc: BaseException) -> None:
        if not (isinstance(exc, _Retryable) and exc.busy):
            self.failures += 1

    def stop(self, state: RetryCallState) -> bool:
        return self.failures >= self.policy.max_attempts or self.busy_waited >= self.policy.max_wait

    def wait(self, state: RetryCallState) -> float:
        exc = state.outcome.exception() if state.outcome is not None else None
        if self.on_retry is not None:
            self.on_retry()
        if isinstance(exc, _Retryable) and exc.busy:
            delay = _BUSY.delay(1, self.rng, exc.retry_after)
            delay = min(delay, max(self.policy.max_wait - self.busy_waited, 0.0))
            self.busy_waited += max(delay, 1e-3)
            self.waited += delay
            log_event(log, "bootstrap.busy", logging.DEBUG, url=self.url, delay=round(delay, 3))
            return delay
        delay = self._failed(state)  # the answer's Retry-After, plus the drawn delay
        self.waited += delay
        log_event(
            log,
            "bootstrap.retry",
            logging.WARNING,
            url=self.url,
            failures=self.failures,
            error=repr(exc),
            delay=round(delay, 3),
        )
        return delay


async def _get(
    client: httpx.AsyncClient,
    url: httpx.URL | str,
    *,
    headers: dict[str, str],
    policy: RetryPolicy,
    allow_404: bool = False,
    on_retry: Callable[[], None] | None = None,
    sent: asyncio.Event | None = None,
) -> httpx.Response:
    """GET ``url`` until it answers 200 (or 404 when allowed), retrying per ``policy``.

    ``sent``, when given, is set once a request is on the wire (httpcore's trace
    extension), so that the caller can do other work while the server answers.

    Raises:
        PagingError: a 4xx other than 429, or the retries ran out.
    """
    shown = str(url)
    attempts = _Attempts(policy, shown, on_retry)
    last_status: int | None = None
    retrying = AsyncRetrying(
        retry=retry_if_exception_type((_Retryable, httpx.TransportError)),
        stop=attempts.stop,
        wait=attempts.wait,
        reraise=True,
    )
    extensions = {"trace": _tracer(sent)} if sent is not None else None
    try:
        async for attempt in retrying:
            with attempt:
                try:
                    response = await client.get(url, headers=headers, extensions=extensions)
                except httpx.TransportError as exc:
                    attempts.record(exc)
                    raise
                shown = str(response.url)
                last_status = response.status_code
                if response.status_code == 200 or (allow_404 and response.status_code == 404):
                    return response
                if response.status_code == 429 or response.status_code >= 500:
                    error = _Retryable(response.status_code, _retry_after(response))
                    attempts.record(error)
                    raise error
                raise PagingError(
                    f"GET {shown}: HTTP {response.status_code}: {_error_message(response)}",
                    url=shown,
                    status=response.status_code,
                )
    except (_Retryable, httpx.TransportError) as exc:
        what = f"HTTP {last_status}" if isinstance(exc, _Retryable) else repr(exc)
        busy = attempts.busy_waited
        on_busy = f", {busy:.1f}s of it on busy answers" if busy else ""
        raise PagingError(
            f"GET {shown}: gave up after {attempts.failures} failed attempts and"
            f" {attempts.waited:.1f}s of waiting between them{on_busy} (last: {what})",
            url=shown,
            status=last_status,
            retry_after=exc.retry_after if isinstance(exc, _Retryable) else None,
        ) from exc
    raise AssertionError("unreachable: tenacity either returns or raises")  # pragma: no cover


def _tracer(sent: asyncio.Event) -> Callable[[str, dict[str, Any]], Awaitable[None]]:
    async def trace(event: str, info: dict[str, Any]) -> None:
        # "http11.send_request_headers.complete" (or http2.): a GET is then sent.
        if event.endswith("send_request_headers.complete"):
            sent.set()

    return trace


_NEXT_AT_END = re.compile(rb',"next":("(?:[^"\\]|\\.)*"|null)\}\s*\Z')


def _peek_next(content: bytes) -> str | bool | None:
    """The ``next`` of a page body without decoding it: a server that writes
    ``"next"`` as the last member (changefeed's route does) lets the pager ask
    for the following page before it decodes this one. False when the body
    does not end that way (then only decoding tells)."""
    match = _NEXT_AT_END.search(content, max(0, len(content) - 8192))
    if match is None:
        return False
    try:
        value = orjson.loads(match.group(1))
    except orjson.JSONDecodeError:
        return False
    return value if isinstance(value, str) else None


def _error_message(response: httpx.Response) -> str:
    try:
        doc = orjson.loads(response.content)
        return str(doc["error"]["message"])
    except (orjson.JSONDecodeError, KeyError, TypeError):
        return response.text[:200]


def _origin(url: httpx.URL) -> tuple[str, str, int | None, str]:
    """Scheme, host and port, as a browser's same-origin rule compares them, and the
    credentials a URL carries (which httpx would send instead of the token)."""
    default = {"http": 80, "https": 443}.get(url.scheme)
    return url.scheme, url.host, url.port or default, url.userinfo.decode()


def bearer_headers(token: str | None) -> dict[str, str]:
    """The ``Authorization`` header of a bearer ``token`` (none without one): what
    every client of a publisher sends (pager, listener handshake, CLI)."""
    return {"Authorization": f"Bearer {token}"} if token else {}


def _decode_page(response: httpx.Response) -> Page:
    try:
        with collector_paused():
            return Page.decode(response.content)
    except ProtocolError as exc:
        raise PagingError(
            f"GET {response.url}: not a valid page: {exc.message}",
            url=str(response.url),
            status=response.status_code,
        ) from None


class Pager:
    """One walk of a bootstrap route.

    ``async for page in pager.pages()`` yields each page's items (a list);
    ``async for item in pager`` yields the items one by one. Each call starts
    a new walk from the first page.

    Args:
        client: the HTTP client (its ``base_url`` resolves a relative ``route``).
        route: the list route, relative (``/vms``) or absolute; it may carry
            filters in its query string, which every page keeps.
        limit: items per page asked for (the server may clamp it).
        max_attempts: failed attempts (connection errors, 5xx) per page before
            giving up.
        on_progress: called after each page with the walk's progress.
        token: bearer token sent with every request.
        max_wait: seconds one page may spend waiting on 429 (busy) answers.
        prefetch: fetch the next page while the current one is consumed.
        rng: source of the retries' jitter (default: the pager's own).

    Raises:
        BootstrapConfigError: ``limit`` or ``max_attempts`` is not positive.
        PagingError: (from the iterators) a page failed for good or its body
            is not a page; ``url`` and ``status`` say which.
    """

    def __init__(
        self,
        client: httpx.AsyncClient,
        route: str,
        *,
        limit: int = 500,
        max_attempts: int = 8,
        on_progress: Callable[[PagerProgress], None] | None = None,
        token: str | None = None,
        max_wait: float = 300.0,
        prefetch: bool = True,
        rng: random.Random | None = None,
    ) -> None:
        if limit < 1:
            raise BootstrapConfigError(f"limit must be positive, got {limit}")
        if max_attempts < 1:
            raise BootstrapConfigError(f"max_attempts must be positive, got {max_attempts}")
        self.client = client
        self.route = route
        self.limit = limit
        self.policy = RetryPolicy(max_attempts=max_attempts, max_wait=max_wait, rng=rng)
        self.on_progress = on_progress
        self.prefetch = prefetch
        self._headers = bearer_headers(token)
        self.progress = PagerProgress()
        self.retries = 0
        """Attempts retried during the current walk (failures and busy answers)."""

    def _count_retry(self) -> None:
        self.retries += 1

    async def _request(self, url: httpx.URL, sent: asyncio.Event | None = None) -> httpx.Response:
        return await _get(
            self.client,
            url,
            headers=self._headers,
            policy=self.policy,
            on_retry=self._count_retry,
            sent=sent,
        )

    async def _request_ahead(self, url: httpx.URL) -> asyncio.Task[httpx.Response]:
        """Start fetching ``url`` and return once the request is on the wire (or
        failed), so that the server works on it while this page is decoded."""
        sent = asyncio.Event()
        request = asyncio.create_task(self._request(url, sent))
        on_the_wire = asyncio.create_task(sent.wait())
        try:
            await asyncio.wait((request, on_the_wire), return_when=asyncio.FIRST_COMPLETED)
        except BaseException:
            request.cancel()
            raise
        finally:
            on_the_wire.cancel()
        return request

    @staticmethod
    def _following(response: httpx.Response, link: str | None) -> httpx.URL | None:
        """The absolute URL of ``link`` (a page's ``next``), None for the last page."""
        if link is None:
            return None
        # Resolved against the page's own URL, as a browser would; kept parsed,
        # since httpx parses long URLs slowly.
        following = response.url.join(link)
        if following == response.url:
            raise PagingError(
                f"GET {response.url}: next link points at the same page",
                url=str(response.url),
                status=200,
            )
        if _origin(following) != _origin(response.url):
            # The walk sends the listener's token with every page: never elsewhere.
            raise PagingError(
                f"GET {response.url}: next link leaves the route's origin"
                f" ({visible(str(following)[:200])}); not followed",
                url=str(response.url),
                status=200,
            )
        return following

    async def pages(self) -> AsyncGenerator[list[Any], None]:
        """Yield the walk's pages, in order, each a list of items.

        With ``prefetch``, the next page is requested before this one is decoded
        when its link can be read off the end of the body (``_peek_next``), else
        right after decoding; either way while the consumer works on this page.
        """
        started = time.monotonic()
        self.progress = PagerProgress()
        self.retries = 0
        items = pages = 0
        pending: asyncio.Task[httpx.Response] | None = None
        try:
            # copy_set_param keeps the route's own query (filters); httpx's params= would drop it.
            first = httpx.URL(self.route).copy_set_param("limit", str(self.limit))
            response = await self._request(first)
            while True:
                peeked = _peek_next(response.content) if self.prefetch else False
                if isinstance(peeked, str):
                    ahead = self._following(response, peeked)
                    assert ahead is not None
                    pending = await self._request_ahead(ahead)
                page = _decode_page(response)
                if pending is not None and page.next != peeked:
                    pending.cancel()  # a server whose body fooled the peek: ask again
                    await asyncio.gather(pending, return_exceptions=True)
                    pending = None
                following = self._following(response, page.next)
                if following is not None and self.prefetch and pending is None:
                    pending = asyncio.create_task(self._request(following))
                items += len(page.items)
                pages += 1
                elapsed = time.monotonic() - started
                self.progress = PagerProgress(
                    items, pages, elapsed, items / elapsed if elapsed > 0 else 0.0
                )
                if self.on_progress is not None:
                    self.on_progress(self.progress)
                yield page.items
                if following is None:
                    return
                if pending is not None:
                    response, pending = await pending, None
                else:
                    response = await self._request(following)
        finally:
            if pending is not None:
                pending.cancel()
                await asyncio.gather(pending, return_exceptions=True)

    async def _items(self) -> AsyncGenerator[Any, None]:
        async with contextlib.aclosing(self.pages()) as pages:
            async for page in pages:
                for item in page:
                    yield item

    def __aiter__(self) -> AsyncIterator[Any]:
        return self._items()


def fetchable_by_path(item_id: str) -> bool:
    """Whether ``fetch_one`` can ask for ``item_id`` as ``{route}/{id}``: not "", "."
    or ".." (a URL resolves them away) and without a "/" (a server splits on it)."""
    return item_id not in ("", ".", "..") and "/" not in item_id


def _item_url(route: str, item_id: str) -> str:
    path, sep, query = route.partition("?")
    return f"{path.rstrip('/')}/{quote(item_id, safe='')}{sep}{query}"


async def fetch_one(
    client: httpx.AsyncClient,
    route: str,
    id: str,
    *,
    token: str | None = None,
    max_attempts: int = 8,
    max_wait: float = 300.0,
    rng: random.Random | None = None,
) -> dict[str, Any] | None:
    """``GET {route}/{id}``: the item, or None when it does not exist (404).

    Args:
        rng: source of the retries' jitter (default: the pager's own).

    Raises:
        PagingError: the retries ran out, another 4xx, or the body is not a JSON object;
            or ``id`` cannot be one segment of a path ("", ".", "..", or with a "/": a
            URL resolves the first, a server splits the other).
    """
    if not fetchable_by_path(id):
        raise PagingError(
            f"id {id!r} cannot be fetched as {route}/{{id}}: it is not one path segment;"
            " fetch it with fetch_many (the ?ids= form)",
            url=route,
        )
    response = await _get(
        client,
        _item_url(route, id),
        headers=bearer_headers(token),
        policy=RetryPolicy(max_attempts=max_attempts, max_wait=max_wait, rng=rng),
        allow_404=True,
    )
    if response.status_code == 404:
        return None
    try:
        item = orjson.loads(response.content)
    except orjson.JSONDecodeError:
        item = None
    if not isinstance(item, dict):
        raise PagingError(
            f"GET {response.url}: body is not a JSON object", url=str(response.url), status=200
        )
    return item


def _item_id(item: Any, id_field: str | None) -> str | None:
    if not isinstance(item, dict):
        return None
    for field in (id_field,) if id_field else ("uuid", "id"):
        if field in item:
            return str(item[field])
    return None


async def fetch_many(
    client: httpx.AsyncClient,
    route: str,
    ids: Iterable[str],
    *,
    chunk: int = 100,
    id_field: str | None = None,
    token: str | None = None,
    max_attempts: int = 8,
    max_wait: float = 300.0,
    rng: random.Random | None = None,
) -> dict[str, dict[str, Any]]:
    """The items found among ``ids``, by id, via the batch form ``{route}?ids=a,b,c``.

    Ids the route does not know are absent from the result (deleted resources).

    Args:
        chunk: ids per request (at most the route's ``max_ids``, 100 by default).
        id_field: the item field holding its id; default ``uuid``, else ``id``.
        rng: source of the retries' jitter (default: the pager's own).

    Raises:
        PagingError: a chunk failed for good or its body is not a page.
    """
    wanted = list(dict.fromkeys(ids))
    policy = RetryPolicy(max_attempts=max_attempts, max_wait=max_wait, rng=rng)
    found: dict[str, dict[str, Any]] = {}
    for start in range(0, len(wanted), chunk):
        part = wanted[start : start + chunk]
        url = httpx.URL(route).copy_set_param("ids", ",".join(part))
        response = await _get(client, url, headers=bearer_headers(token), policy=policy)
        asked = set(part)
        for item in _decode_page(response).items:
            item_id = _item_id(item, id_field)
            if item_id is not None and item_id in asked:
                found[item_id] = item
    return found
