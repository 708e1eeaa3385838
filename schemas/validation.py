"""Load the JSON Schema files of the wire protocol and validate documents against them.

Pure code: reads only the schema files shipped in this package.
"""

from __future__ import annotations

import functools
import json
import re
from importlib import resources
from typing import TYPE_CHECKING, Any

import orjson

from .errors import ProtocolError

if TYPE_CHECKING:  # jsonschema is imported on first use: importing the listener is quick
    from jsonschema import Draft202012Validator
    from jsonschema.exceptions import ValidationError

__all__ = [
    "MESSAGE_LIMIT",
    "SCHEMA_NAMES",
    "bounded",
    "load_schema",
    "parse_json",
    "schema_error",
    "validate",
]

MESSAGE_LIMIT = 300
"""Characters of an error message at most: a message repeats the offending input,
and neither an error frame nor a log line may echo 60 KB of it back."""

_QUOTED = re.compile(r"""(['"])([^'"]{40})[^'"]{8,}\1""")

SCHEMA_NAMES = ("registration", "ack", "change_item", "error", "resources", "stats", "page")


@functools.cache
def load_schema(name: str) -> dict[str, Any]:
    """Return the JSON Schema called ``name`` (one of SCHEMA_NAMES)."""
    if name not in SCHEMA_NAMES:
        raise KeyError(name)
    text = resources.files(__package__).joinpath("json", f"{name}.schema.json").read_text()
    schema: dict[str, Any] = json.loads(text)
    return schema


@functools.cache
def _validator(name: str) -> Draft202012Validator:
    from jsonschema import Draft202012Validator

    return Draft202012Validator(load_schema(name))


def parse_json(data: str | bytes, what: str) -> Any:
    """Parse JSON text, mapping every decoding failure to ProtocolError(bad_frame)."""
    try:
        return orjson.loads(data)
    except orjson.JSONDecodeError as exc:
        raise ProtocolError("bad_frame", bounded(f"{what} is not valid JSON: {exc}")) from None


def schema_error(name: str, document: Any) -> ValidationError | None:
    """What ``document`` breaks of schema ``name`` first (None: nothing)."""
    from jsonschema.exceptions import best_match

    error: ValidationError | None = best_match(_validator(name).iter_errors(document))
    return error


def validate(name: str, document: Any, code: str = "bad_frame") -> None:
    """Check ``document`` against schema ``name``.

    Raises:
        ProtocolError: with ``code``, naming the first offending field.
    """
    error = schema_error(name, document)
    if error is None:
        return
    where = "/".join(str(p) for p in error.absolute_path) or "(document)"
    raise ProtocolError(code, bounded(f"{name}: {where}: {error.message}"))


def bounded(message: str) -> str:
    """``message`` with every long quoted value cut to its first 40 characters, and
    the whole cut to ``MESSAGE_LIMIT``."""
    message = _QUOTED.sub(lambda m: f"{m[1]}{m[2]}…{m[1]}", message)
    return message if len(message) <= MESSAGE_LIMIT else message[: MESSAGE_LIMIT - 1] + "…"
