"""The listener's logger: its events keep one logger name, ``changefeed.listener``,
whichever of its modules logs them (a controller's have their own, below it)."""

from __future__ import annotations

import logging

__all__ = ["log"]

log = logging.getLogger("changefeed.listener")
