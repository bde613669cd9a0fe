"""Does the simulator predict a real swarm? The same run, real on loopback and simulated, side by side.

For each topology, N peers train digits (one of them S times slower) until
the peers' mean test accuracy reaches the target:

- real: a coordinator and N `gossiptrain peer --wait-for N` processes on
  127.0.0.1 (a start line, as the simulated peers start together), the
  straggler started with `--slowdown S`;
- simulated: `gossiptrain.sim` with the same run configuration, the
  straggler's speed S, and a machine model calibrated here beforehand:
  alone, the time of one local step and the CPU time of one exchange
  operation including its ZeroMQ transfer on loopback, both slowed by how
  many busy peers share this machine's cores; and, from a separate
  calibration swarm of the same size (another seed, never reported), how
  loaded the machine is: the effective number of cores that makes the
  simulated peers step as fast as the real ones, and the delay a message
  waits before its peer handles it (the network thread waiting for a core
  and for the GIL behind the trainer), half the difference between that
  swarm's exchange round trip and the simulator's (see calibrate_load).

It reports the time to the target and the exchanges per peer at that time,
both measured and predicted, and the relative errors. Nothing from the
measured runs is fed to the simulator. Output: experiments/results/fidelity/
(results.csv, summary.md); the last line printed is a JSON object with
`time_error` and `exchanges_error` (the worst over the topologies).

    python experiments/fidelity.py            # 8 peers, ring and exponential, one 4x straggler
    python experiments/fidelity.py --quick    # 4 peers, exponential only, target 0.9 (smoke test)
"""

from __future__ import annotations

import argparse
import asyncio
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
from gossiptrain.transport import Transport, listen  # noqa: E402
from gossiptrain.transport.sim import LinkProfile  # noqa: E402
from gossiptrain.wire import Message, decode, encode  # noqa: E402
from gossiptrain.workload import load_workload  # noqa: E402

EVAL_EVERY = 0.25  # seconds, real and virtual: both sides see accuracy at the same cadence
HOLD = 3  # grid points the target must hold for
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


def measure_exchange_time(run: RunConfig, repeats: int = 40) -> float:
    """CPU seconds per exchange operation, alone: snapshot, encode, the ZeroMQ transfer over
    loopback (both ends' I/O threads count: this is process CPU time), decode and merge."""
    workload = load_workload(run.train.workload)
    model = workload.build_model(run.train.seed)
    a = PairwiseAveraging(dict(copy.deepcopy(model).named_parameters()), run.gossip, random.Random(0), me="A")
    b = PairwiseAveraging(dict(copy.deepcopy(model).named_parameters()), run.gossip, random.Random(1), me="B")
    limits = run.limits

    async def main() -> float:
        async with listen("tcp://127.0.0.1:0", limits) as ta, listen("tcp://127.0.0.1:0", limits) as tb:

            async def wire(src: Transport, dst: Transport, tensors: Any) -> Any:
                src.send(dst.address, encode(Message("xreq", "p", src.address, "fp", 0, {}, tensors), limits))
                return decode(await dst.recv(), limits).tensors

            samples = []
            for i in range(repeats + 5):
                c0 = time.process_time()
                (req,) = a.handle(Tick(step=i + 1, partners=["B"]), float(i))
                (rep,) = b.handle(Received("A", XREQ, req.xid, await wire(ta, tb, req.tensors)), float(i))
                a.handle(Received("B", XREP, rep.xid, await wire(tb, ta, rep.tensors)), float(i))
                if i >= 5:  # after connections and the allocator have warmed up
                    samples.append((time.process_time() - c0) / 3)  # three operations: start, serve, complete
            return statistics.median(samples)

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
    """When the peers' mean accuracy reached ``target`` and held it, in seconds from the median peer's start.

    Both sides are read on the same grid: every EVAL_EVERY seconds, the mean
    over peers of each one's latest accuracy; the target counts as reached at
    the first grid point that starts HOLD points at or above it (one noisy
    crossing is not convergence, as in the demo).
    """
    starts = [next((r["time"] for r in recs if r.get("event") == "start"), None) for recs in per_peer]
    if any(s is None for s in starts):
        return None
    # Peers start with `--wait-for N` (a start line), but each sees the N-th member when gossip brings it,
    # up to a heartbeat or two apart; the simulated ones start together. The median start is the fair zero.
    t0 = statistics.median(s for s in starts if s is not None)
    evals = [[r for r in recs if r.get("event") == "eval"] for recs in per_peer]
    end = min((e[-1]["time"] for e in evals if e), default=t0) if all(evals) else t0
    grid: list[tuple[float, list[dict[str, Any]]]] = []
    g = t0 + EVAL_EVERY
    while g <= end:
        latest = [max((r for r in e if r["time"] <= g), key=lambda r: r["time"], default=None) for e in evals]
        if all(latest):
            grid.append((g, latest))  # type: ignore[arg-type]
        g += EVAL_EVERY
    for k in range(len(grid) - HOLD + 1):
        window = grid[k : k + HOLD]
        if all(sum(r["test_acc"] for r in rows) / len(rows) >= target for _, rows in window):
            g, rows = window[0]
            return {
                "time_to_target": g - t0,
                "exchanges_per_peer": sum(r["exchanges"] for r in rows) / len(rows),
                "steps_per_peer": sum(r["step"] for r in rows) / len(rows),
                "rtt_ms": statistics.median(r["rtt_ms"] for r in rows),
            }
    return None


