"""Does the simulator predict a real swarm? The same run, real on loopback and simulated, side by side.

For each topology, N peers train digits (one of them S times slower) until
the peers' mean test accuracy reaches the target:

- real: a coordinator and N `gossiptrain peer --wait-for N` processes on
  127.0.0.1 (a start line), the straggler started with `--slowdown S`;
- simulated: `gossiptrain.sim` with the same run configuration, the same
  start line (`SimConfig.wait_for`), the straggler's speed S, and a machine
  model calibrated here beforehand: alone, the time of one local step, of
  one test-set evaluation (real peers evaluate every 0.25 s on their
  training thread) and the CPU time of one exchange operation on the
  training thread (snapshot or merge; the encoding and the ZeroMQ transfer
  run on the network thread and show in the fitted cores and delay), all
  slowed by how many busy peers share the cores; and, from a separate
  calibration swarm of the same size (another seed, never reported), how
  loaded the machine is: the effective number of cores and the delay a
  message waits before its peer handles it (the network thread waiting for
  a core and for the GIL behind the trainer), fitted together so that the
  simulated calibration swarm steps and exchanges as fast as the real one
  (see calibrate_load).

Both sides are measured by the same code (``curve``, ``first_held``) on the
same kind of records: the real peers' metrics files, the simulator's
samples. One run's crossing of the flat accuracy curve near the target
moves by a second or more from seed to seed, so the headline is where the
mean curve of several runs (``pooled``) holds the target: the time to it
and the exchanges per peer there, measured and predicted, and the relative
errors; each run's own time is reported beside it. Nothing from the
measured runs is fed to the simulator. Output:
experiments/results/fidelity/ (results.csv, summary.md, the real peers'
metrics, the simulated samples); the last line printed is a JSON object
with `time_error` and `exchanges_error` (the worst over the topologies).

    python experiments/fidelity.py            # 8 peers, ring and exponential, one 4x straggler
    python experiments/fidelity.py --quick    # 4 peers, exponential only, target 0.9 (smoke test)
    python experiments/fidelity.py --reuse-real   # the simulator again, against the real runs already there
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import csv
import dataclasses
import json
import math
import os
import random
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from experiments import harness  # noqa: E402
from gossiptrain.config import RunConfig  # noqa: E402
from gossiptrain.net.kinds import XREP, XREQ  # noqa: E402
from gossiptrain.net.transport import Transport, listen  # noqa: E402
from gossiptrain.net.transport.sim import LinkProfile  # noqa: E402
from gossiptrain.net.wire import Message, decode, encode  # noqa: E402
from gossiptrain.protocol.averaging_events import AtSafePoint, Received  # noqa: E402
from gossiptrain.protocol.pairwise import PairwiseAveraging  # noqa: E402
from gossiptrain.runtime.coordinator_process import BackgroundCoordinator  # noqa: E402
from gossiptrain.sim import SimConfig, simulate  # noqa: E402
from gossiptrain.sim.compute import measure_step_time  # noqa: E402
from gossiptrain.train.local_trainer import LocalTrainer  # noqa: E402
from gossiptrain.train.metrics import read_metrics  # noqa: E402
from gossiptrain.train.workload import load_workload  # noqa: E402

EVAL_EVERY = 0.25  # seconds, real and virtual: both sides see accuracy at the same cadence
HOLD = 3  # grid points the target must hold for
EXTRA = 2.0  # seconds a run goes on after it reached the target, so that the runs' mean curve crosses it too
CALIBRATION_ROUNDS = 8  # at most
DAMPING = 0.5  # of each calibration round's correction to the message delay (the cores: the square root)
LOOPBACK = LinkProfile(latency=0.0001, bandwidth=2.0e9)  # about what ZeroMQ moves on loopback here


def run_config(peers: int, topology: str, budget: float) -> RunConfig:
    return RunConfig().with_overrides(
        {
            "train.workload": "digits",
            "train.shards": peers,
            "train.max_steps": 0,
            "train.max_seconds": budget,
            "train.eval_every_seconds": EVAL_EVERY,
            "gossip.topology": topology,
        }
    )


# -- calibration -------------------------------------------------------------------------


def measure_exchange_time(run: RunConfig, repeats: int = 40) -> tuple[float, float]:
    """CPU seconds, alone, of (one exchange operation on the training thread, one message on the network side).

    The operations (start: snapshot; serve: merge and snapshot; complete:
    merge) run at the trainer's safe point and hold its loop; the messages
    (encode, the ZeroMQ transfer over loopback with both ends' I/O threads,
    decode) run on the network thread, beside training. Process CPU time.
    """
    workload = load_workload(run.train.workload)
    model = workload.build_model(run.train.seed)
    a = PairwiseAveraging(dict(copy.deepcopy(model).named_parameters()), run.gossip, random.Random(0), me="A")
    b = PairwiseAveraging(dict(copy.deepcopy(model).named_parameters()), run.gossip, random.Random(1), me="B")
    limits = run.limits

    async def main() -> tuple[float, float]:
        async with listen("tcp://127.0.0.1:0", limits) as ta, listen("tcp://127.0.0.1:0", limits) as tb:

            async def wire(src: Transport, dst: Transport, tensors: Any) -> tuple[Any, float]:
                c0 = time.process_time()
                src.send(dst.address, encode(Message("xreq", "p", src.address, "fp", 0, {}, tensors), limits))
                got = decode(await dst.recv(), limits).tensors
                return got, time.process_time() - c0

            operations, messages = [], []
            for i in range(repeats + 5):
                c0 = time.process_time()
                (req,) = a.handle(AtSafePoint(step=i + 1, partners=["B"]), float(i))
                start = time.process_time() - c0
                got, there = await wire(ta, tb, req.tensors)
                c0 = time.process_time()
                (rep,) = b.handle(Received("A", XREQ, req.xid, got), float(i))
                serve = time.process_time() - c0
                got, back = await wire(tb, ta, rep.tensors)
                c0 = time.process_time()
                a.handle(Received("B", XREP, rep.xid, got), float(i))
                complete = time.process_time() - c0
                if i >= 5:  # after connections and the allocator have warmed up
                    operations.append((start + serve + complete) / 3)
                    messages.append((there + back) / 2)
            return statistics.median(operations), statistics.median(messages)

    return asyncio.run(main())


# -- the real swarm ----------------------------------------------------------------------


def real_run(run: RunConfig, peers: int, slowdown: float, target: float, timeout: float, workdir: Path) -> dict[str, Any]:
    workdir.mkdir(parents=True, exist_ok=True)
    for old in workdir.glob("peer-*.jsonl"):
        old.unlink()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}
    procs: list[subprocess.Popen[bytes]] = []
    with BackgroundCoordinator(run, bind="127.0.0.1:0") as coord:
        join = coord.address.removeprefix("tcp://")
        try:
            for i in range(peers):
                extra = ["--slowdown", str(slowdown)] if i == 0 and slowdown > 1 else []
                log = open(workdir / f"peer-{i}.log", "wb")
                procs.append(
                    subprocess.Popen(
                        [sys.executable, "-m", "gossiptrain", "peer", "--join", join, "--quiet", "--wait-for", str(peers),
                         "--metrics", str(workdir / f"peer-{i}.jsonl"), *extra],
                        stdout=log, stderr=subprocess.STDOUT, env=env,
                    )
                )
                log.close()
            deadline = time.monotonic() + timeout
            extended = False
            while time.monotonic() < deadline:
                if not extended and reached(_records(workdir, peers), target) is not None:
                    deadline, extended = time.monotonic() + EXTRA, True  # a little more curve, for pooling
                if any(p.poll() is not None for p in procs):
                    raise RuntimeError(f"a peer exited early; see {workdir}")
                time.sleep(0.25)
        finally:
            for p in procs:
                if p.poll() is None:
                    p.send_signal(signal.SIGTERM)
            for p in procs:
                try:
                    p.wait(10)
                except subprocess.TimeoutExpired:
                    p.kill()
    return measured(_records(workdir, peers), target, f"the real swarm did not reach {target} within {timeout} s; see {workdir}")


def measured(per_peer: list[list[dict[str, Any]]], target: float, failure: str) -> dict[str, Any]:
    """One run's own crossing (``reached``) and its curve (for ``pooled``)."""
    points = curve(per_peer)
    got = first_held(points, target)
    if got is None:
        raise RuntimeError(failure)
    return {**got, "curve": points}


