"""A typed application of changefeed's listener: one Listener, two Controllers.

It follows the example API's VMs and servers on one websocket (one
registration each), keeps each resource as its own frozen dataclass rather
than a dict (``decode=``), and knows at every moment which host each VM runs
on. The callbacks are plain, fully typed functions; mypy checks them against
the controller's ``ReconcileHandler`` / ``AddHandler`` / ... protocols.

    python docs/examples/typed_controller.py ws://127.0.0.1:8080/changefeeds

``mypy --strict`` checks this file (``[tool.mypy] files`` in pyproject.toml).
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from changefeed.listener import ChangeKind, Controller, Listener


@dataclass(frozen=True)
class Server:
    """A compute node, as this application keeps it."""

    uuid: str
    hostname: str
    status: str

    @classmethod
    def from_json(cls, doc: Mapping[str, Any]) -> Server:
        return cls(str(doc["uuid"]), str(doc["hostname"]), str(doc["status"]))


@dataclass(frozen=True)
class VM:
    """A VM, as this application keeps it: its name, addresses and server."""

    uuid: str
    alias: str
    ips: tuple[str, ...]
    server: str | None

    @classmethod
    def from_json(cls, doc: Mapping[str, Any]) -> VM:
        nics = doc.get("nics") or []
        server = doc.get("server_uuid")
        return cls(
            str(doc["uuid"]),
            str(doc["alias"]),
            tuple(str(nic["ip"]) for nic in nics if "ip" in nic),
            None if server is None else str(server),
        )


class Placement:
    """The application's state: the servers, the VMs, and which host runs which VM."""

    def __init__(self) -> None:
        self.servers: dict[str, Server] = {}
        self.vms: dict[str, VM] = {}

    # The VM controller's one callback: ``old``/``new`` are None when absent.
    async def vm_changed(self, vm_uuid: str, old: VM | None, new: VM | None) -> None:
        if new is None:
            self.vms.pop(vm_uuid, None)
        else:
            self.vms[vm_uuid] = new

    # The server controller's three callbacks (plain functions work too).
    def server_added(self, server_uuid: str, new: Server) -> None:
        self.servers[server_uuid] = new

    def server_updated(self, server_uuid: str, old: Server, new: Server) -> None:
        self.servers[server_uuid] = new  # also called with old == new on a periodic resync

    def server_deleted(self, server_uuid: str, old: Server) -> None:
        self.servers.pop(server_uuid, None)

    def host_of(self, vm_uuid: str) -> str | None:
        """The hostname of the server ``vm_uuid`` runs on, if both are known."""
        vm = self.vms.get(vm_uuid)
        server = self.servers.get(vm.server) if vm is not None and vm.server else None
        return None if server is None else server.hostname


def follow(url: str, placement: Placement) -> tuple[Controller[VM], Controller[Server]]:
    """Two controllers on one listener (one websocket): VMs and servers."""
    listener = Listener(
        url,
        instance=str(uuid.uuid4()),
        service="placement",
        change_kinds=[ChangeKind("vm"), ChangeKind("server")],
    )
    vms = Controller[VM](
        listener, resource="vm", decode=VM.from_json, reconcile=placement.vm_changed
    )
    servers = Controller[Server](
        listener,
        resource="server",
        decode=Server.from_json,
        on_add=placement.server_added,
        on_update=placement.server_updated,
        on_delete=placement.server_deleted,
        resync_period=600.0,  # hand every server to the callbacks again every 10 minutes
    )
    return vms, servers


async def main(url: str) -> None:
    placement = Placement()
    vms, servers = follow(url, placement)
    async with vms, servers:  # the listener starts once both run
        await asyncio.gather(vms.wait_synced(60), servers.wait_synced(60))
        for vm in sorted(placement.vms.values(), key=lambda vm: vm.alias):
            print(f"{vm.alias:<24} {', '.join(vm.ips):<32} {placement.host_of(vm.uuid) or '-'}")
        await asyncio.Event().wait()  # keep following until Ctrl-C


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(main(sys.argv[1] if len(sys.argv) > 1 else "ws://127.0.0.1:8080/changefeeds"))
