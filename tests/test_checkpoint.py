"""Checkpoints: exact round trips, atomic saves, corruption caught and skipped, retention, clear refusals, resume."""

from __future__ import annotations

import hashlib
import json
import logging
import random
import signal
import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gossiptrain.config import RunConfig, TrainConfig
from gossiptrain.errors import CheckpointError, GossipError
from gossiptrain.state.checkpoint import Checkpointer, latest_good, list_checkpoints, read_checkpoint, restore
from gossiptrain.train.local_trainer import LocalTrainer
from gossiptrain.train.peer_loop import PeerOptions, run_peer
from gossiptrain.train.workload import load_workload
from peers.digits import DigitsWorkload
from peers.logreg import LogRegWorkload

from .conftest import fast_config
from .swarm import Procs, next_host, run_forked

LOG = "gossiptrain.state.checkpoint"


def small_model(seed: int, hidden: int = 16) -> torch.nn.Module:
    """Parameters plus float and integer buffers (BatchNorm's running stats and num_batches_tracked)."""
    with torch.random.fork_rng():  # leave the process's global generator alone
        torch.manual_seed(seed)
        return torch.nn.Sequential(torch.nn.Linear(8, hidden), torch.nn.BatchNorm1d(hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, 3))


def sgd(model: torch.nn.Module) -> torch.optim.SGD:
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4)


def train(model: torch.nn.Module, opt: torch.optim.Optimizer, steps: int, seed: int = 0) -> None:
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x, y = torch.randn(16, 8, generator=g), torch.randint(0, 3, (16,), generator=g)
        loss = torch.nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()


def trained(seed: int = 0, steps: int = 3) -> tuple[torch.nn.Module, torch.optim.SGD]:
    model = small_model(seed)
    opt = sgd(model)
    train(model, opt, steps, seed)
    return model, opt


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal dtype, shape and bytes (NaNs and -0.0 included)."""
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


def assert_same_state(a: Any, b: Any, where: str = "") -> None:
    """Nested state (state_dicts of models and optimizers) equal, tensors bit for bit."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and same_bits(a, b), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), where
        for k in a:
            assert_same_state(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert isinstance(b, (list, tuple)) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same_state(x, y, f"{where}[{i}]")
    else:
        assert a == b, (where, a, b)


def save(ck: Checkpointer, model: torch.nn.Module, opt: torch.optim.Optimizer | None, step: int, **kw: Any) -> Path:
    return ck.save(model, opt, step=step, samples_seen=16 * step, fingerprint="run-a", peer="p1", shard=2, **kw).path


def data_files(meta: Path) -> dict[str, Path]:
    files = json.loads(meta.read_text())["files"]
    return {role: meta.parent / f["file"] for role, f in files.items()}


# -- round trip and layout -------------------------------------------------------------


def test_round_trip_restores_model_optimizer_and_counters_bit_identically(tmp_path: Path) -> None:
    model, opt = trained()
    run = RunConfig().to_dict()
    with Checkpointer(tmp_path) as ck:
        info = ck.save(model, opt, step=3, samples_seen=48, fingerprint="run-a", peer="p1", shard=2, run=run)
    ckpt = latest_good(tmp_path)
    assert (ckpt.info.step, ckpt.info.samples_seen, ckpt.info.fingerprint, ckpt.info.peer, ckpt.info.shard) == (3, 48, "run-a", "p1", 2)
    assert ckpt.info.path == info.path and ckpt.info.run == run

    other = small_model(seed=1)
    other_opt = sgd(other)
    restore(ckpt, other, other_opt, fingerprint="run-a")
    assert_same_state(model.state_dict(), other.state_dict())
    assert_same_state(opt.state_dict(), other_opt.state_dict())
    # The restored optimizer is live: one more identical step keeps both bit-identical.
    train(model, opt, 1, seed=7)
    train(other, other_opt, 1, seed=7)
    assert_same_state(model.state_dict(), other.state_dict())


def test_layout_on_disk_and_hashes_in_the_metadata(tmp_path: Path) -> None:
    model, opt = trained()
    with Checkpointer(tmp_path) as ck:
        meta = save(ck, model, opt, 3)
    name = "ckpt-000001-step-3"
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        ".lock", f"{name}.json", f"{name}.model.safetensors", f"{name}.optim.safetensors",
    ]
    body = json.loads(meta.read_text())
    for role, path in data_files(meta).items():
        assert body["files"][role]["sha256"] == hashlib.sha256(path.read_bytes()).hexdigest()
        assert body["files"][role]["bytes"] == path.stat().st_size
    groups = body["optimizer"]["param_groups"]
    assert groups[0]["lr"] == 0.1 and groups[0]["momentum"] == 0.9 and groups[0]["params"][0] == "0.weight"
    assert body["optimizer"]["state"]["0.weight"] == {"momentum_buffer": {"tensor": "0.weight/momentum_buffer"}}


