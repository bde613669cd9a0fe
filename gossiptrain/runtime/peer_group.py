"""A peer made of several workers: synchronous data parallelism inside, gossip between peers.

``Peer(model, join=..., group=process_group)``, called on every rank of a
``torch.distributed`` group, makes one swarm member of the whole group (as
DiLoCo-style and HSDP setups run: DDP inside a group, rare communication
between groups). Only the group's rank 0 (its *leader*) joins the swarm;
``Peer`` returns a ``GroupWorker`` on the other ranks, which never touches
the network. The workers train with DDP (gloo on CPU, NCCL on GPUs), so
their gradients are averaged every step; at each safe point the leader
applies what the swarm sent, and ``PeerGroup.sync`` then broadcasts the
leader's parameters and buffers to every rank, with a few numbers of
control (whether the swarm asked to stop, members known). Every worker
therefore holds the leader's parameters after every safe point, bit for bit.

Only the leader's optimizer matters: each step overwrites the other ranks'
parameters with the leader's, so their own optimizer states never reach a
parameter (their step is redundant work, not a second source of truth).
That costs one broadcast of the model per step on top of DDP's all-reduce:
cheap inside a machine, where such groups live.

Loops must agree on when to stop, or one rank waits forever in a
collective: ``Peer.agree(flag)`` is the leader's decision, on every rank.
A worker that dies makes the group's next collective fail on the others
(gloo: the connection closes); the leader then leaves the swarm cleanly
(see ``gossiptrain.train.peer_loop``), and the swarm goes on without it.

Nothing is pickled: the welcome goes to the workers as JSON bytes in a
tensor, the rest as tensors.
"""

from __future__ import annotations

import json
import math
from collections import defaultdict
from typing import Any, Mapping, Sequence

import torch
import torch.distributed as dist

from gossiptrain.errors import GossipError
from gossiptrain.protocol.pieces import PieceEntry, PieceLayout, gather, local_piece, piece_entries

CONTROL_FIELDS = ("finish_requested", "members", "steps")  # what the leader tells the workers at each sync


