"""What the experiments share, so that gossip and its baselines run genuinely the same thing.

Every system here trains the same workload (digits, the ~1.13M-parameter
MLP) from the same seed, with the same shards (worker i trains shard i of N,
exactly the shard and batch order a gossip peer of index i trains), the same
lr, momentum and batch size (``RunConfig``'s), and the same straggler
injection: after each step the slowed worker sleeps (slowdown - 1) x the
compute time of that step, so it idles rather than burning a core (the
`--slowdown` of `gossiptrain peer`).

Each system evaluates on the workload's test set every EVAL_EVERY seconds of
its own time and records (elapsed, samples, test accuracy); the time to a
target is the first evaluation that starts HOLD evaluations at or above it,
counted from when training starts. Runs are real processes on 127.0.0.1
with ports picked by the OS; each run's processes are stopped (SIGTERM,
then SIGKILL) before the next starts.

Also here: the gossip swarm runner (a coordinator plus `gossiptrain peer`
processes, or peers on the Python API when final models are needed), the
DDP and parameter-server runners, medians over seeds, and CSV / summary.md /
PNG writing. ``python -m experiments.harness gossip-peer ...`` is the
Python-API peer used by the parity experiment.
"""

from __future__ import annotations

import argparse
import csv
import datetime
import json
import math
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
from torch import Tensor

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from gossiptrain.config import RunConfig, TrainConfig  # noqa: E402
from gossiptrain.train.local_trainer import load_shard  # noqa: E402
from gossiptrain.train.metrics import read_metrics  # noqa: E402
from gossiptrain.train.workload import Workload, batches, load_workload  # noqa: E402

EVAL_EVERY = 0.25  # seconds between test-set evaluations, in every system
HOLD = 3  # evaluations in a row at or above the target: one noisy crossing is not convergence
STRAGGLER = 0  # index of the slowed worker (gossip peer, DDP rank, PS worker)
WORKLOAD = "digits"
POLL = 0.2  # seconds between looks at a run's metrics
STARTUP = 300.0  # seconds a run's processes may take to report a first point (imports, joining) on a loaded machine
STOP_GRACE = 10.0  # seconds a stopped process gets before SIGKILL


# -- the run's settings ------------------------------------------------------------------


def run_overrides(
    workers: int, seed: int, *, max_seconds: float = 0.0, max_steps: int = 0, eval_every: float = EVAL_EVERY
) -> dict[str, Any]:
    """The fields of the swarm's configuration that differ from the defaults."""
    return {
        "train.workload": WORKLOAD,
        "train.shards": workers,
        "train.seed": seed,
        "train.max_steps": max_steps,
        "train.max_seconds": max_seconds,
        "train.eval_every_seconds": eval_every,
    }


def run_config(workers: int, seed: int, *, max_seconds: float = 0.0, max_steps: int = 0, eval_every: float = EVAL_EVERY) -> RunConfig:
    """The swarm's configuration; the baselines take their training settings from its ``train`` section."""
    return RunConfig().with_overrides(run_overrides(workers, seed, max_seconds=max_seconds, max_steps=max_steps, eval_every=eval_every))


def build_model(workload: Workload, cfg: TrainConfig) -> torch.nn.Module:
    """The model every worker of every system starts from (as `gossiptrain peer` builds it)."""
    torch.manual_seed(cfg.seed)
    return workload.build_model(cfg.seed)


def shard_batches(workload: Workload, cfg: TrainConfig, shard: int) -> Iterator[tuple[Tensor, Tensor]]:
    """The endless mini-batches (B, 64), (B,) a gossip peer on ``shard`` trains, in the same order.

    Mirrors LocalTrainer (iid shard, shuffled with seed * 1000 + shard);
    tests/test_experiments_smoke.py checks that both streams are identical.
    """
    inputs, targets = load_shard(workload, cfg, shard)  # as LocalTrainer does, label-skewed partitions included
    return batches(inputs, targets, cfg.batch_size, seed=cfg.seed * 1000 + shard)


