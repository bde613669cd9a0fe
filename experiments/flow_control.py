"""Flow control: how many local steps a pairwise peer may take past its last merge, on a slow and a fast link.

4 simulated peers (`gossiptrain.sim`) train digits (the 301k-parameter MLP,
batch 32, SGD) with pairwise averaging on label-skewed shards
(`classes-per-peer`, 3 classes each), a local step costing `--step-time`
virtual seconds (2 ms: about this machine's digits step). Each peer's links
carry `--slow` bytes/s (12.5e6: 100 Mbit/s, where one model takes about 0.1 s
each way, some 50 steps) or `--fast` (1.25e9: 10 Gbit/s, where a round trip
takes under a step). For each bound `gossip.max_steps_ahead` in `--bounds`
(a very large one: no flow control, as before) and each seed, a run lasts
`--horizon` virtual seconds or until the mean test accuracy holds the target
for 2 samples (sampled every 0.5 s).

Output in experiments/results/flow_control/ (`--quick`: a scratch folder):
runs.csv (one row per run) and summary.md (medians per link and bound). The
last line printed is a JSON object: {"slow": {bound: {"time_to_target_s",
"final_acc", "steps", "waited_s"}}, "fast": {...}, "target", "seeds",
"horizon_s"}; a time to target of null means not reached in the horizon.

    python experiments/flow_control.py           # bounds 4 8 16 32 and none, slow and fast link, 3 seeds
    python experiments/flow_control.py --quick   # 2 bounds, 1 seed, short horizon (smoke test)
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
from gossiptrain.config import RunConfig  # noqa: E402
from gossiptrain.net.transport.sim import LinkProfile  # noqa: E402
from gossiptrain.sim.cluster import SimConfig, simulate  # noqa: E402

NONE = 10**9  # a bound never reached: no flow control


def one_run(bound: int, seed: int, bandwidth: float, args: argparse.Namespace) -> dict[str, Any]:
    run = RunConfig().with_overrides({
        "train.workload": "digits", "train.shards": args.peers, "train.partition": "classes-per-peer",
        "train.partition_classes": 3, "train.max_steps": 0, "train.max_seconds": 0, "train.eval_every_seconds": 0.5,
        "train.seed": seed, "gossip.max_steps_ahead": bound,
    })
    config = SimConfig(
        peers=args.peers, run=run, duration=args.horizon, seed=seed, step_time=args.step_time,
        link=LinkProfile(latency=0.0005, bandwidth=bandwidth), sample_every=0.5,
        target_accuracy=args.target, target_hold=2,
    )
    started = time.perf_counter()
    result = simulate(config)
    last = max(r["time"] for r in result.rows)
    final = [r for r in result.rows if r["time"] == last]
    return {
        "bound": "none" if bound == NONE else bound, "seed": seed, "bandwidth": bandwidth,
        "time_to_target_s": result.summary.get("time_to_target"),
        "final_acc": round(statistics.mean(r.get("test_acc", 0.0) for r in final), 4),
        "steps": round(statistics.mean(r.get("step", 0) for r in final), 1),
        "waited_s": round(statistics.mean(r.get("waited_s", 0.0) for r in final), 3),
        "virtual_s": last, "wall_s": round(time.perf_counter() - started, 1),
    }


def median_or_none(values: list[float | None]) -> float | None:
    """The median, counting a run that never reached the target as slower than every run that did."""
    if sum(v is None for v in values) * 2 >= len(values):
        return None
    return statistics.median([float("inf") if v is None else v for v in values])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bounds", type=int, nargs="+", default=[4, 8, 16, 32, NONE])
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--peers", type=int, default=4)
    ap.add_argument("--horizon", type=float, default=40.0, help="virtual seconds per run (default 40)")
    ap.add_argument("--step-time", type=float, default=0.002, help="virtual seconds per local step (default 0.002)")
    ap.add_argument("--slow", type=float, default=12.5e6, help="slow link, bytes/s (default 12.5e6: 100 Mbit/s)")
    ap.add_argument("--fast", type=float, default=1.25e9, help="fast link, bytes/s (default 1.25e9: 10 Gbit/s)")
    ap.add_argument("--target", type=float, default=0.95, help="mean test accuracy to hold (default 0.95)")
    ap.add_argument("--quick", action="store_true", help="2 bounds, 1 seed, 4 virtual s (smoke test)")
    ap.add_argument("--out", type=Path, default=None, help="output folder (default experiments/results/flow_control)")
    args = ap.parse_args()
    if args.quick:
        args.bounds, args.seeds, args.horizon = [8, NONE], 1, 4.0
    out = harness.results_dir("flow_control", args.out, args.quick)
    runs: list[dict[str, Any]] = []
    for link, bandwidth in (("slow", args.slow), ("fast", args.fast)):
        for bound in args.bounds:
            for seed in range(args.seeds):
                row = {"link": link, **one_run(bound, seed, bandwidth, args)}
                runs.append(row)
                print(json.dumps(row), flush=True)
    with open(out / "runs.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(runs[0]))
        writer.writeheader()
        writer.writerows(runs)
    summary: dict[str, Any] = {"target": args.target, "seeds": args.seeds, "horizon_s": args.horizon}
    lines = [
        f"# Flow control: {args.peers} peers, digits, 3 classes per shard, medians of {args.seeds} seeds",
        "",
        "Regenerate: `python experiments/flow_control.py` (step 2 ms virtual, slow link 100 Mbit/s, fast 10 Gbit/s,"
        f" {args.horizon:.0f} virtual s per run, target: mean test accuracy {args.target} held for 2 samples).",
        "",
        "| link | max_steps_ahead | time to target (virtual s) | final accuracy | steps per peer | waited per peer (s) |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for link in ("slow", "fast"):
        summary[link] = {}
        for bound in args.bounds:
            name = "none" if bound == NONE else bound
            mine = [r for r in runs if r["link"] == link and r["bound"] == name]
            cell = {
                "time_to_target_s": median_or_none([r["time_to_target_s"] for r in mine]),
                "final_acc": statistics.median(r["final_acc"] for r in mine),
                "steps": statistics.median(r["steps"] for r in mine),
                "waited_s": statistics.median(r["waited_s"] for r in mine),
            }
            summary[link][str(name)] = cell
            shown = "not reached" if cell["time_to_target_s"] is None else f"{cell['time_to_target_s']:.1f}"
            lines.append(f"| {link} | {name} | {shown} | {cell['final_acc']:.3f} | {cell['steps']:.0f} | {cell['waited_s']:.2f} |")
    return harness.publish(out, lines, summary)


if __name__ == "__main__":
    raise SystemExit(main())
