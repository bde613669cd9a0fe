"""A virtual-time cluster of SWIM ``Membership`` state machines, with no sockets and no event loop.

``Cluster`` is a small discrete-event network: every message takes ``delay``
seconds and is lost with probability ``loss``; each member is ticked at the
time its machine asks for (``next_timer``), as the asyncio driver does. All
randomness comes from one seed, so a failing run replays exactly. Use it to
test membership changes, or to try protocol settings, at hundreds of
members in milliseconds.
"""

from __future__ import annotations

import heapq
import itertools
import random
from typing import Any, Callable

from gossiptrain.config import MembershipConfig
from gossiptrain.net.kinds import ACK, PING, PING_REQ, SYNC
from gossiptrain.protocol.member import Member
from gossiptrain.protocol.membership import Membership
from gossiptrain.protocol.swim.events import Ack, Digest, MemberDown, Ping, PingReq, Send, Tick
from gossiptrain.testing.matchers import match

__all__ = ["DEFAULT_CONFIG", "Cluster", "admit", "event_for"]

DEFAULT_CONFIG = MembershipConfig(heartbeat_interval=1.0)
"""One-second protocol periods: round numbers for the bounds a test computes from the config."""


def event_for(src: Membership, a: Send) -> Any:
    """The event a Send becomes at its recipient (what the node's decoder does)."""
    sender, addr = src.me.id, src.me.addr
    if a.kind == PING:
        return Ping(sender, addr, a.seq, a.entries)
    if a.kind == ACK:
        return Ack(sender, a.seq, a.entries, challenge=a.challenge)
    if a.kind == PING_REQ:
        return PingReq(sender, addr, a.seq, a.target, a.target_addr, a.entries)
    return Digest(a.entries, sender, addr, reply=a.kind == SYNC)


def admit(node: Membership, members: list[Member], now: float, sender: str = "") -> list[Any]:
    """Tell ``node`` of ``members`` and answer its verification probes as each of them would: they become members.

    Gossip only makes a member a candidate; this plays the candidates' side
    (an ack with the probe's nonce from the address claimed) for tests that
    drive one machine by hand. Returns every action ``node`` took.
    """
    by_addr = {m.addr: m for m in members}
    actions = node.handle(Digest(members, sender), now)
    out = list(actions)
    for a in actions:
        m = by_addr.get(a.addr) if isinstance(a, Send) and a.kind == PING else None
        if m is not None:
            out += node.handle(Ack(m.id, a.seq, (m,)), now)
    return out


class Cluster:
    """n members (``m000``, ``m001``, ...) on a simulated network with per-message delay and loss, all from one seed.

    ``events`` records every non-Send action as ``(when, member, action)``;
    set ``blocked(src, dst)`` to cut links (a partition, a deaf member).
    """

    def __init__(
        self, n: int, seed: int, *, loss: float = 0.0, delay: float = 0.01, config: MembershipConfig = DEFAULT_CONFIG
    ) -> None:
        self.rng = random.Random(seed)
        self.config = config
        self.loss, self.delay = loss, delay
        self.now = 0.0
        self.nodes: dict[str, Membership] = {}
        self.crashed: set[str] = set()
        self.events: list[tuple[float, str, Any]] = []
        self.blocked: Callable[[str, str], bool] = lambda src, dst: False
        self._queue: list[tuple[float, int, str, Any]] = []
        self._order = itertools.count()
        self._generation: dict[str, int] = {}  # a restart bumps it, so the old incarnation's ticks are ignored
        for i in range(n):
            self.add(f"m{i:03d}", incarnation=1)

    def add(self, mid: str, incarnation: int) -> Membership:
        """Start (or restart) a member, joined through one live member as a welcome does."""
        me = Member(mid, f"sim://{mid}", 0, incarnation)
        node = Membership(me, self.config, random.Random(self.rng.random()))
        seed = next((m for k, m in self.nodes.items() if k != mid and k not in self.crashed), None)
        self.nodes[mid] = node
        self.crashed.discard(mid)
        self._generation[mid] = self._generation.get(mid, 0) + 1
        if seed is not None:
            self.carry(mid, node.handle(Digest([seed.me]), self.now))
            self.carry(seed.me.id, seed.handle(Digest([me]), self.now))
        self._push(self.now + self.rng.uniform(0, self.config.heartbeat_interval), "tick", (mid, self._generation[mid]))
        return node

    def _push(self, at: float, kind: str, payload: Any) -> None:
        heapq.heappush(self._queue, (at, next(self._order), kind, payload))

    def carry(self, src: str, actions: list) -> None:
        """Act on what member ``src`` returned: Sends go on the network (unless blocked or lost), the rest into ``events``.

        Call it with the result of a ``handle`` you made yourself (a forged
        digest, a leave), so that its consequences play out like any other.
        """
        for a in actions:
            if isinstance(a, Send):
                dst = a.addr.removeprefix("sim://")
                if self.blocked(src, dst) or self.rng.random() < self.loss:
                    continue
                self._push(self.now + self.delay, "msg", (dst, event_for(self.nodes[src], a)))
            else:
                self.events.append((self.now, src, a))

    def run(self, seconds: float) -> None:
        """Advance virtual time by ``seconds``, delivering messages and ticks in time order."""
        end = self.now + seconds
        while self._queue and self._queue[0][0] <= end:
            at, _, kind, payload = heapq.heappop(self._queue)
            self.now = at
            if kind == "tick":
                mid, generation = payload
                if mid in self.crashed or generation != self._generation[mid]:
                    continue
                node = self.nodes[mid]
                self.carry(mid, node.handle(Tick(), at))
                self._push(max(node.next_timer(), at + 0.001), "tick", payload)
            else:
                dst, event = payload
                if dst in self.nodes and dst not in self.crashed:
                    self.carry(dst, self.nodes[dst].handle(event, at))
        self.now = end

    def crash(self, mid: str) -> None:
        """Stop a member silently: it neither ticks nor receives until ``add`` restarts it."""
        self.crashed.add(mid)

    def views(self) -> dict[str, set[str]]:
        """Each running member's view: the ids it holds alive."""
        return {mid: {m.id for m in n.alive()} for mid, n in self.nodes.items() if mid not in self.crashed}

    def deaths(self) -> list[tuple[float, str, str]]:
        """(when, observer, member) of every death verdict."""
        return [(t, src, a.member.id) for t, src, a in self.events if match(a, MemberDown, reason="dead")]
