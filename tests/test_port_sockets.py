"""Bounding the unsent bytes of a server the publisher did not start (plain ASGI)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
from collections.abc import Iterator

import pytest

from changefeed.port_sockets import (
    Bounded,
    _canonical,
    _endpoint,
    bound_unsent,
    find_connections,
)
from changefeed.publisher.peer_sockets import PeerSockets
from changefeed.tcp_liveness import notsent_lowat, set_notsent_lowat
from changefeed.unsent_hold import UnsentHold


@pytest.fixture
def server() -> Iterator[tuple[socket.socket, socket.socket, socket.socket]]:
    """A listening socket on a free loopback port, one connection it accepted, and
    the client's end of it."""
    listening = socket.create_server(("127.0.0.1", 0))
    client = socket.create_connection(listening.getsockname())
    accepted, _ = listening.accept()
    try:
        yield listening, accepted, client
    finally:
        for sock in (client, accepted, listening):
            sock.close()


def test_the_listening_socket_and_the_connections_it_accepted_are_bounded(
    server: tuple[socket.socket, socket.socket, socket.socket],
) -> None:
    listening, accepted, client = server
    port = listening.getsockname()[1]
    done = bound_unsent(port, 16_384)
    assert done == Bounded(listening=1, connections=1, bounded=2)
    assert notsent_lowat(listening) == notsent_lowat(accepted) == 16_384
    # The client's end is another port's socket: left alone.
    assert notsent_lowat(client) == 0
    # What is accepted from now on inherits it from the listening socket.
    later = socket.create_connection(listening.getsockname())
    inherited, _ = listening.accept()
    with later, inherited:
        assert notsent_lowat(inherited) == 16_384
    # The descriptors found were duplicates: the server's own are still open.
    assert accepted.getsockname()[1] == port and listening.getsockname()[1] == port


def test_a_socket_with_a_bound_of_its_own_keeps_it(
    server: tuple[socket.socket, socket.socket, socket.socket],
) -> None:
    listening, accepted, _ = server
    assert set_notsent_lowat(listening, 65_536)
    done = bound_unsent(listening.getsockname()[1], 8_192)
    assert done == Bounded(listening=1, connections=1, bounded=1)
    assert notsent_lowat(listening) == 65_536 and notsent_lowat(accepted) == 8_192


def test_a_port_with_no_socket_in_this_process_finds_nothing() -> None:
    probe = socket.create_server(("127.0.0.1", 0))
    port = probe.getsockname()[1]
    probe.close()
    assert bound_unsent(port, 8_192) == Bounded(listening=0, connections=0, bounded=0)


def _open_fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


def test_it_leaves_no_descriptor_open_and_no_other_socket_changed(
    server: tuple[socket.socket, socket.socket, socket.socket],
) -> None:
    """Only the port's sockets are wrapped, each a duplicate closed at once: a
    blocking socket of someone else's stays blocking, even under
    ``socket.setdefaulttimeout`` (wrapping a descriptor then makes it non-blocking,
    for everyone sharing it)."""
    listening, _, _ = server
    other_a, other_b = socket.socketpair()
    elsewhere = socket.create_server(("127.0.0.1", 0))
    before = _open_fds()
    socket.setdefaulttimeout(5.0)
    try:
        assert bound_unsent(listening.getsockname()[1], 16_384) is not None
    finally:
        socket.setdefaulttimeout(None)
    with other_a, other_b, elsewhere:
        assert _open_fds() == before
        for sock in (other_a, other_b, elsewhere):
            assert os.get_blocking(sock.fileno())
            assert notsent_lowat(sock) in (0, None)


# -- one connection's socket, and waiting for its kernel (plain ASGI) ----------


