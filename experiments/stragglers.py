"""Stragglers: gossip vs torch DDP vs a parameter server, 4 workers, one of them 4x slower.

Every system trains digits (the ~1.13M-parameter MLP) on 4 workers, worker i
on shard i with the same seed, batches, lr and momentum (experiments/harness.py):

- gossip: a coordinator and 4 `gossiptrain peer` processes (pairwise
  averaging, exponential topology, `--threads 1`), the straggler started
  with `--slowdown 4`; its accuracy is the peers' mean test accuracy;
- ddp: torch DistributedDataParallel over gloo, one process per rank;
- ps-sync / ps-async: one parameter-server process and 4 worker processes
  over ZeroMQ (experiments/baselines/param_server.py);
- hivemind (optional, only where `import hivemind` works: the `hivemind`
  extra): 4 processes, each a `hivemind.DHT` on 127.0.0.1 and a
  `hivemind.Optimizer` with local updates and parameter averaging
  (experiments/baselines/hivemind_opt.py, whose docstring has the settings
  tried and kept); its accuracy is the peers' mean test accuracy, as for
  gossip. Without hivemind one line says it is skipped and why.

The straggler (worker 0) sleeps 3x the compute time of each of its steps,
in every system. Each run goes until the test accuracy holds the target
for 3 evaluations (every 0.25 s), with and without the straggler, for each
seed; runs are interleaved (seed by seed, system by system) so that load
from anything else on the machine hits every system alike. Reported: time
to target (median of the seeds, min and max), throughput (training samples
per second, all workers together), and the ratios below.

Output in experiments/results/stragglers/: results.csv (one row per run),
curves.csv (every evaluation), summary.md, accuracy_vs_time.png,
time_to_target.png. The last line printed is a JSON object with
ddp_over_gossip_time and ps_over_gossip_time (baseline time / gossip time,
with the straggler; ps: the faster of the two server variants) and
gossip_throughput_kept (gossip throughput with / without the straggler),
and hivemind_over_gossip_time when hivemind ran.

    python experiments/stragglers.py            # 4 workers, one 4x straggler, target 0.96, 3 seeds
    python experiments/stragglers.py --quick    # 2 workers, target 0.9, 1 seed, fewer runs (smoke test)
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from experiments import harness  # noqa: E402
from experiments.baselines import hivemind_opt  # noqa: E402  (imports hivemind only when a worker runs)
from experiments.harness import Run, fmt, spread  # noqa: E402

SYSTEMS = ("gossip", "ddp", "ps-sync", "ps-async", "hivemind")
COLORS = {"gossip": "tab:green", "ddp": "tab:blue", "ps-sync": "tab:orange", "ps-async": "tab:red", "hivemind": "tab:brown"}
TARGET_DDP_RATIO = 3.0
TARGET_KEPT = 0.8


def run_one(system: str, seed: int, slowdown: float, args: argparse.Namespace) -> Run:
    workdir = args.out / "runs" / f"{system}-x{slowdown:g}-seed{seed}"
    common = dict(min_seconds=args.min_seconds)
    if system == "gossip":
        return harness.run_gossip(args.workers, seed, slowdown, args.target, args.timeout, workdir, **common)
    if system == "ddp":
        return harness.run_ddp(args.workers, seed, slowdown, args.target, args.timeout, workdir, **common)
    if system == "hivemind":
        return hivemind_opt.run_hivemind(args.workers, seed, slowdown, args.target, args.timeout, workdir, **common)
    mode = system.removeprefix("ps-")
    return harness.run_param_server(mode, args.workers, seed, slowdown, args.target, args.timeout, workdir, **common)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--slowdown", type=float, default=4.0, help="the straggler's slowdown factor")
    parser.add_argument("--target", type=float, default=0.96, help="test accuracy to reach (held for 3 evaluations)")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds of training before a run counts as not reached")
    parser.add_argument("--min-seconds", type=float, default=5.0,
                        help="a run that reaches the target sooner trains on until this long, for its throughput")
    parser.add_argument("--systems", nargs="+", default=list(SYSTEMS), choices=SYSTEMS,
                        help="hivemind runs only where `import hivemind` works (the hivemind extra)")
    parser.add_argument("--quick", action="store_true", help="2 workers, target 0.9, 1 seed; baselines only with the straggler")
    parser.add_argument("--out", type=Path, help="results folder (default: experiments/results/stragglers; --quick: a scratch folder)")
    parser.add_argument("--summarise", action="store_true",
                        help="run nothing: rewrite summary.md and the plots from results.csv and curves.csv in --out")
    args = parser.parse_args()
    args.out = harness.results_dir("stragglers", args.out, args.quick)
    if args.summarise:
        runs, wall, crashes = load_runs(args)
        rows, table = summarise(runs, args)
        heads = headline(table, args)
        write_results(args.out, runs, rows, table, heads, args, wall, crashes)
        print(harness.headline(heads))
        return
    args.hivemind_skipped = hivemind_opt.unavailable() if "hivemind" in args.systems else "not in --systems"
    if "hivemind" in args.systems and args.hivemind_skipped:
        print(f"hivemind: skipped, {args.hivemind_skipped}", flush=True)
    systems = [s for s in args.systems if s != "hivemind" or not args.hivemind_skipped]
    plan: list[tuple[str, float]] = [(s, f) for f in (1.0, args.slowdown) for s in systems]
    if args.quick:
        args.workers, args.target, args.seeds, args.timeout, args.min_seconds = 2, 0.9, 1, 60.0, 1.5
        plan = [("gossip", 1.0), ("gossip", args.slowdown), ("ddp", args.slowdown), ("ps-async", args.slowdown)]
        plan += [("hivemind", args.slowdown)] if "hivemind" in systems else []
    args.out.mkdir(parents=True, exist_ok=True)
    began = time.monotonic()

    runs: list[Run] = []
    crashes: list[str] = []
    for seed in range(args.seeds):
        for system, slowdown in plan:
            run, failed = harness.retried(lambda: run_one(system, seed, slowdown, args), f"{system} x{slowdown:g} seed {seed}")
            run.extra["retries"] = len(failed)
            crashes += failed
            runs.append(run)
            ttt = run.time_to_target
            print(
                f"seed {seed} {system:>8} x{slowdown:g}: time to {args.target} "
                f"{'not reached' if ttt is None else f'{ttt:.2f} s'}, {run.throughput:.0f} samples/s, "
                f"final acc {run.final_acc:.3f} (setup {run.setup_seconds:.1f} s, not counted)",
                flush=True,
            )
    rows, table = summarise(runs, args)
    heads = headline(table, args)
    write_results(args.out, runs, rows, table, heads, args, time.monotonic() - began, crashes)
    print(harness.headline(heads))


def summarise(runs: list[Run], args: argparse.Namespace) -> tuple[list[dict[str, Any]], dict[tuple[str, float], dict[str, Any]]]:
    rows = []
    for r in runs:
        rows.append({
            "system": r.system, "slowdown": r.slowdown, "seed": r.seed, "workers": args.workers, "target": args.target,
            "time_to_target_s": "" if r.time_to_target is None else round(r.time_to_target, 3),
            "samples_to_target": "" if r.samples_to_target is None else r.samples_to_target,
            "throughput_samples_per_s": round(r.throughput, 1), "final_acc": round(r.final_acc, 4),
            "evaluations": len(r.points), "setup_s": round(r.setup_seconds, 2),
            "exchanges_per_peer": rounded(r.extra.get("exchanges_per_peer"), 2), "exchange_rtt_ms": rounded(r.extra.get("rtt_ms"), 2),
            "retries": r.extra.get("retries", 0), "ddp_rank0_compute_ms": r.extra.get("compute_ms_rank0", ""),
            "exchanges_per_step": "" if exchanges_per_step(r) is None else round(exchanges_per_step(r), 3),
            **({} if r.system != "hivemind" else {  # columns that exist only when hivemind ran
                "hivemind_averaged_per_peer": rounded(r.extra.get("averaged_per_peer"), 2),
                "hivemind_averaging_failed_per_peer": rounded(r.extra.get("averaging_failed_per_peer"), 2),
                "hivemind_out_of_sync_per_peer": rounded(r.extra.get("out_of_sync_per_peer"), 2),
                "hivemind_group_size_mean": rounded(r.extra.get("group_size_mean"), 2),
                "hivemind_settings": settings_text(r),
            }),
        })
    table: dict[tuple[str, float], dict[str, Any]] = {}
    for key in sorted({(r.system, r.slowdown) for r in runs}, key=lambda k: (SYSTEMS.index(k[0]), k[1])):
        group = [r for r in runs if (r.system, r.slowdown) == key]
        t_med, t_min, t_max = spread([r.time_to_target for r in group])
        table[key] = {
            "time": t_med, "time_min": t_min, "time_max": t_max,
            "throughput": spread([r.throughput for r in group])[0],
            "throughput_min": spread([r.throughput for r in group])[1],
            "throughput_max": spread([r.throughput for r in group])[2],
            "compute_ms_rank0": spread([r.extra.get("compute_ms_rank0") for r in group])[0],
            "samples": spread([r.samples_to_target for r in group])[0],
            "exchanges_per_step": spread([exchanges_per_step(r) for r in group])[0],
            "final_acc": spread([r.final_acc for r in group])[0],
            "runs": len(group),
        }
    return rows, table


def rounded(x: float | None, digits: int) -> float | str:
    return "" if x is None else round(x, digits)


def exchanges_per_step(run: Run) -> float | None:
    """Exchanges a gossip peer took part in (as initiator or partner) per local step, averaged over peers."""
    if "exchanges_per_step" in run.extra:  # read back from results.csv
        return run.extra["exchanges_per_step"]
    if run.system != "gossip":  # hivemind's runs have steps too, but no exchanges
        return None
    steps = run.extra.get("steps")
    return run.extra["exchanges_per_peer"] / max(1.0, sum(steps) / len(steps)) if steps else None


def load_runs(args: argparse.Namespace) -> tuple[list[Run], float, list[str]]:
    """The runs written to results.csv and curves.csv by an earlier run of this script (for --summarise)."""
    import csv
    import re

    def num(x: str) -> float | None:
        return None if x == "" else float(x)

    with open(args.out / "results.csv", newline="") as fh:
        rows = list(csv.DictReader(fh))
    with open(args.out / "curves.csv", newline="") as fh:
        curves = list(csv.DictReader(fh))
    runs = []
    for row in rows:
        key = (row["system"], float(row["slowdown"]), int(row["seed"]))
        points = [
            harness.Point(float(c["elapsed_s"]), int(c["samples"]), float(c["test_acc"]))
            for c in curves if (c["system"], float(c["slowdown"]), int(c["seed"])) == key
        ]
        extra: dict[str, Any] = {"retries": int(row.get("retries") or 0), "compute_ms_rank0": num(row.get("ddp_rank0_compute_ms", ""))}
        if row["system"] == "gossip":
            extra.update(exchanges_per_peer=num(row["exchanges_per_peer"]), rtt_ms=num(row["exchange_rtt_ms"]),
                         exchanges_per_step=num(row.get("exchanges_per_step", "")))
        if row["system"] == "hivemind":
            extra.update({k: num(row.get(f"hivemind_{k}", "")) for k in (
                "averaged_per_peer", "averaging_failed_per_peer", "out_of_sync_per_peer", "group_size_mean")})
            extra["settings"] = row.get("hivemind_settings", "")
        runs.append(Run(key[0], key[2], key[1], points, float(row["target"]), setup_seconds=float(row["setup_s"]), extra=extra))
    args.workers, args.target = int(rows[0]["workers"]), float(rows[0]["target"])
    args.seeds = len({r.seed for r in runs})
    args.slowdown = max(r.slowdown for r in runs)
    args.hivemind_skipped = None if any(r.system == "hivemind" for r in runs) else "not in results.csv"
    found = re.search(r"Wall time of this run: (\d+) s", (args.out / "summary.md").read_text()) if (args.out / "summary.md").exists() else None
    crashes = [f"{r.system} x{r.slowdown:g} seed {r.seed}: repeated {r.extra['retries']} time(s)" for r in runs if r.extra["retries"]]
    return runs, float(found.group(1)) if found else math.nan, crashes


def ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or math.isinf(a) or math.isinf(b) or b <= 0:
        return None
    return round(a / b, 3)


def headline(table: dict[tuple[str, float], dict[str, Any]], args: argparse.Namespace) -> dict[str, Any]:
    s = args.slowdown

    def t(system: str, f: float) -> float | None:
        row = table.get((system, f))
        return None if row is None else row["time"]

    def tp(system: str, f: float) -> float | None:
        row = table.get((system, f))
        return None if row is None else row["throughput"]

    ps_times = [x for x in (t("ps-sync", s), t("ps-async", s)) if x is not None]
    best_ps = min(ps_times) if ps_times else None
    out = {
        "ddp_over_gossip_time": ratio(t("ddp", s), t("gossip", s)),
        "ps_over_gossip_time": ratio(best_ps, t("gossip", s)),
        "gossip_throughput_kept": ratio(tp("gossip", s), tp("gossip", 1.0)),
        "ps_sync_over_gossip_time": ratio(t("ps-sync", s), t("gossip", s)),
        "ps_async_over_gossip_time": ratio(t("ps-async", s), t("gossip", s)),
        "ddp_throughput_kept": ratio(tp("ddp", s), tp("ddp", 1.0)),
        **({"hivemind_over_gossip_time": ratio(t("hivemind", s), t("gossip", s))} if ("hivemind", s) in table else {}),
        "times_s": {f"{k[0]} x{k[1]:g}": (None if math.isinf(v["time"]) else round(v["time"], 3)) for k, v in table.items()},
        "workers": args.workers,
        "slowdown": s,
        "target": args.target,
        "seeds": args.seeds,
    }
    return out


def misses(table: dict[tuple[str, float], dict[str, Any]], heads: dict[str, Any], args: argparse.Namespace) -> list[str]:
    """One sentence per missed target: by how much, and the measured numbers that say why."""
    s = args.slowdown
    lines = []
    g1, gs = table.get(("gossip", 1.0)), table.get(("gossip", s))
    d1, ds = table.get(("ddp", 1.0)), table.get(("ddp", s))
    r = heads["ddp_over_gossip_time"]
    if r is not None and r < TARGET_DDP_RATIO and gs and ds:
        why = f"with the straggler DDP took {ds['time']:.2f} s and gossip {gs['time']:.2f} s (per seed {gs['time_min']:.2f}-{gs['time_max']:.2f} s)"
        kept = heads["ddp_throughput_kept"]
        if d1 and kept:
            batch = harness.run_config(args.workers, 0).train.batch_size * args.workers  # samples per DDP step
            step1, step_s = 1e3 * batch / d1["throughput"], 1e3 * batch / ds["throughput"]
            why += (
                f". Here the straggler cost DDP little: a DDP step took "
                f"{step1:.0f} ms without it, only {d1['compute_ms_rank0']:.1f} ms of which compute, the rest the all-reduce "
                f"of the 4.5 MB of parameters and waiting for it; the straggler's sleep ({s - 1:g} x {ds['compute_ms_rank0']:.1f} ms) "
                f"made it {step_s:.0f} ms, so DDP kept {kept} of its throughput, and even a gossip that lost nothing to the "
                f"straggler and matched DDP's own no-straggler time would be only 1/{kept} = {1 / kept:.2f}x faster"
            )
            if ds["compute_ms_rank0"] < 0.8 * d1["compute_ms_rank0"]:
                why += (
                    f". With {args.workers} workers sharing 2 cores the straggler is also less slow than {s:g}x: its steps "
                    f"computed in {ds['compute_ms_rank0']:.1f} ms against {d1['compute_ms_rank0']:.1f} ms for the same rank "
                    f"without a straggler (while it sleeps it competes less for the CPU), so with its sleep a step of it took "
                    f"{s * ds['compute_ms_rank0']:.0f} ms, {s * ds['compute_ms_rank0'] / d1['compute_ms_rank0']:.1f}x a normal "
                    f"worker's step on this machine, not {s:g}x"
                )
        if g1 and d1:
            similar = 0.8 <= g1["throughput"] / d1["throughput"] <= 1.25
            why += (
                f". Nor was gossip faster than DDP without a straggler ({g1['time']:.2f} s to {d1['time']:.2f} s): "
                f"{'at a similar throughput' if similar else 'at a throughput of'} ({g1['throughput']:.0f} vs "
                f"{d1['throughput']:.0f} samples/s) its peers needed {fmt(g1['samples'], 0)} samples to DDP's "
                f"{fmt(d1['samples'], 0)} before their mean test accuracy held the target: their models differ between "
                f"exchanges (each peer took part in {g1['exchanges_per_step']:.2f} exchanges per local step)"
            )
        lines.append(f"DDP time / gossip time is {r:.2f}, short of the {TARGET_DDP_RATIO:g} target by {TARGET_DDP_RATIO - r:.2f}: {why}.")
    elif r is None and ("ddp", s) in table:
        lines.append("DDP time / gossip time could not be computed: a system did not reach the target in every seed.")
    k = heads["gossip_throughput_kept"]
    if k is not None and k < TARGET_KEPT and g1 and gs:
        overlap = gs["throughput_max"] >= g1["throughput_min"]
        lines.append(
            f"Gossip kept {k:.2f} of its no-straggler throughput, short of {TARGET_KEPT} by {TARGET_KEPT - k:.2f} "
            f"(medians {gs['throughput']:.0f} vs {g1['throughput']:.0f} samples/s; per seed "
            f"{gs['throughput_min']:.0f}-{gs['throughput_max']:.0f} with the straggler, {g1['throughput_min']:.0f}-"
            f"{g1['throughput_max']:.0f} without). "
            + ("The ranges overlap: the difference is within this shared machine's run-to-run noise. " if overlap else "")
            + f"On dedicated machines the straggler alone would cost (1 - 1/{s:g}) / {args.workers} of the samples, "
            f"leaving {(args.workers - 1 + 1 / s) / args.workers:.2f}."
        )
    return lines


def write_results(
    out: Path, runs: list[Run], rows: list[dict[str, Any]], table: dict[tuple[str, float], dict[str, Any]],
    heads: dict[str, Any], args: argparse.Namespace, wall: float, crashes: list[str],
) -> None:
    harness.write_csv(out / "results.csv", rows)
    harness.write_csv(out / "curves.csv", [
        {"system": r.system, "slowdown": r.slowdown, "seed": r.seed, "elapsed_s": p.elapsed, "samples": p.samples, "test_acc": round(p.acc, 4)}
        for r in runs for p in r.points
    ])
    s = args.slowdown
    lines = [
        "# Stragglers: gossip vs DDP vs a parameter server",
        "",
        f"{args.workers} workers on digits (MLP, 1.13M parameters), worker 0 slowed {s:g}x (it sleeps {s - 1:g}x the compute "
        f"time of each of its steps), time to a test accuracy of {args.target} held for {harness.HOLD} evaluations, "
        f"counted from the start of training; medians of {args.seeds} seed(s), [min, max]. Throughput: training samples "
        f"per second, all workers together, from a run's first evaluation to its last (a run trains for at least "
        f"{args.min_seconds:g} s). All processes on one 2-core machine (127.0.0.1), one torch thread each; "
        f"other work was running on the machine at the same time, so single numbers are noisy. " + hivemind_note(runs, args),
        "",
        "| system | straggler | time to target (s) [min, max] | samples to target | throughput (samples/s) [min, max] | final test acc |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for (system, f), row in table.items():
        lines.append(
            f"| {system} | {'x' + format(f, 'g') if f > 1 else 'none'} | {fmt(row['time'])} [{fmt(row['time_min'])}, "
            f"{fmt(row['time_max'])}] | {fmt(row['samples'], 0)} | {row['throughput']:.0f} [{row['throughput_min']:.0f}, "
            f"{row['throughput_max']:.0f}] | {row['final_acc']:.3f} |"
        )
    lines += [
        "",
        "Headline (with the straggler; ps: the faster server variant):",
        "",
        f"- DDP time / gossip time: **{heads['ddp_over_gossip_time']}** (target >= {TARGET_DDP_RATIO:g})",
        f"- parameter server time / gossip time: **{heads['ps_over_gossip_time']}** "
        f"(sync {heads['ps_sync_over_gossip_time']}, async {heads['ps_async_over_gossip_time']})",
        f"- gossip throughput with / without the straggler: **{heads['gossip_throughput_kept']}** (target >= {TARGET_KEPT}); "
        f"DDP's: {heads['ddp_throughput_kept']}",
    ]
    if "hivemind_over_gossip_time" in heads:
        lines.append(f"- hivemind time / gossip time: **{heads['hivemind_over_gossip_time']}**")
    lines += [""]
    missed = misses(table, heads, args)
    lines += (["Missed targets:", ""] + [f"- {m}" for m in missed] + [""]) if missed else ["All targets met.", ""]
    if crashes:
        lines += [f"Runs repeated after a process crashed ({len(crashes)}):", ""] + [f"- {c}" for c in crashes] + [""]
    lines += [
        "Notes: the async parameter server applies each gradient with lr / workers, the same step per sample as the sync "
        "server and DDP (with the full lr it diverges); on one shared machine a sleeping straggler frees CPU for the others, "
        "which helps the asynchronous systems (gossip, async server) and not the synchronous ones, whose workers wait.",
        "",
        f"Wall time of this run: {wall:.0f} s. Regenerate: `python experiments/stragglers.py{' --quick' if args.quick else ''}`",
        "",
        "![accuracy vs time](accuracy_vs_time.png) ![time to target](time_to_target.png)",
    ]
    (out / "summary.md").write_text("\n".join(lines) + "\n")
    plot(out, runs, table, args)


def settings_text(run: Run) -> str:
    """hivemind's settings of ``run`` as "key=value, ..." (read back as text from results.csv)."""
    settings = run.extra.get("settings") or ""
    return settings if isinstance(settings, str) else ", ".join(f"{k}={v}" for k, v in settings.items())


