"""Does the simulator predict a real swarm? The same run, real on loopback and simulated, side by side.

For each topology, N peers train digits (one of them S times slower) until
the peers' mean test accuracy reaches the target:

- real: a coordinator and N `gossiptrain peer` processes on 127.0.0.1, the
  straggler started with `--slowdown S`;
- simulated: `gossiptrain.sim` with the same run configuration, the
  straggler's speed S, and a compute model calibrated here beforehand, alone
  on one core: the time of one local step and of one exchange operation,
  slowed by how many busy peers share this machine's cores.

It reports the time to the target and the exchanges per peer at that time,
both measured and predicted, and the relative errors. Nothing from the real
run is fed to the simulator. Output: experiments/results/fidelity/
(results.csv, summary.md); the last line printed is a JSON object with
`time_error` and `exchanges_error` (the worst over the topologies).

    python experiments/fidelity.py            # 8 peers, ring and exponential, one 4x straggler
    python experiments/fidelity.py --quick    # 4 peers, exponential only, target 0.9 (smoke test)
"""

from __future__ import annotations

import argparse
import copy
import csv
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from gossiptrain.averaging import XREP, XREQ, PairwiseAveraging, Received, Tick  # noqa: E402
from gossiptrain.config import RunConfig  # noqa: E402
from gossiptrain.metrics import read_metrics  # noqa: E402
from gossiptrain.serve import BackgroundCoordinator  # noqa: E402
from gossiptrain.sim import SimConfig, simulate  # noqa: E402
from gossiptrain.sim.cluster import measure_step_time  # noqa: E402
from gossiptrain.transport.sim import LinkProfile  # noqa: E402
from gossiptrain.wire import Message, decode, encode  # noqa: E402
from gossiptrain.workload import load_workload  # noqa: E402

EVAL_EVERY = 0.25  # seconds, real and virtual: both sides see accuracy at the same cadence
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


def measure_exchange_time(run: RunConfig, repeats: int = 60) -> float:
    """Seconds of computation per exchange operation (snapshot+encode, or decode+merge), alone."""
    workload = load_workload(run.train.workload)
    model = workload.build_model(run.train.seed)
    a = PairwiseAveraging(dict(copy.deepcopy(model).named_parameters()), run.gossip, random.Random(0))
    b = PairwiseAveraging(dict(copy.deepcopy(model).named_parameters()), run.gossip, random.Random(1))
    limits = run.limits

    def wire(tensors: Any) -> Any:
        return decode([bytes(f) for f in encode(Message("xreq", "p", "sim://p", "fp", 0, {}, tensors), limits)], limits).tensors

    samples = []
    for i in range(repeats + 5):
        t0 = time.perf_counter()
        (req,) = a.handle(Tick(step=i + 1, partners=["B"]), float(i))
        (rep,) = b.handle(Received("A", XREQ, req.xid, wire(req.tensors)), float(i))
        a.handle(Received("B", XREP, rep.xid, wire(rep.tensors)), float(i))
        if i >= 5:  # after the allocator has warmed up
            samples.append((time.perf_counter() - t0) / 3)  # three operations: start, serve, complete
    return statistics.median(samples)


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
                        [sys.executable, "-m", "gossiptrain", "peer", "--join", join, "--quiet",
                         "--metrics", str(workdir / f"peer-{i}.jsonl"), *extra],
                        stdout=log, stderr=subprocess.STDOUT, env=env,
                    )
                )
                log.close()
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline:
                result = reached(_records(workdir, peers), target)
                if result is not None:
                    break
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
    result = reached(_records(workdir, peers), target)
    if result is None:
        raise RuntimeError(f"the real swarm did not reach {target} within {timeout} s; see {workdir}")
    return result


def _records(workdir: Path, peers: int) -> list[list[dict[str, Any]]]:
    return [read_metrics(workdir / f"peer-{i}.jsonl") for i in range(peers)]


def reached(per_peer: list[list[dict[str, Any]]], target: float) -> dict[str, Any] | None:
    """Seconds from the moment every peer trains until the mean of their latest accuracies reaches ``target``."""
    starts = [next((r["time"] for r in recs if r.get("event") == "start"), None) for recs in per_peer]
    if any(s is None for s in starts):
        return None
    t0 = max(s for s in starts if s is not None)
    events = sorted((r["time"], i, r) for i, recs in enumerate(per_peer) for r in recs if r.get("event") == "eval")
    latest: dict[int, dict[str, Any]] = {}
    for t, i, r in events:
        latest[i] = r
        if len(latest) == len(per_peer) and t >= t0:
            mean_acc = sum(x["test_acc"] for x in latest.values()) / len(latest)
            if mean_acc >= target:
                return {
                    "time_to_target": t - t0,
                    "exchanges_per_peer": sum(x["exchanges"] for x in latest.values()) / len(latest),
                    "steps_per_peer": sum(x["step"] for x in latest.values()) / len(latest),
                    "rtt_ms": statistics.median(x["rtt_ms"] for x in latest.values()),
                }
    return None


# -- the simulated swarm -----------------------------------------------------------------


