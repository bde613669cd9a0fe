"""Gossip (each algorithm, defaults) against torch DDP over one shaped link: 100 Mbit/s and 1 Gbit/s, iid and skewed.

Every process of a run (a coordinator and 4 `gossiptrain peer` processes,
or 4 DDP ranks over gloo) runs inside one Linux network namespace whose
loopback is shaped with `tc` (tbf), so every byte any of them sends crosses
one shared link of that rate: what "4 machines on one 100 Mbit switch
port" costs, on one machine. Workload digits-small (the 19,210-parameter
MLP: at 100 Mbit/s a DDP step is link-bound, about 40 ms of which 2 ms
compute; `--workload digits` for the 1.1M-parameter one), shards iid
or label-skewed (`classes-per-peer`, 3 classes each); target: the mean test
accuracy (DDP: rank 0's) held at `--target` for 3 evaluations. The peers
start at a rendezvous (`--wait-for 4`), as DDP's ranks meet before their
clock starts, timed from the first start (`--no-start-together`: each
trains as it joins). Then
charlm (Adam, 3 peers on contiguous thirds of the text) against one
process alone for the same wall time, on the 100 Mbit/s link; with
`--charlm-steps N` also after the same samples: 3 peers of N steps each
(starting together) against one process of 3N steps on all the text.

Needs root (`ip netns`, `tc`): without it, it prints one line saying why
and exits 0. Output in experiments/results/wan/ (`--quick`: a scratch
folder): runs.csv, summary.md, wan.png; the last line printed is a JSON
object: {"ddp_over_gossip_100mbit_skew", "ddp_over_gossip_lan_skew",
"ddp_over_gossip_lan_iid", "worst_algorithm_over_default",
"charlm_swarm_over_alone"} ("lan" is the 1 Gbit/s link; a ratio above 1
means gossip is faster; worst_algorithm_over_default is the slowest
algorithm's time over the default's on the 100 Mbit/s skewed link;
charlm_swarm_over_alone is the swarm's mean validation loss over the lone
process's, below 1 means the swarm learned more; with `--charlm-steps`
also "charlm_swarm_over_all_samples", the target being at most 1.05).

    python experiments/wan.py            # both links, iid and skew, DDP + 4 algorithms, 3 seeds, charlm (hours)
    python experiments/wan.py --quick    # 100 Mbit/s skew only: DDP and the default, 1 seed, short runs, charlm 10 s
    python experiments/wan.py --seeds 1 --links 100mbit --partitions skew   # a slice
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
from gossiptrain.config import ALGORITHMS, RunConfig  # noqa: E402
from gossiptrain.testing import netns  # noqa: E402
from gossiptrain.train.metrics import read_metrics  # noqa: E402

LINKS = {"100mbit": "100mbit", "1gbit": "1gbit"}
PARTITIONS = {
    "iid": {"train.partition": "iid"},
    "skew": {"train.partition": "classes-per-peer", "train.partition_classes": 3},
}
WORKLOAD = "digits-small"
DEFAULT = RunConfig().gossip.algorithm
CHARLM = {"train.workload": "charlm", "train.optimizer": "adam", "train.lr": 0.003}


# -- the namespace ---------------------------------------------------------------------------


def why_not() -> str | None:
    """Why this machine cannot shape a link here (None: it can)."""
    return netns.why_not("tc", need="a network namespace and tc")


class Namespace(netns.Namespace):
    """A network namespace of our own whose loopback is one shaped link; removed on exit."""

    def __init__(self) -> None:
        super().__init__(netns.unique_name("gt-wan"))

    def shape(self, rate: str) -> None:
        """All of the namespace's traffic through one token bucket of ``rate`` (burst above loopback's 64 KiB MTU)."""
        self.shape_link("lo", netns.LinkShape(rate=rate, burst="256kb", latency="400ms"))


# -- one run, inside the namespace -------------------------------------------------------------


def inside(args: argparse.Namespace) -> None:
    """Run one system (``--system``) and print its row as JSON (called through ``ip netns exec``)."""
    work = Path(args.work)
    if args.system.startswith("charlm-"):
        print(json.dumps(charlm(args, work)))
        return
    sets = {"train.workload": args.workload, **PARTITIONS[args.partition],
            **{k: json.loads(v) for k, _, v in (item.partition("=") for item in args.set)}}
    if args.system == "ddp":
        run = harness.run_ddp(4, args.seed, 1.0, args.target, args.timeout, work, overrides=sets)
    else:
        run = harness.run_gossip(4, args.seed, 1.0, args.target, args.timeout, work,
                                 gossip={**sets, "gossip.algorithm": args.system}, start_together=args.start_together)
    print(json.dumps({"time_to_target_s": run.time_to_target, "final_acc": run.final_acc,
                      "samples_to_target": run.samples_to_target, **{k: v for k, v in run.extra.items() if k != "steps"}}))


def charlm(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """charlm: the swarm (3 peers, contiguous thirds) or one process alone; its final validation loss.

    ``charlm-swarm`` / ``charlm-alone``: ``--charlm-seconds`` of wall time each.
    ``charlm-swarm-steps`` / ``charlm-all-samples``: the same samples, 3 peers of
    ``--charlm-steps`` steps (starting together) against one process of 3 times that.
    """
    by_steps = args.system in ("charlm-swarm-steps", "charlm-all-samples")
    peers = 3 if args.system.startswith("charlm-swarm") else 1
    harness.fresh_dir(work)
    steps = args.charlm_steps if peers > 1 else 3 * args.charlm_steps  # the lone process gets all 3 peers' samples
    budget = ({"train.max_steps": steps, "train.max_seconds": 0} if by_steps
              else {"train.max_steps": 0, "train.max_seconds": args.charlm_seconds})
    overrides = {**CHARLM, "train.shards": peers, "train.seed": args.seed, **budget, "train.eval_every_seconds": 2.0}
    wait = ["--wait-for", str(peers)] if by_steps and peers > 1 else []
    with harness.Procs(work) as procs:
        join = harness.start_coordinator(procs, overrides)
        for i in range(peers):
            procs.start(f"peer-{i}", harness.python_m("gossiptrain", "peer", "--join", join, "--quiet", "--threads", 1,
                                                      "--shard", i, "--metrics", work / f"peer-{i}.jsonl", *wait))
        deadline = time.monotonic() + (args.timeout if by_steps else args.charlm_seconds) + harness.STARTUP
        running = [p for name, p in procs.procs if name.startswith("peer-")]
        while any(p.poll() is None for p in running) and time.monotonic() < deadline:  # each stops after max_seconds
            if problem := procs.failed():
                raise RuntimeError(problem)
            time.sleep(harness.POLL)
    losses = []
    for i in range(peers):
        evals = [r for r in read_metrics(work / f"peer-{i}.jsonl") if "test_loss" in r]
        if evals:
            losses.append(evals[-1]["test_loss"])
    return {"val_loss": statistics.mean(losses) if losses else None, "peers_reporting": len(losses)}


# -- the sweep, outside ------------------------------------------------------------------------


def one(ns: Namespace, system: str, link: str, partition: str, seed: int, args: argparse.Namespace, out: Path) -> dict[str, Any]:
    work = out / "runs" / f"{link}-{partition}-{system}-{seed}"
    cmd = [sys.executable, str(Path(__file__).resolve()), "--inside", "--system", system, "--partition", partition,
           "--seed", str(seed), "--target", str(args.target), "--timeout", str(args.timeout), "--work", str(work),
           "--workload", args.workload, "--charlm-seconds", str(args.charlm_seconds), "--charlm-steps", str(args.charlm_steps),
           "--start-together" if args.start_together else "--no-start-together",
           *[a for item in args.set for a in ("--set", item)]]
    started = time.perf_counter()
    done = ns.run(cmd, capture_output=True, timeout=args.timeout + args.charlm_seconds + harness.STARTUP + 120, check=False)
    row: dict[str, Any] = {"link": link, "partition": partition, "system": system, "seed": seed}
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("{")]
    if done.returncode != 0 or not lines:
        row["error"] = (done.stderr.strip().splitlines() or ["no output"])[-1][:200]
    else:
        row.update(json.loads(lines[-1]))
    row["wall_s"] = round(time.perf_counter() - started, 1)
    print(json.dumps(row), flush=True)
    return row


def median_time(rows: list[dict[str, Any]]) -> float | None:
    """Median time to the target over seeds; a run that never reached it counts as slower than any that did."""
    times = [r.get("time_to_target_s") for r in rows if "error" not in r]
    if not times or sum(t is None for t in times) * 2 >= len(times):
        return None
    return statistics.median(float("inf") if t is None else t for t in times)


def ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or b == 0 else a / b


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--links", nargs="+", default=list(LINKS), choices=list(LINKS))
    ap.add_argument("--partitions", nargs="+", default=list(PARTITIONS), choices=list(PARTITIONS))
    ap.add_argument("--systems", nargs="+", default=["ddp", *ALGORITHMS], choices=["ddp", *ALGORITHMS])
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--target", type=float, default=0.93, help="mean test accuracy to hold (default 0.93)")
    ap.add_argument("--timeout", type=float, default=150.0, help="seconds of training per run before it counts as not reached")
    ap.add_argument("--workload", default=WORKLOAD)
    ap.add_argument("--charlm-seconds", type=float, default=60.0, help="wall seconds of the charlm runs (0: skip charlm)")
    ap.add_argument("--charlm-steps", type=int, default=0,
                    help="also charlm after the same samples: 3 peers of N steps against one process of 3N (0: skip)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=JSON",
                    help="a field of every run's configuration, e.g. gossip.momentum_mode='\"local\"' (repeatable)")
    ap.add_argument("--only-charlm", action="store_true", help="skip the digits runs")
    ap.add_argument("--start-together", action=argparse.BooleanOptionalAction, default=True,
                    help="gossip peers run with --wait-for 4, as DDP's ranks wait for their rendezvous (default; "
                         "--no-start-together: each trains as it joins, the first ones alone); timed from the first start")
    ap.add_argument("--quick", action="store_true", help="100mbit skew, DDP and the default, 1 seed, short runs")
    ap.add_argument("--out", type=Path, default=None, help="output folder (default experiments/results/wan)")
    # one run inside the namespace (used by the sweep itself)
    ap.add_argument("--inside", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--system", help=argparse.SUPPRESS)
    ap.add_argument("--partition", default="iid", help=argparse.SUPPRESS)
    ap.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--work", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.inside:
        inside(args)
        return 0
    if (problem := why_not()) is not None:
        print(f"wan: skipped: {problem} (run as root on Linux with iproute2)")
        return 0
    if args.quick:
        args.links, args.partitions, args.systems, args.seeds = ["100mbit"], ["skew"], ["ddp", DEFAULT], 1
        args.timeout, args.charlm_seconds, args.target = 40.0, 10.0, 0.8
    out = harness.results_dir("wan", args.out, args.quick)
    rows: list[dict[str, Any]] = []
    with Namespace() as ns:
        for link in [] if args.only_charlm else args.links:
            ns.shape(LINKS[link])
            for partition in args.partitions:
                for seed in range(args.seeds):
                    for system in args.systems:
                        rows.append(one(ns, system, link, partition, seed, args, out))
        charlm_systems = [*(("charlm-swarm", "charlm-alone") if args.charlm_seconds > 0 else ()),
                          *(("charlm-swarm-steps", "charlm-all-samples") if args.charlm_steps > 0 else ())]
        if charlm_systems:
            ns.shape(LINKS["100mbit"])
            for seed in range(args.seeds):
                for system in charlm_systems:
                    rows.append(one(ns, system, "100mbit", "contiguous", seed, args, out))
    harness.write_csv(out / "runs.csv", rows)
    return report(rows, args, out)


def report(rows: list[dict[str, Any]], args: argparse.Namespace, out: Path) -> int:
    def cell(link: str, partition: str, system: str) -> float | None:
        return median_time([r for r in rows if (r["link"], r["partition"], r["system"]) == (link, partition, system)])

    lines = [f"# Gossip vs DDP over one shaped link: 4 peers, {args.workload}, medians of {args.seeds} seeds", "",
             f"Regenerate: `python experiments/wan.py` (as root). Target: mean test accuracy {args.target} held for "
             f"3 evaluations; {args.timeout:.0f} s of training per run at most. Time to target in seconds; "
             "ratio = DDP's time over this system's (above 1: faster than DDP).", ""]
    table = []
    for link in args.links:
        for partition in args.partitions:
            ddp = cell(link, partition, "ddp")
            for system in args.systems:
                if not any((r["link"], r["partition"], r["system"]) == (link, partition, system) for r in rows):
                    continue  # not run (a slice of the sweep)
                t = cell(link, partition, system)
                ratio_text = "" if system == "ddp" else harness.fmt(ratio(ddp, t) or float("nan"))
                table.append([link, partition, system, "not reached" if t is None else f"{t:.1f}", ratio_text])
    lines += harness.markdown_table(["link", "shards", "system", "time to target (s)", "DDP / this"], table)
    def losses(system: str) -> list[float]:
        return [r["val_loss"] for r in rows if r["system"] == system and r.get("val_loss") is not None]

    swarm, alone = losses("charlm-swarm"), losses("charlm-alone")
    charlm_ratio = ratio(statistics.median(swarm), statistics.median(alone)) if swarm and alone else None
    if swarm and alone:
        lines += ["", f"charlm, Adam, {args.charlm_seconds:.0f} s on the 100 Mbit/s link: swarm of 3 validation loss "
                  f"{statistics.median(swarm):.3f}, one process alone {statistics.median(alone):.3f}."]
    by_steps, all_samples = losses("charlm-swarm-steps"), losses("charlm-all-samples")
    samples_ratio = ratio(statistics.median(by_steps), statistics.median(all_samples)) if by_steps and all_samples else None
    if by_steps and all_samples:
        lines += ["", f"charlm, Adam, the same samples on the 100 Mbit/s link: swarm of 3 x {args.charlm_steps} steps "
                  f"validation loss {statistics.median(by_steps):.3f}, one process of {3 * args.charlm_steps} steps "
                  f"{statistics.median(all_samples):.3f} (swarm / all samples {samples_ratio:.3f}; target at most 1.05)."]
    (out / "summary.md").write_text("\n".join(lines) + "\n")
    if table:
        plot(rows, args, out)
    print("\n".join(lines))
    algos = [s for s in args.systems if s != "ddp"]
    skew100 = {s: cell("100mbit", "skew", s) for s in algos}
    default = skew100.get(DEFAULT)
    worst = max((t for t in skew100.values()), key=lambda t: float("inf") if t is None else t, default=None)
    print(harness.headline({
        "ddp_over_gossip_100mbit_skew": harness.finite_or_none(ratio(cell("100mbit", "skew", "ddp"), default)),
        "ddp_over_gossip_lan_skew": harness.finite_or_none(ratio(cell("1gbit", "skew", "ddp"), cell("1gbit", "skew", DEFAULT))),
        "ddp_over_gossip_lan_iid": harness.finite_or_none(ratio(cell("1gbit", "iid", "ddp"), cell("1gbit", "iid", DEFAULT))),
        "worst_algorithm_over_default": harness.finite_or_none(ratio(worst, default)),
        "charlm_swarm_over_alone": harness.finite_or_none(charlm_ratio),
        **({"charlm_swarm_over_all_samples": harness.finite_or_none(samples_ratio)} if args.charlm_steps > 0 else {}),
    }))
    return 0


def plot(rows: list[dict[str, Any]], args: argparse.Namespace, out: Path) -> None:
    """Bars: median time to target per system, one group per link and shards."""
    try:
        plt = harness.pyplot()
    except ImportError:
        print("wan: matplotlib missing (pip install -e '.[experiments]'): no wan.png", file=sys.stderr)
        return
    groups = [(link, part) for link in args.links for part in args.partitions]
    fig, ax = plt.subplots(figsize=(max(6, 2.2 * len(groups)), 4))
    width = 0.8 / len(args.systems)
    for k, system in enumerate(args.systems):
        values = [median_time([r for r in rows if (r["link"], r["partition"], r["system"]) == (*g, system)]) for g in groups]
        xs = [i + k * width for i in range(len(groups))]
        ax.bar(xs, [args.timeout if v is None or v == float("inf") else v for v in values], width, label=system,
               hatch=None, alpha=0.9)
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(groups))], [f"{a}\n{b}" for a, b in groups])
    ax.set_ylabel(f"seconds to {args.target} (bar at {args.timeout:.0f}: not reached)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "wan.png", dpi=110)


if __name__ == "__main__":
    raise SystemExit(main())