def sgd(params: Any, cfg: TrainConfig) -> torch.optim.SGD:
    """The optimizer of a gossip peer (LocalTrainer's), for whoever applies updates in a baseline."""
    return torch.optim.SGD(params, lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay)


@dataclass
class Straggler:
    """Emulates a slow machine as `gossiptrain peer --slowdown` does: idle (slowdown - 1) x each step's compute."""

    slowdown: float = 1.0

    def after_step(self, compute_seconds: float) -> None:
        if self.slowdown > 1:
            time.sleep((self.slowdown - 1) * max(0.0, compute_seconds))


def slowdown_of(index: int, slowdown: float) -> float:
    return slowdown if index == STRAGGLER else 1.0


def flat_views(model: torch.nn.Module) -> Tensor:
    """Make ``model``'s parameters views of one flat float32 buffer (N,) and return it: one copy moves them all."""
    params = list(model.parameters())
    flat = torch.cat([p.detach().reshape(-1) for p in params])  # (N,)
    offset = 0
    for p in params:
        n = p.numel()
        p.data = flat[offset : offset + n].view_as(p)
        offset += n
    return flat


# -- results of one run ------------------------------------------------------------------


@dataclass(frozen=True)
class Point:
    elapsed: float  # seconds since training started
    samples: int  # training samples consumed by all workers together
    acc: float  # test accuracy


@dataclass
class Run:
    system: str
    seed: int
    slowdown: float
    points: list[Point]
    target: float
    setup_seconds: float = 0.0  # process start to training start (not counted in any time)
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def time_to_target(self) -> float | None:
        return time_to_target(self.points, self.target)

    @property
    def samples_to_target(self) -> int | None:
        """Training samples (all workers) consumed by the time the target was reached: statistical efficiency."""
        t = self.time_to_target
        return None if t is None else next(p.samples for p in self.points if p.elapsed == t)

    @property
    def throughput(self) -> float:
        return throughput(self.points)

    @property
    def final_acc(self) -> float:
        return self.points[-1].acc if self.points else math.nan


def time_to_target(points: Sequence[Point], target: float, hold: int = HOLD) -> float | None:
    """Elapsed time of the first evaluation that starts ``hold`` in a row at or above ``target``."""
    for k in range(len(points) - hold + 1):
        if all(p.acc >= target for p in points[k : k + hold]):
            return points[k].elapsed
    return None


def throughput(points: Sequence[Point]) -> float:
    """Training samples per second between the first and the last evaluation (steady state, all workers running)."""
    if len(points) < 2 or points[-1].elapsed <= points[0].elapsed:
        return math.nan
    return (points[-1].samples - points[0].samples) / (points[-1].elapsed - points[0].elapsed)


def series_from(records: list[dict[str, Any]]) -> list[Point]:
    """Points of one evaluating process (DDP rank 0, the parameter server)."""
    return [Point(r["elapsed"], r["samples"], r["test_acc"]) for r in records if r.get("event") in ("eval", "done")]


def gossip_series(per_peer: list[list[dict[str, Any]]], batch_size: int) -> tuple[list[Point], float | None]:
    """The swarm's points: the peers' mean test accuracy, read every EVAL_EVERY seconds; and t0.

    Time counts from when the *first* peer started training (peers start as
    they join; counting from the last one would hide the early ones' head
    start, even at a rendezvous: the first to see the count reached starts
    up to a membership round before the others, who average with it while
    they wait). A point exists once every peer has evaluated; its time is
    when the newest of the evaluations it averages was taken, its samples
    the peers' steps at those evaluations.
    """
    starts = [next((r["time"] for r in recs if r.get("event") == "start"), None) for recs in per_peer]
    evals = [[r for r in recs if r.get("event") in ("eval", "done")] for recs in per_peer]
    if any(s is None for s in starts) or not all(evals):
        return [], None
    t0 = min(s for s in starts if s is not None)
    end = max(e[-1]["time"] for e in evals)
    points: list[Point] = []
    g = t0 + EVAL_EVERY
    while g <= end + EVAL_EVERY:
        latest = [max((r for r in e if r["time"] <= g), key=lambda r: r["time"], default=None) for e in evals]
        if all(latest):
            known = max(r["time"] for r in latest)  # type: ignore[index]
            point = Point(
                round(known - t0, 3),
                sum(r["step"] for r in latest) * batch_size,  # type: ignore[index]
                sum(r["test_acc"] for r in latest) / len(latest),  # type: ignore[index]
            )
            if not points or point.elapsed > points[-1].elapsed:
                points.append(point)
        g += EVAL_EVERY
    return points, t0


