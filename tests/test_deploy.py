"""deploy/ holds together: configs load, commands parse, numbers agree, rules name real metrics.

Each file in deploy/ is checked with the tool that will read it where that
tool is installed (``nginx -t``, ``systemd-analyze verify``, ``kubectl
kustomize``, ``promtool``), and always against the code: every command line
is parsed by the real ``changefeed`` argument parser, every config by the
real config loader, every probe path is a real route, every metric in an
alerting rule is one the publisher exports, every alert has a runbook entry,
and the timeouts that must nest (ping interval < proxy read timeout; drain
< stop timeout) do.
"""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import pytest
from helpers import run_python
from prometheus_client import CollectorRegistry, generate_latest
from test_deploy_support import DEPLOY, NGINX, ROOT, Nginx, make_certificate, render_nginx

from changefeed.cli import _parser
from changefeed.listener import Controller, Listener
from changefeed.publisher import Publisher, PublisherConfig, ResourceConfig
from changefeed.publisher.config import (
    ServerConfig,
    config_from_dict,
    load_service_config,
    parse_duration,
    server_config_from_dict,
)
from changefeed.schemas import ChangeKind

UVICORN_SHUTDOWN = 10.0  # changefeed.serving.server_config: timeout_graceful_shutdown
RUNBOOK = ROOT / "docs" / "runbook.md"


def read(path: Path) -> str:
    return path.read_text()


def systemd_unit(path: Path) -> dict[str, dict[str, list[str]]]:
    """A unit file as {section: {key: [values]}} (keys may repeat)."""
    unit: dict[str, dict[str, list[str]]] = {}
    section = ""
    for raw in read(path).splitlines():
        line = raw.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("["):
            section = line.strip("[]")
            unit.setdefault(section, {})
            continue
        key, _, value = line.partition("=")
        unit[section].setdefault(key.strip(), []).append(value.strip())
    return unit


def nginx_seconds(directive: str) -> float:
    text = read(DEPLOY / "nginx" / "snippets" / "changefeed-proxy.conf")
    location = text[text.index("location = /changefeeds {") :]
    match = re.search(rf"^\s*{directive}\s+(\d+)s;", location, re.M)
    assert match, f"{directive} not set in the /changefeeds location"
    return float(match.group(1))


# -- the example config -----------------------------------------------------------------------


def test_example_config_loads_and_is_production_shaped() -> None:
    config, server = load_service_config(DEPLOY / "changefeed.toml")
    assert config.resources and config.resources[0].bootstrap_route.startswith("https://")
    assert config.create_schema is False  # db init runs with the owner's role
    assert config.cursor_key is None  # the feed's own key, which nobody else knows
    assert config.auth_tokens  # nginx's 443 server is public: never an open feed
    assert ":" not in (config.dsn or "").split("@")[0].removeprefix("postgresql://")  # no password
    assert server.ping_interval + server.ping_timeout < nginx_seconds("proxy_read_timeout") + 20
    assert server.ping_interval < nginx_seconds("proxy_read_timeout")
    assert server.ping_interval < nginx_seconds("proxy_send_timeout")


# -- systemd ----------------------------------------------------------------------------------


UNITS = sorted((DEPLOY / "systemd").glob("*.service"))


def test_the_images_and_units_install_what_their_commands_need() -> None:
    """The publisher's image and unit run ``serve`` and ``db init`` (extra ``serve``),
    the Spark ones ``compact`` (extra ``spark``): a bare install is the listener's,
    whose command line has neither."""
    wants = {
        "container/Containerfile": "'.[serve]'",
        "spark/Containerfile": "'.[spark]'",
        "systemd/changefeed-publisher@.service": "'changefeed[serve]'",
        "spark/changefeed-compaction.service": "'changefeed[spark]'",
    }
    for name, extra in wants.items():
        installs = [
            line
            for line in (DEPLOY / name).read_text().splitlines()
            if re.search(r"pip (wheel|install)", line) and "/wheels/" not in line
        ]
        assert installs and all(extra in line for line in installs), (name, installs)
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    assert any(dep.startswith("uvicorn") for dep in extras["serve"])
    assert any(dep.startswith("pyspark") for dep in extras["spark"])


