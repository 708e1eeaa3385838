"""The publisher: feed store, tailer, registry and fan-out, Starlette routes, config.

Embed it in a Starlette API::

    vm = ResourceConfig("vm", "/vms", ("nic", "alias"))
    publisher = Publisher(PublisherConfig(dsn=DSN, resources=(vm,)))
    app = Starlette(routes=[*publisher.routes, ...], lifespan=publisher.lifespan)

and append an entry in the same transaction as each write::

    async with conn.transaction():
        await conn.execute("UPDATE vms SET alias = $1 WHERE uuid = $2", alias, uuid)
        await publish(conn, "vm", ["alias"], uuid)

or let the table publish its own changes, with no extra round trip::

    await install_trigger(conn, "vms", "vm", "uuid")
"""

from changefeed.extras import missing_extra

try:
    import asyncpg  # noqa: F401
    import prometheus_client  # noqa: F401
    import starlette  # noqa: F401
except ModuleNotFoundError as exc:  # a listener-only install: say what to install
    raise missing_extra("changefeed.publisher", "publisher", exc) from exc

from .auth import Authorizer
from .config import PublisherConfig, ResourceConfig, load_config, parse_duration
from .errors import ConfigError, FeedUnavailable, PublisherError
from .feed import FeedEntry, FeedReader, install_trigger, publish, publish_many
from .service import Publisher

__all__ = [
    "Authorizer",
    "ConfigError",
    "FeedEntry",
    "FeedReader",
    "FeedUnavailable",
    "Publisher",
    "PublisherConfig",
    "PublisherError",
    "ResourceConfig",
    "install_trigger",
    "load_config",
    "parse_duration",
    "publish",
    "publish_many",
]
