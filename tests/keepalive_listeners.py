"""Websocket listeners that pause, then read at a pace, in a process of their own.

Run by tests/test_keepalive.py::

    python keepalive_listeners.py URL EXPECTED GROUP...

Each GROUP is ``COUNT:PAUSE:RATE:PINGS[:RCVBUF]``: COUNT listeners register
for every ``vm`` change (RFD 5's v1 registration, one item per frame), wait
PAUSE seconds once registered without reading, then read at most RATE items
per second (0: as fast as they can). PINGS is ``default`` (the websockets
library's own keepalive: a ping every 20 s, closing itself with 1011 when
the pong takes longer than 20 s) or ``none`` (only the server pings).
RCVBUF, when given, pins the socket's receive buffer to that many bytes
(``SO_RCVBUF``, set before connecting); otherwise Linux sizes it as it reads. The
process prints ``ready`` once all are registered, and one JSON line per
listener once it has EXPECTED items or its connection ended: how many items
it got, whether they were the burst's ids in order, once each, how its
connection ended, and the longest its own pings waited for a pong
(``pongWait``, seconds; 0 without pings of its own). Reading happens in
this process, so that the listeners' own work never shares the publisher's
event loop.
"""

from __future__ import annotations

import asyncio
import socket
import sys
import time
import urllib.parse
import uuid
from typing import Any

import orjson
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed

_STEP = 50
"""Items read between two looks at the pace."""


def burst_id(i: int) -> str:
    """The id of the burst's ``i``-th entry (tests/test_keepalive.py writes them)."""
    return f"burst-{i:06d}"


def pinned_socket(url: str, rcvbuf: int) -> socket.socket:
    """A TCP socket connected to ``url``'s host and port, its receive buffer pinned."""
    parts = urllib.parse.urlsplit(url)
    assert parts.hostname is not None and parts.port is not None
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)  # before the handshake
    sock.settimeout(10)  # a bounded connect; asyncio makes it non-blocking after
    sock.connect((parts.hostname, parts.port))
    return sock


async def listen(
    url: str,
    expected: int,
    plan: tuple[float, float, bool, int | None],
    registered: asyncio.Event,
) -> dict[str, Any]:
    pause, rate, pings, rcvbuf = plan
    registration = {
        "instance": str(uuid.uuid4()),
        "service": "keepalive",
        "changeKind": {"resource": "vm", "subResources": []},
    }
    got, in_order, latency = 0, True, 0.0
    closed: dict[str, Any] | None = None
    keepalive: dict[str, Any] = {} if pings else {"ping_interval": None}
    try:
        if rcvbuf is not None:
            keepalive["sock"] = pinned_socket(url, rcvbuf)
        async with connect(url, compression=None, open_timeout=60, **keepalive) as ws:
            await ws.send(orjson.dumps(registration).decode())
            orjson.loads(await ws.recv())
            registered.set()
            await asyncio.sleep(pause)
            started = time.monotonic()
            while got < expected:
                doc = orjson.loads(await ws.recv())
                in_order = in_order and doc.get("changedResourceId") == burst_id(got)
                got += 1
                latency = max(latency, ws.latency)
                if rate and got % _STEP == 0:
                    await asyncio.sleep(max(0.0, started + got / rate - time.monotonic()))
    except ConnectionClosed as exc:
        closed = {
            "received": exc.rcvd.code if exc.rcvd is not None else None,
            "sent": exc.sent.code if exc.sent is not None else None,
            "reason": str(exc),
        }
    return {
        "pause": pause,
        "rate": rate,
        "got": got,
        "inOrder": in_order,
        "closed": closed,
        "pongWait": round(latency, 3),
    }


async def main(url: str, expected: int, groups: list[str]) -> None:
    plans = []
    for group in groups:
        count, pause, rate, pings, *rcvbuf = group.split(":")
        pinned = int(rcvbuf[0]) if rcvbuf else None
        plans += [(float(pause), float(rate), pings == "default", pinned)] * int(count)
    events = [asyncio.Event() for _ in plans]
    tasks = [
        asyncio.create_task(listen(url, expected, plan, event))
        for plan, event in zip(plans, events, strict=True)
    ]
    await asyncio.wait_for(asyncio.gather(*(e.wait() for e in events)), 120)
    print("ready", flush=True)
    for done in asyncio.as_completed(tasks):
        print(orjson.dumps(await done).decode(), flush=True)


if __name__ == "__main__":
    try:  # what the listeners cost their own process is theirs, not the test's point
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    asyncio.run(main(sys.argv[1], int(sys.argv[2]), sys.argv[3:]))
