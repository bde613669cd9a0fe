"""Push-sum averaging (Stochastic Gradient Push, Assran et al. 2019) as a sans-IO state machine.

Each peer holds a pair (x, w): a numerator and a scalar weight; its model is
the de-biased ``z = x / w``. Every ``exchange_every_steps`` steps it keeps
half of its mass and pushes the other half, ``(x/2, w/2)``, to one
out-neighbour; a receiver adds what arrives to its own pair. Only sums are
exchanged, so the total mass (sum of x and of w over peers and messages in
flight) is conserved exactly, whatever the graph: directed, time-varying or
changing under churn. No reply is needed, so a push never waits.

The model in ``params`` always holds ``z`` (gradient steps act on it), and
``x = z * w`` is formed only when pushing.

**Invariant.** The sums over members of ``x`` and of ``w``, plus the pushes
in flight, change only by local steps. A push that cannot be taken (the
receiver's queue was full, it was beyond the staleness bound, the sender is
quarantined, the address is unknown) comes back as a refusal that carries
the push itself, tensors and weight, and the sender adds it back: however
many pushes are refused, and however late, nothing depends on the sender
still remembering them (it remembers only which xids it sent to whom, so
that nobody else can hand it mass). Nothing is lost unless the network
itself loses a message, or a push is refused because its tensors are
unreadable (then there is nothing to give back).

Staleness weighting does not apply here: scaling a push would destroy mass.
The staleness bound does (the stale push is refused and its mass returns).
"""

from __future__ import annotations

import random
from collections import OrderedDict
from typing import Mapping

import torch

from gossiptrain.config import GossipConfig
from gossiptrain.errors import CheckpointError
from gossiptrain.net.kinds import XACK, XNAK, XPUSH
from gossiptrain.protocol.averaging import Averaging
from gossiptrain.protocol.averaging_events import (
    META_RANGES,
    Action,
    AtSafePoint,
    Event,
    MemberGone,
    Received,
    Rejected,
    SendExchange,
    Undelivered,
    wire_bytes,
)

#: Pushes remembered (xid -> receiver and weight, no tensors) so that only a refusal of our own push is taken back.
UNACKED_PUSHES = 4096
#: Flow control's automatic bound for push-sum: local steps past its oldest unacknowledged push. Half of
#: pairwise's (``averaging.AUTO_STEPS_AHEAD``): a push moves only its receiver, half way, where a pairwise
#: exchange moves both ends, so a pusher that drifts as many steps per message as pairwise drifts further.
PUSH_STEPS_AHEAD = 4
#: Below this weight a peer stops pushing: its mass would underflow (it has had nothing pushed to it for long).
MIN_PUSH_WEIGHT = 2.0**-60


