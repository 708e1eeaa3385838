"""Scale: thousands of idle listeners on one publisher process, clients in another process.

The listeners are a ClientFleet (bench/common.py): real websocket connections
driven from a child process over loopback, so that the client side never
shares this process's event loop or its memory figures.
"""

from __future__ import annotations

import gc
import sys
import time
from pathlib import Path

import orjson
import pytest
from helpers import wait_until
from publisher_fixtures import running_publisher, write

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
from common import ClientFleet, raise_nofile, rss_bytes

LISTENERS = 5000


def _registration(batch: bool = False) -> str:
    doc = {
        "instance": "5c2a7b0e-0f5b-4b8e-9d7e-0c2d8b1f4a11",
        "service": "scale",
        "changeKind": {"resource": "vm", "subResources": []},
        "batch": batch,
    }
    return orjson.dumps(doc).decode()


@pytest.mark.slow
async def test_5000_idle_listeners_each_receive_a_broadcast(feed_dsn: str) -> None:
    raise_nofile(LISTENERS * 2 + 1024)
    async with (
        running_publisher(feed_dsn, max_connections=LISTENERS + 100) as pub,
        ClientFleet(nofile=LISTENERS + 1024) as fleet,
    ):
        gc.collect()
        before = rss_bytes()
        started = time.monotonic()
        result = await fleet.connect(
            pub.ws_url, LISTENERS, _registration(), concurrency=200, timeout=120
        )
        assert result["connected"] == LISTENERS, result["refused"]
        await wait_until(lambda: len(pub.publisher.registry) == LISTENERS, timeout=60)
        connected_in = time.monotonic() - started
        gc.collect()
        after = rss_bytes()
        per_listener = (after - before) / LISTENERS

        await fleet.reset(1)
        written = time.monotonic()
        await write(feed_dsn, [("vm", [], "a-broadcast-to-everyone")])
        report = await fleet.wait(60)
        assert report["complete"], f"{sum(report['items'])} of {LISTENERS} received"
        assert report["items"] == [1] * LISTENERS
        fanned_out_in = max(report["done_at"]) - written
        print(
            f"\n{LISTENERS} listeners: registered in {connected_in:.1f}s; publisher RSS "
            f"{before / 2**20:.0f} MiB -> {after / 2**20:.0f} MiB = "
            f"{per_listener / 1024:.1f} KiB per listener; one entry reached all of them "
            f"{fanned_out_in * 1000:.0f} ms after its commit"
        )
        # A listener costs a few tens of KiB (two tasks, the server's protocol objects,
        # the outbox); well under 100 KiB, or thousands would not fit one process.
        assert per_listener < 100 * 1024
        stats = pub.publisher.stats()
        assert stats["listeners"] == LISTENERS and stats["connections"] == LISTENERS

        closed = await fleet.close_all(timeout=30)
        assert closed == LISTENERS
        await wait_until(lambda: pub.publisher.connections == 0, timeout=60)
        assert len(pub.publisher.registry) == 0
