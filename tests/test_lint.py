"""The code is ``ruff`` and ``mypy --strict`` clean, checked with the suite, so that CI
refuses a change that is not (``./dev lint`` runs the same three commands).

What each tool checks is pyproject.toml's: ruff the whole tree, mypy the
package, the documented examples, the benchmarks and these tests.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _run(*command: str) -> None:
    done = subprocess.run(
        [sys.executable, "-m", *command],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert done.returncode == 0, f"{' '.join(command)}:\n{done.stdout[-6000:]}{done.stderr[-2000:]}"


@pytest.mark.parametrize(
    "command",
    [("ruff", "check", "."), ("ruff", "format", "--check", "."), ("mypy",)],
    ids=["ruff-check", "ruff-format", "mypy"],
)
def test_the_tree_is_lint_clean(command: tuple[str, ...]) -> None:
    _run(*command)
