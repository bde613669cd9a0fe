"""Churn: a swarm with a quarter of its peers down at any moment vs the same swarm without churn.

N `gossiptrain peer` processes train digits on 127.0.0.1 (peer i on shard
i, one torch thread, a common start line with `--wait-for N`), with a
coordinator, as the other experiments run them (experiments/harness.py).
In the churn run a driver keeps about a quarter of the peers down: while
fewer than round(fraction x N) peers are down, kills arrive as a Poisson
process (exponential gaps, mean --kill-gap s); each SIGKILLs a random
training peer, which is started again on its shard after an exponential
downtime (mean --downtime s, at least --min-downtime), joins through the
coordinator and downloads the current model by state transfer before it
trains. A peer counts as down from its kill until its new process trains
again (start-up, join and download included): the fraction is of peers not
training. The churn begins once every first peer trains. Both runs train
for --seconds from the first peer's start of training; then every peer is
stopped (SIGTERM). Time counts from that first start, as in the harness.

Measured in each run, from the peers' metrics (one record every 0.25 s):

- time to target: on a grid every 0.25 s from that start, the mean
  test accuracy of the peers training at that moment (each one's latest
  evaluation); the first grid point that starts 3 in a row at or above the
  target (as in the other experiments);
- final accuracy: the mean of that series over the last FINAL_WINDOW s;
- max_stall_s, per peer: for every process, from its start of training to
  its end (its kill, or its last record when stopped), the longest interval
  over which its step count did not grow (between two of its records, or
  from its last progress to its kill). Per peer, so that one stuck peer
  shows even while the others train. Without churn this is the evaluation
  cadence plus the machine's scheduling noise; "no stall" means the churn
  run's figure is within STALL_FACTOR of the churn-free one's. Also
  reported: swarm_stall_s, the longest interval in which no peer progressed;
- rejoins: start-up to training of each restarted process, and whether its
  state transfer completed.

With --sim the simulator (gossiptrain.sim) runs the same swarm to the
target without churn and with the same churn policy as a trace (each
crashed peer down for the real run's mean time from kill to training),
and its time ratio is printed beside the real one. Its compute model is
calibrated only by the step time measured here and the machine's cores
(experiments/fidelity.py does more), so compare the ratios, not the times.
One difference matters here: on the real machine the peers share 2 cores,
so a peer that is down frees CPU for the others (who step faster), while
the simulator charges every peer the contention of all N peers busy, down
or not; its ratio is the cost of churn without that effect.

Output in experiments/results/churn/: results.csv (one row per run),
curves.csv, events.csv, summary.md, accuracy_vs_time.png. The last line
printed is a JSON object with time_ratio (churn / no churn time to
target), acc_gap_points ((no churn - churn) final accuracy, in points) and
max_stall_s (the churn run's), medians over seeds.

    python experiments/churn.py            # 8 peers, 2 down at any moment, target 0.95, 120 s per run, + simulator
    python experiments/churn.py --quick    # 4 peers, 1 down, target 0.9, 20 s per run, no simulator (smoke test)
"""

from __future__ import annotations

import argparse
import math
import os
import random
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from experiments import harness  # noqa: E402
from experiments.harness import EVAL_EVERY, HOLD, POLL, Point  # noqa: E402
from gossiptrain.config import RunConfig  # noqa: E402
from gossiptrain.train.metrics import MetricsTail  # noqa: E402

FINAL_WINDOW = 5.0  # seconds at the end of a run whose mean accuracy is its final accuracy
STALL_FACTOR = 2.0  # "no stall": the churn run's longest per-peer stall within this factor of the churn-free run's
TARGET_TIME_RATIO = 1.4
START_TIMEOUT = 180.0  # seconds for the first N peers to start training (a loaded machine starts Python slowly)


@dataclass
class Life:
    """One peer process: a slot (its shard) runs a new one after each kill."""

    slot: int
    name: str
    proc: Any  # subprocess.Popen
    tail: MetricsTail
    launched: float  # time.time()
    killed: float | None = None

    def start(self) -> dict[str, Any] | None:
        return next((r for r in self.tail.records if r.get("event") == "start"), None)

    def progress(self) -> list[dict[str, Any]]:
        """Its records with a step and an accuracy: the start of training, evaluations, the final one."""
        return [r for r in self.tail.records if r.get("event") in ("start", "eval", "done")]


