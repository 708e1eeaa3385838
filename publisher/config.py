"""Publisher configuration: a typed model, loaded from TOML and/or built in Python.

Every key carries its documentation, unit and default in the model itself
(``field(metadata=...)``), so the config reference in docs/ is generated from
it and a bad value is refused with an error that names the key and the file.

TOML layout::

    [publisher]
    dsn = "postgresql://app@db/app"
    max_age = "24h"

    [[resources]]
    name = "vm"
    sub_resources = ["nic", "alias"]
    bootstrap_route = "/vms"
"""

from __future__ import annotations

import dataclasses
import re
import tomllib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from changefeed.schemas import ProtocolError, quote_schema
from changefeed.tcp_liveness import NOTSENT_LOWAT

from .errors import ConfigError

__all__ = [
    "PublisherConfig",
    "ResourceConfig",
    "ServerConfig",
    "config_from_dict",
    "config_reference",
    "load_config",
    "load_service_config",
    "parse_duration",
    "server_config_from_dict",
]

_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h|d)?\s*$")
_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, None: 1.0}
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.:-]{0,63}$")


def parse_duration(value: Any, key: str = "duration", source: str | None = None) -> float:
    """Seconds from a number or a string: ``"500ms"``, ``"30s"``, ``"10m"``, ``"24h"``, ``"7d"``."""
    if isinstance(value, bool):
        raise ConfigError(key, f"expected a duration, got {value!r}", source)
    if isinstance(value, int | float):
        seconds = float(value)
    elif isinstance(value, str) and (match := _DURATION.match(value)):
        seconds = float(match.group(1)) * _UNITS[match.group(2)]
    else:
        raise ConfigError(
            key, f'expected a duration such as 30, "500ms", "10m" or "24h", got {value!r}', source
        )
    if seconds < 0:
        raise ConfigError(key, f"must not be negative, got {value!r}", source)
    return seconds


def _doc(text: str, unit: str = "", kind: str = "") -> dict[str, str]:
    """A key's documentation; ``kind`` names its type in the reference when the
    type hint alone would mislead (a key the model leaves None until checked)."""
    return {"doc": text, "unit": unit, "kind": kind}


@dataclass(frozen=True, slots=True)
class ResourceConfig:
    """A resource with a change feed (one ``[[resources]]`` table)."""

    name: str = field(metadata=_doc("Resource name listeners register for, e.g. `vm`."))
    bootstrap_route: str = field(
        metadata=_doc(
            "Keyset-paginated list route listeners hydrate from: a path on this API "
            "(`/vms`) or an absolute URL on the API that owns the resource."
        )
    )
    sub_resources: tuple[str, ...] = field(
        default=(), metadata=_doc('Sub-resources a change may name, e.g. `["nic", "alias"]`.')
    )