def stored_run(workdir: Path, peers: int, target: float) -> dict[str, Any] | None:
    """A real run already in ``workdir`` (``--reuse-real``), measured as ``measured`` does; None if absent or short."""
    if not workdir.exists():
        return None
    try:
        return measured(_records(workdir, peers), target, "")
    except RuntimeError:
        return None  # it did not reach the target: run it again


def _records(workdir: Path, peers: int) -> list[list[dict[str, Any]]]:
    return [read_metrics(workdir / f"peer-{i}.jsonl") for i in range(peers)]


Point = tuple[float, dict[str, float]]  # (seconds from the median start, the swarm's means at that grid point)


def curve(per_peer: list[list[dict[str, Any]]]) -> list[Point]:
    """The swarm on a grid: every EVAL_EVERY seconds from the median peer's start, means over peers of each one's latest
    evaluation (accuracy, exchanges, steps) and the median round trip; points before every peer has one are left out.

    Peers start with `--wait-for N` (a start line), but each sees the N-th
    member when gossip brings it, up to a heartbeat or two apart; the
    simulated ones likewise. The median start is the fair zero.
    """
    starts = [next((r["time"] for r in recs if r.get("event") == "start"), None) for recs in per_peer]
    evals = [[r for r in recs if r.get("event") == "eval"] for recs in per_peer]
    if any(s is None for s in starts) or not all(evals):
        return []
    t0 = statistics.median(s for s in starts if s is not None)
    end = min(e[-1]["time"] for e in evals)
    points: list[Point] = []
    k = 1
    while t0 + k * EVAL_EVERY <= end:
        g = t0 + k * EVAL_EVERY
        latest = [max((r for r in e if r["time"] <= g), key=lambda r: r["time"], default=None) for e in evals]
        if all(latest):
            rows: list[dict[str, Any]] = latest  # type: ignore[assignment]
            points.append((k * EVAL_EVERY, {
                "acc": sum(r["test_acc"] for r in rows) / len(rows),
                "exchanges_per_peer": sum(r["exchanges"] for r in rows) / len(rows),
                "steps_per_peer": sum(r["step"] for r in rows) / len(rows),
                "rtt_ms": statistics.median(r["rtt_ms"] for r in rows),
            }))
        k += 1
    return points