# -- the simulated swarm -----------------------------------------------------------------


def sim_run(
    run: RunConfig,
    peers: int,
    slowdown: float,
    target: float,
    timeout: float,
    step_time: float,
    exchange_time: float,
    cores: float,
    seed: int,
    delay: float = 0.0,
) -> dict[str, Any]:
    config = SimConfig(
        peers=peers,
        run=run,
        duration=timeout,
        seed=seed,
        step_time=step_time,
        exchange_time=exchange_time,
        cores=cores,
        speeds=tuple([slowdown] + [1.0] * (peers - 1)),
        link=LinkProfile(latency=LOOPBACK.latency + delay, bandwidth=LOOPBACK.bandwidth),
        join_spread=0.0,  # time to target counts from when all peers train, as in the real run
        sample_every=EVAL_EVERY,
        target_accuracy=target,
        target_hold=HOLD,
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


def calibrate_load(args: argparse.Namespace, step_time: float, exchange_time: float) -> tuple[float, float]:
    """(effective cores, message delay in seconds) of this machine loaded with the swarm.

    A real swarm of the same size and straggler (seed 1000, never reported)
    is run to the target. Two things it shows that the compute model alone
    misses: its peers step slower than ``step_time`` x contention predicts
    (evaluations, heartbeats, the network threads, the OS share the cores
    too), which sets the effective number of cores; and its exchange round
    trip, read as in the measured runs (the peers' smoothed round trips at
    the target), is longer than the simulator's, because a message waits for
    a core and for the GIL behind the trainer before its peer handles it:
    half the difference (a round trip is two messages) is the delay.
    """
    topology = args.topologies[-1]
    run = run_config(args.peers, topology, args.timeout + 30).with_overrides({"train.seed": 1000})
    real = real_run(run, args.peers, args.slowdown, args.target, args.timeout, args.out / "calibration")

    def period(r: dict[str, Any]) -> float:  # seconds per local step of the mean peer
        return r["time_to_target"] / r["steps_per_peer"]

    first = sim_run(run, args.peers, args.slowdown, args.target, args.timeout, step_time, exchange_time, args.cores, 1000)
    cores = args.cores * period(first) / period(real)
    second = sim_run(run, args.peers, args.slowdown, args.target, args.timeout, step_time, exchange_time, cores, 1000)
    delay = max(0.0, (real["rtt_ms"] - second["rtt_ms"]) / 2 / 1000)
    print(
        f"calibration swarm ({topology}, seed 1000): step period real {period(real) * 1e3:.1f} ms, "
        f"simulated {period(first) * 1e3:.1f} ms on {args.cores:g} cores: {cores:.2f} effective cores; "
        f"exchange round trip real {real['rtt_ms']:.0f} ms, simulated {second['rtt_ms']:.0f} ms: "
        f"message delay {delay * 1e3:.1f} ms",
        flush=True,
    )
    return cores, delay


# -- main --------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--peers", type=int, default=8)
    parser.add_argument("--topologies", nargs="+", default=["ring", "exponential"])
    parser.add_argument("--slowdown", type=float, default=4.0, help="the straggler's slowdown")
    parser.add_argument("--target", type=float, default=0.95)
    parser.add_argument("--timeout", type=float, default=180.0)
    parser.add_argument("--cores", type=float, default=float(os.cpu_count() or 1))
    parser.add_argument("--seeds", type=int, default=3, help="runs per topology; medians are reported")
    parser.add_argument("--quick", action="store_true", help="4 peers, exponential, target 0.9, one seed: a smoke test")
    parser.add_argument("--out", type=Path, default=ROOT / "experiments" / "results" / "fidelity")
    args = parser.parse_args()
    if args.quick:
        args.peers, args.topologies, args.target, args.seeds = 4, ["exponential"], 0.9, 1
    torch.set_num_threads(1)
    calib_run = run_config(args.peers, "exponential", args.timeout)
    workload = load_workload("digits")
    step_time = measure_step_time(workload, workload.build_model(calib_run.train.seed), calib_run)
    exchange_time = measure_exchange_time(calib_run)
    print(f"calibrated alone: step {step_time * 1e3:.2f} ms, exchange operation {exchange_time * 1e3:.2f} ms; "
          f"{args.cores:g} cores", flush=True)

    cores, delay = calibrate_load(args, step_time, exchange_time)
    rows = []
    for topology in args.topologies:
        real, sim = [], []
        for seed in range(args.seeds):  # medians over seeds: one run's threshold crossing is noisy
            run = run_config(args.peers, topology, args.timeout + 30).with_overrides({"train.seed": seed})
            real.append(real_run(run, args.peers, args.slowdown, args.target, args.timeout, args.out / f"real-{topology}-{seed}"))
            sim.append(
                sim_run(run, args.peers, args.slowdown, args.target, args.timeout, step_time, exchange_time, cores, seed, delay)
            )

        def med(runs: list[dict[str, Any]], key: str) -> float:
            return statistics.median(r[key] for r in runs)

        row = {
            "topology": topology,
            "peers": args.peers,
            "seeds": args.seeds,
            "real_time": round(med(real, "time_to_target"), 3),
            "sim_time": round(med(sim, "time_to_target"), 3),
            "real_exchanges": round(med(real, "exchanges_per_peer"), 1),
            "sim_exchanges": round(med(sim, "exchanges_per_peer"), 1),
            "real_steps": round(med(real, "steps_per_peer"), 1),
            "sim_steps": round(med(sim, "steps_per_peer"), 1),
            "real_rtt_ms": round(med(real, "rtt_ms"), 2),
            "sim_rtt_ms": round(med(sim, "rtt_ms"), 2),
            "sim_wall_seconds": round(sum(r["wall_seconds"] for r in sim), 1),
        }
        row["time_error"] = round(abs(row["sim_time"] - row["real_time"]) / row["real_time"], 4)
        row["exchanges_error"] = round(abs(row["sim_exchanges"] - row["real_exchanges"]) / max(1.0, row["real_exchanges"]), 4)
        rows.append(row)
        print(
            f"{topology:>12}: time to {args.target} real {row['real_time']:.2f} s, simulated {row['sim_time']:.2f} s "
            f"(error {row['time_error']:.1%}); exchanges/peer real {row['real_exchanges']:.0f}, "
            f"simulated {row['sim_exchanges']:.0f} (error {row['exchanges_error']:.1%}); "
            f"exchange round trip real {row['real_rtt_ms']:.0f} ms, simulated {row['sim_rtt_ms']:.0f} ms "
            f"(medians of {args.seeds} seeds)",
            flush=True,
        )
    write_results(args.out, rows, args, step_time, exchange_time, cores, delay)
    print(json.dumps({
        "time_error": max(r["time_error"] for r in rows),
        "exchanges_error": max(r["exchanges_error"] for r in rows),
        "peers": args.peers,
        "target": args.target,
        "step_time_ms": round(step_time * 1e3, 3),
        "exchange_time_ms": round(exchange_time * 1e3, 3),
        "message_delay_ms": round(delay * 1e3, 3),
        "effective_cores": round(cores, 3),
        "topologies": {r["topology"]: {k: r[k] for k in ("real_time", "sim_time", "real_exchanges", "sim_exchanges")} for r in rows},
    }))


def write_results(
    out: Path,
    rows: list[dict[str, Any]],
    args: argparse.Namespace,
    step_time: float,
    exchange_time: float,
    cores: float,
    delay: float,
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
        f"compute model calibrated alone: step {step_time * 1e3:.2f} ms, exchange operation {exchange_time * 1e3:.2f} ms, "
        f"{args.cores:g} cores shared; from a separate calibration swarm (seed 1000): {cores:.2f} effective cores, "
        f"message delay under load {delay * 1e3:.1f} ms; "
        f"medians of {args.seeds} seeds; the target must hold for {HOLD} evaluations.",
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
    lines += ["", "Regenerate: `python experiments/fidelity.py`"]
    (out / "summary.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
