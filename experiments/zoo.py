"""A workload zoo: do the runtime's defaults ever do worse than plain averaging, on workloads nobody tuned them on?

Each cell is a workload of ``peers.zoo`` (its own model, optimizer, schedule
and clipping: the user's loop), a partition of its data over 4 peers, a link
and a batch size. Four arms train it in the simulator (`gossiptrain.sim`,
virtual time, real torch steps), median of ``--seeds`` seeds:

- ``alone``: one machine on all the data (``train.shards=1``, 1 worker of the
  simulated DDP baseline: the user's loop, untouched, nothing exchanged);
- ``ddp``: the simulated DDP baseline over 4 workers (``sim.system="ddp"``:
  gradients averaged, one optimizer step per step, a ring all-reduce costed on
  the cell's link);
- ``plain``: pairwise gossip with every added method off (``PLAIN``, printed
  in summary.md: local momentum, no drift correction, no rate scaling, no
  compression, and a flow-control bound never reached: pairwise's
  ``hold_until`` waits only once ``steps since the last merge >=
  max_steps_ahead``, and a non-zero value is used as it is);
- ``defaults``: ``RunConfig()``'s gossip section as it is.

Per run: the time to the cell's target (the peers' mean of the cell's metric,
sampled every ``sample_every`` virtual s, at or past the target for ``HOLD``
samples in a row: the first of them), the final metric (the mean of the last
``HOLD`` samples), and whether any peer's (or the DDP model's) parameters
ended non-finite or a sampled test loss was ever non-finite; also what the
stability guard did (``guard_backed_off``: the most methods each peer had
backed off at a sample, summed over peers; ``guard_restores``): a restore (a
model that went non-finite, put back) counts as non-finite in (a).
Digits cells aim at the mean test accuracy; charlm cells at next-byte
validation accuracy (charlm's ``EvalResult.accuracy``; its ``loss``, the
validation loss in nats per byte, is reported as ``final_loss``): an accuracy
target lets the simulator stop a run at the target. Gossip arms run to the
horizon (a model that blows up after the target still counts as non-finite);
``alone`` and ``ddp`` stop at the target.

**Targets and horizons were measured, then fixed here** (``CELLS``): each
target is one the ``plain`` or ``alone`` arm reaches within the horizon (seed
0, every arm run to a horizon of 1.5-6 virtual s without stopping, 2026-12-06,
on this 2-core machine), and the horizons keep a full run (all cells, 4 arms,
3 seeds) well under 40 minutes of wall time on it (measured: 16 and 18 min,
one core busy; about 2.5x that while other jobs loaded both cores). Where plain never gets there
(label skew over 100 Mbit/s, Adam on skewed shards) the target is one alone
reaches and the defaults reached in the calibration run. Virtual step times
are this machine's measured local steps (one thread) at the cell's batch,
rounded. After a first full run three horizons grew (mlp-clipped and
mlp-adam-skew 1.5 -> 2.5 s, batchnorm 0.4 -> 0.8 s), where neither gossip arm
had reached the target in 2 of 3 seeds; no target moved.

Checks (summary.md, and the last line printed, one JSON object):
(a) the defaults are never non-finite (any seed);
(b) the defaults reach the target whenever plain does (medians), in at most
    ``SLACK`` x plain's time;
(c) over the cells each method is meant for (``GROUPS``: label skew = a
    non-iid partition of the digits; slow links = 100 Mbit/s; Adam/AdamW) the
    mean ratio defaults/plain of the median times is below 1. A run that
    never reached the target counts as the horizon there (so a ratio with a
    miss is a bound); a cell where neither reached is left out.

    python experiments/zoo.py                       # every cell, 4 arms, 3 seeds (16-18 min on a quiet 2-core machine)
    python experiments/zoo.py --cells mlp-momentum-skew-100mbit,mlp-adam-skew-fast --seeds 1
    python experiments/zoo.py --quick               # 3 cells, 1 seed, short horizons, a scratch folder (smoke test)
"""

from __future__ import annotations

import argparse
import math
import shlex
import statistics
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Sequence

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from experiments import harness  # noqa: E402
from gossiptrain.config import RunConfig  # noqa: E402
from gossiptrain.net.transport.sim import LinkProfile  # noqa: E402
from gossiptrain.sim.cluster import Cluster, SimConfig  # noqa: E402
from gossiptrain.sim.synchronous import SynchronousJob  # noqa: E402
from gossiptrain.sim.vtime import run_virtual  # noqa: E402

