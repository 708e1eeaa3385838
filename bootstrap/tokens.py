"""Opaque, tamper-checked page tokens: the ``after`` of a keyset-paginated route.

A token carries the walk's id (admission control counts walks by it), the
second it was issued (wall clock: a continuation whose walk every process has
long forgotten is admitted as a new walk, so that hoarded tokens never open
walks past the cap) and the sort key of the last item of the previous page. It
is the JSON of these, prefixed with a version byte and followed by a keyed
digest, base64url-encoded without padding, so it travels in a query string as
it is. Tokens of the first version, which carried no time, are still read (as
issued long ago). The digest covers a
*scope* (the route's name) as well, so a token of one route is refused by
another. The key is never a known one: every process serving the route must
share it (``Publisher.page_token_key`` derives one from the feed's own secret
cursor key, the same on every instance); without one a codec makes a random
key, which only its own process accepts.

Key values may be ``int``, ``str``, ``uuid.UUID`` or an aware or naive
``datetime``; each is tagged with its type so that it decodes to the same
Python value and binds to the same SQL type.

Pure code: no I/O. It must never trust a token's content before its digest
has been checked, and never accept two spellings of one token.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import secrets
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import orjson

from .errors import BootstrapConfigError, PageTokenError

__all__ = ["MAX_TOKEN_LENGTH", "PageToken", "PageTokenCodec", "SortKey", "TokenKey"]

TokenKey = bytes | Callable[[], bytes]
"""A digest key, or what gives it once it is known (``Publisher.page_token_key``:
called for each token, it raises ``TokenKeyUnavailable`` until its publisher has
read the feed)."""

MAX_TOKEN_LENGTH = 2048
"""Longer ``after`` values are refused before any decoding."""

_VERSION = b"\x02"
_UNTIMED = b"\x01"
"""The first version: ``[walk, key...]``, without the second it was issued."""
_DIGEST_SIZE = 10

SortKey = tuple[Any, ...]
"""The values of a row's sort-key columns, in key order."""


@dataclass(frozen=True, slots=True)
class PageToken:
    """What an ``after`` token says: which walk, and the last sort key it saw."""

    walk: str
    key: SortKey
    issued: int | None = None
    """The wall-clock second (Unix time) it was issued; None for a token of the
    first version, which did not say."""


def _tag(value: Any) -> list[Any]:
    # bool is an int subclass; refusing it keeps "1" and True from colliding.
    if isinstance(value, bool):
        raise BootstrapConfigError(f"sort key value {value!r}: bool is not a supported key type")
    if isinstance(value, int):
        return ["i", value]
    if isinstance(value, str):
        return ["s", value]
    if isinstance(value, uuid.UUID):
        return ["u", value.hex]
    if isinstance(value, datetime):
        return ["t", value.isoformat()]
    raise BootstrapConfigError(
        f"sort key value of type {type(value).__name__} is not supported "
        "(use int, str, uuid or datetime columns)"
    )


def _untag(pair: Any) -> Any:
    if not (isinstance(pair, list) and len(pair) == 2 and isinstance(pair[0], str)):
        raise ValueError("malformed key value")
    tag, raw = pair
    if tag == "i" and isinstance(raw, int) and not isinstance(raw, bool):
        return raw
    if tag == "s" and isinstance(raw, str):
        return raw
    if tag == "u" and isinstance(raw, str):
        return uuid.UUID(hex=raw)
    if tag == "t" and isinstance(raw, str):
        return datetime.fromisoformat(raw)
    raise ValueError(f"unknown key value tag {tag!r}")


