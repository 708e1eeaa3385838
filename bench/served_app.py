"""The publisher as an API embeds it, for the benchmarks that run it on each ASGI server
(bench/common.py ``publisher_process``): a Starlette app of the publisher's routes.

``CHANGEFEED_DSN`` is the feed's database, ``CHANGEFEED_BENCH_SETTINGS`` holds
PublisherConfig fields (JSON). The collector is tuned once the publisher has
started, as ``changefeed serve`` does.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import AsyncIterator
from typing import Any

from starlette.applications import Starlette

from changefeed.collector import tune_collector
from changefeed.publisher import Publisher, PublisherConfig, ResourceConfig

_settings = json.loads(os.environ.get("CHANGEFEED_BENCH_SETTINGS", "{}"))
publisher = Publisher(
    PublisherConfig(
        dsn=os.environ["CHANGEFEED_DSN"],
        resources=(ResourceConfig("vm", "/vms", ("nic", "alias")),),
        **_settings,
    )
)


@contextlib.asynccontextmanager
async def lifespan(app: Any) -> AsyncIterator[None]:
    async with publisher.lifespan(app):
        tune_collector()
        yield


app = Starlette(routes=publisher.routes, lifespan=lifespan)
