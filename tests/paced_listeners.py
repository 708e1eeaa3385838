"""RFD 5 listeners that read at different paces, in a process of their own.

Run by tests/test_catchup.py: ``python paced_listeners.py URL EXPECTED RATE...``
connects one listener per RATE (items per second it reads at most; 0: as fast
as it can), registers each for every ``vm`` change with RFD 5's v1
registration (no ``batch``: one item per frame), prints ``ready`` once all are
registered, reads until each has EXPECTED items or its connection ends, and
prints one JSON line per listener: the ids it got, in order, and how its
connection ended. Reading happens in this process, so that the listeners' own
work never shares the publisher's event loop.
"""

from __future__ import annotations

import asyncio
import sys
import time
import uuid
from typing import Any

import orjson
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed

_STEP = 100
"""Items read between two looks at the pace."""


async def listen(url: str, expected: int, rate: float, registered: asyncio.Event) -> dict[str, Any]:
    registration = {
        "instance": str(uuid.uuid4()),
        "service": "paced",
        "changeKind": {"resource": "vm", "subResources": []},
    }
    ids: list[str] = []
    errors: list[str] = []
    closed: int | None = None
    # A small receive buffer and queue: a listener that reads slowly makes the
    # publisher's writes to it back up soon, as a slow consumer on a network does.
    async with connect(url, max_queue=4, compression=None, open_timeout=30) as ws:
        await ws.send(orjson.dumps(registration).decode())
        orjson.loads(await ws.recv())
        registered.set()
        started = time.monotonic()
        try:
            while len(ids) < expected:
                doc = orjson.loads(await ws.recv())
                if "error" in doc:
                    errors.append(doc["error"]["code"])
                    continue
                ids.append(doc["changedResourceId"])
                if rate and len(ids) % _STEP == 0:
                    due = started + len(ids) / rate
                    await asyncio.sleep(max(0.0, due - time.monotonic()))
        except ConnectionClosed as exc:
            closed = exc.rcvd.code if exc.rcvd is not None else 1006
    return {"rate": rate, "ids": ids, "errors": errors, "closed": closed}


async def main(url: str, expected: int, rates: list[float]) -> None:
    events = [asyncio.Event() for _ in rates]
    tasks = [
        asyncio.create_task(listen(url, expected, rate, event))
        for rate, event in zip(rates, events, strict=True)
    ]
    await asyncio.wait_for(asyncio.gather(*(e.wait() for e in events)), 60)
    print("ready", flush=True)
    for result in await asyncio.gather(*tasks):
        print(orjson.dumps(result).decode(), flush=True)


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], int(sys.argv[2]), [float(r) for r in sys.argv[3:]]))
