"""A sender's direct turn of single-item frames goes out in pieces, and ends at the
first piece the kernel does not take whole: the rest stays queued in the
publisher, not in the transport ahead of the listener's pings. Pure logic: the
writer is a stand-in that takes a set number of bytes."""

from __future__ import annotations

from changefeed.publisher.connection import _FRAMES_PER_TURN, _PIECE_LIMITS, _DirectSender
from changefeed.publisher.delivery import Delivery
from changefeed.publisher.entries import Item
from changefeed.publisher.matching import Interest
from changefeed.publisher.wire import BatchFrames
from changefeed.schemas import ChangeKind, Position

LIMIT = 8 * 1024
ORIGIN = Position(100, 0)


class Kernel:
    """A FrameWriter whose kernel takes ``room`` bytes, then refuses: what it refuses
    waits in the transport (``backlogged``)."""

    def __init__(self, room: int, unsent_limit: int = LIMIT) -> None:
        self.room = room
        self.unsent_limit = unsent_limit
        self.writes: list[int] = []
        self.in_transport = 0
        self.open = True
        self.lost = False

    def write(self, data: bytes) -> None:
        self.writes.append(len(data))
        taken = min(self.room, len(data))
        self.room -= taken
        self.in_transport += len(data) - taken

    def backlogged(self) -> bool:
        return self.in_transport > 0

    def buffered(self) -> int:
        return self.in_transport

    def hold_while_unsent(self) -> bool:
        return False


def queued(count: int, batch: bool = False) -> Delivery:
    """A live delivery with ``count`` items of about 220 bytes queued."""
    delivery = Delivery(
        Interest([ChangeKind("vm", ())]), ORIGIN, ORIGIN, capacity=1000, batch=batch
    )
    assert delivery.offer([Item(f'{{"id":"{n:0200d}"}}', 0.0) for n in range(count)])
    return delivery


def sender(delivery: Delivery, kernel: Kernel) -> _DirectSender:
    return _DirectSender(delivery, kernel, 100, BatchFrames())


def test_a_reader_that_keeps_up_gets_the_whole_turn_in_pieces() -> None:
    delivery, kernel = queued(300), Kernel(room=1 << 30)
    direct = sender(delivery, kernel)
    direct.write_turn()
    assert len(delivery.queue) == 300 - _FRAMES_PER_TURN
    assert len(kernel.writes) > 1
    assert max(kernel.writes[1:]) <= _PIECE_LIMITS * LIMIT + 256


def test_the_turn_ends_at_the_first_piece_the_kernel_refuses() -> None:
    delivery, kernel = queued(300), Kernel(room=LIMIT)
    direct = sender(delivery, kernel)
    direct.write_turn()
    # The kernel took its limit: the piece that crossed it is the last one written,
    # and what the transport holds is less than one piece.
    assert kernel.in_transport < _PIECE_LIMITS * LIMIT + 256
    assert len(delivery.queue) > 300 - _FRAMES_PER_TURN  # the rest waits in the queue
    written = sum(kernel.writes)
    direct.write_turn()  # backlogged now: the next turn writes one piece at most
    assert sum(kernel.writes) - written <= _PIECE_LIMITS * LIMIT + 256


def test_a_batch_listener_gets_one_frame_per_turn() -> None:
    delivery, kernel = queued(300, batch=True), Kernel(room=LIMIT)
    direct = sender(delivery, kernel)
    direct.write_turn()
    assert len(kernel.writes) == 1
    assert len(delivery.queue) == 200  # max_batch items in one frame


def test_a_listener_catching_up_gets_its_turn_in_pieces_too() -> None:
    behind = Delivery(Interest([ChangeKind("vm", ())]), ORIGIN, Position(100, 500), capacity=1000)
    assert not behind.live
    behind.queue.extend(Item(f'{{"id":"{n:0200d}"}}', 0.0) for n in range(300))
    kernel = Kernel(room=LIMIT)
    sender(behind, kernel).write_turn()
    assert kernel.in_transport < _PIECE_LIMITS * LIMIT + 256
    assert len(behind.queue) > 300 - _FRAMES_PER_TURN


def test_without_an_unsent_limit_the_turn_is_one_write() -> None:
    delivery, kernel = queued(300), Kernel(room=1 << 30, unsent_limit=0)
    direct = sender(delivery, kernel)
    direct.write_turn()
    assert kernel.writes and len(kernel.writes) == 1
    assert len(delivery.queue) == 300 - _FRAMES_PER_TURN
