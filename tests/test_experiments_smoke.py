"""The experiments: each script runs end to end in --quick mode, and the harness's pieces hold.

Smoke tests only: they check that a script finishes, prints its headline
keys as JSON on its last line and writes its CSV, summary and plots; never
the numbers themselves (those are benchmarks, run by hand). Each script runs
in its own process group, killed whole if it overruns, so no peer, rank or
server process outlives a test.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
import time
from itertools import islice
from pathlib import Path
from typing import Any

import msgpack
import pytest
import torch

from experiments import harness
from experiments.baselines import param_server
from gossiptrain.train.local_trainer import LocalTrainer
from gossiptrain.train.workload import load_workload

from .swarm import ROOT, run_forked, run_quick_experiment

SCRIPT_TIMEOUT = 200  # seconds; the quick runs take well under a minute each on 2 idle cores


def run_script(name: str, out: Path, *flags: str) -> dict[str, Any]:
    """Run experiments/NAME.py --quick (and ``flags``); return its last line as JSON."""
    return run_quick_experiment(name, out, SCRIPT_TIMEOUT, *flags)[0]


def assert_outputs(out: Path, pngs: list[str]) -> None:
    assert (out / "results.csv").read_text().count("\n") >= 2
    assert (out / "summary.md").read_text().startswith("# ")
    for png in pngs:
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", png


def finite(x: Any) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


# -- the scripts -------------------------------------------------------------------------


@pytest.mark.slow  # a whole benchmark in miniature (real swarms and baselines): `make test-slow`; test_experiment_scripts.py checks it starts
@pytest.mark.timeout(SCRIPT_TIMEOUT + 30)
def test_stragglers_quick(tmp_path: Path) -> None:
    heads = run_script("stragglers", tmp_path)
    for key in ("ddp_over_gossip_time", "ps_over_gossip_time", "gossip_throughput_kept"):
        assert key in heads
    assert finite(heads["gossip_throughput_kept"]) and heads["gossip_throughput_kept"] > 0
    assert_outputs(tmp_path, ["accuracy_vs_time.png", "time_to_target.png"])
    assert "| gossip |" in (tmp_path / "summary.md").read_text()


@pytest.mark.slow  # a whole benchmark in miniature (real swarms and baselines): `make test-slow`; test_experiment_scripts.py checks it starts
@pytest.mark.timeout(SCRIPT_TIMEOUT + 30)
def test_parity_quick(tmp_path: Path) -> None:
    heads = run_script("parity", tmp_path)
    assert finite(heads["acc_gap_points"])
    assert 0 <= heads["ddp_acc"] <= 1 and 0 <= heads["gossip_avg_acc"] <= 1
    assert_outputs(tmp_path, ["accuracy.png"])


@pytest.mark.slow  # real swarms of several-worker peers: `make test-slow`; test_experiment_scripts.py checks it starts
@pytest.mark.timeout(SCRIPT_TIMEOUT + 30)
def test_hybrid_quick(tmp_path: Path) -> None:
    heads = run_script("hybrid", tmp_path)
    assert finite(heads["two_workers_minus_one_points"]) and finite(heads["two_by_two_minus_four_by_one_points"])
    assert (tmp_path / "hybrid.csv").read_text().count("\n") == 5  # a header and four setups
    assert "| 2 peers x 2 workers |" in (tmp_path / "summary.md").read_text()


@pytest.mark.slow  # 4 gloo processes with a 4M-parameter transformer, then 8 swarms of 4: ~2 min: `make test-slow`
@pytest.mark.timeout(2 * SCRIPT_TIMEOUT + 30)
def test_model_parallel_quick(tmp_path: Path) -> None:
    """experiments/model_parallel.py (issue 48): a rank of a 2-rank FSDP2 peer holds and sends about half; every
    swarm (FSDP2, pipeline, DDP, single workers) trains through Peer and its pieces gather into a finite model."""
    heads = run_quick_experiment("model_parallel", tmp_path, 2 * SCRIPT_TIMEOUT)[0]
    assert heads["exchanges"] == 1 and 0.45 <= heads["held_ratio_max"] <= 0.55 and 0.45 <= heads["sent_ratio_max"] <= 0.55
    summary = (tmp_path / "summary.md").read_text()
    assert "| one worker, the whole model |" in summary and "| 2 peers x 2 pipeline stages | equal time |" in summary
    assert len(heads["val_loss"]) == 8 and all(finite(v) and v < 6 for v in heads["val_loss"].values()), heads


@pytest.mark.slow  # a coordinator, 4 Python-API peers twice and 4 DDP ranks, ~2 min on 2 cores: `make test-slow`; test_experiment_scripts.py checks it starts
@pytest.mark.timeout(2 * SCRIPT_TIMEOUT + 30)
def test_user_loop_quick(tmp_path: Path) -> None:
    """experiments/user_loop.py (issue 46): the user's own loop on the Python API, given/plain optimizer and DDP."""
    heads = run_quick_experiment("user_loop", tmp_path, 2 * SCRIPT_TIMEOUT)[0]
    for arm in ("given", "plain", "ddp"):
        cell = heads["loopback-iid"][arm]
        assert cell["runs"] == 1 and cell["errors"] == 0 and cell["crashed_runs"] == 0, (arm, cell)
        assert finite(cell["median_final_acc"]) and cell["median_final_acc"] > 0.5, (arm, cell)
    assert (tmp_path / "runs.csv").read_text().count("\n") == 4  # a header and three runs
    summary = (tmp_path / "summary.md").read_text()
    assert summary.startswith("# ") and "`python experiments/user_loop.py --quick" in summary
    assert "| loopback-iid | plain |" in summary


