"""What each rank of a two-worker peer runs in tests/test_peer_group.py (spawned: it must be importable)."""

from __future__ import annotations

import hashlib
import json
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from gossiptrain.runtime.peer import Peer

from .conftest import fast_config


def digest(model: torch.nn.Module) -> str:
    """The parameters and buffers, bit for bit."""
    h = hashlib.sha256()
    for t in [*model.parameters(), *model.buffers()]:
        h.update(t.detach().contiguous().numpy().tobytes())
    return h.hexdigest()


def train(rank: int, join: str, init: str, out: str, steps: int) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2, timeout=timedelta(seconds=120))
    torch.manual_seed(rank)  # different initial models: the first sync must make them equal
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    config = fast_config(**{"train.shards": 2, "train.max_steps": 0, "train.max_seconds": 60})
    seen = []
    with Peer(model, join=join, bind="127.0.0.1:0", config=config, group=dist.group.WORLD) as peer:
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        ddp = DistributedDataParallel(model)
        gen = torch.Generator().manual_seed(100 + rank)  # each worker its own batches
        seen.append(digest(model))
        # Both members start together (the rendezvous, as `--wait-for`): a group that started alone could take its
        # 80 steps, a fraction of a second, before it met the solo member, and end with no exchange at all.
        peer.wait_for_peers(2, timeout=60)
        while peer.agree(peer.steps < steps):
            x = torch.randn(16, 8, generator=gen)  # (B, 8)
            y = (x.sum(1) > 0).long()  # (B,)
            loss = torch.nn.functional.cross_entropy(ddp(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            peer.step()
            seen.append(digest(model))
        peer.finish("budget")
        seen.append(digest(model))
        exchanges = peer.stats().get("completed", 0) + peer.stats().get("served", 0)
        kind = type(peer).__name__
    Path(out).write_text(json.dumps({"digests": seen, "exchanges": exchanges, "kind": kind, "id": peer.id}))
    # DDP's reducer goes before its process group: destroyed after it, on return, it hung rank 1 at exit in 2 of 5
    # runs (the test then timed out with every digest written).
    del ddp
    dist.destroy_process_group()


def split(kind: str, rank: int, join: str, init: str, out: str) -> None:
    """A peer of two ranks whose model is FSDP2-sharded or cut into pipeline stages: refused, on both ranks."""
    from gossiptrain.errors import ConfigError, GossipError

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2, timeout=timedelta(seconds=60))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    if kind == "fsdp":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        fully_shard(model, mesh=init_device_mesh("cpu", (2,)))
    else:  # pipeline stages: rank 0 the first layers, rank 1 the last
        model = model[:2] if rank == 0 else model[2:]
    config = fast_config(**{"train.shards": 2, "train.max_steps": 0, "train.max_seconds": 60})
    try:
        with Peer(model, join=join, bind="127.0.0.1:0", config=config, group=dist.group.WORLD):
            said = ""
    except (GossipError, ConfigError) as e:
        said = str(e)
    Path(out).write_text(json.dumps({"error": said}))
    dist.destroy_process_group()


def solo(join: str, steps: int) -> None:
    """A single-worker member of the same model, so that the group's leader has someone to average with."""
    torch.set_num_threads(1)
    torch.manual_seed(7)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    config = fast_config(**{"train.shards": 2, "train.max_steps": 0, "train.max_seconds": 60})
    with Peer(model, join=join, bind="127.0.0.1:0", config=config) as peer:
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        gen = torch.Generator().manual_seed(200)
        peer.wait_for_peers(2, timeout=60)  # the group's rendezvous
        while peer.steps < steps:
            x = torch.randn(16, 8, generator=gen)
            loss = torch.nn.functional.cross_entropy(model(x), (x.sum(1) < 0).long())
            opt.zero_grad()
            loss.backward()
            opt.step()
            peer.step()
        peer.finish("budget")


if __name__ == "__main__":  # python -m tests.group_ranks train RANK JOIN INIT OUT STEPS | split KIND RANK JOIN INIT OUT | solo JOIN STEPS
    import sys

    what, *rest = sys.argv[1:]
    if what == "train":
        train(int(rest[0]), rest[1], rest[2], rest[3], int(rest[4]))
    elif what == "split":
        split(rest[0], int(rest[1]), rest[2], rest[3], rest[4])
    else:
        solo(rest[0], int(rest[1]))
