"""Gossip against DDP and a parameter server at cluster scale: 16 to 1,024 simulated machines.

"Should I use this instead of DDP on 64 machines?" cannot be answered by
4 processes sharing 2 cores (a sleeping straggler frees CPU for the rest).
This answers it in the simulator, where each peer is a machine of its own:
the same real torch steps, shards, step-time model and links for every
system (`gossiptrain.sim`; DDP and the servers in
`gossiptrain.sim.synchronous`, costed by `gossiptrain.sim.collectives`).

Each run: `peers` machines, steps of 50 virtual ms at speed 1, the
workload's held target (mean test accuracy held for 3 samples); the time
to it in virtual seconds. Conditions change one thing from the base
(1 Gbit/s, 1 ms links, iid shards, every machine alike):

| condition | what changes |
| --- | --- |
| none | nothing |
| straggler | one machine computes 4x slower |
| 10pct | 10% of the machines compute 4x slower |
| lognormal | every step's time is lognormal, sigma 0.5 (mean 1) |
| 10gbit | links of 10 Gbit/s, 0.1 ms |
| 100mbit | links of 100 Mbit/s, 30 ms |
| skew | label-skewed shards (3 classes per machine) |
| churn | 1% of the machines crash per minute, back after 5 s; DDP restarts (30 s) |

Systems: `gossip` (the defaults), `gossip-best` (the fastest of push-sum,
neighbor and local-sgd, at the sizes in `--others-up-to`), `ddp` (ring
all-reduce, as NCCL and gloo do for large buffers), `ddp-hd` (recursive halving-doubling: what
NCCL's trees and MPI do for small buffers; fairer to DDP where latency
dominates), `ps-sync`, `ps-async`.

Runs go two at a time in fresh processes (a run is single-threaded and in
virtual time, so running two at once changes no result; a fresh process
per run measures its own peak memory; `--quick` reuses its processes).
Every finished run is written to runs.csv at once, and `--resume` skips
the runs already there (`--refresh` runs the selected ones again): a long
sweep survives an interruption and can be extended later.

Output in experiments/results/scale/ (`--quick`: a scratch folder):
runs.csv, summary.md, scale_<workload>.png (time to target against peer
count, one panel per condition, one line per system). The last line
printed is a JSON object with `ddp_over_gossip_64_straggler`,
`ddp_over_gossip_64_lognormal`, `ddp_over_gossip_256_100mbit` (digits-small),
`largest_run` (its peers, workload, wall seconds and peak RSS in MB).

    python experiments/scale.py                      # the default grid (hours on 2 cores; --resume continues it)
    python experiments/scale.py --sizes 64 --conditions straggler lognormal --seeds 3
    python experiments/scale.py --quick              # 16 peers, logreg, 2 conditions, 1 seed (smoke test)
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import math
import multiprocessing
import resource
import sys
import time
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from experiments import harness  # noqa: E402

STEP_TIME = 0.05  # virtual s per step at speed 1: a machine with an accelerator on a small model
TARGETS = {"logreg": 0.93, "digits-small": 0.93}
#: workload -> the peer counts it runs at by default (the largest counts logreg only: a 66-parameter model)
SIZES = {"logreg": (16, 64, 256, 1024), "digits-small": (16, 64, 256)}
#: Classes each machine holds under ``skew``: a workload with no more classes than this has no label skew to run.
SKEW_CLASSES = 3
CONDITIONS = ("none", "straggler", "10pct", "lognormal", "10gbit", "100mbit", "skew", "churn")
SYSTEMS = ("gossip", "gossip-best", "ddp", "ddp-hd", "ps-sync", "ps-async")
OTHER_ALGORITHMS = ("push-sum", "neighbor", "local-sgd")
#: link name -> (latency s, bandwidth bytes/s)
LINKS = {"1gbit": (0.001, 1.25e8), "10gbit": (0.0001, 1.25e9), "100mbit": (0.03, 1.25e7)}
GOSSIP_DURATION = 120.0  # virtual s a gossip run may take before it counts as not reached
SYNC_DURATION = 3000.0  # ...a synchronous one (a 1,024-worker ring on 30 ms links spends 61 s per step in latency)
CHURN_PER_MINUTE = 0.01  # of the machines
CHURN_DOWNTIME = 5.0
RESTART_COST = 30.0


@dataclasses.dataclass(frozen=True)
class Spec:
    """One run of the grid."""

    workload: str
    peers: int
    condition: str
    system: str  # gossip, ddp, ddp-hd, ps-sync, ps-async, or gossip:<algorithm> (gossip-best's candidates)
    seed: int
    duration: float

    def key(self) -> tuple[str, int, str, str, int]:
        return (self.workload, self.peers, self.condition, self.system, self.seed)


def sim_config(spec: Spec) -> Any:
    """The SimConfig of one run: the base, the condition's one change, the system."""
    from gossiptrain.config import RunConfig
    from gossiptrain.net.transport.sim import LinkProfile
    from gossiptrain.sim import SimConfig

    overrides: dict[str, Any] = {
        "train.workload": spec.workload, "train.shards": spec.peers, "train.seed": spec.seed,
        "train.max_steps": 0, "train.max_seconds": 0,
    }
    if spec.condition == "skew":
        overrides.update({"train.partition": "classes-per-peer", "train.partition_classes": SKEW_CLASSES})
    system, _, algorithm = spec.system.partition(":")
    if algorithm:
        overrides["gossip.algorithm"] = algorithm
    latency, bandwidth = LINKS.get(spec.condition, LINKS["1gbit"])
    fields: dict[str, Any] = {
        "peers": spec.peers, "run": RunConfig().with_overrides(overrides), "duration": spec.duration, "seed": spec.seed,
        "step_time": STEP_TIME, "link": LinkProfile(latency=latency, bandwidth=bandwidth), "join_spread": 0.0,
        "sample_every": sample_every(spec), "target_accuracy": TARGETS[spec.workload], "target_hold": harness.HOLD,
        "restart_cost": RESTART_COST,
    }
    if spec.condition == "straggler":
        fields["speeds"] = (4.0,) + (1.0,) * (spec.peers - 1)
    elif spec.condition == "10pct":
        fields.update(stragglers=0.1, slowdown=4.0)
    elif spec.condition == "lognormal":
        fields["step_sigma"] = 0.5
    elif spec.condition == "churn":
        fields.update(churn_rate=CHURN_PER_MINUTE * spec.peers / 60.0, churn_downtime=CHURN_DOWNTIME)
    if system in ("ddp", "ddp-hd"):
        fields.update(system="ddp", allreduce="ring" if system == "ddp" else "halving-doubling")
    elif system != "gossip":
        fields["system"] = system
    return SimConfig(**fields)