PEERS = 4
HOLD = 3  # samples in a row at or past the target
SLACK = 1.1  # (b): the defaults may take at most this many times plain's time
NEVER = 10**9  # gossip.max_steps_ahead no run reaches: flow control never waits
#: The `plain` arm: pairwise with every added method off.
PLAIN: dict[str, Any] = {
    "gossip.algorithm": "pairwise",
    "gossip.momentum_mode": "local",
    "gossip.drift_gain": 0.0,
    "gossip.lr_scaling": "none",
    "gossip.compression": "none",
    "gossip.max_steps_ahead": NEVER,
}
ARMS = ("alone", "ddp", "plain", "defaults")
LINKS: dict[str, LinkProfile] = {
    "fast": LinkProfile(),  # the simulator's default: 1 GB/s, 0.5 ms (loopback speed)
    "100mbit": LinkProfile(latency=0.0005, bandwidth=12.5e6),
}
CLASSES_PER_PEER = 3  # 4 peers x 3 >= 10 classes
ADAPTIVE = ("adam", "adamw")


@dataclass(frozen=True)
class Cell:
    """One workload on one partition, link and batch size, with its target and horizon."""

    name: str
    workload: str  # a factory of peers.zoo
    partition: str  # iid, dirichlet or classes-per-peer (charlm: iid, its shards are contiguous slices of text)
    link: str  # a key of LINKS
    batch: int
    target: float  # mean test accuracy (charlm: next-byte validation accuracy) held HOLD samples
    horizon: float  # virtual s
    step_time: float  # virtual s per local step
    sample_every: float  # virtual s
    alpha: float = 1.0  # dirichlet concentration
    optimizer: str = "sgd"  # the workload's (for the Adam/AdamW group)

    @property
    def text(self) -> bool:
        return self.workload in ("gru_adam", "transformer_adamw")

    @property
    def shown_partition(self) -> str:
        if self.text:
            return "contiguous text"
        if self.partition == "dirichlet":
            return f"dirichlet {self.alpha:g}"
        return f"{CLASSES_PER_PEER} classes/peer" if self.partition == "classes-per-peer" else self.partition

    def groups(self) -> list[str]:
        """The groups of (c) this cell belongs to."""
        out = []
        if self.partition != "iid" and not self.text:
            out.append("label_skew")
        if self.link == "100mbit":
            out.append("slow_link")
        if self.optimizer in ADAPTIVE:
            out.append("adam")
        return out


#: The cells. Targets and horizons measured with seed 0, then fixed (see the module's docstring).
CELLS: tuple[Cell, ...] = (
    # name, workload, partition, link, batch, target, horizon, step time, sample every
    Cell("mlp-momentum-iid-fast", "mlp_momentum", "iid", "fast", 32, 0.97, 1.0, 0.0015, 0.02),
    Cell("mlp-momentum-skew-100mbit", "mlp_momentum", "classes-per-peer", "100mbit", 32, 0.75, 6.0, 0.0015, 0.1),
    Cell("mlp-sgd-dir1-fast", "mlp_sgd", "dirichlet", "fast", 64, 0.95, 1.2, 0.0025, 0.02, alpha=1.0),
    Cell("mlp-slow-momentum-dir0.1-100mbit", "mlp_slow_momentum", "dirichlet", "100mbit", 128, 0.85, 2.0, 0.004, 0.05, alpha=0.1),
    Cell("mlp-clipped-dir0.1-100mbit", "mlp_clipped", "dirichlet", "100mbit", 8, 0.8, 2.5, 0.001, 0.05, alpha=0.1),
    Cell("mlp-adam-skew-fast", "mlp_adam", "classes-per-peer", "fast", 32, 0.9, 2.5, 0.003, 0.02, optimizer="adam"),
    Cell("cnn-nesterov-dir0.01-fast", "cnn_nesterov", "dirichlet", "fast", 16, 0.95, 1.2, 0.0015, 0.02, alpha=0.01),
    Cell("cnn-sgd-skew-fast", "cnn_sgd", "classes-per-peer", "fast", 8, 0.93, 1.5, 0.001, 0.02),
    Cell("cnn-cosine-dir1-100mbit", "cnn_cosine", "dirichlet", "100mbit", 32, 0.96, 1.0, 0.002, 0.02, alpha=1.0, optimizer="adamw"),
    Cell("batchnorm-dir0.1-fast", "batchnorm_momentum", "dirichlet", "fast", 64, 0.95, 0.8, 0.001, 0.01, alpha=0.1),
    Cell("layernorm-adamw-iid-100mbit", "layernorm_adamw", "iid", "100mbit", 32, 0.95, 0.6, 0.0015, 0.01, optimizer="adamw"),
    Cell("gru-adam-text-fast", "gru_adam", "iid", "fast", 16, 0.42, 3.5, 0.007, 0.1, optimizer="adam"),
    Cell("transformer-adamw-text-100mbit", "transformer_adamw", "iid", "100mbit", 8, 0.4, 3.0, 0.006, 0.1, optimizer="adamw"),
)
BY_NAME = {c.name: c for c in CELLS}
#: --quick: these cells, 1 seed, QUICK_SHARE of their horizons.
QUICK = ("batchnorm-dir0.1-fast", "layernorm-adamw-iid-100mbit", "cnn-cosine-dir1-100mbit")
QUICK_SHARE = 0.5
GROUPS = ("label_skew", "slow_link", "adam")


