"""Typed models of the wire protocol, with encode / decode / validate.

Shapes follow the websocket contract in docs/design.md (RFD 5 plus ``since``,
``cursor``, ``published``, ``resumed``, ``reason`` and ``batch``) and
node-sdc-changefeed's v2 registration of several resources on one socket. Decoders validate against
the JSON Schema files and raise ProtocolError with a precise message.

``ChangeKind`` and ``ChangeItem`` are msgspec Structs: a listener decodes a
frame of items straight into them (``msgspec.json.Decoder``), with the type
and length checks of the JSON Schema done in C. The Struct annotations carry
those constraints; every other model is a plain dataclass.

Pure code: no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated, Any

import msgspec
import orjson

from .errors import ProtocolError
from .validation import parse_json, validate

__all__ = [
    "RESUME_REASONS",
    "Ack",
    "ChangeItem",
    "ChangeKind",
    "ErrorFrame",
    "Page",
    "Registration",
    "ResourceRoute",
    "decode_change_frame",
    "dumps",
]


RESUME_REASONS: dict[str, str] = {
    "cursor_expired": "older than the feed's low-water mark: the entries after it were trimmed",
    "too_far_behind": "more entries to replay than the publisher's replay_limit",
    "other_feed": "issued by another feed (another database, or a feed created again)",
    "cursor_ahead": "ahead of everything this feed has written (a feed restored from a backup)",
    "unknown_position": "names an entry this feed never held (a feed restored from a backup)",
}
"""The ack's ``reason`` values when a ``since`` was not resumed. In every case the
listener bootstraps; the reason is for logs and operators."""


def dumps(document: Any) -> str:
    """Serialize to compact JSON text."""
    return orjson.dumps(document).decode()


NonEmptyStr = Annotated[str, msgspec.Meta(min_length=1)]
"""A string of at least one character (``minLength: 1`` in the JSON Schema)."""


class ChangeKind(msgspec.Struct, frozen=True, gc=False, rename={"sub_resources": "subResources"}):
    """A resource and the sub-resources of interest (empty: all of them)."""

    resource: NonEmptyStr
    sub_resources: tuple[str, ...] = ()

    def to_json(self) -> dict[str, Any]:
        return {"resource": self.resource, "subResources": list(self.sub_resources)}

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> ChangeKind:
        return cls(doc["resource"], tuple(doc["subResources"]))


@dataclass(frozen=True, slots=True)
class Registration:
    """A listener's first frame.

    ``multi`` marks node-sdc-changefeed's v2 form (``resources``: a list of
    change kinds, answered with ``bootstrapRoutes``); otherwise RFD 5's single
    ``changeKind``.
    """

    instance: str
    service: str
    change_kinds: tuple[ChangeKind, ...]
    since: str | None = None
    batch: bool = False
    multi: bool = False

    def to_json(self) -> dict[str, Any]:
        doc: dict[str, Any] = {"instance": self.instance, "service": self.service}
        if self.multi:
            doc["resources"] = [kind.to_json() for kind in self.change_kinds]
        else:
            doc["changeKind"] = self.change_kinds[0].to_json()
        if self.since is not None:
            doc["since"] = self.since
        if self.batch:
            doc["batch"] = True
        return doc

    def encode(self) -> str:
        return dumps(self.to_json())

    @classmethod
    def decode(cls, data: str | bytes) -> Registration:
        """Parse and validate a registration frame.

        Raises:
            ProtocolError: ``bad_frame`` for non-JSON, ``invalid_registration``
                for a document that breaks the schema.
        """
        doc = parse_json(data, "registration")
        if not isinstance(doc, dict):
            raise ProtocolError("invalid_registration", "registration must be a JSON object")
        validate("registration", doc, code="invalid_registration")
        multi = "resources" in doc
        kinds = doc["resources"] if multi else [doc["changeKind"]]
        return cls(
            instance=doc["instance"],
            service=doc["service"],
            change_kinds=tuple(ChangeKind.from_json(k) for k in kinds),
            since=doc.get("since"),
            batch=doc.get("batch", False),
            multi=multi,
        )


@dataclass(frozen=True, slots=True)
class ResourceRoute:
    """A resource with a change feed, its sub-resources and its bootstrap route."""

    resource: str
    sub_resources: tuple[str, ...]
    bootstrap_route: str

    def to_json(self) -> dict[str, Any]:
        return {
            "resource": self.resource,
            "subResources": list(self.sub_resources),
            "bootstrapRoute": self.bootstrap_route,
        }

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> ResourceRoute:
        return cls(doc["resource"], tuple(doc["subResources"]), doc["bootstrapRoute"])


@dataclass(frozen=True, slots=True)
class Ack:
    """The publisher's answer to a registration."""

    routes: tuple[ResourceRoute, ...]
    cursor: str
    resumed: bool
    batch: bool = False
    multi: bool = False
    reason: str | None = None
    """Why ``since`` was not resumed (one of ``RESUME_REASONS``; None when resumed
    or when the registration gave no ``since``)."""

    @property
    def bootstrap_route(self) -> str:
        return self.routes[0].bootstrap_route

    def to_json(self) -> dict[str, Any]:
        doc: dict[str, Any]
        if self.multi:
            doc = {"bootstrapRoutes": [route.to_json() for route in self.routes]}
        else:
            doc = self.routes[0].to_json()
        doc["cursor"] = self.cursor
        doc["resumed"] = self.resumed
        if self.reason is not None:
            doc["reason"] = self.reason
        if self.batch:
            doc["batch"] = True
        return doc

    def encode(self) -> str:
        return dumps(self.to_json())

    @classmethod
    def decode(cls, data: str | bytes) -> Ack:
        """Parse an ack, or raise ProtocolError (the publisher's error frame
        is raised as ProtocolError with its own code)."""
        doc = parse_json(data, "ack")
        if isinstance(doc, dict) and "error" in doc:
            raise ErrorFrame.from_json(doc).as_exception()
        validate("ack", doc)
        multi = "bootstrapRoutes" in doc
        if multi:
            routes = tuple(ResourceRoute.from_json(r) for r in doc["bootstrapRoutes"])
        else:
            routes = (
                ResourceRoute(
                    doc.get("resource", ""),
                    tuple(doc.get("subResources", ())),
                    doc["bootstrapRoute"],
                ),
            )
        return cls(
            routes,
            doc["cursor"],
            doc["resumed"],
            doc.get("batch", False),
            multi,
            doc.get("reason"),
        )