def test_local_trainer_continues_its_counters(tmp_path: Path) -> None:
    cfg = TrainConfig(workload="logreg", shards=2, batch_size=8)
    workload = LogRegWorkload()
    first = LocalTrainer(workload, workload.build_model(0), cfg, shard=1)
    for _ in range(5):
        first.step()
    with Checkpointer(tmp_path) as ck:
        ck.save(first.model, first.opt, step=first.steps, samples_seen=first.samples_seen)
    second = LocalTrainer(workload, workload.build_model(1), cfg, shard=1)
    second.load_state(latest_good(tmp_path))
    assert (second.steps, second.samples_seen) == (5, 40)
    assert_same_state(first.model.state_dict(), second.model.state_dict())


# -- atomicity -------------------------------------------------------------------------

CRASH_DURING_SAVE = """
import os, sys, torch
from gossiptrain.state.checkpoint import Checkpointer
model = torch.nn.Linear(4, 2)
opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
ck = Checkpointer(sys.argv[1])
ck.save(model, opt, step=1)
real_replace = os.replace
def power_cut(src, dst):
    if str(dst).endswith(".json"):  # the data files are in place; the metadata is still a temporary file
        os._exit(9)
    real_replace(src, dst)
os.replace = power_cut
with torch.no_grad():
    model.weight.add_(1.0)
ck.save(model, opt, step=2)
"""


def test_a_crash_before_the_metadata_rename_leaves_the_previous_checkpoint_latest(tmp_path: Path) -> None:
    script, folder = tmp_path / "crash_during_save.py", tmp_path / "checkpoints"
    script.write_text(CRASH_DURING_SAVE)
    # A process of its own, forked from the one that imported torch already (tests/zygote.py): the crash, not the imports.
    result = run_forked([str(folder)], 120, "a save cut short", tmp_path, module=str(script))
    assert result.returncode == 9, result.stderr
    left = {p.name for p in folder.iterdir()}
    assert ".ckpt-000002-step-2.json.tmp" in left and "ckpt-000002-step-2.model.safetensors" in left
    assert latest_good(folder).info.step == 1
    # The crashed process's lock died with it; the next save cleans up and never reuses its number.
    with Checkpointer(folder) as ck:
        meta = save(ck, torch.nn.Linear(4, 2), None, 3)
    assert meta.name == "ckpt-000003-step-3.json"
    assert sorted(p.name for p in folder.iterdir() if "-000002-" in p.name) == []
    assert [p.name for p in list_checkpoints(folder)] == ["ckpt-000003-step-3.json", "ckpt-000001-step-1.json"]


def test_stray_temporary_and_metadata_less_files_are_not_checkpoints(tmp_path: Path) -> None:
    model, opt = trained()
    with Checkpointer(tmp_path) as ck:
        save(ck, model, opt, 3)
    (tmp_path / ".ckpt-000002-step-9.model.safetensors.tmp").write_bytes(b"half a file")
    (tmp_path / "ckpt-000003-step-12.model.safetensors").write_bytes(b"data without metadata")
    assert latest_good(tmp_path).info.step == 3


# -- corruption ------------------------------------------------------------------------