# -- one run ---------------------------------------------------------------------------------


def run_config(cell: Cell, arm: str, seed: int) -> RunConfig:
    """The swarm's configuration of ``arm`` on ``cell``."""
    overrides: dict[str, Any] = {
        "train.workload": f"peers.zoo:{cell.workload}", "train.batch_size": cell.batch, "train.seed": seed,
        # alone: one shard is all the data, whatever the partition
        "train.shards": 1 if arm == "alone" else PEERS, "train.partition": "iid" if arm == "alone" else cell.partition,
        "train.partition_alpha": cell.alpha, "train.partition_classes": CLASSES_PER_PEER,
        "train.max_steps": 0, "train.max_seconds": 0, "train.eval_every_seconds": cell.sample_every,
    }
    if arm == "plain":
        overrides.update(PLAIN)
    return RunConfig().with_overrides(overrides)


def sim_config(cell: Cell, arm: str, seed: int, horizon: float) -> SimConfig:
    synchronous = arm in ("alone", "ddp")
    return SimConfig(
        peers=1 if arm == "alone" else PEERS, run=run_config(cell, arm, seed), duration=horizon, seed=seed,
        step_time=cell.step_time, link=LINKS[cell.link], join_spread=0.0, sample_every=cell.sample_every,
        system="ddp" if synchronous else "gossip",
        target_accuracy=cell.target if synchronous else 0.0, target_hold=HOLD,
    )


def finite_model(model: torch.nn.Module | None) -> bool:
    return model is None or all(bool(torch.isfinite(p).all()) for p in model.parameters())


def simulate_arm(config: SimConfig) -> tuple[list[dict[str, Any]], bool, dict[str, Any]]:
    """Rows, whether every model ended finite, and the summary of one simulated run (one torch thread, as simulate())."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        if config.system == "gossip":
            cluster = Cluster(config)
            result = run_virtual(cluster.run())
            finite = all(finite_model(p.model) for p in cluster.peers.values())
        else:
            job = SynchronousJob(config)
            result = job.run()
            finite = finite_model(job.model)
    finally:
        torch.set_num_threads(threads)
    return result.rows, finite, result.summary


def series(rows: list[dict[str, Any]], key: str) -> list[tuple[float, float]]:
    """(time, mean over the sampled peers of ``key``) per sample time, in time order."""
    by_time: dict[float, list[float]] = {}
    for r in rows:
        if key in r:
            by_time.setdefault(r["time"], []).append(float(r[key]))
    return [(t, statistics.mean(v)) for t, v in sorted(by_time.items())]


def time_to_target(points: Sequence[tuple[float, float]], target: float, hold: int = HOLD) -> float | None:
    """The first sample time that starts ``hold`` samples in a row at or above ``target``."""
    for k in range(len(points) - hold + 1):
        if all(v >= target for _, v in points[k : k + hold]):
            return points[k][0]
    return None


def nonfinite_seen(rows: list[dict[str, Any]]) -> bool:
    """Whether any sample saw a non-finite test loss, or a peer's training loss go non-finite once it stepped."""
    return any(
        not math.isfinite(r.get("test_loss", 0.0)) or (r.get("step", 0) > 0 and not math.isfinite(r.get("loss", 0.0)))
        for r in rows
    )


def guard_counts(rows: list[dict[str, Any]]) -> dict[str, int]:
    """The stability guard's work, summed over the peers: the most methods each had backed off at once (at a sample;
    the guard retries them later), and the non-finite models it put back (a model went non-finite: counts against (a))."""
    most: dict[tuple[Any, str], int] = {}
    for r in rows:
        for key in ("guard_backed_off", "guard_restores"):
            most[r.get("peer"), key] = max(most.get((r.get("peer"), key), 0), int(r.get(key, 0)))
    return {key: sum(v for (_, k), v in most.items() if k == key) for key in ("guard_backed_off", "guard_restores")}