@dataclass(frozen=True, slots=True)
class PublisherConfig:
    """Everything a publisher needs (the ``[publisher]`` table plus ``[[resources]]``)."""

    resources: tuple[ResourceConfig, ...] = field(
        default=(), metadata=_doc("The resources this publisher has change feeds for.")
    )
    dsn: str | None = field(
        default=None,
        metadata=_doc(
            "PostgreSQL DSN of the feed database. Required, even with a pool: the tailer "
            "opens its own connection (LISTEN); an embedding API's pool serves the other queries.",
            kind="string",
        ),
    )
    read_dsn: str | None = field(
        default=None,
        metadata=_doc(
            "PostgreSQL DSN of a hot standby of `dsn` to read the feed from: tailing, "
            "catch-up pages and resume checks go there, and `dsn` (the primary) keeps only "
            "the doorbell (LISTEN), schema changes, retention and the writers' age. None: "
            'everything reads `dsn` (docs/design.md, "Reading from a standby").',
            kind="string",
        ),
    )
    standby_wait: float = field(
        default=5.0,
        metadata=_doc(
            "With `read_dsn`: how long a registration whose cursor the standby has not "
            "replayed yet (a fresher publisher issued it) is held while the standby catches "
            "up; after that it is answered `unavailable` (4010) with `retryAfter`, never "
            "`resumed: false`. Keep it below the listeners' wait for an ack "
            "(changefeed.listener's `ack_timeout`: 10 s).",
            "seconds",
        ),
    )
    schema: str = field(default="changefeed", metadata=_doc("Schema holding the feed table."))
    create_schema: bool = field(
        default=True, metadata=_doc("Create or upgrade the feed schema at start-up.")
    )
    max_age: float = field(
        default=86400.0,
        metadata=_doc("RFD 5 max age: entries older than this are trimmed.", "seconds"),
    )
    retention: bool = field(
        default=True,
        metadata=_doc(
            "Trim entries older than max_age inline. Turn off when the Spark job does it."
        ),
    )
    retention_interval: float = field(
        default=60.0, metadata=_doc("How often inline retention runs.", "seconds")
    )
    poll_interval: float = field(
        default=0.5,
        metadata=_doc(
            "Tailer poll when no doorbell (NOTIFY) rings; bounds latency if one is lost.", "seconds"
        ),
    )
    tail_batch: int = field(
        default=1000, metadata=_doc("Entries read per tailer query.", "entries")
    )
    queue_size: int = field(
        default=4096,
        metadata=_doc(
            "Items queued for one live listener at most. A listener whose queue cannot take "
            "the next batch is not evicted: it catches up from the window or the feed table, "
            "at its own pace (docs/fanout.md).",
            "items",
        ),
    )
    window_bytes: int = field(
        default=64 << 20,
        metadata=_doc(
            "Memory for the window of recently tailed entries that listeners catch up from, "
            "shared by all of them (a quarter as much again for pages of the feed table read "
            "for listeners further behind).",
            "bytes",
        ),
    )
    window_max_age: float = field(
        default=300.0,
        metadata=_doc(
            "Entries older than this (by their published time) leave the window of recent "
            "entries; listeners further behind read the feed table. With the Spark job, keep "
            "it below its `compaction_lag` (10 minutes by default): no copy in memory may be "
            "older than what the job changes in the table (docs/compaction.md).",
            "seconds",
        ),
    )
    stall_timeout: float = field(
        default=60.0,
        metadata=_doc(
            "A listener that has items to take and takes nothing at all for this long is "
            "evicted (4009). A listener that reads, however slowly, never is.",
            "seconds",
        ),
    )
    max_batch: int = field(
        default=256,
        metadata=_doc("Items per frame for listeners that registered with batch.", "items"),
    )
    send_interval: float = field(
        default=0.002,
        metadata=_doc(
            "Longest wait between two flushes of the listeners' send queues. A flush may "
            "start once three times the previous one's cost has passed since it started: "
            "with few listeners a change goes out at once; with many, changes read "
            "meanwhile go out together (one batch frame per listener), and flushing takes "
            "at most a third of the time. 0: every tailer read at once (docs/fanout.md).",
            "seconds",
        ),
    )
    max_frame_bytes: int = field(
        default=65536, metadata=_doc("Largest frame accepted from a listener.", "bytes")
    )
    registration_timeout: float = field(
        default=10.0,
        metadata=_doc("A connection that sends no registration by then is closed.", "seconds"),
    )
    close_timeout: float = field(
        default=10.0,
        metadata=_doc(
            "How long the publisher waits to hand a closing listener its error and close "
            "frames (an evicted listener may not be reading) before it lets the connection go.",
            "seconds",
        ),
    )
    max_registrations: int = field(
        default=32, metadata=_doc("Registrations (change kinds) allowed on one connection.")
    )
    max_connections: int = field(
        default=10000, metadata=_doc("Listener connections one publisher process accepts.")
    )
    replay_limit: int = field(
        default=1000000,
        metadata=_doc(
            "A resume more entries behind than this (estimated from entry identities) is "
            "answered resumed=false (reason too_far_behind): bootstrapping is then cheaper.",
            "entries",
        ),
    )
    db_retry_budget: float = field(
        default=30.0,
        metadata=_doc(
            "After this long without the database the publisher reports itself unavailable "
            "(it keeps retrying).",
            "seconds",
        ),
    )
    cursor_key: str | None = field(
        default=None,
        metadata=_doc(
            "Key of the cursors' digest. By default the key made with the feed and kept in "
            "its database (every instance reads it there, and nobody else knows it); set "
            "one only to manage it yourself, at least 16 characters, the same on every "
            "instance of one feed."
        ),
    )
    auth_tokens: tuple[str, ...] = field(
        default=(),
        metadata=_doc(
            "Bearer tokens accepted on /changefeeds, /changefeeds/stats and bootstrap routes, "
            "each allowed to read every resource; `sha256:<hex>` gives a token by its SHA-256. "
            "No tokens here or in token_resources: no auth (docs/security.md)."
        ),
    )
    token_resources: dict[str, tuple[str, ...]] = field(
        default_factory=dict,
        metadata=_doc(
            'Bearer tokens allowed to read only some resources: `{"<token>" = ["vm"]}` '
            '(a `[publisher.token_resources]` table; keys may be `"sha256:<hex>"`). '
            "Other resources are refused with `forbidden` (close code 4004)."
        ),
    )

    def __post_init__(self) -> None:
        _check(self, source=None)

    def resource(self, name: str) -> ResourceConfig | None:
        """The configured resource called ``name``, if any."""
        for resource in self.resources:
            if resource.name == name:
                return resource
        return None