@dataclass
class SwarmRun:
    mode: str  # "churn" or "none"
    seed: int
    lives: list[Life]
    t0: float  # time.time() of the first peer's start of training
    end: float
    events: list[tuple[float, str, int]] = field(default_factory=list)  # (time.time(), kill|restart, slot)
    start_spread: float = 0.0  # seconds between the first and the last first peer's start of training
    load: float = math.nan  # the machine's mean 1-minute load average while it trained (other work included)


# -- running a swarm ---------------------------------------------------------------------


def run_swarm(args: argparse.Namespace, seed: int, churn: bool, workdir: Path) -> SwarmRun:
    """A coordinator and args.peers peers for args.seconds of training; with churn, the kill/restart driver."""
    harness.fresh_dir(workdir)
    overrides = harness.run_overrides(args.peers, seed, max_seconds=args.seconds + START_TIMEOUT + 60)
    rng = random.Random(1000 + seed)
    lives: list[Life] = []
    current: dict[int, Life] = {}
    events: list[tuple[float, str, int]] = []
    with harness.Procs(workdir) as procs:
        join = harness.start_coordinator(procs, overrides)
        coordinator = procs.procs[0][1]

        def launch(slot: int, first: bool) -> None:
            again = sum(1 for life in lives if life.slot == slot)
            name = f"peer-{slot}" + (f"-r{again}" if again else "")
            metrics = workdir / f"{name}.jsonl"
            start_line = ["--wait-for", args.peers] if first else []  # a restarted peer trains as soon as it can
            proc = procs.start(name, harness.python_m(
                "gossiptrain", "peer", "--join", join, "--quiet", "--threads", 1, "--shard", slot, "--metrics", metrics,
                *start_line,
            ))
            life = Life(slot, name, proc, MetricsTail(metrics), time.time())
            lives.append(life)
            current[slot] = life

        def check() -> None:
            for life in lives:
                life.tail.poll()
                if life.killed is None and life.proc.poll() not in (None, 0):
                    tail = (workdir / f"{life.name}.log").read_text(errors="replace")[-1500:]
                    raise RuntimeError(f"{life.name} exited with status {life.proc.returncode}; log:\n{tail}")
            if coordinator.poll() is not None:
                raise RuntimeError(f"the coordinator exited with status {coordinator.returncode}; see {workdir}")

        for slot in range(args.peers):
            launch(slot, first=True)
        deadline = time.monotonic() + START_TIMEOUT
        while not all(life.start() for life in lives):
            check()
            if time.monotonic() > deadline:
                raise RuntimeError(f"the peers did not all start within {START_TIMEOUT} s; see {workdir}")
            time.sleep(POLL)
        # Time counts from the first peer's start of training, as in the harness: with --wait-for the peers start
        # within about a second of each other on an idle machine (start_spread_s says how far apart they were),
        # and counting from the last one would hide the early ones' head start. The churn begins once all train.
        t0 = min(life.start()["time"] for life in lives)  # type: ignore[index]
        spread = max(life.start()["time"] for life in lives) - t0  # type: ignore[index]
        end = t0 + args.seconds
        down_target = round(args.fraction * args.peers) if churn else 0
        next_kill: float | None = None
        restarts: dict[int, float] = {}  # slot -> when its new process starts
        loads: list[float] = []
        while (now := time.time()) < end:
            check()
            loads.append(os.getloadavg()[0])
            for slot, due in sorted(restarts.items()):
                if now >= due:
                    del restarts[slot]
                    launch(slot, first=False)
                    events.append((now, "restart", slot))
            training = sorted(s for s, life in current.items() if life.killed is None and life.start() is not None)
            if args.peers - len(training) >= down_target:
                next_kill = None  # enough are down; the Poisson clock restarts (memoryless) when one is back
            elif next_kill is None:
                next_kill = now + rng.expovariate(1 / args.kill_gap)
            elif now >= next_kill and len(training) > 1:
                victim = current[rng.choice(training)]
                victim.proc.kill()
                victim.proc.wait()
                victim.killed = time.time()
                events.append((victim.killed, "kill", victim.slot))
                restarts[victim.slot] = victim.killed + max(args.min_downtime, rng.expovariate(1 / args.downtime))
                next_kill = None
            time.sleep(POLL)
    for life in lives:  # every process has stopped: read what it wrote last
        life.tail.poll()
    return SwarmRun("churn" if churn else "none", seed, lives, t0, end, events, spread, statistics.mean(loads) if loads else math.nan)


