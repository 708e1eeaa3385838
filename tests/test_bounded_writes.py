"""Bounded writes: the kernel holds at most its unsent limit and one write for a peer
that does not read, the rest waits in the transport, and the transport's
descriptor is never closed by the socket borrowed on it."""

from __future__ import annotations

import asyncio
import gc
import socket
import ssl
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from test_deploy_support import make_certificate

from changefeed.bounded_writes import BoundedWrites
from changefeed.tcp_liveness import set_notsent_lowat, unsent_bytes

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="MSG_EOR bounds segments on Linux")

LIMIT = 8 * 1024
WRITE = 3_000


@dataclass
class Pair:
    transport: asyncio.Transport
    peer: socket.socket


async def serve(
    listening: socket.socket, tls: ssl.SSLContext | None = None
) -> tuple[asyncio.Server, asyncio.Future[asyncio.Transport]]:
    """An asyncio server on ``listening`` whose protocol reads nothing, and the
    transport of the first connection it accepts."""
    accepted: asyncio.Future[asyncio.Transport] = asyncio.get_running_loop().create_future()

    class Quiet(asyncio.Protocol):
        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            assert isinstance(transport, asyncio.Transport)
            accepted.set_result(transport)

    server = await asyncio.get_running_loop().create_server(Quiet, sock=listening, ssl=tls)
    return server, accepted


@pytest.fixture
async def pair() -> AsyncIterator[Pair]:
    """A server-side asyncio transport whose peer, a plain socket, reads nothing."""
    listening = socket.create_server(("127.0.0.1", 0))
    assert set_notsent_lowat(listening, LIMIT)
    srv, accepted = await serve(listening)
    peer = socket.create_connection(listening.getsockname()[:2])
    peer.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 * 1024)
    try:
        transport = await asyncio.wait_for(accepted, 5)
        yield Pair(transport, peer)
        transport.abort()
    finally:
        peer.close()
        srv.close()
        await srv.wait_closed()


async def test_the_kernel_holds_no_more_than_its_limit_and_one_write_unsent(pair: Pair) -> None:
    writes = BoundedWrites.of(pair.transport)
    assert writes is not None
    sock = pair.transport.get_extra_info("socket")
    for _ in range(200):  # 600 KB: far past the peer's receive buffer and the limit
        writes.write(b"x" * WRITE)
    unsent = unsent_bytes(sock)
    assert unsent is not None
    assert unsent <= LIMIT + WRITE, unsent
    assert pair.transport.get_write_buffer_size() > 0  # the rest waits in the transport


async def test_without_the_flag_the_kernel_appends_past_its_limit(pair: Pair) -> None:
    """The baseline the bounded writes exist for: the same writes through the
    transport alone leave more than the limit and one write unsent."""
    sock = pair.transport.get_extra_info("socket")
    for _ in range(200):
        pair.transport.write(b"x" * WRITE)
    unsent = unsent_bytes(sock)
    assert unsent is not None
    assert unsent > LIMIT + WRITE, unsent


async def test_the_bytes_arrive_whole_and_in_order(pair: Pair) -> None:
    writes = BoundedWrites.of(pair.transport)
    assert writes is not None
    chunks = [bytes([n]) * (WRITE + n) for n in range(100)]
    for chunk in chunks:
        writes.write(chunk)
    expected = b"".join(chunks)
    received = bytearray()
    pair.peer.setblocking(False)
    loop = asyncio.get_running_loop()
    async with asyncio.timeout(10):
        while len(received) < len(expected):
            received += await loop.sock_recv(pair.peer, 1 << 16)
    assert bytes(received) == expected


async def test_the_borrowed_socket_never_closes_the_transports_descriptor(pair: Pair) -> None:
    sock = pair.transport.get_extra_info("socket")
    for _ in range(2):
        writes = BoundedWrites.of(pair.transport)
        assert writes is not None
        del writes  # collected without release()
        gc.collect()
    released = BoundedWrites.of(pair.transport)
    assert released is not None
    released.release()
    released.write(b"after release")  # through the transport alone
    del released
    gc.collect()
    pair.transport.write(b"still open")
    assert sock.fileno() >= 0
    pair.peer.settimeout(5)
    data = b""
    while not data.endswith(b"still open"):
        data += pair.peer.recv(100)
    assert data == b"after releasestill open"


async def test_a_default_socket_timeout_never_makes_a_refused_write_wait(pair: Pair) -> None:
    previous = socket.getdefaulttimeout()
    socket.setdefaulttimeout(30.0)  # one refused write waiting for it fails the bound below
    try:
        writes = BoundedWrites.of(pair.transport)
    finally:
        socket.setdefaulttimeout(previous)
    assert writes is not None
    started = time.monotonic()
    for _ in range(200):  # refused past the limit: each refusal must return at once
        writes.write(b"x" * WRITE)
    assert time.monotonic() - started < 10
    assert pair.transport.get_write_buffer_size() > 0


async def test_a_tls_transport_is_never_written_to_directly(tmp_path: Path) -> None:
    """Its socket carries TLS records: bytes written there would reach the peer
    unencrypted, and break the stream."""
    made = make_certificate(tmp_path)
    if made is None:
        pytest.skip("no openssl")
    cert, key = made
    server_tls = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server_tls.load_cert_chain(cert, key)
    listening = socket.create_server(("127.0.0.1", 0))
    srv, accepted = await serve(listening, server_tls)
    client_tls = ssl.create_default_context(cafile=str(cert))
    port = listening.getsockname()[1]
    _reader, writer = await asyncio.open_connection("127.0.0.1", port, ssl=client_tls)
    try:
        transport = await asyncio.wait_for(accepted, 10)
        assert transport.get_extra_info("socket") is not None  # there is one to misuse
        assert BoundedWrites.of(transport) is None
    finally:
        writer.close()
        srv.close()
        await srv.wait_closed()
