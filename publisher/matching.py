"""Which entries a listener wants (docs/design.md, "Matching"). Pure code.

An entry with sub-resources C reaches a registration with sub-resources S when
C and S intersect, or C is empty (the resource as a whole: created, deleted),
or S is empty (everything). A connection with several registrations (RFD 5's
v2) wants the union, each entry once. This module is the only place the rule
is written; live delivery, catch-up and resume all ask ``Interest.wants``.
"""

from __future__ import annotations

from collections.abc import Iterable

from changefeed.schemas import ChangeKind

from .feed import FeedEntry

__all__ = ["Interest"]


class Interest:
    """What one connection registered for: its change kinds, as a matcher.

    Connections with equal interests share the work of selecting entries, so
    an interest is hashable and equal to any other of the same change kinds.

    Args:
        kinds: the registration's change kinds.
    """

    __slots__ = ("_hash", "_subs", "kinds", "resources")

    def __init__(self, kinds: Iterable[ChangeKind]) -> None:
        self.kinds = tuple(kinds)
        subs: dict[str, frozenset[str] | None] = {}
        for kind in self.kinds:
            wanted = frozenset(kind.sub_resources)
            if kind.resource in subs:
                known = subs[kind.resource]
                # Two registrations of one resource: the union of what they match.
                subs[kind.resource] = None if known is None or not wanted else known | wanted
            else:
                subs[kind.resource] = wanted or None
        self._subs = subs
        """Resource -> the sub-resources wanted (None: every entry of it)."""
        self.resources = frozenset(subs)
        self._hash = hash(frozenset(subs.items()))

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Interest) and self._subs == other._subs

    def __repr__(self) -> str:
        return f"Interest({[k.to_json() for k in self.kinds]})"

    def wants(self, entry: FeedEntry) -> bool:
        """True when this connection is sent ``entry``."""
        if entry.resource not in self._subs:
            return False
        wanted = self._subs[entry.resource]
        return (
            wanted is None or not entry.sub_resources or not wanted.isdisjoint(entry.sub_resources)
        )

    def wants_all_of(self, resource: str) -> bool:
        """True when every entry of ``resource`` is wanted (no sub-resource filter)."""
        return resource in self._subs and self._subs[resource] is None
