"""One rank of a split peer, alone (no partner), that reports the numbers its piece methods run by
(tests/test_piece_methods.py). ``python -m tests.piece_methods_ranks RANK PORT OUT [guard]``.

Twice: the model FSDP2-sharded (no running statistics), then cut into 2 pipeline stages whose second holds a
BatchNorm. Each time the leader passes news naming 5 members and a round trip of 20 local steps; each rank writes
the gain, the drift correction's memory, the members the rate scaling counts, and the multiplier of one Adam step.

``guard``: the FSDP2 model takes safe points without local steps; past the guard's warmup rank 1's piece grows 10x
(a blow-up on one rank), later rank 0's gets a NaN. Each rank writes its guard's counts after each, whether its piece
is back to what it was, and whether its optimizer's state was forgotten.

``qgm``: the FSDP2 model trains with SGD (momentum 0.9) and quasi-global momentum asked for, rank 1 binding its
optimizer ``LATE_BIND`` steps after rank 0 (as one found late would); each rank writes the steps at which quasi-global
momentum ran (the group's word: both ranks ready) and whether its momentum buffers are the DTensors SGD made.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from gossiptrain.config import GossipConfig
from gossiptrain.runtime.loop_thread import LoopThread
from gossiptrain.runtime.split_group import SplitGroup
from gossiptrain.runtime.split_peer import bind_piece_optimizer


def model(kind: str, rank: int) -> nn.Module:
    torch.manual_seed(0)
    if kind == "fsdp":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
        return fully_shard(net, mesh=init_device_mesh("cpu", (2,)))
    net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.BatchNorm1d(16), nn.Linear(16, 2))
    return net[:2] if rank == 0 else net[2:]  # the BatchNorm in the second stage only


def report(kind: str, rank: int, loop: LoopThread) -> dict[str, object]:
    net = model(kind, rank)
    group = SplitGroup(dist.group.WORLD, net, me="P", host=f"127.0.0.{71 + rank}", fingerprint="methods-test",
                       loop=loop, timeout=2.0, clock=time.monotonic, gossip=GossipConfig())
    assert group.methods is not None
    opt = torch.optim.Adam(net.parameters(), lr=0.01)
    bind_piece_optimizer(group, opt)
    news = {"members": 5.0} if rank == 0 else None
    told = group.safe_point(None, news, 20.0 if rank == 0 else None)  # only the leader's numbers count
    if kind == "fsdp":
        net(torch.randn(4, 8)).sum().backward()
    else:  # each stage on its own: the test asks what its optimizer's step is scaled by, not the pipeline's loss
        net(torch.randn(4, 8 if rank == 0 else 16)).sum().backward()
    seen = []
    opt.register_step_pre_hook(lambda o, *_: seen.append(o.param_groups[0]["lr"]))  # after the scaling's own hook
    opt.step()
    drift = group.methods.drift
    out = {"gain": group.methods.gain, "memory": drift.memory if drift is not None else None, "told": told,
           "members": group.methods.members, "lr_in_step": seen[0], "lr_after": opt.param_groups[0]["lr"],
           "lr_scale": group.methods.lr_scale}
    group.close()
    return out


def guard(rank: int, loop: LoopThread) -> dict[str, object]:
    from gossiptrain.protocol.pieces import local_piece
    from gossiptrain.protocol.stability import WARMUP

    net = model("fsdp", rank)
    group = SplitGroup(dist.group.WORLD, net, me="P", host=f"127.0.0.{71 + rank}", fingerprint="guard-test",
                       loop=loop, timeout=2.0, clock=time.monotonic, gossip=GossipConfig())
    assert group.methods is not None
    opt = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9)
    net(torch.randn(4, 8)).sum().backward()
    opt.step()  # a momentum buffer: the guard's restore must forget it
    opt.zero_grad()
    bind_piece_optimizer(group, opt)
    piece = list(local_piece(net).values())
    original = [t.clone() for t in piece]
    out: dict[str, object] = {}
    for safe_point in range(WARMUP + 100):
        if safe_point == WARMUP + 10 and rank == 1:
            with torch.no_grad():
                for t in piece:
                    t.mul_(10.0)
        if safe_point == WARMUP + 60 and rank == 0:
            with torch.no_grad():
                piece[0].view(-1)[0] = float("nan")
        group.safe_point(None)
        if safe_point in (WARMUP + 10, WARMUP + 60):
            stats = group.methods.stats()
            out[f"after_{safe_point - WARMUP}"] = {
                "backoffs": stats["guard_backoffs"], "restores": stats["guard_restores"], "off": stats["guard_off"],
                "back": all(torch.equal(t, o) for t, o in zip(piece, original)), "momentum": len(opt.state),
            }
    group.close()
    return out


LATE_BIND = 3


def quasi_global(rank: int, loop: LoopThread) -> dict[str, object]:
    from gossiptrain.protocol.momentum import WARMUP_SAFE_POINTS

    net = model("fsdp", rank)
    group = SplitGroup(dist.group.WORLD, net, me="P", host=f"127.0.0.{71 + rank}", fingerprint="qgm-test",
                       loop=loop, timeout=2.0, clock=time.monotonic, gossip=GossipConfig(momentum_mode="quasi-global"))
    methods = group.methods
    assert methods is not None and methods.quasi_global
    opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    ran: list[int] = []
    apply = methods.momentum_apply
    step = 0

    def counted(norm: float) -> None:
        ran.append(step)
        apply(norm)

    methods.momentum_apply = counted  # type: ignore[method-assign]
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(rank))
    for step in range(WARMUP_SAFE_POINTS + 20):
        if step == LATE_BIND * rank:
            bind_piece_optimizer(group, opt)
        opt.zero_grad()
        net(x).square().mean().backward()
        opt.step()
        group.safe_point(None)
    buffers = [opt.state[p].get("momentum_buffer") for p in net.parameters()]
    out = {"ran": ran, "dtensor_buffers": all(type(b).__name__ == "DTensor" for b in buffers)}
    group.close()
    return out


def main(rank: int, port: int, out: Path, mode: str = "") -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    loop = LoopThread(f"methods-{rank}").start()
    got = (guard(rank, loop) if mode == "guard" else quasi_global(rank, loop) if mode == "qgm"
           else {kind: report(kind, rank, loop) for kind in ("fsdp", "pipeline")})
    loop.stop()
    out.write_text(json.dumps(got))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3]), *sys.argv[4:5])