@pytest.mark.parametrize("path", UNITS, ids=[p.name for p in UNITS])
def test_systemd_unit_runs_a_real_command(path: Path) -> None:
    unit = systemd_unit(path)
    (exec_start,) = unit["Service"]["ExecStart"]
    argv = shlex.split(exec_start.replace("%i", "8081"))
    assert argv[0].endswith("/bin/changefeed")
    args = _parser().parse_args(argv[1:])  # SystemExit on any unknown option
    if args.command in ("serve", "example-api"):
        stop = parse_duration(unit["Service"]["TimeoutStopSec"][0])
        _, server = load_service_config(DEPLOY / "changefeed.toml")
        # SIGTERM: drain_grace, then uvicorn's graceful shutdown, then margin.
        assert stop > server.drain_grace + UVICORN_SHUTDOWN, stop
        assert unit["Service"]["KillSignal"] == ["SIGTERM"]
        assert int(unit["Service"]["LimitNOFILE"][0]) >= 10000
    if args.command == "serve":
        assert args.config == "/etc/changefeed/changefeed.toml" and args.port == 8081


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="needs systemd-analyze")
def test_systemd_units_verify(tmp_path: Path) -> None:
    """``systemd-analyze verify`` on the units, with the paths of this machine."""
    changefeed = ROOT / ".venv" / "bin" / "changefeed"
    if not changefeed.exists():
        pytest.skip("no .venv/bin/changefeed")
    names = []
    for path in UNITS:
        text = read(path).replace("/opt/changefeed/venv/bin/changefeed", str(changefeed))
        text = re.sub(r"^(User|Group)=.*$", r"\1=root", text, flags=re.M)
        text = text.replace("EnvironmentFile=/", "EnvironmentFile=-/")
        name = path.name.replace("@.service", "@8081.service")
        (tmp_path / name).write_text(text)
        names.append(str(tmp_path / name))
    result = subprocess.run(
        ["systemd-analyze", "verify", *names],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    problems = [
        line
        for line in (result.stdout + result.stderr).splitlines()
        if line.strip() and "Failed to connect to bus" not in line
    ]
    assert result.returncode == 0 and not problems, problems


# -- Kubernetes -------------------------------------------------------------------------------


def manifests() -> dict[str, dict[str, Any]]:
    yaml = pytest.importorskip("yaml")
    docs = {}
    for path in sorted((DEPLOY / "kubernetes").glob("*.yaml")):
        for doc in yaml.safe_load_all(read(path)):
            docs[doc["kind"]] = doc
    return docs


def test_kubernetes_manifests_agree_with_the_code() -> None:
    docs = manifests()
    config_text = docs["ConfigMap"]["data"]["changefeed.toml"]
    doc = tomllib.loads(config_text)
    config = config_from_dict(doc, "configmap.yaml")
    server = server_config_from_dict(doc, "configmap.yaml")
    assert server.host == "0.0.0.0" and config.create_schema is False
    # The Ingress is public: tokens, and a bootstrap route listeners outside reach.
    assert config.auth_tokens
    assert all(r.bootstrap_route.startswith("https://") for r in config.resources)

    pod = docs["Deployment"]["spec"]["template"]
    (container,) = pod["spec"]["containers"]
    args = _parser().parse_args(container["args"])
    assert args.command == "serve"
    mount = container["volumeMounts"][0]["mountPath"]
    assert args.config == f"{mount}/changefeed.toml"
    assert container["ports"][0]["containerPort"] == server.port
    (init,) = pod["spec"]["initContainers"]
    init_args = _parser().parse_args(init["args"])
    assert (init_args.command, init_args.db_command) == ("db", "init")
    assert "CHANGEFEED_DSN" in {e["name"] for e in init["env"]}

    publisher = Publisher(config)
    paths = {getattr(route, "path", None) for route in publisher.routes}
    assert container["readinessProbe"]["httpGet"]["path"] == "/readyz" in paths
    assert container["livenessProbe"]["httpGet"]["path"] == "/healthz" in paths
    pre_stop = container["lifecycle"]["preStop"]["sleep"]["seconds"]
    grace = pod["spec"]["terminationGracePeriodSeconds"]
    assert grace > pre_stop + server.drain_grace + UVICORN_SHUTDOWN

    labels = pod["metadata"]["labels"]
    for kind in ("Deployment", "PodDisruptionBudget"):
        selector = docs[kind]["spec"]["selector"]["matchLabels"]
        assert selector.items() <= labels.items(), kind
    assert docs["Service"]["spec"]["selector"].items() <= labels.items()
    annotations = docs["Ingress"]["metadata"]["annotations"]
    read_timeout = float(annotations["nginx.ingress.kubernetes.io/proxy-read-timeout"])
    assert read_timeout > server.ping_interval


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="needs kubectl")
def test_kustomization_builds() -> None:
    result = subprocess.run(
        ["kubectl", "kustomize", str(DEPLOY / "kubernetes")],
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    for kind in ("ConfigMap", "Deployment", "Service", "PodDisruptionBudget", "Ingress"):
        assert f"kind: {kind}\n" in result.stdout


# -- Prometheus and the runbook ---------------------------------------------------------------


def exported_metrics() -> set[str]:
    """Every metric name a publisher, a listener and a controller export."""
    registry = CollectorRegistry()
    listener = Listener(
        "ws://127.0.0.1:9/changefeeds",
        instance="00000000-0000-4000-8000-000000000000",
        service="names",
        change_kind=ChangeKind("vm"),
        registry=registry,
    )
    Controller(listener, registry=registry)
    publisher = Publisher(
        PublisherConfig(dsn="postgresql://unused/x", resources=(ResourceConfig("vm", "/vms"),))
    )
    text = publisher.metrics.render().decode() + generate_latest(registry).decode()
    names = set()
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            name, kind = line.split()[2:4]
            names.add(name)
            if kind == "counter":
                names.add(name + "_total")
    return names


def test_alert_rules_name_exported_metrics_and_have_runbook_entries() -> None:
    rules = read(DEPLOY / "prometheus" / "changefeed-alerts.yml")
    used = set(re.findall(r"\bchangefeed_[a-z_]+\b", rules))
    assert used, "no changefeed metrics in the rules"
    missing = used - exported_metrics()
    assert not missing, f"rules use metrics the publisher does not export: {missing}"
    alerts = re.findall(r"^\s*- alert: (\w+)$", rules, re.M)
    runbook = read(RUNBOOK)
    headings = {h.strip().lower() for h in re.findall(r"^#+ (.+)$", runbook, re.M)}
    for alert in alerts:
        assert alert.lower() in headings, f"docs/runbook.md has no section {alert}"
        assert f"docs/runbook.md#{alert.lower()}" in rules


def test_docs_name_only_exported_metrics() -> None:
    for path in (RUNBOOK, ROOT / "docs" / "operations.md"):
        names = set(re.findall(r"\bchangefeed_[a-z_]+\b", read(path)))
        names -= {f"changefeed_{role}" for role in ("publisher", "writer", "owner", "compactor")}
        assert names - exported_metrics() == set(), path.name


# On PATH, or where ./dev unpacks it (beside the virtualenv's python).
PROMTOOL = shutil.which("promtool") or shutil.which(
    "promtool", path=str(Path(sys.executable).parent)
)


@pytest.mark.skipif(PROMTOOL is None, reason="needs promtool (./dev setup fetches it as root)")
def test_alert_rules_pass_promtool() -> None:
    assert PROMTOOL is not None
    rules = DEPLOY / "prometheus"
    for argv in (
        [PROMTOOL, "check", "rules", "changefeed-alerts.yml"],
        [PROMTOOL, "test", "rules", "changefeed-alerts.test.yml"],
    ):
        result = subprocess.run(
            argv, capture_output=True, text=True, timeout=60, cwd=rules, check=False
        )
        assert result.returncode == 0, result.stdout + result.stderr


# -- nginx ------------------------------------------------------------------------------------


@pytest.mark.nginx
@pytest.mark.skipif(NGINX is None, reason="needs Debian's nginx")
def test_nginx_config_is_valid_with_tls(tmp_path: Path) -> None:
    certificate = make_certificate(tmp_path)
    if certificate is None:
        pytest.skip("needs openssl for a test certificate")
    prefix = tmp_path / "nginx"
    prefix.mkdir()
    conf = render_nginx(prefix, [18081, 18082, 18083], 18080, (18443, *certificate))
    result = Nginx(prefix, conf, 18080, tmp_path).test_config()
    assert result.returncode == 0, result.stderr
    assert "test is successful" in result.stderr


def test_nginx_timeouts_outlast_the_ping_interval() -> None:
    server = ServerConfig()
    assert nginx_seconds("proxy_read_timeout") > server.ping_interval
    assert nginx_seconds("proxy_send_timeout") > server.ping_interval


def test_server_processes_tune_the_garbage_collector() -> None:
    """``tune_collector`` (applied by the CLI's servers once started) freezes what
    exists and raises the young-generation threshold. In a child process: it
    changes process-wide state."""
    code = (
        "import gc\n"
        "import changefeed.serving  # what a server has loaded by then\n"
        "from changefeed.collector import tune_collector\n"
        "before = gc.get_threshold()\n"
        "tune_collector()\n"
        "print(before[0], gc.get_threshold()[0], gc.get_freeze_count())\n"
    )
    result = run_python(code)
    assert result.returncode == 0, result.stderr
    before, after, frozen = (int(v) for v in result.stdout.split())
    assert after >= 10_000 > before
    assert frozen > 10_000  # every module loaded so far: out of every later collection