def sample_every(spec: Spec) -> float:
    """Fine enough to time a run (a few steps), coarse enough that 1,024 peers' evaluations stay cheap."""
    return 0.25 if spec.peers <= 256 else 0.5


def run_one(spec: Spec) -> dict[str, Any]:
    """Run ``spec`` in this (fresh) process; its row, with this process's peak memory."""
    import torch

    from gossiptrain.sim import simulate

    torch.set_num_threads(1)
    began = time.perf_counter()
    result = simulate(sim_config(spec))
    s = result.summary
    return {
        "workload": spec.workload, "peers": spec.peers, "condition": spec.condition, "system": spec.system,
        "seed": spec.seed, "time_to_target_s": s.get("time_to_target"), "duration_s": spec.duration,
        "swarm_time_to_target_s": s.get("swarm_time_to_target", ""),
        "final_acc": _round(s.get("mean_test_acc"), 4), "steps_per_peer": _round(s.get("mean_step"), 1),
        "restarts": s.get("restarts", ""), "crashes": s.get("crashes"),
        "wall_s": round(time.perf_counter() - began, 1),
        "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
    }


def _round(x: Any, digits: int) -> Any:
    return round(x, digits) if isinstance(x, (int, float)) and math.isfinite(x) else x


def skew_applies(workload: str) -> bool:
    """Whether ``skew`` means anything for ``workload``: it has more classes than a machine holds (logreg has 2)."""
    from gossiptrain.train.workload import load_workload

    return getattr(load_workload(workload), "num_classes", 0) > SKEW_CLASSES


