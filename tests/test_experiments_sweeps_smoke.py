"""The simulated sweeps (topologies, staleness, compression) run end to end in --quick mode.

Smoke tests only, as tests/test_experiments_smoke.py: each script finishes,
prints its headline keys as JSON on its last line, with sane values (finite
numbers, accuracies in [0, 1], bytes > 0), and writes its CSV, summary and
plots; never whether the numbers are good (those are benchmarks, run by
hand). The quick modes simulate 4 peers for a fraction of a virtual second
(about 10 s of CPU each) and start no real peers. Each script runs in its
own process group, killed whole if it overruns.
"""

from __future__ import annotations

import csv
import math
import sys
from pathlib import Path
from typing import Any

import pytest

from .swarm import ROOT, run_in_session, run_quick_experiment

SCRIPT_TIMEOUT = 300  # seconds: generous, for a machine shared with other jobs (about 10 s of CPU each)


def run_script(name: str, out: Path) -> dict[str, Any]:
    """Run experiments/NAME.py --quick; return its last line as JSON."""
    return run_quick_experiment(name, out, SCRIPT_TIMEOUT)[0]


def assert_outputs(out: Path, pngs: list[str]) -> list[dict[str, str]]:
    """results.csv, summary.md (with its regenerate line) and the plots exist; the CSV's rows."""
    with open(out / "results.csv", newline="") as fh:
        rows = list(csv.DictReader(fh))
    assert rows
    summary = (out / "summary.md").read_text()
    assert summary.startswith("# ") and "Regenerate: `python experiments/" in summary and "| --- |" in summary
    for png in pngs:
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", png
    return rows


