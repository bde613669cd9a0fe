"""The workload zoo (peers/zoo.py) and its experiment (experiments/zoo.py).

A workload brings its own loop (optimizer, schedule, clipping) through the
Workload protocol's optional members; these tests check that every place
that trains uses it (LocalTrainer, a simulated gossip peer, the simulated
DDP baseline), and run a few zoo cells in miniature: the defaults must never
go non-finite and must reach the target whenever plain averaging does. No
timed asserts: times here are virtual.
"""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

from experiments import zoo as experiment
from gossiptrain.config import RunConfig, TrainConfig
from gossiptrain.sim.cluster import Cluster, SimConfig
from gossiptrain.sim.synchronous import SynchronousJob
from gossiptrain.sim.vtime import run_virtual
from gossiptrain.train.local_trainer import LocalTrainer, optimizer_for
from gossiptrain.train.workload import Workload, load_workload
from peers import zoo
from peers.digits import DigitsWorkload

EXPECTED = {  # factory -> (optimizer class, has a schedule, clipping)
    "mlp_momentum": (torch.optim.SGD, False, None),
    "mlp_sgd": (torch.optim.SGD, False, None),
    "mlp_slow_momentum": (torch.optim.SGD, False, None),
    "mlp_adam": (torch.optim.Adam, False, None),
    "mlp_clipped": (torch.optim.SGD, False, 1.0),
    "cnn_nesterov": (torch.optim.SGD, False, None),
    "cnn_sgd": (torch.optim.SGD, False, None),
    "cnn_cosine": (torch.optim.AdamW, True, None),
    "batchnorm_momentum": (torch.optim.SGD, False, None),
    "layernorm_adamw": (torch.optim.AdamW, False, None),
    "gru_adam": (torch.optim.Adam, False, 1.0),
    "transformer_adamw": (torch.optim.AdamW, True, 1.0),
}


def zoo_workload(name: str) -> Workload:
    return load_workload(f"peers.zoo:{name}")


def test_the_zoo_is_all_listed_and_addressable_by_name() -> None:
    assert set(zoo.NAMES) == set(EXPECTED)
    for name in zoo.NAMES:
        assert isinstance(zoo_workload(name), Workload)


def test_the_issues_mlp_has_exactly_301066_parameters() -> None:
    model = zoo_workload("mlp_momentum").build_model(0)
    assert sum(p.numel() for p in model.parameters()) == 301_066


@pytest.mark.parametrize("name", zoo.NAMES)
def test_each_zoo_workload_trains_a_few_steps_with_its_own_loop(name: str) -> None:
    workload = zoo_workload(name)
    model = workload.build_model(0)
    trainer = LocalTrainer(workload, model, TrainConfig(shards=4, batch_size=8), shard=1)
    optimizer, scheduled, clip = EXPECTED[name]
    assert type(trainer.opt) is optimizer
    assert (trainer.scheduler is not None) == scheduled
    assert trainer.clip == clip
    losses = [trainer.step() for _ in range(3)]
    assert all(math.isfinite(x) for x in losses)
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert 0.0 <= workload.evaluate(model).accuracy <= 1.0


def test_the_same_seed_builds_the_same_model_and_leaves_the_global_rng_alone() -> None:
    workload = zoo_workload("cnn_nesterov")
    state = torch.random.get_rng_state()
    a, b = workload.build_model(3), workload.build_model(3)
    assert torch.equal(torch.random.get_rng_state(), state)
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters()))


def test_a_schedule_changes_the_rate_once_per_local_step() -> None:
    workload = zoo_workload("cnn_cosine")  # 50 steps of linear warmup: lr * (step + 1) / 50
    trainer = LocalTrainer(workload, workload.build_model(0), TrainConfig(shards=1, batch_size=8), shard=0)
    peak = trainer.opt.param_groups[0]["initial_lr"]
    assert trainer.opt.param_groups[0]["lr"] == pytest.approx(peak / 50)
    for _ in range(4):
        trainer.step()
    assert trainer.opt.param_groups[0]["lr"] == pytest.approx(peak * 5 / 50)


def test_the_schedule_warms_up_then_decays_to_its_floor() -> None:
    shape = [zoo.warmup_cosine(s, warmup=10, decay=100) for s in range(0, 200)]
    assert shape[0] == pytest.approx(0.1) and shape[9] == pytest.approx(1.0)
    assert all(a >= b for a, b in zip(shape[9:], shape[10:]))
    assert shape[110] == pytest.approx(zoo.FLOOR) and shape[-1] == pytest.approx(zoo.FLOOR)