class PageTokenCodec:
    """Encodes page tokens for one route and checks them on the way back.

    Args:
        scope: what the tokens are for, usually the route's name; a token is
            valid only for the scope it was issued in.
        key: digest key, or what gives it (``TokenKey``); every process serving
            the route must use the same one. None: a random key of this codec's
            own, for a route one process serves.
        key_length: number of sort-key columns a token must carry.
        clock: wall-clock seconds, for the time a token is issued (tests inject one).
    """

    def __init__(
        self,
        scope: str,
        key: TokenKey | None = None,
        key_length: int = 1,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if key_length < 1:
            raise BootstrapConfigError("a sort key needs at least one column")
        self._scope = scope.encode()
        self._key: TokenKey = secrets.token_bytes(32) if key is None else key
        self._key_length = key_length
        self._clock = clock

    def _digest(self, body: bytes) -> bytes:
        key = self._key if isinstance(self._key, bytes) else self._key()
        mac = hmac.new(key, digestmod=hashlib.blake2b)
        mac.update(len(self._scope).to_bytes(2, "big"))
        mac.update(self._scope)
        mac.update(body)
        return mac.digest()[:_DIGEST_SIZE]

    def encode(self, walk: str, key: Sequence[Any]) -> str:
        """Return the token for the page after ``key`` in walk ``walk``.

        Raises:
            BootstrapConfigError: a key value has a type tokens cannot carry, the
                key has the wrong number of columns, or the token would be longer
                than ``MAX_TOKEN_LENGTH`` (which ``decode`` refuses).
            TokenKeyUnavailable: the digest key is not known yet.
        """
        if len(key) != self._key_length:
            raise BootstrapConfigError(
                f"sort key has {len(key)} values, the route's key has {self._key_length} columns"
            )
        issued = int(self._clock())
        body = _VERSION + orjson.dumps([walk, issued, *(_tag(v) for v in key)])
        raw = body + self._digest(body)
        token = base64.urlsafe_b64encode(raw).rstrip(b"=").decode("ascii")
        if len(token) > MAX_TOKEN_LENGTH:
            # Issuing it would only have the walk's next request refused (400).
            raise BootstrapConfigError(
                f"a sort key of {len(orjson.dumps([_tag(v) for v in key]))} bytes of JSON"
                f" makes a page token of {len(token)} characters, over the"
                f" {MAX_TOKEN_LENGTH} a route accepts: sort by shorter columns"
            )
        return token

    def decode(self, token: str) -> PageToken:
        """Return what ``token`` says.

        Raises:
            PageTokenError: the token is too long, not base64url, not canonical,
                of an unknown version, not issued for this scope and key, or
                its content is malformed.
            TokenKeyUnavailable: the digest key is not known yet.
        """
        if not token or len(token) > MAX_TOKEN_LENGTH:
            raise PageTokenError(
                f"after: page token must be 1 to {MAX_TOKEN_LENGTH} characters long"
            )
        try:
            raw = base64.urlsafe_b64decode(token + "=" * (-len(token) % 4))
        except (binascii.Error, ValueError):
            raise PageTokenError("after: page token is not one this route issued") from None
        if base64.urlsafe_b64encode(raw).rstrip(b"=").decode("ascii") != token:
            # Trailing bits that decoding ignores would give one token several spellings.
            raise PageTokenError("after: page token is not one this route issued (not canonical)")
        if len(raw) <= len(_VERSION) + _DIGEST_SIZE or raw[:1] not in (_VERSION, _UNTIMED):
            raise PageTokenError("after: page token is not one this route issued (bad version)")
        body, digest = raw[:-_DIGEST_SIZE], raw[-_DIGEST_SIZE:]
        if not hmac.compare_digest(digest, self._digest(body)):
            raise PageTokenError(
                "after: page token is not one this route issued (checksum mismatch; every"
                " process serving a route must share its token_key)"
            )
        timed = body[:1] == _VERSION
        try:
            doc = orjson.loads(body[1:])
            head = 2 if timed else 1
            if not (isinstance(doc, list) and len(doc) == self._key_length + head):
                raise ValueError("wrong number of key values")
            walk = doc[0]
            if not isinstance(walk, str):
                raise ValueError("walk id is not a string")
            issued = doc[1] if timed else None
            if timed and (not isinstance(issued, int) or isinstance(issued, bool)):
                raise ValueError("issue time is not an integer")
            key = tuple(_untag(pair) for pair in doc[head:])
        except ValueError as exc:
            # Only reachable with the right key: a bug or a key reused across route shapes.
            raise PageTokenError(f"after: page token is malformed ({exc})") from None
        return PageToken(walk, key, issued)
