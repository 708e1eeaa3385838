"""Many real Listeners in a process of their own, each recording the ids it is handed.

Run by tests/test_outage_resume.py: ``python outage_listeners.py URL COUNT``
starts COUNT ``Listener``s of ``vm`` (``async for``, one HTTP client shared
by all), prints ``{"event": "ready"}`` once every one has handed out its
bootstrap, and then, for each line ``report`` read on stdin, one JSON line:
per listener, the change items' ids in the order it was handed them and its
status (registrations, resumes, bootstraps, acks not resumed by reason,
aborts, the last error). The listeners run in this process so that their
200 connections, reconnections and back-offs do not share the publisher's
event loop.
"""

from __future__ import annotations

import asyncio
import random
import sys
import uuid
from typing import Any

import httpx
import orjson

from changefeed.listener import (
    BackoffPolicy,
    ChangeItem,
    ChangeKind,
    Listener,
    ListenerConfig,
)

CONFIG = ListenerConfig(
    backoff=BackoffPolicy(initial=0.2, maximum=2.0),
    open_timeout=15.0,
    ack_timeout=15.0,
)


class Ready:
    """Set once ``count`` listeners have handed out their first bootstrap."""

    def __init__(self, count: int) -> None:
        self.left = count
        self.event = asyncio.Event()

    def one(self) -> None:
        self.left -= 1
        if self.left == 0:
            self.event.set()


async def follow(listener: Listener, ids: list[str], ready: Ready) -> None:
    async with listener:
        async for event in listener:
            if isinstance(event, ChangeItem):
                ids.append(event.changed_resource_id)
            elif listener.bootstraps == 1 and not ids:
                ready.one()  # its first bootstrap: it is live


def summary(listener: Listener, ids: list[str]) -> dict[str, Any]:
    status = listener.status()
    return {
        "ids": ids,
        "state": status.state.value,
        "registrations": status.registrations,
        "resumes": status.resumes,
        "bootstraps": status.bootstraps,
        "not_resumed": status.not_resumed,
        "aborts": status.aborts,
        "last_error": status.last_error,
    }


async def main(url: str, count: int) -> None:
    async with httpx.AsyncClient(timeout=15.0) as http:
        listeners = [
            Listener(
                url,
                instance=str(uuid.uuid4()),
                service="outage",
                change_kind=ChangeKind("vm"),
                config=CONFIG,
                http=http,
                name=f"outage-{n}",
                rng=random.Random(n),
            )
            for n in range(count)
        ]
        received: list[list[str]] = [[] for _ in listeners]
        ready = Ready(count)
        tasks = [
            asyncio.create_task(follow(listener, ids, ready))
            for listener, ids in zip(listeners, received, strict=True)
        ]
        await ready.event.wait()
        print(orjson.dumps({"event": "ready"}).decode(), flush=True)
        reader = asyncio.StreamReader()
        loop = asyncio.get_running_loop()
        await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
        while line := await reader.readline():
            if line.strip() == b"report":
                doc = [summary(li, ids) for li, ids in zip(listeners, received, strict=True)]
                print(orjson.dumps({"event": "report", "listeners": doc}).decode(), flush=True)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], int(sys.argv[2])))
