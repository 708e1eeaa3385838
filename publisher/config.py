"""Publisher configuration: a typed model, loaded from TOML and/or built in Python.

Every key is declared once, in the model: its type, its bounds, its unit and
its documentation (``Annotated[..., key_doc(...)]``, a ``msgspec.Meta``). msgspec
parses a TOML document into it (types, unknown keys, required keys, bounds),
the same checks refuse a value built in Python, the config reference in
docs/ is generated from it (``config_reference.py``), and a bad value is
refused with a ``ConfigError`` that names the key and the file
(``config_errors.py``). Durations are the one
thing msgspec does not read: a string such as ``"24h"`` is turned into
seconds first, for the keys the model marks as durations.

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

import re
import tomllib
from pathlib import Path
from typing import Annotated, Any, TypeVar

import msgspec

from changefeed.durations import seconds_of, too_long
from changefeed.schemas import ProtocolError, quote_schema
from changefeed.tcp_liveness import NOTSENT_LOWAT

from .config_errors import explained, known_keys
from .config_keys import declared, duration_keys, key_doc
from .errors import ConfigError

__all__ = [
    "PublisherConfig",
    "ResourceConfig",
    "ServerConfig",
    "config_from_dict",
    "load_config",
    "load_service_config",
    "parse_duration",
    "server_config_from_dict",
]

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.:-]{0,63}$")


def parse_duration(value: Any, key: str = "duration", source: str | None = None) -> float:
    """Seconds from a number or a string: ``"500ms"``, ``"30s"``, ``"10m"``, ``"24h"``, ``"7d"``."""
    if isinstance(value, bool):
        raise ConfigError(key, f"expected a duration, got {value!r}", source)
    seconds: float | None = None
    if isinstance(value, int | float):
        seconds = float(value)
    elif isinstance(value, str):
        seconds = seconds_of(value)
    if seconds is None:
        raise ConfigError(
            key, f'expected a duration such as 30, "500ms", "10m" or "24h", got {value!r}', source
        )
    if seconds < 0:
        raise ConfigError(key, f"must not be negative, got {value!r}", source)
    if (why := too_long(seconds)) is not None:
        raise ConfigError(key, why, source)
    return seconds


class ResourceConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A resource with a change feed (one ``[[resources]]`` table)."""

    name: Annotated[
        str,
        key_doc("Resource name listeners register for, e.g. `vm`."),
    ]
    bootstrap_route: Annotated[
        str,
        key_doc(
            "Keyset-paginated list route listeners hydrate from: a path on this API "
            "(`/vms`) or an absolute URL on the API that owns the resource."
        ),
    ]
    sub_resources: Annotated[
        tuple[str, ...],
        key_doc('Sub-resources a change may name, e.g. `["nic", "alias"]`.'),
    ] = ()


class PublisherConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Everything a publisher needs (the ``[publisher]`` table plus ``[[resources]]``)."""

    resources: Annotated[
        tuple[ResourceConfig, ...],
        key_doc("The resources this publisher has change feeds for."),
    ] = ()
    dsn: Annotated[
        str | None,
        key_doc(
            "PostgreSQL DSN of the feed database. Required, even with a pool: the tailer "
            "opens its own connection (LISTEN); an embedding API's pool serves the other queries.",
            kind="string",
        ),
    ] = None
    read_dsn: Annotated[
        str | None,
        key_doc(
            "PostgreSQL DSN of a hot standby of `dsn` to read the feed from: tailing, "
            "catch-up pages and resume checks go there, and `dsn` (the primary) keeps only "
            "the doorbell (LISTEN), schema changes, retention and the writers' age. "
            "`changefeed serve` and `example-api` refuse at start-up one that is not the "
            "same database on a hot standby of `dsn`'s server (or that server). None: "
            'everything reads `dsn` (docs/design.md, "Reading from a standby").',
            kind="string",
        ),
    ] = None
    standby_wait: Annotated[
        float,
        key_doc(
            "With `read_dsn`: how long a registration whose cursor the standby has not "
            "replayed yet (a fresher publisher issued it) is held while the standby catches "
            "up; after that it is answered `unavailable` (4010) with `retryAfter`, never "
            "`resumed: false`. Keep it below the listeners' wait for an ack "
            "(changefeed.listener's `ack_timeout`: 10 s).",
            "seconds",
            duration=True,
            ge=0,
        ),
    ] = 5.0
    schema: Annotated[
        str,
        key_doc("Schema holding the feed table."),
    ] = "changefeed"
    create_schema: Annotated[
        bool,
        key_doc("Create or upgrade the feed schema at start-up."),
    ] = True
    max_age: Annotated[
        float,
        key_doc(
            "RFD 5 max age: entries older than this are trimmed.", "seconds", duration=True, gt=0
        ),
    ] = 86400.0
    retention: Annotated[
        bool,
        key_doc("Trim entries older than max_age inline. Turn off when the Spark job does it."),
    ] = True
    retention_interval: Annotated[
        float,
        key_doc("How often inline retention runs.", "seconds", duration=True, gt=0),
    ] = 60.0
    poll_interval: Annotated[
        float,
        key_doc(
            "Tailer poll when no doorbell (NOTIFY) rings; bounds latency if one is lost.",
            "seconds",
            duration=True,
            gt=0,
        ),
    ] = 0.5
    tail_batch: Annotated[
        int,
        key_doc("Entries read per tailer query.", "entries", ge=1, le=100_000),
    ] = 1000
    queue_size: Annotated[
        int,
        key_doc(
            "Items queued for one live listener at most. A listener whose queue cannot take "
            "the next batch is not evicted: it catches up from the window or the feed table, "
            "at its own pace (docs/fanout.md).",
            "items",
            ge=1,
        ),
    ] = 4096
    window_bytes: Annotated[
        int,
        key_doc(
            "Memory for the window of recently tailed entries that listeners catch up from, "
            "shared by all of them (a quarter as much again for pages of the feed table read "
            "for listeners further behind).",
            "bytes",
            ge=1,
        ),
    ] = 64 << 20
    window_max_age: Annotated[
        float,
        key_doc(
            "Entries older than this (by their published time) leave the window of recent "
            "entries; listeners further behind read the feed table. A memory bound, not a "
            "rule the Spark job depends on: below the job's rewrite horizon catch-up reads "
            "the table, whatever its `compaction_lag` (docs/compaction.md).",
            "seconds",
            duration=True,
            gt=0,
        ),
    ] = 300.0
    stall_timeout: Annotated[
        float,
        key_doc(
            "A listener that has items to take and takes nothing at all for this long is "
            "evicted (4009). What it takes is what TCP shows: a receiver's kernel reopens a "
            "full window only once a good part of its buffer is free (on loopback 64 KiB or "
            "more), so a listener that reads less than that per `stall_timeout` (about 1 KiB/s "
            "at 60 s) looks stopped; raise it for consumers that slow. Any faster reader is "
            "never evicted.",
            "seconds",
            duration=True,
            gt=0,
        ),
    ] = 60.0
    max_batch: Annotated[
        int,
        key_doc(
            "Items per frame for listeners that registered with batch.", "items", ge=1, le=65536
        ),
    ] = 256
    send_interval: Annotated[
        float,
        key_doc(
            "Longest wait between two flushes of the listeners' send queues. A flush may "
            "start once three times the previous one's cost has passed since it started: "
            "with few listeners a change goes out at once; with many, changes read "
            "meanwhile go out together (one batch frame per listener), and flushing takes "
            "at most a third of the time. 0: every tailer read at once (docs/fanout.md).",
            "seconds",
            duration=True,
            ge=0,
        ),
    ] = 0.002
    max_frame_bytes: Annotated[
        int,
        key_doc(
            "Largest frame accepted from a listener (a registration must fit).",
            "bytes",
            ge=1024,
            le=64 << 20,
        ),
    ] = 65536
    registration_timeout: Annotated[
        float,
        key_doc(
            "A connection that sends no registration by then is closed.",
            "seconds",
            duration=True,
            gt=0,
        ),
    ] = 10.0
    close_timeout: Annotated[
        float,
        key_doc(
            "How long the publisher waits to hand a closing listener its error and close "
            "frames (an evicted listener may not be reading) before it lets the connection go.",
            "seconds",
            duration=True,
            ge=0,
        ),
    ] = 10.0
    max_registrations: Annotated[
        int,
        key_doc("Registrations (change kinds) allowed on one connection.", ge=1),
    ] = 32
    max_connections: Annotated[
        int,
        key_doc("Listener connections one publisher process accepts.", ge=1),
    ] = 10000
    notsent_lowat: Annotated[
        int,
        key_doc(
            "Through plain ASGI (a server the publisher did not start: the embedding API's "
            "uvicorn, hypercorn, granian): bytes the kernel may hold unsent for each "
            "connection of the port listeners connect to (TCP_NOTSENT_LOWAT), set on that "
            "port's sockets that have none when the first listener connects, so that a ping "
            "or a pong to a listener catching up waits behind little. 0: leave the server's "
            "sockets alone (the host's `net.ipv4.tcp_notsent_lowat` holds, unlimited by "
            "default). `changefeed serve` sets `[server] notsent_lowat` itself.",
            "bytes",
            ge=0,
            lt=1 << 31,
        ),
    ] = NOTSENT_LOWAT
    replay_limit: Annotated[
        int,
        key_doc(
            "A resume more entries behind than this (estimated from entry identities) is "
            "answered resumed=false (reason too_far_behind): bootstrapping is then cheaper.",
            "entries",
            ge=1,
        ),
    ] = 1000000
    db_retry_budget: Annotated[
        float,
        key_doc(
            "After this long without the database the publisher reports itself unavailable "
            "(it keeps retrying).",
            "seconds",
            duration=True,
            ge=0,
        ),
    ] = 30.0
    cursor_key: Annotated[
        str | None,
        key_doc(
            "Key of the cursors' digest. By default the key made with the feed and kept in "
            "its database (every instance reads it there, and nobody else knows it); set "
            "one only to manage it yourself, at least 16 characters, the same on every "
            "instance of one feed."
        ),
    ] = None
    auth_tokens: Annotated[
        tuple[str, ...],
        key_doc(
            "Bearer tokens accepted on /changefeeds, /changefeeds/stats and bootstrap routes, "
            "each allowed to read every resource; `sha256:<hex>` gives a token by its SHA-256. "
            "No tokens here or in token_resources: no auth (docs/security.md)."
        ),
    ] = ()
    token_resources: Annotated[
        dict[str, tuple[str, ...]],
        key_doc(
            'Bearer tokens allowed to read only some resources: `{"<token>" = ["vm"]}` '
            '(a `[publisher.token_resources]` table; keys may be `"sha256:<hex>"`). '
            "Other resources are refused with `forbidden` (close code 4004)."
        ),
    ] = {}

    def __post_init__(self) -> None:
        _check_fields(self, "publisher")
        _check(self, source=None)

    def resource(self, name: str) -> ResourceConfig | None:
        """The configured resource called ``name``, if any."""
        for resource in self.resources:
            if resource.name == name:
                return resource
        return None


class ServerConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """How ``changefeed serve`` listens (the ``[server]`` table)."""

    host: Annotated[
        str,
        key_doc("Address to listen on."),
    ] = "127.0.0.1"
    port: Annotated[
        int,
        key_doc("TCP port to listen on.", ge=1, le=65535),
    ] = 8080
    ping_interval: Annotated[
        float,
        key_doc(
            "Websocket ping interval; keep load balancer idle timeouts above it.",
            "seconds",
            duration=True,
            gt=0,
        ),
    ] = 20.0
    ping_timeout: Annotated[
        float,
        key_doc(
            "Each ping's deadline. A listener that makes no progress (takes none of what was "
            "sent, sends nothing) through three deadlines in a row, answering no ping, is "
            "evicted (`keepalive_timeout`): 60 s at the defaults, 80 s after its last sign.",
            "seconds",
            duration=True,
            gt=0,
        ),
    ] = 20.0
    notsent_lowat: Annotated[
        int,
        key_doc(
            "Bytes the kernel may hold unsent for each connection (TCP_NOTSENT_LOWAT); the "
            "rest waits in the publisher, so that a ping or a pong to a listener catching up "
            "waits behind little more than the listener's own receive buffer. 0: the host's "
            "setting (`net.ipv4.tcp_notsent_lowat`, unlimited by default).",
            "bytes",
            ge=0,
            lt=1 << 31,
        ),
    ] = NOTSENT_LOWAT
    drain_grace: Annotated[
        float,
        key_doc(
            "On SIGTERM, time allowed for listeners to be closed with 1001 before exit.",
            "seconds",
            duration=True,
            ge=0,
        ),
    ] = 5.0
    header_timeout: Annotated[
        float,
        key_doc(
            "An HTTP connection whose request line and headers have not all arrived this long "
            "after it was accepted (or after its previous response) is closed, with 408 if it "
            "sent part of them; so is one whose request body stops arriving for this long. "
            "Websockets, once upgraded, are not affected. 0: off (header_max_bytes too), for "
            "a server behind a proxy that bounds request heads and bodies itself.",
            "seconds",
            duration=True,
            ge=0,
        ),
    ] = 15.0
    header_max_bytes: Annotated[
        int,
        key_doc(
            "An HTTP request whose line and headers have not ended within this many bytes "
            "is answered 431 and the connection closed, before the server parses more of "
            "them (the same layer as header_timeout, and off with it).",
            "bytes",
            ge=1024,
            lt=1 << 31,
        ),
    ] = 65536

    def __post_init__(self) -> None:
        _check_fields(self, "server")


# -- a config built in Python ---------------------------------------------------------


def _check_fields(config: msgspec.Struct, prefix: str) -> None:
    """Each key's type and declared bounds, for a config built in Python (msgspec
    checks them when it parses a file, not when a Struct is built), and durations
    of at most 100 years.

    A value msgspec would convert is stored converted, as from a file: a list
    for a tuple, a table for a ``ResourceConfig``, an integer for a number.
    """
    keys = declared(type(config))
    for f in msgspec.structs.fields(type(config)):
        given = getattr(config, f.name)
        value = _as_tables(given)
        try:
            converted = msgspec.convert(value, f.type)
        except msgspec.ValidationError as exc:
            raise explained(
                exc, value, under=f".{f.name}", cls=type(config), prefix=prefix, source=None
            ) from None
        if converted is not given:
            msgspec.structs.force_setattr(config, f.name, converted)
        duration = (keys[f.name][1].extra or {}).get("duration")
        if duration and isinstance(converted, float) and (problem := too_long(converted)):
            raise ConfigError(f"{prefix}.{f.name}", problem)


def _as_tables(value: Any) -> Any:
    """A list of Structs (``ResourceConfig``s) as a list of tables, so that converting
    it checks each one's keys too (msgspec takes a Struct instance as it is)."""
    if isinstance(value, list | tuple) and any(isinstance(v, msgspec.Struct) for v in value):
        return [msgspec.structs.asdict(v) if isinstance(v, msgspec.Struct) else v for v in value]
    return value