def one_run(cell: Cell, arm: str, seed: int, horizon: float) -> dict[str, Any]:
    started, cpu = time.perf_counter(), time.process_time()
    rows, finite, summary = simulate_arm(sim_config(cell, arm, seed, horizon))
    acc, loss = series(rows, "test_acc"), series(rows, "test_loss")
    tail = acc[-HOLD:]
    return {
        "cell": cell.name, "arm": arm, "seed": seed, "target": cell.target,
        "time_to_target_s": time_to_target(acc, cell.target),
        "final_metric": round(statistics.mean(v for _, v in tail), 4) if tail else math.nan,
        "final_loss": round(statistics.mean(v for _, v in loss[-HOLD:]), 4) if loss else math.nan,
        "nonfinite": not finite or nonfinite_seen(rows),
        **guard_counts(rows),
        "steps_per_worker": round(float(summary.get("mean_step") or 0.0), 1),
        "exchanges_per_peer": round(float(summary.get("exchanges_per_peer") or 0.0), 1),
        "virtual_s": round(acc[-1][0], 3) if acc else 0.0, "horizon_s": horizon,
        "wall_s": round(time.perf_counter() - started, 1), "cpu_s": round(time.process_time() - cpu, 1),
    }


# -- the table -------------------------------------------------------------------------------


def median_time(runs: list[dict[str, Any]]) -> float:
    """The median time to target over seeds; a run that never reached it counts as infinitely slow."""
    return harness.spread([r["time_to_target_s"] for r in runs])[0]


def capped(t: float, horizon: float) -> float:
    """A time for the ratios of (c): a miss counts as the horizon (a bound)."""
    return min(t, horizon)