class ChangeItem(msgspec.Struct, frozen=True, gc=False, rename="camel"):
    """RFD 5's change item plus the feed ``cursor`` and ``published`` time.

    Not tracked by the cyclic garbage collector (``gc=False``: it holds only
    strings and a ChangeKind, so it can be in no cycle): a listener may buffer
    tens of thousands of them, and the collector need not walk them.
    """

    change_kind: ChangeKind
    changed_resource_id: NonEmptyStr
    cursor: NonEmptyStr
    published: str

    def to_json(self) -> dict[str, Any]:
        return {
            "changeKind": self.change_kind.to_json(),
            "changedResourceId": self.changed_resource_id,
            "cursor": self.cursor,
            "published": self.published,
        }

    def encode(self) -> str:
        return dumps(self.to_json())

    @classmethod
    def from_json(cls, doc: Any) -> ChangeItem:
        validate("change_item", doc)
        return cls(
            ChangeKind.from_json(doc["changeKind"]),
            doc["changedResourceId"],
            doc["cursor"],
            doc["published"],
        )


def decode_change_frame(data: str | bytes) -> list[ChangeItem]:
    """Decode a change frame: one item, or a JSON array of items (batch mode).

    Raises:
        ProtocolError: the frame is not JSON or an item breaks the schema; an
            error frame from the publisher is raised with its own code.
    """
    doc = parse_json(data, "change frame")
    if isinstance(doc, list):
        return [ChangeItem.from_json(item) for item in doc]
    if isinstance(doc, dict) and "error" in doc:
        raise ErrorFrame.from_json(doc).as_exception()
    return [ChangeItem.from_json(doc)]


@dataclass(frozen=True, slots=True)
class ErrorFrame:
    """``{"error": {"code", "message"}}``: sent before a 4xxx close, and as HTTP error bodies."""

    code: str
    message: str
    retry_after: float | None = None
    """Seconds after which trying again may succeed (``retryAfter``; with ``unavailable``)."""

    def to_json(self) -> dict[str, Any]:
        error: dict[str, Any] = {"code": self.code, "message": self.message}
        if self.retry_after is not None:
            error["retryAfter"] = self.retry_after
        return {"error": error}

    def encode(self) -> str:
        return dumps(self.to_json())

    @classmethod
    def from_json(cls, doc: Any) -> ErrorFrame:
        validate("error", doc)
        error = doc["error"]
        return cls(error["code"], error["message"], error.get("retryAfter"))

    def as_exception(self) -> ProtocolError:
        return ProtocolError(self.code, self.message, self.retry_after)


@dataclass(frozen=True, slots=True)
class Page:
    """One page of a bootstrap route."""

    items: list[Any] = field(default_factory=list)
    next: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {"items": self.items, "next": self.next}

    @classmethod
    def decode(cls, data: str | bytes) -> Page:
        doc = parse_json(data, "page")
        validate("page", doc)
        return cls(doc["items"], doc["next"])