def hivemind_note(runs: list[Run], args: argparse.Namespace) -> str:
    """The summary's sentence on hivemind: the settings it ran with and its averaging, or why it did not run."""
    mine = [r for r in runs if r.system == "hivemind"]
    if not mine:
        return f"hivemind: not run ({getattr(args, 'hivemind_skipped', None) or 'not in --systems'})."
    settings = settings_text(mine[0]) or "the settings of experiments/baselines/hivemind_opt.py"
    per_run = "; ".join(
        f"x{r.slowdown:g} seed {r.seed}: {fmt(r.extra.get('averaged_per_peer') or 0.0, 1)} averaged, "
        f"{fmt(r.extra.get('averaging_failed_per_peer') or 0.0, 1)} failed"
        for r in mine
    )
    return (
        "hivemind: `hivemind.Optimizer(use_local_updates=True)` (experiments/baselines/hivemind_opt.py), "
        + settings
        + f"; its accuracy is the peers' mean, as for gossip. Averaging rounds per peer ({per_run})."
    )


def plot(out: Path, runs: list[Run], table: dict[tuple[str, float], dict[str, Any]], args: argparse.Namespace) -> None:
    plt = harness.pyplot()
    slowdowns = sorted({r.slowdown for r in runs})
    fig, axes = plt.subplots(1, len(slowdowns), figsize=(5.5 * len(slowdowns), 4), sharey=True, squeeze=False)
    for ax, f in zip(axes[0], slowdowns):
        labelled: set[str] = set()
        for r in runs:
            if r.slowdown != f or not r.points:
                continue
            label = r.system if r.system not in labelled else None
            labelled.add(r.system)
            ax.plot([p.elapsed for p in r.points], [p.acc for p in r.points], color=COLORS[r.system], alpha=0.8, lw=1.2, label=label)
        ax.axhline(args.target, color="grey", ls="--", lw=0.8)
        ax.set_title(f"{args.workers} workers, " + (f"worker 0 {f:g}x slower" if f > 1 else "no straggler"))
        ax.set_xlabel("seconds since training started")
        ax.set_ylim(0.5, 1.0)
        ax.legend(loc="lower right")
    peers_mean = "gossip, hivemind" if any(r.system == "hivemind" for r in runs) else "gossip"
    axes[0][0].set_ylabel(f"test accuracy ({peers_mean}: mean over peers)")
    fig.tight_layout()
    fig.savefig(out / "accuracy_vs_time.png", dpi=80)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6, 3.5))
    systems = [s for s in SYSTEMS if any(k[0] == s for k in table)]
    width = 0.8 / max(1, len(slowdowns))
    for j, f in enumerate(slowdowns):
        xs, ys, lo, hi = [], [], [], []
        for i, s in enumerate(systems):
            row = table.get((s, f))
            if row is None or math.isinf(row["time"]):
                continue
            xs.append(i + j * width)
            ys.append(row["time"])
            lo.append(row["time"] - row["time_min"])
            hi.append(0.0 if math.isinf(row["time_max"]) else row["time_max"] - row["time"])
        ax.bar(xs, ys, width, yerr=[lo, hi], capsize=3, label="no straggler" if f == 1 else f"worker 0 {f:g}x slower",
               color="tab:grey" if f == 1 else "tab:purple", alpha=0.8)
    ax.set_xticks([i + width * (len(slowdowns) - 1) / 2 for i in range(len(systems))], systems)
    ax.set_ylabel(f"seconds to test acc {args.target}")
    finite = [row["time_max"] for row in table.values() if not math.isinf(row["time_max"])]
    ax.set_ylim(0, 1.3 * max(finite, default=1.0))  # room for the legend above the bars
    ax.legend(loc="upper left", ncol=2, fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "time_to_target.png", dpi=80)
    plt.close(fig)


if __name__ == "__main__":
    main()
