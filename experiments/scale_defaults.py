"""Issue 52: what keeps the defaults behind DDP at 64 peers on fast links, and which default change would help.

The scale grid (experiments/scale.py) has gossip at 64 simulated machines
with fast links slower to its target than DDP with a halving-doubling
all-reduce. This asks why, on the grid's own bed (digits-small, steps of
50 virtual ms, held target 0.93, ``scale.sim_config``), and tries the
changes issue 52 names, each against the defaults, medians of ``--seeds``
seeds:

- ``defaults``: ``RunConfig()``'s gossip section;
- ``two-in-flight``: two exchanges at once, with two partners
  (``gossip.exchanges_in_flight = 2``: each of weight 1/3);
- ``sqrt``: the square-root rule for SGD too (``gossip.lr_scaling = sqrt``:
  the rate x sqrt(members), at most 4x);
- ``ddp-hd``: the simulated DDP with a halving-doubling all-reduce.

Two conditions of the grid: ``10gbit`` (iid shards, 10 Gbit/s links: where
DDP wins) and ``skew`` (3 classes per machine, 1 Gbit/s: a change must not
hurt label skew). Per run: the time to the target of the peers' own models
(the grid's measure) and of their averaged model (what a final consensus,
``Peer.finish()``'s merged model, hands out), and the steps per peer.
Output: experiments/results/scale_defaults/{runs.csv, summary.md}; the last
line printed is one JSON object {condition: {variant: [own, averaged]}}
(median seconds; null where not reached).

    python experiments/scale_defaults.py            # 2 conditions x 4 variants x 3 seeds, about 10 minutes
    python experiments/scale_defaults.py --quick    # 16 peers, 10gbit, 1 seed (a smoke test)
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from experiments import harness, scale  # noqa: E402
from experiments.zoo import code_version  # noqa: E402

VARIANTS: dict[str, dict[str, Any]] = {
    "defaults": {},
    "two-in-flight": {"gossip.exchanges_in_flight": 2},
    "sqrt": {"gossip.lr_scaling": "sqrt"},
    "ddp-hd": {},
}
CONDITIONS = ("10gbit", "skew")


def one_run(args: tuple[str, str, int, int]) -> dict[str, Any]:
    """One run in this (worker) process: the condition, the variant, the peers and the seed."""
    import torch

    from gossiptrain.sim import simulate

    condition, variant, peers, seed = args
    torch.set_num_threads(1)
    system = "ddp-hd" if variant == "ddp-hd" else "gossip"
    spec = scale.Spec("digits-small", peers, condition, system, seed,
                      scale.GOSSIP_DURATION if system == "gossip" else scale.SYNC_DURATION)
    config = scale.sim_config(spec)
    if system == "gossip":
        config = dataclasses.replace(config, run=config.run.with_overrides(VARIANTS[variant]))
    began = time.perf_counter()
    s = simulate(config).summary
    return {"condition": condition, "variant": variant, "peers": peers, "seed": seed,
            "time_to_target_s": s.get("time_to_target"), "averaged_time_to_target_s": s.get("swarm_time_to_target"),
            "steps_per_peer": s.get("mean_step"), "wall_s": round(time.perf_counter() - began, 1)}


def median_or_none(values: list[float | None]) -> float | None:
    got = [v for v in values if v is not None]
    return statistics.median(got) if len(got) * 2 > len(values) else None  # most runs must have reached it


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--peers", type=int, default=64)
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--conditions", default=",".join(CONDITIONS))
    ap.add_argument("--jobs", type=int, default=2, help="runs at once, each in its own process")
    ap.add_argument("--quick", action="store_true", help="16 peers, 10gbit, 1 seed (a smoke test)")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    peers, seeds = (16, 1) if args.quick else (args.peers, args.seeds)
    conditions = ["10gbit"] if args.quick else harness.chosen(args.conditions, scale.CONDITIONS, "condition")
    out = harness.results_dir("scale_defaults", args.out, args.quick)
    out.mkdir(parents=True, exist_ok=True)
    jobs = [(c, v, peers, s) for c in conditions for s in range(seeds) for v in VARIANTS]
    rows: list[dict[str, Any]] = []
    with ProcessPoolExecutor(max_workers=args.jobs) as pool:
        for row in pool.map(one_run, jobs):
            rows.append(row)
            print(f"{row['condition']} {row['variant']} seed {row['seed']}: {row['time_to_target_s']} s "
                  f"(averaged {row['averaged_time_to_target_s']} s), {row['steps_per_peer']} steps, {row['wall_s']} s",
                  flush=True)
            harness.write_csv(out / "runs.csv", rows)
    head: dict[str, Any] = {}
    table = []
    for condition in conditions:
        for variant in VARIANTS:
            rs = [r for r in rows if r["condition"] == condition and r["variant"] == variant]
            own = median_or_none([r["time_to_target_s"] for r in rs])
            avg = median_or_none([r["averaged_time_to_target_s"] for r in rs]) if variant != "ddp-hd" else None
            head.setdefault(condition, {})[variant] = [own, avg]
            each = ", ".join("not reached" if r["time_to_target_s"] is None else f"{r['time_to_target_s']:g}" for r in rs)
            table.append([condition, variant, "not reached" if own is None else f"{own:g}", each,
                          "-" if avg is None else f"{avg:g}", f"{statistics.median(r['steps_per_peer'] for r in rs):g}"])
    command = ("python experiments/scale_defaults.py " + " ".join(sys.argv[1:])).strip()
    lines = [
        f"# Issue 52: the defaults against DDP-hd at {peers} peers, and the changes the issue names",
        "",
        f"Command: `{command}` ({code_version()}, {time.strftime('%Y-%m-%d')})",
        "",
        f"experiments/scale.py's bed: digits-small, {peers} simulated machines, steps of "
        f"{scale.STEP_TIME * 1000:.0f} virtual ms, target {scale.TARGETS['digits-small']} held for {harness.HOLD} "
        f"samples; medians of {seeds} seeds (virtual s). Own: the peers' mean test accuracy (the grid's measure); "
        "averaged: the peers' averaged model.",
        "",
        *harness.markdown_table(["condition", "variant", "own models (s)", "each seed", "averaged model (s)",
                                 "steps per peer"], table),
    ]
    return harness.publish(out, lines, head)


if __name__ == "__main__":
    raise SystemExit(main())