def sim_run(
    run: RunConfig, peers: int, slowdown: float, target: float, timeout: float, step_time: float, exchange_time: float, cores: float
) -> dict[str, Any]:
    config = SimConfig(
        peers=peers,
        run=run,
        duration=timeout,
        seed=0,
        step_time=step_time,
        exchange_time=exchange_time,
        cores=cores,
        speeds=tuple([slowdown] + [1.0] * (peers - 1)),
        link=LOOPBACK,
        join_spread=0.0,  # time to target counts from when all peers train, as in the real run
        sample_every=EVAL_EVERY,
        target_accuracy=target,
    )
    result = simulate(config)
    ttt = result.summary["time_to_target"]
    if ttt is None:
        raise RuntimeError(f"the simulated swarm did not reach {target} within {timeout} virtual s")
    at = [r for r in result.rows if r["time"] == ttt]
    return {
        "time_to_target": ttt,
        "exchanges_per_peer": sum(r["exchanges"] for r in at) / len(at),
        "steps_per_peer": sum(r["step"] for r in at) / len(at),
        "rtt_ms": statistics.median(r["rtt_ms"] for r in at),
        "wall_seconds": result.summary["wall_seconds"],
        "contention": result.summary["contention"],
    }


# -- main --------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--peers", type=int, default=8)
    parser.add_argument("--topologies", nargs="+", default=["ring", "exponential"])
    parser.add_argument("--slowdown", type=float, default=4.0, help="the straggler's slowdown")
    parser.add_argument("--target", type=float, default=0.95)
    parser.add_argument("--timeout", type=float, default=180.0)
    parser.add_argument("--cores", type=float, default=float(os.cpu_count() or 1))
    parser.add_argument("--quick", action="store_true", help="4 peers, exponential, target 0.9: a smoke test")
    parser.add_argument("--out", type=Path, default=ROOT / "experiments" / "results" / "fidelity")
    args = parser.parse_args()
    if args.quick:
        args.peers, args.topologies, args.target = 4, ["exponential"], 0.9
    torch.set_num_threads(1)
    calib_run = run_config(args.peers, "exponential", args.timeout)
    workload = load_workload("digits")
    step_time = measure_step_time(workload, workload.build_model(calib_run.train.seed), calib_run)
    exchange_time = measure_exchange_time(calib_run)
    print(f"calibrated alone: step {step_time * 1e3:.2f} ms, exchange operation {exchange_time * 1e3:.2f} ms; "
          f"{args.cores:g} cores", flush=True)

    rows = []
    for topology in args.topologies:
        run = run_config(args.peers, topology, args.timeout + 30)
        real = real_run(run, args.peers, args.slowdown, args.target, args.timeout, args.out / f"real-{topology}")
        sim = sim_run(run, args.peers, args.slowdown, args.target, args.timeout, step_time, exchange_time, args.cores)
        row = {
            "topology": topology,
            "peers": args.peers,
            "real_time": round(real["time_to_target"], 3),
            "sim_time": round(sim["time_to_target"], 3),
            "time_error": round(abs(sim["time_to_target"] - real["time_to_target"]) / real["time_to_target"], 4),
            "real_exchanges": round(real["exchanges_per_peer"], 1),
            "sim_exchanges": round(sim["exchanges_per_peer"], 1),
            "exchanges_error": round(abs(sim["exchanges_per_peer"] - real["exchanges_per_peer"]) / max(1.0, real["exchanges_per_peer"]), 4),
            "real_steps": round(real["steps_per_peer"], 1),
            "sim_steps": round(sim["steps_per_peer"], 1),
            "real_rtt_ms": round(real["rtt_ms"], 2),
            "sim_rtt_ms": round(sim["rtt_ms"], 2),
            "sim_wall_seconds": sim["wall_seconds"],
        }
        rows.append(row)
        print(
            f"{topology:>12}: time to {args.target} real {row['real_time']:.2f} s, simulated {row['sim_time']:.2f} s "
            f"(error {row['time_error']:.1%}); exchanges/peer real {row['real_exchanges']:.0f}, "
            f"simulated {row['sim_exchanges']:.0f} (error {row['exchanges_error']:.1%})",
            flush=True,
        )
    write_results(args.out, rows, args, step_time, exchange_time)
    print(json.dumps({
        "time_error": max(r["time_error"] for r in rows),
        "exchanges_error": max(r["exchanges_error"] for r in rows),
        "peers": args.peers,
        "target": args.target,
        "step_time_ms": round(step_time * 1e3, 3),
        "exchange_time_ms": round(exchange_time * 1e3, 3),
        "topologies": {r["topology"]: {k: r[k] for k in ("real_time", "sim_time", "real_exchanges", "sim_exchanges")} for r in rows},
    }))


def write_results(out: Path, rows: list[dict[str, Any]], args: argparse.Namespace, step_time: float, exchange_time: float) -> None:
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "results.csv", "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    lines = [
        "# Simulator fidelity",
        "",
        f"{args.peers} peers, digits, one peer {args.slowdown:g}x slower, target mean test accuracy {args.target}; "
        f"compute model calibrated alone: step {step_time * 1e3:.2f} ms, exchange operation {exchange_time * 1e3:.2f} ms, "
        f"{args.cores:g} cores shared.",
        "",
        "| topology | real time (s) | simulated (s) | error | real exchanges/peer | simulated | error |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        lines.append(
            f"| {r['topology']} | {r['real_time']:.2f} | {r['sim_time']:.2f} | {r['time_error']:.1%} | "
            f"{r['real_exchanges']:.0f} | {r['sim_exchanges']:.0f} | {r['exchanges_error']:.1%} |"
        )
    lines += ["", "Regenerate: `python experiments/fidelity.py`"]
    (out / "summary.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