def test_a_step_schedule_for_a_workload_without_one_cuts_the_rate_twice_and_resumes_where_it_was(tmp_path: Path) -> None:
    from gossiptrain.errors import ConfigError, WorkloadError
    from gossiptrain.state.checkpoint import Checkpointer, latest_good
    from gossiptrain.train.local_trainer import step_decay

    assert [step_decay(s, total=100) for s in (0, 74, 75, 89, 90, 99)] == pytest.approx([1, 1, 0.1, 0.1, 0.01, 0.01])
    with pytest.raises(ConfigError, match="lr_schedule"):
        TrainConfig(lr_schedule="step", max_seconds=10)  # a budget in seconds alone: no max_steps to cut at
    with pytest.raises(ConfigError, match="known: constant, step"):
        TrainConfig(lr_schedule="cosine", max_steps=10)
    workload = DigitsWorkload(hidden=8, depth=1)
    config = TrainConfig(shards=1, batch_size=8, lr=0.2, max_steps=20, lr_schedule="step")
    trainer = LocalTrainer(workload, workload.build_model(0), config, shard=0)
    rates = []
    for _ in range(20):
        trainer.step()
        rates.append(trainer.opt.param_groups[0]["lr"])
    assert rates[:14] == pytest.approx([0.2] * 14) and rates[14:17] == pytest.approx([0.02] * 3)
    assert rates[17:] == pytest.approx([0.002] * 3)
    # A resumed trainer goes on at the rate of the step it resumes from, not the first one's.
    half = LocalTrainer(workload, workload.build_model(0), config, shard=0)
    for _ in range(16):
        half.step()
    with Checkpointer(tmp_path) as ck:
        ck.save(half.model, half.opt, step=half.steps, samples_seen=half.samples_seen)
    again = LocalTrainer(workload, workload.build_model(0), config, shard=0)
    again.load_state(latest_good(tmp_path))
    assert again.opt.param_groups[0]["lr"] == pytest.approx(0.02)
    again.step(), again.step()
    assert again.opt.param_groups[0]["lr"] == pytest.approx(0.002)
    with pytest.raises(WorkloadError, match="its own learning-rate schedule"):
        cosine = zoo_workload("cnn_cosine")
        LocalTrainer(cosine, cosine.build_model(0), TrainConfig(shards=1, max_steps=10, lr_schedule="step"), shard=0)


def test_clipping_in_the_loop_bounds_the_gradient_norm() -> None:
    class Clipped(DigitsWorkload):
        clip_grad_norm = 1e-3  # far below any gradient of a fresh model

    workload = Clipped(hidden=32, depth=1)
    trainer = LocalTrainer(workload, workload.build_model(0), TrainConfig(shards=1, batch_size=16, lr=0.1, momentum=0.0), shard=0)
    trainer.step()
    norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.grad) for p in trainer.model.parameters()]))
    assert float(norm) <= 1e-3 * (1 + 1e-5)


def test_a_workload_without_a_loop_gets_the_optimizer_train_names() -> None:
    workload = DigitsWorkload(hidden=8, depth=1)
    adam = optimizer_for(workload, TrainConfig(optimizer="adam", lr=0.01), workload.build_model(0))
    assert type(adam) is torch.optim.Adam and adam.param_groups[0]["lr"] == 0.01
    trainer = LocalTrainer(workload, workload.build_model(0), TrainConfig(shards=1), shard=0)
    assert type(trainer.opt) is torch.optim.SGD and trainer.scheduler is None and trainer.clip is None


def _run(workload: str, **sim: Any) -> RunConfig:
    return RunConfig().with_overrides({
        "train.workload": f"peers.zoo:{workload}", "train.shards": 2, "train.batch_size": 8,
        "train.max_steps": 0, "train.max_seconds": 0, **sim,
    })


def test_the_simulated_ddp_baseline_steps_the_workloads_optimizer_schedule_and_clipping() -> None:
    config = SimConfig(peers=2, run=_run("transformer_adamw"), duration=0.05, step_time=0.01, sample_every=0.05, system="ddp")
    job = SynchronousJob(config)
    assert type(job.optimizer) is torch.optim.AdamW and job.clip == 1.0
    job.run()
    assert job.scheduler is not None and job.scheduler.last_epoch == int(job.state.steps) > 0  # once per DDP step


def test_a_simulated_gossip_peer_steps_the_workloads_optimizer() -> None:
    config = SimConfig(peers=2, run=_run("cnn_cosine"), duration=0.3, step_time=0.01, sample_every=0.1, join_spread=0.0)
    cluster = Cluster(config)
    run_virtual(cluster.run())
    trainers = [p.trainer for p in cluster.peers.values()]
    assert trainers and all(t is not None for t in trainers)
    for t in trainers:
        assert type(t.opt) is torch.optim.AdamW and t.scheduler is not None and t.steps > 0
        assert t.scheduler.last_epoch == t.steps


def test_every_cell_names_a_zoo_workload_and_its_optimizer_group() -> None:
    for cell in experiment.CELLS:
        workload = getattr(zoo, cell.workload)()
        assert cell.optimizer == workload.recipe.optimizer, cell.name
        assert cell.link in experiment.LINKS and 8 <= cell.batch <= 128
    assert len(experiment.CELLS) >= 12 and set(experiment.QUICK) <= set(experiment.BY_NAME)


# -- a few zoo cells in miniature -------------------------------------------------------------

