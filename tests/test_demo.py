"""The quickstart's main job: ``changefeed demo`` on its own embedded PostgreSQL
(what ``./dev demo`` runs), end to end, in a process of its own; and with
``--standby``, the publisher reading an embedded hot standby of it."""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest


@pytest.mark.parametrize("standby", [False, True], ids=["primary", "standby"])
def test_the_demo_converges_and_stops_its_postgresql(standby: bool) -> None:
    # Under root the server runs as an unprivileged user, who must reach the
    # data directory: a fresh 755 directory, as changefeed.embedded.temporary makes.
    root = Path(tempfile.mkdtemp(prefix="changefeed-demo-"))
    root.chmod(0o755)
    data_dir = root / "pg"
    try:
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "changefeed.cli",
                "demo",
                "--duration",
                "8",
                "--data-dir",
                str(data_dir),
                *(["--standby"] if standby else []),
            ],
            check=False,
            capture_output=True,
            text=True,
            timeout=180,
        )
        output = done.stdout + done.stderr
        assert done.returncode == 0, output[-3000:]
        assert "converged: the DNS service's mirrors equal the API" in done.stdout, output[-3000:]
        assert "on one connection" in done.stdout, output[-3000:]  # VMs and servers, one listener
        assert (data_dir / "PG_VERSION").exists()
        reads_standby = "the publisher reads the feed from the standby" in done.stdout
        assert reads_standby == standby, output[-3000:]
        if standby:
            assert "(via the standby)" in done.stdout and "stopping the embedded standby" in output
        # Stopped on the way out: no server left running on that directory.
        assert not (data_dir / "postmaster.pid").exists(), output[-3000:]
    finally:
        shutil.rmtree(root, ignore_errors=True)
