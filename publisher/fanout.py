"""Live delivery: each batch the tailer reads, offered to every live listener wanting it. Pure code.

The batch is matched per *interest* (the change kinds of a connection), not
per listener: listeners with the same change kinds share one selection of
items, and each queue takes its selection with one ``deque.extend``. An entry
is encoded the first time an interest wants it (``Chunk.item``), and never
again. Dispatching 1,000 entries to 5,000 listeners of a few interests is
then 5,000 C-level extends, not five million Python steps on the event loop.

A listener whose queue cannot take its selection is not evicted: it *falls
behind* (``Delivery.fall_behind``) at the position before this batch, leaves
the fan-out, and its connection catches up from the window or the feed
(``catchup``). Nothing here awaits, and nobody waits for anybody (I2, I3).
"""

from __future__ import annotations

import heapq
from bisect import bisect_right

from .delivery import Delivery
from .entries import Chunk
from .matching import Interest

__all__ = ["Dispatched", "Fanout"]


class Dispatched:
    """What one dispatch did: who got items, who fell behind, how many items were queued."""

    __slots__ = ("behind", "queued", "touched")

    def __init__(self) -> None:
        self.touched: list[Delivery] = []
        self.behind: list[Delivery] = []
        self.queued = 0


class Fanout:
    """The live deliveries of one publisher, grouped by interest."""

    def __init__(self) -> None:
        self._groups: dict[Interest, dict[Delivery, None]] = {}
        self._shared: dict[Interest, Interest] = {}
        """Each group's interest, the one its deliveries share."""
        self._by_resource: dict[str, set[Interest]] = {}

    def __len__(self) -> int:
        return sum(len(group) for group in self._groups.values())

    def join(self, delivery: Delivery) -> None:
        """Serve ``delivery`` live from the next dispatch on."""
        interest = delivery.interest
        group = self._groups.get(interest)
        if group is None:
            group = self._groups[interest] = {}
            self._shared[interest] = interest
            for resource in interest.resources:
                self._by_resource.setdefault(resource, set()).add(interest)
        else:
            # Equal interests are one object: thousands of listeners of the same
            # change kinds hold one matcher, not thousands.
            delivery.interest = self._shared[interest]
        group[delivery] = None

    def leave(self, delivery: Delivery) -> None:
        """Stop serving ``delivery`` live (it fell behind, or its connection ended)."""
        interest = delivery.interest
        group = self._groups.get(interest)
        if group is None or delivery not in group:
            return
        del group[delivery]
        if not group:
            del self._groups[interest]
            del self._shared[interest]
            for resource in interest.resources:
                interests = self._by_resource[resource]
                interests.discard(interest)
                if not interests:
                    del self._by_resource[resource]

    def dispatch(self, chunk: Chunk, start: int) -> Dispatched:
        """Offer ``chunk``'s entries from index ``start`` on (the tailer's new batch,
        in feed order) to every live delivery that wants them."""
        done = Dispatched()
        entries = chunk.entries
        by_resource: dict[str, list[int]] = {}
        for i in range(start, len(entries)):
            resource = entries[i].resource
            if resource in self._by_resource:
                by_resource.setdefault(resource, []).append(i)
        if not by_resource:
            return done
        interests = set().union(*(self._by_resource[r] for r in by_resource))
        positions_of = chunk.positions
        before = positions_of[start - 1] if start else chunk.after
        for interest in interests:
            present = [by_resource[r] for r in interest.resources if r in by_resource]
            candidates = present[0] if len(present) == 1 else list(heapq.merge(*present))
            if len(interest.resources) == 1 and interest.wants_all_of(
                entries[candidates[0]].resource
            ):
                chosen = candidates
            else:
                chosen = [i for i in candidates if interest.wants(entries[i])]
            if not chosen:
                continue
            items = [chunk.item(i) for i in chosen]
            positions = [positions_of[i] for i in chosen]
            first = positions[0]
            for delivery in self._groups[interest]:
                if delivery.closing is not None:
                    continue
                selection = items
                if delivery.skip_until >= first:
                    selection = items[bisect_right(positions, delivery.skip_until) :]
                    if not selection:
                        continue
                if delivery.offer(selection):
                    done.touched.append(delivery)
                    done.queued += len(selection)
                else:
                    done.behind.append(delivery)
        # Leave only now: changing a group while iterating it would not do.
        for delivery in done.behind:
            self.leave(delivery)
            delivery.fall_behind(before)
        return done
