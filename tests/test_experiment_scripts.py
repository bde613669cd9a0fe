"""Every experiment script starts: its imports resolve and its flags parse (cheap; the full --quick runs of the
heaviest scripts are in the slow set, `make test-slow`)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
HELPERS = ("harness", "lying_member")  # modules the scripts run or import, not experiments of their own
SCRIPTS = sorted(p.stem for p in (ROOT / "experiments").glob("*.py") if p.stem not in HELPERS)


def test_the_scripts_are_all_here() -> None:
    assert set(SCRIPTS) >= {"churn", "compression", "exchange", "fidelity", "parity", "staleness", "stragglers", "topologies"}


@pytest.mark.parametrize("name", SCRIPTS)
def test_each_experiment_script_imports_and_shows_its_help(name: str) -> None:
    result = subprocess.run(
        [sys.executable, str(ROOT / "experiments" / f"{name}.py"), "--help"],
        capture_output=True, text=True, timeout=120, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "--quick" in result.stdout and "--out" in result.stdout
