"""One rank of a split peer that checkpoints its piece, or resumes from it (tests/test_piece_checkpoints.py).

``python -m tests.piece_checkpoint_ranks RANK PORT KIND MODE DIR``: KIND
fsdp or pipeline (each stage trains on a loss of its own: the checkpoint
is what is tested, not the pipeline schedule). MODE ``save``: 3 steps of
SGD with momentum, a checkpoint of each rank's piece, then 2 more steps
whose result is written as the reference (and, for FSDP2, the full model
at the save, by torch's own all-gather). MODE ``resume``: a fresh model
and optimizer resume from the checkpoints and take the same 2 steps;
their result is written beside the reference.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import save_file

from gossiptrain.protocol.pieces import local_piece
from gossiptrain.runtime import piece_checkpoints
from gossiptrain.runtime.peer_group import PeerGroup
from gossiptrain.state.checkpoint import Checkpointer

from .split_ranks import model, split


def steps(net: torch.nn.Module, opt: torch.optim.Optimizer, kind: str, rank: int, seeds: range) -> None:
    width = 8 if kind == "fsdp" or rank == 0 else 17
    for seed in seeds:
        x = torch.randn(4, width, generator=torch.Generator().manual_seed(100 * rank + seed))
        opt.zero_grad()
        net(x).square().mean().backward()
        opt.step()


def main(rank: int, port: int, kind: str, mode: str, out: Path) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    net = split(model(1), kind, rank)
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    group = PeerGroup(dist.group.WORLD)
    layout = group.layout(net)
    directory = out / "ckpt"
    if mode == "save":
        steps(net, opt, kind, rank, range(3))
        with Checkpointer(piece_checkpoints.rank_directory(directory, rank)) as ckpt:
            ckpt.save(net, opt, step=3, samples_seen=12, peer="A", piece=piece_checkpoints.piece_info(layout, rank))
        if kind == "fsdp":
            full = {n: p.full_tensor().detach().clone() for n, p in net.named_parameters()}
            if rank == 0:
                save_file(full, str(out / "full.safetensors"))
        (out / f"layout-{rank}.json").write_text(json.dumps(layout.to_wire()))
    else:
        step = piece_checkpoints.resume(group, directory, net, opt, layout)
        (out / f"resumed-{rank}.json").write_text(json.dumps(step))
    steps(net, opt, kind, rank, range(3, 5))
    save_file({n: t.detach().clone().contiguous() for n, t in local_piece(net).items()}, str(out / f"{mode}-{rank}.safetensors"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4], Path(sys.argv[5]))