def grid(args: argparse.Namespace) -> list[Spec]:
    specs = []
    for workload in args.workloads:
        conditions = list(args.conditions)
        if "skew" in conditions and not skew_applies(workload):
            conditions.remove("skew")
            print(f"skew: {workload} has no more than {SKEW_CLASSES} classes, so machines holding {SKEW_CLASSES} "
                  "of them are not label-skewed: not run", flush=True)
        for peers in args.sizes or SIZES[workload]:
            for condition in conditions:
                for system in args.systems:
                    names = [f"gossip:{a}" for a in args.others] if system == "gossip-best" else [system]
                    if system == "gossip-best" and peers > args.others_up_to:
                        continue
                    for name in names:
                        duration = args.gossip_duration if name.startswith("gossip") else args.sync_duration
                        specs += [Spec(workload, peers, condition, name, seed, duration) for seed in range(args.seeds)]
    return specs


def read_rows(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    with open(path, newline="") as fh:
        rows = list(csv.DictReader(fh))
    for r in rows:
        r["peers"], r["seed"] = int(r["peers"]), int(r["seed"])
        r["time_to_target_s"] = float(r["time_to_target_s"]) if r["time_to_target_s"] not in ("", "None") else None
        swarm = r.get("swarm_time_to_target_s")
        r["swarm_time_to_target_s"] = float(swarm) if swarm not in (None, "", "None") else None
        for k in ("wall_s", "peak_rss_mb", "duration_s"):
            r[k] = float(r[k]) if r.get(k) not in (None, "") else math.nan
    return rows


def key_of(row: dict[str, Any]) -> tuple[str, int, str, str, int]:
    return (row["workload"], row["peers"], row["condition"], row["system"], row["seed"])


def save_rows(path: Path, rows: list[dict[str, Any]]) -> None:
    """runs.csv from all rows so far: rewritten whole, so that rows of older runs lacking a newer column stay aligned."""
    tmp = path.with_suffix(".csv.tmp")
    harness.write_csv(tmp, rows)
    tmp.replace(path)  # a sweep interrupted mid-write keeps the previous file


def run_grid(specs: list[Spec], csv_path: Path, rows: list[dict[str, Any]], jobs: int, fresh: bool = True) -> None:
    """Run ``specs`` ``jobs`` at a time, adding each row to ``rows`` and runs.csv as it finishes.

    ``fresh``: each run in a process of its own (its peak memory is its
    own); otherwise the processes are reused (quicker: torch is imported
    once per process; the peak memory reported is the process's so far).
    """
    if not specs:
        return
    total, done, began = len(specs), 0, time.perf_counter()
    ctx = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=jobs, mp_context=ctx, max_tasks_per_child=1 if fresh else None) as pool:
        pending: dict[Future[dict[str, Any]], Spec] = {pool.submit(run_one, s): s for s in specs}
        while pending:
            finished, _ = wait(pending, return_when=FIRST_COMPLETED)
            for f in finished:
                spec = pending.pop(f)
                row = f.result()
                rows.append(row)
                save_rows(csv_path, rows)
                done += 1
                elapsed = time.perf_counter() - began
                ttt = harness.fmt_seconds(row["time_to_target_s"] if row["time_to_target_s"] is not None else math.inf)
                print(f"[{done}/{total}, {elapsed / 60:.0f} min, ~{elapsed / done * (total - done) / 60:.0f} min left] "
                      f"{spec.workload} {spec.peers} peers {spec.condition} {spec.system} seed {spec.seed}: {ttt} "
                      f"(wall {row['wall_s']} s, {row['peak_rss_mb']:.0f} MB)", flush=True)


# -- aggregation ---------------------------------------------------------------------------


def medians(rows: list[dict[str, Any]]) -> dict[tuple[str, int, str, str], tuple[float, int]]:
    """(workload, peers, condition, system) -> (median time to target over seeds, seeds); gossip-best folded in.

    A run that missed counts as infinitely slow; gossip-best is, per
    configuration, the best of the other algorithms' medians.
    """
    by: dict[tuple[str, int, str, str], list[float | None]] = {}
    for r in rows:
        by.setdefault((r["workload"], r["peers"], r["condition"], r["system"]), []).append(r["time_to_target_s"])
        if r["system"] == "gossip" and r.get("swarm_time_to_target_s") is not None:
            # The peers' averaged model (what the final consensus hands out), where the run recorded it.
            by.setdefault((r["workload"], r["peers"], r["condition"], "gossip-avg"), []).append(r["swarm_time_to_target_s"])
    out = {k: (harness.spread(v)[0], len(v)) for k, v in by.items()}
    for (w, p, c, s), value in list(out.items()):
        if s.startswith("gossip:"):
            best = out.get((w, p, c, "gossip-best"))
            if best is None or value[0] < best[0]:
                out[(w, p, c, "gossip-best")] = value
    return out


