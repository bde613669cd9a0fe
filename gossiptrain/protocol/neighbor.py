"""Neighbour averaging (D-PSGD, Lian et al. 2017) as a sans-IO state machine.

Every round (``exchange_every_steps`` local steps) a peer pushes its model to
all its current topology neighbours. Models that arrive are kept, the newest
per sender, and merged at the next safe point all at once with
Metropolis-Hastings weights, ``x <- x + sum_j w_j (x_j - s)`` with
``w_j = f(staleness_j) / (1 + max(d_i, d_j))`` (``d`` is a peer's degree,
sent with its model) and ``s`` the model we sent at our last round (moved by
the merges since): the neighbours' models are mixed with the one they got
from us, and the local steps we took since are kept whole. On an undirected
graph in synchronous rounds this is exactly ``x <- W x`` plus the local
update, with the library's mixing matrix; asynchronously, a neighbour that
sent nothing since the last merge simply leaves its weight with us, so the
update never waits.

**Invariant.** In synchronous rounds on an undirected graph the MH matrix
is symmetric and doubly stochastic, so the mean of the models changes only
by local steps (``tests/test_algorithms.py`` checks it in lockstep).
Asynchronously it is not exact: a merge uses a neighbour's model of some
earlier round while that neighbour mixes ours of another, so the mean
wanders by a fraction of the models' disagreement, and shrinks as they
agree; a message that is lost or arrives late only leaves its weight with
the receiver (no mass exists to lose). What holds under every fault is that
nothing is made up: without local steps each merge is a convex combination,
so the models stay inside the box of the initial ones, and they come
together once faults stop (the averaging nemesis,
``gossiptrain.testing.averaging_nemesis``, checks both after every event;
top-k edges that fall silent leave the mixing, ``SILENT_EDGE_ROUNDS``).
Algorithms that promise exact conservation asynchronously are pairwise and
push-sum.

Local SGD (``gossiptrain.protocol.local_sgd``) is this exchange every H steps.
With ``compression="topk:..."`` it sends compressed changes against
per-edge references instead of models, and mix with the references once per
round (CHOCO-gossip, see ``gossiptrain.protocol.choco``).
"""

from __future__ import annotations

import random
from collections import OrderedDict
from dataclasses import dataclass
from typing import Mapping

import torch

