"""A service that mirrors VMs and servers with checkpoints, in a process of its own.

Run by tests/test_checkpoint_kill.py: ``python checkpoint_controller.py WS_URL
CHECKPOINT CALLBACKS``. One Listener for ``vm`` and ``server``, one
Controller each, both in one checkpoint (SQLite file CHECKPOINT, saved every
0.2 s). Every callback appends one JSON line ``{"resource", "id", "old",
"new"}`` to CALLBACKS with a single ``write`` (a line is in the file whole or
not at all, whenever the process is killed). Every 0.1 s it prints a status
line: the listener's state and counters, its checkpoint's, each mirror's
size and a digest of its content (SHA-256 of its JSON, keys sorted), so the
test compares it with the API's tables without asking the process anything.
SIGTERM stops it cleanly (the last checkpoint is saved); SIGKILL is the
point of the test.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import signal
import sys
import uuid
from collections.abc import Mapping
from typing import Any

import orjson

from changefeed.listener import (
    BackoffPolicy,
    ChangeKind,
    Controller,
    Listener,
    ListenerConfig,
    SqliteCheckpointStore,
)

CONFIG = ListenerConfig(
    backoff=BackoffPolicy(initial=0.05, maximum=0.5),
    page_limit=50,
    checkpoint_interval=0.2,
    ping_interval=2.0,
    ping_timeout=2.0,
)


def digest(mirror: Mapping[str, Any]) -> str:
    return hashlib.sha256(orjson.dumps(dict(mirror), option=orjson.OPT_SORT_KEYS)).hexdigest()


async def main(url: str, checkpoint: str, callbacks: str) -> None:
    log = os.open(callbacks, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    listener = Listener(
        url,
        instance=str(uuid.uuid4()),
        service="checkpointed",
        change_kinds=[ChangeKind("vm", ("nic", "alias", "server")), ChangeKind("server")],
        config=CONFIG,
        checkpoint=SqliteCheckpointStore(checkpoint),
    )

    def recorder(resource: str) -> Any:
        def reconcile(key: str, old: Any, new: Any) -> None:
            line = {"resource": resource, "id": key, "old": old, "new": new}
            os.write(log, orjson.dumps(line) + b"\n")

        return reconcile

    vms = Controller(listener, resource="vm", reconcile=recorder("vm"), fetch_batch=20)
    servers = Controller(listener, resource="server", reconcile=recorder("server"))
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)

    def report(event: str = "status") -> None:
        status = listener.status()
        doc = {
            "event": event,
            "pid": os.getpid(),
            "state": status.state.value,
            "registrations": status.registrations,
            "resumes": status.resumes,
            "bootstraps": status.bootstraps,
            "not_resumed": status.not_resumed,
            "checkpoint": None if status.checkpoint is None else status.checkpoint.to_json(),
            "synced": vms.synced and servers.synced,
            "idle": vms.queue.idle and servers.queue.idle,
            "vms": len(vms.mirror),
            "servers": len(servers.mirror),
            "vm_digest": digest(vms.mirror),
            "server_digest": digest(servers.mirror),
        }
        sys.stdout.write(orjson.dumps(doc).decode() + "\n")
        sys.stdout.flush()

    async with vms, servers:
        while not stop.is_set():
            report()
            try:
                async with asyncio.timeout(0.1):
                    await stop.wait()
            except TimeoutError:
                pass
    report("stopped")
    os.close(log)


if __name__ == "__main__":
    asyncio.run(main(*sys.argv[1:4]))