# -- reading a run -----------------------------------------------------------------------


def life_end(life: Life) -> float | None:
    """When a life stopped counting: its kill, or its last record (the final one, when stopped)."""
    recs = life.progress()
    if life.killed is not None:
        return life.killed
    return recs[-1]["time"] if recs else None


def training_at(life: Life, t: float) -> bool:
    start = life.start()
    end = life_end(life)
    return start is not None and end is not None and start["time"] <= t and (life.killed is None or t < life.killed)


def series(run: SwarmRun, batch_size: int) -> tuple[list[Point], list[int]]:
    """The swarm's points every EVAL_EVERY s from the first start of training, and how many peers trained at each."""
    points: list[Point] = []
    counts: list[int] = []
    progress = {id(life): life.progress() for life in run.lives}
    g = run.t0 + EVAL_EVERY
    while g <= run.end + 1e-9:
        accs, samples = [], 0
        for life in run.lives:
            seen = [r for r in progress[id(life)] if r["time"] <= g]
            if not seen:
                continue
            samples += seen[-1]["step"] * batch_size  # steps of a process that has since died count too
            if training_at(life, g):
                accs.append(seen[-1]["test_acc"])
        if accs:
            points.append(Point(round(g - run.t0, 3), samples, sum(accs) / len(accs)))
            counts.append(len(accs))
        g += EVAL_EVERY
    return points, counts


def stalls(run: SwarmRun) -> tuple[float, float, str]:
    """(longest per-peer stall, longest swarm-wide stall, whose was the per-peer one); see the module docstring."""
    worst, who = 0.0, ""
    advances: list[float] = []
    for life in run.lives:
        recs = life.progress()
        if not recs or recs[0].get("event") != "start":
            continue
        last_time, last_step = recs[0]["time"], recs[0]["step"]
        for r in recs[1:]:
            if r["step"] > last_step:
                if r["time"] - last_time > worst:
                    worst, who = r["time"] - last_time, life.name
                last_time, last_step = r["time"], r["step"]
                advances.append(r["time"])
        if life.killed is not None and life.killed - last_time > worst:  # stuck from its last progress to its kill
            worst, who = life.killed - last_time, f"{life.name} (until killed)"
    marks = sorted([run.t0, *(t for t in advances if run.t0 <= t <= run.end), run.end])
    swarm = max((b - a for a, b in zip(marks, marks[1:])), default=0.0)
    return worst, swarm, who


def summarise_run(run: SwarmRun, args: argparse.Namespace, batch_size: int) -> dict[str, Any]:
    points, counts = series(run, batch_size)
    ttt = harness.time_to_target(points, args.target, HOLD)
    last = [p.acc for p in points if p.elapsed >= args.seconds - FINAL_WINDOW]
    stall, swarm_stall, who = stalls(run)
    restarted = [life for life in run.lives if life.launched > run.t0]
    rejoined = [life for life in restarted if life.start() is not None]
    complete = [life for life in rejoined if life.start()["state_transfer"] == "complete"]  # type: ignore[index]
    rejoin_s = [life.start()["time"] - life.launched for life in rejoined]  # type: ignore[index]
    transfer_s = [life.start()["state_transfer_seconds"] for life in complete]  # type: ignore[index]
    down_times = []
    for life in (x for x in run.lives if x.killed is not None):
        after = next((x for x in run.lives if x.slot == life.slot and x.launched > life.killed and x.start()), None)
        if after is not None:
            down_times.append(after.start()["time"] - life.killed)  # type: ignore[index]
    duration = points[-1].elapsed - points[0].elapsed if len(points) > 1 else math.nan
    settled = [c for p, c in zip(points, counts) if p.elapsed >= run.start_spread]  # once every first peer trained
    return {
        "run": run.mode, "seed": run.seed, "peers": args.peers, "target": args.target, "seconds": args.seconds,
        "time_to_target_s": ttt, "final_acc": statistics.mean(last) if last else math.nan,
        "max_stall_s": stall, "max_stall_peer": who, "swarm_stall_s": swarm_stall,
        "kills": sum(1 for e in run.events if e[1] == "kill"), "restarts": len(restarted), "rejoined": len(rejoined),
        "transfers_complete": len(complete),
        "rejoin_s_median": statistics.median(rejoin_s) if rejoin_s else math.nan,
        "rejoin_s_max": max(rejoin_s, default=math.nan),
        "transfer_s_median": statistics.median(transfer_s) if transfer_s else math.nan,
        "down_s_mean": statistics.mean(down_times) if down_times else math.nan,
        "down_fraction": 1 - statistics.mean(settled) / args.peers if settled else math.nan,
        "throughput_samples_per_s": (points[-1].samples - points[0].samples) / duration if duration > 0 else math.nan,
        "start_spread_s": run.start_spread,
        "load_avg": run.load,
        "_points": points, "_counts": counts,
    }


