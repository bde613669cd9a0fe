"""Topologies: time and bytes to a target accuracy, and consensus distance over time, for every topology in the library.

For 8 and 16 peers, every topology of `topologies/` that exists at that size
with its default parameters (`file` needs an edge-list file and is skipped;
any other that cannot be built at a size is skipped and named) trains digits
(the ~1.13M-parameter MLP, peer i on shard i, pairwise averaging by default):

- simulated (`gossiptrain.sim`, the experiments' harness): peers start
  together, one core each, a local step costs 6 ms of virtual time, links of
  0.5 ms and 1 GB/s; each run is sampled every 0.05 virtual s (the peers'
  mean test accuracy, their mean consensus distance ||x_i - mean x|| and
  the bytes each has sent, mean over peers) until the target holds, or for
  at most `--horizon` virtual seconds. Deterministic for a seed; medians
  over `--seeds` seeds (2 by default: a 16-peer run costs about a minute
  of CPU here).
- real (8 peers, a subset by default: ring, exponential, complete; `--real-all`
  for all): a `gossiptrain coordinator` and 8 `gossiptrain peer --threads 1`
  processes on 127.0.0.1, as experiments/stragglers.py starts them
  (harness.run_gossip), until the mean test accuracy holds the target. The
  8 processes share this machine's 2 cores, so real seconds are not the
  simulator's (one core per peer): compare topologies within a column.

The time to the target is the first sample of 3 in a row at or above it;
bytes to the target are what each peer had sent by then (mean over peers:
parameters, after compression, plus membership traffic).

Output in experiments/results/topologies/: results.csv (one row per
configuration: medians over seeds), runs.csv (one row per run), curves.csv
(mean consensus distance and accuracy per sample, simulated runs), summary.md,
consensus.png (consensus distance vs time, one line per topology),
to_target.png (bars: time and bytes to the target). The last line printed is
a JSON object:

- best_topology_8, best_topology_16: the simulated topology with the shortest
  median time to the target (ties: fewer bytes); null if none reached it;
- time_to_target_s, bytes_to_target: {"8": {topology: median}, "16": {...}}
  (simulated; null: not reached within the horizon);
- real_time_to_target_s, real_bytes_to_target: {topology: value} for the real
  8-peer runs (empty when none ran);
- skipped: {topology: reason}; target, seeds, horizon_s, algorithm.

    python experiments/topologies.py              # 8 and 16 peers, all topologies, 2 seeds; real: ring, exponential, complete
    python experiments/topologies.py --real-all   # ... and every topology as a real 8-peer cluster
    python experiments/topologies.py --quick      # 4 peers, ring and complete, one seed, no real runs (smoke test)
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

import topologies as topo_lib  # noqa: E402
from experiments import harness  # noqa: E402
from experiments.harness import SimRun, fmt  # noqa: E402

REAL_DEFAULT = ("ring", "exponential", "complete")


def available(peers: int) -> tuple[list[str], dict[str, str]]:
    """The library's topologies that exist on ``peers`` members with default parameters, and why the others do not."""
    ok, skipped = [], {}
    for name in topo_lib.names():
        try:
            topo_lib.parse(name).neighbours(peers, 0, 0)
        except ValueError as e:
            skipped[name] = str(e)
            continue
        ok.append(name)
    return ok, skipped


def shape(name: str, peers: int) -> dict[str, Any]:
    """Degree and spectral gap of the topology at this size (topologies.describe), for the table."""
    d = topo_lib.describe(topo_lib.parse(name), peers)
    return {"degree": round(float(d["degree"]), 2), "spectral_gap": round(float(d["spectral_gap"]), 3)}  # type: ignore[arg-type]


