"""experiments/churn.py runs end to end in --quick mode (a smoke test: never the numbers themselves)."""

from __future__ import annotations

import csv
import json
import math
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from .swarm import ROOT

SCRIPT_TIMEOUT = 400  # seconds; about 70 s on 2 idle cores (two runs of 4 peers for 20 s each, plus start-up)


@pytest.mark.slow  # two real swarms (about 70-150 s): out of the default run; the short chaos test covers churn there
@pytest.mark.timeout(SCRIPT_TIMEOUT + 30)
def test_churn_quick(tmp_path: Path) -> None:
    proc = subprocess.Popen(
        [sys.executable, str(ROOT / "experiments" / "churn.py"), "--quick", "--out", str(tmp_path)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT, start_new_session=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    try:
        output, _ = proc.communicate(timeout=SCRIPT_TIMEOUT)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the script's peers and coordinator too
        output, _ = proc.communicate()
        pytest.fail(f"churn.py --quick ran over {SCRIPT_TIMEOUT} s:\n{output[-3000:]}")
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 0, output[-3000:]
    heads = json.loads(output.strip().splitlines()[-1])
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
