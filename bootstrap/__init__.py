"""Bootstrap: keyset-paginated list routes (server) and the pager that walks them (client).

A listener that cannot resume hydrates its mirror by walking the publisher
API's list route while it buffers change items; see docs/bootstrap.md for why
the walk plus the buffered items converge.

Server side::

    vms = KeysetQuery(
        "vms", table="vmapi.vms", key="uuid", parse_id=uuid.UUID,
        token_key=publisher.page_token_key,  # shared by every instance, known to nobody else
    )
    route = BootstrapRoute("/vms", vms, pool, admission=Admission(max_walks=32))
    app = Starlette(routes=[*route.routes(), ...])

Client side::

    async for item in Pager(client, "/vms", limit=500):
        mirror.add(item)
    vm = await fetch_one(client, "/vms", uuid)           # None once deleted
    vms = await fetch_many(client, "/vms", uuids)         # {uuid: item}

Every exception raised here is a ``BootstrapError`` (tree in ``errors``).

The server side's Starlette and asyncpg come with ``changefeed[publisher]``:
``route`` is imported on first use of one of its names, so that a listener-only
install (the pager) needs neither.
"""

import importlib.util
import sys
from typing import TYPE_CHECKING, Any

from changefeed.extras import missing_extra

from .admission import Admission, QuerySlots, WalkTable
from .errors import (
    BootstrapConfigError,
    BootstrapError,
    PageRequestError,
    PageTokenError,
    PagingError,
    TokenKeyUnavailable,
    WalkRefused,
)
from .keyset import BatchRequest, Filter, KeysetQuery, PageRequest, quote_identifier
from .pager import (
    Pager,
    PagerProgress,
    RetryPolicy,
    bearer_headers,
    fetch_many,
    fetch_one,
    fetchable_by_path,
)
from .tokens import PageToken, PageTokenCodec, TokenKey

if TYPE_CHECKING:
    from .route import DB_UNAVAILABLE as DB_UNAVAILABLE
    from .route import BootstrapRoute as BootstrapRoute
    from .route import encode_json as encode_json
    from .route import error_response as error_response
    from .route import unavailable_response as unavailable_response

_PUBLISHER_EXTRA = frozenset({"asyncpg", "starlette"})
"""What the server side imports that a listener-only install lacks."""

_ROUTE_NAMES = frozenset(
    {"DB_UNAVAILABLE", "BootstrapRoute", "encode_json", "error_response", "unavailable_response"}
)

__all__ = [
    "Admission",
    "BatchRequest",
    "BootstrapConfigError",
    "BootstrapError",
    "Filter",
    "KeysetQuery",
    "PageRequest",
    "PageRequestError",
    "PageToken",
    "PageTokenCodec",
    "PageTokenError",
    "Pager",
    "PagerProgress",
    "PagingError",
    "QuerySlots",
    "RetryPolicy",
    "TokenKey",
    "TokenKeyUnavailable",
    "WalkRefused",
    "WalkTable",
    "bearer_headers",
    "fetch_many",
    "fetch_one",
    "fetchable_by_path",
    "quote_identifier",
]


def _installed(module: str) -> bool:
    if module in sys.modules:
        return sys.modules[module] is not None
    return importlib.util.find_spec(module) is not None


if all(_installed(module) for module in _PUBLISHER_EXTRA):
    # A star import takes the server side only where it can be imported.
    __all__.extend(sorted(_ROUTE_NAMES))


def __getattr__(name: str) -> Any:
    if name in _ROUTE_NAMES:
        try:
            from . import route
        except ModuleNotFoundError as exc:
            if (exc.name or "").partition(".")[0] not in _PUBLISHER_EXTRA:
                raise
            # A listener-only install: say what to install.
            what = f"changefeed.bootstrap.{name} (the server side)"
            raise missing_extra(what, "publisher", exc) from exc

        return getattr(route, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