def damage(path: Path, how: str) -> None:
    data = bytearray(path.read_bytes())
    if how == "truncate":
        path.write_bytes(data[: len(data) // 2])
    elif how == "flip":
        data[len(data) * 3 // 4] ^= 0x01  # in the tensor bytes: the file still parses
        path.write_bytes(data)
    elif how == "delete":
        path.unlink()


@pytest.mark.parametrize(
    "role, how, reason",
    [
        ("model", "truncate", "bytes, but its metadata says"),
        ("model", "flip", "SHA-256 does not match"),
        ("optimizer", "truncate", "bytes, but its metadata says"),
        ("optimizer", "flip", "SHA-256 does not match"),
        ("optimizer", "delete", "missing"),
        ("metadata", "truncate", "not valid JSON"),
    ],
)
def test_a_damaged_checkpoint_is_detected_and_the_previous_one_used(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, role: str, how: str, reason: str
) -> None:
    model, opt = trained()
    with Checkpointer(tmp_path) as ck:
        save(ck, model, opt, 3)
        train(model, opt, 2)
        newest = save(ck, model, opt, 5)
    victim = newest if role == "metadata" else data_files(newest)[role]
    damage(victim, how)
    with caplog.at_level(logging.WARNING, logger=LOG):
        ckpt = latest_good(tmp_path)
    assert ckpt.info.step == 3
    (warning,) = [r.getMessage() for r in caplog.records if r.name == LOG]
    assert str(victim) in warning and reason in warning, warning


def test_an_edit_to_the_metadata_that_still_parses_is_caught(tmp_path: Path) -> None:
    model, opt = trained()
    with Checkpointer(tmp_path) as ck:
        meta = save(ck, model, opt, 3)
    meta.write_text(meta.read_text().replace('"step": 3', '"step": 4'))
    with pytest.raises(CheckpointError, match="checksum does not match"):
        read_checkpoint(meta)


def test_no_good_checkpoint_is_a_clear_error_listing_each_problem(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="does not exist"):
        latest_good(tmp_path / "nowhere")
    with pytest.raises(CheckpointError, match="no checkpoint in"):
        latest_good(tmp_path)
    model, opt = trained()
    with Checkpointer(tmp_path) as ck:
        first, second = save(ck, model, opt, 1), save(ck, model, opt, 2)
    damage(data_files(first)["model"], "truncate")
    damage(data_files(second)["optimizer"], "flip")
    with pytest.raises(CheckpointError) as err:
        latest_good(tmp_path)
    message = str(err.value)
    assert message.startswith(f"no good checkpoint in {tmp_path}: ")
    assert str(data_files(first)["model"]) in message and str(data_files(second)["optimizer"]) in message


# -- retention and locking -------------------------------------------------------------


def test_retention_keeps_the_newest_k_and_nothing_else(tmp_path: Path) -> None:
    model, opt = trained()
    with Checkpointer(tmp_path, keep=2) as ck:
        for step in range(1, 6):
            save(ck, model, opt, step * 10)
            assert len(list_checkpoints(tmp_path)) == min(step, 2)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["ckpt-000005-step-50.json", "ckpt-000004-step-40.json"]
    assert len([p for p in tmp_path.iterdir() if p.name.startswith("ckpt-")]) == 2 * 3


def test_newest_means_written_last_not_highest_step(tmp_path: Path) -> None:
    # A peer that resumed from an older checkpoint (the newer one being damaged) continues with lower steps.
    model, opt = trained()
    with Checkpointer(tmp_path) as ck:
        save(ck, model, opt, 500)
        save(ck, model, opt, 120)
    assert latest_good(tmp_path).info.step == 120


def test_one_checkpointer_per_directory(tmp_path: Path) -> None:
    with Checkpointer(tmp_path):
        with pytest.raises(CheckpointError, match="in use by another checkpointer"):
            Checkpointer(tmp_path)
    with Checkpointer(tmp_path) as ck:  # released on close
        save(ck, torch.nn.Linear(2, 2), None, 1)


def test_unusable_directory_is_named(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with pytest.raises(CheckpointError, match=f"cannot use checkpoint directory {blocker}/sub"):
        Checkpointer(blocker / "sub")


def test_due_by_steps_and_by_time() -> None:
    now = [100.0]
    with tempfile.TemporaryDirectory() as d, Checkpointer(d, every_steps=10, every_seconds=5.0, clock=lambda: now[0]) as ck:
        assert not ck.due(3)  # the first call sets the baseline
        assert not ck.due(12) and ck.due(13)
        save(ck, torch.nn.Linear(2, 2), None, 13)
        assert not ck.due(14)
        now[0] += 5.0
        assert ck.due(14)


# -- refusals --------------------------------------------------------------------------


def test_a_checkpoint_of_another_model_is_refused_naming_the_first_difference(tmp_path: Path) -> None:
    model, opt = trained()
    with Checkpointer(tmp_path) as ck:
        save(ck, model, opt, 3)
    ckpt = latest_good(tmp_path)
    wider = small_model(0, hidden=32)
    before = {k: v.clone() for k, v in wider.state_dict().items()}
    with pytest.raises(CheckpointError, match=r"tensor '0\.weight' has shape \[16, 8\] in the checkpoint but \[32, 8\] in the model"):
        restore(ckpt, wider, sgd(wider))
    assert_same_state(before, wider.state_dict())  # nothing was modified
    deeper = torch.nn.Sequential(*small_model(0), torch.nn.Linear(3, 3))
    with pytest.raises(CheckpointError, match=r"tensor '4\.weight' is in the model but not in the checkpoint"):
        restore(ckpt, deeper)
    no_stats = small_model(0)
    no_stats[1] = torch.nn.BatchNorm1d(16, track_running_stats=False)
    with pytest.raises(CheckpointError, match=r"tensor '1\.num_batches_tracked' is in the checkpoint but not in the model"):
        restore(ckpt, no_stats)
    with pytest.raises(CheckpointError, match=r"tensor '0\.weight' is torch\.float32 in the checkpoint but torch\.float64"):
        restore(ckpt, small_model(0).double())


def test_a_checkpoint_of_another_run_is_refused_unless_allowed(tmp_path: Path) -> None:
    ours, theirs = RunConfig(), RunConfig().with_overrides({"train.lr": 0.2})
    model, opt = trained()
    with Checkpointer(tmp_path) as ck:
        ck.save(model, opt, step=3, fingerprint=theirs.fingerprint(), run=theirs.to_dict())
    ckpt = latest_good(tmp_path)
    other = small_model(1)
    other_opt = torch.optim.SGD(other.parameters(), lr=0.05, momentum=0.9)
    with pytest.raises(CheckpointError, match=rf"of run {theirs.fingerprint()}, not of this run {ours.fingerprint()} "
                                              r"\(train\.lr: 0\.2 vs 0\.05\)"):
        restore(ckpt, other, other_opt, fingerprint=ours.fingerprint(), run=ours.to_dict())
    restore(ckpt, other, other_opt, fingerprint=ours.fingerprint(), run=ours.to_dict(), allow_other_run=True)
    assert_same_state(model.state_dict(), other.state_dict())
    assert other_opt.param_groups[0]["lr"] == 0.05  # the new run's hyperparameters stand
    assert same_bits(other_opt.state[other[0].weight]["momentum_buffer"], opt.state[model[0].weight]["momentum_buffer"])


def test_a_peer_refuses_to_resume_another_runs_checkpoint_before_training(tmp_path: Path, coordinator_factory: Any) -> None:
    swarm = fast_config(**{"train.shards": 2})
    coord = coordinator_factory(swarm)
    workload = DigitsWorkload()
    model = workload.build_model(seed=0)
    other = swarm.with_overrides({"train.lr": 0.2})
    with Checkpointer(tmp_path) as ck:
        ck.save(model, None, step=10, fingerprint=other.fingerprint(), shard=1, run=other.to_dict())
    options = PeerOptions(join=coord.address.removeprefix("tcp://"), bind=f"{next_host()}:0", resume=tmp_path, progress=False)
    threads = torch.get_num_threads()
    try:
        with pytest.raises(CheckpointError, match=r"not of this run .* \(train\.lr: 0\.2 vs 0\.05\); allow another run"):
            run_peer(options)
    finally:
        torch.set_num_threads(threads)  # run_peer sets the peer's thread count


def test_a_state_safetensors_cannot_hold_is_refused_before_anything_is_written(tmp_path: Path) -> None:
    model, opt = trained()
    with Checkpointer(tmp_path) as ck:
        save(ck, model, opt, 3)
        model.register_buffer("phase", torch.zeros(2, dtype=torch.complex128))
        with pytest.raises(CheckpointError, match="cannot checkpoint the model: safetensors cannot store torch.complex128"):
            save(ck, model, opt, 4)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["ckpt-000001-step-3.json"]
    assert len(list(tmp_path.iterdir())) == 1 + 3  # the lock and one checkpoint: no partial files


def test_checkpoint_error_is_a_gossip_error() -> None:
    assert issubclass(CheckpointError, GossipError)


# -- property: any small state dict round-trips ----------------------------------------

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int8, torch.uint8, torch.bool]


def random_tensor(dtype: torch.dtype, shape: list[int], seed: int, special: bool) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.rand(shape, generator=g) > 0.5
    if dtype.is_floating_point:
        t = (torch.randn(shape, generator=g) * 1e3).to(dtype)
        if special and t.numel():
            t.view(-1)[0] = float("nan")
            t.view(-1)[-1] = -0.0
        return t
    info = torch.iinfo(dtype)
    return torch.randint(info.min, info.max, shape, generator=g, dtype=torch.int64).to(dtype)


class Bag(torch.nn.Module):
    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        super().__init__()
        for name, t in tensors.items():
            if t.dtype.is_floating_point and name.startswith("p"):
                self.register_parameter(name, torch.nn.Parameter(t))
            else:
                self.register_buffer(name, t)


specs = st.lists(
    st.tuples(
        st.sampled_from(DTYPES), st.lists(st.integers(0, 4), max_size=3), st.integers(0, 2**31), st.booleans(), st.booleans()
    ),
    max_size=5,
)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(specs)
def test_random_small_state_dicts_round_trip(spec: list[tuple[torch.dtype, list[int], int, bool, bool]]) -> None:
    tensors = {
        f"{'p' if param else 'b'}{i}": random_tensor(dtype, shape, seed, special)
        for i, (dtype, shape, seed, special, param) in enumerate(spec)
    }
    original = Bag(tensors)
    blank = Bag({k: torch.zeros_like(v) for k, v in tensors.items()})
    with tempfile.TemporaryDirectory() as d:
        with Checkpointer(d) as ck:
            ck.save(original, None, step=len(spec))
        restore(latest_good(d), blank)
    for name, t in original.state_dict().items():
        assert same_bits(blank.state_dict()[name], t), name


# -- the CLI ---------------------------------------------------------------------------


def test_resume_without_a_good_checkpoint_exits_2_naming_the_problem(tmp_path: Path) -> None:
    model, opt = trained()
    with Checkpointer(tmp_path) as ck:
        meta = save(ck, model, opt, 3)
    damage(data_files(meta)["model"], "truncate")
    # The checkpoint is read before joining, so the (unused) join address is never contacted.
    result = run_forked(["peer", "--join", "127.0.0.1:9", "--resume", str(tmp_path), "--quiet"], 60, "gossiptrain peer",
                        tmp_path)
    assert result.returncode == 2, result
    assert f"no good checkpoint in {tmp_path}" in result.stderr and str(data_files(meta)["model"]) in result.stderr
    assert "Traceback" not in result.stderr


def test_a_stopped_peer_resumes_from_its_checkpoint(procs: Procs, coordinator_factory: Any, tmp_path: Path) -> None:
    swarm = fast_config(**{"train.shards": 2, "train.max_steps": 0, "train.max_seconds": 120})
    coord = coordinator_factory(swarm)
    join = coord.address.removeprefix("tcp://")
    ckdir = tmp_path / "ck"
    every = ("--checkpoint-dir", str(ckdir), "--checkpoint-every-steps", "40", "--checkpoint-keep", "2")
    other = procs.peer(join, "--shard", "0", name="other")
    saver = procs.peer(join, "--shard", "1", *every, name="saver")
    procs.wait_for(lambda: len(saver.records("checkpoint")) >= 2, 90, "two periodic checkpoints")
    saver.signal(signal.SIGTERM)
    assert saver.wait(30) == 0, saver.output()
    (done,) = saver.records("done")
    last = saver.records("checkpoint")[-1]
    assert last["step"] == done["step"] and done["checkpoints"] == len(saver.records("checkpoint"))  # saved on the way out
    assert len(list_checkpoints(ckdir)) == 2
    ckpt = latest_good(ckdir)
    assert (ckpt.info.step, ckpt.info.samples_seen, ckpt.info.shard) == (last["step"], last["samples_seen"], 1)
    # The checkpoint is exactly the model the peer evaluated when it stopped (one thread, as the peer).
    workload = load_workload(swarm.train.workload)
    model = workload.build_model(seed=1)
    restore(ckpt, model, fingerprint=saver.records("start")[0]["fingerprint"])
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert workload.evaluate(model).accuracy == done["test_acc"]
    finally:
        torch.set_num_threads(threads)

    resumed = procs.peer(join, "--resume", str(ckdir), *every, name="resumed")  # no --shard: the checkpoint's
    procs.wait_for(lambda: resumed.records("eval"), 60, "the resumed peer's first evaluation")
    (start,) = resumed.records("start")
    assert (start["step"], start["resumed_step"], start["samples_seen"], start["shard"]) == (
        last["step"], last["step"], last["samples_seen"], 1,
    )
    assert resumed.records("eval")[0]["step"] >= last["step"]
    # It keeps checkpointing into the same directory (the stopped peer's lock is gone).
    procs.wait_for(lambda: any(r["step"] > last["step"] for r in resumed.records("checkpoint")), 60, "a checkpoint after resuming")
    # A peer stopped during its join aborts with 130 by design (a slow start on a loaded machine, its state download
    # from the saver cut short by the saver's stop): wait until the other peer trains before stopping it.
    procs.wait_for(lambda: other.records("start"), 60, "the other peer training")
    for p in (resumed, other):
        p.signal(signal.SIGTERM)
    for p in (resumed, other):
        assert p.wait(30) == 0, p.output()
    assert latest_good(ckdir).info.step == resumed.records("done")[0]["step"]


# -- the averaging state ------------------------------------------------------------------------


def test_the_averaging_state_round_trips_and_a_bad_one_is_refused_before_writing(tmp_path: Path) -> None:
    model, opt = trained()
    with Checkpointer(tmp_path) as ck:
        ck.save(model, opt, step=3, averaging={"push_sum_weight": 0.375})
        ck.save(model, opt, step=4)
        with pytest.raises(CheckpointError, match="averaging.push_sum_weight is nan"):
            ck.save(model, opt, step=5, averaging={"push_sum_weight": float("nan")})
    first, second = sorted((read_checkpoint(p) for p in list_checkpoints(tmp_path)), key=lambda c: c.info.seq)
    assert first.info.averaging == {"push_sum_weight": 0.375}
    assert second.info.averaging is None  # none given: a pairwise peer, or a checkpoint of an older gossiptrain
    assert len(list_checkpoints(tmp_path)) == 2  # the refused save wrote nothing


def test_a_resumed_push_sum_machine_keeps_its_weight_and_refuses_an_impossible_one() -> None:
    from gossiptrain.config import GossipConfig
    from gossiptrain.protocol.algorithms import make_averaging

    def machine() -> Any:
        params = {"w": torch.ones(4)}
        return make_averaging(params, GossipConfig(algorithm="push-sum"), random.Random(0), me="a")

    saved = machine()
    saved.weight = 0.3125
    resumed = machine()
    resumed.restore_state(saved.checkpoint_state())
    assert resumed.weight == 0.3125 and resumed.mass()[1] == 0.3125
    fresh = machine()
    fresh.restore_state({})  # a pairwise run's checkpoint: a newcomer's weight
    assert fresh.weight == 1.0
    with pytest.raises(CheckpointError, match="push-sum weight"):
        fresh.restore_state({"push_sum_weight": 0.0})


def test_a_push_sum_peer_resumes_with_the_weight_it_saved(procs: Procs, coordinator_factory: Any, tmp_path: Path) -> None:
    swarm = fast_config(**{"train.shards": 2, "train.max_steps": 0, "train.max_seconds": 120, "gossip.algorithm": "push-sum"})
    coord = coordinator_factory(swarm)
    join = coord.address.removeprefix("tcp://")
    ckdir = tmp_path / "ck"
    every = ("--checkpoint-dir", str(ckdir), "--checkpoint-every-steps", "40")
    other = procs.peer(join, "--shard", "0", name="other")
    saver = procs.peer(join, "--shard", "1", *every, name="saver")
    procs.wait_for(lambda: saver.records("checkpoint") and saver.records("eval") and saver.records("eval")[-1]["exchanges"] > 0,
                   90, "a checkpoint after push-sum exchanges")
    saver.signal(signal.SIGTERM)
    assert saver.wait(30) == 0, saver.output()
    saved = latest_good(ckdir).info.averaging
    assert saved is not None and 0 < saved["push_sum_weight"] < 2, saved  # two peers: the weights sum to 2
    resumed = procs.peer(join, "--resume", str(ckdir), name="resumed")
    procs.wait_for(lambda: resumed.records("start"), 60, "the resumed peer's start")
    assert resumed.records("start")[0]["resumed_averaging"] == saved
    for p in (resumed, other):
        p.signal(signal.SIGTERM)
    for p in (resumed, other):
        assert p.wait(30) == 0, p.output()


# -- a full disk --------------------------------------------------------------------------------


@pytest.mark.skipif(not hasattr(__import__("resource"), "prlimit"), reason="needs prlimit (Linux)")
def test_a_failing_disk_costs_one_error_per_scheduled_checkpoint_and_the_summary_names_the_last_good_one(
    procs: Procs, coordinator_factory: Any, tmp_path: Path,
) -> None:
    import re
    import resource

    # Real writes failing: once the peer has saved, its file size limit (set from here) drops below the size of a
    # checkpoint's model file (digits: 4.5 MB), so every later save fails in write() (EFBIG; Python ignores SIGXFSZ),
    # as on a full disk. Its log and metrics stay far below the limit.
    swarm = fast_config(**{"train.shards": 1, "train.max_steps": 0, "train.max_seconds": 120, "train.workload": "digits",
                           "train.eval_every_seconds": 1.0})
    coord = coordinator_factory(swarm)
    ckdir, every = tmp_path / "ck", 20
    saver = procs.peer(coord.address.removeprefix("tcp://"), "--checkpoint-dir", str(ckdir),
                       "--checkpoint-every-steps", str(every), name="saver")
    procs.wait_for(lambda: saver.records("checkpoint"), 90, "a first checkpoint")
    _, hard = resource.prlimit(saver.popen.pid, resource.RLIMIT_FSIZE)
    resource.prlimit(saver.popen.pid, resource.RLIMIT_FSIZE, (1 << 20, hard))

    def failed_steps() -> list[int]:
        return [int(s) for s in re.findall(r"checkpoint at step (\d+) failed", saver.output())]

    procs.wait_for(lambda: len(failed_steps()) >= 3, 90, "three failed checkpoints")
    saver.signal(signal.SIGTERM)
    assert saver.wait(30) == 0, saver.output()
    (done,) = saver.records("done")
    steps = failed_steps()  # the scheduled ones, then the save on the way out
    assert len(steps) == done["checkpoint_failures"] and "File too large" in saver.output()
    assert all(b - a >= every for a, b in zip(steps, steps[1:-1])), steps  # not retried at every step
    last_good = saver.records("checkpoint")[-1]
    assert last_good["step"] < steps[0]
    assert done["checkpoint"] == last_good["path"] == str(latest_good(ckdir).info.path)  # intact, and named
