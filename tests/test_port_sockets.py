"""Bounding the unsent bytes of a server the publisher did not start (plain ASGI)."""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator

import pytest

from changefeed.port_sockets import Bounded, bound_unsent
from changefeed.tcp_liveness import notsent_lowat, set_notsent_lowat


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
