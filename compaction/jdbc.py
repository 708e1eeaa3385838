"""From the asyncpg/libpq DSN the publisher is configured with to what Spark's JDBC source needs.

``postgresql://user:pw@host:port/db?sslmode=require`` becomes the URL
``jdbc:postgresql://host:port/db`` plus properties (``user``, ``password``,
``sslmode``, ``driver`` ...). The password travels in the properties only, so
the URL can be logged. Pure code, apart from looking for the driver's jar.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import parse_qsl, quote, unquote, urlsplit

from .errors import CompactionError

__all__ = [
    "DEBIAN_JDBC_JAR",
    "JDBC_DRIVER",
    "JDBC_JAR_ENV",
    "JDBC_PACKAGE",
    "JdbcTarget",
    "find_jdbc_jar",
    "jdbc_from_dsn",
]

JDBC_DRIVER = "org.postgresql.Driver"
"""The driver class Spark is told to load (its ``driver`` option)."""

JDBC_PACKAGE = "org.postgresql:postgresql:42.7.4"
"""Maven coordinates for ``spark-submit --packages`` on a cluster."""

DEBIAN_JDBC_JAR = "/usr/share/java/postgresql.jar"
"""Where Debian's ``libpostgresql-jdbc-java`` installs the driver."""

JDBC_JAR_ENV = "CHANGEFEED_JDBC_JAR"
"""Environment variable naming the driver jar (after the explicit argument)."""

# libpq query parameters -> pgjdbc connection properties. Anything else is refused:
# a silently dropped sslmode would connect in the clear.
_PARAMS: Mapping[str, str] = {
    "sslmode": "sslmode",
    "sslrootcert": "sslrootcert",
    "sslcert": "sslcert",
    "sslkey": "sslkey",
    "sslpassword": "sslpassword",
    "application_name": "ApplicationName",
    "connect_timeout": "connectTimeout",
    "options": "options",
    "user": "user",
    "password": "password",
}
_SSLMODES = frozenset({"disable", "allow", "prefer", "require", "verify-ca", "verify-full"})
_TARGET_SESSION_ATTRS: Mapping[str, str] = {
    "any": "any",
    "read-write": "primary",
    "primary": "primary",
    "standby": "secondary",
    "prefer-standby": "preferSecondary",
}


@dataclass(frozen=True, slots=True)
class JdbcTarget:
    """A JDBC URL and the connection properties that go with it.

    Attributes:
        url: ``jdbc:postgresql://host[:port][,host[:port]...]/database``; no secrets.
        properties: ``user``, ``password``, ``driver`` and any mapped parameters.
    """

    url: str
    properties: Mapping[str, str] = field(default_factory=dict)

    def with_properties(self, **extra: str) -> dict[str, str]:
        """The properties plus ``extra`` (e.g. Spark's ``fetchsize``), as a new dict."""
        return {**self.properties, **extra}

    def __repr__(self) -> str:
        shown = {
            k: ("***" if k in {"password", "sslpassword"} else v)
            for k, v in self.properties.items()
        }
        return f"JdbcTarget(url={self.url!r}, properties={shown!r})"


def _bad(dsn_shape: str, message: str) -> CompactionError:
    return CompactionError(f"cannot use DSN {dsn_shape} for JDBC: {message}")


def _hosts(hostlist: str, shape: str) -> list[tuple[str, int | None]]:
    """``host[:port],...`` as (host, port) pairs; IPv6 addresses stay bracketed."""
    hosts: list[tuple[str, int | None]] = []
    for item in hostlist.split(","):
        if item.startswith("["):
            end = item.find("]")
            if end < 0:
                raise _bad(shape, f"unterminated IPv6 address in {item!r}")
            host, rest = item[: end + 1], item[end + 1 :]
        else:
            host, sep, port_text = item.partition(":")
            host, rest = unquote(host), sep + port_text
            if host.startswith("/"):
                raise _bad(shape, "unix-socket hosts are not supported by JDBC; use host:port")
        port: int | None = None
        if rest:
            port_text = rest[1:]
            if not rest.startswith(":") or not port_text.isdigit():
                raise _bad(shape, f"bad port in {item!r}")
            port = int(port_text)
            if not 0 < port < 65536:
                raise _bad(shape, f"bad port in {item!r}")
        hosts.append((host or "localhost", port))
    return hosts


