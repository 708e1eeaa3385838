"""Background work that runs every so often, and never dies silently.

Each round's database errors are expected weather (the database restarts,
fails over): they are logged and the next round tries again. Anything else
is most likely a bug: it is logged with its traceback, retried a few rounds
in a row, and then the work gives up by raising, so that its supervisor
(``Publisher``) reports it failed instead of it failing forever in a loop.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from changefeed.logs import log_event

from .feed import DB_ERRORS

__all__ = ["every"]

_UNEXPECTED_ROUNDS = 3


async def every(
    interval: float,
    work: Callable[[], Awaitable[None]],
    *,
    name: str,
    log: logging.Logger,
    log_db_errors: bool = True,
) -> None:
    """Run ``work`` every ``interval`` seconds, forever.

    Args:
        interval: seconds between the end of a round and the start of the next.
        work: one round.
        name: what the work is called in logs (``<name>.failed``).
        log: where to log.
        log_db_errors: log database errors (off for work whose failures
            something else already reports, such as the tailer's).

    Raises:
        Exception: the last of ``_UNEXPECTED_ROUNDS`` unexpected failures in a row.
    """
    unexpected = 0
    while True:
        try:
            await work()
            unexpected = 0
        except DB_ERRORS as exc:
            if log_db_errors:
                log_event(log, f"{name}.failed", logging.WARNING, exc=exc)
        except Exception as exc:
            unexpected += 1
            log_event(log, f"{name}.failed", logging.ERROR, exc=exc, rounds=unexpected)
            if unexpected >= _UNEXPECTED_ROUNDS:
                raise
        await asyncio.sleep(interval)