from gossiptrain.config import GossipConfig
from gossiptrain.errors import ProtocolError
from gossiptrain.net.kinds import XACK, XNAK, XPUSH
from gossiptrain.protocol.averaging import Averaging
from gossiptrain.protocol.averaging_events import (
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
from gossiptrain.protocol.choco import ChocoEdges
from gossiptrain.protocol.robust import trimmed_mean

#: Senders whose latest model is held between two merges; more evict the oldest (bounds memory).
MAX_HELD_SENDERS = 64
#: Top-k: an in-edge that brought nothing for this many of our rounds leaves the mixing (and both its
#: references go) until the sender's next reset. Its reference is a model the sender no longer mixes with
#: ours (it died, moved to other neighbours, or its messages were refused); mixed forever, it pulls every
#: round toward a ghost and holds the swarm apart (found by the averaging nemesis). A straggler 16x slower
#: than us still sends within it.
SILENT_EDGE_ROUNDS = 16


@dataclass
class _Held:
    tensors: list[torch.Tensor]  # decoded and validated, in parameter order
    msg: Received  # for step, degree and version


class NeighborAveraging(Averaging):
    """D-PSGD over the live ``params``: push to every neighbour, merge what arrived with MH weights."""

    network_kinds = frozenset({XACK})  # receipts free the links as they arrive (``protocol.receipts``)

    def __init__(
        self, params: Mapping[str, torch.Tensor], config: GossipConfig, rng: random.Random, me: str = ""
    ) -> None:
        super().__init__(params, config, rng, me)
        self.every = config.exchange_every_steps
        self._held: OrderedDict[str, _Held] = OrderedDict()
        self._last_round_step = -(10**9)
        self._degree = 0  # our out-degree at the last round
        self.choco = ChocoEdges(self.codec, self._like()) if self.codec.name == "topk" else None
        self._latest: dict[str, Received] = {}  # top-k: the last message per in-edge (step, degree)
        self._rounds = 0  # our averaging rounds so far
        self._heard: dict[str, int] = {}  # top-k: the round in which each in-edge last brought a message
        # Our model as the neighbours got it at our last round, moved by every merge since: params - _sent
        # is our own training since we sent (None until our first round). See _merge_weighted.
        self._sent: list[torch.Tensor] | None = None

    def handle(self, event: Event, now: float) -> list[Action]:
        if isinstance(event, AtSafePoint):
            return self._tick(event, now)
        if isinstance(event, Received):
            if event.kind == XPUSH:
                return self._hold(event)
            if event.kind == XACK:
                self.receipts.settled(event.sender, event.xid, now, receipt=True)
            elif event.kind == XNAK:
                self.receipts.settled(event.sender, event.xid, now, receipt=False)
                if event.tensors and self.choco is not None:
                    self.choco.reset_out(event.sender)  # our push was refused: its reference moved on without it
            return []  # nothing waits for a reply; other kinds: a misconfigured sender
        if isinstance(event, Undelivered):
            if event.kind == XPUSH:
                self.receipts.settled(event.to, event.xid, now, receipt=False)
                if self.choco is not None:
                    self.choco.reset_out(event.to)
            return []
        if isinstance(event, MemberGone):
            self.receipts.forget(event.member)
            self._forget(event.member)
            return []
        raise TypeError(f"unknown event {event!r}")

    def _forget(self, member: str) -> None:
        """Nothing of a member that is gone stays to be mixed: its held model and its edges' references."""
        self._held.pop(member, None)
        self._latest.pop(member, None)
        self._heard.pop(member, None)
        if self.choco is not None:
            self.choco.forget(member)

    def _hold(self, msg: Received) -> list[Action]:
        if self.choco is not None:
            return self._hold_reference(msg, self.choco)
        previous = self._held.get(msg.sender)
        if previous is not None and int(previous.msg.meta.get("ver", 0)) > int(msg.meta.get("ver", 0)):
            self.stats.late += 1  # overtaken by a newer model from the same sender
            return []
        remote = self._validated(msg)
        if isinstance(remote, Rejected):
            return [remote]
        self._held[msg.sender] = _Held(remote, msg)
        self._held.move_to_end(msg.sender)
        while len(self._held) > MAX_HELD_SENDERS:
            self._held.popitem(last=False)
        return []

    def flow_bound(self) -> int:
        return max(self.max_ahead, self.every)

    def _tick(self, tick: AtSafePoint, now: float) -> list[Action]:
        self._at_step(tick.step, now)
        actions = self._merge() if self.choco is None else []
        if tick.step - self._last_round_step < self.every:
            return actions
        if self.receipts.in_flight(now):  # the last round's models are still on their way: one at a time per link
            return actions
        self._last_round_step = tick.step
        self._rounds += 1
        if self.choco is not None:
            actions += self._mix_references(self.choco)
        self._end_of_round()
        partners = list(tick.partners)
        self._degree = len(partners)
        if not partners:
            return actions
        xid = self._new_xid()
        self.stats.started += len(partners)
        meta = {"deg": len(partners), "ver": self.version}
        if self.choco is not None:
            for p in partners:
                try:
                    wire, seq = self.choco.encode_for(p, self._like())
                except ProtocolError:  # our model is not finite: let the base class say so, and send nothing
                    self._encode_own(self.params)
                    return actions
                actions.append(SendExchange(p, XPUSH, xid, wire, {**meta, "seq": seq}))
                self.receipts.pushed(p, xid, tick.step, now, wire_bytes(wire))
            return actions
        encoded = self._encode_own(self._frozen(self.params))  # a copy: the trainer moves on while it is sent
        if encoded is None:
            return actions
        wire, self._sent = encoded
        for p in partners:
            self.receipts.pushed(p, xid, tick.step, now, wire_bytes(wire))
        return actions + [SendExchange(p, XPUSH, xid, wire, meta) for p in partners]

    def _merge(self) -> list[Action]:
        if not self._held:
            return []
        d_me = max(self._degree, len(self._held))
        merged: list[tuple[float, _Held]] = []
        refused: list[Action] = []
        for held in self._held.values():
            factor = self._staleness_weight(held.msg)
            if factor is None:
                continue
            if self.clip is not None and self._clip_factor(held.tensors, self.params, held.msg.sender) is None:
                refused.append(Rejected(held.msg.sender, "model far beyond recent differences (robust)"))
                continue
            d_them = int(held.msg.meta.get("deg", d_me))
            merged.append((factor / (1 + max(d_me, d_them)), held))
        self._held.clear()
        if not merged:
            return refused
        total = sum(w for w, _ in merged)  # <= d_me / (1 + d_me) < 1
        if self.config.robust:
            self._merge_robust(total, [held.tensors for _, held in merged])
        else:
            self._merge_weighted(total, merged)
        for _, held in merged:
            self._record_staleness(held.msg)
        self.stats.served += len(merged)
        self.version += 1
        return refused

    def _merge_weighted(self, total: float, merged: list[tuple[float, _Held]]) -> None:
        """x <- x + sum_j w_j (x_j - s), s what we sent: mix the models the neighbours mix, keep our own steps.

        The neighbours' models were sent before our latest local steps, so
        ``(1 - total) x + sum_j w_j x_j`` would scale those steps down by
        ``1 - total`` (0.51 of plain SGD's progress with two peers under a
        constant gradient). Mixing against what we sent (D-PSGD's
        ``W x^t`` plus the gradient, Lian et al. 2017) keeps them whole, and
        on a symmetric graph the swarm's sum moves only by training. ``s``
        moves with each merge, so a fast neighbour's next model adds only
        what changed, never its difference twice.
        """
        with torch.no_grad():
            base = self._sent if self._sent is not None else [p.detach().clone() for p in self.params]
            delta = torch._foreach_mul(base, -total)  # all at once (sequential lerps would not be W x)
            for w, held in merged:
                torch._foreach_add_(delta, held.tensors, alpha=w)  # delta = sum_j w_j (x_j - s)
            torch._foreach_add_(self.params, delta)
            if self._sent is not None:
                self._sent = torch._foreach_add(self._sent, delta)  # new tensors: the sent ones may still be on the wire

    def _merge_robust(self, total: float, models: list[list[torch.Tensor]]) -> None:
        """x <- x + total * c * (trimmed_mean(x, models) - x): the same share, but no single model decides."""
        own = [p.detach() for p in self.params]
        center = trimmed_mean([own, *models], self.config.robust_trim)
        share = total
        with torch.no_grad():
            torch._foreach_lerp_(self.params, center, share)

    # -- top-k: per-edge references (CHOCO) ----------------------------------------------------

    def _hold_reference(self, msg: Received, choco: ChocoEdges) -> list[Action]:
        seq = msg.meta.get("seq")
        if not isinstance(seq, int):
            self.stats.rejected += 1
            return [Rejected(msg.sender, "top-k push without an edge sequence number")]
        try:
            applied = choco.receive(msg.sender, msg.tensors, seq)
        except ProtocolError as e:
            self.stats.rejected += 1
            choco.forget(msg.sender)
            return [Rejected(msg.sender, str(e))]
        if applied:
            self._latest[msg.sender] = msg
            self._heard[msg.sender] = self._rounds
        else:
            self.stats.late += 1
        return []

    def _mix_references(self, choco: ChocoEdges) -> list[Action]:
        """x += gamma * sum_j w_j (r_ji - r_ij) over in-edges in sync and heard from lately."""
        for j in [j for j, heard in self._heard.items() if self._rounds - heard > SILENT_EDGE_ROUNDS]:
            self._forget(j)
        self._latest = {j: m for j, m in self._latest.items() if j in choco.inn}
        if not self._latest:
            return []
        d_me = max(self._degree, len(self._latest))
        # CHOCO needs a smaller step the more is dropped: ratio 0.1 diverges on a ring at gamma 1 but converges
        # at 0.2. 2 * ratio converged on ring, torus and hypercube for ratios 0.01 to 0.3 (tests/test_algorithms.py).
        gamma = self.config.consensus_step or min(1.0, 2 * float(getattr(self.codec, "ratio", 0.5)))
        like = self._like()
        refused: list[Action] = []
        mixed = 0
        with torch.no_grad():
            for j, msg in list(self._latest.items()):
                factor = self._staleness_weight(msg)
                diff = choco.pull(j, like)
                if factor is None or diff is None:
                    continue
                if self.clip is not None:
                    clip = self._clip_factor(list(choco.inn[j].reference.values()), self.params, j)
                    if clip is None:
                        refused.append(Rejected(j, "reference far beyond recent differences (robust)"))
                        choco.forget(j)
                        continue
                    factor *= clip
                w = factor / (1 + max(d_me, int(msg.meta.get("deg", d_me))))
                torch._foreach_add_(self.params, diff, alpha=gamma * w)
                self._record_staleness(msg)
                mixed += 1
        self.stats.served += mixed
        self.version += 1
        return refused

    def _end_of_round(self) -> None:
        """Called once per round, after merging and before sending (local SGD's outer step)."""
