"""The config reference (docs/config.md), generated from the config model itself.

Every key's type, default, unit and meaning come from its one declaration in
``publisher/config.py``; tests/test_config.py keeps docs/config.md in step.
"""

from __future__ import annotations

import msgspec
import msgspec.inspect as mi

from .config import PublisherConfig, ResourceConfig, ServerConfig
from .config_keys import declared

__all__ = ["config_reference"]


def _type_name(cls: type[msgspec.Struct], name: str) -> str:
    kind, meta = declared(cls)[name]
    if (meta.extra or {}).get("kind"):
        return str((meta.extra or {})["kind"])
    if (meta.extra or {}).get("duration"):
        return "duration"
    if isinstance(kind, mi.VarTupleType):
        return "list of strings"
    if isinstance(kind, mi.DictType):
        return "table of lists of strings"
    if isinstance(kind, mi.UnionType):
        return "string (optional)"
    words = {mi.BoolType: "boolean", mi.IntType: "integer", mi.FloatType: "number"}
    return words.get(type(kind), "string")


def config_reference() -> str:
    """The config reference (docs/config.md), generated from the model itself."""
    lines = [
        "# Configuration reference",
        "",
        "Generated from the config model by",
        "`changefeed.publisher.config_reference.config_reference()`;",
        "tests/test_config.py keeps this file and the model in step.",
        "",
        'Durations are seconds as a number, or a string such as `"500ms"`, `"30s"`, `"10m"`,',
        '`"24h"`, `"7d"`, of at most 100 years (`"36500d"`). Unknown keys and wrong types',
        "are refused with an error naming the file and the key. The same keys built in",
        "Python (`PublisherConfig(...)`, `ServerConfig(...)`; durations as seconds) are",
        "checked the same way, with a `ConfigError` naming the key.",
        "",
    ]
    sections: list[tuple[str, type[msgspec.Struct], set[str]]] = [
        ("[publisher]", PublisherConfig, {"resources"}),
        ("[[resources]]", ResourceConfig, set()),
        ("[server] (only `changefeed serve`)", ServerConfig, set()),
    ]
    for title, cls, skip in sections:
        lines += [
            f"## {title}",
            "",
            "| key | type | default | unit | meaning |",
            "| --- | --- | --- | --- | --- |",
        ]
        for f in msgspec.structs.fields(cls):
            if f.name in skip:
                continue
            meta = declared(cls)[f.name][1]
            if f.default_factory is not msgspec.NODEFAULT:
                default = "(none)"
            elif f.default is msgspec.NODEFAULT:
                default = "required"
            elif f.default in (None, ()):
                default = "(none)"
            elif isinstance(f.default, bool):
                default = f"`{str(f.default).lower()}`"
            else:
                default = f"`{f.default!r}`".replace("'", '"')
            unit = (meta.extra or {}).get("unit", "")
            lines.append(
                f"| `{f.name}` | {_type_name(cls, f.name)} | {default} | {unit} | "
                f"{meta.description or ''} |"
            )
        lines.append("")
    return "\n".join(lines)