def test_user_loop_summarises_each_setting_and_arm(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Medians count a run that missed the target as slower than any; non-finite and crashed runs are counted."""
    from argparse import Namespace

    from experiments import user_loop

    def digits(arm: str, seed: int, t: float | None, **extra: Any) -> dict[str, Any]:
        return {"setting": "100mbit-skew", "arm": arm, "seed": seed, "time_to_target_s": t, "nonfinite": False,
                "max_mean_acc": 0.97, "final_acc": 0.96, "final_acc_after_finish": 0.97, "steps_per_peer": 900, **extra}

    rows = [
        digits("given", 0, None, nonfinite=True, crashed="peer-1 exited with status 1"), digits("given", 1, None, nonfinite=True),
        digits("plain", 0, 20.0), digits("plain", 1, None), digits("ddp", 0, 30.0), digits("ddp", 1, 40.0),
        {"setting": "charlm-adam", "arm": "given", "seed": 0, "val_loss": 1.1, "val_loss_before_finish": 1.2, "lr_scale": 1.7},
        {"setting": "charlm-adam", "arm": "alone", "seed": 0, "val_loss": 1.3, "val_loss_before_finish": 1.3},
    ]
    args = Namespace(settings=["100mbit-skew", "charlm-adam"], arms=["given", "plain", "ddp"], seeds=2, seconds=40.0,
                     target=0.97, charlm_steps=300, charlm_lr=0.003)
    user_loop.report(rows, args, tmp_path, "python experiments/user_loop.py --seeds 2")
    head = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    skew = head["100mbit-skew"]
    assert skew["given"] == {"median_time_to_target_s": None, "nonfinite_runs": 2, "runs": 2, "errors": 0,
                             "crashed_runs": 1, "median_final_acc": 0.96}
    assert skew["plain"]["median_time_to_target_s"] is None  # one of two missed: the median is a miss
    assert skew["ddp"]["median_time_to_target_s"] == 35.0
    assert head["charlm-adam"]["given"]["median_val_loss"] == 1.1 and head["charlm-adam"]["alone"]["median_val_loss"] == 1.3
    summary = (tmp_path / "summary.md").read_text()
    assert "| 100mbit-skew | plain | 2 | not reached | 20.0, not reached |" in summary
    assert "peer-1 exited with status 1" in summary


@pytest.mark.slow  # the whole exchange benchmark in miniature, 7 s: `make test-slow`; test_experiment_scripts.py checks it starts
@pytest.mark.timeout(SCRIPT_TIMEOUT + 30)
def test_exchange_quick(tmp_path: Path) -> None:
    heads = run_script("exchange", tmp_path)
    assert finite(heads["fraction_of_raw_zmq_16mib"]) and heads["fraction_of_raw_zmq_16mib"] > 0
    assert finite(heads["over_gloo_16mib"]) and heads["over_gloo_16mib"] > 0
    assert_outputs(tmp_path, ["throughput.png"])
    assert "gloo all-reduce" in (tmp_path / "results.csv").read_text()


@pytest.mark.slow  # two 4.3M-parameter peers and their steps, ~10 s: `make test-slow`
@pytest.mark.timeout(SCRIPT_TIMEOUT + 30)
def test_exchange_of_a_realistic_model_quick(tmp_path: Path) -> None:
    """``exchange.py --model``: the whole exchange, the wire and raw ZeroMQ timed with their CPU, and the pool's size."""
    heads = run_script("exchange", tmp_path, "--model", "charlm-large")
    assert heads["params"] == 4_266_240 and finite(heads["fraction_of_raw_zmq"]) and heads["fraction_of_raw_zmq"] > 0
    assert heads["buffers_at_end"] == heads["buffers_after_warm_up"] > 0  # nothing allocated past the warm-up
    assert all(finite(heads["cpu_ms_per_round"][name]) for name in ("gossip exchange", "gossip wire", "raw zeromq"))
    assert 0 < heads["fraction_bound_by_cores"] <= 1
    summary = (tmp_path / "charlm-large" / "summary.md").read_text()
    assert "| gossip exchange |" in summary and "CPU: an exchange keeps the two processes busy" in summary


@pytest.mark.slow  # two 4.3M-parameter machines in one process, ~5 s: `make test-slow`
@pytest.mark.timeout(SCRIPT_TIMEOUT + 30)
def test_exchange_phases_of_a_realistic_model_quick(tmp_path: Path) -> None:
    """``exchange.py --model --phases``: each step of an exchange timed in one process, written and summed."""
    heads = run_script("exchange", tmp_path, "--model", "charlm-large", "--phases")
    phases = heads["phases_ms"]
    assert len(phases) == 8 and all(finite(ms) and ms > 0 for ms in phases.values()), phases
    assert heads["total_ms"] == pytest.approx(sum(phases.values()), abs=0.02)
    assert (tmp_path / "charlm-large-phases" / "phases.csv").read_text().count("\n") == 9  # a header and 8 phases


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc (Linux)")
def test_the_exchange_benchmark_counts_the_cpu_of_both_processes() -> None:
    """``exchange.py --model`` bounds the exchange by its CPU time: read from /proc, ours and the responder's."""
    from experiments.exchange import CpuMeter, cpu_seconds

    child = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        meter = CpuMeter({"busy": child.pid})
        meter.start("busy")
        began = cpu_seconds(child.pid)
        assert began is not None
        deadline = time.monotonic() + 60
        while cpu_seconds(child.pid) == began and time.monotonic() < deadline:  # a clock tick of the child's work
            time.sleep(0.01)
        meter.stop("busy", rounds=2)
        spent = meter.per_round_ms("busy")
        assert spent is not None and spent > 0
        assert meter.per_round_ms("never measured") is None
    finally:
        child.kill()
        child.wait()
    assert cpu_seconds(child.pid) is None  # gone: nothing to read


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks what it says where CUDA is absent")
def test_gpu_check_says_in_one_line_that_there_is_no_cuda_and_exits_2(tmp_path: Path) -> None:
    # Forked from the test fork server (tests/zygote.py): what the script says, not its interpreter's start.
    result = run_forked([], 120, "gpu_check.py", tmp_path, module=str(ROOT / "experiments" / "gpu_check.py"))
    assert result.returncode == 2, result.stdout + result.stderr
    (line,) = result.stdout.strip().splitlines()
    assert line.startswith("gpu_check: CUDA is not available") and result.stderr == ""


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks what it says where CUDA is absent")
def test_the_exchange_on_cuda_says_in_one_line_that_there_is_none_and_exits_2(tmp_path: Path) -> None:
    # Forked from the test fork server (tests/zygote.py): what the script says, not its interpreter's start.
    result = run_forked(["--model", "charlm-large", "--device", "cuda", "--quick"], 120, "exchange.py", tmp_path,
                        module=str(ROOT / "experiments" / "exchange.py"))
    assert result.returncode == 2, result.stdout + result.stderr
    (line,) = result.stdout.strip().splitlines()
    assert line.startswith("exchange: --device cuda, but CUDA is not available") and result.stderr == ""


# -- the harness: the baselines train what gossip trains ---------------------------------


@pytest.mark.parametrize("seed,shard", [(0, 0), (0, 3), (2, 1)])
def test_baselines_see_the_gossip_peers_batches(seed: int, shard: int) -> None:
    workload = load_workload(harness.WORKLOAD)
    cfg = harness.run_config(4, seed).train
    trainer = LocalTrainer(workload, harness.build_model(workload, cfg), cfg, shard)
    ours = harness.shard_batches(workload, cfg, shard)
    for (x, y), (u, v) in zip(islice(trainer._data, 30), islice(ours, 30)):
        assert torch.equal(x, u) and torch.equal(y, v)


def test_every_system_starts_from_the_same_model() -> None:
    workload = load_workload(harness.WORKLOAD)
    cfg = harness.run_config(4, 1).train
    a, b = harness.build_model(workload, cfg), harness.build_model(workload, cfg)
    flat = harness.flat_views(b)  # the parameter server's layout
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    flat.zero_()
    assert all(float(p.detach().abs().sum()) == 0 for p in b.parameters())  # the parameters are views of the buffer


def test_time_to_target_needs_the_target_to_hold() -> None:
    P = harness.Point
    points = [P(0.25, 10, 0.5), P(0.5, 20, 0.97), P(0.75, 30, 0.9), P(1.0, 40, 0.96), P(1.25, 50, 0.97), P(1.5, 60, 0.98)]
    assert harness.time_to_target(points, 0.96, hold=3) == 1.0
    assert harness.time_to_target(points, 0.99, hold=3) is None
    assert harness.throughput(points) == 40.0
    assert harness.spread([2.0, None, 1.0]) == (2.0, 1.0, math.inf)


def test_gossip_series_counts_from_the_first_peer() -> None:
    records = [
        [{"event": "start", "time": 100.0}, {"event": "eval", "time": 100.3, "step": 3, "test_acc": 0.5}],
        [{"event": "start", "time": 100.2}, {"event": "eval", "time": 100.4, "step": 1, "test_acc": 0.7}],
    ]
    points, t0 = harness.gossip_series(records, batch_size=32)
    assert t0 == 100.0
    assert points == [harness.Point(0.4, 4 * 32, 0.6)]


# -- the parameter server's wire: msgpack headers and raw bytes, validated ----------------


class _Frame:
    """Stands in for zmq.Frame (``buffer``) without a socket."""

    def __init__(self, data: bytes) -> None:
        self.buffer = memoryview(bytearray(data))


@pytest.mark.parametrize(
    "frames",
    [
        [b"\x92\x01\x02"],  # a list, not a map
        [msgpack.packb({"kind": "grad", "worker": 0})],  # missing version
        [msgpack.packb({"kind": "grad", "worker": 0, "version": 1}), b"\0" * 7],  # wrong tensor size
        [msgpack.packb({"kind": "grad", "worker": -1, "version": 1}), b"\0" * 8],  # negative index
        [msgpack.packb({"kind": "grad", "worker": True, "version": 1}), b"\0" * 8],  # bool, not int
        [msgpack.packb({"kind": "hello", "worker": 0}), b"\0" * 8],  # a tensor it does not take
        [msgpack.packb({"kind": "exec", "worker": 0})],  # unknown kind
        [msgpack.packb({"kind": "hello", "worker": b"x"}, use_bin_type=True)],  # bin type refused
        [b"\xc1"],  # not msgpack
        [b"\x81" + b"\xa1k" * 300],  # over the header bound
    ],
)
def test_param_server_drops_bad_messages(frames: list[bytes]) -> None:
    with pytest.raises(param_server.BadMessage):
        param_server.parse([_Frame(f) for f in frames], nbytes=8)  # type: ignore[arg-type]


def test_param_server_reads_a_good_gradient() -> None:
    grad = torch.arange(2, dtype=torch.float32)
    frames = [_Frame(param_server.header(param_server.GRAD, worker=1, version=5)), _Frame(grad.numpy().tobytes())]
    h, tensor = param_server.parse(frames, nbytes=8)  # type: ignore[arg-type]
    out = torch.zeros(2)
    assert tensor is not None
    param_server.copy_into(out, tensor)
    assert h == {"kind": "grad", "worker": 1, "version": 5} and torch.equal(out, grad)


@pytest.mark.timeout(SCRIPT_TIMEOUT + 30)
def test_relaysgd_table_quick(tmp_path: Path) -> None:
    """Two rows of the RelaySGD table in miniature (simulated, about 5 s): every cell an accuracy.

    Simulated, it starts no process: forked from the test fork server (tests/zygote.py), the script's run, not its
    interpreter's start and torch's import."""
    out = tmp_path / "out"
    done = run_forked(["--quick", "--out", str(out)], SCRIPT_TIMEOUT, "relaysgd_table.py --quick", tmp_path,
                      module=str(ROOT / "experiments" / "relaysgd_table.py"))
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    head = json.loads(done.stdout.strip().splitlines()[-1])
    assert set(head) == {"alpha_0.1", "alpha_0.01"}
    assert all(set(cells) == {"allreduce", "dpsgd_ring"} for cells in head.values())
    assert all(0.0 <= acc <= 1.0 for cells in head.values() for acc in cells.values())
    assert (out / "runs.csv").exists() and "| allreduce |" in (out / "summary.md").read_text()


@pytest.mark.slow  # four 16-peer simulations, about 20 s: `make test-slow`; test_experiment_scripts.py checks it starts
@pytest.mark.timeout(SCRIPT_TIMEOUT + 30)
def test_scale_defaults_quick(tmp_path: Path) -> None:
    head = run_script("scale_defaults", tmp_path)
    assert set(head) == {"10gbit"} and set(head["10gbit"]) == {"defaults", "two-in-flight", "sqrt", "ddp-hd"}
    own, averaged = head["10gbit"]["defaults"]
    assert own is None or own > 0
    assert head["10gbit"]["ddp-hd"][1] is None  # DDP has one model: no average to time


@pytest.mark.timeout(SCRIPT_TIMEOUT + 30)
def test_sim_speed_quick(tmp_path: Path) -> None:
    """The simulator's speed, stacked steps against one by one, in miniature (8 simulated peers, about 2 s; forked from
    the test fork server): both ways end on the same accuracy."""
    out = tmp_path / "out"
    done = run_forked(["--quick", "--out", str(out)], SCRIPT_TIMEOUT, "sim_speed.py --quick", tmp_path,
                      module=str(ROOT / "experiments" / "sim_speed.py"))
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    head = json.loads(done.stdout.strip().splitlines()[-1])
    assert set(head) == {"logreg_8"} and head["logreg_8"]["stacked_over_one_by_one"] > 0
    runs = json.loads((out / "runs.json").read_text())
    assert [r["stacked"] for r in runs] == [False, True] and runs[1]["stacked_steps"] > 0
    assert runs[0]["mean_test_acc"] == pytest.approx(runs[1]["mean_test_acc"], abs=0.01)
    assert "| logreg | 8 |" in (out / "summary.md").read_text()