def simulate_all(args: argparse.Namespace) -> tuple[dict[tuple[int, str], list[SimRun]], dict[str, str]]:
    """Every (size, topology) over the seeds, printing a line as each configuration finishes."""
    runs: dict[tuple[int, str], list[SimRun]] = {}
    skipped: dict[str, str] = {}
    for peers in args.peers:
        names, missing = available(peers)
        for name, why in missing.items():  # the same reason at every size reads once
            skipped[name] = why if skipped.get(name, why) == why else f"{skipped[name]}; {why}"
        for name in [n for n in names if not args.topologies or n in args.topologies]:
            overrides = {"gossip.topology": name, "gossip.algorithm": args.algorithm}
            group = [
                harness.run_sim(name, peers, seed, overrides, args.target, args.horizon, stop_at_target=True)
                for seed in range(args.seeds)
            ]
            runs[(peers, name)] = group
            med = harness.sim_medians(group)
            print(
                f"sim {peers:>2} peers {name:>20}: time to {args.target} {harness.fmt_seconds(med['time_to_target_s'])}, "
                f"{fmt(med['bytes_to_target'] / 1e6, 0)} MB/peer, consensus distance there "
                f"{statistics.median(consensus_at_target(r) for r in group):.3f} "
                f"({med['reached']}/{len(group)} seeds reached; wall {sum(r.wall_seconds for r in group):.0f} s)",
                flush=True,
            )
    return runs, skipped


def real_all(args: argparse.Namespace) -> dict[str, list[harness.Run]]:
    """Real 8-peer loopback clusters (harness.run_gossip), one topology after another."""
    real: dict[str, list[harness.Run]] = {}
    for name in args.real:
        group = []
        for seed in range(args.real_seeds):
            workdir = args.out / "runs" / f"real-{name}-seed{seed}"
            run, failed = harness.retried(
                lambda: harness.run_gossip(args.real_peers, seed, 1.0, args.target, args.real_timeout, workdir, topology=name),
                f"real {name} seed {seed}",
            )
            ttt = run.time_to_target
            run.extra["bytes_to_target"] = None if ttt is None else harness.gossip_bytes_at(workdir, args.real_peers, ttt)
            run.extra["retries"] = len(failed)
            group.append(run)
            print(
                f"real {args.real_peers} peers {name:>20} seed {seed}: time to {args.target} "
                f"{'not reached' if ttt is None else f'{ttt:.2f} s'}, "
                f"{fmt((run.extra['bytes_to_target'] or math.inf) / 1e6, 0)} MB/peer, {run.extra['exchanges_per_peer']:.0f} "
                f"exchanges/peer "
                f"(setup {run.setup_seconds:.1f} s, not counted)",
                flush=True,
            )
        real[name] = group
    return real