@dataclass(frozen=True, slots=True)
class ServerConfig:
    """How ``changefeed serve`` listens (the ``[server]`` table)."""

    host: str = field(default="127.0.0.1", metadata=_doc("Address to listen on."))
    port: int = field(default=8080, metadata=_doc("TCP port to listen on."))
    ping_interval: float = field(
        default=20.0,
        metadata=_doc(
            "Websocket ping interval; keep load balancer idle timeouts above it.", "seconds"
        ),
    )
    ping_timeout: float = field(
        default=20.0,
        metadata=_doc(
            "A listener that neither answers a ping within this nor makes progress meanwhile "
            "(takes more of what was sent, or sends anything) is evicted (`keepalive_timeout`).",
            "seconds",
        ),
    )
    notsent_lowat: int = field(
        default=NOTSENT_LOWAT,
        metadata=_doc(
            "Bytes the kernel may hold unsent for each connection (TCP_NOTSENT_LOWAT); the "
            "rest waits in the publisher, so that a ping or a pong to a listener catching up "
            "waits behind little more than the listener's own receive buffer. 0: the host's "
            "setting (`net.ipv4.tcp_notsent_lowat`, unlimited by default).",
            "bytes",
        ),
    )
    drain_grace: float = field(
        default=5.0,
        metadata=_doc(
            "On SIGTERM, time allowed for listeners to be closed with 1001 before exit.", "seconds"
        ),
    )
    header_timeout: float = field(
        default=15.0,
        metadata=_doc(
            "An HTTP connection whose request line and headers have not all arrived this long "
            "after it was accepted (or after its previous response) is closed, with 408 if it "
            "sent part of them; so is one whose request body stops arriving for this long. "
            "Websockets, once upgraded, are not affected.",
            "seconds",
        ),
    )

    def __post_init__(self) -> None:
        if not 0 < self.port < 65536:
            raise ConfigError("server.port", f"must be 1-65535, got {self.port}")
        for key in ("header_timeout", "ping_interval", "ping_timeout"):
            if not getattr(self, key) > 0:
                raise ConfigError(f"server.{key}", f"must be positive, got {getattr(self, key)}")
        if not 0 <= self.notsent_lowat < 1 << 31:
            raise ConfigError(
                "server.notsent_lowat", f"must be 0 or a byte count, got {self.notsent_lowat}"
            )


_DURATION_KEYS = {
    "max_age",
    "retention_interval",
    "poll_interval",
    "registration_timeout",
    "close_timeout",
    "stall_timeout",
    "window_max_age",
    "send_interval",
    "db_retry_budget",
    "standby_wait",
    "ping_interval",
    "ping_timeout",
    "drain_grace",
    "header_timeout",
}
_POSITIVE_DURATIONS = {
    # 0 would trim every entry, spin a loop, or close every listener at once; the
    # other durations take 0 (send at once, do not wait, report at once).
    "max_age",
    "retention_interval",
    "poll_interval",
    "window_max_age",
    "registration_timeout",
    "stall_timeout",
}
_POSITIVE_INTS = {
    "tail_batch",
    "queue_size",
    "max_batch",
    "max_frame_bytes",
    "max_registrations",
    "max_connections",
    "replay_limit",
    "window_bytes",
}


