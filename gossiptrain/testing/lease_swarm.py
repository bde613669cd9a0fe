"""A swarm of lease machines in virtual time, with a nemesis: for the lease core's tests and quick studies.

Members train at their own pace (samples per virtual second), in batches,
through ``Leases.next_chunk``/``trained``, and gossip their tables over a
network that delays, drops and partitions messages. Members crash (and come
back under a new id, as a restarted peer does), and newcomers join. What
membership would say is modelled, not run: a member sees as live every
member that is up and on its side of a partition, a crash only after
``detect`` seconds (SWIM's suspicion time). The real membership and the real
transport are in ``gossiptrain.sim`` and the runtime; this harness isolates
the lease protocol so that its invariants can be checked after every event.

A ledger counts, for each chunk, the samples each member trained of it: the
ground truth the invariants are checked against.
"""

from __future__ import annotations

import heapq
import itertools
import random
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Callable

import msgpack

from gossiptrain.protocol.leases import ChunkPlan, Leases, LeaseSettings, SendLeases


@dataclass
class SimMember:
    id: str
    pace: float  # samples per second
    leases: Leases
    up: bool = True
    down_at: float = 0.0
    side: int = 0  # partition side


@dataclass
class LeaseSwarm:
    """Members, the network and the ledger. ``run(until)`` advances virtual time."""

    plan: ChunkPlan
    settings: LeaseSettings = field(default_factory=LeaseSettings)
    seed: int = 0
    batch: int = 8
    delay: tuple[float, float] = (0.001, 0.02)
    drop: float = 0.0
    detect: float = 1.0  # seconds before a crash is seen by the others
    now: float = 0.0
    members: dict[str, SimMember] = field(default_factory=dict)
    ledger: dict[int, dict[str, int]] = field(default_factory=lambda: defaultdict(dict))  # chunk -> member -> samples
    spans: dict[int, list[tuple[int, int]]] = field(default_factory=lambda: defaultdict(list))  # chunk -> [start, end) trained
    sent_bytes: int = 0
    messages: int = 0
    on_event: Callable[[LeaseSwarm], None] | None = None  # called after every event (the invariant checks)
    training: bool = True  # False: members only gossip (to let the tables settle)

    def __post_init__(self) -> None:
        self.rng = random.Random(self.seed)
        self._queue: list[tuple[float, int, str, Any]] = []
        self._seq = itertools.count()
        self._ids = itertools.count()

    # -- the cast ---------------------------------------------------------------------------------

    def add(self, pace: float, name: str | None = None) -> SimMember:
        mid = name or f"m{next(self._ids):04d}"
        leases = Leases(mid, self.plan, live=lambda: self.live_for(mid), rng=random.Random(self.rng.random()),
                        settings=self.settings)
        m = self.members[mid] = SimMember(mid, pace, leases)
        self._at(self.now, "step", mid)
        self._at(self.now + self.rng.uniform(0, self.settings.interval), "tick", mid)
        return m

    def crash(self, mid: str) -> None:
        m = self.members[mid]
        m.up, m.down_at = False, self.now

    def partition(self, ids: set[str]) -> None:
        for m in self.members.values():
            m.side = 1 if m.id in ids else 0

    def heal(self) -> None:
        for m in self.members.values():
            m.side = 0

    def live_for(self, mid: str) -> list[str]:
        """Who ``mid``'s membership holds live: up (or down for under ``detect``) and on its side."""
        me = self.members[mid]
        return [m.id for m in self.members.values()
                if (m.up or self.now - m.down_at < self.detect) and m.side == me.side]

    def up(self) -> list[SimMember]:
        return [m for m in self.members.values() if m.up]

    # -- time ---------------------------------------------------------------------------------------

    def at(self, t: float, fn: Callable[[], None]) -> None:
        """Run ``fn`` at virtual time ``t`` (a fault, a newcomer)."""
        self._at(t, "call", fn)

    def run(self, until: float) -> None:
        while self._queue and self._queue[0][0] <= until:
            t, _, kind, what = heapq.heappop(self._queue)
            self.now = t
            getattr(self, f"_on_{kind}")(what)
            if self.on_event is not None:
                self.on_event(self)
        self.now = until

    def _at(self, t: float, kind: str, what: Any) -> None:
        heapq.heappush(self._queue, (t, next(self._seq), kind, what))

    def _on_call(self, fn: Callable[[], None]) -> None:
        fn()

    def _on_step(self, mid: str) -> None:
        m = self.members[mid]
        if not m.up:
            return
        if not self.training:
            self._at(self.now + 0.05, "step", mid)
            return
        got = m.leases.next_chunk(self.now)
        if got is None:
            self._at(self.now + 0.05, "step", mid)
            return
        g, done = got
        n = min(self.batch, self.plan.size(g) - done)
        took = n / m.pace
        self._at(self.now + took, "trained", (mid, g, done, n))

    def _on_trained(self, what: tuple[str, int, int, int]) -> None:
        mid, g, start, n = what
        m = self.members[mid]
        if not m.up:
            return  # died mid-batch: the batch never counted
        self.ledger[g][mid] = self.ledger[g].get(mid, 0) + n
        self.spans[g].append((start, start + n))
        m.leases.trained(g, n, self.now)
        self._at(self.now, "step", mid)

    def _on_tick(self, mid: str) -> None:
        m = self.members[mid]
        if not m.up:
            return
        self._send(mid, m.leases.tick(self.now))
        self._at(max(self.now + 1e-3, m.leases.next_timer()), "tick", mid)

    def _on_deliver(self, what: tuple[str, SendLeases]) -> None:
        sender, msg = what
        dest = self.members.get(msg.to)
        if dest is None or not dest.up or dest.side != self.members[sender].side:
            return
        self._send(msg.to, dest.leases.handle(sender, msg.body, self.now, reply=msg.reply))

    def _send(self, sender: str, out: list[SendLeases]) -> None:
        for msg in out:
            self.messages += 1
            self.sent_bytes += len(msgpack.packb(msg.body))
            if self.rng.random() < self.drop:
                continue
            self._at(self.now + self.rng.uniform(*self.delay), "deliver", (sender, msg))

    # -- what the ledger shows ------------------------------------------------------------------------

    def floor(self) -> int:
        """The highest floor any live member holds: the chunks the swarm calls done."""
        return max((m.leases.table.floor for m in self.up()), default=0)

    def untrained_below(self, floor: int) -> list[int]:
        """Chunks below ``floor`` some sample of which nobody trained (a resumed chunk: one member up to its
        checkpoint, another from there)."""
        out = []
        for g in range(floor):
            covered = 0
            for start, end in sorted(self.spans.get(g, ())):
                if start > covered:
                    break
                covered = max(covered, end)
            if covered < self.plan.size(g):
                out.append(g)
        return out

    def samples_trained(self) -> int:
        return sum(sum(v.values()) for v in self.ledger.values())

    def holders(self) -> dict[int, list[str]]:
        """Chunk -> the up members that hold it now."""
        out: dict[int, list[str]] = defaultdict(list)
        for m in self.up():
            for h in m.leases.held:
                out[h.g].append(m.id)
        return out
