"""A nemesis for averaging: fault schedules against the real state machines, the invariant checked after every event.

In the spirit of Jepsen's nemeses and the SWIM/memberlist test harnesses: a
schedule is a list of operations (``Op``), each a step of normal life (a safe
point with a local step, a message delivered) or a fault (a loop paused past
the exchange timeout, a message delayed arbitrarily by being delivered out
of order, a request or refusal dropped, a send that fails locally, a full
receive queue, a member killed mid-exchange, the clock jumping forward).
Crossing requests and refusals arise by themselves. ``Nemesis.run`` plays a
schedule against the same machines the runtime uses
(``gossiptrain.protocol.algorithms``), routed as a real peer's driver routes
them (``SafePoint`` and ``PeerNode``): an algorithm's ``network_kinds`` are
handled on arrival, paused or not; the rest wait in a bounded queue for the
next safe point, and a push that finds it full is refused with its mass.

**The invariant** is mass conservation, stated without trusting the
machines: each machine's mass (``mass_of``) is measured around every call to
``handle``. The difference, plus the mass the incoming message carried, is
what the call's one outgoing message carries; a call that sends nothing must
have absorbed exactly what came in. So every unit of mass a message takes
out of one member must arrive, exactly, in another (or come back), and
``total`` (members plus messages on the wire and in queues) must equal
``expected`` (the initial mass, plus local steps, minus what left with the
killed members) after every operation. After the schedule the nemesis
heals (every loop resumes, every message is delivered, rounds run without
faults) and checks that the survivors agree, at the value the invariant
predicts.

Faults the algorithms are not meant to absorb are not generated, and the
module says so instead of hiding them: a reply or push lost by the network
after it was sent (the sender has moved already; in practice this is a
member dying with the message in its socket, which ``Kill`` models), and
clock jumps adding up past ``pairwise.OVERDUE_SECONDS`` (the horizon after
which a reply is abandoned).

**Every algorithm** runs here, each against what it promises:

- ``pairwise`` and ``push-sum`` (``CONSERVING``) promise exact conservation
  asynchronously: the mass balance above, and survivors that meet at the
  mean it predicts.
- ``neighbor`` and ``local-sgd`` (``CONVEX``) keep the mean exactly only in
  synchronous rounds on symmetric weights (``tests/test_algorithms.py``
  checks that in lockstep); asynchronously a lost or late push leaves its
  weight with the receiver, so the mean wanders by a fraction of the
  disagreement. What they promise under every fault is that averaging makes
  nothing up: with no local steps (the nemesis takes none for them) each
  merge is a convex combination, so every model stays inside the box of the
  initial models (per coordinate, within a lossy codec's resolution), and
  healed survivors agree inside it. local-sgd's outer step with
  ``outer_lr > 1`` or momentum extrapolates by design, by at most
  ``outer_lr / (1 - outer_momentum) - 1`` of the box's width on each side:
  the box is widened by that (``config.MAX_OUTER_STEP`` was chosen with
  this nemesis: above it, the swarm drifts away with no gradient at all).
"""

from __future__ import annotations

import random
from collections import deque
from dataclasses import dataclass, field

import torch

from gossiptrain.config import GossipConfig
from gossiptrain.net.kinds import XNAK, XPUSH, XREQ
from gossiptrain.protocol import averaging_events, pairwise, push_sum
from gossiptrain.protocol.algorithms import make_averaging
from gossiptrain.protocol.averaging import Averaging
from gossiptrain.protocol.averaging_events import MemberGone, Received, SendExchange, Undelivered
from gossiptrain.protocol.push_sum import PushSum

CONSERVING = ("pairwise", "push-sum")  # the mass is conserved exactly, asynchronously
CONVEX = ("neighbor", "local-sgd")  # every merge is a convex combination: nothing is made up
SUPPORTED = CONSERVING + CONVEX
TICK = 0.01  # virtual seconds every operation takes
HEAL_EXTRA = 3  # survivors not agreeing after the heal's rounds get up to this many times as many more


# -- operations ------------------------------------------------------------------------------


@dataclass(frozen=True)
class SafePoint:
    """Peer ``peer`` (mod n) takes a local step of size ``local_step`` (0: none) and reaches its safe point."""

    peer: int
    local_step: float = 0.0


@dataclass(frozen=True)
class Deliver:
    """The ``pick``-th message on the wire (mod its length) arrives: picking out of order delays the others."""

    pick: int