def _check(config: PublisherConfig, source: str | None) -> None:
    try:
        quote_schema(config.schema)
    except ProtocolError as exc:
        raise ConfigError("publisher.schema", exc.message, source) from None
    for key in _POSITIVE_INTS:
        if getattr(config, key) < 1:
            raise ConfigError(f"publisher.{key}", "must be at least 1", source)
    for key in _POSITIVE_DURATIONS:
        if not getattr(config, key) > 0:
            raise ConfigError(f"publisher.{key}", "must be more than 0 seconds", source)
    if config.cursor_key is not None and len(config.cursor_key) < 16:
        raise ConfigError(
            "publisher.cursor_key",
            "must be at least 16 characters (or left out: the feed's own key is used)",
            source,
        )
    if config.read_dsn is not None and not config.read_dsn.strip():
        raise ConfigError(
            "publisher.read_dsn", "must not be empty (leave it out to read dsn)", source
        )
    if config.queue_size < config.tail_batch:
        raise ConfigError(
            "publisher.queue_size",
            f"must be at least tail_batch ({config.tail_batch}): one tailer read is queued at once",
            source,
        )
    _check_tokens(config, source)
    names = set()
    for i, resource in enumerate(config.resources):
        where = f"resources[{i}]"
        if not _NAME.match(resource.name):
            raise ConfigError(
                f"{where}.name", f"{resource.name!r} is not a valid resource name", source
            )
        if resource.name in names:
            raise ConfigError(f"{where}.name", f"duplicate resource {resource.name!r}", source)
        names.add(resource.name)
        if not resource.bootstrap_route:
            raise ConfigError(f"{where}.bootstrap_route", "must not be empty", source)
        for sub in resource.sub_resources:
            if not _NAME.match(sub):
                raise ConfigError(f"{where}.sub_resources", f"{sub!r} is not a valid name", source)


_SHA256 = re.compile(r"^sha256:[0-9a-fA-F]{64}$")


def _check_tokens(config: PublisherConfig, source: str | None) -> None:
    if not isinstance(config.token_resources, dict):
        raise ConfigError("publisher.token_resources", "expected a table", source)
    # Python callers may pass lists; the model keeps tuples.
    object.__setattr__(
        config,
        "token_resources",
        {token: tuple(resources) for token, resources in config.token_resources.items()},
    )
    known = {resource.name for resource in config.resources}
    for key, tokens in (
        ("publisher.auth_tokens", list(config.auth_tokens)),
        ("publisher.token_resources", list(config.token_resources)),
    ):
        for token in tokens:
            if not token or token != token.strip() or any(c.isspace() for c in token):
                raise ConfigError(key, "a token must be non-empty and without whitespace", source)
            if token.startswith("sha256:") and not _SHA256.match(token):
                raise ConfigError(key, "sha256: must be followed by 64 hex digits", source)
    for token, resources in config.token_resources.items():
        if token in config.auth_tokens:
            raise ConfigError(
                "publisher.token_resources",
                "a token is listed in auth_tokens too; list it in one place",
                source,
            )
        for name in resources:
            if known and name != "*" and name not in known:
                raise ConfigError(
                    "publisher.token_resources",
                    f"unknown resource {name!r} (known: {', '.join(sorted(known))})",
                    source,
                )


def _coerce(key: str, hint: Any, value: Any, source: str | None) -> Any:
    """Check one TOML value against the model's type hint."""
    if key.rsplit(".", 1)[-1] in _DURATION_KEYS:
        return parse_duration(value, key, source)
    origin = typing.get_origin(hint)
    if origin in (types.UnionType, typing.Union):
        if value is None:
            return None
        (hint,) = [a for a in typing.get_args(hint) if a is not type(None)]
        origin = typing.get_origin(hint)
    if origin is tuple:
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise ConfigError(key, f"expected a list of strings, got {value!r}", source)
        return tuple(value)
    if origin is dict:
        if not isinstance(value, dict) or not all(
            isinstance(v, list) and all(isinstance(x, str) for x in v) for v in value.values()
        ):
            raise ConfigError(
                key, f'expected a table such as {{"<token>" = ["vm"]}}, got {value!r}', source
            )
        return {str(k): tuple(v) for k, v in value.items()}
    if hint is bool and not isinstance(value, bool):
        raise ConfigError(key, f"expected true or false, got {value!r}", source)
    if hint is int and (isinstance(value, bool) or not isinstance(value, int)):
        raise ConfigError(key, f"expected an integer, got {value!r}", source)
    if hint is float and (isinstance(value, bool) or not isinstance(value, int | float)):
        raise ConfigError(key, f"expected a number, got {value!r}", source)
    if hint is str and not isinstance(value, str):
        raise ConfigError(key, f"expected a string, got {value!r}", source)
    return float(value) if hint is float else value


def _build(
    cls: type[Any], doc: Any, prefix: str, source: str | None, skip: set[str]
) -> dict[str, Any]:
    if not isinstance(doc, dict):
        raise ConfigError(prefix, f"expected a table, got {doc!r}", source)
    hints = typing.get_type_hints(cls)
    known = {f.name for f in dataclasses.fields(cls)} - skip
    values = {}
    for key, value in doc.items():
        if key not in known:
            raise ConfigError(
                f"{prefix}.{key}", f"unknown key (known: {', '.join(sorted(known))})", source
            )
        values[key] = _coerce(f"{prefix}.{key}", hints[key], value, source)
    return values


