"""Push-sum averaging (Stochastic Gradient Push, Assran et al. 2019) as a sans-IO state machine.

Each peer holds a pair (x, w): a numerator and a scalar weight; its model is
the de-biased ``z = x / w``. Every ``exchange_every_steps`` steps it keeps
half of its mass and pushes the other half, ``(x/2, w/2)``, to one
out-neighbour; a receiver adds what arrives to its own pair. Only sums are
exchanged, so the total mass (sum of x and of w over peers and messages in
flight) is conserved exactly, whatever the graph: directed, time-varying or
changing under churn. No reply is needed, so a push never waits.

The model in ``params`` always holds ``z`` (gradient steps act on it), and
``x = z * w`` is formed only when pushing. A push that cannot be delivered
(the receiver's queue was full, the update was beyond the staleness bound,
the address unknown) comes back as a refusal, and its mass is taken back,
so nothing is lost unless the network itself loses the message.

Staleness weighting does not apply here: scaling a push would destroy mass.
The staleness bound does (the stale push is refused and its mass returns).
"""

from __future__ import annotations

import random
from collections import OrderedDict
from typing import Mapping

import torch

from gossiptrain.config import GossipConfig
from gossiptrain.net.kinds import XNAK, XPUSH
from gossiptrain.protocol.averaging import Action, AtSafePoint, Averaging, Event, Received, Rejected, SendExchange

#: Pushes remembered so that a refused one can be taken back (each holds one model-sized tensor set).
UNACKED_PUSHES = 2
#: Below this weight a peer stops pushing: its mass would underflow (it has had nothing pushed to it for long).
MIN_PUSH_WEIGHT = 2.0**-60


class PushSum(Averaging):
    """SGP over the live ``params``: ``params`` is z = x / w, ``weight`` is w."""

    def __init__(
        self, params: Mapping[str, torch.Tensor], config: GossipConfig, rng: random.Random, me: str = ""
    ) -> None:
        super().__init__(params, config, rng, me)
        self.weight = 1.0
        self._last_push_step = -(10**9)
        # xid -> (numerator sent, as the receiver decodes it; weight sent)
        self._unacked: OrderedDict[int, tuple[list[torch.Tensor], float]] = OrderedDict()

    def mass(self) -> tuple[list[torch.Tensor], float]:
        """Our part of the swarm's mass: (x = z * w, w); the invariant the tests check."""
        return [p.detach() * self.weight for p in self.params], self.weight

    def handle(self, event: Event, now: float) -> list[Action]:
        if isinstance(event, AtSafePoint):
            return self._tick(event)
        if isinstance(event, Received):
            if event.kind == XPUSH:
                return self._absorb(event)
            if event.kind == XNAK:
                return self._take_back(event)
            return []  # another algorithm's message (a misconfigured sender): ignore
        raise TypeError(f"unknown event {event!r}")

    def _tick(self, tick: AtSafePoint) -> list[Action]:
        self._step = tick.step
        if tick.step - self._last_push_step < self.config.exchange_every_steps or not tick.partners:
            return []
        if self.weight < MIN_PUSH_WEIGHT:
            return []
        to = self.rng.choice(list(tick.partners))
        half = self.weight / 2
        with torch.no_grad():
            out = [p.detach() * half for p in self.params]  # x / 2 = z * w / 2, new tensors
            encoded = self._encode_own(out)
            if encoded is None:
                return []
            wire, sent = encoded
            if not self.lossless:
                # We keep x - sent (not x / 2), so that what we keep plus what the receiver decodes
                # is exactly x: z <- (z * w - sent) / (w / 2) = 2 z - sent / half.
                torch._foreach_mul_(self.params, 2.0)
                torch._foreach_add_(self.params, sent, alpha=-1.0 / half)
        self.weight = half
        xid = self._new_xid()
        self._unacked[xid] = (sent, half)
        while len(self._unacked) > UNACKED_PUSHES:
            self._unacked.popitem(last=False)
        self._last_push_step = tick.step
        self.stats.started += 1
        return [SendExchange(to, XPUSH, xid, wire, {"w": half, "ver": self.version})]

    def _absorb(self, msg: Received) -> list[Action]:
        w_in = msg.meta.get("w")
        if not isinstance(w_in, float):
            self.stats.rejected += 1
            return [Rejected(msg.sender, "push without a weight")]
        remote = self._validated(msg)
        if isinstance(remote, Rejected):
            return [remote, SendExchange(msg.sender, XNAK, msg.xid, {})]
        if self.staleness.bound and self._staleness_weight(msg) is None:
            return [SendExchange(msg.sender, XNAK, msg.xid, {})]  # the sender takes its mass back
        self._add_mass(remote, w_in)
        self.stats.served += 1
        self.version += 1
        self._record_staleness(msg)
        return []

    def _take_back(self, msg: Received) -> list[Action]:
        pending = self._unacked.pop(msg.xid, None)
        if pending is not None:
            self._add_mass(*pending)
            self.stats.lost += 1
        return []

    def _add_mass(self, x_in: list[torch.Tensor], w_in: float) -> None:
        # (x, w) += (x_in, w_in) with x = z * w kept implicit: z <- (z * w + x_in) / (w + w_in)
        total = self.weight + w_in
        with torch.no_grad():
            torch._foreach_mul_(self.params, self.weight / total)
            torch._foreach_add_(self.params, x_in, alpha=1.0 / total)
        self.weight = total
