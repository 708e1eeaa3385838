"""Configuration: the reference in docs/ is the model's, and every key refuses a wrong value
with an error that names the file and the key."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import msgspec
import pytest

from changefeed.publisher import ConfigError, PublisherConfig, ResourceConfig
from changefeed.publisher.config import (
    ServerConfig,
    load_service_config,
    parse_duration,
)
from changefeed.publisher.config_reference import config_reference

DOCS = Path(__file__).resolve().parent.parent / "docs" / "config.md"

VALID = """
[publisher]
dsn = "postgresql://postgres@127.0.0.1:5432/postgres"
max_age = "24h"

[[resources]]
name = "vm"
sub_resources = ["nic", "alias"]
bootstrap_route = "/vms"

[server]
port = 9000
"""


def _keys() -> list[tuple[str, str, type[Any]]]:
    keys: list[tuple[str, str, type[Any]]] = [
        ("publisher", f.name, PublisherConfig)
        for f in msgspec.structs.fields(PublisherConfig)
        if f.name != "resources"
    ]
    keys += [("resources", f.name, ResourceConfig) for f in msgspec.structs.fields(ResourceConfig)]
    keys += [("server", f.name, ServerConfig) for f in msgspec.structs.fields(ServerConfig)]
    return keys


def test_docs_config_reference_is_generated_from_the_model() -> None:
    assert DOCS.read_text().strip() == config_reference().strip(), (
        "docs/config.md is stale: regenerate it from config_reference()"
    )


def test_every_documented_key_is_in_the_model() -> None:
    documented = {
        line.split("`")[1] for line in DOCS.read_text().splitlines() if line.startswith("| `")
    }
    assert documented == {name for _, name, _ in _keys()}


def test_a_valid_file_loads(tmp_path: Path) -> None:
    path = tmp_path / "changefeed.toml"
    path.write_text(VALID)
    config, server = load_service_config(path)
    assert config.max_age == 86400.0
    assert config.resources == (ResourceConfig("vm", "/vms", ("nic", "alias")),)
    assert server.port == 9000


def _wrong_value(table: str, name: str, cls: type[Any]) -> Any:
    hint = {f.name: f.type for f in msgspec.structs.fields(cls)}[name]
    if "tuple" in str(hint):
        return 42  # a list of strings is expected
    return {"a": 1}  # a table is never a valid scalar


@pytest.mark.parametrize(("table", "name", "cls"), _keys())
def test_every_key_refuses_a_wrong_value_naming_file_and_key(
    tmp_path: Path, table: str, name: str, cls: type[Any]
) -> None:
    import tomllib

    doc = tomllib.loads(VALID)
    wrong = _wrong_value(table, name, cls)
    if table == "resources":
        doc["resources"][0][name] = wrong
    else:
        doc.setdefault(table, {})[name] = wrong
    path = tmp_path / "bad.toml"
    path.write_text(_dump(doc))
    with pytest.raises(ConfigError) as raised:
        load_service_config(path)
    message = str(raised.value)
    key = f"resources[0].{name}" if table == "resources" else f"{table}.{name}"
    assert str(path) in message and key in message, message


@pytest.mark.parametrize(("table", "name", "cls"), _keys())
def test_every_key_refuses_a_wrong_value_built_in_python(
    table: str, name: str, cls: type[Any]
) -> None:
    """A config built in Python is checked as a file is, with a ``ConfigError`` naming
    the key (not a ``TypeError`` later, where the value is first used)."""
    wrong = _wrong_value(table, name, cls)
    with pytest.raises(ConfigError) as raised:
        if table == "resources":
            PublisherConfig(resources=({"name": "vm", "bootstrap_route": "/vms", name: wrong},))  # type: ignore[arg-type]
        else:
            cls(**{name: wrong})
    key = f"resources[0].{name}" if table == "resources" else f"{table}.{name}"
    assert str(raised.value).startswith(f"{key}: expected "), str(raised.value)


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"poll_interval": float("nan")}, "publisher.poll_interval: must be a number, not NaN"),
        ({"queue_size": 0}, "publisher.queue_size: must be at least 1"),
        ({"max_age": 1e15}, "publisher.max_age: must be at most 100 years"),
        ({"resources": "vm"}, "resources: expected a list of [[resources]] tables"),
        (
            {"resources": (ResourceConfig(name=1, bootstrap_route="/vms"),)},  # type: ignore[arg-type]
            "resources[0].name: expected a string, got 1",
        ),
        (
            {"token_resources": {1: ["vm"]}},
            'publisher.token_resources: expected a table such as {"<token>" = ["vm"]}: '
            "its keys must be strings",
        ),
    ],
)
def test_python_values_out_of_bounds_are_refused_as_in_a_file(
    settings: dict[str, Any], message: str
) -> None:
    with pytest.raises(ConfigError) as raised:
        PublisherConfig(**settings)
    assert str(raised.value).startswith(message), str(raised.value)


def test_nan_is_refused_in_a_file(tmp_path: Path) -> None:
    path = tmp_path / "nan.toml"
    path.write_text("[publisher]\npoll_interval = nan\n")
    with pytest.raises(ConfigError, match=r"publisher\.poll_interval: must be a number, not NaN"):
        load_service_config(path)


def test_python_values_are_stored_as_a_file_would_give_them() -> None:
    config = PublisherConfig(
        resources=[  # type: ignore[arg-type]
            {"name": "vm", "bootstrap_route": "/vms", "sub_resources": ["nic"]},
            ResourceConfig("server", "/servers", ["cpu"]),  # type: ignore[arg-type]
        ],
        token_resources={"t" * 20: ["vm"]},  # type: ignore[dict-item]
        max_age=60,
    )
    assert config.resources == (
        ResourceConfig("vm", "/vms", ("nic",)),
        ResourceConfig("server", "/servers", ("cpu",)),
    )
    assert config.resource("vm") is config.resources[0]
    assert config.token_resources == {"t" * 20: ("vm",)}
    assert isinstance(config.max_age, float)


@pytest.mark.parametrize(
    ("text", "key"),
    [
        ("[publisher]\nqueue_sise = 10\n", "publisher.queue_sise"),
        ("[publisher]\nqueue_size = 0\n", "publisher.queue_size"),
        ('[publisher]\nmax_age = "forever"\n', "publisher.max_age"),
        ('[publisher]\nschema = "Bad-Name"\n', "publisher.schema"),
        ("[publishers]\n", "publishers"),
        ('[[resources]]\nname = "vm"\n', "resources[0].bootstrap_route"),
        ("[server]\nport = 70000\n", "server.port"),
        ('[server]\nheader_timeout = "-1s"\n', "server.header_timeout"),
        ('[publisher]\nstall_timeout = "0s"\n', "publisher.stall_timeout"),
        ("[publisher]\npoll_interval = 0\n", "publisher.poll_interval"),
        ("[publisher]\nregistration_timeout = 0\n", "publisher.registration_timeout"),
        ("[publisher]\nmax_age = 0\n", "publisher.max_age"),
        ("[server]\nping_interval = 0\n", "server.ping_interval"),
        ("not toml ===", "(file)"),
        ('[publisher]\nmax-age = "5m"\n', "publisher.max-age: unknown key (known: "),
        ('[publisher]\n"a\\nb" = 1\n', "publisher.'a\\nb': unknown key"),
        ("[publisher]\ntail_batch = 99999999999999999999\n", "publisher.tail_batch"),
        ("[publisher]\ntail_batch = 1000000\n", "publisher.tail_batch"),
        ("[publisher]\nmax_frame_bytes = 16\n", "publisher.max_frame_bytes"),
    ],
)
def test_bad_files_name_the_key(tmp_path: Path, text: str, key: str) -> None:
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(ConfigError) as raised:
        load_service_config(path)
    assert key in str(raised.value) and str(path) in str(raised.value)


def test_a_file_that_is_not_utf8_text_is_a_clear_error(tmp_path: Path) -> None:
    path = tmp_path / "binary.toml"
    path.write_bytes(b"\xff\xfe[publisher]\n")
    with pytest.raises(ConfigError, match=r"\(file\): not UTF-8 text \(.* at byte 0\)"):
        load_service_config(path)


def test_missing_file_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read"):
        load_service_config(tmp_path / "nope.toml")


@pytest.mark.parametrize(
    ("text", "seconds"),
    [(30, 30.0), ("500ms", 0.5), ("10m", 600.0), ("24h", 86400.0), ("7d", 604800.0), (1.5, 1.5)],
)
def test_durations(text: Any, seconds: float) -> None:
    assert parse_duration(text) == seconds


def test_a_duration_over_a_hundred_years_is_refused_in_a_file_and_in_python(
    tmp_path: Path,
) -> None:
    """``max_age = "800000d"`` is refused when loaded, naming the file and the key,
    rather than taken and then failing at every inline trim (OverflowError computing
    "now minus max_age")."""
    path = tmp_path / "long.toml"
    path.write_text('[publisher]\nmax_age = "800000d"\n')
    with pytest.raises(ConfigError, match=r"publisher\.max_age.*at most 100 years") as caught:
        load_service_config(path)
    assert str(path) in str(caught.value)
    with pytest.raises(ConfigError, match=r"max_age.*at most 100 years"):
        PublisherConfig(max_age=1e15)


def test_serve_names_the_file_and_key_on_a_bad_config(tmp_path: Path) -> None:
    path = tmp_path / "bad.toml"
    path.write_text("[publisher]\npoll_interval = true\n")
    result = subprocess.run(
        [sys.executable, "-m", "changefeed.cli", "serve", "--config", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode != 0
    assert "publisher.poll_interval" in result.stderr and str(path) in result.stderr
    assert "Traceback" not in result.stderr


def _dump(doc: dict[str, Any]) -> str:
    """Minimal TOML writer for the test documents (strings, numbers, bools, lists, tables)."""

    def value(v: Any) -> str:
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, str):
            return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
        if isinstance(v, list):
            return "[" + ", ".join(value(x) for x in v) + "]"
        if isinstance(v, dict):
            return "{" + ", ".join(f"{k} = {value(x)}" for k, x in v.items()) + "}"
        return repr(v)

    out = []
    for table, body in doc.items():
        if isinstance(body, list):
            for row in body:
                out.append(f"[[{table}]]")
                out += [f"{k} = {value(v)}" for k, v in row.items()]
        else:
            out.append(f"[{table}]")
            out += [f"{k} = {value(v)}" for k, v in body.items()]
    return "\n".join(out) + "\n"
