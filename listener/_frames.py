"""Decoding the publisher's frames: change items (one, or a batch), or an error frame.

The wire shapes are defined in ``changefeed.schemas`` (JSON Schema). Validating
every item with the schema costs ~100 us, which caps a listener near 10,000
items/s; so a frame with exactly the expected shape is decoded directly, and
anything else goes through ``decode_change_frame`` for the validator's precise
message. ``ChangeKind`` values are shared between items.

Pure code. It must never accept a frame the schema refuses.
"""

from __future__ import annotations

from typing import Any

import orjson

from changefeed.schemas import (
    ChangeItem,
    ChangeKind,
    ErrorFrame,
    ProtocolError,
    decode_change_frame,
)

from ._errors import BadPublisherFrame

__all__ = ["decode_frame", "error_frame"]

_KINDS: dict[tuple[Any, ...], ChangeKind] = {}
_KINDS_MAX = 4096  # distinct (resource, sub-resources) pairs remembered


def _kind(doc: Any) -> ChangeKind | None:
    """The ChangeKind of a ``changeKind`` member, shared between items; None if malformed."""
    if type(doc) is not dict:
        return None
    resource = doc.get("resource")
    subs = doc.get("subResources")
    if type(subs) is not list:
        return None
    try:
        key = (resource, *subs)
        kind = _KINDS.get(key)
    except TypeError:  # an unhashable sub-resource: not a string anyway
        return None
    if kind is None:
        if not (type(resource) is str and resource and all(type(s) is str for s in subs)):
            return None
        kind = ChangeKind(resource, tuple(subs))
        if len(_KINDS) < _KINDS_MAX:
            _KINDS[key] = kind
    return kind


def _fast_items(doc: Any) -> list[ChangeItem] | None:
    """Change items from a parsed frame when it has exactly the expected shape, else None
    (the caller then runs the schema validator for a precise error)."""
    docs = doc if type(doc) is list else [doc]
    items: list[ChangeItem] = []
    append = items.append
    for d in docs:
        if type(d) is not dict:
            return None
        kind = _kind(d.get("changeKind"))
        rid = d.get("changedResourceId")
        cursor = d.get("cursor")
        published = d.get("published")
        if (
            kind is None
            or type(rid) is not str
            or not rid
            or type(cursor) is not str
            or not cursor
            or type(published) is not str
        ):
            return None
        append(ChangeItem(kind, rid, cursor, published))
    return items


def error_frame(raw: str | bytes) -> ErrorFrame | None:
    """The publisher's error frame, if ``raw`` is one.

    Raises:
        BadPublisherFrame: it has an ``error`` member but not the error frame's shape.
    """
    if b'"error"' not in (raw.encode() if isinstance(raw, str) else raw)[:32]:
        return None
    try:
        doc = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return None
    if not (isinstance(doc, dict) and "error" in doc):
        return None
    try:
        return ErrorFrame.from_json(doc)
    except ProtocolError as exc:
        raise BadPublisherFrame(f"malformed error frame: {exc.message}") from None


def decode_frame(raw: str | bytes) -> list[ChangeItem] | ErrorFrame:
    """Change items in a frame (one item or a batch), or the publisher's error frame.

    Raises:
        BadPublisherFrame: the frame breaks the wire contract (with the validator's message).
    """
    try:
        doc = orjson.loads(raw)
    except orjson.JSONDecodeError:
        doc = None
    if isinstance(doc, dict) and "error" in doc:
        try:
            return ErrorFrame.from_json(doc)
        except ProtocolError as exc:
            raise BadPublisherFrame(f"malformed error frame: {exc.message}") from None
    items = _fast_items(doc) if doc is not None else None
    if items is not None:
        return items
    try:
        return decode_change_frame(raw)
    except ProtocolError as exc:
        raise BadPublisherFrame(f"bad change frame ({exc.code}): {exc.message}") from None
