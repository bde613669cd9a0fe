"""One rank of a two-rank model split by FSDP2 or a pipeline (tests/test_pieces.py starts two).

Each rank builds the same model, splits it, trains its piece a few steps (so
every rank's piece differs from the initial model), then writes its piece's
layout entries and tensors, and for FSDP2 the full parameters gathered by
torch's own collective: what ``pieces.gather`` must reproduce from the files.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import save_file
from torch import nn

from gossiptrain.protocol.pieces import local_piece, piece_entries


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 17), nn.ReLU(), nn.Linear(17, 5))  # 17 rows: shards of 9 and 8


def main(rank: int, port: int, kind: str, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    net = model()
    if kind == "fsdp":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (2,))
        for layer in net:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(net, mesh=mesh)
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(rank))  # each rank its own batch
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        for _ in range(3):
            opt.zero_grad()
            net(x).square().mean().backward()
            opt.step()
        full = {n: p.full_tensor().detach().clone() for n, p in net.named_parameters()}  # torch's own gather
        save_file(full, f"{out}.full.safetensors")
    else:  # pipeline: rank 0 holds layers 0-1, rank 1 layer 2 (a slice of a Sequential keeps the layers' names)
        net = net[:2] if rank == 0 else net[2:]
        with torch.no_grad():
            for p in net.parameters():
                p.add_(rank + 1.0)  # each stage trained apart
    save_file({n: t.contiguous() for n, t in local_piece(net).items()}, f"{out}.piece.safetensors")
    Path(f"{out}.entries.json").write_text(json.dumps([e.to_wire() for e in piece_entries(net)]))
    dist.destroy_process_group()


if __name__ == "__main__":  # python -m tests.piece_ranks RANK PORT KIND OUT
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4])