def ratio(m: dict[tuple[str, int, str, str], tuple[float, int]], workload: str, peers: int, condition: str,
          system: str = "ddp") -> float | None:
    """DDP's (or ``system``'s) time over the default gossip's; None where either is missing or both missed."""
    a, b = m.get((workload, peers, condition, system)), m.get((workload, peers, condition, "gossip"))
    if a is None or b is None or (math.isinf(a[0]) and math.isinf(b[0])):
        return None
    return a[0] / b[0] if b[0] > 0 else None


def summary_lines(rows: list[dict[str, Any]], m: dict[tuple[str, int, str, str], tuple[float, int]]) -> list[str]:
    lines = [
        "# Gossip against DDP and a parameter server, 16 to 1,024 simulated machines",
        "",
        "Regenerate: `python experiments/scale.py` (`--resume` continues a sweep). Each machine is simulated on its "
        f"own (`gossiptrain.sim`), steps of {STEP_TIME * 1000:.0f} ms; base: 1 Gbit/s, 1 ms links, iid shards. Time to "
        f"the held target (mean test accuracy {TARGETS}) in virtual seconds, medians of the seeds "
        "(n = seeds); DDP / gossip above 1: gossip is faster. gossip: the mean of the peers' own models' "
        "accuracies (the stop condition); gossip-avg: the peers' averaged model, what the final consensus "
        "hands out (where a run recorded it).",
        "",
    ]
    systems = ["gossip", "gossip-avg", "gossip-best", "ddp", "ddp-hd", "ps-sync", "ps-async"]
    for workload in sorted({r["workload"] for r in rows}):
        lines += [f"## {workload}", ""]
        table = []
        for peers in sorted({r["peers"] for r in rows if r["workload"] == workload}):
            for condition in CONDITIONS:
                cells = [m.get((workload, peers, condition, s)) for s in systems]
                if not any(cells):
                    continue
                shown = [("" if c is None else f"{harness.fmt(c[0])} (n={c[1]})") for c in cells]
                r_ring = ratio(m, workload, peers, condition)
                r_hd = ratio(m, workload, peers, condition, "ddp-hd")
                table.append([peers, condition, *shown, harness.fmt(r_ring) if r_ring is not None else "",
                              harness.fmt(r_hd) if r_hd is not None else ""])
        lines += harness.markdown_table(
            ["peers", "condition", *systems, "DDP / gossip", "DDP-hd / gossip"], table)
        lines.append("")
    largest = largest_run(rows)
    if largest:
        lines.append(f"Largest run: {largest['peers']} peers ({largest['workload']}, {largest['system']}, "
                     f"{largest['condition']}): {largest['wall_s']:.0f} s wall, {largest['peak_rss_mb']:.0f} MB peak RSS.")
    return lines


