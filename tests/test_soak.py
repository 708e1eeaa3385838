"""The soak (bench/soak.py), short: about a minute of steady writes and listener churn.

The same processes and checks as the 20-minute soak (docs/soak.md) with
looser limits, since a minute is too short for a slope to mean much: the
publisher is ``changefeed serve`` with inline retention on a 10 s max age,
and the run must show its feed table bounded, its memory without a steep
trend, no growing connections, descriptors or tasks, every listener counted
exactly at the end, churners both resuming and re-bootstrapping, and every
mirror equal to the API's data once the writes stop.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from test_deploy_support import ROOT

sys.path.insert(0, str(ROOT / "bench"))

import soak

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]


async def test_short_soak(dsn: str, tmp_path: Path) -> None:
    options = soak.SoakOptions(
        minutes=1.0,
        rate=20.0,
        population=150,
        mirrors=2,
        churners=5,
        churn_every=2.0,
        expire_share=0.15,
        max_age=10.0,
        retention_interval=2.0,
        sample_every=2.0,
        rss_slope=3.0,
        size_growth=1.0,
        dsn=dsn,
        out=tmp_path,
        plot=False,
    )
    report = await soak.run(options)
    failed = [f"{c.name}: {c.detail}" for c in report.failed()]
    assert report.ok, failed
    assert (tmp_path / "soak.csv").exists() and (tmp_path / "soak.json").exists()
    assert report.figures["writes"] >= 0.8 * options.rate * options.minutes * 60
