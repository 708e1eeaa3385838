"""deploy/ for a fleet: publishers on standbys, behind nginx, with compose and Kubernetes.

Checked against the code and against each other, as test_deploy.py does for
one publisher: every command line parses with the real ``changefeed`` parser,
every publisher config loads with the real loader and reads a standby while
its ``dsn`` names the primary, the standby settings are the same in
``deploy/postgresql/standby.conf``, the compose file and the CloudNativePG
cluster, the standby is made with ``pg_basebackup -R``, the nginx config
renders and passes ``nginx -t``, and the kernel setting for slow listeners
is one this kernel has. (Docker and the operator are not run here; the
settings and the roles are run on a real standby in test_deploy_postgres.py.)
"""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import subprocess
import tomllib
from pathlib import Path
from typing import Any

import asyncpg
import pytest
from test_deploy_support import DEPLOY, NGINX, Nginx

from changefeed.cli import _parser
from changefeed.embedded import temporary
from changefeed.publisher.config import config_from_dict, load_service_config
from changefeed.schemas import apply_schema

COMPOSE = DEPLOY / "compose"
SETTING = re.compile(r"^\s*([a-z0-9_.]+)\s*=\s*('(?:[^']*)'|[^#\s]+)\s*(?:#.*)?$")


def conf_settings(path: Path) -> dict[str, str]:
    """``name = value`` lines of a PostgreSQL or sysctl file, quotes removed."""
    settings = {}
    for line in path.read_text().splitlines():
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        match = SETTING.match(line)
        assert match, f"unparsable line in {path.name}: {line!r}"
        settings[match.group(1)] = match.group(2).strip("'")
    return settings


def yaml_docs(path: Path) -> list[dict[str, Any]]:
    yaml = pytest.importorskip("yaml")
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


def compose() -> dict[str, Any]:
    (doc,) = yaml_docs(COMPOSE / "compose.yaml")
    return doc


def mounts(service: dict[str, Any]) -> dict[str, str]:
    """A compose service's volumes as {path in the container: source}."""
    found = {}
    for volume in service.get("volumes", []):
        source, target = volume.split(":")[:2]
        found[target] = source
    return found


def host_of(dsn: str) -> str:
    return dsn.split("@", 1)[1].split(":", 1)[0]


def test_compose_publishers_read_the_standby_and_listen_on_the_primary() -> None:
    services = compose()["services"]
    assert {"primary", "standby", "db-init", "db-roles", "publisher", "nginx"} <= set(services)
    publisher = services["publisher"]
    args = _parser().parse_args(publisher["command"])
    assert args.command == "serve"
    config, server = load_service_config(COMPOSE / mounts(publisher)[args.config])
    assert config.read_dsn and config.dsn
    assert host_of(config.dsn) == "primary" and host_of(config.read_dsn) == "standby"
    assert config.create_schema is False and server.host == "0.0.0.0"
    assert publisher["deploy"]["replicas"] >= 2
    assert int(publisher["ulimits"]["nofile"]["soft"]) >= config.max_connections
    init = _parser().parse_args(services["db-init"]["command"])
    assert (init.command, init.db_command) == ("db", "init")
    assert host_of(services["db-init"]["environment"]["CHANGEFEED_DSN"]) == "primary"
    # Passwords only from the environment, never in the repository.
    for name, service in services.items():
        for key, value in (service.get("environment") or {}).items():
            if "PASSWORD" in key:
                assert str(value).startswith("${") and ":?" in str(value), (name, key)


def test_compose_standby_is_a_streaming_copy_with_the_standby_settings() -> None:
    services = compose()["services"]
    standby = services["standby"]
    mounted = mounts(standby)
    script = (COMPOSE / mounted[standby["entrypoint"][-1]]).read_text()
    assert "pg_basebackup" in script and "--write-recovery-conf" in script
    assert "/etc/postgresql/standby.conf" in script
    assert mounted["/etc/postgresql/standby.conf"] == "../postgresql/standby.conf"
    assert services["standby"]["depends_on"]["primary"]["condition"] == "service_healthy"
    init = (COMPOSE / "primary-init.sh").read_text()
    assert "REPLICATION" in init and "host replication replicator" in init
    assert services["nginx"]["sysctls"] == {"net.ipv4.tcp_notsent_lowat": 8192}


