"""Through plain ASGI, writes to a listener that is behind wait while its kernel holds the bound.

On real loopback sockets, without a server: the publisher finds the
connection's socket (changefeed.port_sockets), waits while the kernel holds
its ``TCP_NOTSENT_LOWAT`` unsent, and lets the socket go with the connection.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
from collections.abc import Iterator

import pytest
from helpers import wait_until

from changefeed.port_sockets import peer_of
from changefeed.publisher import unsent
from changefeed.publisher.unsent import ConnectionSockets, UnsentHold
from changefeed.tcp_liveness import notsent_lowat, unsent_bytes

LIMIT = 8_192


@pytest.fixture
def soon(monkeypatch: pytest.MonkeyPatch) -> None:
    """Let a socket go a moment after its listener caught up."""
    monkeypatch.setattr(unsent, "RELEASE_AFTER", 0.05)


@pytest.fixture
def connection() -> Iterator[tuple[socket.socket, socket.socket]]:
    """A server's end of a loopback connection (non-blocking) and its client's end."""
    listening = socket.create_server(("127.0.0.1", 0))
    client = socket.create_connection(listening.getsockname())
    accepted, _ = listening.accept()
    accepted.setblocking(False)
    try:
        yield accepted, client
    finally:
        for sock in (client, accepted, listening):
            sock.close()


def fill(sock: socket.socket) -> None:
    """Write until the kernel takes no more (the client reads nothing)."""
    with contextlib.suppress(BlockingIOError):
        while True:
            sock.send(b"x" * 65_536)


def drain(sock: socket.socket) -> None:
    sock.setblocking(False)
    with contextlib.suppress(BlockingIOError):
        while sock.recv(1 << 20):
            pass


def descriptors() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


async def test_writes_wait_while_the_kernel_holds_the_bound_and_go_on_once_it_is_sent(
    connection: tuple[socket.socket, socket.socket], soon: None
) -> None:
    accepted, client = connection
    before = descriptors()
    sockets = ConnectionSockets()
    peer = peer_of(client.getsockname())
    assert peer is not None
    hold = UnsentHold(sockets, accepted.getsockname()[1], peer, LIMIT)
    # Not bounded yet (the port's pass has not come): the hold sets the bound.
    assert notsent_lowat(accepted) == 0
    await asyncio.wait_for(hold.after_write(), 1)  # asks for the socket, returns
    fill(accepted)
    assert (unsent_bytes(accepted) or 0) >= LIMIT
    waiting = None
    async with asyncio.timeout(10):
        while waiting is None:
            attempt = asyncio.ensure_future(hold.after_write())
            done, _ = await asyncio.wait({attempt}, timeout=0.2)
            if not done:
                waiting = attempt  # found, and holding
    assert hold.holding and hold.limit == LIMIT
    assert notsent_lowat(accepted) == LIMIT
    assert len(descriptors() - before) == 1  # the duplicate it watches

    async def sent() -> bool:
        await asyncio.to_thread(drain, client)
        return waiting.done()

    await wait_until(sent, timeout=10)
    await waiting
    assert hold.holding
    hold.caught_up()  # its socket let go soon, unless it falls behind again
    assert not hold.holding
    assert len(descriptors() - before) == 1
    await wait_until(lambda: descriptors() == before, timeout=5)
    hold.close()
    await sockets.close()
    assert descriptors() == before
    assert accepted.getsockname()  # its own descriptor is still open


async def test_a_connection_that_ends_before_its_socket_is_found_leaves_nothing_open(
    connection: tuple[socket.socket, socket.socket], soon: None
) -> None:
    accepted, client = connection
    before = descriptors()
    sockets = ConnectionSockets()
    peer = peer_of(client.getsockname())
    assert peer is not None
    hold = UnsentHold(sockets, accepted.getsockname()[1], peer, LIMIT)
    await hold.after_write()
    hold.close()  # gone at once: the lookup under way is given up
    later = UnsentHold(sockets, accepted.getsockname()[1], peer, LIMIT)
    await later.after_write()
    await wait_until(lambda: bool(descriptors() - before), timeout=5)  # found for the later one
    later.close()  # found and never taken: closed too
    await sockets.close()
    assert descriptors() == before


async def test_a_socket_not_found_means_writes_go_on_as_before(soon: None) -> None:
    sockets = ConnectionSockets()
    stranger = peer_of(("127.0.0.1", 1))
    assert stranger is not None
    hold = UnsentHold(sockets, 1, stranger, LIMIT)
    await hold.after_write()

    async def given_up() -> bool:
        await hold.after_write()
        return hold.limit == 0

    await wait_until(given_up, timeout=5)
    assert not hold.holding
    hold.close()
    await sockets.close()
