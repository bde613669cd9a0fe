"""Label skew at 16 peers: the default's final accuracy with Dirichlet shards (alpha 0.01) against iid shards.

16 simulated peers (`gossiptrain.sim`) train digits-small with the defaults
(pairwise, drift correction, auto compression, flow control), once on
iid shards and once on `--partition dirichlet --partition-alpha 0.01` (about
one class per peer), same seeds, same virtual time. Two settings:

- `relaxed`: the simulator's default link (1 GB/s, 0.5 ms) and steps of
  50 ms, 60 virtual s: the link is never the limit;
- `slow`: 100 Mbit/s links and steps of 2 ms (about this machine's step),
  4 virtual s: some 40 steps per round trip.

The issue's target: the Dirichlet run's final mean test accuracy within 2
points of the iid run's (medians of the seeds).

Output in experiments/results/dirichlet/ (`--quick`: a scratch folder):
runs.csv and summary.md. The last line printed is a JSON object:
{setting: {"iid", "dirichlet", "gap_points"}, "seeds"}.

    python experiments/dirichlet.py           # both settings, 3 seeds (about 5 minutes on 2 cores)
    python experiments/dirichlet.py --quick   # the slow setting, 1 seed, 2 virtual s (smoke test)
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from experiments import harness  # noqa: E402
from gossiptrain.config import RunConfig  # noqa: E402
from gossiptrain.net.transport.sim import LinkProfile  # noqa: E402
from gossiptrain.sim.cluster import SimConfig, simulate  # noqa: E402

PEERS = 16
ALPHA = 0.01
#: setting -> (link, step time in virtual s, duration in virtual s)
SETTINGS: dict[str, tuple[LinkProfile, float, float]] = {
    "relaxed": (LinkProfile(), 0.05, 60.0),
    "slow": (LinkProfile(latency=0.0005, bandwidth=12.5e6), 0.002, 4.0),
}


def one_run(setting: str, partition: str, seed: int, duration: float) -> dict[str, Any]:
    link, step_time, _ = SETTINGS[setting]
    run = RunConfig().with_overrides({
        "train.workload": "digits-small", "train.shards": PEERS, "train.partition": partition,
        "train.partition_alpha": ALPHA, "train.max_steps": 0, "train.max_seconds": 0, "train.seed": seed,
    })
    started = time.perf_counter()
    result = simulate(SimConfig(peers=PEERS, run=run, duration=duration, seed=seed, step_time=step_time, link=link))
    return {
        "setting": setting, "partition": partition, "seed": seed, "virtual_s": duration,
        "final_acc": round(result.summary["mean_test_acc"], 4),
        "consensus_distance": round(result.summary["consensus_distance"], 4),
        "steps_per_peer": round(result.summary["mean_step"], 1),
        "exchanges_per_peer": round(result.summary["exchanges_per_peer"], 1),
        "wall_s": round(time.perf_counter() - started, 1),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--settings", nargs="+", default=list(SETTINGS), choices=list(SETTINGS))
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="the slow setting, 1 seed, 2 virtual s (smoke test)")
    ap.add_argument("--out", type=Path, default=None, help="output folder (default experiments/results/dirichlet)")
    args = ap.parse_args()
    if args.quick:
        args.settings, args.seeds = ["slow"], 1
    out = harness.results_dir("dirichlet", args.out, args.quick)
    rows: list[dict[str, Any]] = []
    for setting in args.settings:
        duration = 2.0 if args.quick else SETTINGS[setting][2]
        for seed in range(args.seeds):
            for partition in ("iid", "dirichlet"):
                rows.append(one_run(setting, partition, seed, duration))
                print(json.dumps(rows[-1]), flush=True)
    harness.write_csv(out / "runs.csv", rows)
    summary: dict[str, Any] = {"seeds": args.seeds}
    lines = [
        f"# Label skew at {PEERS} peers: Dirichlet alpha {ALPHA} against iid, digits-small, defaults, medians of {args.seeds} seeds",
        "",
        "Regenerate: `python experiments/dirichlet.py`. relaxed: 1 GB/s links, 50 ms steps, 60 virtual s;"
        " slow: 100 Mbit/s links, 2 ms steps, 4 virtual s. Target: the gap at most 2 points.",
        "",
        "| setting | iid (per seed) | dirichlet (per seed) | gap (points, medians) |",
        "| --- | --- | --- | --- |",
    ]
    for setting in args.settings:
        acc = {p: [r["final_acc"] for r in rows if r["setting"] == setting and r["partition"] == p] for p in ("iid", "dirichlet")}
        med = {p: statistics.median(v) for p, v in acc.items()}
        gap = round(100 * (med["iid"] - med["dirichlet"]), 1)
        summary[setting] = {**med, "gap_points": gap}
        shown = {p: ", ".join(f"{a:.3f}" for a in v) for p, v in acc.items()}
        lines.append(f"| {setting} | {shown['iid']} | {shown['dirichlet']} | {gap} |")
    return harness.publish(out, lines, summary)


if __name__ == "__main__":
    raise SystemExit(main())
