"""Run an ASGI app that embeds publishers on uvicorn, draining them on SIGTERM.

uvicorn's own shutdown closes websockets with 1012; a draining publisher
closes them with 1001 first ("going away": register with another instance),
after the listening socket stopped accepting, and within a bounded time.
"""

from __future__ import annotations

import socket
from collections.abc import Sequence
from typing import Any

import uvicorn

from changefeed.publisher import Publisher

__all__ = ["DrainingServer", "server_config"]


def server_config(app: Any, host: str, port: int, **overrides: Any) -> uvicorn.Config:
    """uvicorn settings for a publisher: uvloop/httptools where available, websocket
    pings every 20 s (dead listeners are dropped within ~40 s), no per-message
    compression (small JSON frames gain little and cost CPU per listener)."""
    settings: dict[str, Any] = {
        "host": host,
        "port": port,
        "loop": "auto",
        "http": "auto",
        "ws": "websockets-sansio",
        "ws_ping_interval": 20.0,
        "ws_ping_timeout": 20.0,
        "ws_per_message_deflate": False,
        "ws_max_size": 1 << 20,
        "lifespan": "on",
        "log_level": "warning",
        "timeout_graceful_shutdown": 10,
        # uvicorn's own loggers go through changefeed's formatter (JSON or human),
        # not a second, differently formatted configuration.
        "log_config": None,
    }
    settings.update(overrides)
    return uvicorn.Config(app, **settings)


class DrainingServer(uvicorn.Server):
    """A uvicorn server that drains ``publishers`` before it shuts down.

    Args:
        config: the uvicorn config.
        publishers: publishers to drain (close listeners with 1001) on shutdown.
        grace: seconds allowed for the drain.
    """

    def __init__(
        self, config: uvicorn.Config, publishers: Sequence[Publisher], grace: float = 5.0
    ) -> None:
        super().__init__(config)
        self.publishers = list(publishers)
        self.grace = grace

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        for server in self.servers:
            server.close()  # stop accepting before asking listeners to go elsewhere
        for publisher in self.publishers:
            await publisher.drain(self.grace)
        await super().shutdown(sockets)
