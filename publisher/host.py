"""What a listener connection needs of its publisher: the small interface between the two.

The websocket adapter (``connection``) knows nothing else of the publisher,
and the publisher nothing of ASGI: each side can change without the other.
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

from changefeed.schemas import AccessDenied, AccessGranted

from .catchup import Catchup
from .config import PublisherConfig
from .registration import Refusal
from .registry import Session

__all__ = ["Admitted", "ListenerHost"]


@dataclass(frozen=True, slots=True)
class Admitted:
    """A registration admitted: its session, and the ack to send it."""

    session: Session
    ack: str


class ListenerHost(Protocol):
    """The publisher, as one listener connection sees it."""

    @property
    def config(self) -> PublisherConfig: ...

    @property
    def catchup(self) -> Catchup:
        """Refills the queue of a connection that is behind."""

    @property
    def rng(self) -> random.Random:
        """Random source of a connection's waits before reading the feed again."""

    async def access(self, headers: Mapping[str, str], peer: str) -> AccessGranted | AccessDenied:
        """Whether a handshake may go on (its bearer token); a refusal is counted."""

    def refused(self, code: str, endpoint: str, peer: str, reason: str) -> None:
        """Count and log one refusal."""

    def connection_opened(self, direct_writes: bool, port: int | None) -> None:
        """A websocket handshake arrived (whatever becomes of it) on local ``port``."""

    def connection_closed(self) -> None:
        """A connection counted by ``connection_opened`` ended."""

    def capacity(self) -> Refusal | None:
        """A refusal when the publisher takes no more listeners now (draining, full)."""

    async def register(self, text: str, access: frozenset[str], peer: str) -> Admitted | Refusal:
        """Decide on a registration frame, and admit the connection if it may register."""

    def evict(
        self, session: Session, code: str, message: str, close_code: int | None = None
    ) -> None:
        """Close a session for the publisher's own reason (error code ``code``;
        ``close_code``: the one the server already closed it with)."""

    def forget(self, session: Session) -> None:
        """The session's connection ended."""
