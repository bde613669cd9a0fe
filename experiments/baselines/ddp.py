"""torch DDP baseline: one process per rank, gloo on 127.0.0.1, the gossip peers' shards, seeds and straggler.

Rank r trains the shard gossip peer r trains, with the same batches, model
initialisation, lr, momentum and batch size (from the swarm's RunConfig).
DistributedDataParallel averages the gradients of every step over all ranks
(all-reduce inside backward), so every step waits for the slowest rank.

Straggler injection is the gossip peer's: after each step the slowed rank
sleeps (slowdown - 1) x the compute time of that step. Compute excludes the
all-reduce: it is the forward pass, the backward pass up to the moment the
last gradient is ready (a post-accumulate-grad hook on every parameter), and
the optimizer step; time spent waiting for the other ranks inside backward
is communication, as it is not part of a gossip peer's step either.

Rank 0 evaluates on the test set every ``--eval-every`` seconds (the others
wait for it at the next all-reduce, as they would in any DDP job) and writes
JSON lines: start, eval (elapsed, samples, test_acc), done. The rendezvous is
a TCPStore hosted by the harness on a port the OS picked.

    python -m experiments.baselines.ddp --rank 0 --world 4 --store-port PORT --seed 0 --metrics rank-0.jsonl
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from experiments.harness import Straggler, build_model, run_config, sgd, shard_batches
from gossiptrain.train.metrics import MetricsLog
from gossiptrain.train.workload import load_workload


class GradsReady:
    """When the last gradient of a backward pass was accumulated: the end of the step's compute."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.at: float | None = None
        for p in model.parameters():
            p.register_post_accumulate_grad_hook(self._ready)

    def _ready(self, _param: torch.Tensor) -> None:
        self.at = time.perf_counter()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world", type=int, required=True)
    p.add_argument("--store-port", type=int, required=True, help="the harness's TCPStore on 127.0.0.1")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--slowdown", type=float, default=1.0, help="this rank idles (slowdown-1) x each step's compute")
    p.add_argument("--max-steps", type=int, default=0, help="stop after this many steps (0: until stopped)")
    p.add_argument("--eval-every", type=float, default=0.25, help="seconds between rank 0's evaluations (0: only at the end)")
    p.add_argument("--metrics", type=Path, required=True)
    p.add_argument("--save", type=Path, help="rank 0: save the final model here (safetensors)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=JSON",
                   help="a field of the run's configuration, e.g. train.partition='\"classes-per-peer\"' (repeatable)")
    args = p.parse_args(argv)

    torch.set_num_threads(1)  # as each gossip peer (--threads 1)
    timeout = datetime.timedelta(seconds=60)
    store = dist.TCPStore("127.0.0.1", args.store_port, None, False, timeout=timeout)
    dist.init_process_group("gloo", store=store, rank=args.rank, world_size=args.world, timeout=timeout)

    sets = {k: json.loads(v) for k, _, v in (item.partition("=") for item in args.set)}
    cfg = run_config(args.world, args.seed).with_overrides(sets).train
    workload = load_workload(cfg.workload)
    model = build_model(workload, cfg)
    ddp = DistributedDataParallel(model)  # broadcasts rank 0's parameters: identical anyway
    opt = sgd(ddp.parameters(), cfg)
    data = shard_batches(workload, cfg, args.rank)
    ready = GradsReady(model)
    straggler = Straggler(args.slowdown)
    samples_per_step = cfg.batch_size * args.world
    evaluating = args.rank == 0

    with MetricsLog(args.metrics) as metrics:
        dist.barrier()  # everyone is ready: training starts now on every rank
        started = time.monotonic()
        metrics.write({"event": "start", "time": time.time(), "rank": args.rank, "world": args.world})
        next_eval = started + args.eval_every if args.eval_every > 0 else float("inf")
        step = 0
        computed = 0.0  # seconds of compute in this rank's steps (what the straggler's sleep is based on)

        def record(event: str) -> None:
            result = workload.evaluate(model)
            metrics.write({
                "event": event, "time": time.time(), "elapsed": round(time.monotonic() - started, 4), "step": step,
                "samples": step * samples_per_step, "test_acc": result.accuracy, "test_loss": result.loss,
                "compute_ms": round(1e3 * computed / max(1, step), 3),
            })

        while args.max_steps <= 0 or step < args.max_steps:
            began = time.perf_counter()
            ready.at = None
            x, y = next(data)  # (B, 64), (B,)
            loss = workload.loss(ddp, x, y)
            opt.zero_grad(set_to_none=True)
            loss.backward()  # returns once the gradients are all-reduced
            backward_done = time.perf_counter()
            opt.step()
            loss.item()
            ended = time.perf_counter()
            compute = ((ready.at or backward_done) - began) + (ended - backward_done)
            straggler.after_step(compute)
            computed += compute
            step += 1
            if evaluating and time.monotonic() >= next_eval:
                record("eval")
                next_eval = time.monotonic() + args.eval_every
        if evaluating:
            record("done")
            if args.save is not None:
                from safetensors.torch import save_file

                save_file({n: t.detach().contiguous() for n, t in model.state_dict().items()}, str(args.save))
    del ddp, opt  # the reducer holds the process group: release it before the group is destroyed
    dist.destroy_process_group()
    del store


def leave() -> None:
    """Exit without running C++ destructors: everything this rank owes is written and closed by now.

    Interpreter shutdown can destroy one of gloo's or the store client's threads while it is still
    joinable, and the process then aborts ("terminate called without an active exception", status -6)
    after a run that succeeded: about 1 run in 25 of a 2-rank job here.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
    leave()
