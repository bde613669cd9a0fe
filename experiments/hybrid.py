"""Peers made of several workers against single-worker peers, at the same number of samples.

    python experiments/hybrid.py                 # 3 seeds, digits, results in experiments/results/hybrid/
    python experiments/hybrid.py --quick         # 1 seed, fewer steps (smoke test)

Two questions of issue 19, each answered on real processes on 127.0.0.1
(`gossiptrain peer --nproc-per-peer`, gloo inside a peer, gossip between):

1. Per sample, is a peer of 2 workers (DDP) as good as a peer of 1? One
   peer of 1 worker trains S steps of batch B; one peer of 2 workers trains
   S/2 steps, each worker a batch of B: the same S x B samples. Compared:
   final test accuracy (target: within 0.5 points).
2. Do 2 peers of 2 workers converge as 4 peers of 1 do? Both swarms train
   the same total samples per step (4 x B) for the same number of steps,
   on 4 processes: compared, the swarm's final mean accuracy and its time to
   the held target.

Medians over seeds; a CSV and summary.md in the results folder; the last
line is JSON.
"""

from __future__ import annotations

import argparse
import csv
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from experiments import harness  # noqa: E402
from gossiptrain.train.metrics import read_metrics  # noqa: E402

SETUPS = {  # name -> (peers, workers per peer, steps as a fraction of the single worker's S)
    "1 peer x 1 worker": (1, 1, 1.0),
    "1 peer x 2 workers": (1, 2, 0.5),
    "4 peers x 1 worker": (4, 1, 0.25),
    "2 peers x 2 workers": (2, 2, 0.25),
}


def run(name: str, seed: int, steps: int, target: float, workdir: Path, timeout: float) -> dict[str, Any]:
    """One setup to its step budget; its final mean accuracy, time to the held target and samples."""
    peers, workers, fraction = SETUPS[name]
    budget = max(1, round(steps * fraction))
    harness.fresh_dir(workdir)
    overrides = {**harness.run_overrides(peers, seed, max_steps=budget), "train.max_seconds": 0}
    batch = int(harness.run_config(peers, seed).train.batch_size)
    with harness.Procs(workdir) as procs:
        join = harness.start_coordinator(procs, overrides)
        for i in range(peers):
            procs.start(f"peer-{i}", harness.python_m(
                "gossiptrain", "peer", "--join", join, "--quiet", "--threads", 1, "--shard", i, "--wait-for", peers,
                "--nproc-per-peer", workers, "--metrics", workdir / f"peer-{i}.jsonl",
            ))
        deadline = time.monotonic() + timeout
        while not all(p.poll() is not None for n, p in procs.procs if n.startswith("peer-")):
            problem = procs.failed()
            if problem:
                raise RuntimeError(problem)
            if time.monotonic() > deadline:
                raise RuntimeError(f"{name}, seed {seed}: not done in {timeout} s")
            time.sleep(harness.POLL)
        problem = procs.failed()
        if problem:
            raise RuntimeError(problem)
    per_peer = [read_metrics(workdir / f"peer-{i}.jsonl") for i in range(peers)]
    done = [next(r for r in reversed(recs) if r.get("event") == "done") for recs in per_peer]
    points, _ = harness.gossip_series(per_peer, batch * workers)
    return {
        "setup": name, "seed": seed, "peers": peers, "workers": workers, "steps": budget,
        "samples": sum(r["step"] for r in done) * batch * workers,
        "final_acc": round(statistics.mean(r["test_acc"] for r in done), 4),
        "time_to_target": harness.time_to_target(points, target),
        "exchanges_per_peer": statistics.mean(r.get("exchanges", 0) for r in done),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=1200, help="S: the single worker's steps (default 1200)")
    parser.add_argument("--target", type=float, default=0.95, help="held mean accuracy for the time to target")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per run")
    parser.add_argument("--quick", action="store_true", help="1 seed, S = 200")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    seeds, steps = (1, 200) if args.quick else (args.seeds, args.steps)
    out = harness.results_dir("hybrid", args.out, args.quick)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for seed in range(seeds):
        for name in SETUPS:
            row = run(name, seed, steps, args.target, out / "runs" / f"{name.replace(' ', '')}-{seed}", args.timeout)
            print(json.dumps(row), flush=True)
            rows.append(row)
    with open(out / "hybrid.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)

    def median(name: str, field: str) -> float | None:
        values = [r[field] for r in rows if r["setup"] == name and r[field] is not None]
        return statistics.median(values) if values else None

    lines = ["| setup | steps | samples | final mean accuracy (median) | time to target, s (median) |", "| --- | --- | --- | --- | --- |"]
    for name in SETUPS:
        ttt = median(name, "time_to_target")
        lines.append(f"| {name} | {median(name, 'steps'):g} | {median(name, 'samples'):g} | {median(name, 'final_acc'):.4f} | "
                     f"{'never' if ttt is None else f'{ttt:.2f}'} |")
    acc = {name: median(name, "final_acc") or 0.0 for name in SETUPS}
    ttt = {name: median(name, "time_to_target") for name in SETUPS}
    verdict = {
        "two_workers_minus_one_points": round(100 * (acc["1 peer x 2 workers"] - acc["1 peer x 1 worker"]), 2),
        "two_by_two_minus_four_by_one_points": round(100 * (acc["2 peers x 2 workers"] - acc["4 peers x 1 worker"]), 2),
        "two_by_two_over_four_by_one_time": (
            round(ttt["2 peers x 2 workers"] / ttt["4 peers x 1 worker"], 3)
            if ttt["2 peers x 2 workers"] and ttt["4 peers x 1 worker"] else None
        ),
        "seeds": seeds, "steps": steps,
    }
    (out / "summary.md").write_text(
        f"# Peers of several workers against single-worker peers (digits, S = {steps}, {seeds} seeds)\n\n"
        "Command: `python experiments/hybrid.py" + (" --quick" if args.quick else "") + "`\n\n" + "\n".join(lines)
        + "\n\n```json\n" + json.dumps(verdict) + "\n```\n"
    )
    print("\n".join(lines))
    print(json.dumps(verdict))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
