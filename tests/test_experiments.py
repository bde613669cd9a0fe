"""Smoke tests: each experiment script runs end to end in its --quick mode and reports its headline keys."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from .swarm import ROOT


@pytest.mark.slow  # a whole benchmark in miniature (calibration, real and simulated swarms): `make test-slow`; test_experiment_scripts.py checks it starts
def test_fidelity_quick_reports_its_errors(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, str(ROOT / "experiments" / "fidelity.py"), "--quick", "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(ROOT)}, cwd=ROOT,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    headline = json.loads(result.stdout.strip().splitlines()[-1])
    assert headline["time_error"] >= 0 and headline["exchanges_error"] >= 0
    assert headline["topologies"]["exponential"]["real_time"] > 0
    assert (tmp_path / "results.csv").exists() and "| exponential |" in (tmp_path / "summary.md").read_text()