def tables(
    sims: dict[tuple[int, str], list[SimRun]], real: dict[str, list[harness.Run]], args: argparse.Namespace
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """results.csv (medians per configuration) and runs.csv (every run)."""
    rows, runs = [], []
    for (peers, name), group in sims.items():
        med = harness.sim_medians(group)
        rows.append({
            "mode": "sim", "peers": peers, "topology": name, **shape(name, peers), "seeds": len(group), "target": args.target,
            "time_to_target_s": harness.finite_or_none(med["time_to_target_s"]),
            "bytes_to_target": harness.finite_or_none(med["bytes_to_target"], 0),
            "consensus_at_target": round(statistics.median(consensus_at_target(r) for r in group), 4),
            "consensus_mean": round(statistics.median(statistics.mean(r.consensus) for r in group), 4),
            "exchanges_per_peer": round(statistics.median(r.extra["exchanges_per_peer"] or 0 for r in group), 1),
            "wall_s": round(sum(r.wall_seconds for r in group), 1),
        })
        runs += [{
            "mode": "sim", "peers": peers, "topology": name, "seed": r.seed,
            "time_to_target_s": r.time_to_target, "bytes_to_target": r.bytes_to_target,
            "consensus_at_target": round(consensus_at_target(r), 4), "wall_s": round(r.wall_seconds, 1),
        } for r in group]
    for name, group in real.items():
        t_med = harness.spread([r.time_to_target for r in group])[0]
        b_med = harness.spread([r.extra["bytes_to_target"] for r in group])[0]
        rows.append({
            "mode": "real", "peers": args.real_peers, "topology": name, **shape(name, args.real_peers), "seeds": len(group),
            "target": args.target, "time_to_target_s": harness.finite_or_none(t_med), "bytes_to_target": harness.finite_or_none(b_med, 0),
            "consensus_at_target": "", "consensus_mean": "",
            "exchanges_per_peer": round(statistics.median(r.extra["exchanges_per_peer"] for r in group), 1), "wall_s": "",
        })
        runs += [{
            "mode": "real", "peers": args.real_peers, "topology": name, "seed": r.seed, "time_to_target_s": r.time_to_target,
            "bytes_to_target": r.extra["bytes_to_target"], "consensus_at_target": "", "wall_s": "", "setup_s": round(r.setup_seconds, 1),
        } for r in group]
    return rows, runs


def consensus_at_target(run: SimRun) -> float:
    """The mean consensus distance when the target was reached (at the end of the run if it was not)."""
    t = run.time_to_target
    return next((c for p, c in zip(run.points, run.consensus) if p.elapsed == t), run.consensus[-1])


def best(rows: list[dict[str, Any]], peers: int) -> str | None:
    """The simulated topology that reached the target first at this size (ties: fewer bytes)."""
    reached = [r for r in rows if r["mode"] == "sim" and r["peers"] == peers and r["time_to_target_s"] is not None]
    return min(reached, key=lambda r: (r["time_to_target_s"], r["bytes_to_target"]))["topology"] if reached else None


def headline(rows: list[dict[str, Any]], skipped: dict[str, str], args: argparse.Namespace) -> dict[str, Any]:
    sim = [r for r in rows if r["mode"] == "sim"]
    real = [r for r in rows if r["mode"] == "real"]
    return {
        **{f"best_topology_{p}": best(rows, p) for p in args.peers},
        "time_to_target_s": {str(p): {r["topology"]: r["time_to_target_s"] for r in sim if r["peers"] == p} for p in args.peers},
        "bytes_to_target": {str(p): {r["topology"]: r["bytes_to_target"] for r in sim if r["peers"] == p} for p in args.peers},
        "real_time_to_target_s": {r["topology"]: r["time_to_target_s"] for r in real},
        "real_bytes_to_target": {r["topology"]: r["bytes_to_target"] for r in real},
        "skipped": skipped,
        "target": args.target,
        "seeds": args.seeds,
        "horizon_s": args.horizon,
        "algorithm": args.algorithm,
    }


def curves(sims: dict[tuple[int, str], list[SimRun]]) -> list[dict[str, Any]]:
    """curves.csv: every sample of every simulated run (small: a few dozen samples a run)."""
    return [
        {"peers": peers, "topology": name, "seed": r.seed, "time_s": p.elapsed, "mean_acc": round(p.acc, 4),
         "consensus": round(c, 5), "bytes_sent": round(b)}
        for (peers, name), group in sims.items() for r in group for p, c, b in zip(r.points, r.consensus, r.bytes_sent)
    ]


def write_summary(
    out: Path, rows: list[dict[str, Any]], real: dict[str, list[harness.Run]], heads: dict[str, Any], args: argparse.Namespace,
    wall: float,
) -> None:
    def mb(x: float | None) -> str:
        return "not reached" if x is None else f"{x / 1e6:.0f}"

    def t(x: float | None) -> str:
        return "not reached" if x is None else f"{x:.2f}"

    header = ["mode", "peers", "topology", "degree", "spectral gap", f"time to {args.target} (s)", "MB sent per peer to it",
              "consensus distance at it", "mean consensus distance", "exchanges per peer"]
    table = [
        [r["mode"], r["peers"], r["topology"], r["degree"], r["spectral_gap"], t(r["time_to_target_s"]), mb(r["bytes_to_target"]),
         r["consensus_at_target"], r["consensus_mean"], r["exchanges_per_peer"]]
        for r in sorted(rows, key=lambda r: (r["mode"] != "sim", r["peers"], r["time_to_target_s"] or math.inf))
    ]
    skipped = "; ".join(f"`{k}` ({v})" for k, v in heads["skipped"].items()) or "none"
    real_note = (
        f"Real: {args.real_peers} `gossiptrain peer --threads 1` processes and a coordinator on 127.0.0.1 of this 2-core "
        f"machine (shared with other work), {args.real_seeds} seed(s), evaluations every {harness.EVAL_EVERY} s, times from "
        f"the first peer's start, until the target held (start-up, not counted, took "
        f"{statistics.median(r.setup_seconds for g in real.values() for r in g):.0f} s, median); their seconds are not the "
        f"simulator's ({args.real_peers} processes share 2 cores) and they have no consensus distance (peers do not log it)."
        if real else "Real runs: none this time."
    )
    lines = [
        "# Topologies: time and bytes to a target accuracy, consensus distance",
        "",
        f"Digits (MLP, 1.13M parameters, iid shards), `{args.algorithm}` averaging, peers {', '.join(map(str, args.peers))}; "
        f"target: mean test accuracy {args.target} held for {harness.HOLD} samples. Simulated: every peer on its own core, "
        f"a local step {harness.SIM_STEP_TIME * 1e3:g} ms of virtual time, links 0.5 ms / 1 GB/s, peers start together, "
        f"sampled every {harness.SIM_SAMPLE_EVERY:g} s until the target held (at most {args.horizon:g} virtual s); medians "
        f"of {args.seeds} seed(s). Consensus distance: mean over peers of the L2 distance of a peer's parameters to the "
        f"peers' mean, at the target and averaged over the run's samples. Exchanges per peer: initiated or served, by "
        f"the end of the run. Bytes: sent per peer (mean), parameters and membership traffic. {real_note}",
        "",
        f"Skipped: {skipped}.",
        "",
        *harness.markdown_table(header, table),
        "",
        "Best simulated topology (shortest median time to the target): "
        + ", ".join(f"{p} peers: **{heads[f'best_topology_{p}']}**" for p in args.peers) + ".",
        "",
        *notes(args),
        f"Wall time of this run: {wall:.0f} s. Regenerate: `python experiments/topologies.py{' --quick' if args.quick else ''}`"
        + (" (add `--real-all` for every topology as a real cluster)" if not args.quick else ""),
        "",
        "![consensus distance](consensus.png) ![time and bytes to target](to_target.png)",
    ]
    (out / "summary.md").write_text("\n".join(lines) + "\n")


def notes(args: argparse.Namespace) -> list[str]:
    """How to read bytes for the algorithm that ran."""
    if args.algorithm == "pairwise":
        return [
            "With `pairwise` averaging a peer sends one model per exchange it starts or serves, whatever the topology, so "
            "bytes to the target follow time to the target; the topology decides whom a peer averages with, which shows "
            "in the consensus distance (`--algorithm neighbor` pushes to every neighbour each round: bytes then grow "
            "with the degree).",
            "",
            "Time-varying topologies (`one-peer-exponential`, `base-k`) choose neighbours by round, and the round is the "
            "peer's local step. A pairwise peer starts an exchange only when its previous one has completed, so when a "
            "round trip lasts a multiple of the topology's period (here 3 steps of 6 ms against a period of 3 at 8 "
            "peers), it asks at the same phase of the period every time: on `one-peer-exponential` always the member "
            "2 places on, which on 8 peers splits the swarm into two groups that never average with each other, and "
            "their consensus distance grows without bound. At 16 peers the period is 4 and the phases rotate.",
            "",
        ]
    return []


def plot(out: Path, sims: dict[tuple[int, str], list[SimRun]], rows: list[dict[str, Any]], args: argparse.Namespace) -> None:
    plt = harness.pyplot()
    sizes = list(args.peers)
    names = list(dict.fromkeys(name for _, name in sims))  # the library's order
    colors = plt.get_cmap("tab10")
    fig, axes = plt.subplots(1, len(sizes), figsize=(6 * len(sizes), 4), sharey=True, squeeze=False)
    for ax, peers in zip(axes[0], sizes):
        for k, name in enumerate(names):
            group = sims.get((peers, name))
            if not group:
                continue
            n = min(len(r.consensus) for r in group)
            median = [statistics.median(r.consensus[j] for r in group) for j in range(n)]
            ax.plot([p.elapsed for p in group[0].points[:n]], median, label=name, color=colors(k % 10), ls="-" if k < 10 else "--", lw=1.3)
        ax.set_title(f"{peers} peers, {args.algorithm} (simulated, median of {args.seeds} seed(s)), until {args.target} held", fontsize=9)
        ax.set_xlabel("virtual seconds")
        ax.set_yscale("log")
    axes[0][0].set_ylabel("consensus distance: mean ||x_i - mean x||")
    axes[0][-1].legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(out / "consensus.png", dpi=80)
    plt.close(fig)

    groups = [(f"simulated, {p} peers", "virtual s", [r for r in rows if r["mode"] == "sim" and r["peers"] == p]) for p in sizes]
    real = [r for r in rows if r["mode"] == "real"]
    groups += [(f"real loopback, {args.real_peers} peers", "s", real)] if real else []
    fig, axes = plt.subplots(2, len(groups), figsize=(5 * len(groups), 6), squeeze=False)
    for j, (title, unit, group) in enumerate(groups):
        panels = [("time_to_target_s", f"{unit} to {args.target}", 1.0), ("bytes_to_target", f"MB sent per peer to {args.target}", 1e6)]
        for i, (key, label, scale) in enumerate(panels):
            ax = axes[i][j]
            xs = [r["topology"] for r in group]
            ax.bar(xs, [(r[key] or 0) / scale for r in group], color="tab:purple" if "real" in title else "tab:blue")
            for x, r in enumerate(group):
                if r[key] is None:
                    ax.text(x, 0, "not reached", rotation=90, ha="center", va="bottom", fontsize=7, color="tab:red")
            ax.set_title(f"{title}: {label}", fontsize=9)
            ax.tick_params(axis="x", labelrotation=70, labelsize=7)
    fig.tight_layout()
    fig.savefig(out / "to_target.png", dpi=80)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--peers", type=int, nargs="+", default=[8, 16], help="swarm sizes simulated")
    parser.add_argument("--topologies", nargs="+", default=None, help="only these (default: every one that exists at the size)")
    parser.add_argument("--algorithm", default="pairwise", help="gossip.algorithm of every run")
    parser.add_argument("--target", type=float, default=0.95, help="mean test accuracy to reach (held for 3 samples)")
    parser.add_argument("--horizon", type=float, default=2.0, help="virtual seconds a simulated run lasts at most (it stops at the target)")
    parser.add_argument("--seeds", type=int, default=2, help="simulated runs per configuration; medians are reported")
    parser.add_argument("--real", nargs="*", default=list(REAL_DEFAULT), help="topologies run as real 8-peer clusters (none: --real)")
    parser.add_argument("--real-all", action="store_true", help="every topology as a real cluster too (slow: ~1 min each)")
    parser.add_argument("--real-peers", type=int, default=8)
    parser.add_argument("--real-seeds", type=int, default=1)
    parser.add_argument("--real-timeout", type=float, default=300.0,
                        help="seconds from starting the processes (their start-up included) before a real run counts as not reached")
    parser.add_argument("--quick", action="store_true", help="4 peers, ring and complete, target 0.8, one seed, no real runs")
    parser.add_argument("--out", type=Path, help="results folder (default: experiments/results/topologies; --quick: a scratch folder)")
    args = parser.parse_args()
    args.out = harness.results_dir("topologies", args.out, args.quick)
    if args.real_all:
        args.real = available(args.real_peers)[0]
    if args.quick:
        args.peers, args.topologies, args.target, args.seeds, args.horizon, args.real = [4], ["ring", "complete"], 0.8, 1, 0.4, []
    args.out.mkdir(parents=True, exist_ok=True)
    began = time.monotonic()
    sims, skipped = simulate_all(args)
    real = real_all(args)
    rows, runs = tables(sims, real, args)
    heads = headline(rows, skipped, args)
    harness.write_csv(args.out / "results.csv", rows)
    harness.write_csv(args.out / "runs.csv", runs)
    harness.write_csv(args.out / "curves.csv", curves(sims))
    write_summary(args.out, rows, real, heads, args, time.monotonic() - began)
    plot(args.out, sims, rows, args)
    print(harness.headline(heads))


if __name__ == "__main__":
    main()
