"""experiments/wan.py: gossip against DDP over one shaped link (a network namespace with tc on its loopback).

The default run checks what needs no root: the skip line, and the summary
and headline from rows. The real `--quick` run (a namespace, tc, DDP and a
swarm, charlm for a few seconds) is in the slow set and needs root.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from argparse import Namespace
from pathlib import Path

import pytest

from experiments import wan

ROOT = Path(__file__).resolve().parent.parent


def test_without_root_it_says_why_and_skips(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    assert wan.why_not() == "needs root for a network namespace and tc"


def test_the_headline_compares_each_cell_with_ddp(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rows = [
        {"link": "100mbit", "partition": "skew", "system": "ddp", "seed": 0, "time_to_target_s": 30.0},
        {"link": "100mbit", "partition": "skew", "system": "pairwise", "seed": 0, "time_to_target_s": 10.0},
        {"link": "100mbit", "partition": "skew", "system": "push-sum", "seed": 0, "time_to_target_s": None},
        {"link": "1gbit", "partition": "iid", "system": "ddp", "seed": 0, "time_to_target_s": 4.0},
        {"link": "1gbit", "partition": "iid", "system": "pairwise", "seed": 0, "time_to_target_s": 5.0},
        {"link": "100mbit", "partition": "contiguous", "system": "charlm-swarm", "seed": 0, "val_loss": 1.5},
        {"link": "100mbit", "partition": "contiguous", "system": "charlm-alone", "seed": 0, "val_loss": 2.0},
        {"link": "100mbit", "partition": "contiguous", "system": "charlm-swarm-steps", "seed": 0, "val_loss": 1.1},
        {"link": "100mbit", "partition": "contiguous", "system": "charlm-all-samples", "seed": 0, "val_loss": 1.0},
    ]
    args = Namespace(links=["100mbit", "1gbit"], partitions=["skew", "iid"], systems=["ddp", "pairwise", "push-sum"],
                     seeds=1, target=0.93, timeout=60.0, workload="digits-small", charlm_seconds=30.0, charlm_steps=100)
    wan.report(rows, args, tmp_path)
    head = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert head["ddp_over_gossip_100mbit_skew"] == 3.0
    assert head["ddp_over_gossip_lan_iid"] == 0.8
    assert head["ddp_over_gossip_lan_skew"] is None  # not run
    assert head["worst_algorithm_over_default"] is None  # push-sum never reached it
    assert head["charlm_swarm_over_alone"] == 0.75
    assert head["charlm_swarm_over_all_samples"] == pytest.approx(1.1)  # the same samples: 3 x 100 steps against 300
    summary = (tmp_path / "summary.md").read_text()
    assert "| 100mbit | skew | push-sum | not reached |" in summary


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_wan_quick_runs_in_a_shaped_namespace(tmp_path: Path) -> None:
    if wan.why_not() is not None:
        pytest.skip(f"experiments/wan.py {wan.why_not()}")
    result = subprocess.run([sys.executable, str(ROOT / "experiments" / "wan.py"), "--quick", "--out", str(tmp_path)],
                            capture_output=True, text=True, timeout=880, cwd=ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    head = json.loads(result.stdout.strip().splitlines()[-1])
    assert head["ddp_over_gossip_100mbit_skew"] is not None  # both reached the quick target
    assert head["charlm_swarm_over_alone"] is not None
    assert (tmp_path / "summary.md").exists() and (tmp_path / "runs.csv").exists()
