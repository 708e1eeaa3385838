"""The example application docs/examples/typed_controller.py: it runs against the example
API (one listener, VMs and servers), and the listener's public API is typed for
real: ``mypy --strict`` accepts the application and refuses callbacks whose
signatures do not match the controller's resource type."""

from __future__ import annotations

import importlib.util
import sys
import textwrap
from pathlib import Path
from types import ModuleType

import httpx
from helpers import wait_until
from mypy import api as mypy
from test_listener_shared import create_servers, publisher_stats
from test_listener_support import VmApiServer

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "docs" / "examples" / "typed_controller.py"

MISTAKES = """
from dataclasses import dataclass
from typing import Any

from changefeed.listener import ChangeKind, Controller, Listener


@dataclass(frozen=True)
class VM:
    uuid: str

    @classmethod
    def from_json(cls, doc: Any) -> VM:
        return cls(doc["uuid"])


def right(vm: str, old: VM | None, new: VM | None) -> None: ...
def wrong_type(vm: str, old: int | None, new: int | None) -> None: ...
def too_few(vm: str) -> None: ...


listener = Listener("ws://h/changefeeds", instance="i", service="s", change_kind=ChangeKind("vm"))
typed = Controller[VM](listener, decode=VM.from_json, reconcile=right)
reveal_type(typed)
reveal_type(typed.mirror)
Controller[VM](listener, decode=VM.from_json, reconcile=wrong_type)  # wrong: int, not VM
Controller[VM](listener, decode=VM.from_json, on_add=too_few)  # wrong: one argument short
"""


def _example() -> ModuleType:
    spec = importlib.util.spec_from_file_location("typed_controller", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


async def test_the_example_application_follows_vms_and_their_servers(dsn: str) -> None:
    example = _example()
    async with VmApiServer(dsn) as api, httpx.AsyncClient(base_url=api.url) as client:
        cn1, cn2 = await create_servers(client, 2)
        body = {"alias": "web", "nics": [{"ip": "10.0.0.1"}], "server_uuid": cn1}
        vm = (await client.post("/vms", json=body)).json()["uuid"]
        placement = example.Placement()
        vms, servers = example.follow(api.ws_url, placement)
        async with vms, servers:
            await vms.wait_synced(20)
            await servers.wait_synced(20)
            assert placement.vms[vm] == example.VM(vm, "web", ("10.0.0.1",), cn1)
            assert isinstance(servers.mirror[cn1], example.Server)  # decoded, not a dict
            assert placement.host_of(vm) == "cn-0"
            stats = await publisher_stats(api)
            assert stats["listeners"] == 1 and len(stats["registrations"]) == 2
            await client.patch(f"/vms/{vm}", json={"server_uuid": cn2})  # a migration
            await wait_until(lambda: placement.host_of(vm) == "cn-1", 10, message="migrated")
            await client.patch(f"/servers/{cn2}", json={"hostname": "cn-9"})
            await wait_until(lambda: placement.host_of(vm) == "cn-9", 10, message="renamed")


def _mypy(*args: str) -> tuple[str, int]:
    out, err, status = mypy.run(["--strict", "--no-error-summary", *args])
    return out + err, status


def test_the_example_application_passes_mypy_strict() -> None:
    out, status = _mypy(str(EXAMPLE))
    assert status == 0, out


def test_mismatched_callbacks_are_type_errors(tmp_path: Path) -> None:
    snippet = tmp_path / "mistakes.py"
    source = "from __future__ import annotations\n" + textwrap.dedent(MISTAKES)
    snippet.write_text(source)
    wrong = [n for n, line in enumerate(source.splitlines(), 1) if "# wrong" in line]
    out, status = _mypy(str(snippet))
    assert status == 1
    lines = out.splitlines()
    assert any('Revealed type is "changefeed.listener._controller.Controller[mistakes.VM]"' in x
               for x in lines), out  # fmt: skip
    assert any('Revealed type is "typing.Mapping[str, mistakes.VM]"' in x for x in lines), out
    errors = [x for x in lines if ": error:" in x]
    assert [int(x.split(":")[1]) for x in errors] == wrong, out
    assert all("[arg-type]" in x for x in errors), out