def _check(config: PublisherConfig, source: str | None) -> None:
    """What a key's type and bounds cannot say."""
    try:
        quote_schema(config.schema)
    except ProtocolError as exc:
        raise ConfigError("publisher.schema", exc.message, source) from None
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


# -- TOML documents -----------------------------------------------------------------------

_S = TypeVar("_S", bound=msgspec.Struct)


def _convert(cls: type[_S], doc: dict[str, Any], prefix: str, source: str | None) -> _S:
    """``doc`` as ``cls``, or a ``ConfigError`` naming the key and the file."""
    try:
        return msgspec.convert(doc, cls)
    except ConfigError as exc:  # a check of the model's own, in __post_init__
        raise ConfigError(exc.key, exc.message, source) from None
    except msgspec.ValidationError as exc:
        raise explained(exc, doc, under="", cls=cls, prefix=prefix, source=source) from None


def _table(doc: dict[str, Any], name: str, source: str | None) -> dict[str, Any]:
    """The ``[name]`` table of ``doc``, its durations in seconds."""
    table = doc.get(name, {})
    if not isinstance(table, dict):
        raise ConfigError(name, f"expected a table, got {table!r}", source)
    cls = PublisherConfig if name == "publisher" else ServerConfig
    return {
        key: parse_duration(value, f"{name}.{key}", source) if key in duration_keys(cls) else value
        for key, value in table.items()
    }


