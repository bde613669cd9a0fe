"""Who is alive: a sans-IO heartbeat-gossip membership state machine.

Each member bumps its own heartbeat every round and sends its view (every
entry it knows alive, plus members that announced a clean leave) to a few
random members. A member whose heartbeat has not advanced for
``MembershipConfig.fail_timeout(n)`` seconds is declared dead locally; a
higher heartbeat later re-admits it (a paused process that resumes, or a
partition that heals). Dead members are remembered as tombstones for a while
so that stale gossip about them cannot bring them back, and are sent our
view now and then, so that two sides of a healed partition find each other.

The machine never touches a socket or a clock: ``handle(event, now)`` returns
actions for its driver (the asyncio peer node, or the simulator) to carry out.
"""

from __future__ import annotations

import dataclasses
import random
import re
from dataclasses import dataclass
from typing import Any, Iterable, Sequence

from .config import MembershipConfig
from .errors import ProtocolError

ALIVE, DEAD, LEFT = "alive", "dead", "left"
_STATES = (ALIVE, DEAD, LEFT)
_ID_RE = re.compile(r"^[A-Za-z0-9_.:-]{1,64}$")
_MAX_ADDR = 256


@dataclass(frozen=True)
class Member:
    """One member as gossiped: identity, where to reach it, its shard and its liveness version."""

    id: str
    addr: str
    shard: int
    incarnation: int  # new for every process start, so a restart outranks old heartbeats
    heartbeat: int
    state: str = ALIVE

    @property
    def version(self) -> tuple[int, int]:
        return (self.incarnation, self.heartbeat)

    def to_wire(self) -> list[Any]:
        return [self.id, self.addr, self.shard, self.incarnation, self.heartbeat, self.state]

    @classmethod
    def from_wire(cls, raw: Any) -> "Member":
        """Validate one gossiped entry; anything malformed is a ProtocolError."""
        if not isinstance(raw, list) or len(raw) != 6:
            raise ProtocolError("member entry must be a list of 6 fields")
        mid, addr, shard, inc, hb, state = raw
        if not isinstance(mid, str) or not _ID_RE.match(mid):
            raise ProtocolError(f"bad member id {mid!r:.80}")
        if not isinstance(addr, str) or len(addr) > _MAX_ADDR or "://" not in addr:
            raise ProtocolError(f"bad member address {addr!r:.80}")
        for name, v in (("shard", shard), ("incarnation", inc), ("heartbeat", hb)):
            if type(v) is not int or v < 0 or v >= 1 << 63:
                raise ProtocolError(f"bad member {name} {v!r:.40}")
        if state not in _STATES:
            raise ProtocolError(f"bad member state {state!r:.40}")
        return cls(mid, addr, shard, inc, hb, state)


def members_from_wire(raw: Any, limit: int) -> list[Member]:
    if not isinstance(raw, list):
        raise ProtocolError("members must be a list")
    if len(raw) > limit:
        raise ProtocolError(f"{len(raw)} members in one message, limit {limit}")
    return [Member.from_wire(r) for r in raw]


# -- events ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Tick:
    """A gossip round is due: bump our heartbeat, expire the silent, tell a few members."""


@dataclass(frozen=True)
class Digest:
    """Entries received from another member (gossip, a welcome, or a newcomer's own entry)."""

    entries: Sequence[Member]


@dataclass(frozen=True)
class Leave:
    """We are leaving: announce it to everyone we know."""


Event = Tick | Digest | Leave

# -- actions -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Send:
    """Send ``entries`` to the member at ``addr`` as a message of ``kind`` (gossip or leave)."""

    addr: str
    kind: str
    entries: tuple[Member, ...]


@dataclass(frozen=True)
class MemberUp:
    member: Member


@dataclass(frozen=True)
class MemberDown:
    member: Member
    reason: str  # "dead" (silent too long) or "left" (announced)


Action = Send | MemberUp | MemberDown


@dataclass
class _Record:
    member: Member
    changed_at: float  # local time at which the member's version last advanced (or it went down)


