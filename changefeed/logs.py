"""Structured log events for every package, and how they are rendered.

Code logs an *event* with fields: ``log_event(log, "registration", instance=...)``.
``configure_logging`` renders them as ``event key=value ...`` for people on a
terminal and as one JSON object per line otherwise (or when asked), so that
every step of a broadcast can be followed in either form (RFD 5 "Logging").
"""

from __future__ import annotations

import contextlib
import logging
import sys
from datetime import UTC, datetime
from typing import Any

import orjson

from changefeed.visible import json_visible, visible

__all__ = ["HumanFormatter", "JsonFormatter", "configure_logging", "log_event"]

_FIELDS = "cf_fields"


def log_event(
    logger: logging.Logger,
    event: str,
    level: int = logging.INFO,
    *,
    exc: BaseException | None = None,
    **fields: Any,
) -> None:
    """Log ``event`` with structured ``fields``.

    Args:
        exc: the exception that caused the event: its traceback goes with the
            line (``exc`` in JSON), so an error in a log can be debugged.
    """
    if logger.isEnabledFor(level):
        exc_info = (type(exc), exc, exc.__traceback__) if exc is not None else None
        if level >= logging.WARNING and not logger.hasHandlers():
            _last_resort(logger, level, event, exc_info, fields)
            return
        logger.log(level, event, exc_info=exc_info, extra={_FIELDS: fields}, stacklevel=2)


def _last_resort(
    logger: logging.Logger, level: int, event: str, exc_info: Any, fields: dict[str, Any]
) -> None:
    """Where nobody set up logging (an embedding app that never called
    ``configure_logging``, or a module imported before it did, as uvicorn's
    ``--ws`` option does), Python's last resort prints a warning's message
    alone: the event's name, without the fields that say what happened. The
    same line as a terminal shows it instead, fields and traceback included."""
    if logging.lastResort is None:  # the application turned the last resort off
        return
    record = logger.makeRecord(
        logger.name, level, "", 0, event, (), exc_info, extra={_FIELDS: fields}
    )
    if not logger.filter(record):
        return
    # Like the last resort, a stderr that is closed or gone loses the line, never
    # the caller's work.
    with contextlib.suppress(OSError, ValueError):
        print(HumanFormatter().format(record), file=sys.stderr, flush=True)


def _fields(record: logging.LogRecord) -> dict[str, Any]:
    fields: dict[str, Any] = getattr(record, _FIELDS, {})
    return fields


class JsonFormatter(logging.Formatter):
    """One JSON object per line: ts, level, logger, event and the event's fields."""

    def format(self, record: logging.LogRecord) -> str:
        doc: dict[str, Any] = {
            "ts": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "event": record.getMessage(),
        }
        doc.update(_fields(record))
        if record.exc_info:
            doc["exc"] = self.formatException(record.exc_info)
        # Names, reasons and paths come from peers: a terminal tailing the log, or a
        # viewer showing it, gets none of their control or format characters raw.
        try:
            text = orjson.dumps(doc, default=str).decode()
        except TypeError:  # an integer past 64 bits (orjson refuses it): as text
            text = orjson.dumps(
                {
                    k: str(v) if isinstance(v, int) and v.bit_length() > 63 else v
                    for k, v in doc.items()
                },
                default=str,
            ).decode()
        return json_visible(text)


class HumanFormatter(logging.Formatter):
    """``HH:MM:SS.mmm level logger event key=value ...`` for terminals, one line per
    event (but for a traceback), with what is not printable escaped (``visible``)."""

    def format(self, record: logging.LogRecord) -> str:
        ts = datetime.fromtimestamp(record.created).strftime("%H:%M:%S.%f")[:-3]
        pairs = " ".join(f"{k}={v}" for k, v in _fields(record).items())
        # Field values come from peers (instance names, paths): a newline or an escape
        # sequence of theirs must not start a line of its own or drive the terminal.
        line = visible(
            f"{ts} {record.levelname.lower():<7} {record.name} {record.getMessage()} {pairs}"
        )
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        return line.rstrip()


def configure_logging(level: str = "info", json_output: bool | None = None) -> None:
    """Send the ``changefeed`` (and uvicorn's) loggers to stderr; JSON unless stderr
    is a terminal. Where the process has no logging set up (no handler on the root
    logger), every other library's warnings go the same way."""
    if json_output is None:
        json_output = not sys.stderr.isatty()
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if json_output else HumanFormatter())
    for name in ("changefeed", "uvicorn", "uvicorn.error"):
        logger = logging.getLogger(name)
        logger.handlers[:] = [handler]
        logger.setLevel(level.upper())
        logger.propagate = False
    root = logging.getLogger()
    if not root.handlers:
        # Nobody set up this process's logging (a changefeed command, a script):
        # other libraries' warnings (asyncpg's pool, asyncio's) come out in the
        # same form, traceback included, instead of as Python's bare last resort,
        # which would break a stream of JSON lines.
        root.addHandler(handler)
