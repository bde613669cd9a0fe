"""`--tensorboard DIR`: the records peers and the simulator write, as TensorBoard scalars read back from the event files."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from gossiptrain.cli.main import main
from gossiptrain.config import RunConfig
from gossiptrain.sim.cluster import SimConfig, simulate
from gossiptrain.train.tensorboard import TensorBoardLog, write_simulated

from .conftest import fast_config
from .swarm import Procs

event_accumulator = pytest.importorskip(
    "tensorboard.backend.event_processing.event_accumulator", reason="the tensorboard extra is not installed"
)


def scalars(run_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar of one run, as (step, value) lists per tag, read by TensorBoard's own reader."""
    acc = event_accumulator.EventAccumulator(str(run_dir))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def test_eval_and_done_records_become_scalars_at_their_step(tmp_path: Path) -> None:
    with TensorBoardLog(tmp_path / "run") as log:
        log.write({"event": "start", "time": 1.0, "step": 0, "test_acc": 0.1})  # not an evaluation: skipped
        log.write({"event": "eval", "time": 2.0, "step": 10, "test_acc": 0.5, "loss": 1.5, "bytes_sent": 2_000_000,
                   "members": 3, "test_loss": float("nan"), "staleness_hist": {"0": 4}})
        log.write({"event": "checkpoint", "time": 2.5, "step": 12, "path": "x"})
        log.write({"event": "done", "time": 3.0, "step": 20, "test_acc": 0.75, "loss": 0.5, "bytes_sent": 5_000_000})
    got = scalars(tmp_path / "run")
    assert got["accuracy/test"] == [(10, 0.5), (20, 0.75)]
    assert got["loss/train"] == [(10, 1.5), (20, 0.5)]
    assert got["bytes/sent_MB"] == [(10, 2.0), (20, 5.0)]
    assert got["swarm/members"] == [(10, 3.0)]
    assert "loss/test" not in got  # NaN is no value
    TensorBoardLog(None).write({"event": "eval", "step": 1, "test_acc": 1.0})  # no directory: nothing, no error


def test_a_simulated_run_gives_one_run_per_peer_with_its_consensus_distance(tmp_path: Path) -> None:
    run = RunConfig().with_overrides({"train.workload": "logreg", "train.shards": 3, "train.max_steps": 0})
    result = simulate(SimConfig(peers=3, run=run, duration=3.0, step_time=0.05, sample_every=0.5))
    assert write_simulated(result.rows, tmp_path) == 3
    for n in range(3):
        got = scalars(tmp_path / f"peer-{n}")
        rows = [r for r in result.rows if r["peer"] == n and isinstance(r.get("step"), int) and "test_acc" in r]
        assert [v for _, v in got["accuracy/test"]] == pytest.approx([r["test_acc"] for r in rows])
        assert [s for s, _ in got["swarm/consensus_distance"]] == [r["step"] for r in rows]


def test_the_simulate_command_writes_it(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["simulate", "--peers", "2", "--workload", "logreg", "--duration", "2", "--step-time", "0.05",
               "--sample-every", "0.5", "--tensorboard", str(tmp_path / "tb")])
    assert rc == 0
    assert sorted(p.name for p in (tmp_path / "tb").iterdir()) == ["peer-0", "peer-1"]
    assert scalars(tmp_path / "tb" / "peer-0")["accuracy/test"]


def test_real_peers_write_one_run_each_and_their_metrics_plot(procs: Procs, coordinator_factory: Any, tmp_path: Path) -> None:
    coord = coordinator_factory(fast_config(**{"train.shards": 2, "train.max_steps": 60, "train.eval_every_seconds": 0.2}))
    join = coord.address.removeprefix("tcp://")
    board = tmp_path / "tb"
    peers = [procs.peer(join, "--tensorboard", str(board)) for _ in range(2)]
    procs.wait_for(lambda: all(p.records("done") for p in peers), 90, "both peers to finish 60 steps")
    for p in peers:
        (done,) = p.records("done")
        got = scalars(board / done["peer"])
        assert got["accuracy/test"][-1] == (done["step"], pytest.approx(done["test_acc"]))
        assert got["exchanges/total"][-1][1] == done["exchanges"]
    picture = tmp_path / "run.png"  # the same peers' metrics files, as `gossiptrain plot` reads them
    assert main(["plot", *(str(p.metrics) for p in peers), "--out", str(picture)]) == 0
    assert picture.read_bytes().startswith(b"\x89PNG")