@dataclass(frozen=True)
class Drop:
    """The network loses the ``pick``-th message of those it may lose without loss of mass (requests, bare refusals)."""

    pick: int


@dataclass(frozen=True)
class Pause:
    """Peer ``peer``'s training loop stops reaching safe points (its network side goes on)."""

    peer: int


@dataclass(frozen=True)
class Resume:
    peer: int


@dataclass(frozen=True)
class Jump:
    """The clock jumps forward by ``seconds`` (exchange timeouts fire at the next safe points)."""

    seconds: float


@dataclass(frozen=True)
class Kill:
    """Peer ``peer`` dies with whatever it holds; the others hear of it (``MemberGone``). Two always survive."""

    peer: int


@dataclass(frozen=True)
class FailSend:
    """Peer ``peer``'s next message cannot be put on the wire (its driver reports it at once)."""

    peer: int


Op = SafePoint | Deliver | Drop | Pause | Resume | Jump | Kill | FailSend


class InvariantViolation(AssertionError):
    """The swarm's mass changed by something other than a local step or a death, or a model left the box."""


@dataclass
class _Message:
    src: int
    dst: int
    send: SendExchange
    carried: torch.Tensor  # the mass this message takes from its sender to its receiver


@dataclass
class Report:
    """What a schedule did: for the test to check that the faults really happened."""

    operations: int = 0
    delivered: int = 0
    dropped: int = 0
    refused_full: int = 0  # messages refused because the receiver's queue was full
    skipped_steps: int = 0  # local steps not taken: CONVEX algorithms run without them
    failed_sends: int = 0
    killed: int = 0
    checks: int = 0  # invariant checks passed
    stats: list[dict[str, object]] = field(default_factory=list)  # each survivor's AveragingStats at the end


def mass_of(machine: Averaging) -> torch.Tensor:
    """A machine's share of the swarm's mass: what its model will be once every merge it made is applied.

    pairwise: the parameters plus ``pending``; push-sum: the numerator ``x = z w`` and the weight ``w``.
    """
    if isinstance(machine, PushSum):
        x, w = machine.mass()
        return torch.cat([t.flatten() for t in x] + [torch.tensor([w], dtype=torch.float64)])
    pending = getattr(machine, "pending", None)
    if pending is None:
        raise TypeError(f"{type(machine).__name__} has no conserved mass; the nemesis runs {', '.join(SUPPORTED)}")
    return torch.cat([(p.detach() + d).flatten() for p, d in zip(machine.params, pending)])