# -- the simulator -----------------------------------------------------------------------


def policy_trace(peers: int, down: int, kill_gap: float, downtime: float, duration: float, rng: random.Random) -> tuple[Any, ...]:
    """The real driver's policy as a simulator churn trace: while fewer than ``down`` slots are down, crashes at
    exponential gaps (mean ``kill_gap``) of a random up slot, each rejoining ``downtime`` later."""
    from gossiptrain.sim.faults import ChurnEvent

    events: list[Any] = []
    back: dict[int, float] = {}  # down slot -> when it rejoins
    t = 0.0
    while t < duration:
        returns = min(back.values(), default=math.inf)
        kill = t + rng.expovariate(1 / kill_gap) if len(back) < down else math.inf
        if returns <= kill:  # one is back first; the kill clock starts again (memoryless)
            t = returns
            del back[min(back, key=back.__getitem__)]
            continue
        t = kill
        if t >= duration:
            break
        slot = rng.choice([s for s in range(peers) if s not in back])
        back[slot] = t + downtime
        events.append(ChurnEvent(t, slot, "crash"))
        if back[slot] < duration:
            events.append(ChurnEvent(back[slot], slot, "join"))
    return tuple(events)


def sim_time_ratio(args: argparse.Namespace, downtime: float) -> dict[str, Any]:
    """The simulator's time to target with the same churn policy (each crash down ``downtime``), and without."""
    from gossiptrain.sim import SimConfig, simulate
    from gossiptrain.sim.compute import measure_step_time
    from gossiptrain.train.workload import load_workload

    run = harness.run_config(args.peers, 0, max_seconds=0.0)
    workload = load_workload(run.train.workload)
    model = workload.build_model(run.train.seed)
    # The least disturbed of a few measurements: on a machine shared with other work the median of one is often inflated.
    step_time = min(measure_step_time(workload, model, run) for _ in range(3))
    down = round(args.fraction * args.peers)
    trace = policy_trace(args.peers, down, args.kill_gap, downtime, args.sim_duration, random.Random(0))
    out: dict[str, Any] = {"sim_step_time_ms": round(step_time * 1e3, 3), "sim_downtime_s": round(downtime, 2)}
    for mode, events in (("none", ()), ("churn", trace)):
        config = SimConfig(
            peers=args.peers, run=run, duration=args.sim_duration, seed=0, step_time=step_time, cores=float(os.cpu_count() or 1),
            churn_trace=events, join_spread=0.0, sample_every=EVAL_EVERY, target_accuracy=args.target, target_hold=HOLD,
        )
        result = simulate(config)
        out[f"sim_time_{mode}"] = result.summary["time_to_target"]
        out[f"sim_crashes_{mode}"] = result.summary["crashes"]
        out[f"sim_wall_s_{mode}"] = result.summary["wall_seconds"]
    out["sim_time_ratio"] = ratio(out["sim_time_churn"], out["sim_time_none"])
    return out


# -- main --------------------------------------------------------------------------------


def ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or b <= 0 or math.isnan(a) or math.isnan(b):
        return None
    return round(a / b, 3)


def r3(x: float | None) -> float | None:
    return None if x is None else round(x, 3)


