"""A listener that reads is never cut off by either end's keepalive, and stats count what it took.

A websocket ping, or the pong to a listener's ping, waits behind every byte
sent before it. The publisher keeps what the kernel holds unsent for a
listener small (``TCP_NOTSENT_LOWAT``) and what its transport holds too, so
that a pong waits behind that and the listener's own receive buffer, not
behind megabytes; and its own pings give up only on a connection that makes
no progress (changefeed.tcp_liveness). Stats count an item as delivered once
the listener's TCP has acknowledged it, not once it was written.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import asyncpg
import orjson
import pytest
from helpers import wait_until
from keepalive_listeners import burst_id
from publisher_fixtures import (
    connect_not_reading,
    receive_items,
    register,
    registration,
    running_publisher,
)
from servers import leave_signals_to_pytest
from starlette.applications import Starlette
from uvicorn.protocols.websockets.websockets_sansio_impl import WebSocketsSansIOProtocol
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed

from changefeed.publisher import publish_many
from changefeed.publisher.inflight import InFlight
from changefeed.serving import DrainingServer, server_config
from changefeed.tcp_liveness import NOTSENT_LOWAT, PingWatch, notsent_lowat, unsent_bytes

LISTENERS = Path(__file__).with_name("keepalive_listeners.py")

PRODUCTION_PINGS = {"ws_ping_interval": 20.0, "ws_ping_timeout": 20.0}
"""The publisher's own keepalive (changefeed.serving.server_config)."""


async def publish_burst(dsn: str, count: int) -> None:
    """``count`` entries in one transaction, ids ``burst_id(0...)`` in feed order."""
    conn = await asyncpg.connect(dsn)
    try:
        async with conn.transaction():
            await publish_many(conn, [("vm", ["nic"], burst_id(i)) for i in range(count)])
    finally:
        await conn.close()