def jdbc_from_dsn(dsn: str, env: Mapping[str, str] | None = None) -> JdbcTarget:
    """Convert a libpq/asyncpg URL DSN to a JDBC URL and properties.

    Supports user and password (percent-decoded), several ``host:port`` pairs,
    bracketed IPv6 addresses, the database (default: the user name, as libpq),
    and the query parameters ``sslmode``, ``sslrootcert``, ``sslcert``,
    ``sslkey``, ``sslpassword``, ``application_name``, ``connect_timeout``,
    ``options``, ``target_session_attrs``, ``user``, ``password``, ``host`` and
    ``port``. The environment fills in what the DSN leaves out, as it does for
    asyncpg (libpq's variables), so that Spark reads the database the job's own
    connection locks and writes: ``PGUSER``, ``PGPASSWORD``, ``PGHOST``,
    ``PGPORT``, ``PGDATABASE``, ``PGSSLMODE`` and ``PGTARGETSESSIONATTRS``.

    Raises:
        CompactionError: not a ``postgresql://`` URL, a unix-socket host, or an
            unsupported parameter (named in the message; the password never is).
    """
    environ = os.environ if env is None else env
    scheme, _, rest = dsn.partition("://")
    shape = f"{scheme}://..." if rest else "(not a URL)"
    if scheme not in {"postgresql", "postgres"} or not rest:
        raise _bad(shape, "expected postgresql://[user[:password]@]host[:port]/database")
    parts = urlsplit(dsn)
    netloc = parts.netloc
    userinfo, at, hostlist = netloc.rpartition("@")
    if not at:
        userinfo, hostlist = "", netloc
    user, colon, password = userinfo.partition(":")
    props: dict[str, str] = {}
    if user:
        props["user"] = unquote(user)
    if colon:
        props["password"] = unquote(password)
    database = unquote(parts.path[1:]) if parts.path.startswith("/") else ""
    query_hosts: str | None = None
    query_port: str | None = None
    for key, value in parse_qsl(parts.query, keep_blank_values=True):
        if key in {"dbname", "database"}:
            database = value
        elif key == "host":
            query_hosts = value
        elif key == "port":
            query_port = value
        elif key == "target_session_attrs":
            if value not in _TARGET_SESSION_ATTRS:
                raise _bad(shape, f"target_session_attrs={value!r} is not supported")
            props["targetServerType"] = _TARGET_SESSION_ATTRS[value]
        elif key in _PARAMS:
            if key == "sslmode" and value not in _SSLMODES:
                raise _bad(shape, f"sslmode={value!r} is not one of {sorted(_SSLMODES)}")
            if key == "connect_timeout" and not value.isdigit():
                raise _bad(shape, f"connect_timeout={value!r} is not a whole number of seconds")
            props[_PARAMS[key]] = value
        else:
            raise _bad(shape, f"query parameter {key!r} is not supported")
    if query_hosts is None and not hostlist:
        # (A socket directory, as libpq allows there, is no host for JDBC: localhost.)
        env_host = environ.get("PGHOST") or ""
        query_hosts = env_host if env_host and not env_host.startswith("/") else None
    if query_port is None and environ.get("PGPORT"):
        query_port = environ["PGPORT"]
    if "sslmode" not in props and (mode := environ.get("PGSSLMODE")):
        if mode not in _SSLMODES:
            raise _bad(shape, f"PGSSLMODE={mode!r} is not one of {sorted(_SSLMODES)}")
        props["sslmode"] = mode
    if "targetServerType" not in props and (attrs := environ.get("PGTARGETSESSIONATTRS")):
        if attrs not in _TARGET_SESSION_ATTRS:
            raise _bad(shape, f"PGTARGETSESSIONATTRS={attrs!r} is not supported")
        props["targetServerType"] = _TARGET_SESSION_ATTRS[attrs]
    hosts = _hosts(query_hosts if query_hosts is not None else hostlist, shape)
    if query_port is not None:
        if not query_port.isdigit() or not 0 < int(query_port) < 65536:
            raise _bad(shape, f"bad port {query_port!r}")
        hosts = [(h, p if p is not None else int(query_port)) for h, p in hosts]
    if "user" not in props and environ.get("PGUSER"):
        props["user"] = environ["PGUSER"]
    if "password" not in props and environ.get("PGPASSWORD"):
        props["password"] = environ["PGPASSWORD"]
    if not database:
        database = (
            environ.get("PGDATABASE") or props.get("user") or environ.get("USER") or "postgres"
        )
    props["driver"] = JDBC_DRIVER
    where = ",".join(h if p is None else f"{h}:{p}" for h, p in hosts)
    url = f"jdbc:postgresql://{where}/{quote(database, safe='')}"
    return JdbcTarget(url, props)


def find_jdbc_jar(
    configured: str | None = None, env: Mapping[str, str] | None = None
) -> str | None:
    """The PostgreSQL JDBC driver jar to put on Spark's class path.

    Looked up in order: ``configured``; env ``CHANGEFEED_JDBC_JAR``; Debian's
    ``/usr/share/java/postgresql.jar``. None when none of them exists (then the
    driver must already be on the class path, e.g. ``spark-submit --packages``).

    Raises:
        CompactionError: ``configured`` (or the env variable) names a missing file.
    """
    environ = os.environ if env is None else env
    for source, path in (("jdbc_jar", configured), (JDBC_JAR_ENV, environ.get(JDBC_JAR_ENV))):
        if path:
            if not Path(path).is_file():
                raise CompactionError(f"{source}: JDBC driver jar {path!r} does not exist")
            return str(Path(path).resolve())
    if Path(DEBIAN_JDBC_JAR).is_file():
        return str(Path(DEBIAN_JDBC_JAR).resolve())
    return None