def median_of(rows: list[dict[str, Any]], key: str) -> float | None:
    values = [r[key] for r in rows if r[key] is not None and not (isinstance(r[key], float) and math.isnan(r[key]))]
    return statistics.median(values) if values else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--peers", type=int, default=8)
    parser.add_argument("--fraction", type=float, default=0.25, help="fraction of the peers down at any moment")
    parser.add_argument("--kill-gap", type=float, default=1.0, help="mean seconds between kills while fewer are down")
    parser.add_argument("--downtime", type=float, default=3.0, help="mean seconds a killed peer stays down before it restarts")
    parser.add_argument("--min-downtime", type=float, default=0.5)
    parser.add_argument("--target", type=float, default=0.95, help="mean test accuracy to reach (held for 3 evaluations)")
    parser.add_argument("--seconds", type=float, default=120.0, help="seconds of training per run, from the first start")
    parser.add_argument("--seeds", type=int, default=1)
    parser.add_argument("--sim", action=argparse.BooleanOptionalAction, default=True, help="also the simulator, side by side")
    parser.add_argument("--sim-duration", type=float, default=60.0, help="virtual seconds before a simulated run gives up")
    parser.add_argument("--quick", action="store_true", help="4 peers, 1 down, target 0.9, 20 s per run, no simulator")
    parser.add_argument("--out", type=Path, help="results folder (default: experiments/results/churn; --quick: a scratch folder)")
    args = parser.parse_args()
    args.out = harness.results_dir("churn", args.out, args.quick)
    if args.quick:
        args.peers, args.target, args.seconds, args.seeds, args.sim = 4, 0.9, 20.0, 1, False
        args.kill_gap, args.downtime = 0.5, 1.0
    if not 0 < args.fraction < 1 or round(args.fraction * args.peers) < 1:
        parser.error("--fraction must leave at least one peer down and one up")
    args.out.mkdir(parents=True, exist_ok=True)
    began = time.monotonic()
    batch_size = RunConfig().train.batch_size
    runs: list[SwarmRun] = []
    rows: list[dict[str, Any]] = []
    crashes: list[str] = []
    for seed in range(args.seeds):
        for churn in (False, True):
            mode = "churn" if churn else "none"
            run, failed = harness.retried(
                lambda: run_swarm(args, seed, churn, args.out / "runs" / f"{mode}-seed{seed}"), f"{mode} seed {seed}"
            )
            crashes += failed
            runs.append(run)
            row = summarise_run(run, args, batch_size)
            row["retries"] = len(failed)
            rows.append(row)
            ttt = row["time_to_target_s"]
            print(
                f"seed {seed} {mode:>5}: time to {args.target} {'not reached' if ttt is None else f'{ttt:.2f} s'}, "
                f"final acc {row['final_acc']:.4f}, max stall {row['max_stall_s']:.2f} s ({row['max_stall_peer']}), "
                f"swarm stall {row['swarm_stall_s']:.2f} s, {row['kills']} kills, {row['rejoined']}/{row['restarts']} rejoined "
                f"({row['transfers_complete']} by state transfer), down fraction {row['down_fraction']:.2f}, "
                f"first peers started within {row['start_spread_s']:.1f} s",
                flush=True,
            )
    churned = [r for r in rows if r["run"] == "churn"]
    calm = [r for r in rows if r["run"] == "none"]
    t_churn, t_calm = median_of(churned, "time_to_target_s"), median_of(calm, "time_to_target_s")
    a_churn, a_calm = median_of(churned, "final_acc"), median_of(calm, "final_acc")
    stall, calm_stall = median_of(churned, "max_stall_s"), median_of(calm, "max_stall_s")
    heads: dict[str, Any] = {
        "time_ratio": ratio(t_churn, t_calm),
        "acc_gap_points": None if a_churn is None or a_calm is None else round(100 * (a_calm - a_churn), 2),
        "max_stall_s": r3(stall),
        "max_stall_s_no_churn": r3(calm_stall),
        "swarm_stall_s": r3(median_of(churned, "swarm_stall_s")),
        "time_to_target_s": {"churn": t_churn, "none": t_calm},
        "final_acc": {"churn": a_churn, "none": a_calm},
        "down_fraction": r3(median_of(churned, "down_fraction")),
        "kills": sum(r["kills"] for r in churned),
        "rejoined": sum(r["rejoined"] for r in churned),
        "transfers_complete": sum(r["transfers_complete"] for r in churned),
        "peers": args.peers, "target": args.target, "seeds": args.seeds,
    }
    down = median_of(churned, "down_s_mean")
    if args.sim and down:
        print(f"simulator: churn at the measured mean downtime {down:.2f} s ...", flush=True)
        heads.update(sim_time_ratio(args, down))
    write_results(args, runs, rows, heads, time.monotonic() - began, crashes)
    print(harness.headline(heads))


