"""Compression: bytes to a target accuracy and final accuracy for every codec the exchanges offer.

8 simulated peers (`gossiptrain.sim`, the experiments' harness) train digits
(the ~1.13M-parameter MLP, 4.5 MB of float32 parameters, peer i on shard i)
on the exponential graph with each `gossip.compression`:

- `pairwise` (AD-PSGD, the runtime's default): none, fp16, bf16, int8 (one
  scale per tensor). Each end moves toward what the other decoded.
- `neighbor` (D-PSGD): none, fp16, bf16, int8 and `topk:ratio=0.1`. Top-k
  sends the largest 10% of the change against a reference both ends of an
  edge keep (CHOCO-gossip, with error feedback and a dense resync every 32
  messages), which needs per-edge state: only `neighbor` and `local-sgd` keep
  it, and the configuration refuses it with `pairwise`. `neighbor` is the
  choice because CHOCO-SGD is compressed D-PSGD, with a round every step as
  here; `local-sgd` would also change how often peers communicate (every 8
  steps), mixing two effects. Top-k is compared with `neighbor` without
  compression, the other codecs with their own algorithm's `none`.

Links are those of the other simulated sweeps: 1 GB/s (`--bandwidth`) and
0.5 ms latency, so a whole model takes 4.5 ms on the wire against a 6 ms
local step (virtual time, one core per peer): the network is not the
bottleneck, and a codec changes the bytes far more than the time. (On slower
links, e.g. `--bandwidth 1.25e8`, uncompressed neighbor rounds fill the
links' send queues and merge models many steps old.) Each run lasts
`--horizon` (1.5) virtual seconds, sampled every 0.05 s; medians over
`--seeds` seeds. Reported: bytes each peer sent by the time the mean test
accuracy held the target for 3 samples (after compression; mean over
peers), the time to it, and the final accuracy (the last 3 samples). The
target is 0.9, not the 0.95 of the other sweeps: `neighbor` learns about
four times slower than `pairwise` here (see the README) and reaches 0.95
only after about 2.5 virtual s.

`--real` also runs the pairwise codecs as real loopback clusters (a
coordinator and `--real-peers` `gossiptrain peer` processes, as
experiments/stragglers.py starts them), until the target holds.

Output in experiments/results/compression/: results.csv (one row per
algorithm and codec), runs.csv (one per run), summary.md, compression.png
(bytes to target and final accuracy). The last line printed is a JSON
object:

- bytes_saved_fp16, bytes_saved_bf16, bytes_saved_int8: bytes to the target
  without compression / with the codec, pairwise (2: half the bytes);
  bytes_saved_topk: the same for topk:ratio=0.1 against neighbor's none;
- acc_gap_points_fp16, ..._int8, acc_gap_points_topk: final accuracy without
  compression minus with it, in points (positive: the codec lost accuracy);
- bytes_saved, acc_gap_points, time_to_target_s, final_acc:
  {algorithm: {codec: value}} for every configuration (null: not reached);
- real: {codec: {"time_to_target_s", "bytes_to_target"}} when --real ran;
- target, seeds, horizon_s, peers, bandwidth.

    python experiments/compression.py            # 8 peers, pairwise x 4 codecs, neighbor x 5 codecs, target 0.9, 2 seeds
    python experiments/compression.py --real     # ... and pairwise's codecs as real 4-peer clusters
    python experiments/compression.py --quick    # 4 peers, pairwise none/int8 and neighbor topk, short (smoke test)
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

DENSE = ("none", "fp16", "bf16", "int8")
TOPK = "topk:ratio=0.1"
PLAN = {"pairwise": DENSE, "neighbor": (*DENSE, TOPK)}


def short(codec: str) -> str:
    """topk:ratio=0.1 -> topk, for the headline's keys."""
    return codec.partition(":")[0]