def first_held(points: list[Point], target: float) -> dict[str, float] | None:
    """The first grid point that starts HOLD points at or above ``target`` (one noisy crossing is not convergence)."""
    for k in range(len(points) - HOLD + 1):
        if all(p["acc"] >= target for _, p in points[k : k + HOLD]):
            t, p = points[k]
            return {"time_to_target": t, **{key: v for key, v in p.items() if key != "acc"}}
    return None


def reached(per_peer: list[list[dict[str, Any]]], target: float) -> dict[str, Any] | None:
    """When one swarm's mean accuracy reached ``target`` and held it, in seconds from the median peer's start."""
    return first_held(curve(per_peer), target)


def pooled(curves: list[list[Point]], target: float) -> dict[str, float] | None:
    """``first_held`` on the mean of several runs' curves, over the grid points they all have.

    One run's crossing of a flat accuracy curve moves by a second or more
    from seed to seed; the mean curve's crossing moves much less. Real and
    simulated runs are pooled alike.
    """
    common = set.intersection(*({round(t / EVAL_EVERY) for t, _ in c} for c in curves)) if curves else set()
    by_point = [dict((round(t / EVAL_EVERY), p) for t, p in c) for c in curves]
    mean: list[Point] = [
        (k * EVAL_EVERY, {key: sum(b[k][key] for b in by_point) / len(by_point) for key in by_point[0][k]})
        for k in sorted(common)
    ]
    return first_held(mean, target)


# -- the simulated swarm -----------------------------------------------------------------


def sim_run(
    run: RunConfig,
    peers: int,
    slowdown: float,
    target: float,
    timeout: float,
    machine: Machine,
    seed: int,
    save: Path | None = None,
) -> dict[str, Any]:
    """The simulated swarm, measured exactly as the real one: ``reached`` on its samples (kept in ``save``, JSON lines)."""
    config = SimConfig(
        peers=peers,
        run=run,
        duration=timeout,
        seed=seed,
        step_time=machine.step_time,
        exchange_time=machine.exchange_time,
        eval_time=machine.eval_time,
        cores=machine.cores,
        speeds=tuple([slowdown] + [1.0] * (peers - 1)),
        link=LinkProfile(latency=LOOPBACK.latency + machine.delay, bandwidth=LOOPBACK.bandwidth),
        join_spread=0.0,
        wait_for=peers,  # the real peers' start line (`--wait-for N`)
        sample_every=EVAL_EVERY,
        target_accuracy=target,
        target_hold=HOLD + round(EXTRA / EVAL_EVERY),  # past the crossing, as the real runs go on for EXTRA seconds
    )
    result = simulate(config)
    if save is not None:
        save.parent.mkdir(parents=True, exist_ok=True)
        save.write_text("".join(json.dumps(row, separators=(",", ":")) + "\n" for row in result.rows))
    got = measured(sim_records(result.rows, peers), target, f"the simulated swarm did not reach {target} within {timeout} virtual s")
    return {**got, "wall_seconds": result.summary["wall_seconds"], "contention": result.summary["contention"]}


