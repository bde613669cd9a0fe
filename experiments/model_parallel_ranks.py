"""One process of ``experiments/model_parallel.py``'s training runs: a rank of a peer, through ``Peer`` as users write it.

``python -m experiments.model_parallel_ranks ARM PEER RANK JOIN INIT OUT SEED STEPS SECONDS BATCH LR``

Arms (every one 4 processes and the same samples per round: 4 x BATCH windows):

- ``fsdp``: 2 peers of 2 ranks, the model FSDP2-sharded (every layer and the
  root); each rank trains on its own BATCH windows (data parallel inside).
- ``pipeline``: 2 peers of 2 stages (``CharTransformer.stage``), GPipe over
  2 micro-batches of one batch of 2 x BATCH windows.
- ``ddp``: 2 peers of 2 ranks, the whole model on each, DDP inside.
- ``single``: 4 peers of 1 rank, BATCH windows each.

Rank r of peer p trains on the windows of shard 2p + r of 4 (a pipeline peer:
shard p of 2, both stages the same batches; ``single``: shard p of 4), picked
at random by a generator of its own. It trains until STEPS steps (SECONDS > 0:
until that many seconds of training instead), runs the final phase, and
writes its piece (``OUT.safetensors``: its local tensors, names of the unsplit
model) and what it measured (``OUT``: JSON).
"""

from __future__ import annotations

import json
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

WORKLOAD = "peers.charlm:transformer"
#: What every arm runs: the workload, budgets from the driver.
RUN = {"train.workload": WORKLOAD, "train.max_steps": 0, "train.max_seconds": 3600}
#: ...and, unless the defaults are asked for (``--defaults``), the added methods off, so that only the layout differs.
PLAIN = {"gossip.lr_scaling": "none", "gossip.drift_gain": 0.0, "gossip.compression": "none",
         "gossip.momentum_mode": "local", "gossip.guard": False}
PEERS = {"fsdp": 2, "pipeline": 2, "ddp": 2, "single": 4}


def run_fields(arm: str, defaults: bool) -> dict[str, Any]:
    """The swarm's run (the coordinator's and every peer's): plain averaging, or the defaults."""
    return {**RUN, **({} if defaults else PLAIN), "train.shards": PEERS[arm]}


def run_config(arm: str, defaults: bool) -> Any:
    from gossiptrain.config import RunConfig

    return RunConfig().with_overrides(run_fields(arm, defaults))


def main(arm: str, peer: int, rank: int, join: str, init: str, out: Path, seed: int, steps: int, seconds: float,
         batch: int, lr: float, defaults: bool = False) -> None:
    import torch.distributed as dist

    from gossiptrain.protocol.pieces import local_piece, piece_entries
    from gossiptrain.runtime.peer import Peer
    from gossiptrain.train.workload import load_workload
    from safetensors.torch import save_file

    torch.set_num_threads(1)
    grouped = arm != "single"
    if grouped:
        dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2, timeout=timedelta(seconds=300))
    workload = load_workload(WORKLOAD)
    model = workload.build_model(seed)  # every peer starts from the same point, as the CLI's do
    if arm == "fsdp":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (2,))
        for layer in model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    elif arm == "pipeline":
        model.stage(rank, 2)
    if arm == "pipeline":
        inputs, targets = workload.train_shard(peer, 2, seed)
    else:
        inputs, targets = workload.train_shard(2 * peer + rank if grouped else peer, 4, seed)
    gen = torch.Generator().manual_seed(1000 * seed + 10 * peer + (0 if arm == "pipeline" else rank))
    per_step = 2 * batch if arm == "pipeline" else batch
    record: dict[str, Any] = {"arm": arm, "peer": peer, "rank": rank}
    bind = f"127.0.0.{80 + 2 * peer + rank}:0"
    with Peer(model, join=join, bind=bind, config=run_config(arm, defaults), group=dist.group.WORLD if grouped else None) as p:
        optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
        forward: Any = model
        schedule = None
        if arm == "ddp":
            from torch.nn.parallel import DistributedDataParallel

            forward = DistributedDataParallel(model)
        elif arm == "pipeline":
            from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

            def loss_fn(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
                return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))

            schedule = ScheduleGPipe(PipelineStage(model, rank, 2, torch.device("cpu")), n_microbatches=2, loss_fn=loss_fn)
        p.wait_for_peers(PEERS[arm], timeout=300)
        started = time.monotonic()

        def going() -> bool:
            return time.monotonic() - started < seconds if seconds > 0 else p.steps < steps

        while p.agree(going()):
            pick = torch.randint(len(inputs), (per_step,), generator=gen)
            x, y = inputs[pick], targets[pick]  # (per_step, T), (per_step, T)
            optimizer.zero_grad()
            if schedule is None:
                workload.loss(forward, x, y).backward()
            elif rank == 0:
                schedule.step(x)
            else:
                schedule.step(target=y)
            optimizer.step()
            p.step()
        trained = time.monotonic() - started
        report = p.finish("budget")
        stats = p.stats()
        record.update(steps=p.steps, seconds=round(trained, 3), final_seconds=round(report.seconds, 3),
                      samples=p.steps * (2 * batch if grouped else batch), completed=stats.get("completed", 0), served=stats.get("served", 0),
                      kind=type(p).__name__, id=p.id)
        if rank == 0 or arm in ("fsdp", "pipeline"):
            save_file({n: t.detach().clone().contiguous() for n, t in local_piece(model).items()}, f"{out}.safetensors")
            record["entries"] = [e.to_wire() for e in piece_entries(model)]  # how the driver puts the pieces together
        if arm == "ddp":
            del forward  # DDP's reducer before its process group (it hung at exit otherwise)
    Path(out).write_text(json.dumps(record))
    if grouped:
        dist.destroy_process_group()


if __name__ == "__main__":
    a = sys.argv[1:]
    main(a[0], int(a[1]), int(a[2]), a[3], a[4], Path(a[5]), int(a[6]), int(a[7]), float(a[8]), int(a[9]), float(a[10]),
         a[11:12] == ["defaults"])
