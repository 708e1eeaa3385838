"""Keyset pagination of one table or query: the SQL, and what a request asks for.

``KeysetQuery`` turns a source (a table, or a configured ``SELECT``) with a
unique, immutable sort key into three statements: a page after a key, a batch
of ids, and one id. It also parses a request's query string into a
``PageRequest`` or ``BatchRequest`` and builds the ``next`` link. The
Starlette adapter (``route.BootstrapRoute``) runs the statements.

Pagination is by key, never OFFSET: a page is ``WHERE key > $last ORDER BY key
LIMIT n``, served by the key's index, so page 1,000 costs what page 1 costs
and a walk neither repeats nor skips rows that exist throughout it
(docs/bootstrap.md has the argument).

Pure code: no I/O. It must never put a request's value into SQL text: request
values are always bind parameters. Only configured identifiers (table, columns)
are formatted into SQL, and only after they pass a strict pattern.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol
from urllib.parse import urlencode

from .errors import BootstrapConfigError, PageRequestError
from .tokens import PageTokenCodec, SortKey, TokenKey

__all__ = [
    "BatchRequest",
    "Filter",
    "KeysetQuery",
    "PageRequest",
    "Row",
    "quote_identifier",
]


class Row(Protocol):
    """A result row: an asyncpg Record or a mapping, indexed by column name."""

    def __getitem__(self, key: str, /) -> Any: ...


_IDENTIFIER = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,62}$")
_LIMIT = re.compile(r"^[0-9]{1,9}$")
_RESERVED = frozenset({"limit", "after", "ids"})


def quote_identifier(name: str) -> str:
    """Quote a configured SQL identifier, optionally schema-qualified (``vmapi.vms``).

    Raises:
        BootstrapConfigError: a part is not a plain identifier (letters, digits,
            underscores; at most 63 characters).
    """
    parts = name.split(".")
    if len(parts) > 2 or not all(_IDENTIFIER.match(p) for p in parts):
        raise BootstrapConfigError(
            f"identifier {name!r} must be [schema.]name with each part matching "
            f"{_IDENTIFIER.pattern}"
        )
    return ".".join(f'"{p}"' for p in parts)


@dataclass(frozen=True, slots=True)
class Filter:
    """An equality filter a list route accepts as a query parameter.

    Args:
        column: the column compared (a configured identifier).
        parse: turns the parameter's text into the value bound to the query;
            ``ValueError`` or ``TypeError`` becomes a 400 naming the parameter.
            Without one (``str``) the column is compared as text
            (``column::text = $n``), whatever its type: exact text, so a number
            or uuid column takes its canonical spelling only, and its index
            serves only a text column. Give ``parse`` (``int``, ``uuid.UUID``)
            to compare a column of another type as that type.
    """

    column: str
    parse: Callable[[str], Any] = str


@dataclass(frozen=True, slots=True)
class PageRequest:
    """``GET <route>?limit=N[&after=<token>][&<filter>=<value>...]``.

    ``walk``, ``after`` and ``issued`` are None on a walk's first page.
    """

    limit: int
    walk: str | None = None
    after: SortKey | None = None
    filters: tuple[tuple[str, Any], ...] = ()
    filter_text: tuple[tuple[str, str], ...] = ()
    issued: int | None = None
    """When the ``after`` token was issued (``PageToken.issued``)."""


@dataclass(frozen=True, slots=True)
class BatchRequest:
    """``GET <route>?ids=a,b,c[&<filter>=<value>...]``: the items found among ``ids``."""

    ids: tuple[Any, ...]
    filters: tuple[tuple[str, Any], ...] = ()


class KeysetQuery:
    """The statements and request parsing of one keyset-paginated source.

    Exactly one of ``table`` and ``query`` is given.

    Args:
        name: the route's name; scopes its page tokens (e.g. ``"vms"``).
        table: a table or view, ``[schema.]name``.
        query: a configured ``SELECT`` to paginate instead of a table (never
            request text); it becomes ``(query) AS source``.
        key: the sort-key column(s): unique, NOT NULL, never updated, and
            indexed in this order (a primary key is ideal).
        columns: the columns each item has; None selects ``*``.
        filters: query parameter name → Filter (or a column name, compared as text).
        id_column: the column ``?ids=`` and the per-id route look up; default:
            the key, when it is one column.
        parse_id: turns an id's text into the value bound for ``id_column``.
        default_limit: page size when the request names none.
        max_limit: larger ``limit`` values are clamped to this (not refused).
        max_ids: most ids one ``?ids=`` request may name.
        token_key: digest key of page tokens, shared by every process serving the route.

    Raises:
        BootstrapConfigError: an identifier, filter name or limit is unusable.
    """

    def __init__(
        self,
        name: str,
        *,
        table: str | None = None,
        query: str | None = None,
        key: str | Sequence[str],
        columns: Sequence[str] | None = None,
        filters: Mapping[str, Filter | str] | None = None,
        id_column: str | None = None,
        parse_id: Callable[[str], Any] = str,
        default_limit: int = 100,
        max_limit: int = 5000,
        max_ids: int = 100,
        token_key: TokenKey | None = None,
    ) -> None:
        if (table is None) == (query is None):
            raise BootstrapConfigError("give exactly one of table= and query=")
        if not 1 <= default_limit <= max_limit:
            raise BootstrapConfigError(
                f"need 1 <= default_limit ({default_limit}) <= max_limit ({max_limit})"
            )
        if max_ids < 1:
            raise BootstrapConfigError(f"max_ids must be positive, got {max_ids}")
        self.name = name
        self.key: tuple[str, ...] = (key,) if isinstance(key, str) else tuple(key)
        if not self.key:
            raise BootstrapConfigError("key needs at least one column")
        quoted_key = [quote_identifier(k) for k in self.key]
        if any("." in k for k in self.key):
            raise BootstrapConfigError(f"key columns must be unqualified names: {self.key!r}")
        self.filters: dict[str, Filter] = {}
        for param, given in (filters or {}).items():
            if param in _RESERVED or not _IDENTIFIER.match(param):
                raise BootstrapConfigError(f"filter parameter name {param!r} is not usable")
            spec = Filter(given) if isinstance(given, str) else given
            quote_identifier(spec.column)
            self.filters[param] = spec
        if id_column is None:
            id_column = self.key[0] if len(self.key) == 1 else None
        self.id_column = id_column
        self.parse_id = parse_id
        self.default_limit = default_limit
        self.max_limit = max_limit
        self.max_ids = max_ids
        self.tokens = PageTokenCodec(name, token_key, len(self.key))

        if table is not None:
            self._source = f"{quote_identifier(table)} AS source"
        else:
            assert query is not None
            self._source = f"({query.rstrip().rstrip(';')}) AS source"
        if columns is None:
            self._columns = "*"
        else:
            self._columns = ", ".join(quote_identifier(c) for c in columns)
            missing = [k for k in self.key if k not in columns]
            if missing:
                raise BootstrapConfigError(f"columns must include the sort key, missing {missing}")
        self._order = ", ".join(quoted_key)
        self._key_tuple = quoted_key[0] if len(quoted_key) == 1 else f"({self._order})"
        self._pages: dict[tuple[tuple[str, ...], bool], str] = {}

    # -- SQL -------------------------------------------------------------------

    def _where(self, filter_names: Iterable[str], first_param: int) -> list[str]:
        conditions = []
        for i, name in enumerate(filter_names):
            spec = self.filters[name]
            column = quote_identifier(spec.column)
            # A filter without a parser compares as text, whatever the column's type
            # (on a text column the cast is nothing, and its index still serves).
            compared = f"{column}::text" if spec.parse is str else column
            conditions.append(f"{compared} = ${first_param + i}")
        return conditions

    def page_sql(self, filter_names: tuple[str, ...], after: bool) -> str:
        """The page statement: parameters are the filters' values (in the order of
        ``filter_names``), then the ``after`` key's values when ``after``, then the
        row limit."""
        cache_key = (filter_names, after)
        sql = self._pages.get(cache_key)
        if sql is None:
            conditions = self._where(filter_names, 1)
            n = len(filter_names) + 1
            if after:
                params = [f"${n + i}" for i in range(len(self.key))]
                bound = params[0] if len(params) == 1 else f"({', '.join(params)})"
                conditions.append(f"{self._key_tuple} > {bound}")
                n += len(self.key)
            where = f" WHERE {' AND '.join(conditions)}" if conditions else ""
            sql = (
                f"SELECT {self._columns} FROM {self._source}{where}"
                f" ORDER BY {self._order} LIMIT ${n}"
            )
            self._pages[cache_key] = sql
        return sql

    def page_statement(self, request: PageRequest) -> tuple[str, list[Any]]:
        """SQL and arguments for ``request``; fetches one row more than the limit,
        so that a full last page is known to be the last without another query."""
        names = tuple(name for name, _ in request.filters)
        args = [value for _, value in request.filters]
        if request.after is not None:
            args.extend(request.after)
        args.append(request.limit + 1)
        return self.page_sql(names, request.after is not None), args

    def batch_statement(self, request: BatchRequest) -> tuple[str, list[Any]]:
        """SQL and arguments for ``?ids=``: the items found, in key order."""
        id_column = self._require_id_column()
        names = tuple(name for name, _ in request.filters)
        conditions = self._where(names, 1)
        conditions.append(f"{quote_identifier(id_column)} = ANY(${len(names) + 1})")
        sql = (
            f"SELECT {self._columns} FROM {self._source} WHERE {' AND '.join(conditions)}"
            f" ORDER BY {self._order}"
        )
        return sql, [*(value for _, value in request.filters), list(request.ids)]

    def item_statement(self) -> str:
        """SQL of the per-id route: one parameter, the parsed id."""
        id_column = self._require_id_column()
        return (
            f"SELECT {self._columns} FROM {self._source}"
            f" WHERE {quote_identifier(id_column)} = $1 LIMIT 1"
        )

    def _require_id_column(self) -> str:
        if self.id_column is None:
            raise BootstrapConfigError(
                f"route {self.name!r} has a composite key: configure id_column for ids/per-id"
            )
        return self.id_column

    # -- requests --------------------------------------------------------------

    def parse_id_text(self, text: str) -> Any:
        """Parse one id (a path parameter or an ``ids`` element).

        Raises:
            PageRequestError: ``parse_id`` refused it.
        """
        if "\x00" in text:
            raise PageRequestError("an id must not contain the NUL character (U+0000)")
        try:
            return self.parse_id(text)
        except (ValueError, TypeError):
            raise PageRequestError(f"{text!r} is not a valid id") from None

    def parse_request(self, params: Iterable[tuple[str, str]]) -> PageRequest | BatchRequest:
        """Parse a list route's query string (as ``(name, value)`` pairs).

        Raises:
            PageRequestError: a parameter is unknown, repeated or malformed.
        """
        seen: dict[str, str] = {}
        for name, value in params:
            if name in seen:
                raise PageRequestError(f"{name}: given more than once")
            if "\x00" in value:
                # PostgreSQL text cannot hold U+0000: the query would fail with a 500.
                raise PageRequestError(f"{name}: must not contain the NUL character (U+0000)")
            if name not in _RESERVED and name not in self.filters:
                known = ", ".join(["limit", "after", "ids", *sorted(self.filters)])
                raise PageRequestError(f"unknown query parameter {name!r} (known: {known})")
            seen[name] = value
        filter_text = tuple((name, seen[name]) for name in self.filters if name in seen)
        filters = []
        for name, text in filter_text:
            try:
                filters.append((name, self.filters[name].parse(text)))
            except (ValueError, TypeError):
                raise PageRequestError(f"{name}: {text!r} is not a valid value") from None
        if "ids" in seen:
            if "after" in seen:
                raise PageRequestError("ids and after cannot be combined")
            return BatchRequest(self._parse_ids(seen["ids"]), tuple(filters))
        limit = self._parse_limit(seen.get("limit"))
        if "after" in seen:
            token = self.tokens.decode(seen["after"])
            return PageRequest(
                limit, token.walk, token.key, tuple(filters), filter_text, token.issued
            )
        return PageRequest(limit, None, None, tuple(filters), filter_text)

    def _parse_limit(self, text: str | None) -> int:
        if text is None:
            return self.default_limit
        if not _LIMIT.match(text) or int(text) < 1:
            raise PageRequestError(
                f"limit: expected a positive integer of at most 9 digits (above "
                f"{self.max_limit}, pages have {self.max_limit} items), got {text!r}"
            )
        return min(int(text), self.max_limit)

    def _parse_ids(self, text: str) -> tuple[Any, ...]:
        self._require_id_column()
        texts = text.split(",")
        if not text or any(not t for t in texts):
            raise PageRequestError("ids: expected a comma-separated list of ids, without empties")
        if len(texts) > self.max_ids:
            raise PageRequestError(f"ids: at most {self.max_ids} ids per request, got {len(texts)}")
        ids = []
        for t in dict.fromkeys(texts):
            try:
                ids.append(self.parse_id(t))
            except (ValueError, TypeError):
                raise PageRequestError(f"ids: {t!r} is not a valid id") from None
        return tuple(ids)

    # -- responses -------------------------------------------------------------

    def sort_key(self, row: Row) -> SortKey:
        """The sort key of a result row."""
        return tuple(row[k] for k in self.key)

    def next_link(self, path: str, request: PageRequest, walk: str, last: SortKey) -> str:
        """The ``next`` of a page: same path, the effective limit, the token after
        ``last``, and the request's filters."""
        pairs = [("limit", str(request.limit)), ("after", self.tokens.encode(walk, last))]
        pairs.extend(request.filter_text)
        return f"{path}?{urlencode(pairs)}"
