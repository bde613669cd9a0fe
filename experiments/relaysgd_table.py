"""Issue 52: the label-skew table of the RelaySGD paper, reproduced in shape in the simulator.

Vogels et al., "RelaySum for Decentralized Deep Learning on Heterogeneous
Data" (NeurIPS 2021), train VGG-11 on CIFAR-10 over 16 workers whose data
is split by a Dirichlet draw of each class over the workers (alpha 1.0,
0.1, 0.01: from mild to almost one class per worker) and report the final
test accuracy per algorithm and topology:

| | alpha 1.0 | 0.1 | 0.01 |
| --- | --- | --- | --- |
| all-reduce (with momentum) | 87.0 (90.2) | 87.0 (90.2) | 87.0 (90.2) |
| D-PSGD, ring | 87.4 | 79.9 | 53.9 |
| D-PSGD with quasi-global momentum, ring | 89.5 | 84.8 | 63.3 |
| SGP (push-sum), time-varying exponential (with local momentum) | 87.4 (89.5) | 86.7 (89.2) | 86.7 (87.5) |

Its shape: all-reduce does not care about alpha; push-sum on the
exponential graph stays within a point or three of it; D-PSGD on a ring
collapses as alpha falls, quasi-global momentum softening the collapse.

CIFAR-10 and VGG-11 do not fit this machine, so the same rows run on this
project's workload (``--workload``, default digits-small: the MLP on sklearn's
8x8 digits) in the simulator (``gossiptrain.sim``), 16 peers, the same
alphas, every row the same number of steps per worker (``--epochs`` passes
over the training set between them), medians of ``--seeds`` seeds. The
shards are cut as the paper's code cuts them (``train.partition
dirichlet-even``: the Dirichlet draw, then cut into shards of equal size;
``--partition dirichlet`` keeps the drawn sizes, which at alpha 0.01 leave
most peers a handful of samples). The rows:

- ``allreduce``: the simulated DDP baseline (gradients averaged every step),
  SGD without momentum; ``allreduce_momentum``: with momentum 0.9;
- ``dpsgd_ring``: the ``neighbor`` algorithm on a ring (each round a peer
  averages with its two neighbours, weights 1/3), SGD without momentum, every
  added method off (``PLAIN``);
- ``dpsgd_ring_qgm``: the same with momentum 0.9 run quasi-globally
  (``gossip.momentum_mode quasi-global``);
- ``pushsum_exp``: push-sum on the one-peer exponential graph (SGP's
  time-varying exponential graph: at round k a peer pushes to the peer
  2^(k mod log2 n) places on), SGD without momentum, every added method off;
  ``pushsum_exp_momentum``: with local momentum 0.9;
- ``default``: this project's defaults (``RunConfig()``'s gossip section:
  pairwise, drift correction, ...), momentum 0.9;
  ``default_drift0`` (only when named in ``--rows``): the same without drift
  correction.

Learning rates: ``LR`` (the workload's 0.05) with momentum; ``LR_PLAIN``
without, the same step in the long run (0.05 / (1 - 0.9)), cut as the
paper's recipe cuts it (200 epochs, x0.1 at 150 and 180: ``train.lr_schedule
step``, x0.1 after 75% and 90% of the steps; ``--lr-schedule constant`` to
keep it). The decay matters to the table: a gossip peer's distance from the
others shrinks with the rate, so the local models of the last epochs are
nearly the average. The paper tuned each row's rate; here one rate per
momentum setting is used for every row, so a row's number says how the
algorithm meets the skew at a rate that suits all-reduce, not its best.

Per run: the peers' mean test accuracy at the end (what each peer's own
model scores; the paper's decentralized numbers) and the accuracy of the
peers' averaged model. Output: experiments/results/relaysgd_table/
{runs.csv, summary.md}; the last line printed is one JSON object
``{"alpha_1.0": {"allreduce": acc, "dpsgd_ring": acc, "dpsgd_ring_qgm": acc,
"pushsum_exp": acc, "default": acc, ...}, "alpha_0.1": {...}, "alpha_0.01":
{...}}`` (mean test accuracy, medians over seeds).

    python experiments/relaysgd_table.py              # 7 rows x 3 alphas x 3 seeds, 200 epochs: about 15 minutes
    python experiments/relaysgd_table.py --quick      # 2 rows, alphas 0.1 and 0.01, 1 seed, 2 epochs (smoke test)
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from experiments import harness  # noqa: E402
from experiments import zoo  # noqa: E402
from experiments.zoo import code_version  # noqa: E402
from gossiptrain.config import RunConfig  # noqa: E402
from gossiptrain.sim.cluster import Cluster, SimConfig  # noqa: E402
from gossiptrain.sim.synchronous import SynchronousJob  # noqa: E402
from gossiptrain.sim.vtime import run_virtual  # noqa: E402

PEERS = 16
ALPHAS = (1.0, 0.1, 0.01)
LR = 0.05
MOMENTUM = 0.9
LR_PLAIN = LR / (1 - MOMENTUM)
STEP_TIME = 0.01  # virtual s per local step: a fast link (the simulator's default, 1 GB/s, 0.5 ms) never binds
TRAIN_SAMPLES = 1437  # digits' training split (peers.digits)
#: Every added method off, as experiments/zoo.py's plain arm: what the paper's rows ran.
PLAIN: dict[str, Any] = {**zoo.PLAIN, "gossip.guard": False}
#: row -> (system, gossip overrides, momentum)
ROWS: dict[str, tuple[str, dict[str, Any], float]] = {
    "allreduce": ("ddp", {}, 0.0),
    "allreduce_momentum": ("ddp", {}, MOMENTUM),
    "dpsgd_ring": ("gossip", {**PLAIN, "gossip.algorithm": "neighbor", "gossip.topology": "ring"}, 0.0),
    "dpsgd_ring_qgm": ("gossip", {**PLAIN, "gossip.algorithm": "neighbor", "gossip.topology": "ring",
                                  "gossip.momentum_mode": "quasi-global"}, MOMENTUM),
    "pushsum_exp": ("gossip", {**PLAIN, "gossip.algorithm": "push-sum", "gossip.topology": "one-peer-exponential"}, 0.0),
    "pushsum_exp_momentum": ("gossip", {**PLAIN, "gossip.algorithm": "push-sum",
                                        "gossip.topology": "one-peer-exponential"}, MOMENTUM),
    "default": ("gossip", {}, MOMENTUM),
    # Not in the paper, and not run unless named (--rows): the defaults without drift correction, to show what
    # it does to a short run whose rate is cut (its memory, 100 steps, is longer than a run of 30 epochs here).
    "default_drift0": ("gossip", {"gossip.drift_gain": 0.0}, MOMENTUM),
}
#: The rows run when --rows is not given: the paper's, and the defaults.
TABLE_ROWS = tuple(name for name in ROWS if name != "default_drift0")
#: The paper's numbers (final test accuracy, %), for the side-by-side columns.
PAPER: dict[str, tuple[float, float, float]] = {
    "allreduce": (87.0, 87.0, 87.0),
    "allreduce_momentum": (90.2, 90.2, 90.2),
    "dpsgd_ring": (87.4, 79.9, 53.9),
    "dpsgd_ring_qgm": (89.5, 84.8, 63.3),
    "pushsum_exp": (87.4, 86.7, 86.7),
    "pushsum_exp_momentum": (89.5, 89.2, 87.5),
}


def steps_for(epochs: float, batch: int) -> int:
    """Local steps per worker for ``epochs`` passes over the training set by the 16 workers together."""
    return max(1, round(epochs * TRAIN_SAMPLES / (PEERS * batch)))


def one_run(row: str, alpha: float, seed: int, epochs: float, workload: str, partition: str,
            schedule: str = "step") -> dict[str, Any]:
    system, overrides, momentum = ROWS[row]
    run = RunConfig().with_overrides({
        "train.workload": workload, "train.shards": PEERS, "train.partition": partition,
        "train.partition_alpha": alpha, "train.seed": seed, "train.max_seconds": 0,
        "train.lr": LR if momentum else LR_PLAIN, "train.momentum": momentum, **overrides,
    })
    steps = steps_for(epochs, run.train.batch_size)
    run = run.with_overrides({"train.max_steps": steps, "train.lr_schedule": schedule})
    # Long enough for every worker's steps whatever waits for the link; the sample at the end sees the models
    # as the budget left them (a peer that spent it stays, idle, until the run ends).
    duration = steps * STEP_TIME * 3 + 2.0
    config = SimConfig(peers=PEERS, run=run, duration=duration, seed=seed, step_time=STEP_TIME, join_spread=0.0,
                       sample_every=duration, system=system)
    began = time.perf_counter()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        if system == "gossip":
            result = run_virtual(Cluster(config).run())
        else:
            result = SynchronousJob(config).run()
    finally:
        torch.set_num_threads(threads)
    last = max(r["time"] for r in result.rows)
    final = [r for r in result.rows if r["time"] == last and "test_acc" in r]
    return {
        "row": row, "partition": partition, "lr_schedule": schedule, "alpha": alpha, "seed": seed, "epochs": epochs, "steps_per_worker": steps,
        "steps_done": round(statistics.mean(r.get("step", 0) for r in final), 1),
        "mean_test_acc": round(statistics.mean(r["test_acc"] for r in final), 4),
        "averaged_model_acc": round(final[0]["swarm_acc"], 4) if final and final[0].get("swarm_acc") is not None else None,
        "wall_s": round(time.perf_counter() - began, 1),
    }


def summarise(rows: list[dict[str, Any]], command: str, workload: str, epochs: float, seeds: int,
              partition: str) -> tuple[list[str], dict[str, Any]]:
    alphas = sorted({r["alpha"] for r in rows}, reverse=True)
    names = [n for n in ROWS if any(r["row"] == n for r in rows)]
    head: dict[str, Any] = {}
    table = []
    for name in names:
        cells, paper = [], []
        for i, alpha in enumerate(alphas):
            rs = [r for r in rows if r["row"] == name and r["alpha"] == alpha]
            acc = statistics.median(r["mean_test_acc"] for r in rs) if rs else None
            avg = [r["averaged_model_acc"] for r in rs if r["averaged_model_acc"] is not None]
            head.setdefault(f"alpha_{alpha}", {})[name] = acc
            cells.append("-" if acc is None else f"{100 * acc:.1f}" + (f" ({100 * statistics.median(avg):.1f})" if avg else ""))
            if name in PAPER and alpha in ALPHAS:
                paper.append(f"{PAPER[name][ALPHAS.index(alpha)]:.1f}")
        table.append([name, *cells, " / ".join(paper) if paper else "-"])
    lines = [
        "# Issue 52: RelaySGD's label-skew table (CIFAR-10, VGG-11, 16 workers) in shape, in the simulator",
        "",
        f"Command: `{command}` ({code_version()}, {time.strftime('%Y-%m-%d')})",
        "",
        f"{PEERS} simulated peers, {workload}, label skew `{partition}`, {epochs:g} epochs (the same steps per worker for "
        f"every row), medians of {seeds} seeds. Each cell: the peers' mean test accuracy at the end, % (in brackets "
        "for gossip rows: the peers' averaged model; all-reduce has one model). Last column: the paper's numbers "
        f"at alpha {' / '.join(f'{a:g}' for a in ALPHAS)}. lr {LR:g} with momentum {MOMENTUM:g}, {LR_PLAIN:g} without.",
        "",
        *harness.markdown_table(["row", *(f"alpha {a:g}" for a in alphas), "paper (%)"], table),
    ]
    return lines, head


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default=",".join(TABLE_ROWS), help=f"comma-separated, of {', '.join(ROWS)}")
    ap.add_argument("--alphas", default=",".join(f"{a:g}" for a in ALPHAS))
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--epochs", type=float, default=200.0, help="passes over the training set (the paper's 200)")
    ap.add_argument("--workload", default="digits-small")
    ap.add_argument("--lr-schedule", default="step", choices=("step", "constant"),
                    help="step (the paper's: x0.1 at 75%% and 90%% of the steps) or constant")
    ap.add_argument("--partition", default="dirichlet-even", choices=("dirichlet-even", "dirichlet"),
                    help="dirichlet-even (the paper's: shards of equal size) or dirichlet (sizes as drawn)")
    ap.add_argument("--quick", action="store_true", help="2 rows, alphas 0.1 and 0.01, 1 seed, 2 epochs (a smoke test)")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    names = ["allreduce", "dpsgd_ring"] if args.quick else harness.chosen(args.rows, ROWS, "row")
    alphas = [0.1, 0.01] if args.quick else [float(a) for a in args.alphas.split(",")]
    seeds, epochs = (1, 2.0) if args.quick else (args.seeds, args.epochs)
    out = harness.results_dir("relaysgd_table", args.out, args.quick)
    out.mkdir(parents=True, exist_ok=True)
    rows: list[dict[str, Any]] = []
    for alpha in alphas:
        for seed in range(seeds):
            for name in names:
                rows.append(one_run(name, alpha, seed, epochs, args.workload, args.partition, args.lr_schedule))
                r = rows[-1]
                print(f"alpha {alpha:g} seed {seed} {name}: {r['mean_test_acc']:.3f} (averaged {r['averaged_model_acc']}), "
                      f"{r['steps_done']}/{r['steps_per_worker']} steps, {r['wall_s']} s", flush=True)
                harness.write_csv(out / "runs.csv", rows)
    command = ("python experiments/relaysgd_table.py " + " ".join(sys.argv[1:])).strip()
    lines, head = summarise(rows, command, args.workload, epochs, seeds, f"{args.partition}`, lr schedule `{args.lr_schedule}")
    return harness.publish(out, lines, head)


if __name__ == "__main__":
    raise SystemExit(main())
