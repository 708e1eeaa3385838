"""``changefeed listen``: the debugging listener (node-sdc-changefeed's changefeedsnoop).

Prints every change item as a JSON line on stdout; with ``--mirror`` it keeps
one controller's mirror per resource instead and prints each add/update/delete
with the resource's new state. With ``--checkpoint FILE`` the cursor (and the
mirrors) are kept in a SQLite file: run again, it resumes where it stopped
and prints only what changed meanwhile. A file another ``listen`` holds is
refused at start (exit 1); when its saves are failing at the end, the
command says so and exits 1. Several ``--resource`` options share one
connection (one registration per resource). A live status line on stderr
shows the listener's state, buffer, back-off and, while it bootstraps, each
route's progress, so an operator sees what the listener is doing.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import sys
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import orjson

from changefeed.listener import (
    ChangeItem,
    ChangeKind,
    Controller,
    Listener,
    ListenerConfig,
    ListenerConfigError,
    ListenerStatus,
    Resynced,
    SqliteCheckpointStore,
)
from changefeed.visible import json_visible, visible

__all__ = ["UsageError", "change_kinds", "run_listen", "status_line", "websocket_url"]


class UsageError(ValueError):
    """A ``--resource`` / ``--sub-resources`` combination that names nothing clear."""


def websocket_url(url: str) -> str:
    """The /changefeeds websocket URL for a publisher base URL (http(s) or ws(s))."""
    url = url.rstrip("/")
    for http, ws in (("http://", "ws://"), ("https://", "wss://")):
        if url.startswith(http):
            url = ws + url[len(http) :]
    if not url.endswith("/changefeeds"):
        url += "/changefeeds"
    return url


def _subs(text: str) -> tuple[str, ...]:
    return tuple(s.strip() for s in text.split(",") if s.strip())


def change_kinds(resources: Sequence[str], sub_resources: str = "") -> tuple[ChangeKind, ...]:
    """The change kinds of ``--resource NAME[:SUB,SUB]`` (repeatable) and ``--sub-resources``.

    ``--sub-resources`` is the older spelling for one resource:
    ``--resource vm --sub-resources nic,alias`` is ``--resource vm:nic,alias``.

    Raises:
        UsageError: no resource, an empty name, a resource twice, or
            ``--sub-resources`` beside several resources or inline sub-resources.
    """
    if not resources:
        raise UsageError("name at least one --resource")
    kinds = []
    for spec in resources:
        name, _, subs = spec.partition(":")
        if not name.strip():
            raise UsageError(f"--resource {spec!r}: the resource name is empty")
        kinds.append(ChangeKind(name.strip(), _subs(subs)))
    if sub_resources:
        if len(kinds) > 1 or kinds[0].sub_resources:
            raise UsageError(
                "--sub-resources goes with one --resource; "
                "give several as --resource vm:nic,alias --resource server"
            )
        kinds = [ChangeKind(kinds[0].resource, _subs(sub_resources))]
    names = [kind.resource for kind in kinds]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise UsageError(f"--resource {', '.join(twice)} given twice")
    return tuple(kinds)


def status_line(status: ListenerStatus, shown: int) -> str:
    """One line: state, buffer, back-off, counts; each route's walk while it bootstraps."""
    line = (
        f"{status.state.value:<13} buffer={status.buffer_size}/{status.buffer_capacity} "
        f"attempts={status.attempts} backoff={status.backoff_delay:.2f}s "
        f"received={status.items_received} shown={shown}"
    )
    walking = [p for p in status.bootstrap if not p.done]
    if walking:
        line += " bootstrap " + "; ".join(
            f"{p.resource} {p.items} items {p.pages} pages {p.rate:,.0f}/s"
            for p in status.bootstrap
        )
    checkpoint = status.checkpoint
    if checkpoint is not None:
        line += f" checkpoint={'resumed' if checkpoint.resumed_from else 'new'}"
        line += f"/{checkpoint.saves} saves"
    if status.last_error:
        line += f" last_error={visible(status.last_error[:60])}"
    return line


class _Output:
    """Stdout, one JSON line per document. Once whoever reads it has gone
    (``listen | head -1``), the run stops quietly (``stop``) and writes nothing more."""

    def __init__(self, stop: asyncio.Event) -> None:
        self.stop = stop
        self.gone = False

    def emit(self, doc: dict[str, Any]) -> None:
        if self.gone:
            return
        try:
            # Ids, names and reasons come from the publisher: a terminal shows none raw.
            sys.stdout.write(json_visible(orjson.dumps(doc).decode()) + "\n")
            sys.stdout.flush()
        except BrokenPipeError:
            self.gone = True
            # Nothing more may be flushed into the closed pipe, at exit either.
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            self.stop.set()