class PushSum(Averaging):
    """SGP over the live ``params``: ``params`` is z = x / w, ``weight`` is w."""

    network_kinds = frozenset({XACK})  # receipts free the link as they arrive (``protocol.receipts``)
    auto_steps_ahead = PUSH_STEPS_AHEAD
    merges_stale = True  # a push is a model of before our last step, merged against ours of now

    def __init__(
        self, params: Mapping[str, torch.Tensor], config: GossipConfig, rng: random.Random, me: str = ""
    ) -> None:
        super().__init__(params, config, rng, me)
        self.weight = 1.0
        self._last_push_step = -(10**9)
        # xid -> (receiver, weight sent); the tensors come back with a refusal
        self._unacked: OrderedDict[int, tuple[str, float]] = OrderedDict()
        self._own_share = 1.0  # of the model as it was at the last ``take_stale_share``, what the merges since kept

    def take_stale_share(self) -> float:
        share, self._own_share = 1.0 - self._own_share, 1.0
        return share

    def checkpoint_state(self) -> dict[str, float]:
        return {"push_sum_weight": self.weight}

    def restore_state(self, state: Mapping[str, float]) -> None:
        """A resumed peer's weight: its model is z = x / w, so without w it would rejoin with another mass."""
        w = state.get("push_sum_weight")
        if w is None:
            return  # a checkpoint of another algorithm (or of an older gossiptrain): start from 1, as a newcomer
        if not (MIN_PUSH_WEIGHT <= w <= META_RANGES["w"][2]):
            raise CheckpointError(f"a checkpoint's push-sum weight {w!r} is outside [{MIN_PUSH_WEIGHT}, {META_RANGES['w'][2]}]")
        self.weight = float(w)

    def mass(self) -> tuple[list[torch.Tensor], float]:
        """Our part of the swarm's mass: (x = z * w, w); the invariant the tests check."""
        return [p.detach() * self.weight for p in self.params], self.weight

    def handle(self, event: Event, now: float) -> list[Action]:
        if isinstance(event, AtSafePoint):
            return self._tick(event, now)
        if isinstance(event, Received):
            if event.kind == XPUSH:
                return self._absorb(event)
            if event.kind == XACK:
                self.receipts.settled(event.sender, event.xid, now, receipt=True)
                return []
            if event.kind == XNAK:
                self.receipts.settled(event.sender, event.xid, now, receipt=False)
                return self._take_back(event)
            return []  # another algorithm's message (a misconfigured sender): ignore
        if isinstance(event, MemberGone):
            self.receipts.forget(event.member)
            return []
        if isinstance(event, Undelivered):
            return []  # an undelivered push comes back as its own refusal (the driver's); a receipt needs nothing
        raise TypeError(f"unknown event {event!r}")

    def flow_bound(self) -> int:
        return max(self.max_ahead, self.config.exchange_every_steps)

    def compression_bound(self) -> int:
        """About a push per ``exchange_every_steps`` steps: push-sum mixes only by pushes, so the link must keep up."""
        return 2 * self.config.exchange_every_steps

    def _tick(self, tick: AtSafePoint, now: float) -> list[Action]:
        self._at_step(tick.step, now)
        if tick.step - self._last_push_step < self.config.exchange_every_steps or not tick.partners:
            return []
        if self.receipts.in_flight(now):  # one push at a time: at the link's pace, not the steps'
            return []
        if self.weight < MIN_PUSH_WEIGHT:
            return []
        to = self.rng.choice(list(tick.partners))
        half = self.weight / 2
        with torch.no_grad():
            out = self.buffers.like(self.params)  # x / 2 = z * w / 2, in buffers reused once sent
            for o, p in zip(out, self.params, strict=True):
                torch.mul(p.detach(), half, out=o)
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
        self._unacked[xid] = (to, half)
        while len(self._unacked) > UNACKED_PUSHES:
            self._unacked.popitem(last=False)
        self._last_push_step = tick.step
        self.receipts.pushed(to, xid, tick.step, now, wire_bytes(wire))
        self.stats.started += 1
        return [SendExchange(to, XPUSH, xid, wire, {"w": half, "ver": self.version})]

    def _absorb(self, msg: Received) -> list[Action]:
        w_in = msg.meta.get("w")
        if not isinstance(w_in, float):
            self.stats.rejected += 1
            return [Rejected(msg.sender, "push without a weight")]
        remote = self._validated(msg)
        if isinstance(remote, Rejected):
            return [remote, SendExchange(msg.sender, XNAK, msg.xid, {})]  # unreadable: nothing to give back
        if self.staleness.bound and self._staleness_weight(msg) is None:
            return [refusal(msg)]  # the sender takes its mass back
        self._add_mass(remote, w_in)
        self.stats.served += 1
        self.version += 1
        self._record_staleness(msg)
        return []

    def _take_back(self, msg: Received) -> list[Action]:
        pushed = self._unacked.get(msg.xid)
        if pushed is None or msg.sender != pushed[0]:  # not a push of ours to them
            return []
        if not msg.tensors:  # refused as unreadable: our mass is gone (the receiver logged why)
            del self._unacked[msg.xid]
            self.stats.lost += 1
            return []
        returned = self._validated(msg)
        if isinstance(returned, Rejected):  # they sent back something else than our push: keep waiting
            return [returned]
        del self._unacked[msg.xid]
        self._add_mass(returned, pushed[1])
        self.stats.refused += 1
        return []

    def _add_mass(self, x_in: list[torch.Tensor], w_in: float) -> None:
        # (x, w) += (x_in, w_in) with x = z * w kept implicit: z <- (z * w + x_in) / (w + w_in)
        total = self.weight + w_in
        with torch.no_grad():
            torch._foreach_mul_(self.params, self.weight / total)
            torch._foreach_add_(self.params, x_in, alpha=1.0 / total)
        self._own_share *= self.weight / total
        self.weight = total


def refusal(push: Received | SendExchange) -> SendExchange:
    """The refusal of ``push`` that gives its mass back: the push's own tensors and weight, to its sender.

    For a push that arrived, it goes to the sender; for one of ours that could
    not be sent, the driver hands it to our own machine as if received.
    """
    to = push.sender if isinstance(push, Received) else push.to
    meta = {"w": push.meta["w"]} if "w" in push.meta else {}
    return SendExchange(to, XNAK, push.xid, dict(push.tensors), meta)
