"""Local SGD with gossip averaging, and an optional DiLoCo-style outer optimizer (sans-IO).

``LocalSGD`` is neighbour averaging (``gossiptrain.protocol.neighbor``) once
every ``local_steps`` (H) steps, with an optional outer optimizer in the
style of DiLoCo (Douillard et al. 2023):
the change of the model over a round (local steps and merges) is treated
as a gradient, ``delta = anchor - x``, and applied to the round's starting
point with Nesterov momentum. ``outer_lr=1, outer_momentum=0`` is plain
local SGD with gossip averaging.

**Invariant.** Without the outer optimizer, that of neighbour averaging (the
mean moves only by local steps, exactly in synchronous rounds). The outer
step replaces the round's change ``delta`` by ``outer_lr (delta + mu m)``:
it moves the swarm's mean by the mean of those, which is the point of it
(a larger, momentum-smoothed step), and it scales the disagreement the
round's merges removed by the same factor.
"""

from __future__ import annotations

import random
from typing import Mapping

import torch

from gossiptrain.config import GossipConfig
from gossiptrain.protocol.neighbor import NeighborAveraging


class LocalSGD(NeighborAveraging):
    """H local steps, then a neighbour-averaging round and an optional outer (Nesterov) step."""

    def __init__(
        self, params: Mapping[str, torch.Tensor], config: GossipConfig, rng: random.Random, me: str = ""
    ) -> None:
        super().__init__(params, config, rng, me)
        self.every = config.local_steps
        self.outer = config.outer_lr != 1.0 or config.outer_momentum != 0.0
        self._anchor = self._snapshot() if self.outer else []  # the model at the start of the round
        self._momentum = [torch.zeros_like(p) for p in self.params] if config.outer_momentum else []

    def suspend(self) -> None:
        """The stability guard backs off the outer step: plain local SGD until ``resume``, momentum forgotten."""
        self.outer = False
        for m in self._momentum:
            m.zero_()

    def resume(self) -> None:
        """The outer step again, from this round's start (the model as it is now)."""
        self._anchor = self._snapshot()
        self.outer = True

    @property
    def has_outer_step(self) -> bool:
        """Whether this run's configuration asks for an outer step (``outer_lr`` or ``outer_momentum`` set)."""
        return self.config.outer_lr != 1.0 or self.config.outer_momentum != 0.0

    def _end_of_round(self) -> None:
        if not self.outer:
            return
        lr, mu = self.config.outer_lr, self.config.outer_momentum
        with torch.no_grad():
            delta = self.buffers.like(self.params)  # the round's "outer gradient", in buffers reused every round
            for d, a, p in zip(delta, self._anchor, self.params, strict=True):
                torch.sub(a, p, out=d)
            if mu:
                torch._foreach_mul_(self._momentum, mu)
                torch._foreach_add_(self._momentum, delta)  # m <- mu m + delta
                torch._foreach_add_(delta, self._momentum, alpha=mu)  # Nesterov: delta + mu m
            # x <- anchor - lr * step
            for p, a, d in zip(self.params, self._anchor, delta):
                p.copy_(a).add_(d, alpha=-lr)
            torch._foreach_copy_(self._anchor, [p.detach() for p in self.params])  # in place: the anchor is ours alone