def sim_records(rows: list[dict[str, Any]], peers: int) -> list[list[dict[str, Any]]]:
    """The simulator's samples as the metrics records real peers write: a start line, then evaluations."""
    out: list[list[dict[str, Any]]] = [[] for _ in range(peers)]
    for row in rows:
        if "test_acc" not in row:
            continue  # not training yet
        recs = out[row["peer"]]
        if not recs:
            recs.append({"event": "start", "time": row["started"]})
        recs.append({"event": "eval", **{k: row[k] for k in ("time", "test_acc", "exchanges", "step", "rtt_ms")}})
    return out


@dataclass(frozen=True)
class Machine:
    """The simulator's model of this machine running the swarm (see calibrate_alone and calibrate_load)."""

    step_time: float  # seconds per local step, alone on a core
    exchange_time: float  # CPU seconds per exchange operation on the training thread, alone
    eval_time: float  # seconds per test-set evaluation, alone
    cores: float  # effective cores the peers share
    delay: float = 0.0  # seconds a message waits before its peer's network side handles it
    message_time: float = 0.0  # CPU seconds per message on the network side, alone (for the record: the simulator
    # has no network thread; its cost shows in the effective cores and the delay)


def calibrate_alone(run: RunConfig, cores: float) -> Machine:
    """Step, exchange and evaluation costs measured on this machine, one peer alone (no swarm running)."""
    workload = load_workload(run.train.workload)
    model = workload.build_model(run.train.seed)
    step_time = measure_step_time(workload, model, run)
    trainer = LocalTrainer(workload, copy.deepcopy(model), run.train, shard=0)
    trainer.evaluate()
    evals = []
    for _ in range(10):
        t0 = time.perf_counter()
        trainer.evaluate()
        evals.append(time.perf_counter() - t0)
    operation, message = measure_exchange_time(run)
    return Machine(step_time, operation, statistics.median(evals), cores, message_time=message)


def calibrate_load(args: argparse.Namespace, alone: Machine) -> Machine:
    """``alone`` with the effective cores and the message delay of this machine loaded with the swarm.

    A real swarm of the same size and straggler (seed 1000, never reported)
    is run to the target. Two things it shows that the compute model alone
    misses: its peers step slower than the measured costs x contention
    predict (heartbeats, the network threads, the OS share the cores too),
    which sets the effective number of cores; and its exchange round trip,
    read as in the measured runs (the peers' smoothed round trips at the
    target), is longer than the simulator's, because a message waits for a
    core and for the GIL behind the trainer before its peer handles it,
    which sets the delay. The two interact, so they are fitted together:
    the calibration swarm is simulated, both corrected, and again, until
    the simulated step period and round trip match the real ones.
    """
    topology = args.topologies[-1]
    run = run_config(args.peers, topology, args.timeout + 30).with_overrides({"train.seed": 1000})
    workdir = args.out / "calibration"
    real = stored_run(workdir, args.peers, args.target) if args.reuse_real else None
    if real is None:
        real = real_run(run, args.peers, args.slowdown, args.target, args.timeout, workdir)

    def period(r: dict[str, Any]) -> float:  # seconds per local step of the mean peer
        return r["time_to_target"] / r["steps_per_peer"]

    # A longer round trip means fewer exchanges, so more time for steps: damped fixed-point iteration from
    # "all cores, no delay" (undamped, it oscillates).
    machine = alone
    for attempt in range(1, args.calibration_rounds + 1):
        sim = sim_run(run, args.peers, args.slowdown, args.target, args.timeout, machine, 1000, workdir / "sim.jsonl")
        cores = machine.cores * math.sqrt(period(sim) / period(real))
        delay = max(0.0, machine.delay + DAMPING * (real["rtt_ms"] - sim["rtt_ms"]) / 2 / 1000)
        print(
            f"calibration round {attempt} ({topology}, seed 1000): step period real {period(real) * 1e3:.1f} ms, "
            f"simulated {period(sim) * 1e3:.1f} ms on {machine.cores:.2f} cores; exchange round trip real "
            f"{real['rtt_ms']:.0f} ms, simulated {sim['rtt_ms']:.0f} ms with {machine.delay * 1e3:.1f} ms delay -> "
            f"{cores:.2f} cores, {delay * 1e3:.1f} ms",
            flush=True,
        )
        settled = abs(cores / machine.cores - 1) < 0.03 and abs(delay - machine.delay) < 0.003
        machine = dataclasses.replace(machine, cores=cores, delay=delay)
        if settled:
            break
    return machine


# -- DDP: the simulator's synchronous baseline against torch DDP over gloo ---------------


def ddp_points(rows: list[dict[str, Any]]) -> list[harness.Point]:
    """The simulated DDP job's samples as the points of rank 0's evaluations."""
    return [harness.Point(r["time"], r["samples"], r["test_acc"]) for r in rows if "test_acc" in r]


