"""Smoke tests: each experiment script runs end to end in its --quick mode and reports its headline keys."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest

from .swarm import run_quick_experiment


@pytest.mark.slow  # a whole benchmark in miniature (calibration, real and simulated swarms): `make test-slow`; test_experiment_scripts.py checks it starts
@pytest.mark.timeout(360)  # above the script's own 300 s, so that its overrun is reported (and its peers killed) first
def test_fidelity_quick_reports_its_errors(tmp_path: Path) -> None:
    # run_quick_experiment runs the script in its own session: an overrun, or this test killed, takes its peers too.
    headline, _ = run_quick_experiment("fidelity", tmp_path, timeout=300)
    with open(tmp_path / "results.csv", newline="") as fh:
        rows = list(csv.DictReader(fh))
    assert rows and "exponential" in {r["topology"] for r in rows}
    # The headline errors are the worst of the per-topology errors, recomputed here from the raw measurements.
    time_errors = [abs(float(r["sim_time"]) - float(r["real_time"])) / float(r["real_time"]) for r in rows]
    exchange_errors = [
        abs(float(r["sim_exchanges"]) - float(r["real_exchanges"])) / max(1.0, float(r["real_exchanges"])) for r in rows
    ]
    assert headline["time_error"] == pytest.approx(max(time_errors), abs=1e-4)
    assert headline["exchanges_error"] == pytest.approx(max(exchange_errors), abs=1e-4)
    assert headline["topologies"]["exponential"]["real_time"] > 0
    assert "| exponential |" in (tmp_path / "summary.md").read_text()