async def run_listen(args: argparse.Namespace) -> int:
    """Listen until Ctrl-C, ``--count`` items or ``--duration`` seconds.

    Returns:
        0, or 1 when the checkpoint's saves were failing at the end (the file is
        behind: a restart replays or bootstraps more than it should), or when
        ``--duration`` ran out before ``--count`` items came.

    Raises:
        UsageError: the ``--resource`` options name nothing clear.
        ListenerError: the registration refused, retries exhausted, or the
            checkpoint file held by another listener (``CheckpointRefused``).
    """
    kinds = change_kinds(args.resource, args.sub_resources)
    checkpoint = args.checkpoint
    if checkpoint and args.since:
        raise UsageError("give --since or --checkpoint, not both: the checkpoint keeps the cursor")
    if checkpoint:
        _check_checkpoint_path(Path(checkpoint))
    config = None if args.page_limit is None else ListenerConfig(page_limit=args.page_limit)
    try:
        listener = Listener(
            websocket_url(args.url),
            instance=str(uuid.uuid4()),
            service="changefeed-listen",
            change_kinds=kinds,
            token=args.token,
            cursor=args.since,
            checkpoint=SqliteCheckpointStore(checkpoint) if checkpoint else None,
            config=config,
        )
    except ListenerConfigError as exc:  # what the options said (--resource, --since)
        raise UsageError(str(exc)) from None
    show_status = sys.stderr.isatty() if args.status is None else args.status
    stop = asyncio.Event()
    out = _Output(stop)
    shown = 0
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)

    def reached() -> bool:
        return args.count is not None and shown >= args.count

    def counted(*, stop_run: bool) -> None:
        nonlocal shown
        shown += 1
        if stop_run and reached():
            stop.set()

    async def follow_items() -> None:
        async with listener:
            async for event in listener:
                if isinstance(event, Resynced):
                    out.emit(
                        {
                            "event": "bootstrapped",
                            "resource": event.resource,
                            "items": len(event.items),
                            "route": event.route,
                            "cursor": event.cursor,
                        }
                    )
                elif isinstance(event, ChangeItem):
                    out.emit(event.to_json())
                    # --count ends this loop, not the main task: cancelled while the
                    # listener closes, the run would lose its final checkpoint.
                    counted(stop_run=False)
                    if reached():
                        # --count: not one more, whatever is buffered; and a
                        # checkpoint covers the last one printed.
                        listener.done_with_last()
                        return

    async def follow_mirror() -> None:
        def change(resource: str, op: str) -> Any:
            def callback(key: str, *states: Any) -> None:
                if reached():
                    return  # --count: the main task stops the controllers next
                state = states[-1] if op != "delete" else None
                out.emit({"resource": resource, "op": op, "id": key, "state": state})
                counted(stop_run=True)  # the controllers run on: the main task stops them

            return callback

        controllers = [
            Controller(
                listener,
                resource=kind.resource,
                on_add=change(kind.resource, "add"),
                on_update=change(kind.resource, "update"),
                on_delete=change(kind.resource, "delete"),
                id_field=args.id_field,
            )
            for kind in kinds
        ]
        failed = False
        try:
            await asyncio.gather(*(controller.run() for controller in controllers))
        except Exception:
            # A refusal or exhausted retries: no mirror is printed, as an empty one
            # would read as a feed with nothing in it.
            failed = True
            raise
        finally:
            if not failed:  # stopped (a signal, --duration, --count): the mirrors now
                for controller in controllers:
                    out.emit(
                        {
                            "event": "mirror",
                            "resource": controller.resource,
                            "size": len(controller.mirror),
                            "resources": dict(controller.mirror),
                        }
                    )

    async def report() -> None:
        while True:
            sys.stderr.write("\r\x1b[K" + status_line(listener.status(), shown))
            sys.stderr.flush()
            await asyncio.sleep(args.status_interval)

    work = asyncio.create_task(follow_mirror() if args.mirror else follow_items())
    reporter = asyncio.create_task(report()) if show_status else None
    timed_out = False
    try:
        waiter = asyncio.create_task(stop.wait())
        timeout = args.duration
        done, _ = await asyncio.wait(
            {work, waiter}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED
        )
        waiter.cancel()
        if work in done:
            work.result()  # a refusal or exhausted retries: raise it
        timed_out = not done
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
    verdict = _checkpoint_verdict(listener.status(), checkpoint)
    if timed_out and args.count is not None and not reached():
        sys.stderr.write(
            f"changefeed listen: {shown} of the {args.count} items --count asked for"
            f" within --duration {args.duration:g}s\n"
        )
        return 1
    return verdict


def _check_checkpoint_path(path: Path) -> None:
    """A file no save could ever write is a usage error now, not a save failing every
    interval for as long as the listener runs."""
    if path.is_dir():
        raise UsageError(f"--checkpoint: {path} is a directory; name a file in it")
    if not path.parent.is_dir():
        raise UsageError(f"--checkpoint: {path.parent} is not a directory that exists")


def _checkpoint_verdict(status: ListenerStatus, path: str | None) -> int:
    """0, or 1 (and why, on stderr) when the run ends with its checkpoint saves failing:
    the file does not hold where this run got to."""
    saved = status.checkpoint
    if saved is None or not saved.failing:
        return 0
    failed = saved.consecutive_failures
    saves = "its last save" if failed == 1 else f"its last {failed} saves"
    sys.stderr.write(
        f"changefeed listen: checkpoint {path}: {saves} failed ({saved.last_error});"
        " it does not hold where this run got to\n"
    )
    return 1