def largest_run(rows: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The gossip run with the most peers (the slowest of them): what the simulator's scale costs."""
    gossip = [r for r in rows if r["system"] == "gossip"]
    return max(gossip, key=lambda r: (r["peers"], r["wall_s"]), default=None)


def plot(out: Path, rows: list[dict[str, Any]], m: dict[tuple[str, int, str, str], tuple[float, int]]) -> None:
    plt = harness.pyplot()
    for workload in sorted({r["workload"] for r in rows}):
        conditions = [c for c in CONDITIONS if any(k[0] == workload and k[2] == c for k in m)]
        cols = min(4, len(conditions))
        rows_n = math.ceil(len(conditions) / cols)
        fig, axes = plt.subplots(rows_n, cols, figsize=(4 * cols, 3.2 * rows_n), squeeze=False, sharey=True)
        for ax, condition in zip(axes.flat, conditions):
            for system in SYSTEMS:
                points = sorted((k[1], v[0]) for k, v in m.items()
                                if k[0] == workload and k[2] == condition and k[3] == system and math.isfinite(v[0]))
                if points:
                    ax.plot(*zip(*points), marker="o", label=system)
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_title(condition)
            ax.set_xlabel("peers")
        for ax in axes.flat[len(conditions):]:
            ax.set_visible(False)
        axes[0][0].set_ylabel("time to target (virtual s)")
        axes[0][0].legend(fontsize=7)
        fig.suptitle(f"{workload}: time to mean test accuracy {TARGETS[workload]} (medians of seeds)")
        fig.tight_layout()
        fig.savefig(out / f"scale_{workload}.png", dpi=110)
        plt.close(fig)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workloads", nargs="+", default=list(SIZES), choices=list(SIZES))
    ap.add_argument("--sizes", nargs="+", type=int, default=None, help="peer counts (default: each workload's own)")
    ap.add_argument("--conditions", nargs="+", default=list(CONDITIONS), choices=list(CONDITIONS))
    ap.add_argument("--systems", nargs="+", default=list(SYSTEMS), choices=list(SYSTEMS))
    ap.add_argument("--others-up-to", type=int, default=64, help="gossip-best runs only up to this many peers (default 64)")
    ap.add_argument("--others", nargs="+", default=list(OTHER_ALGORITHMS), choices=list(OTHER_ALGORITHMS),
                    help="gossip-best's candidates to run (default all; with --resume --refresh: refresh only these)")
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--jobs", type=int, default=2, help="runs at once, each in its own process (default 2)")
    ap.add_argument("--gossip-duration", type=float, default=GOSSIP_DURATION)
    ap.add_argument("--sync-duration", type=float, default=SYNC_DURATION)
    ap.add_argument("--resume", action="store_true", help="keep runs.csv and skip the runs it already holds")
    ap.add_argument("--refresh", action="store_true",
                    help="with --resume: run the selected runs again, replacing their rows in runs.csv")
    ap.add_argument("--quick", action="store_true", help="16 peers, logreg, none and straggler, 1 seed (smoke test)")
    ap.add_argument("--out", type=Path, default=None, help="output folder (default experiments/results/scale)")
    args = ap.parse_args()
    if args.quick:
        args.workloads, args.sizes, args.conditions, args.seeds = ["logreg"], [16], ["none", "straggler"], 1
        args.systems = ["gossip", "ddp", "ps-sync", "ps-async"]
        args.gossip_duration, args.sync_duration = 20.0, 200.0
    out = harness.results_dir("scale", args.out, args.quick)
    out.mkdir(parents=True, exist_ok=True)
    csv_path = out / "runs.csv"
    if not args.resume and csv_path.exists():
        csv_path.unlink()
    selected = grid(args)
    rows = read_rows(csv_path)
    if args.refresh:
        again = {s.key() for s in selected}
        rows = [r for r in rows if key_of(r) not in again]
    have = {key_of(r) for r in rows}
    specs = [s for s in selected if s.key() not in have]
    print(f"{len(specs)} runs to go ({len(have)} already in {csv_path})", flush=True)
    run_grid(specs, csv_path, rows, args.jobs, fresh=not args.quick)
    rows = read_rows(csv_path) if csv_path.exists() else rows
    m = medians(rows)
    plot(out, rows, m)
    largest = largest_run(rows)
    head = {
        "ddp_over_gossip_64_straggler": harness.finite_or_none(ratio(m, "digits-small", 64, "straggler")),
        "ddp_over_gossip_64_lognormal": harness.finite_or_none(ratio(m, "digits-small", 64, "lognormal")),
        "ddp_over_gossip_256_100mbit": harness.finite_or_none(ratio(m, "digits-small", 256, "100mbit")),
        "largest_run": None if largest is None else {
            k: largest[k] for k in ("peers", "workload", "condition", "wall_s", "peak_rss_mb")},
        "runs": len(rows),
    }
    if args.quick:  # the quick grid has neither digits-small nor 64 peers: its own ratios
        head["ddp_over_gossip_16_straggler_logreg"] = harness.finite_or_none(ratio(m, "logreg", 16, "straggler"))
    return harness.publish(out, summary_lines(rows, m), head)


if __name__ == "__main__":
    raise SystemExit(main())
