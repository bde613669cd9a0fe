"""One rank of a split peer that averages its piece with the same rank of another peer (tests/test_split_group.py).

``python -m tests.split_ranks PEER RANK PORT KIND DIR EXCHANGES [kill|train]``:
PEER is A or B (A asks, B serves), each peer a gloo group of 2 ranks on its
own PORT, the model split by FSDP2 or as 2 pipeline stages (KIND). Nothing
trains: the pieces change only by the exchanges, so the test knows what
they must hold. Each rank writes its piece before and after
(``DIR/PEER-RANK.{before,after}.safetensors``) and its counts. With
``kill``, B's rank 1 dies (``os._exit``) once it has served a request, and
A stops after its first aborted exchange. With ``train`` (FSDP2), every
rank takes an SGD step before each safe point, and at the end both ranks
run the model on one probe batch (``DIR/PEER-probe.safetensors``): what
FSDP2 computes from the shards the exchanges wrote. With ``flow``, every
rank of A takes an SGD step before each safe point and A's leader asks for
flow control with a bound of ``FLOW_BOUND`` steps, while B pauses 200 ms
between its safe points (where it answers); A's ranks write how many local
steps they took between merges; pieces travel with ``auto`` compression,
at the level each peer's leader sets. With ``download``, A downloads B's
pieces (of a wider model, ``DOWNLOAD_HIDDEN``, in ``state.chunk_bytes`` of
1 KiB: several chunks a rank) with B's SGD momentum buffers
(``state.transfer_optimizer``: B took one step first, A binds its optimizer
after the download), its leader naming a donor that never answers as well
as B, and each rank of B stops answering the first session it serves after
``STALL_AFTER`` chunks: A's ranks must resume with another session, from
the chunks they had. Each rank writes its momentum buffers
(``DIR/PEER-RANK.momentum.safetensors``).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors.torch import save_file
from torch import nn

from gossiptrain.protocol.compression import get_codec
from gossiptrain.protocol.pieces import local_piece
from gossiptrain.state.local_tensors import local
from gossiptrain.protocol.step_timer import StepTimer
from gossiptrain.runtime.loop_thread import LoopThread
from gossiptrain.config import GossipConfig, StateConfig
from gossiptrain.net.kinds import SREQ
from gossiptrain.net.addressing import free_loopback_port
from gossiptrain.runtime.split_group import Partner, SplitGroup

FLOW_BOUND = 4
DOWNLOAD_HIDDEN, STALL_AFTER = 300, 3
DOWNLOAD_STATE = StateConfig(chunk_bytes=1024, request_timeout=1.0, max_seconds=30.0, transfer_optimizer=True)

HOSTS = {("A", 0): "127.0.0.61", ("A", 1): "127.0.0.62", ("B", 0): "127.0.0.63", ("B", 1): "127.0.0.64"}


def model(seed: int, hidden: int = 17) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, hidden), nn.ReLU(), nn.Linear(hidden, 5))


def split(net: nn.Module, kind: str, rank: int) -> nn.Module:
    if kind == "fsdp":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (2,))
        for layer in net:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh)
        return fully_shard(net, mesh=mesh)
    return net[:2] if rank == 0 else net[2:]  # pipeline stages: layers 0-1, layer 2 (names kept)


def save_piece(net: nn.Module, path: Path) -> None:
    save_file({n: t.detach().clone().contiguous() for n, t in local_piece(net).items()}, str(path))


def main(peer: str, rank: int, port: int, kind: str, out: Path, exchanges: int, mode: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    net = split(model(1 if peer == "A" else 2, DOWNLOAD_HIDDEN if mode == "download" else 17), kind, rank)
    loop = LoopThread(f"split-{peer}{rank}").start()
    codec = get_codec("auto") if mode == "flow" else None  # (flow: the leader's compression level too)
    gossip = GossipConfig() if mode == "flow" else None  # (flow: the default methods, the drift correction's pace)
    group = SplitGroup(dist.group.WORLD, net, me=peer, host=HOSTS[(peer, rank)], fingerprint="split-test",
                       loop=loop, timeout=2.0, clock=time.monotonic, codec=codec, steps=StepTimer(), gossip=gossip,
                       state=DOWNLOAD_STATE if mode == "download" else None)
    corrections: list[int] = []
    if gossip is not None and group.methods is not None and group.methods.drift is not None:
        drift_after = group.methods.drift.after  # counted: once per local step, however many safe points it held
        group.methods.drift.after = lambda **kw: (corrections.append(1), drift_after(**kw))[1]  # type: ignore[method-assign]
    save_piece(net, out / f"{peer}-{rank}.before.safetensors")
    if rank == 0:
        tmp = out / f".{peer}.json"
        tmp.write_text(json.dumps(list(group.addresses)))
        tmp.rename(out / f"{peer}.json")
    partner = None
    if (peer, rank) == ("A", 0):  # the leader meets B's: layouts checked, B's ranks' addresses learnt
        other = out / "B.json"
        deadline = time.monotonic() + 60
        while not other.exists() and time.monotonic() < deadline:
            time.sleep(0.02)
        partner = group.meet(json.loads(other.read_text())[0])
        assert partner.id == "B" and partner.addresses == tuple(json.loads(other.read_text()))
    if mode == "download":
        newcomer(peer, rank, group, partner, net, out)
        group.close()
        loop.stop()
        dist.destroy_process_group()
        return
    kill, flow = mode == "kill", mode == "flow"
    train = mode in ("train", "flow")
    bound = FLOW_BOUND if flow and (peer, rank) == ("A", 0) else None  # the leader's word holds every rank
    steps, merges, between, local_steps = 0, 0, [], 0
    opt = torch.optim.SGD(net.parameters(), lr=0.05)
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(10 * (peer == "B") + rank))  # each rank its batch
    done = out / "A.done"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if train:  # a local step between safe points, as a training loop takes
            local_steps += 1
            opt.zero_grad()
            net(x).square().mean().backward()
            opt.step()
        if kill and (peer, rank) == ("B", 1) and group.stats.served:
            os._exit(3)  # a rank dies: its group's next collective fails, and B's rank 0 with it
        # (the leader's word; rank 1 passes None): a start is proposed before the one in flight is decided
        asked = partner is not None and group.stats.committed + len(group.exchanges.in_flight) < exchanges \
            and not (kill and group.stats.aborted)
        group.safe_point(partner if asked else None, hold_bound=bound)
        if flow and peer == "A":
            steps += 1
            group.hold(lambda: group.safe_point(None, hold_bound=bound, local_step=False))
            if group.stats.committed > merges:
                merges, between, steps = group.stats.committed, between + [steps], 0
        elif flow:
            time.sleep(0.2)  # a slow server: A's requests wait for B's next safe point (A, even loaded, gets ahead)
        if peer == "A" and kill:
            finished = group.stats.aborted >= 1 and not group.busy
        elif peer == "A":  # (B refuses a request while A's word on the last one has not come: A asks again)
            finished = group.stats.committed >= exchanges and not group.busy
        else:
            finished = done.exists() and not group.exchanges.held
        if all(group.group.all_json(finished)):  # stop together, or one rank waits forever in a collective
            break
        if not (flow and peer == "A"):  # A steps as fast as it can: what flow control must hold back
            time.sleep(0.01)
    if peer == "A" and rank == 0:
        done.write_text("")
    save_piece(net, out / f"{peer}-{rank}.after.safetensors")
    if train:
        probe = torch.randn(3, 8, generator=torch.Generator().manual_seed(99))  # the same on both ranks
        with torch.no_grad():
            y = net(probe)
        if rank == 0:
            save_file({"probe": probe, "out": y.detach().clone()}, str(out / f"{peer}-probe.safetensors"))
    (out / f"{peer}-{rank}.stats.json").write_text(json.dumps({**group.stats.__dict__, "between": between,
                                                                 "waits": group.waits, "level": group.exchanges.level,
                                                                 "corrections": len(corrections), "steps": local_steps}))
    group.close()
    loop.stop()
    dist.destroy_process_group()


def newcomer(peer: str, rank: int, group: SplitGroup, partner: Partner | None, net: nn.Module, out: Path) -> None:
    """``download``: A downloads B's pieces, its leader naming a donor that never answers (nobody listens at its
    ranks' addresses) and B, whose ranks each stall the first session they serve; B takes safe points (where it
    copies its piece for the sessions) until A is done."""
    opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    if peer == "B":  # a step: momentum buffers to give
        net(torch.randn(4, 8, generator=torch.Generator().manual_seed(rank))).square().mean().backward()
        opt.step()
        group.bind_optimizer(opt)
    if peer == "A":
        candidates: list[Partner] = []
        if rank == 0:
            assert partner is not None
            gone = tuple(f"tcp://127.0.0.{65 + r}:{free_loopback_port()}" for r in range(2))
            candidates = [Partner("gone", gone, steps=1), partner]
        got = group.download((lambda: candidates.pop(0) if candidates else None) if rank == 0 else None, timeout=25.0)
        waiting = group.optimizer_transfer
        group.bind_optimizer(opt)  # found after the download, as at a first step: the state that came goes in now
        (out / f"A-{rank}.stats.json").write_text(json.dumps({
            "got": got, "optimizer": [waiting, group.optimizer_transfer], **group.transfer.endpoint.transfer.to_dict()}))
        if all(group.group.all_json(True)) and rank == 0:
            (out / "A.done").write_text("")
    else:
        group.download(None, timeout=1.0)  # no donor: a peer of the swarm's first, its pieces worth giving from now
        stall_first_session(group)
        while True:
            group.safe_point(None)
            if all(group.group.all_json((out / "A.done").exists())):
                break
            time.sleep(0.01)
    save_piece(net, out / f"{peer}-{rank}.after.safetensors")
    save_file({n: local(opt.state[p]["momentum_buffer"]).detach().clone().contiguous()
               for n, p in net.named_parameters() if "momentum_buffer" in opt.state[p]},
              str(out / f"{peer}-{rank}.momentum.safetensors"))


def stall_first_session(group: SplitGroup) -> None:
    """A donor rank that stops answering mid-download: the first session's requests past ``STALL_AFTER`` dropped."""
    first: list[int] = []
    answered = [0]
    on_message = group.transfer.endpoint.on_message

    def stalling(msg: Any) -> None:
        if msg.kind == SREQ and isinstance(msg.body, dict):
            if not first:
                first.append(msg.body.get("sid"))
            if msg.body.get("sid") == first[0]:
                answered[0] += 1
                if answered[0] > STALL_AFTER:
                    return
        on_message(msg)

    group.transfer.endpoint.on_message = stalling  # type: ignore[method-assign]


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], Path(sys.argv[5]), int(sys.argv[6]),
         sys.argv[7] if len(sys.argv) > 7 else "")