#: (cell, horizon in virtual s, target): short enough for the default run.
QUICK_CELLS = {
    # measured at 3c081c4, seed 0: times to the target in virtual s
    "mlp-momentum-iid-fast": (0.25, 0.93),  # the issue's MLP and SGD (plain 0.12 s, defaults 0.12 s)
    "batchnorm-dir0.1-fast": (0.2, 0.93),  # BatchNorm, label skew (plain 0.08 s, defaults 0.05 s)
    "layernorm-adamw-iid-100mbit": (0.2, 0.93),  # AdamW, a slow link (plain 0.06 s, defaults 0.12 s: twice plain's)
}
_RUNS: dict[tuple[str, str], dict[str, Any]] = {}


def quick_run(name: str, arm: str) -> dict[str, Any]:
    """One seed of ``arm`` on the cell in miniature (cached: the checks (a) and (b) share the runs)."""
    if (name, arm) not in _RUNS:
        horizon, target = QUICK_CELLS[name]
        cell = replace(experiment.BY_NAME[name], target=target, horizon=horizon)
        _RUNS[name, arm] = experiment.one_run(cell, arm, 0, horizon)
    return _RUNS[name, arm]


@pytest.mark.parametrize("name", QUICK_CELLS)
def test_the_defaults_never_go_non_finite_on_a_zoo_cell(name: str) -> None:
    assert not quick_run(name, "defaults")["nonfinite"]


@pytest.mark.parametrize("name", QUICK_CELLS)
def test_the_defaults_reach_the_target_whenever_plain_averaging_does(name: str) -> None:
    plain, defaults = quick_run(name, "plain"), quick_run(name, "defaults")
    if plain["time_to_target_s"] is not None:
        assert defaults["time_to_target_s"] is not None, (plain, defaults)


def test_the_summary_judges_each_cell_and_each_group(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    skew = replace(experiment.BY_NAME["batchnorm-dir0.1-fast"], horizon=2.0)  # label skew, fast, SGD
    adam = replace(experiment.BY_NAME["layernorm-adamw-iid-100mbit"], horizon=2.0)  # iid, slow link, AdamW

    def run(cell: experiment.Cell, arm: str, seed: int, t: float | None, *, nonfinite: bool = False) -> dict[str, Any]:
        return {"cell": cell.name, "arm": arm, "seed": seed, "time_to_target_s": t, "final_metric": 0.9,
                "nonfinite": nonfinite, "guard_restores": 0, "horizon_s": cell.horizon}

    runs = [run(skew, "plain", s, 1.0) for s in range(3)] + [run(skew, "defaults", s, 0.5) for s in range(3)]
    runs += [run(adam, "plain", s, 1.0) for s in range(3)]  # the defaults: one miss, one blow-up, 1.2 s
    runs += [run(adam, "defaults", 0, None), run(adam, "defaults", 1, 1.2, nonfinite=True), run(adam, "defaults", 2, 1.2)]
    experiment.report([skew, adam], runs, 3, "python experiments/zoo.py", tmp_path)
    head = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert head["failing_a"] == head["failing_b"] == [adam.name]  # median 1.2 s > 1.1 x 1.0 s
    assert head["group_ratio"] == head["group_geomean"] == {"label_skew": 0.5, "slow_link": 1.2, "adam": 1.2}
    assert head["failing_c"] == ["slow_link", "adam"]
    summary = (tmp_path / "summary.md").read_text()
    assert summary.splitlines()[2].startswith("Command: `python experiments/zoo.py` (")  # then the commit measured
    assert f"| {adam.name} |" in summary and "FAIL" in summary


def test_the_guards_work_counts_what_it_backed_off_even_once_it_retried() -> None:
    rows = [
        {"peer": 0, "guard_backed_off": 1, "guard_restores": 0}, {"peer": 1, "guard_backed_off": 0, "guard_restores": 1},
        {"peer": 0, "guard_backed_off": 0, "guard_restores": 0}, {"peer": 1, "guard_backed_off": 2, "guard_restores": 1},
        {"peer": 1, "guard_backed_off": 0, "guard_restores": 1},
    ]
    assert experiment.guard_counts(rows) == {"guard_backed_off": 3, "guard_restores": 1}
    assert experiment.guard_counts([{"peer": 0, "test_acc": 0.5}]) == {"guard_backed_off": 0, "guard_restores": 0}


@pytest.mark.slow  # the script end to end (3 cells, 1 seed, about 25 s of CPU): `make test-slow`
@pytest.mark.timeout(330)
def test_the_quick_zoo_writes_its_table_and_headline(tmp_path: Path) -> None:
    from .swarm import run_quick_experiment

    head, _ = run_quick_experiment("zoo", tmp_path, 300)
    assert head["cells"] == len(experiment.QUICK) and head["seeds"] == 1
    assert set(head["group_ratio"]) == set(experiment.GROUPS)
    with open(tmp_path / "runs.csv") as fh:
        assert len(fh.read().strip().splitlines()) == 1 + len(experiment.QUICK) * len(experiment.ARMS)
    assert "| defaults/plain | (a) | (b) | groups |" in (tmp_path / "summary.md").read_text()