@contextlib.asynccontextmanager
async def listeners(url: str, expected: int, *groups: str) -> AsyncIterator[Any]:
    """keepalive_listeners.py's listeners, registered and paused, in another process;
    yields a function that awaits their results."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, str(LISTENERS), url, str(expected), *groups, stdout=asyncio.subprocess.PIPE
    )
    count = sum(int(group.split(":")[0]) for group in groups)

    async def results(timeout: float) -> list[dict[str, Any]]:
        assert proc.stdout is not None
        found = []
        async with asyncio.timeout(timeout):
            for _ in range(count):
                found.append(orjson.loads(await proc.stdout.readline()))
        return found

    try:
        assert proc.stdout is not None
        line = await asyncio.wait_for(proc.stdout.readline(), 120)
        assert line == b"ready\n", line
        yield results
    finally:
        if proc.returncode is None:
            proc.kill()
        await proc.wait()


def cut_off(found: list[dict[str, Any]], expected: int) -> list[dict[str, Any]]:
    """The listeners that did not get every item once, in order."""
    return [r for r in found if r["got"] != expected or not r["inOrder"] or r["closed"]]


# -- the pure parts ------------------------------------------------------------


def quiet_deadlines(watch: PingWatch, acked: int | None, received: int) -> int:
    """Deadlines with no progress until the watch gives up (at most 10)."""
    for n in range(1, 11):
        if watch.expired(acked, received):
            return n
    return 0


def test_a_ping_watch_keeps_a_connection_whose_peer_takes_more_or_speaks() -> None:
    """However long the pong takes, a listener that keeps reading (its TCP
    acknowledges more) or speaking stays."""
    watch = PingWatch()
    watch.sent(acked=1_000, received=50)
    acked = 1_000
    for _ in range(10 * PingWatch.PATIENCE):
        assert not watch.expired(acked=acked, received=50)  # a quiet deadline
        acked += 4_096
        assert not watch.expired(acked=acked, received=50)  # it read on: progress
    for _ in range(PingWatch.PATIENCE):
        assert not watch.expired(acked=acked, received=50)
    assert not watch.expired(acked=acked, received=56)  # it sent a ping of its own


def test_a_ping_watch_gives_up_after_patience_deadlines_without_progress() -> None:
    """A listener reading its way through its own receive buffer shows nothing on
    the publisher's side; nor does a gone or hung one. The ping decides only after
    PATIENCE + 1 deadlines in a row without progress, and progress starts the
    count again."""
    watch = PingWatch()
    watch.sent(acked=1_000, received=50)
    assert quiet_deadlines(watch, 1_000, 50) == PingWatch.PATIENCE + 1
    watch.sent(acked=1_000, received=50)
    for _ in range(PingWatch.PATIENCE):
        assert not watch.expired(acked=1_000, received=50)
    assert not watch.expired(acked=1_006, received=50)  # the ping itself acknowledged
    assert quiet_deadlines(watch, 1_006, 50) == PingWatch.PATIENCE + 1


def test_a_ping_watch_without_tcp_figures_goes_by_what_the_peer_sends() -> None:
    watch = PingWatch()
    watch.sent(acked=None, received=0)
    assert not watch.expired(acked=None, received=10)
    assert quiet_deadlines(watch, None, 10) == PingWatch.PATIENCE + 1


def test_in_flight_counts_an_item_taken_once_its_last_byte_is_acknowledged() -> None:
    ledger = InFlight()
    ledger.wrote(100, 2, first_published=10.0)
    ledger.wrote(300, 3, first_published=11.0)
    assert ledger.settle(outstanding=400) == 5
    assert ledger.oldest() == 10.0
    assert ledger.settle(outstanding=350) == 5  # half of the first write taken: not its items
    assert ledger.settle(outstanding=300) == 3
    assert ledger.oldest() == 11.0
    assert ledger.settle(outstanding=0) == 0
    assert ledger.oldest() is None


def test_in_flight_stays_small_and_errs_towards_untaken() -> None:
    ledger = InFlight()
    for i in range(10 * InFlight.CROWDED):
        ledger.wrote(10, 1, first_published=float(i))
    assert ledger.crowded
    # Merged writes: what is outstanding is never reported as taken.
    assert ledger.settle(outstanding=15) >= 2
    assert ledger.settle(outstanding=0) == 0
    assert not ledger.crowded


# -- on real sockets -------------------------------------------------------------


async def test_stats_count_what_a_listener_has_taken_not_what_waits_in_buffers(
    feed_dsn: str,
) -> None:
    """A listener that reads nothing: what the publisher wrote to its socket waits
    in buffers, and stats say it has not been delivered (delivered, queue depth,
    lag). Once it reads everything, stats say so."""
    total = 5_000
    async with running_publisher(feed_dsn, queue_size=1_000) as pub:
        ws = await connect_not_reading(pub.ws_url)
        await ws.send(registration(subs=[]))
        await asyncio.wait_for(ws.recv(), 10)  # the ack
        await publish_burst(feed_dsn, total)
        delivery = next(iter(pub.publisher.registry)).delivery
        tailer = pub.publisher.tailer
        await wait_until(
            lambda: tailer.entries_total >= total and delivery.sent > 0 and not delivery.live,
            timeout=30,
        )
        (row,) = pub.publisher.stats()["registrations"]
        # Its socket holds what it has not read: a 16 KiB receive buffer, one
        # frame in the client library, and what the publisher's kernel holds
        # unsent (TCP_NOTSENT_LOWAT, 32 KiB): a few hundred ~250-byte items at most.
        assert row["delivered"] < 1_000, row
        assert row["delivered"] < delivery.sent, row
        # And what waits below the publisher is bounded too (the kernel's unsent
        # part, the transport's buffer): the rest waits in the publisher.
        assert delivery.sent - row["delivered"] < 1_000, (delivery.sent, row)
        assert row["state"] == "catching_up", row
        assert row["lagEntries"] >= total - row["delivered"], row
        assert row["queueDepth"] >= delivery.sent - row["delivered"], row
        assert row["lagSeconds"] is not None and row["lagSeconds"] >= 0, row
        # Now it reads all of it.
        ws.transport.resume_reading()
        items = await receive_items(ws, total, timeout=60)
        assert [i["changedResourceId"] for i in items] == [burst_id(i) for i in range(total)]

        def caught_up() -> bool:
            (row,) = pub.publisher.stats()["registrations"]
            return bool(row["delivered"] == total and row["lagEntries"] == 0)

        await wait_until(caught_up, timeout=10)
        (row,) = pub.publisher.stats()["registrations"]
        assert row["queueDepth"] == 0 and row["state"] == "live", row
        await ws.close()


async def test_a_listener_reading_its_own_full_buffer_is_not_cut_off_by_the_publishers_pings(
    feed_dsn: str,
) -> None:
    """Everything sent has reached the listener's receive buffer (a large one), and
    a ping waits behind it while the listener does not read: nothing on the
    publisher's side shows progress then, but the listener is no more gone than
    one reading slowly. It gets a few deadlines to reach the ping; then reads
    everything, answers, and stays."""
    total = 2_000  # ~500 KB: all of it fits in the listener's receive buffer
    pings = {"ws_ping_interval": 1.0, "ws_ping_timeout": 1.0}
    async with running_publisher(feed_dsn, server=pings) as pub:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 20)
        sock.setblocking(False)
        await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", pub.server.port))
        ws = await connect(pub.ws_url, sock=sock, compression=None, ping_interval=None)
        await ws.send(registration(subs=[]))
        await asyncio.wait_for(ws.recv(), 10)  # the ack
        ws.transport.pause_reading()
        await publish_burst(feed_dsn, total)
        delivery = next(iter(pub.publisher.registry)).delivery
        await wait_until(lambda: delivery.sent == total and delivery.untaken() == 0, timeout=30)
        # All of it acknowledged, none of it read: a ping's first deadline passes.
        await asyncio.sleep(2.5)
        ws.transport.resume_reading()
        items = await receive_items(ws, total, timeout=30)
        assert [i["changedResourceId"] for i in items] == [burst_id(i) for i in range(total)]
        await asyncio.sleep(2.5)  # more pings, answered now
        assert len(pub.publisher.registry) == 1
        assert pub.publisher.stats()["counters"]["evictions"] == 0
        await ws.close()


async def test_a_peer_flooding_pings_and_reading_no_pongs_is_read_no_further_and_let_go(
    feed_dsn: str,
) -> None:
    """Every ping read is answered with a pong at once, whatever the transport holds:
    a peer that floods pings and reads nothing would grow the publisher's memory
    without bound. Past a backlog its frames are not read (it can send only what the
    kernels' buffers take); making no progress, it is let go by its pings' deadlines,
    as an eviction; a listener beside it is served throughout."""
    pings = {"ws_ping_interval": 0.5, "ws_ping_timeout": 0.5}
    async with running_publisher(feed_dsn, server=pings) as pub:
        healthy, _ = await register(pub.ws_url, registration(subs=[]))
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.setblocking(False)
        await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", pub.server.port))
        flooder = await connect(pub.ws_url, sock=sock, compression=None, ping_interval=None)
        await flooder.send(registration(resource="network", subs=[]))
        await asyncio.wait_for(flooder.recv(), 10)  # the ack
        flooder.transport.pause_reading()
        sent, cap = 0, 64 << 20
        while sent < cap:
            try:
                # Returns once written; waits while the client's own buffer is full.
                await asyncio.wait_for(flooder.ping(sent.to_bytes(125)), 2)
            except (TimeoutError, ConnectionClosed):
                break  # the publisher reads no more of it (or let it go already)
            sent += 131  # a masked frame of 125 bytes
        assert sent < 8 << 20, f"the publisher read {sent:,} bytes of pings it could not answer"

        def let_go() -> bool:
            evictions = pub.publisher.stats()["counters"]["evictionsByCode"]
            return bool(evictions.get("keepalive_timeout") == 1)

        await wait_until(let_go, timeout=30)
        (evicted,) = pub.publisher.stats()["recentEvictions"]
        assert evicted["code"] == "keepalive_timeout", evicted
        await publish_burst(feed_dsn, 1)
        (item,) = await receive_items(healthy, 1, timeout=10)
        assert item["changedResourceId"] == burst_id(0)
        assert len(pub.publisher.registry) == 1
        await healthy.close()
        flooder.transport.abort()


async def test_through_plain_asgi_a_listener_the_servers_keepalive_closed_is_gone_not_an_error(
    feed_dsn: str, caplog: pytest.LogCaptureFixture
) -> None:
    """uvicorn's own keepalive closes a listener that answers no ping. Through plain
    ASGI the publisher's next send to it is refused while the close waits on what
    the listener does not read (uvicorn raises RuntimeError there, not the OSError
    the ASGI spec asks for): that is a listener gone, as one that leaves mid-send
    is, not an internal error logged with a traceback; the listener beside it is
    served on."""
    caplog.set_level(logging.INFO, logger="changefeed")
    async with running_publisher(feed_dsn, ws="asgi") as pub:
        healthy, _ = await register(pub.ws_url, registration(subs=[]))
        deaf = await connect_not_reading(pub.ws_url, ping_interval=None)
        await deaf.send(registration(resource="vm", subs=[]))
        await asyncio.wait_for(deaf.recv(), 10)  # the ack
        (server_side,) = [
            c
            for c in pub.server.server.server_state.connections
            if c.transport.get_extra_info("peername") == deaf.local_address
        ]
        assert isinstance(server_side, WebSocketsSansIOProtocol)
        deaf.transport.pause_reading()  # reads nothing, answers no ping from now on
        sent = 0
        async with asyncio.timeout(30):
            # Until the kernels take no more and uvicorn's transport holds some, below
            # the mark where its sends wait: its close will wait on that.
            while not server_side.transport.get_write_buffer_size():
                await publish_burst(feed_dsn, 20)
                sent += 20
                await asyncio.sleep(0.1)  # the burst's sends; the buffer ends the loop
            # uvicorn's keepalive gives up on it (what its ping deadline does, now):
            # a close frame, and a close that waits on what the transport holds.
            server_side.keepalive_timeout()
            await publish_burst(feed_dsn, 1)
            sent += 1
            await wait_until(lambda: len(pub.publisher.registry) == 1, timeout=20)
        errors = [r for r in caplog.records if r.getMessage() == "listener.error"]
        assert errors == [], [r.exc_info for r in errors]
        (gone,) = [r for r in caplog.records if r.getMessage() == "listener.disconnected"]
        assert gone.cf_fields["reason"] == "gone mid-send", gone.cf_fields  # type: ignore[attr-defined]
        items = await receive_items(healthy, sent, timeout=20)
        assert len(items) == sent
        await healthy.close()
        deaf.transport.abort()


async def test_a_draining_server_bounds_what_the_kernel_holds_unsent_for_each_connection() -> None:
    """``changefeed serve``'s server sets TCP_NOTSENT_LOWAT on its listening
    sockets, which every connection accepted from them inherits, whatever
    protocol then serves it."""
    server = DrainingServer(
        server_config(Starlette(), "127.0.0.1", 0, loop="asyncio"), [], notsent_lowat=24_576
    )
    leave_signals_to_pytest(server)
    task = asyncio.create_task(server.serve())
    try:
        await wait_until(lambda: server.started, timeout=15)
        (listening,) = [sock for srv in server.servers for sock in srv.sockets]
        assert notsent_lowat(listening) == 24_576
    finally:
        server.should_exit = True
        await asyncio.wait_for(task, 20)


@pytest.mark.parametrize("limit", [12_288, 0])
async def test_through_plain_asgi_the_publisher_bounds_the_sockets_of_the_port_listeners_use(
    feed_dsn: str, limit: int
) -> None:
    """On a server it did not start (an embedding API's uvicorn), the publisher
    sets TCP_NOTSENT_LOWAT on the listening socket of the port its first listener
    came through, and on that connection; ``notsent_lowat = 0`` leaves them alone."""
    async with running_publisher(feed_dsn, ws="asgi", notsent_lowat=limit) as pub:
        (listening,) = [sock for srv in pub.server.server.servers for sock in srv.sockets]
        assert notsent_lowat(listening) == 0
        ws, ack = await register(pub.ws_url, registration())
        async with ws:
            assert ack["cursor"]
            accepted = [
                s
                for s in pub.server.server.server_state.connections
                if s.transport.get_extra_info("peername") == ws.local_address
            ]
            (sock,) = [a.transport.get_extra_info("socket") for a in accepted]
            if not limit:
                # Nothing was even scheduled (a pass is a task, started at the handshake).
                passes = [t for t in asyncio.all_tasks() if "bound-port" in t.get_name()]
                assert passes == []
                assert notsent_lowat(listening) == notsent_lowat(sock) == 0
                return
            # Off the event loop: bounded shortly after the listener came.
            await wait_until(lambda: notsent_lowat(listening) == limit, timeout=5)
            await wait_until(lambda: notsent_lowat(sock) == limit, timeout=5)
            # A connection that missed it (completed by the kernel, not yet accepted,
            # when the listening socket was bounded) gets it from the pass the next
            # listener asks for, at most a second later.
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NOTSENT_LOWAT, 0)
            later, _ = await register(pub.ws_url, registration(instance="later"))
            async with later:
                await wait_until(lambda: notsent_lowat(sock) == limit, timeout=5)


def descriptors_of(sock: socket.socket) -> int:
    """This process's descriptors of ``sock``'s socket (its own, and duplicates)."""
    name = f"socket:[{os.fstat(sock.fileno()).st_ino}]"
    count = 0
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            count += os.readlink(f"/proc/self/fd/{fd}") == name
    return count


async def test_what_the_kernel_holds_unsent_for_a_slow_reader_stays_near_its_limit(
    feed_dsn: str,
) -> None:
    """A listener reading slowly behind a backlog: whatever the kernel holds unsent
    for it waits ahead of its pings' answers. ``TCP_NOTSENT_LOWAT`` alone lets
    writes pile onto the kernel's last segment, as large as 64 KiB. The publisher
    holds its writes while the limit is reached (watching a duplicate of the
    socket's descriptor while it waits), and cuts its turns to it once the
    listener has shown it is slow. The kernel then never holds twice the limit."""
    total = 6_000
    async with running_publisher(feed_dsn) as pub:
        # The default receive buffer: the kernel then builds segments as large as
        # 64 KiB (half the peer's largest window), and writes pile onto the last.
        client = await connect(pub.ws_url, max_queue=1, compression=None)
        await client.send(registration(subs=[]))
        await asyncio.wait_for(client.recv(), 10)  # the ack
        (accepted,) = [
            s
            for s in pub.server.server.server_state.connections
            if s.transport.get_extra_info("peername") == client.local_address
        ]
        server_socket = accepted.transport.get_extra_info("socket")
        await wait_until(lambda: notsent_lowat(server_socket) == NOTSENT_LOWAT, timeout=5)
        await publish_burst(feed_dsn, total)
        items: list[dict[str, Any]] = []
        samples: list[int] = []
        duplicated = False

        async def watch() -> None:
            nonlocal duplicated
            while True:
                # Past what was written before it showed it is slow.
                if len(items) > total // 2:
                    samples.append(unsent_bytes(server_socket) or 0)
                if len(samples) % 10 == 0:
                    duplicated = duplicated or descriptors_of(server_socket) > 1
                await asyncio.sleep(0.002)

        watcher = asyncio.create_task(watch())
        try:
            async with asyncio.timeout(60):
                while len(items) < total:
                    items.append(orjson.loads(await client.recv()))
                    if len(items) % 10 == 0:
                        await asyncio.sleep(0.005)  # about 1,500 items/s
        finally:
            watcher.cancel()
        assert [i["changedResourceId"] for i in items] == [burst_id(i) for i in range(total)]
        assert duplicated  # the publisher watched the socket for writability
        assert len(samples) > 100, len(samples)
        assert max(samples) <= 2 * NOTSENT_LOWAT, max(samples)
        await client.close()


@pytest.mark.slow
async def test_listeners_paused_through_a_burst_then_reading_are_never_cut_off(
    feed_dsn: str,
) -> None:
    """200 listeners paused 20 s while a 10,000-entry burst is written, then
    reading as fast as they can, answer only the server's pings (20 s, 20 s):
    every one gets every entry once, in order, and the publisher evicts none."""
    total = 10_000
    async with (
        running_publisher(feed_dsn, server=PRODUCTION_PINGS) as pub,
        listeners(pub.ws_url, total, "200:20:0:none") as results,
    ):
        await publish_burst(feed_dsn, total)
        found = await results(timeout=240)
        assert cut_off(found, total) == [], cut_off(found, total)[:5]
        stats = pub.publisher.stats()
        assert stats["counters"]["evictions"] == 0, stats["recentEvictions"][:3]


@pytest.mark.slow
@pytest.mark.parametrize("ws", ["direct", "asgi"])
async def test_plain_clients_paused_through_a_burst_then_reading_never_close_themselves(
    feed_dsn: str, ws: str
) -> None:
    """50 plain websockets clients paused 25 s while a 10,000-entry burst is
    written, then reading at 500 items/s, ping the publisher themselves at the
    library's defaults (every 20 s, closing themselves after 20 s without a
    pong): their pongs wait behind little more than their own receive buffers,
    and every one gets every entry once, in order. Through plain ASGI too, on a
    server the publisher did not start (uvicorn as an embedding API runs it):
    there it bounds the port's sockets itself (changefeed.port_sockets)."""
    total = 10_000
    async with (
        running_publisher(feed_dsn, ws=ws, server=PRODUCTION_PINGS) as pub,
        listeners(pub.ws_url, total, "50:25:500:default") as results,
    ):
        await publish_burst(feed_dsn, total)
        found = await results(timeout=240)
        assert cut_off(found, total) == [], cut_off(found, total)[:5]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("ws", "rcvbuf"),
    [pytest.param("direct", "", id="direct"), pytest.param("asgi", ":262144", id="asgi")],
)
async def test_plain_clients_reading_through_a_50000_entry_burst_are_never_cut_off(
    feed_dsn: str, ws: str, rcvbuf: str
) -> None:
    """Ten plain websockets clients at their default keepalive, three of them
    reading slower than the others (900 items/s), through a 50,000-entry burst:
    none closes itself for a late pong, and each gets every entry once, in order
    (through plain ASGI too).

    A pong also waits behind what the client's own receive buffer holds, which
    no server can shorten: Linux grows the buffer of a client that reads in
    256 KiB gulps (as the websockets library does) up to ``net.ipv4.tcp_rmem``'s
    maximum, and at 900 items/s (about 135 KB/s) 3 MB alone is a 22 s wait. The
    fast path holds its writes to a listener that is behind, which keeps those
    buffers near 1 MB; through plain ASGI, where the publisher does not, they
    reach 2-3 MB, so there the slower three pin theirs to 256 KiB
    (``SO_RCVBUF``), and what the test measures is the publisher's part."""
    total = 50_000
    async with (
        running_publisher(feed_dsn, ws=ws, server=PRODUCTION_PINGS) as pub,
        listeners(pub.ws_url, total, "7:0:0:default", f"3:0:900:default{rcvbuf}") as results,
    ):
        await publish_burst(feed_dsn, total)
        found = await results(timeout=240)
        assert cut_off(found, total) == [], cut_off(found, total)[:5]