def finite(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def accuracy(x: Any) -> bool:
    return finite(x) and 0 <= x <= 1


@pytest.mark.timeout(SCRIPT_TIMEOUT + 30)
@pytest.mark.slow  # ~13 s of a 2-core run; test_experiment_scripts.py checks it starts: `make test-slow`
def test_topologies_quick(tmp_path: Path) -> None:
    heads = run_script("topologies", tmp_path)
    assert heads["best_topology_4"] in ("ring", "complete")
    times, sent = heads["time_to_target_s"]["4"], heads["bytes_to_target"]["4"]
    assert set(times) == set(sent) == {"ring", "complete"}
    assert all(finite(t) and t > 0 for t in times.values())
    assert all(finite(b) and b > 0 for b in sent.values())
    assert heads["real_time_to_target_s"] == {}  # --quick starts no real peers
    assert "file" in heads["skipped"]  # needs an edge-list file
    rows = assert_outputs(tmp_path, ["consensus.png", "to_target.png"])
    assert {r["topology"] for r in rows} == {"ring", "complete"}
    assert all(float(r["consensus_at_target"]) > 0 for r in rows)
    assert (tmp_path / "curves.csv").read_text().count("\n") > 2


@pytest.mark.timeout(SCRIPT_TIMEOUT + 30)
@pytest.mark.slow  # ~15 s of a 2-core run; test_experiment_scripts.py checks it starts: `make test-slow`
def test_staleness_quick(tmp_path: Path) -> None:
    heads = run_script("staleness", tmp_path)
    settings = {"constant/none", "polynomial:1/none"}
    assert heads["best_setting"] in settings | {None}
    for case in ("none", "straggler"):
        assert set(heads["final_acc"][case]) == settings
        assert all(accuracy(a) for a in heads["final_acc"][case].values())
        assert all(t is None or (finite(t) and t > 0) for t in heads["time_to_target_s"][case].values())
    rows = assert_outputs(tmp_path, ["staleness.png"])
    assert len(rows) == 4
    straggler = [r for r in rows if r["straggler"] == "straggler"]
    assert all(float(r["staleness_mean"]) >= 0 for r in straggler)


@pytest.mark.slow  # a whole benchmark in miniature (four simulated sweeps): `make test-slow`; test_experiment_scripts.py checks it starts
@pytest.mark.timeout(SCRIPT_TIMEOUT + 30)
def test_compression_quick(tmp_path: Path) -> None:
    heads = run_script("compression", tmp_path)
    for key in ("bytes_saved_int8", "bytes_saved_topk"):
        assert finite(heads[key]) and heads[key] > 1, key  # both send fewer bytes than the uncompressed run
    for key in ("acc_gap_points_int8", "acc_gap_points_topk"):
        assert finite(heads[key]) and abs(heads[key]) <= 100, key
    assert all(accuracy(a) for per in heads["final_acc"].values() for a in per.values())
    assert heads["real"] == {}
    rows = assert_outputs(tmp_path, ["compression.png"])
    assert {(r["algorithm"], r["codec"]) for r in rows} == {
        ("pairwise", "none"), ("pairwise", "int8"), ("neighbor", "none"), ("neighbor", "topk:ratio=0.1"),
    }
    assert all(int(r["bytes_per_peer_total"]) > 0 for r in rows)


@pytest.mark.slow
def test_flow_control_quick(tmp_path: Path) -> None:
    heads = run_script("flow_control", tmp_path)
    assert set(heads["slow"]) == set(heads["fast"]) == {"8", "none"}
    assert all(accuracy(cell["final_acc"]) for link in ("slow", "fast") for cell in heads[link].values())
    assert heads["slow"]["8"]["waited_s"] > 0 and heads["slow"]["none"]["waited_s"] == 0  # only the bound waits
    summary = (tmp_path / "summary.md").read_text()
    assert "Regenerate: `python experiments/flow_control.py`" in summary and (tmp_path / "runs.csv").exists()


@pytest.mark.timeout(SCRIPT_TIMEOUT + 30)
@pytest.mark.slow  # 2 conditions x 4 systems, ~16 s of a 2-core run; test_experiment_scripts.py checks it starts: `make test-slow`
def test_scale_quick_and_resume(tmp_path: Path) -> None:
    heads = run_script("scale", tmp_path)
    for key in ("ddp_over_gossip_64_straggler", "ddp_over_gossip_64_lognormal", "ddp_over_gossip_256_100mbit", "largest_run"):
        assert key in heads
    assert heads["runs"] == 8  # 2 conditions x 4 systems, one seed
    assert finite(heads["ddp_over_gossip_16_straggler_logreg"]) and heads["ddp_over_gossip_16_straggler_logreg"] > 0
    assert heads["largest_run"]["peers"] == 16 and heads["largest_run"]["peak_rss_mb"] > 0
    with open(tmp_path / "runs.csv", newline="") as fh:
        rows = list(csv.DictReader(fh))
    assert {r["system"] for r in rows} == {"gossip", "ddp", "ps-sync", "ps-async"}
    assert all(0 < float(r["final_acc"]) <= 1 for r in rows)
    assert "| 16 | straggler |" in (tmp_path / "summary.md").read_text()
    assert (tmp_path / "scale_logreg.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # --resume runs nothing that runs.csv already holds, and keeps it.
    cmd = [sys.executable, str(ROOT / "experiments" / "scale.py"), "--quick", "--resume", "--out", str(tmp_path)]
    done = run_in_session(cmd, SCRIPT_TIMEOUT, "scale.py --quick --resume")
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    assert "0 runs to go (8 already" in done.stdout


def test_scale_runs_skew_only_where_a_workload_has_more_classes_than_a_machine_holds(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """logreg has 2 classes: 3 per machine is no skew (every peer's shard load failed before); digits has 10."""
    import argparse

    from experiments import scale

    args = argparse.Namespace(workloads=["logreg", "digits-small"], sizes=[16], conditions=["none", "skew"],
                              systems=["gossip"], seeds=1, others_up_to=64, gossip_duration=1.0, sync_duration=1.0)
    runs = {(s.workload, s.condition) for s in scale.grid(args)}
    assert runs == {("logreg", "none"), ("digits-small", "none"), ("digits-small", "skew")}
    assert "skew: logreg has no more than 3 classes" in capsys.readouterr().out
