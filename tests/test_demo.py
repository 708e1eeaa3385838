"""The quickstart's main job: ``changefeed demo`` on its own embedded PostgreSQL
(what ``./dev demo`` runs), end to end, in a process of its own."""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
from pathlib import Path


def test_the_demo_converges_and_stops_its_postgresql() -> None:
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
        # Stopped on the way out: no server left running on that directory.
        assert not (data_dir / "postmaster.pid").exists(), output[-3000:]
    finally:
        shutil.rmtree(root, ignore_errors=True)
