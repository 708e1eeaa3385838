"""Which registrations an entry reaches (docs/design.md, "Matching"). Pure code.

An entry with sub-resources C reaches a registration with sub-resources S when
C and S intersect, or C is empty (the resource as a whole: created, deleted),
or S is empty (everything).
"""

from __future__ import annotations

from collections.abc import Collection

__all__ = ["matches"]


def matches(entry_subs: Collection[str], registered_subs: Collection[str]) -> bool:
    """True when an entry changing ``entry_subs`` concerns a registration
    for ``registered_subs``."""
    if not entry_subs or not registered_subs:
        return True
    return not set(entry_subs).isdisjoint(registered_subs)
