"""Decoding the publisher's frames: change items (one, or a batch), or an error frame.

The wire shapes are defined in ``changefeed.schemas`` (JSON Schema). A frame
is decoded by msgspec straight into ``ChangeItem`` objects, whose annotations
carry the schema's types and lengths: parsing, checking and building the
items is one pass in C, about what ``orjson.loads`` alone costs. Anything
that pass refuses (an error frame, a frame that breaks the contract) goes
through ``decode_change_frame`` and the JSON Schema validator, for the
publisher's error or the validator's precise message.

Frames may be ``bytes`` (the listener reads text frames undecoded): msgspec
checks the UTF-8 of every string it keeps.

Pure code. It must never accept a frame the schema refuses.
"""

from __future__ import annotations

import msgspec
import orjson

from changefeed.schemas import (
    ChangeItem,
    ErrorFrame,
    ProtocolError,
    decode_change_frame,
)

from ._errors import BadPublisherFrame

__all__ = ["decode_frame", "error_frame"]

_ITEMS = msgspec.json.Decoder(list[ChangeItem] | ChangeItem)


def error_frame(raw: str | bytes) -> ErrorFrame | None:
    """The publisher's error frame, if ``raw`` is one.

    Raises:
        BadPublisherFrame: it has an ``error`` member but not the error frame's shape.
    """
    if b'"error"' not in (raw.encode() if isinstance(raw, str) else raw)[:32]:
        return None
    return _as_error_frame(_json_or_none(raw))


def decode_frame(raw: str | bytes) -> list[ChangeItem] | ErrorFrame:
    """Change items in a frame (one item or a batch), or the publisher's error frame.

    Raises:
        BadPublisherFrame: the frame breaks the wire contract (with the validator's message).
    """
    try:
        decoded = _ITEMS.decode(raw)
    except (msgspec.DecodeError, UnicodeDecodeError):
        return _refused(raw)
    return decoded if isinstance(decoded, list) else [decoded]


def _refused(raw: str | bytes) -> list[ChangeItem] | ErrorFrame:
    """What the fast pass refused: the error frame, or the validator's verdict."""
    error = _as_error_frame(_json_or_none(raw))
    if error is not None:
        return error
    try:
        # The schema is the authority: should it accept what msgspec refused,
        # its items are taken.
        return decode_change_frame(raw)
    except ProtocolError as exc:
        raise BadPublisherFrame(f"bad change frame ({exc.code}): {exc.message}") from None


def _json_or_none(raw: str | bytes) -> object:
    """``raw`` decoded as JSON, None when it is not JSON."""
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError:
        return None


def _as_error_frame(doc: object) -> ErrorFrame | None:
    """``doc`` as the publisher's error frame; None when it is no object with ``error``.

    Raises:
        BadPublisherFrame: it has an ``error`` member but not the error frame's shape.
    """
    if not (isinstance(doc, dict) and "error" in doc):
        return None
    try:
        return ErrorFrame.from_json(doc)
    except ProtocolError as exc:
        raise BadPublisherFrame(f"malformed error frame: {exc.message}") from None
