"""msgspec's complaint about a config, in the words a config file's reader knows.

msgspec says ``Expected `int`, got `str` - at `$.queue_size```; the reader of
a TOML file wants ``publisher.queue_size: expected an integer, got 'many'``
with the file's name. ``explained`` turns the one into the other, reading the
key's declared bounds (``config_keys.py``) for a value out of range.
"""

from __future__ import annotations

import re
from typing import Any

import msgspec
import msgspec.inspect as mi

from .config_keys import bound_error, declared
from .errors import ConfigError

__all__ = ["explained"]

_TYPE_WORDS = {
    "int": "an integer",
    "float": "a number",
    "bool": "true or false",
    "str": "a string",
    "str | null": "a string",
    "array": "a list of strings",
    "object": "a table",
}
_FAILURE = re.compile(
    r"^(?P<what>.*?)(?: - at (?P<key>`key` in )?`\$(?P<path>[^`]*)`)?$", re.DOTALL
)
"""msgspec's complaint, and where: ``- at `$.path```, or ``- at `key` in `$.path``` for
a table's key (a config built in Python may have a key that is not a string)."""
_EXPECTED = re.compile(r"^Expected `(?P<type>[^`]+)`(?:, got `[^`]+`| (?P<bound>[<>]=?) .*)$")

_TABLES = "resources"
"""The one key whose value is a list of tables of their own (``[[resources]]``)."""


def _at(doc: Any, path: str) -> Any:
    """The value at a msgspec path (``.queue_size``, ``.resources[0].name``) of ``doc``."""
    for part in re.findall(r"\.(\w+)|\[(\d+)\]", path):
        name, index = part
        try:
            doc = doc[int(index)] if index else doc[name]
        except (KeyError, IndexError, TypeError):
            return None
    return doc


def _key(prefix: str, path: str) -> str:
    """The dotted key of a msgspec path under ``prefix``: ``publisher.queue_size``,
    ``resources[0].name`` (a path into a table of values names the table)."""
    path = path.split("[...]", 1)[0]
    if path.startswith(f".{_TABLES}"):
        return path[1:]
    return f"{prefix}{path}"


def _struct_at(cls: type[msgspec.Struct], key: str) -> type[msgspec.Struct]:
    """The Struct whose keys ``key`` is one of: a ``[[resources]]`` table's, or ``cls``'s."""
    if key.startswith(f"{_TABLES}[") and _TABLES in declared(cls):
        tables = declared(cls)[_TABLES][0]
        if isinstance(tables, mi.VarTupleType) and isinstance(tables.item_type, mi.StructType):
            return tables.item_type.cls
    return cls


def known_keys(cls: type[msgspec.Struct]) -> str:
    """The keys a table of ``cls`` may hold, for an 'unknown key' error."""
    return ", ".join(sorted(n for n in declared(cls) if n != _TABLES))


def explained(
    exc: msgspec.ValidationError,
    doc: Any,
    *,
    under: str,
    cls: type[msgspec.Struct],
    prefix: str,
    source: str | None,
) -> ConfigError:
    """msgspec's complaint about ``doc`` (found at the msgspec path ``under`` of a
    ``cls``) as a ``ConfigError`` naming the key, in the words a file's reader knows."""
    failure = _FAILURE.match(str(exc))
    assert failure is not None
    what, inner = failure.group("what"), failure.group("path") or ""
    path = under + inner
    key = _key(prefix, path)
    struct = _struct_at(cls, key)
    if unknown := re.match(r"Object contains unknown field `(.+)`", what, re.DOTALL):
        name = unknown.group(1)
        shown = name if re.fullmatch(r"[\w-]+", name) else repr(name)  # one line, whatever
        return ConfigError(f"{key}.{shown}", f"unknown key (known: {known_keys(struct)})", source)
    if missing := re.match(r"Object missing required field `(\w+)`", what):
        return ConfigError(f"{key}.{missing.group(1)}", "is required", source)
    value = _at(doc, inner)
    expected = _EXPECTED.match(what)
    if expected is not None and expected.group("bound"):
        name = key.rsplit(".", 1)[-1]
        problem = bound_error(declared(struct)[name][1], value)
        return ConfigError(key, problem or what, source)
    if failure.group("key"):
        example = ' such as {"<token>" = ["vm"]}' if "token" in key else ""
        return ConfigError(key, f"expected a table{example}: its keys must be strings", source)
    if expected is not None:
        words = _TYPE_WORDS.get(expected.group("type"), f"`{expected.group('type')}`")
        if "[...]" in path or expected.group("type") == "object":
            words = 'a table such as {"<token>" = ["vm"]}' if "token" in key else words
        if key == _TABLES:
            words = "a list of [[resources]] tables"
        # Under a table's keys ([...]) msgspec does not say which key: no value to show.
        got = "" if "[...]" in inner else f", got {value!r}"
        return ConfigError(key, f"expected {words}{got}", source)
    return ConfigError(key, what, source)
