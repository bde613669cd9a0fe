"""Synchronous rounds of the real averaging state machines, without training or a network.

The event-driven simulator (``Cluster``) runs peers asynchronously in
virtual time, as real peers run. Theory, though, is stated in synchronous
rounds: every peer sends, every message arrives, every peer merges. This
driver runs exactly that with the same state machines the runtime uses (so
its results test them, not a model of them): in round r each peer gets a
``AtSafePoint`` with its topology neighbours for round r, and every message is
delivered, replies included, before the next round. ``flush`` makes each
peer merge what arrived in the last round without starting another.

Values are one vector per peer, usually float64 so that invariants such as
push-sum's mass conservation can be checked to rounding error.
"""

from __future__ import annotations

import random
from collections import deque

import torch

import topologies
from gossiptrain.config import GossipConfig
from gossiptrain.protocol.algorithms import make_averaging
from gossiptrain.protocol.averaging import Averaging
from gossiptrain.protocol.averaging_events import AtSafePoint, Received, SendExchange


class Lockstep:
    """``n`` peers, peer i holding ``initial[i]`` as its only parameter ``x``."""

    def __init__(self, initial: torch.Tensor, gossip: GossipConfig, seed: int = 0) -> None:
        if initial.dim() != 2 or initial.shape[0] < 1:
            raise ValueError(f"initial values must be (peers, dim), got {list(initial.shape)}")
        self.n = initial.shape[0]
        self.topology = topologies.parse(gossip.topology_spec)
        self.ids = [f"p{i:05d}" for i in range(self.n)]  # sorted like a membership view
        self._index = {m: i for i, m in enumerate(self.ids)}
        self.params = [{"x": initial[i].clone()} for i in range(self.n)]  # each (dim,)
        self.machines: list[Averaging] = [
            make_averaging(self.params[i], gossip, random.Random(seed * 1_000_003 + i), me=self.ids[i])
            for i in range(self.n)
        ]
        self.round = 0
        self.messages = 0

    def values(self) -> torch.Tensor:
        """(peers, dim): every peer's current model."""
        return torch.stack([p["x"] for p in self.params])

    def consensus_distance(self) -> float:
        """sqrt(mean_i ||x_i - mean x||^2): how far the peers are from agreeing."""
        v = self.values()  # (n, d)
        return float(((v - v.mean(dim=0)) ** 2).sum(dim=1).mean().sqrt())

    def step(self) -> None:
        """One synchronous round: tick every peer, then deliver everything until quiet."""
        self.round += 1
        queue: deque[tuple[int, SendExchange]] = deque()
        for i, machine in enumerate(self.machines):
            partners = [self.ids[j] for j in self.topology.neighbours(self.n, i, self.round)]
            queue.extend((i, a) for a in machine.handle(AtSafePoint(self.round, partners), float(self.round)) if _is_send(a))
        while queue:
            src, send = queue.popleft()
            self.messages += 1
            dst = self._index[send.to]
            event = Received(self.ids[src], send.kind, send.xid, send.tensors, self.round, dict(send.meta))
            actions = self.machines[dst].handle(event, float(self.round))
            queue.extend((dst, a) for a in actions if _is_send(a))

    def flush(self) -> None:
        """Let every peer merge what arrived, starting nothing new (a tick with no neighbours)."""
        for machine in self.machines:
            actions = machine.handle(AtSafePoint(self.round, []), float(self.round))
            if any(_is_send(a) for a in actions):
                raise RuntimeError("a flush tick must not send")

    def run(self, rounds: int) -> list[float]:
        """``rounds`` rounds then a flush; the consensus distance before and after each round."""
        out = [self.consensus_distance()]
        for _ in range(rounds):
            self.step()
            self.flush()
            out.append(self.consensus_distance())
        return out


def _is_send(action: object) -> bool:
    return isinstance(action, SendExchange)