def ddp_measured(points: list[harness.Point], peers: int, batch: int, target: float, what: str) -> dict[str, Any]:
    """Time to the held target and steps per second (every rank steps together), measured alike on both sides."""
    ttt = harness.time_to_target(points, target, HOLD)
    if ttt is None:
        raise RuntimeError(f"{what} did not reach {target}")
    at = next(p for p in points if p.elapsed == ttt)
    return {"time_to_target": ttt, "steps_per_second": harness.throughput(points) / (batch * peers),
            "steps_to_target": at.samples // (batch * peers), "first_point": points[0].elapsed}


def real_ddp(peers: int, slowdown: float, target: float, timeout: float, workdir: Path, seed: int) -> dict[str, Any]:
    """torch DDP over gloo on loopback (experiments/baselines/ddp.py), the gossip runs' workload and straggler."""
    run = harness.run_ddp(peers, seed, slowdown, target, timeout, workdir, eval_every=EVAL_EVERY, min_seconds=EXTRA)
    batch = harness.run_config(peers, seed).train.batch_size
    return ddp_measured(run.points, peers, batch, target, f"real DDP (seed {seed}, {workdir})")


def sim_ddp(peers: int, slowdown: float, target: float, timeout: float, machine: Machine, link: LinkProfile, seed: int) -> dict[str, Any]:
    """The simulated DDP job on the calibrated machine (the gossip calibration's cores) and all-reduce link."""
    run = harness.run_config(peers, seed)
    speeds = [1.0] * peers
    speeds[harness.STRAGGLER] = slowdown
    config = SimConfig(
        peers=peers, run=run, duration=timeout, seed=seed, system="ddp", step_time=machine.step_time,
        eval_time=machine.eval_time, cores=machine.cores, speeds=tuple(speeds), link=link, join_spread=0.0,
        sample_every=EVAL_EVERY, target_accuracy=target, target_hold=HOLD + round(EXTRA / EVAL_EVERY),
    )
    result = simulate(config)
    got = ddp_measured(ddp_points(result.rows), peers, run.train.batch_size, target, f"simulated DDP (seed {seed})")
    return {**got, "wall_seconds": result.summary["wall_seconds"], "comm_share": result.summary["comm_share"],
            "model_bytes": result.summary["model_bytes"]}


def calibrate_ddp(args: argparse.Namespace, machine: Machine) -> LinkProfile:
    """The all-reduce's effective loopback link, from one real DDP run without a straggler (seed 1000, never reported).

    gloo's all-reduce of the model's gradients among processes that share
    the cores costs far more than loopback's bytes per second suggest (the
    reduction itself is computation, contended like the steps). The
    compute model is the gossip calibration's; what the real step period
    has beyond it is the all-reduce, and the bandwidth that makes the ring's
    closed form (gossiptrain.sim.collectives) take that long is the link's.
    The rows reported then have the straggler: what they check is the
    compute model (a straggler, shared cores) with the fitted all-reduce.
    """
    from gossiptrain.sim.collectives import ring_allreduce_seconds

    real = real_ddp(args.peers, 1.0, args.target, args.timeout, args.out / "ddp-calibration", 1000)
    sim = sim_ddp(args.peers, 1.0, args.target, args.timeout, machine, LOOPBACK, 1000)
    model_bytes = sim["model_bytes"]  # what the simulated job all-reduces each step
    sim_comm = ring_allreduce_seconds(args.peers, model_bytes, LOOPBACK)
    comm = 1 / real["steps_per_second"] - (1 / sim["steps_per_second"] - sim_comm)  # the real period less the compute
    latencies = 2 * (args.peers - 1) * LOOPBACK.latency
    ring = 2 * (args.peers - 1) / args.peers * model_bytes
    bandwidth = ring / (comm - latencies) if comm > latencies + ring / LOOPBACK.bandwidth else LOOPBACK.bandwidth
    link = LinkProfile(latency=LOOPBACK.latency, bandwidth=bandwidth)
    print(
        f"DDP calibration (seed 1000, no straggler): real {real['steps_per_second']:.2f} steps/s, simulated on loopback's link "
        f"{sim['steps_per_second']:.2f} steps/s -> all-reduce {comm * 1e3:.1f} ms per step, effective bandwidth "
        f"{bandwidth / 1e6:.0f} MB/s",
        flush=True,
    )
    return link


def ddp_rows(args: argparse.Namespace, machine: Machine) -> dict[str, Any]:
    """Real and simulated DDP, several seeds each: median time to the target and steps per second, and the errors."""
    link = calibrate_ddp(args, machine)
    real = [real_ddp(args.peers, args.slowdown, args.target, args.timeout, args.out / f"ddp-{seed}", seed) for seed in range(args.ddp_seeds)]
    sim = [sim_ddp(args.peers, args.slowdown, args.target, args.timeout, machine, link, seed) for seed in range(args.ddp_seeds)]

    def med(runs: list[dict[str, Any]], key: str) -> float:
        return statistics.median(r[key] for r in runs)

    row = {
        "system": "ddp", "peers": args.peers, "seeds": args.ddp_seeds,
        "real_time": round(med(real, "time_to_target"), 3), "sim_time": round(med(sim, "time_to_target"), 3),
        "real_steps_per_s": round(med(real, "steps_per_second"), 3), "sim_steps_per_s": round(med(sim, "steps_per_second"), 3),
        "real_times": " ".join(f"{r['time_to_target']:.2f}" for r in real),
        "sim_times": " ".join(f"{r['time_to_target']:.2f}" for r in sim),
        "real_steps_to_target": " ".join(str(r["steps_to_target"]) for r in real),
        "sim_steps_to_target": " ".join(str(r["steps_to_target"]) for r in sim),
        "real_first_eval_s": " ".join(f"{r['first_point']:.2f}" for r in real),
        "allreduce_bandwidth_mb_s": round(link.bandwidth / 1e6, 1),
    }
    row["time_error"] = round(abs(row["sim_time"] - row["real_time"]) / row["real_time"], 4)
    row["steps_error"] = round(abs(row["sim_steps_per_s"] - row["real_steps_per_s"]) / row["real_steps_per_s"], 4)
    print(
        f"{'ddp':>12}: time to {args.target} real {row['real_time']:.2f} s, simulated {row['sim_time']:.2f} s "
        f"(error {row['time_error']:.1%}); steps/s real {row['real_steps_per_s']:.2f}, simulated "
        f"{row['sim_steps_per_s']:.2f} (error {row['steps_error']:.1%}); per seed real {row['real_times']}, "
        f"simulated {row['sim_times']}",
        flush=True,
    )
    return row


# -- main --------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--peers", type=int, default=8)
    parser.add_argument("--topologies", nargs="+", default=["ring", "exponential"])
    parser.add_argument("--slowdown", type=float, default=4.0, help="the straggler's slowdown")
    parser.add_argument("--target", type=float, default=0.95)
    parser.add_argument("--timeout", type=float, default=180.0)
    parser.add_argument("--cores", type=float, default=float(os.cpu_count() or 1))
    parser.add_argument("--seeds", type=int, default=8, help="real runs per topology; medians are reported")
    parser.add_argument("--sim-seeds", type=int, default=10, help="simulated runs per topology; medians are reported")
    parser.add_argument("--calibration-rounds", type=int, default=CALIBRATION_ROUNDS,
                        help="at most this many simulations of the calibration swarm to fit cores and delay")
    parser.add_argument("--reuse-real", action="store_true",
                        help="take the real runs already under --out (when they reached the target) instead of running "
                             "them again: to try a change to the simulator against the same measurements")
    parser.add_argument("--ddp-seeds", type=int, default=3, help="real and simulated DDP runs (0: no DDP rows)")
    parser.add_argument("--only-ddp", action="store_true",
                        help="the DDP rows alone (ddp.csv, ddp.md), on the compute model measured alone with --cores")
    parser.add_argument("--quick", action="store_true", help="4 peers, exponential, target 0.9, one seed: a smoke test")
    parser.add_argument("--out", type=Path, help="results folder (default: experiments/results/fidelity; --quick: a scratch folder)")
    args = parser.parse_args()
    args.out = harness.results_dir("fidelity", args.out, args.quick)
    if args.quick:
        args.peers, args.topologies, args.target, args.seeds, args.sim_seeds = 4, ["exponential"], 0.9, 1, 1
        args.ddp_seeds = 1
        args.calibration_rounds = 1  # a smoke test: one fit of cores and delay, not a converged one
    torch.set_num_threads(1)
    alone = calibrate_alone(run_config(args.peers, "exponential", args.timeout), args.cores)
    print(f"calibrated alone: step {alone.step_time * 1e3:.2f} ms, exchange operation {alone.exchange_time * 1e3:.2f} ms "
          f"(training thread) + {alone.message_time * 1e3:.2f} ms per message (network side), "
          f"evaluation {alone.eval_time * 1e3:.2f} ms; {args.cores:g} cores", flush=True)

    if args.only_ddp:
        ddp = ddp_rows(args, alone)
        write_ddp(args.out, ddp, args, alone)
        print(json.dumps({"ddp_time_error": ddp["time_error"], "ddp_steps_error": ddp["steps_error"], "peers": args.peers,
                          "target": args.target, "ddp": {k: v for k, v in ddp.items() if k != "system"}}))
        return
    machine = calibrate_load(args, alone)
    rows = []
    for topology in args.topologies:
        real, sim = [], []
        for seed in range(args.seeds):  # several seeds: one run's threshold crossing is noisy
            run = run_config(args.peers, topology, args.timeout + 30).with_overrides({"train.seed": seed})
            workdir = args.out / f"real-{topology}-{seed}"
            stored = stored_run(workdir, args.peers, args.target) if args.reuse_real else None
            real.append(stored or real_run(run, args.peers, args.slowdown, args.target, args.timeout, workdir))
        for seed in range(args.sim_seeds):
            run = run_config(args.peers, topology, args.timeout + 30).with_overrides({"train.seed": seed})
            save = args.out / f"sim-{topology}" / f"seed-{seed}.jsonl"
            sim.append(sim_run(run, args.peers, args.slowdown, args.target, args.timeout, machine, seed, save))

        real_pool = pooled([r["curve"] for r in real], args.target)
        sim_pool = pooled([r["curve"] for r in sim], args.target)
        if real_pool is None or sim_pool is None:
            side = "real" if real_pool is None else "simulated"
            raise RuntimeError(f"the mean curve of the {side} {topology} runs does not hold {args.target} where all have data")

        def med(runs: list[dict[str, Any]], key: str) -> float:
            return statistics.median(r[key] for r in runs)

        row = {
            "topology": topology,
            "peers": args.peers,
            "seeds": args.seeds,
            "sim_seeds": args.sim_seeds,
            "real_time": round(real_pool["time_to_target"], 3),
            "sim_time": round(sim_pool["time_to_target"], 3),
            "real_exchanges": round(real_pool["exchanges_per_peer"], 1),
            "sim_exchanges": round(sim_pool["exchanges_per_peer"], 1),
            "real_steps": round(real_pool["steps_per_peer"], 1),
            "sim_steps": round(sim_pool["steps_per_peer"], 1),
            "real_rtt_ms": round(real_pool["rtt_ms"], 2),
            "sim_rtt_ms": round(sim_pool["rtt_ms"], 2),
            "real_median_time": round(med(real, "time_to_target"), 3),
            "sim_median_time": round(med(sim, "time_to_target"), 3),
            "real_times": " ".join(f"{r['time_to_target']:.2f}" for r in real),
            "sim_times": " ".join(f"{r['time_to_target']:.2f}" for r in sim),
            "sim_wall_seconds": round(sum(r["wall_seconds"] for r in sim), 1),
        }
        row["time_error"] = round(abs(row["sim_time"] - row["real_time"]) / row["real_time"], 4)
        row["exchanges_error"] = round(abs(row["sim_exchanges"] - row["real_exchanges"]) / max(1.0, row["real_exchanges"]), 4)
        rows.append(row)
        print(
            f"{topology:>12}: time to {args.target} real {row['real_time']:.2f} s, simulated {row['sim_time']:.2f} s "
            f"(error {row['time_error']:.1%}); exchanges/peer real {row['real_exchanges']:.0f}, "
            f"simulated {row['sim_exchanges']:.0f} (error {row['exchanges_error']:.1%}); "
            f"steps/peer real {row['real_steps']:.0f}, simulated {row['sim_steps']:.0f}; "
            f"exchange round trip real {row['real_rtt_ms']:.0f} ms, simulated {row['sim_rtt_ms']:.0f} ms "
            f"(mean curves of {args.seeds} real and {args.sim_seeds} simulated runs; each run's own time: real "
            f"{row['real_times']} (median {row['real_median_time']:.2f}), simulated {row['sim_times']} "
            f"(median {row['sim_median_time']:.2f}))",
            flush=True,
        )
    ddp = ddp_rows(args, machine) if args.ddp_seeds > 0 else None
    write_results(args.out, rows, args, machine, ddp)
    print(json.dumps({
        "ddp_time_error": ddp["time_error"] if ddp else None,
        "ddp_steps_error": ddp["steps_error"] if ddp else None,
        "time_error": max(r["time_error"] for r in rows),
        "exchanges_error": max(r["exchanges_error"] for r in rows),
        "peers": args.peers,
        "target": args.target,
        "step_time_ms": round(machine.step_time * 1e3, 3),
        "exchange_time_ms": round(machine.exchange_time * 1e3, 3),
        "message_time_ms": round(machine.message_time * 1e3, 3),
        "eval_time_ms": round(machine.eval_time * 1e3, 3),
        "message_delay_ms": round(machine.delay * 1e3, 3),
        "effective_cores": round(machine.cores, 3),
        "topologies": {
            r["topology"]: {k: r[k] for k in ("real_time", "sim_time", "real_exchanges", "sim_exchanges", "real_steps", "sim_steps")}
            for r in rows
        },
    }))


def write_results(
    out: Path, rows: list[dict[str, Any]], args: argparse.Namespace, machine: Machine, ddp: dict[str, Any] | None = None,
) -> None:
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "results.csv", "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    lines = [
        "# Simulator fidelity",
        "",
        f"{args.peers} peers, digits, one peer {args.slowdown:g}x slower, target mean test accuracy {args.target}; "
        f"compute model calibrated alone: step {machine.step_time * 1e3:.2f} ms, exchange operation "
        f"{machine.exchange_time * 1e3:.2f} ms, evaluation {machine.eval_time * 1e3:.2f} ms, {args.cores:g} cores shared; "
        f"from a separate calibration swarm (seed 1000): {machine.cores:.2f} effective cores, "
        f"message delay under load {machine.delay * 1e3:.1f} ms. Both sides measured alike: each run on a {EVAL_EVERY} s "
        f"grid from the peers' median training start, the mean of {args.seeds} real and of {args.sim_seeds} simulated "
        f"runs' curves, the first grid point that starts {HOLD} at or above the target.",
        "",
        "| topology | real time (s) | simulated (s) | error | real exchanges/peer | simulated | error | real RTT (ms) | simulated |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        lines.append(
            f"| {r['topology']} | {r['real_time']:.2f} | {r['sim_time']:.2f} | {r['time_error']:.1%} | "
            f"{r['real_exchanges']:.0f} | {r['sim_exchanges']:.0f} | {r['exchanges_error']:.1%} | "
            f"{r['real_rtt_ms']:.0f} | {r['sim_rtt_ms']:.0f} |"
        )
    lines += ["", "Each run's own time to the target (s):", ""]
    lines += [f"- {r['topology']}: real {r['real_times']}; simulated {r['sim_times']}" for r in rows]
    if ddp is not None:
        lines += ["", *ddp_lines(out, ddp)]
    lines += ["", "Regenerate: `python experiments/fidelity.py`"]
    (out / "summary.md").write_text("\n".join(lines) + "\n")


