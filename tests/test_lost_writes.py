"""Listeners that reset their connections mid catch-up do not set the volume of the log.

Through plain ASGI the publisher learns that a connection is gone only once the
event loop has run the server's ``connection_lost``; until then each frame of a
turn is written into a dead transport, and asyncio logs every such write from
the fifth on ("socket.send() raised exception.", no peer, no traceback). While
a publisher runs, those lines are budgeted (``changefeed.lost_writes``).
"""

from __future__ import annotations

import asyncio
import logging
import socket
import struct

import asyncpg
import pytest
from helpers import wait_until
from publisher_fixtures import receive_items, registration, running_publisher
from websockets.asyncio.client import connect

from changefeed import lost_writes
from changefeed.publisher import publish_many

LISTENERS = 8
BURST = 5_000


async def test_listeners_resetting_mid_catch_up_write_a_bounded_number_of_lines(
    feed_dsn: str, caplog: pytest.LogCaptureFixture
) -> None:
    """8 RFD 5 listeners on plain ASGI read part of a 5,000-entry burst, then reset
    their connections: at most ``LOG_BURST`` lost-write lines, the rest counted in
    one summary when the publisher stops, and the filter gone with it."""
    caplog.set_level(logging.WARNING, logger="asyncio")
    caplog.set_level(logging.INFO, logger=lost_writes.log.name)
    async with running_publisher(feed_dsn, ws="asgi") as pub:
        clients = []
        for _ in range(LISTENERS):
            ws = await connect(pub.ws_url, open_timeout=10, compression=None, max_queue=None)
            await ws.send(registration())
            await asyncio.wait_for(ws.recv(), 10)  # the ack
            clients.append(ws)
        await wait_until(lambda: len(pub.publisher.registry) == LISTENERS, timeout=10)
        conn = await asyncpg.connect(feed_dsn)
        try:
            entries = [("vm", ("nic",), f"reset-{i}") for i in range(BURST)]
            async with conn.transaction():
                await publish_many(conn, entries)
        finally:
            await conn.close()
        # Each reads part of the burst, then resets its connection (SO_LINGER 0: RST)
        # while the publisher is still sending it the rest, a turn at a time.
        for ws in clients:
            await receive_items(ws, 300, timeout=30)
            sock = ws.transport.get_extra_info("socket")
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            ws.transport.abort()
        await wait_until(lambda: len(pub.publisher.registry) == 0, timeout=30)
        during = [r for r in caplog.records if r.getMessage() == lost_writes.MESSAGE]
        assert len(during) <= lost_writes.LOG_BURST
    # The publisher has stopped: what was held went out as one summary.
    held = [r for r in caplog.records if r.getMessage() == "asyncio.lost_writes_held"]
    total = sum(r.cf_fields["held"][lost_writes.MESSAGE] for r in held)  # type: ignore[attr-defined]
    print(f"\nlost-write lines: {len(during)} written, {total} held")
    # Without the budget each of these would have been a line of its own (about 120
    # per listener here); the summary is how the test knows the writes happened.
    assert len(during) == lost_writes.LOG_BURST and total > 0, (len(during), total)
    assert not logging.getLogger("asyncio").filters  # removed with the last publisher
