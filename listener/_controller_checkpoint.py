"""A controller's mirror in checkpoints: its part of one taken now, and starting from a loaded one.

The listener's ``Checkpointer`` calls these through the controller's sink
(``_controller_sink``):

* ``_checkpoint_part``, in the same synchronous step as it reads the cursor,
  is the mirror as the application saw it (where a callback is still due,
  ``_seen`` holds what it last saw), whole or only the ids touched since the
  last save, with every id whose work is outstanding as pending, so that a
  restart fetches those again.
* ``_restore``, when a checkpoint is loaded before the first registration,
  starts from its mirror without calling back for it; its pending ids, and
  any ``decode`` refuses, are fetched again and called back (``_forced``).
  Without ``decode``, the resources stay encoded until first read.
* ``_touched`` counts, from then on, the ids a save must write again.

It must never save a state the application was not called back with, nor
call back for a restored resource that was not pending.
"""

from __future__ import annotations

import orjson

from changefeed.logs import log_event

from ._checkpoint import JsonItems, MirrorCheckpoint, application_view
from ._controller_state import ControllerState, T, Undecodable, log

__all__ = ["Checkpointing"]


class Checkpointing(ControllerState[T]):
    """The controller's part that a checkpoint reads its mirror from and loads it into."""

    def _restore(self, part: MirrorCheckpoint) -> None:
        """Start from a checkpoint's mirror (no callbacks for it); its pending ids, and
        any ``decode`` refuses, are fetched again and called back if they changed."""
        refetch = set(part.pending)
        held = part.items
        if self._decode is None:
            if isinstance(held, JsonItems) and not held.values_held:
                # Decoded as they are read: going live does not wait for a million objects.
                encoded = held.encoded
                self._mirror.restore_encoded(
                    encoded if isinstance(encoded, dict) else dict(encoded), orjson.loads
                )
            else:
                self._mirror.restore(held)  # the JSON itself is T
        else:
            decoded: dict[str, T] = {}
            for key, raw in held.items():
                value = self._decoded(key, raw)
                if isinstance(value, Undecodable):
                    refetch.add(key)
                else:
                    decoded[key] = value
            self._mirror.restore(decoded)
        self._touched = set()
        self._restored = True
        self._forced.update(refetch)
        self._stale.update(refetch)
        self.queue.add_many(refetch)
        log_event(
            log,
            "controller.restored",
            controller=self.name,
            items=len(self._mirror),
            pending=len(refetch),
        )

    def _track_changes(self) -> None:
        """Start counting the ids a checkpoint must save again (nothing was restored)."""
        if self._touched is None:
            self._touched = set()

    def _checkpoint_part(self, changed: set[str] | None) -> MirrorCheckpoint:
        """This controller's part of a checkpoint taken now: every resource as the
        application saw it (``changed`` None), or those of ``changed`` (ids absent
        from the view are deleted), and every id with work outstanding."""
        seen, resource = self._seen, self.resource or ""
        deleted: list[str] = []
        encoded: dict[str, bytes] = {}
        if changed is None:
            values, encoded = self._mirror.copy_parts()
            for key in seen:
                encoded.pop(key, None)  # what the application saw instead, or nothing
            view = application_view(values, seen)
        else:
            view = {}
            get = self._mirror.get
            for key in changed:
                value = seen[key] if key in seen else get(key)
                if value is None:
                    deleted.append(key)
                else:
                    view[key] = value
        # A forced id is due a callback even when its state did not change.
        pending = self._stale | self._fetching | seen.keys() | self._attempted.keys() | self._forced
        return MirrorCheckpoint(resource, JsonItems(view, encoded, self._encode), deleted, pending)

    def _take_touched(self) -> set[str]:
        touched = self._touched or set()
        self._touched = set()
        return touched