class Nemesis:
    """``n`` peers running ``gossip.algorithm`` over a ``dim``-vector, played through a schedule of faults."""

    def __init__(self, n: int, gossip: GossipConfig, *, dim: int = 3, seed: int = 0, queue: int = 2) -> None:
        if gossip.algorithm not in SUPPORTED:
            raise ValueError(f"the nemesis runs {', '.join(SUPPORTED)}, not {gossip.algorithm!r}")
        if n < 2:
            raise ValueError("the nemesis needs at least 2 peers")
        rng = random.Random(seed)
        self.rng = rng
        self.n, self.queue_size = n, queue
        self.ids = [f"p{i}" for i in range(n)]
        self.params = [{"x": torch.tensor([rng.uniform(-10, 10) for _ in range(dim)], dtype=torch.float64)} for _ in range(n)]
        self.machines: list[Averaging | None] = [
            make_averaging(self.params[i], gossip, random.Random(seed * 7919 + i), me=self.ids[i]) for i in range(n)
        ]
        self.queues: list[deque[tuple[Received, torch.Tensor]]] = [deque() for _ in range(n)]
        self.returns: list[deque[tuple[Received, torch.Tensor]]] = [deque() for _ in range(n)]
        self.wire: list[_Message] = []
        self.paused: set[int] = set()
        self.failing: set[int] = set()
        self.steps = [0] * n
        self.now = 0.0
        self._jumped = 0.0
        self.report = Report()
        # Safe points per averaging round: local-sgd averages every local_steps, the others every exchange_every_steps.
        self.every = gossip.local_steps if gossip.algorithm == "local-sgd" else gossip.exchange_every_steps
        self.conserves = gossip.algorithm in CONSERVING
        # local-sgd's outer step beyond plain averaging extrapolates on purpose: the box widens by what it may add.
        outer = gossip.outer_lr / (1 - gossip.outer_momentum) if gossip.algorithm == "local-sgd" else 1.0
        self.widen = max(0.0, outer - 1.0)  # of the box's width, on each side
        models = torch.stack([p["x"] for p in self.params])  # (n, dim)
        self.low, self.high = models.min(dim=0).values, models.max(dim=0).values  # (dim,) the initial box
        if self.conserves:
            self.expected = sum((mass_of(m) for m in self._alive_machines()), torch.zeros_like(mass_of(self._machine(0))))
        else:
            self.expected = torch.zeros(1, dtype=torch.float64)  # no mass is tracked: messages carry zeros
        self.scale = max(float(self.expected.abs().max()), float(models.abs().max())) + 1.0
        # How close healed survivors must agree, relative to the scale: a lossy codec moves each toward what it
        # decodes of the others, so they meet within its resolution (int8: 1/127 of the largest value); mass is exact.
        # The same tolerance bounds how far outside the initial box a CONVEX algorithm's decoded models may take it.
        self.agreement = 1e-6 if gossip.compression == "none" else 2e-2

    # -- running ---------------------------------------------------------------------------------

    def run(self, schedule: list[Op], heal_rounds: int | None = None) -> Report:
        """Play ``schedule``, checking the invariant after every operation; then heal and check agreement.

        ``heal_rounds`` (default ``max(30, 10 n)`` averaging rounds) fault-free rounds let the survivors agree.
        """
        for op in schedule:
            self.apply(op)
            self.check(f"after {op}")
        self.heal(heal_rounds if heal_rounds is not None else max(30, 10 * self.n) * self.every)
        self.report.stats = [m.stats.to_dict() for m in self._alive_machines()]
        return self.report

    def apply(self, op: Op) -> None:
        self.report.operations += 1
        self.now += TICK
        if isinstance(op, SafePoint):
            self._safe_point(op.peer % self.n, op.local_step)
        elif isinstance(op, Deliver):
            if self.wire:
                self._deliver(self.wire.pop(op.pick % len(self.wire)))
        elif isinstance(op, Drop):
            losable = [m for m in self.wire if m.send.kind == XREQ or (m.send.kind == XNAK and not m.send.tensors)]
            if losable:
                self.wire.remove(losable[op.pick % len(losable)])
                self.report.dropped += 1
        elif isinstance(op, Pause):
            self.paused.add(op.peer % self.n)
        elif isinstance(op, Resume):
            self.paused.discard(op.peer % self.n)
        elif isinstance(op, Jump):
            seconds = min(op.seconds, pairwise.OVERDUE_SECONDS / 2 - self._jumped)  # see the module: the horizon
            if seconds > 0:
                self._jumped += seconds
                self.now += seconds
        elif isinstance(op, Kill):
            self._kill(op.peer % self.n)
        elif isinstance(op, FailSend):
            self.failing.add(op.peer % self.n)
        else:
            raise TypeError(f"unknown operation {op!r}")

    def heal(self, rounds: int) -> None:
        """No more faults: every loop resumes, everything is delivered, ``rounds`` rounds run; then agreement.

        Survivors that do not agree yet get up to ``HEAL_EXTRA`` times as many
        rounds more: how fast they mix is the topology's business (neighbor
        averaging on 8 peers needed 120 rounds to agree within 1e-6, not 80),
        whether they meet at all, and where, is the invariant's.
        """
        self.paused.clear()
        self.failing.clear()
        self._drain_wire()
        for _ in range(rounds):
            self._heal_round()
        for _ in range(rounds * HEAL_EXTRA):
            self._settle_last_round()
            if self._disagreement() is None:
                break
            self._heal_round()
        self._settle_last_round()
        self.check("after healing")
        self._check_agreement()

    def _heal_round(self) -> None:
        self.now += 1.0  # past any exchange timeout: a request to a dead member frees its sender
        for i in self._alive():
            self._safe_point(i, 0.0)
            self._drain_wire()
        self.check("while healing")

    def _settle_last_round(self) -> None:
        for i in self._alive():  # the merges of the last round reach the parameters
            self._safe_point(i, 0.0, start=False)
        self._drain_wire()

    # -- the invariant -----------------------------------------------------------------------------

    def total(self) -> torch.Tensor:
        """Members' mass plus what messages on the wire and in queues carry."""
        out = sum((mass_of(m) for m in self._alive_machines()), torch.zeros_like(self.expected))
        for m in self.wire:
            out = out + m.carried
        for q in self.queues + self.returns:
            for _, carried in q:
                out = out + carried
        return out

    def check(self, where: str) -> None:
        if self.conserves:
            error = float((self.total() - self.expected).abs().max())
            if error > 1e-9 * self.scale:
                raise InvariantViolation(f"{where}: the swarm's mass is off by {error:.3g} (scale {self.scale:.3g})")
        else:
            self._check_box(where)
        self.report.checks += 1

    def _check_box(self, where: str) -> None:
        """CONVEX: every model finite and inside the initial box (widened by what an outer step may extrapolate)."""
        slack = self.agreement * self.scale + self.widen * (self.high - self.low)  # (dim,)
        for i in self._alive():
            x = self.params[i]["x"]
            if not bool(torch.isfinite(x).all()):
                raise InvariantViolation(f"{where}: {self.ids[i]}'s model is not finite: {x.tolist()}")
            outside = float((torch.maximum(self.low - x, x - self.high) - slack).max())
            if outside > 0:
                raise InvariantViolation(
                    f"{where}: {self.ids[i]}'s model is {outside:.3g} outside the initial models' box "
                    f"[{self.low.tolist()}, {self.high.tolist()}]: averaging made something up"
                )

    def _check_agreement(self) -> None:
        problem = self._disagreement()
        if problem is not None:
            raise InvariantViolation(f"after healing, {problem}")

    def _disagreement(self) -> str | None:
        """How the survivors' models miss agreement (with each other, or with the predicted mean); None: they agree."""
        alive = self._alive()
        if not self.conserves:  # no mean is predicted: the survivors must agree with each other
            first = self.params[alive[0]]["x"]
            for i in alive[1:]:
                error = float((self.params[i]["x"] - first).abs().max())
                if error > self.agreement * self.scale:
                    return f"{self.ids[i]} is {error:.3g} from {self.ids[alive[0]]}"
            return None
        if isinstance(self._machine(alive[0]), PushSum):
            target = self.expected[:-1] / self.expected[-1]  # sum x / sum w
        else:
            target = self.expected / len(alive)
        for i in alive:
            got = self.params[i]["x"]
            error = float((got - target).abs().max())
            if error > self.agreement * self.scale:
                return f"{self.ids[i]} is {error:.3g} from the predicted mean {target.tolist()}"
        return None

    # -- the driver, as SafePoint and PeerNode route ------------------------------------------------

    def _safe_point(self, i: int, local_step: float, start: bool = True) -> None:
        machine = self.machines[i]
        if machine is None or i in self.paused:
            return
        if local_step and not self.conserves:
            self.report.skipped_steps += 1  # a local step has no box (see the module): CONVEX runs without
        elif local_step:
            before = mass_of(machine)
            direction = torch.tensor([self.rng.uniform(-1, 1) for _ in range(self.params[i]["x"].numel())], dtype=torch.float64)
            self.params[i]["x"].add_(direction, alpha=local_step)
            self.expected = self.expected + (mass_of(machine) - before)
        while self.returns[i]:
            self._call(i, *self.returns[i].popleft())
        while self.queues[i]:
            self._call(i, *self.queues[i].popleft())
        self.steps[i] += 1
        partners = [self.ids[j] for j in self._alive() if j != i] if start else []
        self._call(i, averaging_events.AtSafePoint(self.steps[i], partners), torch.zeros_like(self.expected))

    def _call(self, i: int, event: averaging_events.Event, carried: torch.Tensor) -> None:
        """``handle`` on peer i, with the mass balance of the call; its sends go on the wire."""
        machine = self._machine(i)
        if not self.conserves:
            for send in machine.handle(event, self.now):
                if isinstance(send, SendExchange):
                    self._send(i, send, self.expected * 0)
            return
        before = mass_of(machine)
        actions = machine.handle(event, self.now)
        out = before + carried - mass_of(machine)  # what this call's messages must carry
        sends = [a for a in actions if isinstance(a, SendExchange)]
        if not sends:
            if float(out.abs().max()) > 1e-9 * self.scale:
                raise InvariantViolation(f"{self.ids[i]} took {event!r} and its mass moved by something else than it carried")
            return
        if len(sends) > 1 and float(out.abs().max()) > 1e-9 * self.scale:
            raise InvariantViolation(f"{self.ids[i]} sent {len(sends)} messages carrying mass in one call")
        for k, send in enumerate(sends):
            self._send(i, send, out if k == 0 else torch.zeros_like(out))

    def _send(self, i: int, send: SendExchange, carried: torch.Tensor) -> None:
        machine = self._machine(i)
        if i in self.failing:  # the driver could not put it on the wire: it tells the machine at once
            self.failing.discard(i)
            self.report.failed_sends += 1
            if send.kind in machine.network_kinds:
                self._call(i, Undelivered(send.to, send.kind, send.xid), carried)
            elif send.kind == XPUSH:
                back = Received(send.to, XNAK, send.xid, dict(send.tensors), 0, dict(send.meta))
                self.returns[i].append((back, carried))
            elif float(carried.abs().max()) > 1e-9 * self.scale:
                raise InvariantViolation(f"{self.ids[i]}'s unsendable {send.kind} carried mass")
            return
        # Serialized as it is sent, as a real wire does: the receiver never shares a tensor with the sender.
        on_wire = SendExchange(send.to, send.kind, send.xid, {k: t.clone() for k, t in send.tensors.items()}, dict(send.meta))
        self.wire.append(_Message(i, self.ids.index(send.to), on_wire, carried))

    def _deliver(self, message: _Message) -> None:
        self.report.delivered += 1
        dst, send = message.dst, message.send
        machine = self.machines[dst]
        if machine is None:  # sent to a member that died: what it carried left with it
            self.expected = self.expected - message.carried
            return
        event = Received(self.ids[message.src], send.kind, send.xid, dict(send.tensors), self.steps[message.src], dict(send.meta))
        if send.kind in machine.network_kinds:
            self._call(dst, event, message.carried)
        elif send.kind == XNAK and send.tensors:
            self.returns[dst].append((event, message.carried))
        elif len(self.queues[dst]) < self.queue_size:
            self.queues[dst].append((event, message.carried))
        else:  # the node refuses at once what the queue cannot take; a push gets its mass back
            self.report.refused_full += 1
            if send.kind == XPUSH:
                self.wire.append(_Message(dst, message.src, push_sum.refusal(event), message.carried))
            elif send.kind == XREQ:
                self.wire.append(_Message(dst, message.src, SendExchange(event.sender, XNAK, send.xid, {}), message.carried))
            elif float(message.carried.abs().max()) > 1e-9 * self.scale:
                raise InvariantViolation(f"a {send.kind} carrying mass was dropped by a full queue")

    def _kill(self, i: int) -> None:
        machine = self.machines[i]
        if machine is None or len(self._alive()) <= 2:  # two survivors at least, so that agreement means something
            return
        if self.conserves:
            self.expected = self.expected - mass_of(machine)
        for _, carried in list(self.queues[i]) + list(self.returns[i]):
            self.expected = self.expected - carried
        self.queues[i].clear()
        self.returns[i].clear()
        self.machines[i] = None
        self.paused.discard(i)
        self.report.killed += 1
        for j in self._alive():
            self._call(j, MemberGone(self.ids[i]), torch.zeros_like(self.expected))

    def _drain_wire(self) -> None:
        while self.wire:
            self._deliver(self.wire.pop(0))

    def _alive(self) -> list[int]:
        return [i for i, m in enumerate(self.machines) if m is not None]

    def _alive_machines(self) -> list[Averaging]:
        return [m for m in self.machines if m is not None]

    def _machine(self, i: int) -> Averaging:
        machine = self.machines[i]
        assert machine is not None, f"{self.ids[i]} is dead"
        return machine


def schedules(max_ops: int = 60):  # type: ignore[no-untyped-def]
    """A hypothesis strategy of schedules (lists of ``Op``), weighted toward normal life with faults mixed in."""
    from hypothesis import strategies as st

    peer = st.integers(0, 15)
    pick = st.integers(0, 63)
    op = st.one_of(
        st.builds(SafePoint, peer, st.sampled_from([0.0, 0.0, 0.5, -1.5])),
        st.builds(SafePoint, peer),
        st.builds(Deliver, pick),
        st.builds(Deliver, pick),
        st.builds(Deliver, st.just(0)),  # in order
        st.builds(Drop, pick),
        st.builds(Pause, peer),
        st.builds(Resume, peer),
        st.builds(Jump, st.sampled_from([0.3, 2.0, 11.0])),  # below, near and past the exchange timeouts
        st.builds(Kill, peer),
        st.builds(FailSend, peer),
    )
    return st.lists(op, max_size=max_ops)
