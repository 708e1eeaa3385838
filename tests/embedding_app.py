"""An existing API that embeds a publisher, as the README shows: what
tests/test_asgi_servers.py runs on each ASGI server, from a venv with the built
wheel, copied into a directory of its own (no checkout beside it).

``CHANGEFEED_APP_FRAMEWORK`` picks the API's framework (``starlette`` or
``fastapi``), ``CHANGEFEED_APP_SETTINGS`` holds PublisherConfig fields (JSON).
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import AsyncIterator
from typing import Any

from changefeed.logs import configure_logging
from changefeed.publisher import Publisher, PublisherConfig, ResourceConfig

configure_logging("info", json_output=True)  # the API's own logging set-up would do this

publisher = Publisher(
    PublisherConfig(
        dsn=os.environ["CHANGEFEED_DSN"],
        resources=(
            ResourceConfig("vm", "/vms", ("nic", "alias")),
            ResourceConfig("network", "/networks", ("subnet",)),
        ),
        **json.loads(os.environ.get("CHANGEFEED_APP_SETTINGS", "{}")),
    )
)


@contextlib.asynccontextmanager
async def lifespan(app: Any) -> AsyncIterator[None]:
    # The API's own start-up and shut-down would go around this.
    async with publisher.lifespan(app):
        yield


async def version() -> dict[str, str]:
    return {"api": "1"}


if os.environ.get("CHANGEFEED_APP_FRAMEWORK") == "fastapi":
    from fastapi import FastAPI

    app: Any = FastAPI(lifespan=lifespan)
    app.get("/version")(version)
    app.router.routes.extend(publisher.routes)
else:
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    async def version_route(request: Request) -> JSONResponse:
        return JSONResponse(await version())

    app = Starlette(routes=[Route("/version", version_route), *publisher.routes], lifespan=lifespan)