# -- processes ---------------------------------------------------------------------------


def child_env() -> dict[str, str]:
    """Children import this checkout, flush their output, use one thread and loopback for gloo."""
    return {
        **os.environ,
        "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
        "PYTHONUNBUFFERED": "1",
        "OMP_NUM_THREADS": "1",
        "GLOO_SOCKET_IFNAME": os.environ.get("GLOO_SOCKET_IFNAME", "lo"),
    }


class Procs:
    """Child processes of one run, output to log files; all stopped on exit, whatever happens."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.procs: list[tuple[str, subprocess.Popen[bytes]]] = []

    def start(self, name: str, args: list[str]) -> subprocess.Popen[bytes]:
        with open(self.workdir / f"{name}.log", "wb") as log:
            proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=child_env(), cwd=ROOT)
        self.procs.append((name, proc))
        return proc

    def failed(self) -> str | None:
        """A line naming a process that exited with an error, and its log's end."""
        for name, p in self.procs:
            if p.poll() not in (None, 0):
                tail = (self.workdir / f"{name}.log").read_text(errors="replace")[-1500:]
                return f"{name} exited with status {p.returncode}; log {self.workdir / name}.log:\n{tail}"
        return None

    def all_exited(self) -> bool:
        return all(p.poll() is not None for _, p in self.procs)

    def stop(self) -> None:
        for _, p in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + STOP_GRACE
        for _, p in self.procs:
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()

    def __enter__(self) -> "Procs":
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.stop()


def results_dir(name: str, out: Path | None, quick: bool) -> Path:
    """Where an experiment writes: ``--out`` if given, else its committed results folder, or for ``--quick``
    (a smoke test) a fresh scratch folder, so that a quick run never overwrites the results the README shows."""
    if out is not None:
        return out
    if quick:
        scratch = Path(tempfile.mkdtemp(prefix=f"gossiptrain-{name}-quick-"))
        print(f"--quick: writing to {scratch} (the committed results stay as they are; --out DIR to choose)", flush=True)
        return scratch
    return ROOT / "experiments" / "results" / name


