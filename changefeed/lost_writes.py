"""The event loop's "socket.send() raised exception." lines, within a budget.

asyncio and uvloop log that warning, with no peer and no traceback, for every
write to a connection they know is gone, from the fifth such write on.
Through plain ASGI a publisher cannot tell that a listener's connection is
gone until the loop has run the server's ``connection_lost``: the failed write
only schedules it. A turn of single-item frames to a listener that vanished
mid catch-up therefore writes most of a turn's frames (up to 128,
``connection._FRAMES_PER_TURN``) into a dead transport, each logged, and a
peer that resets its connection at will sets the volume of the log. The
publisher logs the disconnect itself (``listener.disconnected``), with the
peer; these lines add nothing to it.

While a publisher runs, a filter on the ``asyncio`` logger lets ``LOG_BURST``
of them through per ``LOG_WINDOW`` seconds and counts the rest, written as one
``asyncio.lost_writes_held`` line when the window ends (``budgeted_log``).
Every other line of that logger passes untouched. The filter is installed
once per process, however many publishers run, and removed with the last.
"""

from __future__ import annotations

import asyncio
import logging
import threading

from changefeed.budgeted_log import BudgetedLines
from changefeed.log_budget import LogBudget

__all__ = ["LOG_BURST", "LOG_WINDOW", "MESSAGE", "hold", "release"]

log = logging.getLogger(__name__)

MESSAGE = "socket.send() raised exception."
"""The line, as asyncio's selector transports and uvloop's streams write it."""

LOG_BURST = 5
"""Lost-write lines of one window logged as they come."""

LOG_WINDOW = 60.0
"""Seconds of a window: at most ``LOG_BURST`` lost-write lines and one summary in that time."""

_ASYNCIO = logging.getLogger("asyncio")


class _LostWrites(logging.Filter):
    def __init__(self) -> None:
        super().__init__()
        self.lines = BudgetedLines(
            LogBudget(LOG_BURST, LOG_WINDOW), log, "asyncio.lost_writes_held"
        )
        self.lock = threading.Lock()  # loops in other threads log through the same logger

    def filter(self, record: logging.LogRecord) -> bool:
        if record.msg != MESSAGE:
            return True
        try:
            loop: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
        except RuntimeError:
            loop = None
        with self.lock:
            return self.lines.due(MESSAGE, loop)


class _Holders:
    """The publishers holding the budget in this process, and the filter they share."""

    def __init__(self) -> None:
        self.count = 0
        self.installed: _LostWrites | None = None
        self.guard = threading.Lock()

    def hold(self) -> None:
        with self.guard:
            self.count += 1
            if self.installed is None:
                self.installed = _LostWrites()
                _ASYNCIO.addFilter(self.installed)

    def release(self) -> None:
        with self.guard:
            if self.count == 0:
                return
            self.count -= 1
            if self.count == 0 and self.installed is not None:
                _ASYNCIO.removeFilter(self.installed)
                with self.installed.lock:
                    self.installed.lines.flush()
                self.installed = None


_HOLDERS = _Holders()


def hold() -> None:
    """Budget the lost-write lines until the matching ``release`` (a publisher's start)."""
    _HOLDERS.hold()


def release() -> None:
    """The end of one ``hold`` (a publisher's stop): with the last, the filter goes,
    after writing what it held."""
    _HOLDERS.release()
