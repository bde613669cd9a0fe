"""Staleness: how received updates are weighted by age and dropped beyond a bound, with and without a straggler.

8 simulated peers (`gossiptrain.sim`, the experiments' harness) train digits
(the ~1.13M-parameter MLP, peer i on shard i) with pairwise averaging on the
exponential graph, for each combination of

- weighting: `constant` (weight 1), `polynomial` with exponent 0.5 and 1
  (weight 1 / (1 + s)^exponent for an update s steps stale);
- bound: none, 2, 8 (updates more than that many steps stale are refused);
- straggler: none, or peer 0 4x slower (speeds 4, 1, ..., 1: the
  simulator's `--stragglers 0.125:4`).

Staleness is the step difference between the two ends of an exchange
(gossiptrain.protocol.staleness); pairwise uses one weight for both ends. Each run
lasts `--horizon` virtual seconds (a local step: 6 ms at speed 1, links of
0.5 ms and 1 GB/s, one core per peer), sampled every 0.05 s. Reported per
setting, medians over `--seeds` seeds: time to the target (mean test
accuracy held for 3 samples), final accuracy (mean over the peers, the last
3 samples), the slowest peer's final accuracy, mean staleness of the
applied updates and the updates refused as too stale.

Output in experiments/results/staleness/: results.csv (one row per setting
and straggler case), runs.csv (one per run), summary.md, staleness.png
(time to target and final accuracy per setting). The last line printed is a
JSON object:

- best_setting: the setting with the shortest median time to the target with
  the straggler (ties: higher final accuracy), as "WEIGHTING/BOUND", e.g.
  "polynomial:0.5/none"; best_time_to_target_s its time;
- baseline_time_to_target_s: constant weighting without a bound (the
  default), with the straggler; speedup_over_baseline: baseline / best;
- time_to_target_s, final_acc: {"straggler": {setting: value}, "none": {...}}
  (null: not reached within the horizon);
- target, seeds, horizon_s, peers, slowdown.

    python experiments/staleness.py            # 8 peers, 9 settings x {no straggler, one 4x}, 1.5 virtual s, 3 seeds
    python experiments/staleness.py --quick    # 4 peers, 2 settings x 2 cases, one short seed (smoke test)
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from experiments import harness  # noqa: E402
from experiments.harness import SimRun, fmt  # noqa: E402

WEIGHTINGS = ("constant", "polynomial:0.5", "polynomial:1")
BOUNDS = (0, 2, 8)
BASELINE = "constant/none"


def label(weighting: str, bound: int) -> str:
    return f"{weighting}/{bound or 'none'}"


def overrides(weighting: str, bound: int, args: argparse.Namespace) -> dict[str, Any]:
    kind, _, exponent = weighting.partition(":")
    out: dict[str, Any] = {
        "gossip.topology": args.topology, "gossip.algorithm": args.algorithm,
        "gossip.staleness_weighting": kind, "gossip.staleness_bound": bound,
    }
    if exponent:
        out["gossip.staleness_exponent"] = float(exponent)
    return out


def speeds(case: str, args: argparse.Namespace) -> tuple[float, ...]:
    """Per-peer slowdowns: peer 0 is the straggler (as SimConfig's stragglers=1/peers)."""
    return tuple([args.slowdown if case == "straggler" and i == 0 else 1.0 for i in range(args.peers)])


def sweep(args: argparse.Namespace) -> dict[tuple[str, str], list[SimRun]]:
    """Every (case, setting) over the seeds; one progress line per configuration."""
    runs: dict[tuple[str, str], list[SimRun]] = {}
    for case in args.cases:
        for weighting in args.weightings:
            for bound in args.bounds:
                name = label(weighting, bound)
                group = [
                    harness.run_sim(name, args.peers, seed, overrides(weighting, bound, args), args.target, args.horizon,
                                    speeds=speeds(case, args))
                    for seed in range(args.seeds)
                ]
                runs[(case, name)] = group
                med = harness.sim_medians(group)
                print(
                    f"{case:>9} {name:>20}: time to {args.target} {harness.fmt_seconds(med['time_to_target_s'])}, final acc "
                    f"{med['final_acc']:.3f} (slowest peer {statistics.median(r.final_min_acc for r in group):.3f}), "
                    f"staleness {statistics.median(r.extra['staleness_mean'] for r in group):.2f}, refused "
                    f"{statistics.median(r.extra['stale_dropped'] for r in group):.0f} "
                    f"({med['reached']}/{len(group)} seeds reached; wall {sum(r.wall_seconds for r in group):.0f} s)",
                    flush=True,
                )
    return runs


def tables(runs: dict[tuple[str, str], list[SimRun]], args: argparse.Namespace) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    rows, per_run = [], []
    for (case, name), group in runs.items():
        med = harness.sim_medians(group)
        weighting, _, bound = name.partition("/")
        rows.append({
            "straggler": case, "setting": name, "weighting": weighting, "bound": bound, "peers": args.peers, "seeds": len(group),
            "target": args.target, "time_to_target_s": harness.finite_or_none(med["time_to_target_s"]),
            "final_acc": round(med["final_acc"], 4),
            "slowest_peer_acc": round(statistics.median(r.final_min_acc for r in group), 4),
            "staleness_mean": round(statistics.median(r.extra["staleness_mean"] for r in group), 3),
            "refused_stale": statistics.median(r.extra["stale_dropped"] for r in group),
            "exchanges_per_peer": round(statistics.median(r.extra["exchanges_per_peer"] or 0 for r in group), 1),
            "wall_s": round(sum(r.wall_seconds for r in group), 1),
        })
        per_run += [{
            "straggler": case, "setting": name, "seed": r.seed, "time_to_target_s": r.time_to_target,
            "final_acc": round(r.final_acc, 4), "slowest_peer_acc": round(r.final_min_acc, 4),
            "staleness_mean": round(r.extra["staleness_mean"], 3), "refused_stale": r.extra["stale_dropped"],
            "wall_s": round(r.wall_seconds, 1),
        } for r in group]
    return rows, per_run


def headline(rows: list[dict[str, Any]], args: argparse.Namespace) -> dict[str, Any]:
    case = "straggler" if "straggler" in args.cases else args.cases[0]
    mine = [r for r in rows if r["straggler"] == case]
    reached = [r for r in mine if r["time_to_target_s"] is not None]
    top = min(reached, key=lambda r: (r["time_to_target_s"], -r["final_acc"])) if reached else None
    base = next((r["time_to_target_s"] for r in mine if r["setting"] == BASELINE), None)
    return {
        "best_setting": top["setting"] if top else None,
        "best_time_to_target_s": top["time_to_target_s"] if top else None,
        "baseline_time_to_target_s": base,
        "speedup_over_baseline": round(base / top["time_to_target_s"], 3) if top and base else None,
        "time_to_target_s": {c: {r["setting"]: r["time_to_target_s"] for r in rows if r["straggler"] == c} for c in args.cases},
        "final_acc": {c: {r["setting"]: r["final_acc"] for r in rows if r["straggler"] == c} for c in args.cases},
        "target": args.target,
        "seeds": args.seeds,
        "horizon_s": args.horizon,
        "peers": args.peers,
        "slowdown": args.slowdown,
    }


def span(values: list[float], spec: str) -> str:
    """ "0.89-0.90", or one number when they are all equal."""
    lo, hi = format(min(values, default=0.0), spec), format(max(values, default=0.0), spec)
    return lo if lo == hi else f"{lo}-{hi}"


def findings(rows: list[dict[str, Any]], args: argparse.Namespace) -> list[str]:
    """One sentence per straggler case on what the bounds did, from the table's numbers."""
    out = []
    for case in args.cases:
        mine = [r for r in rows if r["straggler"] == case]
        name = "Without a straggler" if case == "none" else f"With peer 0 {args.slowdown:g}x slower"
        bounded = [r for r in mine if r["bound"] != "none"]
        free = [r for r in mine if r["bound"] == "none"]
        stale = span([r["staleness_mean"] for r in free], ".2f")
        if not bounded:
            out.append(f"{name}, applied updates were {stale} steps stale on average (no bound was tried).")
            continue
        if not any(r["refused_stale"] for r in bounded):
            out.append(f"{name}, no update was refused in any setting (applied updates were {stale} steps stale on average "
                       f"without a bound), so the bounds changed nothing.")
            continue
        out.append(
            f"{name}, applied updates were {stale} steps stale on average without a bound; the bounds refused "
            f"{span([r['refused_stale'] for r in bounded], '.0f')} updates (all peers together), which cut the slow peer off: "
            f"the slowest peer ended at {span([r['slowest_peer_acc'] for r in bounded], '.3f')} with a bound, "
            f"{span([r['slowest_peer_acc'] for r in free], '.3f')} without."
        )
    return out


def write_summary(out: Path, rows: list[dict[str, Any]], heads: dict[str, Any], args: argparse.Namespace, wall: float) -> None:
    header = ["straggler", "weighting / bound", f"time to {args.target} (s)", "final acc", "slowest peer's final acc",
              "mean staleness (steps)", "updates refused as stale", "exchanges per peer"]
    table = [
        [r["straggler"], r["setting"], "not reached" if r["time_to_target_s"] is None else f"{r['time_to_target_s']:.2f}",
         f"{r['final_acc']:.3f}", f"{r['slowest_peer_acc']:.3f}", r["staleness_mean"], f"{r['refused_stale']:.0f}",
         r["exchanges_per_peer"]]
        for r in rows
    ]
    lines = [
        "# Staleness: weighting and bound, with and without a straggler",
        "",
        f"{args.peers} simulated peers, digits (MLP, 1.13M parameters, iid shards), `{args.algorithm}` averaging on the "
        f"`{args.topology}` graph; straggler: peer 0 {args.slowdown:g}x slower. Every peer on its own core, a local step "
        f"{harness.SIM_STEP_TIME * 1e3:g} ms of virtual time, links 0.5 ms / 1 GB/s, {args.horizon:g} virtual s per run, "
        f"sampled every {harness.SIM_SAMPLE_EVERY:g} s; target: mean test accuracy {args.target} held for {harness.HOLD} "
        f"samples; final acc: mean over the peers of the last {harness.HOLD} samples; medians of {args.seeds} seed(s); "
        f"updates refused: summed over the peers. Weighting `polynomial:E`: an update s steps stale counts "
        f"1/(1+s)^E; bound B: refused when s > B (none: never).",
        "",
        *harness.markdown_table(header, table),
        "",
        *[f"- {f}" for f in findings(rows, args)],
        "",
        f"Best with the straggler: **{heads['best_setting']}** ({fmt(heads['best_time_to_target_s'] or math.inf)} s to "
        f"{args.target}; the default `{BASELINE}`: {fmt(heads['baseline_time_to_target_s'] or math.inf)} s).",
        "",
        f"Wall time of this run: {wall:.0f} s. Regenerate: `python experiments/staleness.py{' --quick' if args.quick else ''}`",
        "",
        "![staleness settings](staleness.png)",
    ]
    (out / "summary.md").write_text("\n".join(lines) + "\n")


def plot(out: Path, rows: list[dict[str, Any]], args: argparse.Namespace) -> None:
    plt = harness.pyplot()
    settings = list(dict.fromkeys(r["setting"] for r in rows))
    fig, axes = plt.subplots(2, 1, figsize=(max(6, 0.9 * len(settings) + 2), 6), sharex=True)
    width = 0.8 / len(args.cases)
    colors = {"none": "tab:grey", "straggler": "tab:purple"}
    for j, case in enumerate(args.cases):
        mine = {r["setting"]: r for r in rows if r["straggler"] == case}
        xs = [i + j * width for i in range(len(settings))]
        times = [mine[s]["time_to_target_s"] if mine.get(s) and mine[s]["time_to_target_s"] is not None else 0 for s in settings]
        name = "no straggler" if case == "none" else f"peer 0 {args.slowdown:g}x slower"
        axes[0].bar(xs, times, width, color=colors.get(case), label=name)
        for x, t in zip(xs, times):
            if not t:
                axes[0].text(x, 0, "not reached", rotation=90, ha="center", va="bottom", fontsize=7, color="tab:red")
        axes[1].bar(xs, [mine[s]["final_acc"] if s in mine else 0 for s in settings], width, color=colors.get(case), label=name)
    axes[0].set_ylabel(f"virtual s to {args.target}")
    axes[1].set_ylabel(f"final mean test acc\n(after {args.horizon:g} s)")
    finals = [r["final_acc"] for r in rows]
    axes[1].set_ylim(max(0.0, min(finals) - 0.02), min(1.0, max(finals) + 0.01))
    axes[1].set_xticks([i + width * (len(args.cases) - 1) / 2 for i in range(len(settings))], settings, rotation=30, ha="right")
    axes[0].legend(fontsize=8)
    axes[0].set_title(f"{args.peers} peers, {args.algorithm}, {args.topology} (simulated, median of {args.seeds} seed(s))")
    fig.tight_layout()
    fig.savefig(out / "staleness.png", dpi=80)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--peers", type=int, default=8)
    parser.add_argument("--topology", default="exponential")
    parser.add_argument("--algorithm", default="pairwise")
    parser.add_argument("--weightings", nargs="+", default=list(WEIGHTINGS), help="constant or polynomial:EXPONENT")
    parser.add_argument("--bounds", type=int, nargs="+", default=list(BOUNDS), help="staleness bounds (0: none)")
    parser.add_argument("--cases", nargs="+", default=["none", "straggler"], choices=["none", "straggler"])
    parser.add_argument("--slowdown", type=float, default=4.0, help="the straggler's slowdown")
    parser.add_argument("--target", type=float, default=0.95, help="mean test accuracy to reach (held for 3 samples)")
    parser.add_argument("--horizon", type=float, default=1.5, help="virtual seconds per run")
    parser.add_argument("--seeds", type=int, default=3, help="runs per configuration; medians are reported (a miss counts as slowest)")
    parser.add_argument("--quick", action="store_true", help="4 peers, constant and polynomial:1 without a bound, 0.25 s, target 0.7")
    parser.add_argument("--out", type=Path, help="results folder (default: experiments/results/staleness; --quick: a scratch folder)")
    args = parser.parse_args()
    args.out = harness.results_dir("staleness", args.out, args.quick)
    if args.quick:
        args.peers, args.weightings, args.bounds, args.target, args.seeds, args.horizon = 4, ["constant", "polynomial:1"], [0], 0.7, 1, 0.25
    args.out.mkdir(parents=True, exist_ok=True)
    began = time.monotonic()
    runs = sweep(args)
    rows, per_run = tables(runs, args)
    heads = headline(rows, args)
    harness.write_csv(args.out / "results.csv", rows)
    harness.write_csv(args.out / "runs.csv", per_run)
    write_summary(args.out, rows, heads, args, time.monotonic() - began)
    plot(args.out, rows, args)
    print(harness.headline(heads))


if __name__ == "__main__":
    main()
