"""What `pip install changefeed` is: the listener side, light. The extras bring the rest.

Checked here in this checkout's environment, in a fresh interpreter each time
(what a module import pulls in is decided once per process). The built wheel,
installed into clean venvs, is checked in tests/test_wheel.py.
"""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest
from helpers import run_python

from changefeed.fast_path import OLDEST_UVICORN

ROOT = Path(__file__).resolve().parent.parent
SERVER_SIDE = ("uvicorn", "starlette", "asyncpg", "pyspark", "prometheus_client")


def test_the_listener_side_imports_no_server_side_module() -> None:
    # jsonschema is the listener's too, but loaded on first use only.
    unwanted = (*SERVER_SIDE, "jsonschema")
    code = (
        "import sys\n"
        "import changefeed.listener, changefeed.bootstrap, changefeed.schemas, changefeed.snoop\n"
        "from changefeed.bootstrap import Pager\n"
        f"print(sorted(m for m in {unwanted!r} if m in sys.modules))\n"
    )
    done = run_python(code)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_the_core_dependencies_leave_the_server_side_to_the_extras() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    core = " ".join(project["dependencies"])
    for name in ("uvicorn", "starlette", "asyncpg", "pyspark", "prometheus-client"):
        assert name not in core
    extras = project["optional-dependencies"]
    assert {"publisher", "serve", "spark", "all"} <= set(extras)
    # The floor is the oldest uvicorn CI and the benchmarks run.
    assert f"uvicorn[standard]>={OLDEST_UVICORN.removesuffix('.0')}" in extras["serve"]
    # No upper pin on a server: an embedder keeps its own.
    assert not [d for d in extras["serve"] + extras["publisher"] if "<" in d]


def test_the_tests_run_the_fast_path_on_the_uvicorn_it_claims() -> None:
    """The development and CI environment (the test extra) holds the newest uvicorn
    of the fast path's tested range, so that its tests run it there."""
    from changefeed.fast_path import TESTED_UVICORN

    (low, high) = TESTED_UVICORN
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    pinned = [d for d in extras["optional-dependencies"]["test"] if d.startswith("uvicorn")]
    assert pinned == [f"uvicorn[standard]>={low[0]}.{low[1]},<{high[0]}.{high[1]}"]


@pytest.mark.parametrize(
    ("argv", "blocked", "extra"),
    [
        (["serve", "--config", "missing.toml"], "uvicorn", "serve"),
        (["example-api", "--dsn", "postgresql://x/y"], "starlette", "serve"),
        (["db", "init", "--dsn", "postgresql://x/y"], "asyncpg", "publisher"),
        (["compact", "--dsn", "postgresql://x/y"], "asyncpg", "spark"),
    ],
)
def test_a_command_without_its_extra_says_which_to_install(
    argv: list[str], blocked: str, extra: str
) -> None:
    # A module set to None in sys.modules cannot be imported: as if not installed.
    code = (
        f"import sys; sys.modules[{blocked!r}] = None\n"
        "from changefeed.cli import main\n"
        f"sys.exit(main({argv!r}))\n"
    )
    done = run_python(code)
    assert done.returncode == 1, done.stderr
    assert "Traceback" not in done.stderr
    assert f"pip install 'changefeed[{extra}]'" in done.stderr
    assert f"no module {blocked!r}" in done.stderr


@pytest.mark.parametrize("blocked", ["asyncpg", "starlette"])
def test_a_star_import_of_the_bootstrap_package_takes_what_is_installed(blocked: str) -> None:
    """The client side, without the server side's names (which a listener-only install
    cannot import): a star import works there as anywhere."""
    done = run_python(
        f"import sys; sys.modules[{blocked!r}] = None\n"
        "from changefeed.bootstrap import *\n"
        "print(sorted({'Pager', 'fetch_one', 'BootstrapRoute', 'error_response'} & set(dir())))\n"
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["['Pager',", "'fetch_one']"]
    done = run_python(
        "from changefeed.bootstrap import *\nprint('BootstrapRoute' in dir(), Pager.__name__)\n"
    )
    assert done.returncode == 0 and done.stdout.split() == ["True", "Pager"], done.stderr


@pytest.mark.parametrize(
    ("package", "extra"), [("publisher", "publisher"), ("compaction", "spark")]
)
def test_a_package_without_its_extra_says_which_to_install(package: str, extra: str) -> None:
    done = run_python(f"import sys; sys.modules['asyncpg'] = None\nimport changefeed.{package}\n")
    assert done.returncode == 1
    assert f"changefeed.{package} needs changefeed[{extra}]" in done.stderr
    assert f"pip install 'changefeed[{extra}]'" in done.stderr


@pytest.mark.parametrize("blocked", ["asyncpg", "starlette"])
def test_the_bootstrap_routes_without_their_extra_say_which_to_install(blocked: str) -> None:
    done = run_python(
        f"import sys; sys.modules[{blocked!r}] = None\n"
        "from changefeed.bootstrap import Pager\n"  # the client side needs neither
        "from changefeed.bootstrap import BootstrapRoute\n"
    )
    assert done.returncode == 1
    assert "BootstrapRoute (the server side) needs changefeed[publisher]" in done.stderr
    assert f"no module {blocked!r}" in done.stderr