def config_from_dict(doc: dict[str, Any], source: str | None = None) -> PublisherConfig:
    """Build a config from a parsed TOML document, refusing unknown keys and wrong types."""
    for key in doc:
        if key not in ("publisher", "resources", "server"):
            raise ConfigError(key, "unknown table (known: publisher, resources, server)", source)
    values = _build(PublisherConfig, doc.get("publisher", {}), "publisher", source, {"resources"})
    raw_resources = doc.get("resources", [])
    if not isinstance(raw_resources, list):
        raise ConfigError("resources", "expected [[resources]] tables", source)
    resources = []
    for i, raw in enumerate(raw_resources):
        fields = _build(ResourceConfig, raw, f"resources[{i}]", source, set())
        for required in ("name", "bootstrap_route"):
            if required not in fields:
                raise ConfigError(f"resources[{i}].{required}", "is required", source)
        resources.append(ResourceConfig(**fields))
    try:
        return PublisherConfig(resources=tuple(resources), **values)
    except ConfigError as exc:
        raise ConfigError(exc.key, str(exc).split(": ", 1)[-1], source) from None


def server_config_from_dict(doc: dict[str, Any], source: str | None = None) -> ServerConfig:
    """The ``[server]`` table of a parsed TOML document."""
    values = _build(ServerConfig, doc.get("server", {}), "server", source, set())
    try:
        return ServerConfig(**values)
    except ConfigError as exc:
        raise ConfigError(exc.key, str(exc).split(": ", 1)[-1], source) from None


def _type_name(cls: type[Any], name: str) -> str:
    kind: str = {f.name: f.metadata.get("kind", "") for f in dataclasses.fields(cls)}[name]
    if kind:
        return kind
    if name in _DURATION_KEYS:
        return "duration"
    hint = typing.get_type_hints(cls)[name]
    if typing.get_origin(hint) is tuple:
        return "list of strings"
    if typing.get_origin(hint) is dict:
        return "table of lists of strings"
    if typing.get_origin(hint) in (types.UnionType, typing.Union):
        return "string (optional)"
    return {bool: "boolean", int: "integer", float: "number", str: "string"}.get(hint, str(hint))


def config_reference() -> str:
    """The config reference (docs/config.md), generated from the model itself."""
    lines = [
        "# Configuration reference",
        "",
        "Generated from the config model, `changefeed.publisher.config.config_reference()`;",
        "tests/test_config.py keeps this file and the model in step.",
        "",
        'Durations are seconds as a number, or a string such as `"500ms"`, `"30s"`, `"10m"`,',
        '`"24h"`, `"7d"`. Unknown keys and wrong types are refused with an error naming the',
        "file and the key.",
        "",
    ]
    sections: list[tuple[str, type[Any], set[str]]] = [
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
        for f in dataclasses.fields(cls):
            if f.name in skip:
                continue
            if f.default_factory is not dataclasses.MISSING:
                default = "(none)"
            elif f.default is dataclasses.MISSING:
                default = "required"
            elif f.default in (None, ()):
                default = "(none)"
            elif isinstance(f.default, bool):
                default = f"`{str(f.default).lower()}`"
            else:
                default = f"`{f.default!r}`".replace("'", '"')
            unit = f.metadata.get("unit", "")
            lines.append(
                f"| `{f.name}` | {_type_name(cls, f.name)} | {default} | {unit} | "
                f"{f.metadata.get('doc', '')} |"
            )
        lines.append("")
    return "\n".join(lines)


def load_config(path: str | Path) -> PublisherConfig:
    """Load a publisher config from a TOML file.

    Raises:
        ConfigError: the file is unreadable, not TOML, or a key is unknown or wrong.
    """
    return load_service_config(path)[0]


def load_service_config(path: str | Path) -> tuple[PublisherConfig, ServerConfig]:
    """Load ``[publisher]``, ``[[resources]]`` and ``[server]`` from a TOML file.

    Raises:
        ConfigError: the file is unreadable, not TOML, or a key is unknown or wrong.
    """
    source = str(path)
    try:
        with open(path, "rb") as f:
            doc = tomllib.load(f)
    except OSError as exc:
        raise ConfigError("(file)", f"cannot read: {exc.strerror}", source) from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError("(file)", f"not valid TOML: {exc}", source) from None
    return config_from_dict(doc, source), server_config_from_dict(doc, source)