@pytest.mark.nginx
@pytest.mark.skipif(NGINX is None, reason="needs Debian's nginx")
def test_compose_nginx_config_is_valid(tmp_path: Path) -> None:
    """deploy/compose/nginx.conf with the shared proxy snippet, in an nginx main
    context of the test's own (``publisher`` resolved to loopback ports)."""
    prefix = tmp_path / "nginx"
    (prefix / "snippets").mkdir(parents=True)
    shutil.copy(DEPLOY / "nginx" / "snippets" / "changefeed-proxy.conf", prefix / "snippets")
    site = (COMPOSE / "nginx.conf").read_text()
    assert "server publisher:8080" in site
    site = site.replace("server publisher:8080", "server 127.0.0.1:18381")
    site = site.replace("listen 80;", "listen 127.0.0.1:18380;")
    (prefix / "site.conf").write_text(site)
    temp = prefix / "tmp"
    temp.mkdir()
    user = "user root;\n" if os.geteuid() == 0 else ""  # as render_nginx does
    temps = "".join(
        f"    {kind}_temp_path {temp}/{kind};\n"
        for kind in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi")
    )
    conf = prefix / "nginx.conf"
    conf.write_text(
        f"{user}worker_processes 1;\nevents {{}}\n"
        f"http {{\n    access_log off;\n{temps}    include site.conf;\n}}\n"
    )
    result = Nginx(prefix, conf, 18380, tmp_path).test_config()
    assert result.returncode == 0, result.stderr


def test_the_standby_settings_agree_everywhere() -> None:
    """standby.conf is the one source; the Kubernetes cluster sets the same values."""
    wanted = conf_settings(DEPLOY / "postgresql" / "standby.conf")
    assert wanted["hot_standby_feedback"] == "on"
    assert float(wanted["max_standby_streaming_delay"].rstrip("s")) <= 30
    (cluster,) = yaml_docs(DEPLOY / "kubernetes" / "postgresql" / "cluster.yaml")
    assert cluster["kind"] == "Cluster" and cluster["spec"]["instances"] >= 2
    parameters = cluster["spec"]["postgresql"]["parameters"]
    for name in (
        "hot_standby_feedback",
        "max_standby_streaming_delay",
        "max_standby_archive_delay",
    ):
        assert parameters[name] == wanted[name], name
    primary = conf_settings(DEPLOY / "postgresql" / "changefeed.conf")
    assert primary["synchronous_commit"] == parameters["synchronous_commit"] == "on"


def test_kubernetes_publishers_read_the_clusters_standbys() -> None:
    (configmap,) = yaml_docs(DEPLOY / "kubernetes" / "configmap.yaml")
    config = config_from_dict(tomllib.loads(configmap["data"]["changefeed.toml"]))
    assert config.dsn and config.read_dsn
    assert host_of(config.dsn).startswith("changefeed-db-rw.")
    assert host_of(config.read_dsn).startswith("changefeed-db-ro.")
    (cluster,) = yaml_docs(DEPLOY / "kubernetes" / "postgresql" / "cluster.yaml")
    assert cluster["metadata"]["name"] == "changefeed-db"  # the operator's -rw / -ro Services


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="needs kubectl")
def test_the_database_kustomization_builds() -> None:
    result = subprocess.run(
        ["kubectl", "kustomize", str(DEPLOY / "kubernetes" / "postgresql")],
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    assert "kind: Cluster\n" in result.stdout


def test_the_slow_listener_sysctl_is_one_this_kernel_has() -> None:
    settings = conf_settings(DEPLOY / "nginx" / "sysctl-changefeed.conf")
    assert settings == {"net.ipv4.tcp_notsent_lowat": "8192"}
    proc = Path("/proc/sys/net/ipv4/tcp_notsent_lowat")
    if not proc.exists():
        pytest.skip("no /proc/sys here")
    assert int(proc.read_text()) > 0  # a real, readable setting


PSQL = shutil.which("psql") or next(
    (str(p) for p in sorted(Path("/usr/lib/postgresql").glob("*/bin/psql"))), None
)


@pytest.mark.skipif(PSQL is None, reason="needs psql")
async def test_compose_db_roles_applies_the_roles_and_the_password(tmp_path: Path) -> None:
    """db-roles' command, as compose runs it (``$$`` is a ``$``), against a real server
    with the feed schema: the roles exist, and changefeed_publisher has the password."""
    assert PSQL is not None
    service = compose()["services"]["db-roles"]
    script = service["command"][-1].replace("$$", "$")
    server = temporary()
    try:
        server.start()
        conn = await asyncpg.connect(server.dsn)
        try:
            await apply_schema(conn)
        finally:
            await conn.close()
        script = script.replace("-h primary", f"-h 127.0.0.1 -p {server.port}")
        script = script.replace("-d app", "-d postgres").replace("psql ", f"{PSQL} ")
        roles = tmp_path / "roles.sql"
        roles.write_text((DEPLOY / "postgresql" / "roles.sql").read_text())
        script = script.replace("/roles.sql", str(roles))
        env = {**os.environ, "PUBLISHER_PASSWORD": "it's a secret"}
        shell = await asyncio.create_subprocess_exec(
            "sh", "-c", script, env=env,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        )  # fmt: skip
        _, err = await asyncio.wait_for(shell.communicate(), 60)
        assert shell.returncode == 0, err.decode()
        conn = await asyncpg.connect(server.dsn)
        try:
            password = await conn.fetchval(
                "SELECT rolpassword FROM pg_authid WHERE rolname = 'changefeed_publisher'"
            )
        finally:
            await conn.close()
        assert password and password.startswith("SCRAM-SHA-256$")
    finally:
        server.close()