def judge(cell: Cell, runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per-arm medians and the checks (a) and (b) on one cell."""
    mine = {arm: [r for r in runs if r["cell"] == cell.name and r["arm"] == arm] for arm in ARMS}
    out: dict[str, Any] = {"cell": cell.name}
    for arm, rs in mine.items():
        if rs:
            out[arm] = {"time": median_time(rs), "final": statistics.median(r["final_metric"] for r in rs),
                        "nonfinite": sum(bool(r["nonfinite"]) or r["guard_restores"] > 0 for r in rs),
                        "horizon": rs[0]["horizon_s"]}
    plain, default = out.get("plain"), out.get("defaults")
    if plain is None or default is None:
        return out
    out["a"] = default["nonfinite"] == 0
    out["b"] = math.isinf(plain["time"]) or default["time"] <= SLACK * plain["time"]
    both_missed = math.isinf(plain["time"]) and math.isinf(default["time"])
    horizon = default["horizon"]
    out["ratio"] = None if both_missed else capped(default["time"], horizon) / capped(plain["time"], horizon)
    return out


def group_ratios(cells: Sequence[Cell], judged: dict[str, dict[str, Any]], *, geometric: bool = False) -> dict[str, float | None]:
    """(c): per group, the mean ratio defaults/plain over its cells that have one (or their geometric mean, which one
    miss counted as the horizon sways less)."""
    out: dict[str, float | None] = {}
    for group in GROUPS:
        ratios = [judged[c.name]["ratio"] for c in cells if group in c.groups() and judged[c.name].get("ratio") is not None]
        mean = statistics.geometric_mean if geometric else statistics.mean
        out[group] = round(mean(ratios), 3) if ratios else None
    return out


def shown_time(arm: dict[str, Any] | None) -> str:
    if arm is None:
        return "-"
    return harness.fmt(arm["time"]) + (f" ({arm['nonfinite']} non-finite)" if arm["nonfinite"] else "")


def report(
    cells: Sequence[Cell], runs: list[dict[str, Any]], seeds: int, command: str, out: Path, version: str | None = None
) -> int:
    """summary.md and the headline; ``version``: the code measured (``code_version()`` as the run began)."""
    judged = {c.name: judge(c, runs) for c in cells}
    groups = group_ratios(cells, judged)
    geomeans = group_ratios(cells, judged, geometric=True)
    rows = []
    for c in cells:
        j = judged[c.name]
        ratio = "-" if j.get("ratio") is None else f"{j['ratio']:.2f}"
        finals = " / ".join("-" if arm not in j else f"{j[arm]['final']:.3f}" for arm in ARMS)
        rows.append([
            c.name, c.workload, c.shown_partition, c.link, c.batch, c.target, f"{c.horizon:g}",
            *(shown_time(j.get(arm)) for arm in ARMS), finals, ratio,
            _mark(j.get("a")), _mark(j.get("b")), ", ".join(c.groups()) or "-",
        ])
    plain = ", ".join(f"{k}={v}" for k, v in PLAIN.items())
    lines = [
        f"# Workload zoo: the defaults against plain averaging, {PEERS} peers, medians of {seeds} seed{'s' * (seeds != 1)}",
        "",
        f"Command: `{command}` ({version or code_version()}, {time.strftime('%Y-%m-%d')})",
        "",
        f"Simulated (`gossiptrain.sim`), virtual seconds. Arms: alone (1 worker, all the data), ddp ({PEERS} workers,"
        f" simulated), plain (`{plain}`), defaults (`RunConfig()`). Time to target: the peers' mean test accuracy"
        f" (charlm: next-byte validation accuracy) at or past the target for {HOLD} samples; not reached within the"
        " horizon: `not reached`. Final: the mean of the last samples (alone and ddp stop at the target).",
        "",
        *harness.markdown_table(
            ["cell", "workload", "partition", "link", "batch", "target", "horizon (s)", "alone", "ddp", "plain",
             "defaults", "final alone / ddp / plain / defaults", "defaults/plain", "(a)", "(b)", "groups"],
            rows,
        ),
        "",
        "(a) the defaults never non-finite; (b) the defaults reach the target whenever plain does, in at most"
        f" {SLACK}x plain's time (medians); (c) per group, the mean ratio defaults/plain (a miss counts as the"
        " horizon; cells where neither reached are left out) is below 1 (the geometric mean is shown beside it):",
        "",
        *harness.markdown_table(
            ["group", "cells", "mean defaults/plain", "geometric mean", "(c)"],
            [[g, sum(g in c.groups() for c in cells), _ratio(groups[g]), _ratio(geomeans[g]),
              _mark(None if groups[g] is None else groups[g] < 1)] for g in GROUPS],
        ),
    ]
    headline = {
        "cells": len(cells), "seeds": seeds,
        "failing_a": [n for n, j in judged.items() if j.get("a") is False],
        "failing_b": [n for n, j in judged.items() if j.get("b") is False],
        "group_ratio": groups,
        "group_geomean": geomeans,
        "failing_c": [g for g in GROUPS if groups[g] is not None and groups[g] >= 1],
    }
    return harness.publish(out, lines, headline)


def _mark(ok: bool | None) -> str:
    return "-" if ok is None else "pass" if ok else "FAIL"


def _ratio(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}"


def code_version() -> str:
    """The commit the run measured, marked where the working tree differed from it (the defaults change over time)."""
    import subprocess

    def git(*args: str) -> str:
        try:
            return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=10).stdout.strip()
        except (OSError, subprocess.TimeoutExpired):
            return ""

    commit = git("rev-parse", "--short", "HEAD") or "unknown commit"
    return commit + (" + uncommitted changes" if git("status", "--porcelain", "--untracked-files=no") else "")


# -- main ------------------------------------------------------------------------------------


def chosen_cells(names: str | None, quick: bool) -> list[Cell]:
    if names:
        picked = [BY_NAME[n] for n in harness.chosen(names, list(BY_NAME), "cell")]
    else:
        picked = [BY_NAME[n] for n in QUICK] if quick else list(CELLS)
    return [replace(c, horizon=c.horizon * QUICK_SHARE) for c in picked] if quick else picked


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cells", default=None, help=f"comma-separated cell names (default all): {', '.join(BY_NAME)}")
    ap.add_argument("--arms", default=",".join(ARMS), help="comma-separated arms (default all four)")
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help=f"{len(QUICK)} cells, 1 seed, half horizons (smoke test)")
    ap.add_argument("--out", type=Path, default=None, help="output folder (default experiments/results/zoo)")
    args = ap.parse_args()
    command = "python experiments/zoo.py" + "".join(f" {shlex.quote(a)}" for a in sys.argv[1:])
    version = code_version()  # now: the modules this run imports are the tree as it is now, whatever lands meanwhile
    cells = chosen_cells(args.cells, args.quick)
    arms = harness.chosen(args.arms, ARMS, "arm")
    seeds = 1 if args.quick else args.seeds
    out = harness.results_dir("zoo", args.out, args.quick)
    out.mkdir(parents=True, exist_ok=True)
    runs: list[dict[str, Any]] = []
    for cell in cells:
        for seed in range(seeds):
            for arm in arms:
                runs.append(one_run(cell, arm, seed, cell.horizon))
                print(harness.headline(runs[-1]), flush=True)
        harness.write_csv(out / "runs.csv", runs)  # after every cell: a long run interrupted keeps what it measured
    return report(cells, runs, seeds, command, out, version)


if __name__ == "__main__":
    raise SystemExit(main())
