"""The listener's public API is typed for real: ``mypy --strict`` accepts the example
application (docs/examples/typed_controller.py) and refuses callbacks whose
signatures do not match the controller's resource type."""

from __future__ import annotations

import textwrap
from pathlib import Path

from mypy import api as mypy

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
