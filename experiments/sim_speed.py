"""The simulator's own speed: the same simulated runs with peers' local steps stacked (the default) and one by one.

Issue 52 asks for 1,024 training peers in ten minutes of wall time. Every
simulated peer takes real torch steps; ``SimConfig.batch_steps`` (the
default) computes the steps every peer has under way in one stacked call
(``gossiptrain.sim.batched_steps``). This runs each setting both ways, in
one process, one thread, alternating the order over ``--repeats`` rounds,
and reports wall and CPU seconds (medians) and their ratio, with the two
runs' results side by side (the mean test accuracy and consensus distance
at the end: the same up to float rounding).

    python experiments/sim_speed.py              # logreg 256 peers x 5 virtual s, digits-small 128 x 3 s; minutes
    python experiments/sim_speed.py --quick      # a smoke test: 8 peers, 2 virtual s, 1 round

Output: experiments/results/sim_speed/summary.md (``--quick``: a scratch
folder, ``harness.results_dir``); the last line printed is one JSON object, per setting the medians
and ``stacked_over_one_by_one`` (wall time; below 1: stacking is faster).
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from experiments import harness  # noqa: E402
from experiments.zoo import code_version  # noqa: E402
from gossiptrain.config import RunConfig  # noqa: E402
from gossiptrain.sim.cluster import Cluster, SimConfig  # noqa: E402
from gossiptrain.sim.vtime import run_virtual  # noqa: E402

#: (workload, peers, virtual seconds) of the default run.
SETTINGS = (("logreg", 256, 5.0), ("digits-small", 128, 3.0))
QUICK = (("logreg", 8, 2.0),)
STEP_TIME = 0.05  # virtual seconds per step, as experiments/scale.py


def one_run(workload: str, peers: int, seconds: float, stacked: bool) -> dict[str, Any]:
    """Wall and CPU seconds of one simulated run, and what it ended with."""
    config = SimConfig(peers=peers, duration=seconds, step_time=STEP_TIME, batch_steps=stacked,
                       run=RunConfig().with_overrides({"train.workload": workload}))
    cluster = Cluster(config)
    wall, cpu = time.perf_counter(), time.process_time()
    result = run_virtual(cluster.run())
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    stats = cluster.batcher.stats if cluster.batcher is not None else None
    return {
        "workload": workload, "peers": peers, "virtual_s": seconds, "stacked": stacked, "wall_s": round(wall, 2),
        "cpu_s": round(cpu, 2), "steps": round(peers * float(result.summary.get("mean_step") or 0.0)),
        "mean_test_acc": result.summary.get("mean_test_acc"), "consensus_distance": result.summary.get("consensus_distance"),
        "stacked_calls": stats.stacked_calls if stats else 0, "stacked_steps": stats.stacked_steps if stats else 0,
    }


def _fmt(value: float | None, digits: int = 4) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=2, help="rounds of both modes, alternating (default 2)")
    ap.add_argument("--quick", action="store_true", help="8 logreg peers, 2 virtual s, 1 round (smoke test)")
    ap.add_argument("--out", type=Path, default=None, help="output folder (default experiments/results/sim_speed)")
    args = ap.parse_args()
    settings = QUICK if args.quick else SETTINGS
    repeats = 1 if args.quick else args.repeats
    out = harness.results_dir("sim_speed", args.out, args.quick)
    out.mkdir(parents=True, exist_ok=True)
    command = "python experiments/sim_speed.py " + " ".join(sys.argv[1:])
    version = code_version()
    torch.set_num_threads(1)  # as simulate() runs: one thread, the measure of the simulator itself
    runs: list[dict[str, Any]] = []
    for workload, peers, seconds in settings:
        for r in range(repeats):
            for stacked in ((False, True) if r % 2 == 0 else (True, False)):
                row = one_run(workload, peers, seconds, stacked)
                print(json.dumps(row), flush=True)
                runs.append(row)
    headline: dict[str, Any] = {}
    lines = [
        "# The simulator's speed: local steps stacked against one by one", "",
        f"Command: `{command.strip()}` ({version}, {datetime.date.today().isoformat()})", "",
        f"One process, one torch thread; steps of {STEP_TIME:g} virtual s; the defaults otherwise. Medians over "
        f"{repeats} rounds, the two modes alternating. Stacked: `SimConfig.batch_steps` (the default, "
        "gossiptrain.sim.batched_steps); one by one: `batch_steps=False`.", "",
        "| workload | peers | virtual s | steps | one by one: wall s / CPU s | stacked: wall s / CPU s | wall ratio "
        "| test acc (one by one / stacked) | consensus distance (one by one / stacked) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for workload, peers, seconds in settings:
        mine = [r for r in runs if r["workload"] == workload and r["peers"] == peers]
        one = [r for r in mine if not r["stacked"]]
        both = [r for r in mine if r["stacked"]]
        med = {k: {m: statistics.median(r[m] for r in rs) for m in ("wall_s", "cpu_s")} for k, rs in (("one", one), ("stacked", both))}
        ratio = round(med["stacked"]["wall_s"] / med["one"]["wall_s"], 3)
        headline[f"{workload}_{peers}"] = {"one_by_one_wall_s": med["one"]["wall_s"], "stacked_wall_s": med["stacked"]["wall_s"],
                                           "stacked_over_one_by_one": ratio}
        lines.append(
            f"| {workload} | {peers} | {seconds:g} | {one[0]['steps']:,} | {med['one']['wall_s']:.2f} / {med['one']['cpu_s']:.2f} "
            f"| {med['stacked']['wall_s']:.2f} / {med['stacked']['cpu_s']:.2f} | {ratio:.3f} "
            f"| {_fmt(one[0]['mean_test_acc'])} / {_fmt(both[0]['mean_test_acc'])} "
            f"| {_fmt(one[0]['consensus_distance'], 5)} / {_fmt(both[0]['consensus_distance'], 5)} |"
        )
    (out / "summary.md").write_text("\n".join(lines) + "\n")
    (out / "runs.json").write_text(json.dumps(runs, indent=1) + "\n")
    print("\n".join(lines))
    print(json.dumps(headline))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