def config_from_dict(doc: dict[str, Any], source: str | None = None) -> PublisherConfig:
    """Build a config from a parsed TOML document, refusing unknown keys and wrong types."""
    for key in doc:
        if key not in ("publisher", "resources", "server"):
            raise ConfigError(key, "unknown table (known: publisher, resources, server)", source)
    publisher = _table(doc, "publisher", source)
    if "resources" in publisher:  # they are [[resources]] tables of their own
        raise ConfigError(
            "publisher.resources", f"unknown key (known: {known_keys(PublisherConfig)})", source
        )
    resources = doc.get("resources", [])
    if not isinstance(resources, list):
        raise ConfigError("resources", "expected [[resources]] tables", source)
    return _convert(PublisherConfig, {**publisher, "resources": resources}, "publisher", source)


def server_config_from_dict(doc: dict[str, Any], source: str | None = None) -> ServerConfig:
    """The ``[server]`` table of a parsed TOML document."""
    return _convert(ServerConfig, _table(doc, "server", source), "server", source)


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
    except UnicodeDecodeError as exc:  # TOML is UTF-8 text
        where = f"byte {exc.start}"
        raise ConfigError("(file)", f"not UTF-8 text ({exc.reason} at {where})", source) from None
    return config_from_dict(doc, source), server_config_from_dict(doc, source)
