"""Run ASGI apps on real uvicorn servers on 127.0.0.1 inside the test's event loop."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator
from typing import Any

import uvicorn


def _free_socket(port: int) -> socket.socket:
    # IPPROTO_TCP explicitly: asyncio sets TCP_NODELAY on accepted connections only
    # when the listening socket says so; without it Nagle adds ~40 ms per request.
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", port))
    return sock


def leave_signals_to_pytest(server: uvicorn.Server) -> None:
    """Keep ``server`` (started inside a test) off the process's signal handlers, which
    belong to pytest: a no-op context manager stands in for uvicorn's
    ``capture_signals`` (a private name, listed in changefeed/uvicorn_private.py;
    hence the ignore)."""
    server.capture_signals = contextlib.nullcontext  # type: ignore[method-assign, assignment]


class RunningServer:
    """A uvicorn server started by ``serve_app``; ``url`` is its http base URL."""

    def __init__(self, server: uvicorn.Server, task: asyncio.Task[None], port: int) -> None:
        self.server = server
        self.task = task
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self.ws_url = f"ws://127.0.0.1:{port}"

    async def stop(self, timeout: float = 15.0) -> None:
        self.server.should_exit = True
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.wait_for(self.task, timeout)


@contextlib.asynccontextmanager
async def serve_app(
    app: Any, *, port: int | None = None, **config: Any
) -> AsyncIterator[RunningServer]:
    """Serve ``app`` (lifespan on) until the block exits. Extra kwargs go to uvicorn.Config."""
    sock = _free_socket(port or 0)
    bound_port = sock.getsockname()[1]
    settings: dict[str, Any] = {
        "log_level": "warning",
        "lifespan": "on",
        "ws_ping_interval": 5.0,
        "ws_ping_timeout": 5.0,
        # As server_config does in production: uvicorn otherwise waits forever
        # for a connection whose peer never completes the close (seen once in
        # the convergence test, under load, on an API restart).
        "timeout_graceful_shutdown": 5,
    }
    settings.update(config)
    server = uvicorn.Server(uvicorn.Config(app, **settings))
    leave_signals_to_pytest(server)
    task = asyncio.create_task(server.serve(sockets=[sock]))
    running = RunningServer(server, task, bound_port)
    try:
        async with asyncio.timeout(15):
            while not server.started:
                if task.done():
                    task.result()
                    raise RuntimeError("uvicorn exited before it started")
                await asyncio.sleep(0.01)
        yield running
    finally:
        await running.stop()
        sock.close()