def write_ddp(out: Path, ddp: dict[str, Any], args: argparse.Namespace, machine: Machine) -> None:
    """``--only-ddp``: ddp.csv and ddp.md, leaving the gossip rows' summary as it is."""
    out.mkdir(parents=True, exist_ok=True)
    head = [
        "# Simulator fidelity: DDP", "",
        f"{args.peers} ranks, digits, rank {harness.STRAGGLER} {args.slowdown:g}x slower, target test accuracy "
        f"{args.target} held {HOLD} evaluations; compute model measured alone: step {machine.step_time * 1e3:.2f} ms, "
        f"evaluation {machine.eval_time * 1e3:.2f} ms, {machine.cores:g} cores shared.", "",
    ]
    (out / "ddp.md").write_text("\n".join([*head, *ddp_lines(out, ddp), "", "Regenerate: `python experiments/fidelity.py --only-ddp`"]) + "\n")


def ddp_lines(out: Path, ddp: dict[str, Any]) -> list[str]:
    """The DDP section (and ddp.csv)."""
    harness.write_csv(out / "ddp.csv", [ddp])
    return [
        f"## DDP ({ddp['seeds']} seeds each side)", "",
        "torch DDP over gloo (experiments/baselines/ddp.py, the same straggler) against the simulator's DDP "
        "(gossiptrain.sim.synchronous) on the compute model above and the all-reduce link fitted to one real "
        f"run of seed 1000 without the straggler ({ddp['allreduce_bandwidth_mb_s']:.0f} MB/s effective).", "",
        "| real time (s) | simulated (s) | error | real steps/s | simulated | error |",
        "| --- | --- | --- | --- | --- | --- |",
        f"| {ddp['real_time']:.2f} | {ddp['sim_time']:.2f} | {ddp['time_error']:.1%} | {ddp['real_steps_per_s']:.2f} | "
        f"{ddp['sim_steps_per_s']:.2f} | {ddp['steps_error']:.1%} |",
        "", f"Each run's own time: real {ddp['real_times']}; simulated {ddp['sim_times']}. Steps to the target: "
        f"real {ddp['real_steps_to_target']}, simulated {ddp['sim_steps_to_target']} (the same models step for step; the counts "
        "differ by where the 0.25 s evaluations fall). "
        f"The real runs' first evaluation, after one step: {ddp['real_first_eval_s']} s (DDP's first iteration "
        "and gloo's first collective), a start-up the simulator does not charge.",
    ]


if __name__ == "__main__":
    main()
