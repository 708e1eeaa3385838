"""``changefeed listen``: the debugging listener (node-sdc-changefeed's changefeedsnoop).

Prints every change item as a JSON line on stdout; with ``--mirror`` it keeps a
controller's mirror instead and prints each add/update/delete with the
resource's new state. A live status line on stderr shows the listener's state,
buffer and back-off, so an operator sees what the listener is doing.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal
import sys
import uuid
from typing import Any

import orjson

from changefeed.listener import Controller, Listener, ListenerStatus, Resynced
from changefeed.schemas import ChangeItem, ChangeKind

__all__ = ["run_listen", "status_line", "websocket_url"]


def websocket_url(url: str) -> str:
    """The /changefeeds websocket URL for a publisher base URL (http(s) or ws(s))."""
    url = url.rstrip("/")
    for http, ws in (("http://", "ws://"), ("https://", "wss://")):
        if url.startswith(http):
            url = ws + url[len(http) :]
    if not url.endswith("/changefeeds"):
        url += "/changefeeds"
    return url


def status_line(status: ListenerStatus, shown: int) -> str:
    """One line: state, buffer, back-off, counts."""
    line = (
        f"{status.state.value:<13} buffer={status.buffer_size}/{status.buffer_capacity} "
        f"attempts={status.attempts} backoff={status.backoff_delay:.2f}s "
        f"received={status.items_received} shown={shown}"
    )
    if status.last_error:
        line += f" last_error={status.last_error[:60]}"
    return line


def _emit(doc: dict[str, Any]) -> None:
    sys.stdout.write(orjson.dumps(doc).decode() + "\n")
    sys.stdout.flush()


async def run_listen(args: argparse.Namespace) -> int:
    """Listen until Ctrl-C, ``--count`` items or ``--duration`` seconds."""
    subs = tuple(s for s in args.sub_resources.split(",") if s)
    listener = Listener(
        websocket_url(args.url),
        instance=str(uuid.uuid4()),
        service="changefeed-listen",
        change_kind=ChangeKind(args.resource, subs),
        token=args.token,
        cursor=args.since,
    )
    show_status = sys.stderr.isatty() if args.status is None else args.status
    stop = asyncio.Event()
    shown = 0
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)

    def counted() -> None:
        nonlocal shown
        shown += 1
        if args.count is not None and shown >= args.count:
            stop.set()

    async def follow_items() -> None:
        async with listener:
            async for event in listener:
                if isinstance(event, Resynced):
                    _emit(
                        {
                            "event": "bootstrapped",
                            "items": len(event.items),
                            "route": event.route,
                            "cursor": event.cursor,
                        }
                    )
                elif isinstance(event, ChangeItem):
                    _emit(event.to_json())
                    counted()

    async def follow_mirror() -> None:
        def change(op: str) -> Any:
            def callback(key: str, *states: Any) -> None:
                _emit({"op": op, "id": key, "state": states[-1] if op != "delete" else None})
                counted()

            return callback

        controller = Controller(
            listener,
            on_add=change("add"),
            on_update=change("update"),
            on_delete=change("delete"),
            id_field=args.id_field,
        )
        try:
            await controller.run()
        finally:
            _emit(
                {
                    "event": "mirror",
                    "size": len(controller.mirror),
                    "resources": dict(controller.mirror),
                }
            )

    async def report() -> None:
        while True:
            sys.stderr.write("\r\x1b[K" + status_line(listener.status(), shown))
            sys.stderr.flush()
            await asyncio.sleep(0.5)

    work = asyncio.create_task(follow_mirror() if args.mirror else follow_items())
    reporter = asyncio.create_task(report()) if show_status else None
    try:
        waiter = asyncio.create_task(stop.wait())
        timeout = args.duration
        done, _ = await asyncio.wait(
            {work, waiter}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED
        )
        waiter.cancel()
        if work in done:
            work.result()  # a refusal or exhausted retries: raise it
    finally:
        for task in (work, reporter):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
        if show_status:
            sys.stderr.write("\n")
    return 0