class Membership:
    """The membership view of one member. Feed it events; carry out the actions it returns."""

    def __init__(self, me: Member, config: MembershipConfig, rng: random.Random) -> None:
        self.me = me
        self.config = config
        self._rng = rng
        self._records: dict[str, _Record] = {}
        self._rounds = 0

    # -- queries ---------------------------------------------------------------------------

    def alive(self) -> list[Member]:
        """Alive members including ourselves, sorted by id (the order topologies index)."""
        out = [r.member for r in self._records.values() if r.member.state == ALIVE]
        if self.me.state == ALIVE:
            out.append(self.me)
        return sorted(out, key=lambda m: m.id)

    def get(self, member_id: str) -> Member | None:
        if member_id == self.me.id:
            return self.me
        rec = self._records.get(member_id)
        return rec.member if rec else None

    def is_alive(self, member_id: str) -> bool:
        m = self.get(member_id)
        return m is not None and m.state == ALIVE

    def sample(self, k: int) -> list[Member]:
        """Up to ``k`` alive members, ourselves always included (a newcomer's seed list)."""
        others = [m for m in self.alive() if m.id != self.me.id]
        picked = self._rng.sample(others, min(k - 1, len(others))) if k > 1 else []
        return [self.me, *picked]

    def free_shard(self, shards: int) -> int:
        return least_loaded_shard((m.shard for m in self.alive()), shards)

    # -- the state machine -----------------------------------------------------------------

    def handle(self, event: Event, now: float) -> list[Action]:
        if isinstance(event, Tick):
            return self._tick(now)
        if isinstance(event, Digest):
            return self._merge(event.entries, now)
        if isinstance(event, Leave):
            return self._leave()
        raise TypeError(f"unknown event {event!r}")

    def _tick(self, now: float) -> list[Action]:
        actions: list[Action] = []
        if self.me.state != ALIVE:
            return actions
        self.me = dataclasses.replace(self.me, heartbeat=self.me.heartbeat + 1)
        timeout = self.config.fail_timeout(len(self.alive()))
        forget_after = self.config.tombstone_rounds * self.config.heartbeat_interval
        for mid, rec in list(self._records.items()):
            silent = now - rec.changed_at
            if rec.member.state == ALIVE and silent > timeout:
                rec.member = dataclasses.replace(rec.member, state=DEAD)
                rec.changed_at = now
                actions.append(MemberDown(rec.member, "dead"))
            elif rec.member.state != ALIVE and silent > forget_after:
                del self._records[mid]
        self._rounds += 1
        targets = [m for m in self.alive() if m.id != self.me.id]
        dead = [r.member for r in self._records.values() if r.member.state == DEAD]
        if targets or dead:
            digest = self._digest()
            for m in self._rng.sample(targets, min(self.config.fanout, len(targets))):
                actions.append(Send(m.addr, "gossip", digest))
            if dead and self._rounds % self.config.probe_dead_every == 0:
                # A member we think dead may be alive behind a healed partition: tell it we
                # are here, and its side learns of ours (memberlist's gossip to the dead).
                actions.append(Send(self._rng.choice(dead).addr, "gossip", digest))
        return actions

    def _digest(self) -> tuple[Member, ...]:
        """What we gossip: alive members and clean leaves. Local death verdicts stay local."""
        return tuple([self.me] + [r.member for r in self._records.values() if r.member.state != DEAD])

    def _merge(self, entries: Iterable[Member], now: float) -> list[Action]:
        actions: list[Action] = []
        for e in entries:
            if e.id == self.me.id:
                self._refute(e)
                continue
            rec = self._records.get(e.id)
            if rec is None:
                if e.state == DEAD:
                    continue
                self._records[e.id] = _Record(e, now)
                if e.state == ALIVE:
                    actions.append(MemberUp(e))
                continue
            if e.version <= rec.member.version:
                continue
            was = rec.member.state
            state = e.state if e.state != DEAD else was
            rec.member = e if state == e.state else dataclasses.replace(e, state=state)
            rec.changed_at = now
            if state == ALIVE and was != ALIVE:
                actions.append(MemberUp(rec.member))
            elif state == LEFT and was == ALIVE:
                actions.append(MemberDown(rec.member, "left"))
        return actions

    def _refute(self, claim: Member) -> None:
        """Someone gossips about us with a newer version (we restarted under our old id): outrank it."""
        if self.me.state == ALIVE and claim.version >= self.me.version:
            self.me = dataclasses.replace(
                self.me, incarnation=max(self.me.incarnation, claim.incarnation), heartbeat=claim.heartbeat + 1
            )

    def _leave(self) -> list[Action]:
        if self.me.state == LEFT:
            return []
        self.me = dataclasses.replace(self.me, state=LEFT, heartbeat=self.me.heartbeat + 1)
        return [Send(m.addr, "leave", (self.me,)) for m in self.alive()]


def least_loaded_shard(held: Iterable[int], shards: int) -> int:
    """The shard fewest live members train (lowest index on ties): a newcomer fills a gap first."""
    load = [0] * shards
    for s in held:
        if 0 <= s < shards:
            load[s] += 1
    return min(range(shards), key=lambda s: (load[s], s))
