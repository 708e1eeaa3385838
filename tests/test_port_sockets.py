"""Bounding the unsent bytes of a server the publisher did not start (plain ASGI)."""

from __future__ import annotations

import ipaddress
import os
import socket
from collections.abc import Iterator

import pytest

from changefeed.port_sockets import Bounded, bound_unsent, connection_sockets, peer_of
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


def test_a_connection_is_found_by_its_peer_as_a_duplicate_of_its_own_socket(
    server: tuple[socket.socket, socket.socket, socket.socket],
) -> None:
    listening, accepted, client = server
    other = socket.create_connection(listening.getsockname())
    other_accepted, _ = listening.accept()
    with other, other_accepted:
        me = peer_of(client.getsockname())
        assert me is not None
        found = connection_sockets(listening.getsockname()[1], {me})
        assert list(found) == [me]
        sock = found[me]
        try:
            assert sock.fileno() != accepted.fileno()
            assert os.fstat(sock.fileno()).st_ino == os.fstat(accepted.fileno()).st_ino
            assert os.get_blocking(accepted.fileno())  # its flags as they were
        finally:
            sock.close()
        # Closing the duplicate left the server's own open.
        assert accepted.getpeername() == client.getsockname()


def test_a_peer_not_connected_to_the_port_finds_nothing(
    server: tuple[socket.socket, socket.socket, socket.socket],
) -> None:
    listening, _, _ = server
    stranger = peer_of(("127.0.0.1", 1))
    assert stranger is not None
    before = _open_fds()
    assert connection_sockets(listening.getsockname()[1], {stranger}) == {}
    assert _open_fds() == before


def test_an_asgi_client_address_is_a_peer_ipv4_mapped_or_not() -> None:
    v4 = ipaddress.ip_address("127.0.0.1")
    assert peer_of(("127.0.0.1", 5000)) == (v4, 5000)
    assert peer_of(["::ffff:127.0.0.1", 5000]) == (v4, 5000)
    assert peer_of(("::1", 80)) == (ipaddress.ip_address("::1"), 80)
    assert peer_of(None) is None
    assert peer_of(("unix-socket", 0)) is None


def test_an_ipv6_connection_is_found_too() -> None:
    try:
        listening = socket.create_server(("::1", 0), family=socket.AF_INET6)
    except OSError:
        pytest.skip("no IPv6 loopback")
    with listening, socket.create_connection(listening.getsockname()[:2]) as client:
        accepted, _ = listening.accept()
        with accepted:
            me = peer_of(client.getsockname()[:2])
            assert me is not None
            found = connection_sockets(listening.getsockname()[1], {me})
            assert list(found) == [me]
            found[me].close()