def sweep(args: argparse.Namespace) -> dict[tuple[str, str], list[SimRun]]:
    """Every (algorithm, codec) over the seeds; one progress line per configuration."""
    from gossiptrain.net.transport.sim import LinkProfile

    link = LinkProfile(latency=args.latency, bandwidth=args.bandwidth)
    runs: dict[tuple[str, str], list[SimRun]] = {}
    for algorithm, codecs in args.plan.items():
        for codec in codecs:
            overrides = {"gossip.topology": args.topology, "gossip.algorithm": algorithm, "gossip.compression": codec}
            group = [
                harness.run_sim(f"{algorithm} {codec}", args.peers, seed, overrides, args.target, args.horizon, link=link)
                for seed in range(args.seeds)
            ]
            runs[(algorithm, codec)] = group
            med = harness.sim_medians(group)
            reached = math.isfinite(med["time_to_target_s"])
            print(
                f"{algorithm:>9} {codec:>15}: "
                + (f"{med['bytes_to_target'] / 1e6:.1f} MB/peer to {args.target} in {med['time_to_target_s']:.2f} s, " if reached
                   else f"{args.target} not reached, ")
                + f"final acc {med['final_acc']:.3f} "
                f"({med['reached']}/{len(group)} seeds reached; wall {sum(r.wall_seconds for r in group):.0f} s)",
                flush=True,
            )
    return runs