def test_a_connection_is_found_by_its_peer_as_the_servers_own_descriptor(
    server: tuple[socket.socket, socket.socket, socket.socket],
) -> None:
    listening, accepted, client = server
    port = listening.getsockname()[1]
    peer = client.getsockname()
    found = find_connections(port, [peer, ("127.0.0.1", 1)], limit=12_288)
    assert found is not None and list(found) == [peer]  # nobody came from port 1
    (connection,) = found.values()
    assert connection.fd == accepted.fileno()  # the server's own, not a duplicate
    assert connection.inode == os.fstat(accepted.fileno()).st_ino
    # A connection without a bound of its own is given the limit.
    assert connection.notsent_lowat == notsent_lowat(accepted) == 12_288
    # The listening socket is not a connection; and no descriptor was left open.
    assert find_connections(port, [listening.getsockname()]) == {}


def test_a_peer_is_found_whichever_way_its_address_is_written() -> None:
    assert _endpoint("0100007F:1F90") == ("127.0.0.1", 8080)
    # An IPv4 peer of a dual-stack socket, as the kernel's tcp6 table shows it.
    assert _endpoint("0000000000000000FFFF00000100007F:C350") == ("127.0.0.1", 50000)
    assert _endpoint("00000000000000000000000001000000:0050") == ("::1", 80)
    assert _canonical("::ffff:10.0.0.1") == _canonical("10.0.0.1") == "10.0.0.1"
    assert _canonical("fe80::1%eth0") == "fe80::1"
    assert _canonical("not an address") == "not an address"


def _fill(sock: socket.socket) -> None:
    """Write to ``sock`` until its kernel refuses more (its peer reads nothing)."""
    sock.setblocking(False)
    with contextlib.suppress(BlockingIOError):
        while True:
            sock.send(b"x" * 4096)


async def test_a_hold_waits_until_the_kernel_holds_less_than_its_limit(
    server: tuple[socket.socket, socket.socket, socket.socket],
) -> None:
    listening, accepted, client = server
    (found,) = (
        find_connections(listening.getsockname()[1], [client.getsockname()], 8_192) or {}
    ).values()
    hold = UnsentHold(found)
    assert not hold.too_much()
    _fill(accepted)
    assert hold.too_much()
    descriptors = _open_fds()
    waiting = asyncio.create_task(hold.room())
    await asyncio.sleep(0.05)
    assert not waiting.done()
    assert len(_open_fds()) == len(descriptors) + 1  # a duplicate, watched while it waits
    client.setblocking(False)
    async with asyncio.timeout(5):
        while not waiting.done():
            with contextlib.suppress(BlockingIOError):
                client.recv(65_536)
            await asyncio.sleep(0.001)
    assert not hold.too_much()
    assert _open_fds() == descriptors  # the duplicate closed


async def test_a_hold_whose_descriptor_names_another_socket_now_holds_nothing(
    server: tuple[socket.socket, socket.socket, socket.socket],
) -> None:
    listening, accepted, client = server
    (found,) = (
        find_connections(listening.getsockname()[1], [client.getsockname()], 8_192) or {}
    ).values()
    hold = UnsentHold(found)
    _fill(accepted)
    assert hold.too_much()
    # The server closes it, and the descriptor's number goes to another socket.
    other_a, other_b = socket.socketpair()
    with other_a, other_b:
        os.dup2(other_a.fileno(), found.fd)
        assert not hold.too_much() and hold.gone
        await asyncio.wait_for(hold.room(), 1)  # nothing to wait for


async def test_the_sockets_of_listeners_that_ask_together_are_found_in_one_pass(
    server: tuple[socket.socket, socket.socket, socket.socket],
) -> None:
    listening, _, client = server
    port = listening.getsockname()[1]
    second = socket.create_connection(listening.getsockname())
    accepted, _ = listening.accept()
    with second, accepted:
        sockets = PeerSockets(8_192)
        asked = [sockets.find(port, client.getsockname()), sockets.find(port, second.getsockname())]
        passes = [t for t in asyncio.all_tasks() if t.get_name() == "changefeed-peer-sockets"]
        assert len(passes) == 1
        found = await asyncio.wait_for(asyncio.gather(*asked), 5)
        assert all(isinstance(hold, UnsentHold) for hold in found)
        assert await sockets.find(port, ("127.0.0.1", 1)) is None
        # notsent_lowat = 0: the server's sockets are left alone, nothing is looked for.
        assert await PeerSockets(0).find(port, client.getsockname()) is None
        await sockets.close()