# -- output ------------------------------------------------------------------------------


def fmt(x: Any, digits: int = 2) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "n/a"
    return f"{x:.{digits}f}"


def write_results(
    args: argparse.Namespace, runs: list[SwarmRun], rows: list[dict[str, Any]], heads: dict[str, Any], wall: float,
    crashes: list[str],
) -> None:
    out = args.out
    public = [{k: ("" if v is None else round(v, 4) if isinstance(v, float) else v) for k, v in r.items() if not k.startswith("_")}
              for r in rows]
    harness.write_csv(out / "results.csv", public)
    harness.write_csv(out / "curves.csv", [
        {"run": r["run"], "seed": r["seed"], "elapsed_s": p.elapsed, "samples": p.samples, "test_acc": round(p.acc, 4),
         "training_peers": c}
        for r in rows for p, c in zip(r["_points"], r["_counts"])
    ])
    harness.write_csv(out / "events.csv", [
        {"run": run.mode, "seed": run.seed, "elapsed_s": round(t - run.t0, 3), "event": kind, "slot": slot}
        for run in runs for t, kind, slot in [*run.events, *training_events(run)]
    ] or [{"run": "", "seed": "", "elapsed_s": "", "event": "", "slot": ""}])
    stall_ok = heads["max_stall_s"] is not None and heads["max_stall_s_no_churn"] is not None and (
        heads["max_stall_s"] <= STALL_FACTOR * heads["max_stall_s_no_churn"]
    )
    time_ok = heads["time_ratio"] is not None and heads["time_ratio"] <= TARGET_TIME_RATIO
    down = round(args.fraction * args.peers)
    lines = [
        "# Churn: a quarter of the peers down at any moment vs no churn",
        "",
        f"{args.peers} `gossiptrain peer` processes train digits (MLP, 1.13M parameters) on 127.0.0.1 of a 2-core machine "
        f"shared with other work, peer i on shard i, for {args.seconds:g} s from the first peer's start of training (a "
        f"start line: `--wait-for {args.peers}`). Churn, once all train: while fewer "
        f"than {down} peers are down, a random training peer is SIGKILLed after an exponential gap (mean "
        f"{args.kill_gap:g} s); it restarts on its shard after an exponential downtime (mean {args.downtime:g} s, at least "
        f"{args.min_downtime:g} s), rejoins through the coordinator and downloads the model by state transfer. A peer is down "
        f"from its kill until its new process trains (start-up, join and download included). Time to target: the mean test "
        f"accuracy of the peers training at each moment holds {args.target} for {HOLD} evaluations (every {EVAL_EVERY} s); "
        f"final accuracy: the mean over the last {FINAL_WINDOW:g} s; max stall: the longest time one training peer's step "
        f"count did not grow (to its kill, if it was killed); swarm stall: the longest time no peer's did. "
        f"Load average: the machine's 1-minute load average while the run trained (2 cores; the swarm alone keeps it near "
        f"{args.peers}, the rest is other work). Medians of {args.seeds} seed(s).",
        "",
        "| run | seed | time to target (s) | final acc | max stall (s) | swarm stall (s) | kills | rejoined (state transfer) "
        "| start-up to training (s), median [max] | down (s), mean | down fraction | samples/s | first peers' start spread (s) "
        "| load average |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        ttt = "not reached" if r["time_to_target_s"] is None else fmt(r["time_to_target_s"])
        lines.append(
            f"| {r['run']} | {r['seed']} | {ttt} | {fmt(r['final_acc'], 4)} | {fmt(r['max_stall_s'])} | "
            f"{fmt(r['swarm_stall_s'])} | {r['kills']} | {r['rejoined']}/{r['restarts']} ({r['transfers_complete']}) | "
            f"{fmt(r['rejoin_s_median'], 1)} [{fmt(r['rejoin_s_max'], 1)}] | {fmt(r['down_s_mean'], 1)} | "
            f"{fmt(r['down_fraction'])} | {fmt(r['throughput_samples_per_s'], 0)} | {fmt(r['start_spread_s'], 1)} | "
            f"{fmt(r['load_avg'], 1)} |"
        )
    lines += [
        "",
        "Headline:",
        "",
        f"- time to target, churn / no churn: **{heads['time_ratio']}** (target <= {TARGET_TIME_RATIO:g}: "
        f"{'met' if time_ok else 'missed'})",
        f"- final accuracy, no churn minus churn: **{heads['acc_gap_points']} points**",
        f"- longest per-peer stall: **{heads['max_stall_s']} s** with churn, {heads['max_stall_s_no_churn']} s without "
        f"(no stall: within {STALL_FACTOR:g}x, {'met' if stall_ok else 'missed'}); swarm-wide: {heads['swarm_stall_s']} s",
    ]
    if "sim_time_ratio" in heads:
        lines.append(
            f"- simulator, the same swarm and churn policy (each crashed peer down {heads['sim_downtime_s']} s, "
            f"the real run's mean from kill to training; {os.cpu_count()} cores shared): time ratio **{heads['sim_time_ratio']}** "
            f"({fmt(heads['sim_time_churn'])} vs {fmt(heads['sim_time_none'])} virtual s; {heads['sim_crashes_churn']} crashes). "
            f"The simulator charges every peer the contention of all {args.peers} busy, down or not, so a down peer frees no CPU "
            f"there: its ratio is the cost of churn without the speed-up the survivors get on the real machine"
        )
    if crashes:
        lines += ["", f"Runs repeated after a process crashed ({len(crashes)}):", ""] + [f"- {c}" for c in crashes]
    quick = " --quick" if args.quick else ""
    lines += [
        "",
        f"Wall time of this run: {wall:.0f} s. Regenerate: `python experiments/churn.py{quick}`",
        "",
        "![accuracy vs time](accuracy_vs_time.png)",
    ]
    (out / "summary.md").write_text("\n".join(lines) + "\n")
    plot(args, runs, rows)


def training_events(run: SwarmRun) -> list[tuple[float, str, int]]:
    """When each restarted process began to train (after its join and download)."""
    return [(life.start()["time"], "training", life.slot) for life in run.lives  # type: ignore[index]
            if life.launched > run.t0 and life.start() is not None]


def plot(args: argparse.Namespace, runs: list[SwarmRun], rows: list[dict[str, Any]]) -> None:
    plt = harness.pyplot()
    fig, (ax, bx) = plt.subplots(2, 1, figsize=(8, 6), sharex=True, gridspec_kw={"height_ratios": [3, 1]})
    colors = {"none": "tab:grey", "churn": "tab:purple"}
    for run, row in zip(runs, rows):
        if run.seed != 0:
            continue
        xs = [p.elapsed for p in row["_points"]]
        label = "no churn" if run.mode == "none" else f"churn ({round(args.fraction * args.peers)} of {args.peers} down)"
        ax.plot(xs, [p.acc for p in row["_points"]], color=colors[run.mode], lw=1.3, label=label)
        bx.step(xs, row["_counts"], where="post", color=colors[run.mode], lw=1.2)
        if run.mode == "churn":
            kills = [t - run.t0 for t, kind, _ in run.events if kind == "kill"]
            back = [t - run.t0 for t, _, _ in training_events(run)]
            ax.plot(kills, [0.505] * len(kills), "v", color="tab:red", ms=6, label="peer killed")
            ax.plot(back, [0.525] * len(back), "^", color="tab:green", ms=6, label="restarted peer trains (state transferred)")
    ax.axhline(args.target, color="black", ls="--", lw=0.8)
    ax.set_ylim(0.5, 1.0)
    ax.set_ylabel("mean test accuracy of\nthe peers training")
    ax.set_title(f"{args.peers} peers on digits, churn vs none")
    ax.legend(loc="center right", fontsize=8)
    bx.set_ylabel("peers training")
    bx.set_xlabel("seconds since the first peer started training")
    bx.set_ylim(0, args.peers + 0.5)
    fig.tight_layout()
    fig.savefig(args.out / "accuracy_vs_time.png", dpi=80)
    plt.close(fig)


if __name__ == "__main__":
    main()
