"""experiments/data_balance.py (issue 49): its summary of per-sample counts, and its quick run (slow set)."""

from __future__ import annotations

from pathlib import Path

import pytest

from experiments import data_balance

from .swarm import run_quick_experiment


def test_the_counts_of_all_incarnations_are_summed_and_read_as_multiples_of_the_mean() -> None:
    n = 1437
    # Peer 0 trained every sample twice; peer 1's first incarnation trained the first half once, then it was
    # restarted and its second incarnation trained the second half once.
    peer0 = [{"event": "start", "time": 0.0}, {"event": "counts", "counts": [2] * n},
             {"event": "eval", "time": 1.0, "elapsed": 1.0, "step": 10, "test_acc": 0.5, "lease_epoch": 2,
              "samples_trained": 2 * n, "samples_trained_twice": 10}]
    half = n // 2
    peer1 = [{"event": "start", "time": 0.0}, {"event": "counts", "counts": [1] * half + [0] * (n - half)},
             {"event": "start", "time": 0.5}, {"event": "counts", "counts": [0] * half + [1] * (n - half)},
             {"event": "eval", "time": 1.0, "elapsed": 0.5, "step": 5, "test_acc": 0.5, "lease_epoch": 3,
              "samples_trained": n, "samples_trained_twice": 0, "longest_stall_s": 0.4}]
    row = data_balance.summarise([peer0, peer1], "leased", 0, 0.9)
    assert row["count_min"] == row["count_max"] == 1.0 and row["mean_count"] == 3.0
    assert row["epochs"] == 3 and row["untrained_chunks"] == 0
    assert row["trained_twice"] == round(10 / (3 * n), 4)
    assert row["time_to_target_s"] is None  # 0.5 never reaches 0.9
    assert row["longest_stall_s"] == 0.4  # the longest of any peer's


@pytest.mark.slow  # 4 real runs of 8 s and two simulated ones, ~3 min on 2 cores: `make test-slow`
@pytest.mark.timeout(600)
def test_data_balance_quick(tmp_path: Path) -> None:
    head = run_quick_experiment("data_balance", tmp_path, 540)[0]
    static, leased = head["count_spread_4x_static"], head["count_spread_4x_leased"]
    assert static[0] < 0.6 and 0.67 <= leased[0] <= leased[1] <= 1.5, head
    summary = (tmp_path / "summary.md").read_text()
    assert "| 4x | 4 | leased |" in summary and "| 16 | digits-small | 4x | leased |" in summary


def test_the_scale_study_keeps_members_busy_and_loses_no_chunk_under_churn(tmp_path: Path) -> None:
    """experiments/lease_scale.py, one small churning swarm: a tenth of the members crash every 2 s, newcomers
    replace them; every chunk below the floor was trained, and the members were busy nearly all the time."""
    from experiments import lease_scale

    row = lease_scale.one_run("churn", 24, 0, 6.0)
    assert row["untrained_below_floor"] == 0 and row["epochs"] > 0
    assert row["utilization"] > 0.9 and 0 < row["share_min"] <= row["share_max"] <= 1.0
    assert row["trained_twice"] < 0.05 and row["taken_over"] > 0  # the crashed members' chunks went to others
    lines, head = lease_scale.summarise([row], "python experiments/lease_scale.py --members 24")
    assert "| 24 | churn | 1 |" in "\n".join(lines) and head["churn_24"]["untrained"] == 0