def fresh_dir(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    for old in list(path.glob("*.jsonl")) + list(path.glob("*.log")) + list(path.glob("*.safetensors")):
        old.unlink()
    return path


def poll_run(
    procs: Procs, read: Callable[[], list[Point]], target: float | None, timeout: float, done: Callable[[], bool] | None = None,
    min_seconds: float = 0.0,
) -> list[Point]:
    """Poll ``read`` until the target holds (``target`` None: until ``done``), a process fails, or ``timeout``.

    With a target, ``timeout`` counts from the first point: start-up (up to
    STARTUP seconds: imports and joining take a minute or more on a loaded
    2-core machine) does not eat the training time. With ``min_seconds`` a
    run that reaches the target early goes on until it has trained that
    long, so that its throughput is measured over a window of at least that
    length.
    """
    deadline = time.monotonic() + timeout + (STARTUP if target is not None else 0.0)
    first_point = False
    while True:
        points = read()
        if points and not first_point:
            first_point, deadline = True, time.monotonic() + timeout
        if target is not None and time_to_target(points, target) is not None and points[-1].elapsed >= min_seconds:
            return points
        if done is not None and done():
            return read()
        problem = procs.failed()
        if problem:
            raise RuntimeError(problem)
        if time.monotonic() > deadline:
            return points
        time.sleep(POLL)


def retried(run: Callable[[], Any], what: str, retries: int = 1) -> tuple[Any, list[str]]:
    """``run()``, run again (up to ``retries`` times) if one of its processes crashed; also the crashes' first lines.

    A crash is a result too, so the experiments report every one; retrying
    keeps one crash from throwing away a whole sweep.
    """
    failures: list[str] = []
    while True:
        try:
            return run(), failures
        except RuntimeError as e:
            first = str(e).strip().splitlines()
            failures.append(f"{what}: {' / '.join(first[:1] + first[-1:])}")
            print(f"{what} failed, {'retrying' if len(failures) <= retries else 'giving up'}: {e}", file=sys.stderr, flush=True)
            if len(failures) > retries:
                raise


def start_coordinator(procs: Procs, overrides: dict[str, Any], timeout: float = 60.0, extra: Sequence[str] = ()) -> str:
    """`gossiptrain coordinator` on 127.0.0.1, a port the OS picks; returns HOST:PORT to join.

    A process of its own, not a thread here: it then runs the same code as the
    peers it starts with, even if the checkout changed since this script began.
    ``extra``: more flags (``--secure --key ... --allow ...``: the address's key
    is then not part of what is returned; joiners take it from their allow list).
    """
    sets = [a for key, value in overrides.items() for a in ("--set", f"{key}={value}")]
    procs.start("coordinator", python_m("gossiptrain", "coordinator", "--bind", "127.0.0.1:0", *extra, *sets))
    log = procs.workdir / "coordinator.log"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = re.search(r"coordinator listening on tcp://([^\s?]+)", log.read_text(errors="replace") if log.exists() else "")
        if found:
            return found.group(1)
        problem = procs.failed()
        if problem:
            raise RuntimeError(problem)
        time.sleep(0.05)
    raise RuntimeError(f"the coordinator did not start within {timeout} s; see {log}")


def chosen(text: str, known: Sequence[str], what: str) -> list[str]:
    """A comma-separated ``--arms``-style choice, each one of ``known``; SystemExit naming the unknown ones."""
    items = [t.strip() for t in text.split(",") if t.strip()]
    unknown = [t for t in items if t not in known]
    if unknown or not items:
        raise SystemExit(f"unknown {what}: {', '.join(unknown) or '(none given)'}; choose from {', '.join(known)}")
    return items


def python_m(module: str, *args: Any) -> list[str]:
    return [sys.executable, "-m", module, *map(str, args)]


# -- the systems -------------------------------------------------------------------------


def run_gossip(
    workers: int, seed: int, slowdown: float, target: float, timeout: float, workdir: Path, *, topology: str = "auto",
    min_seconds: float = 0.0, gossip: dict[str, Any] | None = None, start_together: bool = False,
) -> Run:
    """A coordinator and ``workers`` `gossiptrain peer` processes (peer i on shard i, one thread), until the target holds.

    ``gossip``: more fields of the run, e.g. {"gossip.compression": "int8"}.
    ``start_together``: every peer runs with ``--wait-for workers``, so none
    trains before all have joined (as DDP's ranks wait for their
    rendezvous); otherwise each starts as it joins, the first ones alone.
    Either way the clock starts with the first (see `gossip_series`).
    """
    fresh_dir(workdir)
    overrides = {**run_overrides(workers, seed, max_seconds=timeout + 30), "gossip.topology": topology, **(gossip or {})}
    run = RunConfig().with_overrides(overrides)
    began = time.time()
    with Procs(workdir) as procs:
        join = start_coordinator(procs, overrides)
        for i in range(workers):
            extra = ["--slowdown", str(slowdown)] if i == STRAGGLER and slowdown > 1 else []
            extra += ["--wait-for", str(workers)] if start_together else []
            procs.start(f"peer-{i}", python_m(
                "gossiptrain", "peer", "--join", join, "--quiet", "--threads", 1, "--shard", i,
                "--metrics", workdir / f"peer-{i}.jsonl", *extra,
            ))

        def read() -> list[Point]:
            return gossip_series([read_metrics(workdir / f"peer-{i}.jsonl") for i in range(workers)], run.train.batch_size)[0]

        points = poll_run(procs, read, target, timeout, min_seconds=min_seconds)
    per_peer = [read_metrics(workdir / f"peer-{i}.jsonl") for i in range(workers)]
    _, t0 = gossip_series(per_peer, run.train.batch_size)
    last = [next((r for r in reversed(recs) if r.get("event") in ("eval", "done")), {}) for recs in per_peer]
    starts = [r["time"] for recs in per_peer for r in recs if r.get("event") == "start"]
    extra_info = {
        "exchanges_per_peer": statistics.mean(r.get("exchanges", 0) for r in last),
        "steps": [r.get("step", 0) for r in last],
        "rtt_ms": statistics.median(r.get("rtt_ms", 0.0) for r in last),
        "start_spread_s": round(max(starts) - min(starts), 3) if starts else None,  # first to last peer's start
    }
    return Run("gossip", seed, slowdown, points, target, setup_seconds=(t0 or began) - began, extra=extra_info)


def run_ddp(
    workers: int, seed: int, slowdown: float, target: float | None, timeout: float, workdir: Path, *,
    max_steps: int = 0, save: Path | None = None, eval_every: float = EVAL_EVERY, min_seconds: float = 0.0,
    overrides: dict[str, Any] | None = None,
) -> Run:
    """torch DDP over gloo: one process per rank, rendezvous through a TCPStore this process hosts on port 0.

    ``overrides``: more fields of the run (train.workload, train.partition, ...), as ``run_gossip``'s ``gossip``.
    """
    import torch.distributed as dist

    fresh_dir(workdir)
    store = dist.TCPStore("127.0.0.1", 0, None, True, timeout=datetime.timedelta(seconds=60), wait_for_workers=False)
    began = time.time()
    with Procs(workdir) as procs:
        for r in range(workers):
            extra = ["--save", save] if save is not None and r == 0 else []
            extra += [a for key, value in (overrides or {}).items() for a in ("--set", f"{key}={json.dumps(value)}")]
            procs.start(f"rank-{r}", python_m(
                "experiments.baselines.ddp", "--rank", r, "--world", workers, "--store-port", store.port, "--seed", seed,
                "--slowdown", slowdown_of(r, slowdown), "--max-steps", max_steps, "--eval-every", eval_every,
                "--metrics", workdir / f"rank-{r}.jsonl", *extra,
            ))

        def read() -> list[Point]:
            return series_from(read_metrics(workdir / "rank-0.jsonl"))

        points = poll_run(procs, read, target, timeout, done=procs.all_exited if max_steps else None, min_seconds=min_seconds)
    del store
    records = read_metrics(workdir / "rank-0.jsonl")
    start = next((r["time"] for r in records if r.get("event") == "start"), began)
    last = next((r for r in reversed(records) if "compute_ms" in r), {})
    extra = {"compute_ms_rank0": last.get("compute_ms")}  # rank 0 is the straggler when there is one
    return Run("ddp", seed, slowdown, points, target or 0.0, setup_seconds=start - began, extra=extra)


def run_param_server(
    mode: str, workers: int, seed: int, slowdown: float, target: float, timeout: float, workdir: Path, *, min_seconds: float = 0.0
) -> Run:
    """A parameter server (``mode`` sync or async) and ``workers`` worker processes, until the target holds."""
    fresh_dir(workdir)
    began = time.time()
    server_log = workdir / "server.jsonl"
    with Procs(workdir) as procs:
        procs.start("server", python_m(
            "experiments.baselines.param_server", "server", "--mode", mode, "--workers", workers, "--seed", seed,
            "--metrics", server_log,
        ))

        def address() -> str | None:
            return next((r["address"] for r in read_metrics(server_log) if r.get("event") == "listening"), None)

        deadline = time.monotonic() + 60
        while (addr := address()) is None:
            problem = procs.failed()
            if problem or time.monotonic() > deadline:
                raise RuntimeError(problem or f"the parameter server did not start; see {workdir}")
            time.sleep(POLL)
        for i in range(workers):
            procs.start(f"worker-{i}", python_m(
                "experiments.baselines.param_server", "worker", "--index", i, "--workers", workers, "--server", addr,
                "--seed", seed, "--slowdown", slowdown_of(i, slowdown),
            ))
        points = poll_run(procs, lambda: series_from(read_metrics(server_log)), target, timeout, min_seconds=min_seconds)
    records = read_metrics(server_log)
    start = next((r["time"] for r in records if r.get("event") == "start"), began)
    return Run(f"ps-{mode}", seed, slowdown, points, target, setup_seconds=start - began)


def run_gossip_fixed_steps(workers: int, seed: int, steps: int, timeout: float, workdir: Path) -> list[Path]:
    """Python-API peers (one process each, shard i) that train ``steps`` steps each and save their final models.

    The same runtime as `gossiptrain peer` (Peer, LocalTrainer, one thread);
    used where the final parameters are needed (parity). Returns the
    safetensors files, one per peer.
    """
    fresh_dir(workdir)
    overrides = run_overrides(workers, seed, max_steps=steps, max_seconds=timeout + 30)
    outs = [workdir / f"peer-{i}.safetensors" for i in range(workers)]
    with Procs(workdir) as procs:
        join = start_coordinator(procs, overrides)
        for i in range(workers):
            procs.start(f"peer-{i}", python_m(
                "experiments.harness", "gossip-peer", "--join", join, "--shard", i, "--workers", workers,
                "--metrics", workdir / f"peer-{i}.jsonl", "--save", outs[i],
            ))
        peers = procs.procs[1:]  # the coordinator serves until stopped

        def finished() -> bool:
            return all(p.poll() is not None for _, p in peers)

        poll_run(procs, lambda: [], None, timeout, done=finished)
        if not finished():
            raise RuntimeError(f"gossip peers did not finish {steps} steps within {timeout} s; see {workdir}")
    missing = [p for p in outs if not p.exists()]
    if missing:
        raise RuntimeError(f"gossip peers did not save {missing}; see {workdir}")
    return outs


def gossip_peer_main(argv: list[str]) -> None:
    """A peer on the Python API (`gossiptrain.Peer`): wait for the swarm, train the run's budget, save the model."""
    from safetensors.torch import save_file

    from gossiptrain import Peer
    from gossiptrain.train.local_trainer import LocalTrainer
    from gossiptrain.train.metrics import MetricsLog

    p = argparse.ArgumentParser(prog="python -m experiments.harness gossip-peer")
    p.add_argument("--join", required=True)
    p.add_argument("--shard", type=int, required=True)
    p.add_argument("--workers", type=int, required=True)
    p.add_argument("--metrics", type=Path, required=True)
    p.add_argument("--save", type=Path, required=True)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    workloads: dict[str, Workload] = {}

    def build(config: RunConfig, shard: int) -> torch.nn.Module:
        workloads["w"] = load_workload(config.train.workload)
        return build_model(workloads["w"], config.train)

    with MetricsLog(args.metrics) as metrics, Peer(build, join=args.join, shard=args.shard) as peer:
        peer.wait_for_peers(args.workers, timeout=60)  # as DDP's rendezvous: nobody trains alone
        cfg = peer.config.train
        trainer = LocalTrainer(workloads["w"], peer.model, cfg, peer.shard)
        metrics.write({"event": "start", "time": time.time(), "shard": peer.shard})
        while trainer.steps < cfg.max_steps:
            trainer.step()
            peer.step()
        stats = peer.stats()
        acc = trainer.evaluate().accuracy
        save_file({n: t.detach().contiguous() for n, t in peer.model.state_dict().items()}, str(args.save))
        metrics.write({
            "event": "done", "time": time.time(), "shard": peer.shard, "step": trainer.steps, "test_acc": acc,
            "exchanges": stats.get("completed", 0) + stats.get("served", 0),
        })


# -- simulated swarms (gossiptrain.sim): sweeps too long to run as real processes --------

SIM_STEP_TIME = 0.006  # virtual s per local step at speed 1: the digits MLP on one core (DESIGN.md: ~6.8 ms); fixed, so runs repeat
SIM_SAMPLE_EVERY = 0.05  # virtual s between samples of every peer: about 8 steps, fine enough to time a run that takes ~100


@dataclass
class SimRun:
    """One simulated swarm, read at every sample: the peers' mean accuracy, consensus distance and bytes sent."""

    label: str
    seed: int
    points: list[Point]  # elapsed: virtual s since the simulation began; acc: mean over the live peers
    consensus: list[float]  # per point: mean over peers of ||x_i - mean_j x_j|| (L2, all parameters)
    bytes_sent: list[float]  # per point: bytes each peer has sent so far, mean over peers (after compression)
    min_acc: list[float]  # per point: the worst peer's test accuracy (an isolated straggler shows here)
    target: float
    wall_seconds: float
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def time_to_target(self) -> float | None:
        return time_to_target(self.points, self.target)

    @property
    def bytes_to_target(self) -> float | None:
        """Bytes sent per peer by the time the target was reached (the first point of the run that held)."""
        t = self.time_to_target
        return None if t is None else next(b for p, b in zip(self.points, self.bytes_sent) if p.elapsed == t)

    @property
    def final_acc(self) -> float:
        """Mean accuracy of the last HOLD points: one sample (360 test images per peer) moves by a point or so."""
        tail = self.points[-HOLD:]
        return statistics.mean(p.acc for p in tail) if tail else math.nan

    @property
    def final_min_acc(self) -> float:
        """The worst peer's accuracy over the last HOLD points (mean), as ``final_acc``."""
        return statistics.mean(self.min_acc[-HOLD:]) if self.min_acc else math.nan


def run_sim(
    label: str, peers: int, seed: int, overrides: dict[str, Any], target: float, duration: float, *,
    speeds: Sequence[float] = (), link: Any = None, stop_at_target: bool = False, sample_every: float = SIM_SAMPLE_EVERY,
) -> SimRun:
    """Simulate ``peers`` peers on the experiments' run (plus ``overrides``) for ``duration`` virtual s, or to the target.

    Deterministic: the step time is fixed (SIM_STEP_TIME) and ``seed`` seeds
    both the run (model, shards) and the simulated world. Peers start
    together, one core each. Runs the Cluster itself (as ``simulate`` does)
    to read the peers' averaging counters at the end, such as updates
    dropped as too stale.
    """
    from gossiptrain.net.transport.sim import LinkProfile
    from gossiptrain.sim import Cluster, SimConfig
    from gossiptrain.sim.vtime import run_virtual

    run = RunConfig().with_overrides({**run_overrides(peers, seed), **overrides})
    config = SimConfig(
        peers=peers, run=run, duration=duration, seed=seed, step_time=SIM_STEP_TIME, speeds=tuple(speeds),
        link=link or LinkProfile(), join_spread=0.0, sample_every=sample_every,
        target_accuracy=target if stop_at_target else 0.0, target_hold=HOLD,
    )
    began = time.perf_counter()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as simulate(): one thread keeps runs bit-identical
    try:
        cluster = Cluster(config)
        result = run_virtual(cluster.run())
    finally:
        torch.set_num_threads(threads)
    stats = [p.averaging.stats for p in cluster.peers.values() if p.averaging is not None]
    out = sim_series(label, seed, result.rows, run.train.batch_size, target, time.perf_counter() - began)
    out.extra.update(
        stale_dropped=sum(s.stale_dropped for s in stats),
        staleness_mean=statistics.mean(s.to_dict()["staleness_mean"] for s in stats) if stats else math.nan,
        exchanges_per_peer=result.summary.get("exchanges_per_peer"),
        steps_per_peer=result.summary.get("mean_step"),
    )
    return out


def sim_series(label: str, seed: int, rows: list[dict[str, Any]], batch_size: int, target: float, wall: float) -> SimRun:
    """The simulator's per-peer rows, one point per sample time (means over the peers that were live then)."""
    by_time: dict[float, list[dict[str, Any]]] = {}
    for r in rows:
        if "test_acc" in r:
            by_time.setdefault(r["time"], []).append(r)
    points, consensus, sent, worst = [], [], [], []
    for t, group in by_time.items():
        points.append(Point(t, sum(r["step"] for r in group) * batch_size, statistics.mean(r["test_acc"] for r in group)))
        consensus.append(statistics.mean(r["consensus_distance"] for r in group))
        sent.append(statistics.mean(r.get("bytes_sent", 0) for r in group))
        worst.append(min(r["test_acc"] for r in group))
    return SimRun(label, seed, points, consensus, sent, worst, target, wall)


def sim_medians(runs: Sequence[SimRun]) -> dict[str, float]:
    """Medians over seeds of one configuration's runs; a run that missed the target counts as infinitely slow."""
    return {
        "time_to_target_s": spread([r.time_to_target for r in runs])[0],
        "bytes_to_target": spread([r.bytes_to_target for r in runs])[0],
        "final_acc": statistics.median(r.final_acc for r in runs),
        "reached": sum(r.time_to_target is not None for r in runs),
    }


def gossip_bytes_at(workdir: Path, workers: int, elapsed: float) -> float | None:
    """Bytes sent per peer (mean) by ``elapsed`` s into a `run_gossip` run, from its peers' metrics files.

    Each peer's latest evaluation at or before the same instant as the
    point ``gossip_series`` made for that time (t0: the first peer's start).
    """
    per_peer = [read_metrics(workdir / f"peer-{i}.jsonl") for i in range(workers)]
    _, t0 = gossip_series(per_peer, 1)
    if t0 is None:
        return None
    latest = [
        max((r for r in recs if r.get("event") in ("eval", "done") and r["time"] <= t0 + elapsed + 1e-6), key=lambda r: r["time"], default=None)
        for recs in per_peer
    ]
    if not all(latest):
        return None
    return statistics.mean(r.get("bytes_sent", 0) for r in latest)  # type: ignore[union-attr]


# -- aggregation and output --------------------------------------------------------------


def spread(values: Sequence[float | None]) -> tuple[float, float, float]:
    """Median, min and max; a run that missed (None) counts as infinitely slow."""
    xs = [math.inf if v is None or (isinstance(v, float) and math.isnan(v)) else float(v) for v in values]
    return statistics.median(xs), min(xs), max(xs)


def fmt(x: float, digits: int = 2) -> str:
    return "not reached" if math.isinf(x) else f"{x:.{digits}f}"


def fmt_seconds(x: float) -> str:
    """A time to target for a progress line: "1.25 s" or "not reached"."""
    return fmt(x) if math.isinf(x) else f"{x:.2f} s"


def publish(out: Path, lines: list[str], headline: dict[str, Any]) -> int:
    """Write summary.md from ``lines``, print them, then the headline JSON as the last line; exit status 0."""
    (out / "summary.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    print(json.dumps(headline))
    return 0


def write_csv(path: Path, rows: list[dict[str, Any]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    keys: list[str] = []
    for row in rows:
        keys += [k for k in row if k not in keys]
    with open(path, "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=keys)
        writer.writeheader()
        writer.writerows(rows)


def pyplot() -> Any:
    """matplotlib's pyplot on the file-only backend (the `experiments` extra)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> list[str]:
    """A summary.md table: the header, its rule and one line per row."""
    lines = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    return lines + ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]


def finite_or_none(x: float | None, digits: int = 3) -> float | None:
    """A number for the JSON headline: rounded, or None where it is missing or infinite (not reached)."""
    return None if x is None or not math.isfinite(x) else round(x, digits)


def headline(values: dict[str, Any]) -> str:
    """The last line every experiment prints: one JSON object."""
    return json.dumps(values, separators=(", ", ": "))


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] != "gossip-peer":
        raise SystemExit("usage: python -m experiments.harness gossip-peer --join HOST:PORT --shard I ...")
    gossip_peer_main(argv[1:])


if __name__ == "__main__":
    main()