class PeerGroup:
    """One rank's side of its group's collectives (see the module docstring)."""

    def __init__(self, group: Any) -> None:
        if not dist.is_available() or not dist.is_initialized():
            raise GossipError("Peer(group=...): torch.distributed is not initialised (init_process_group first)")
        self.group = group
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)
        self.leader_rank = dist.get_global_rank(group, 0)  # broadcasts name the source by its global rank
        self.leader = self.rank == 0
        self._control = torch.zeros(len(CONTROL_FIELDS), dtype=torch.float64)
        self._flag = torch.zeros(1, dtype=torch.uint8)
        self._views: list[tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor]]] = []  # (flat, views, tensors)
        self._model: torch.nn.Module | None = None

    # -- joining -----------------------------------------------------------------------------------

    def share(self, info: dict[str, Any] | None, error: str = "") -> dict[str, Any]:
        """The leader's welcome (id, shard, run) to every rank; a worker raises the leader's ``error`` if it failed."""
        payload = json.dumps({"error": error} if info is None else info).encode() if self.leader else b""
        size = torch.tensor([len(payload)], dtype=torch.int64)
        dist.broadcast(size, self.leader_rank, group=self.group)
        data = torch.frombuffer(bytearray(payload), dtype=torch.uint8) if self.leader else torch.empty(int(size), dtype=torch.uint8)
        if int(size):
            dist.broadcast(data, self.leader_rank, group=self.group)
        got: dict[str, Any] = json.loads(data.numpy().tobytes().decode()) if not self.leader else (info or {})
        if not self.leader and "error" in got:
            raise GossipError(f"the leader of this peer (rank 0) could not join: {got['error']}")
        return got

    def check_whole(self, model: torch.nn.Module) -> None:
        """Every rank holds the whole model (DDP): raise, on every rank alike, where FSDP2 sharded it or the ranks
        hold different parameters (pipeline stages). ``sync`` would otherwise copy rank 0's shard or stage over
        every other rank's. A model split before ``Peer(...)`` is a split peer's (``gossiptrain.runtime.split_peer``,
        chosen before joining); one a model factory splits is found only here, after the join, too late."""
        layout = self.layout(model)
        if layout.kind == "whole":
            return
        raise GossipError(
            f"Peer(group=...): the model factory's model is split across this peer's ranks ({layout.describe()}): "
            "a split model's layout is part of what the swarm checks at join, so split it (fully_shard, a pipeline "
            "stage) before Peer(...) and pass the module")

    def layout(self, model: torch.nn.Module) -> PieceLayout:
        """What every rank of this group holds of ``model`` (collective): FSDP2 shards, pipeline stages (ranks
        holding different parameters), or the whole model on every rank."""
        every = self.all_json([e.to_wire() for e in piece_entries(model)])
        return PieceLayout.of_ranks(tuple(tuple(PieceEntry(e[0], e[1], tuple(e[2]), e[3]) for e in rank) for rank in every))

    def all_json(self, value: Any) -> list[Any]:
        """``value`` of every rank, in rank order (JSON bytes in tensors: nothing is pickled)."""
        payload = json.dumps(value).encode()
        sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(self.size)]
        dist.all_gather(sizes, torch.tensor([len(payload)], dtype=torch.int64), group=self.group)
        longest = max(int(s) for s in sizes)
        mine = torch.zeros(longest, dtype=torch.uint8)  # (longest,)
        mine[: len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        everyone = [torch.zeros(longest, dtype=torch.uint8) for _ in range(self.size)]
        dist.all_gather(everyone, mine, group=self.group)
        return [json.loads(b[: int(n)].numpy().tobytes().decode()) for b, n in zip(everyone, sizes)]

    def gather_on_leader(self, tensors: Mapping[str, torch.Tensor]) -> list[dict[str, torch.Tensor]] | None:
        """Every rank's named ``tensors`` on the leader, in rank order (a collective; other ranks get None). Names,
        dtypes and shapes go as JSON, the values as one float64 buffer per rank (it holds every float dtype, and
        integers up to 2^53, exactly): nothing is pickled."""
        mine = [(name, str(t.dtype).removeprefix("torch."), list(t.shape)) for name, t in tensors.items()]
        every = self.all_json(mine)
        sizes = [sum(math.prod(shape) for _, _, shape in rank) for rank in every]
        flat = torch.zeros(max(max(sizes), 1), dtype=torch.float64)  # (largest rank's values,)
        if tensors:
            values = torch.cat([t.detach().reshape(-1).to(torch.float64) for t in tensors.values()])
            flat[: values.numel()] = values
        received = [torch.empty_like(flat) for _ in every] if self.leader else None
        dist.gather(flat, received, dst=self.leader_rank, group=self.group)
        if received is None:
            return None
        out = []
        for entries, buf in zip(every, received):
            named, offset = {}, 0
            for name, dtype, shape in entries:
                n = math.prod(shape)
                named[name] = buf[offset: offset + n].reshape(shape).to(getattr(torch, dtype))
                offset += n
            out.append(named)
        return out

    def whole_state(self, model: torch.nn.Module, layout: PieceLayout) -> dict[str, torch.Tensor] | None:
        """The unsplit model's state_dict on the leader, from every rank's piece and buffers (a collective; other
        ranks get None): the parameters put together as ``layout`` says (``pieces.gather``), each persistent buffer as
        the first rank that holds it has it (FSDP2 leaves buffers whole on every rank; a pipeline stage's are its
        own)."""
        mine = {f"p{name}": t for name, t in local_piece(model).items()}
        persistent = set(model.state_dict())  # (a buffer registered persistent=False is not the model's state)
        mine.update({f"b{name}": b for name, b in model.named_buffers() if name in persistent})
        every = self.gather_on_leader(mine)
        if every is None:
            return None
        params = [{k[1:]: t for k, t in rank.items() if k[0] == "p"} for rank in every]
        state = gather(layout, params)
        for rank in every:
            for k, t in rank.items():
                if k[0] == "b":
                    state.setdefault(k[1:], t)
        return state

    # -- every step -----------------------------------------------------------------------------

    def agree(self, flag: bool) -> bool:
        """The leader's ``flag`` on every rank (whether to go on training, say)."""
        self._flag.fill_(int(flag))
        dist.broadcast(self._flag, self.leader_rank, group=self.group)
        return bool(self._flag)

    def sync(self, model: torch.nn.Module, control: Sequence[float] = ()) -> list[float]:
        """The leader's parameters and buffers into every rank's ``model``, and the leader's ``control`` numbers."""
        c = self._control
        c.zero_()
        if self.leader:
            c[: len(control)] = torch.tensor(list(control), dtype=torch.float64)
        dist.broadcast(c, self.leader_rank, group=self.group)
        for flat, views, tensors in self._flats(model):
            if self.leader:
                torch._foreach_copy_(views, tensors)
            dist.broadcast(flat, self.leader_rank, group=self.group)
            if not self.leader:
                torch._foreach_copy_(tensors, views)
        return c.tolist()

    def _flats(self, model: torch.nn.Module) -> list[tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor]]]:
        """One flat buffer per dtype and device, made once: a broadcast per dtype, nothing allocated per step."""
        if self._model is not model:
            by_kind: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = defaultdict(list)
            with torch.no_grad():
                for t in [*model.parameters(), *model.buffers()]:
                    by_kind[(t.dtype, t.device)].append(t.detach())
            self._views = []
            for (dtype, device), tensors in by_kind.items():
                flat = torch.empty(sum(t.numel() for t in tensors), dtype=dtype, device=device)  # (total numel,)
                views, offset = [], 0
                for t in tensors:
                    views.append(flat[offset: offset + t.numel()].view_as(t))
                    offset += t.numel()
                self._views.append((flat, views, tensors))
            self._model = model
        return self._views


def control_dict(values: Sequence[float]) -> dict[str, float]:
    return dict(zip(CONTROL_FIELDS, values))
