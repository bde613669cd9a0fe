"""What a leased sampler costs a training loop per batch, against a static shard's shuffled indices.

Issue 49 asks that leases cost equal peers no more than 5% of their time.
For a small model a step is a few hundred microseconds, so the indices'
cost per batch shows. This times, in one process and one run, the two ways
``experiments/data_balance.py`` feeds its peers: a shuffled static shard
(``DataLoader(shuffle=True)``'s indices) and ``LeasedSampler`` (the real
lease machine, one member, so that the swarm's gossip is left out: the
cost measured is the training thread's), each batched by 32 into a tensor
as a ``DataLoader`` does. Medians of ``--repeats`` rounds, the modes
alternating.

    python experiments/sampler_cost.py           # about 20 s
    python experiments/sampler_cost.py --quick   # a smoke test

Output: experiments/results/sampler_cost/summary.md; the last line printed
is one JSON object: microseconds per batch of each mode and dataset, the
difference, and a step of data_balance's MLP (``mlp_step_us``), which the
difference is set against.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Callable, Iterator

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from experiments import harness  # noqa: E402
from experiments.zoo import code_version  # noqa: E402
from gossiptrain.config import DataConfig  # noqa: E402
from gossiptrain.runtime.leased_data import LeaseClient, LeasedSampler, plan_for  # noqa: E402

BATCH = 32


def time_batches(indices: Iterator[int], batches: int) -> float:
    """Seconds to read ``batches`` batches of BATCH indices into tensors (B,)."""
    start = time.perf_counter()
    batch: list[int] = []
    made = 0
    for i in indices:
        batch.append(i)
        if len(batch) == BATCH:
            torch.tensor(batch)
            batch = []
            made += 1
            if made == batches:
                break
    return time.perf_counter() - start


def static(samples: int) -> Iterator[int]:
    mine = torch.arange(0, samples, 4)  # a quarter of the dataset, as one of 4 peers holds
    gen = torch.Generator().manual_seed(0)
    while True:
        yield from mine[torch.randperm(len(mine), generator=gen)].tolist()


def leased(samples: int) -> Iterator[int]:
    config = DataConfig(mode="leased")
    client = LeaseClient("me", plan_for(samples, config, 0), config, live=lambda: ["me"], now=time.monotonic,
                         rng=random.Random(0))
    sampler = LeasedSampler(client, lambda: 1)
    while True:
        yield from sampler


def step_us(steps: int = 1000, repeats: int = 5) -> float:
    """Microseconds of one training step of experiments/data_balance.py's MLP (64-128-10, SGD 0.05/0.9, batch
    32, one thread): what the sampler's cost is set against."""
    torch.manual_seed(0)
    x, y = torch.randn(1437, 64), torch.randint(0, 10, (1437,))  # (N, 64), (N,)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    batch = torch.randint(0, 1437, (BATCH,))  # (B,)

    def run(n: int) -> float:
        start = time.perf_counter()
        for _ in range(n):
            loss = torch.nn.functional.cross_entropy(model(x[batch]), y[batch])
            opt.zero_grad()
            loss.backward()
            opt.step()
        return (time.perf_counter() - start) / n * 1e6

    run(200)  # warm up
    return statistics.median(run(steps) for _ in range(repeats))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", type=int, default=20_000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="2,000 batches, 3 rounds (a smoke test)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    batches, repeats = (2_000, 3) if args.quick else (args.batches, args.repeats)
    torch.set_num_threads(1)
    out = harness.results_dir("sampler_cost", args.out, args.quick)
    out.mkdir(parents=True, exist_ok=True)
    modes: dict[str, Callable[[int], Iterator[int]]] = {"static": static, "leased": leased}
    rows, headline = [], {}
    for name, samples in (("digits", 1437), ("cifar-sized", 50_000)):
        times: dict[str, list[float]] = {m: [] for m in modes}
        for _ in range(repeats):
            for mode, make in modes.items():
                times[mode].append(time_batches(make(samples), batches) / batches * 1e6)
        med = {m: statistics.median(v) for m, v in times.items()}
        chunks = plan_for(samples, DataConfig(mode="leased"), 0).chunks
        rows.append([f"{name} ({samples:,})", chunks, f"{med['static']:.1f}", f"{med['leased']:.1f}",
                     f"{med['leased'] - med['static']:.1f}"])
        headline[name] = {"static_us": round(med["static"], 2), "leased_us": round(med["leased"], 2),
                          "extra_us": round(med["leased"] - med["static"], 2)}
    step = step_us(200 if args.quick else 1000, repeats)
    for row in rows:
        row.append(f"{100 * headline[row[0].split(' (')[0]]['extra_us'] / step:.1f}%")
    headline["mlp_step_us"] = round(step, 1)
    command = ("python experiments/sampler_cost.py " + " ".join(sys.argv[1:])).strip()
    lines = [
        "# Issue 49: what a leased sampler costs a training loop per batch",
        "",
        f"Command: `{command}` ({code_version()}, {time.strftime('%Y-%m-%d')})",
        "",
        f"Batches of {BATCH} indices read into a tensor, {batches:,} a round, medians of {repeats} rounds; `static`: "
        "a quarter of the dataset reshuffled each pass; `leased`: `LeasedSampler` of a lone member (the lease "
        "machine's cost to the training thread, the swarm's gossip left out). Last column: the difference as a "
        f"share of one step of experiments/data_balance.py's MLP (64-128-10, batch {BATCH}, one thread: "
        f"{step:.0f} us here).",
        "",
        *harness.markdown_table(["dataset", "chunks an epoch", "static (us / batch)", "leased (us / batch)",
                                 "leased - static (us)", "of an MLP step"], rows),
    ]
    return harness.publish(out, lines, headline)


if __name__ == "__main__":
    raise SystemExit(main())