def real_runs(args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """pairwise's codecs as real loopback clusters (harness.run_gossip), one seed each."""
    out: dict[str, dict[str, Any]] = {}
    for codec in args.plan.get("pairwise", ()):
        workdir = args.out / "runs" / f"real-{codec}"
        run, _ = harness.retried(
            lambda: harness.run_gossip(args.real_peers, 0, 1.0, args.target, args.real_timeout, workdir,
                                       topology=args.topology, gossip={"gossip.compression": codec}),
            f"real {codec}",
        )
        ttt = run.time_to_target
        sent = None if ttt is None else harness.gossip_bytes_at(workdir, args.real_peers, ttt)
        out[codec] = {"time_to_target_s": harness.finite_or_none(ttt), "bytes_to_target": harness.finite_or_none(sent, 0),
                      "final_acc": round(run.final_acc, 4)}
        print(f"real {args.real_peers} peers {codec:>6}: {fmt((sent or math.inf) / 1e6, 1)} MB/peer, time to {args.target} "
              f"{harness.fmt_seconds(ttt or math.inf)} (setup {run.setup_seconds:.1f} s, not counted)", flush=True)
    return out


def tables(runs: dict[tuple[str, str], list[SimRun]], args: argparse.Namespace) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    rows, per_run = [], []
    for (algorithm, codec), group in runs.items():
        med = harness.sim_medians(group)
        base = harness.sim_medians(runs[(algorithm, "none")]) if (algorithm, "none") in runs else None
        saved = base["bytes_to_target"] / med["bytes_to_target"] if base and math.isfinite(med["bytes_to_target"]) else math.nan
        rows.append({
            "algorithm": algorithm, "codec": codec, "peers": args.peers, "seeds": len(group), "target": args.target,
            "bytes_to_target": harness.finite_or_none(med["bytes_to_target"], 0),
            "bytes_saved": harness.finite_or_none(saved),
            "time_to_target_s": harness.finite_or_none(med["time_to_target_s"]),
            "final_acc": round(med["final_acc"], 4),
            "acc_gap_points": round(100 * (base["final_acc"] - med["final_acc"]), 2) if base else None,
            "bytes_per_peer_total": round(statistics.median(r.bytes_sent[-1] for r in group)),
            "exchanges_per_peer": round(statistics.median(r.extra["exchanges_per_peer"] or 0 for r in group), 1),
            "final_consensus": round(statistics.median(r.consensus[-1] for r in group), 4),
            "wall_s": round(sum(r.wall_seconds for r in group), 1),
        })
        per_run += [{
            "algorithm": algorithm, "codec": codec, "seed": r.seed, "bytes_to_target": r.bytes_to_target,
            "time_to_target_s": r.time_to_target, "final_acc": round(r.final_acc, 4), "wall_s": round(r.wall_seconds, 1),
        } for r in group]
    return rows, per_run


def headline(rows: list[dict[str, Any]], real: dict[str, dict[str, Any]], args: argparse.Namespace) -> dict[str, Any]:
    def pick(key: str) -> dict[str, dict[str, Any]]:
        return {a: {short(r["codec"]): r[key] for r in rows if r["algorithm"] == a} for a in args.plan}

    saved, gap = pick("bytes_saved"), pick("acc_gap_points")
    flat: dict[str, Any] = {}
    for codec in ("fp16", "bf16", "int8"):
        flat[f"bytes_saved_{codec}"] = saved.get("pairwise", {}).get(codec)
        flat[f"acc_gap_points_{codec}"] = gap.get("pairwise", {}).get(codec)
    for algorithm in args.plan:  # top-k: whichever algorithm ran it (neighbor by default)
        if "topk" in saved[algorithm]:
            flat["bytes_saved_topk"], flat["acc_gap_points_topk"] = saved[algorithm]["topk"], gap[algorithm]["topk"]
    return {
        **flat,
        "bytes_saved": saved, "acc_gap_points": gap,
        "time_to_target_s": pick("time_to_target_s"), "final_acc": pick("final_acc"),
        "real": real,
        "target": args.target, "seeds": args.seeds, "horizon_s": args.horizon, "peers": args.peers, "bandwidth": args.bandwidth,
    }


def write_summary(
    out: Path, rows: list[dict[str, Any]], real: dict[str, dict[str, Any]], args: argparse.Namespace, wall: float
) -> None:
    def opt(x: Any, spec: str, scale: float = 1.0) -> str:
        return "not reached" if x is None else format(x / scale, spec)

    header = ["algorithm", "codec", f"MB sent per peer to {args.target}", "bytes saved (x)", f"time to {args.target} (s)",
              "final acc", "acc gap (points)", f"MB sent per peer in {args.horizon:g} s", "exchanges per peer"]
    table = [
        [r["algorithm"], r["codec"], opt(r["bytes_to_target"], ".1f", 1e6), opt(r["bytes_saved"], ".2f"),
         opt(r["time_to_target_s"], ".2f"), f"{r['final_acc']:.3f}", opt(r["acc_gap_points"], "+.2f"),
         f"{r['bytes_per_peer_total'] / 1e6:.0f}", r["exchanges_per_peer"]]
        for r in rows
    ]
    lines = [
        "# Compression: bytes to a target accuracy and final accuracy per codec",
        "",
        f"{args.peers} simulated peers, digits (MLP, 1.13M parameters = 4.5 MB in float32, iid shards), `{args.topology}` "
        f"graph; every peer on its own core, a local step {harness.SIM_STEP_TIME * 1e3:g} ms of virtual time, links "
        f"{args.latency * 1e3:g} ms / {args.bandwidth:.3g} bytes/s, {args.horizon:g} virtual s per run, sampled every "
        f"{harness.SIM_SAMPLE_EVERY:g} s; target: mean test accuracy {args.target} held for {harness.HOLD} samples; "
        f"bytes: sent per peer (mean) after compression, membership traffic included; bytes saved: the algorithm's "
        f"`none` / the codec's bytes to the target; acc gap: `none`'s final accuracy minus the codec's (final: mean of "
        f"the last {harness.HOLD} samples); medians of {args.seeds} seed(s). `{TOPK}` runs with `neighbor` (D-PSGD) "
        f"because top-k sends differences against per-edge references (CHOCO-gossip) that `pairwise` does not keep.",
        "",
        *harness.markdown_table(header, table),
        "",
        "Reading the `neighbor` rows: it pushes its model to every neighbour each round, so it sends several times "
        "pairwise's bytes for the same progress; its dense merge mixes the neighbours' models against the one it sent "
        "them and keeps its own steps since (x <- x + sum_j w_j (x_j - s)), as top-k's CHOCO update does with references.",
    ]
    if real:
        lines += [
            "",
            f"Real loopback clusters ({args.real_peers} `gossiptrain peer` processes, pairwise, 2 shared cores, one seed):",
            "",
            *harness.markdown_table(
                ["codec", f"MB sent per peer to {args.target}", f"time to {args.target} (s)"],
                [[c, opt(v["bytes_to_target"], ".1f", 1e6), opt(v["time_to_target_s"], ".2f")] for c, v in real.items()],
            ),
        ]
    lines += [
        "",
        f"Wall time of this run: {wall:.0f} s. Regenerate: `python experiments/compression.py{' --quick' if args.quick else ''}`"
        + (" (`--real` adds real loopback clusters)" if not args.quick else ""),
        "",
        "![compression](compression.png)",
    ]
    (out / "summary.md").write_text("\n".join(lines) + "\n")


def plot(out: Path, rows: list[dict[str, Any]], args: argparse.Namespace) -> None:
    plt = harness.pyplot()
    labels = [f"{r['algorithm']}\n{short(r['codec'])}" for r in rows]
    colors = ["tab:blue" if r["algorithm"] == "pairwise" else "tab:orange" for r in rows]
    fig, axes = plt.subplots(1, 2, figsize=(max(8, 1.1 * len(rows) + 3), 3.8))
    axes[0].bar(labels, [(r["bytes_to_target"] or 0) / 1e6 for r in rows], color=colors)
    for x, r in enumerate(rows):
        if r["bytes_to_target"] is None:
            axes[0].text(x, 0, "not reached", rotation=90, ha="center", va="bottom", fontsize=7, color="tab:red")
    axes[0].set_ylabel(f"MB sent per peer to {args.target}")
    axes[1].bar(labels, [r["final_acc"] for r in rows], color=colors)
    finals = [r["final_acc"] for r in rows]
    axes[1].set_ylim(max(0.0, min(finals) - 0.02), min(1.0, max(finals) + 0.01))
    axes[1].set_ylabel(f"final mean test acc (after {args.horizon:g} s)")
    for ax in axes:
        ax.tick_params(axis="x", labelsize=7)
    fig.suptitle(f"{args.peers} peers, {args.topology}, links {args.bandwidth:.3g} B/s (simulated, median of {args.seeds} seed(s))",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(out / "compression.png", dpi=80)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--peers", type=int, default=8)
    parser.add_argument("--topology", default="exponential")
    parser.add_argument("--algorithms", nargs="+", default=list(PLAN), choices=list(PLAN))
    parser.add_argument("--bandwidth", type=float, default=1e9, help="bytes/s of every simulated link")
    parser.add_argument("--latency", type=float, default=0.0005, help="one-way seconds of every simulated link")
    parser.add_argument("--target", type=float, default=0.9, help="mean test accuracy to reach (held for 3 samples)")
    parser.add_argument("--horizon", type=float, default=1.5, help="virtual seconds per run")
    parser.add_argument("--seeds", type=int, default=2, help="runs per configuration; medians are reported")
    parser.add_argument("--real", action="store_true", help="also run pairwise's codecs as real loopback clusters")
    parser.add_argument("--real-peers", type=int, default=4)
    parser.add_argument("--real-timeout", type=float, default=120.0)
    parser.add_argument("--quick", action="store_true", help="4 peers; pairwise none and int8, neighbor none and topk; 0.2 s, target 0.5")
    parser.add_argument("--out", type=Path, help="results folder (default: experiments/results/compression; --quick: a scratch folder)")
    args = parser.parse_args()
    args.out = harness.results_dir("compression", args.out, args.quick)
    args.plan = {a: PLAN[a] for a in args.algorithms}
    if args.quick:
        args.peers, args.target, args.seeds, args.horizon, args.real = 4, 0.5, 1, 0.2, False
        args.plan = {"pairwise": ("none", "int8"), "neighbor": ("none", TOPK)}
    args.out.mkdir(parents=True, exist_ok=True)
    began = time.monotonic()
    runs = sweep(args)
    real = real_runs(args) if args.real else {}
    rows, per_run = tables(runs, args)
    heads = headline(rows, real, args)
    harness.write_csv(args.out / "results.csv", rows)
    harness.write_csv(args.out / "runs.csv", per_run)
    write_summary(args.out, rows, real, args, time.monotonic() - began)
    plot(args.out, rows, args)
    print(harness.headline(heads))


if __name__ == "__main__":
    main()
