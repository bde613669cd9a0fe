"""experiments/churn.py runs end to end in --quick mode (a smoke test: never the numbers themselves)."""

from __future__ import annotations

import csv
import math
from pathlib import Path

import pytest

from .swarm import run_quick_experiment

SCRIPT_TIMEOUT = 400  # seconds; about 70 s on 2 idle cores (two runs of 4 peers for 20 s each, plus start-up)


@pytest.mark.slow  # two real swarms (about 70-150 s): out of the default run; the short chaos test covers churn there
@pytest.mark.timeout(SCRIPT_TIMEOUT + 30)
def test_churn_quick(tmp_path: Path) -> None:
    heads, _ = run_quick_experiment("churn", tmp_path, SCRIPT_TIMEOUT)
    for key in ("time_ratio", "acc_gap_points", "max_stall_s"):
        assert key in heads, heads
    assert isinstance(heads["max_stall_s"], float) and math.isfinite(heads["max_stall_s"]) and heads["max_stall_s"] > 0
    assert heads["kills"] >= 1, heads  # the churn run did kill and restart peers
    with open(tmp_path / "results.csv", newline="") as fh:
        rows = list(csv.DictReader(fh))
    assert sorted(r["run"] for r in rows) == ["churn", "none"]
    assert (tmp_path / "summary.md").read_text().startswith("# Churn")
    assert (tmp_path / "accuracy_vs_time.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "kill" in (tmp_path / "events.csv").read_text()
