"""When a plain-ASGI listener's sends wait for its kernel (pure policy, a stand-in kernel)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any, cast

from changefeed.publisher.delivery import Delivery
from changefeed.publisher.held_sends import HeldSends, KernelHold


class Kernel:
    """A kernel that holds ``unsent`` bytes; each ``room`` the listener takes ``reads``."""

    limit = 8_192

    def __init__(self, unsent: int, reads: int = 4_096) -> None:
        self.unsent = unsent
        self.reads = reads
        self.waits = 0

    def too_much(self) -> bool:
        return self.unsent >= self.limit

    async def room(self) -> None:
        self.waits += 1
        await asyncio.sleep(0.001)
        self.unsent = max(0, self.unsent - self.reads)


def delivery(*, live: bool, queued: int) -> Any:
    return SimpleNamespace(live=live, queue=[object()] * queued, closing=None)


def held_by(kernel: Kernel | None) -> tuple[HeldSends, list[int]]:
    """A policy whose socket is found at once, and how often it was asked for."""
    asked: list[int] = []

    def find() -> asyncio.Future[KernelHold | None]:
        asked.append(1)
        found: asyncio.Future[KernelHold | None] = asyncio.get_running_loop().create_future()
        found.set_result(kernel)
        return found

    return HeldSends(find), asked


async def test_a_live_listener_with_nothing_queued_is_never_looked_at() -> None:
    held, asked = held_by(Kernel(unsent=50_000))
    for _ in range(3):
        held.after_turn(cast(Delivery, delivery(live=True, queued=0)))
    assert asked == [] and held.most_bytes() == 0


async def test_a_listener_behind_waits_for_its_kernel_then_gets_turns_cut_to_the_limit() -> None:
    kernel = Kernel(unsent=20_000)
    held, asked = held_by(kernel)
    behind = cast(Delivery, delivery(live=False, queued=500))
    held.after_turn(behind)  # asks for the socket (found at once here) and looks
    assert asked == [1]
    assert held.holding and held.most_bytes() == kernel.limit
    await held.before_turn(behind)
    assert kernel.waits == 3 and not kernel.too_much()  # 20,000 → 16,000 → 12,000 → 8,000 → 4,000
    await held.before_turn(behind)  # nothing more to wait for until a turn fills it again
    assert kernel.waits == 3
    # Live again, still with a queue: still cut, and looked at.
    kernel.unsent = 9_000
    held.after_turn(cast(Delivery, delivery(live=True, queued=10)))
    assert held.holding
    await held.before_turn(behind)
    assert kernel.waits == 4
    # Live with nothing queued: full turns again, asked for no more.
    held.after_turn(cast(Delivery, delivery(live=True, queued=0)))
    assert not held.holding and held.most_bytes() == 0 and asked == [1]


async def test_a_live_listener_with_a_queue_is_looked_at_too() -> None:
    """Through plain ASGI a listener that stops reading fills the server's transport
    while it is still live, before its queue overflows."""
    kernel = Kernel(unsent=12_000)
    held, asked = held_by(kernel)
    burst = cast(Delivery, delivery(live=True, queued=500))
    held.after_turn(burst)
    assert asked == [1] and held.holding and held.most_bytes() == kernel.limit
    await held.before_turn(burst)
    assert kernel.waits == 1 and not kernel.too_much()


async def test_a_listener_whose_socket_is_not_found_is_sent_to_unheld_and_not_asked_again() -> None:
    held, asked = held_by(None)
    behind = cast(Delivery, delivery(live=False, queued=500))
    for _ in range(3):
        held.after_turn(behind)
        await held.before_turn(behind)
    assert asked == [1] and not held.holding and held.most_bytes() == 0


async def test_a_wait_ends_when_the_delivery_closes() -> None:
    kernel = Kernel(unsent=1_000_000, reads=0)  # a listener that reads nothing
    held, _ = held_by(kernel)
    behind = delivery(live=False, queued=500)
    held.after_turn(cast(Delivery, behind))
    waiting = asyncio.create_task(held.before_turn(cast(Delivery, behind)))
    await asyncio.sleep(0.01)
    behind.closing = "evicted"
    await asyncio.wait_for(waiting, 1)
