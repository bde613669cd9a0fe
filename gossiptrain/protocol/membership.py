"""Who is alive: a sans-IO SWIM membership state machine with Lifeguard's refinements.

Every protocol period a member probes one other and, failing an answer,
asks others to; a probe nobody answered makes its target a suspect, whose
suspicion spreads and is either refuted by the suspect or confirmed by a
timer that shrinks as independent members confirm it (SWIM, Das et al.
2002; Lifeguard, Dadgar et al. 2018). Updates ride piggybacked on probe
messages; now and then two members exchange their full views (``sync``,
anti-entropy), which is also how a newcomer learns the swarm at once. A
member we hold dead is sent its verdict now and then, in case it is alive
behind a healed partition and can refute it. Nothing is taken on trust: a
member heard of is a candidate until it answers our own probe.

``Membership`` is the facade: it owns one of each part below (the split
follows HashiCorp memberlist's) and routes each event through them. The
member record and its wire checks are ``gossiptrain.protocol.member``, the
unverified members ``gossiptrain.protocol.candidates``; the rest is in
``gossiptrain.protocol.swim``:

- ``events``: the events ``handle`` takes, the actions it returns, ``HealthStats``;
- ``view``: the member table and its indexes;
- ``timing``: probe timeouts from measured round trips, Lifeguard's local health;
- ``broadcasts``: the piggybacked updates and the refutation hints;
- ``probes``: the probe cycle (pings, ping-reqs, the probes we relay for others);
- ``merge``: SWIM's precedence of claims and the rules of evidence;
- ``suspicion``: Lifeguard's suspicion timers and the placeholders' grace;
- ``verification``: probing candidates (``gossiptrain.protocol.candidates``).

The machine never touches a socket or a clock: ``handle(event, now)`` returns
actions for its driver (the asyncio peer node, or the simulator) to carry
out, and ``next_timer()`` says when it next wants a ``Tick``.

Re-exported here, for whoever drives a ``Membership``: ``Member`` and its
states (``ALIVE``, ``SUSPECT``, ``DEAD``, ``LEFT``), the events and actions of
``handle`` and ``HealthStats``. Everything else is imported from its own module.
"""

from __future__ import annotations

import dataclasses
import random
from typing import Callable

from gossiptrain.config import MembershipConfig
from gossiptrain.net.address_forms import is_client_address
from gossiptrain.net.kinds import ACK, GOSSIP, LEAVE, SYNC
from gossiptrain.protocol.candidates import Candidates
from gossiptrain.protocol.member import ALIVE, DEAD, LEFT, SUSPECT, Member, least_loaded_shard
from gossiptrain.protocol.swim.broadcasts import Broadcasts
from gossiptrain.protocol.swim.events import (
    Ack,
    Action,
    Digest,
    Event,
    HealthStats,
    Leave,
    MemberDown,
    MemberUp,
    Ping,
    PingReq,
    Send,
    Suspected,
    Tick,
    Welcomed,
)
from gossiptrain.protocol.swim.merge import Merger
from gossiptrain.protocol.swim.probes import Prober
from gossiptrain.protocol.swim.suspicion import Suspicions
from gossiptrain.protocol.swim.timing import Timing
from gossiptrain.protocol.swim.verification import Verifier
from gossiptrain.protocol.swim.view import View

__all__ = [
    "ALIVE", "DEAD", "DEAD_VIEW_SENDERS", "LEFT", "MAX_PLACEHOLDERS", "SUSPECT", "WELCOMED_INTRODUCER",
    "Ack", "Action", "Digest", "Event", "HealthStats", "Leave", "Member", "MemberDown", "MemberUp", "Membership",
    "Ping", "PingReq", "Send", "Suspected", "Tick", "Welcomed",
]

#: About how many members send their whole view to a member they hold dead, per probe_dead_every periods.
DEAD_VIEW_SENDERS = 4
#: Placeholders of members we welcomed that have not started yet, at most (see ``Membership._welcome``).
MAX_PLACEHOLDERS = 16
#: The introducer our own welcomes' deferred newcomers are charged to in the candidate table.
WELCOMED_INTRODUCER = "welcomed by us"


def _anyone(address: str) -> bool:
    return True


class Membership:
    """The membership view of one member. Feed it events; carry out the actions it returns."""

    def __init__(
        self,
        me: Member,
        config: MembershipConfig,
        rng: random.Random,
        candidates: int = 128,
        nonces: random.Random | None = None,
        id_of: Callable[[str], str | None] | None = None,
        can_reach: Callable[[str], bool] | None = None,
    ) -> None:
        """``candidates``: members heard of but not verified yet that we hold at once (``limits.candidates``).

        ``nonces`` draws the probe sequence numbers, which prove that an ack
        came from whoever got the probe: a real peer passes an OS-seeded
        generator (a ``--seed`` must not make them guessable); by default
        ``rng`` (the simulator's runs repeat exactly).

        ``id_of`` (a secure swarm): the member id an address entitles its
        holder to; a claim of any other id at that address is refused.

        ``can_reach``: whether a message to an address can leave now (the
        transport's ``can_reach``). A client-mode member (behind NAT) can be
        reached only by members it has sent to; the others neither probe it
        nor ask it to probe, so it is never suspected for what nobody could
        send it, and its liveness is judged by those it talks to.
        """
        self.config = config
        self.stats = HealthStats()
        self._rng = rng
        self._can_reach = can_reach or _anyone
        forget_after = config.tombstone_rounds * config.heartbeat_interval
        self.candidates = Candidates(candidates, max(1, candidates // 4), quarantine_for=forget_after)
        self._view = View(me)
        self._timing = Timing(config)
        self._broadcasts = Broadcasts(config, self._view)
        self._prober = Prober(
            config, self._view, self._timing, self._broadcasts, self.stats, rng, nonces or rng, self._can_reach
        )
        self._merger = Merger(
            config, self._view, self.candidates, self._broadcasts, self._prober, self._timing, self.stats, id_of
        )
        self._suspicions = Suspicions(config, self._view, self._timing, self._broadcasts)
        self._verifier = Verifier(
            config, self._view, self.candidates, self._prober, self._broadcasts, self._timing, rng, self._can_reach, id_of
        )
        self._rounds = 0
        self._next_period: float | None = None  # set by the first tick
        self._next_sync = 0.0
        self._sync_gap = 0.0  # doubles from one period to config.sync_interval: a newcomer swaps views often at first
        # The shortest direct probe round trip lately: the link's latency (averaging keeps more exchanges in flight
        # on a far link: PairwiseAveraging.concurrency)
        self.min_rtt = self._timing.min_rtt

    # -- queries ---------------------------------------------------------------------------

    @property
    def me(self) -> Member:
        """Our own entry: its incarnation rises when we refute a suspicion, its state turns left when we leave."""
        return self._view.me

    @me.setter
    def me(self, member: Member) -> None:
        self._view.me = member

    @property
    def health(self) -> int:
        """Lifeguard's local health multiplier, 0 (healthy) .. config.max_health (``Timing``)."""
        return self._timing.health

    def trust_stats(self) -> dict[str, int]:
        """What gossip we did not believe (counters), and how many candidates wait now."""
        s, c = self.stats, self.candidates.stats
        refused = s.redirects_refused + s.jumps_refused + s.verdicts_refused + s.hearsay_refused + s.forged_ids_refused
        return {
            **c.to_dict(),
            **{k: v for k, v in s.to_dict().items() if k.endswith(("_refused", "_doubted", "_deferred"))},
            "candidates": len(self.candidates),
            "gossip_refused": refused + c.candidates_refused + c.candidates_unanswered,
        }

    def alive(self) -> list[Member]:
        """Live members including ourselves (suspects too: not dead yet), sorted by id (the order topologies index).

        Kept sorted between changes: with n members every one of the n^2
        membership events of a swarm's start asks for it (a node's view is
        rebuilt at each), and sorting each time made that n^3 log n.
        """
        return self._view.alive()

    def alive_ids(self) -> tuple[str, ...]:
        """The ids of ``alive()``, sorted: recomputed only when who is live changes, not at every refreshed claim.

        A node's view is this; with n members it is asked for at each of the
        n^2 membership events of a swarm's start. The ids of live records are
        kept sorted as they change (``View``), so an answer is a copy, not a
        scan and a sort.
        """
        return self._view.alive_ids()

    def get(self, member_id: str) -> Member | None:
        return self._view.get(member_id)

    def is_alive(self, member_id: str) -> bool:
        m = self.get(member_id)
        return m is not None and m.state in (ALIVE, SUSPECT)

    def suspects(self) -> list[str]:
        return self._view.suspect_ids()

    def has_suspects(self) -> bool:
        """Whether any member is held suspect now (cheaper than ``suspects()``; safe to ask from another thread)."""
        return self._view.has_suspects()

    def holds_clients(self) -> bool:
        """Whether a live member, ourselves included, is a client-mode member (behind NAT): not everyone can send to
        it. Kept as members change, so asking costs nothing (another thread may ask)."""
        return self._view.live_clients() > 0 or (self.me.state == ALIVE and is_client_address(self.me.addr))

    def sample(self, k: int) -> list[Member]:
        """Up to ``k`` live members, ourselves always included (a newcomer's seed list)."""
        others = [m for m in self.alive() if m.id != self.me.id]
        picked = self._rng.sample(others, min(k - 1, len(others))) if k > 1 else []
        return [self.me, *picked]

    def free_shard(self, shards: int) -> int:
        return least_loaded_shard((m.shard for m in self.alive()), shards)

    def period(self) -> float:
        """The protocol period now: ``heartbeat_interval``, or what the measured round trips need, if longer
        (``Timing.period``); stretched by our local health multiplier when we are struggling."""
        return self._timing.period()

    def probe_timeout(self, member_id: str | None = None) -> float:
        """How long a direct ping may take (``Timing.probe_timeout``): ``member_id``'s own round trips where we measured
        them, else the median timeout of the last members measured; before any measurement, half a period."""
        return self._timing.probe_timeout(self._view.rtt(member_id))

    def next_timer(self) -> float:
        """The latest local time at which the machine needs its next ``Tick``."""
        if self._next_period is None:
            return 0.0
        times = [self._next_period]
        probe_due = self._prober.next_deadline()
        if probe_due is not None:
            times.append(probe_due)
        times += self._suspicions.deadlines()
        due = self.candidates.next_deadline()
        if due is not None:
            times.append(due)
        return min(times)

    # -- the state machine -----------------------------------------------------------------

    def handle(self, event: Event, now: float) -> list[Action]:
        if isinstance(event, Tick):
            return self._tick(now)
        actions: list[Action] = []
        merge = self._merger.merge
        if isinstance(event, Welcomed):
            self._welcome(event.member, now, actions)
        elif isinstance(event, Ping):
            merge(event.entries, now, actions, event.sender, event.source)
            challenge = self._verifier.challenge(event, now)
            ack = self._broadcasts.piggyback(event.sender)
            actions.append(Send(event.reply_to, ACK, ack, seq=event.seq, challenge=challenge))
        elif isinstance(event, PingReq):
            merge(event.entries, now, actions, event.sender, event.source)
            self._prober.relay(event, now, actions)
        elif isinstance(event, Ack):
            # First: a candidate it verifies is then a member the entries may name.
            if not self._verifier.on_ack(event, now, actions):
                self._prober.on_ack(event, now, actions)
            merge(event.entries, now, actions, event.sender, event.source)
        elif isinstance(event, Digest):
            merge(event.entries, now, actions, event.sender, event.source)
            if event.reply:
                self._send_view(event.sender, actions)
        elif isinstance(event, Leave):
            return self._leave()
        else:
            raise TypeError(f"unknown event {event!r}")
        if isinstance(event, (Digest, PingReq)) and event.sender:
            self._broadcasts.hint(event.sender, now, actions)  # a ping's ack already carries the hint
        self._verifier.probe_new(now, actions)
        return actions

    def _tick(self, now: float) -> list[Action]:
        actions: list[Action] = []
        if self.me.state != ALIVE:
            return actions
        if self._next_period is None:  # first tick: a newcomer swaps views with someone at once
            self._next_period = now
            self._next_sync = now
            self._sync_gap = self.config.heartbeat_interval
        self._expire(now, actions)
        self._verifier.expire(now, actions, sweep=self._rounds % 16 == 0)
        p = self._prober.in_flight
        if p is not None and (p.acked or now >= p.deadline):
            self._conclude(now, actions)
        elif p is not None and not p.indirect_sent and now >= p.direct_deadline:
            self._prober.ask_others(now, actions)
        if now >= self._next_period:
            self._start_period(now, actions)
        self._verifier.probe_new(now, actions)
        return actions

    def _start_period(self, now: float, actions: list[Action]) -> None:
        self._rounds += 1
        self._verifier.new_period()
        self._merger.new_period()
        period = self.period()
        self._next_period = now + period * self._rng.uniform(0.9, 1.1)
        if self._prober.in_flight is not None:
            self._conclude(now, actions)
        deadline = self._prober.start(now, period, actions)
        if deadline is not None:
            self._next_period = max(self._next_period, deadline)  # a far member's probe ends before the next starts
        if now >= self._next_sync:
            # Swarms start together: the first views swapped are partial, so swap again soon, then less often.
            self._sync_gap = min(2 * self._sync_gap, self.config.sync_interval)
            self._next_sync = now + self._sync_gap
            others = [m for m in self.alive() if m.id != self.me.id and self._can_reach(m.addr)]
            if others:
                peer = self._rng.choice(others)
                actions.append(Send(peer.addr, SYNC, self._view.digest(peer.id)))
        # Only members we knew ourselves: a tombstone we were told of names an address someone else chose.
        dead = [] if self._rounds % self.config.probe_dead_every else self._view.known_dead()
        if dead:
            # A member we think dead may be alive behind a healed partition: its own tombstone makes it
            # refute, and a view lets both sides find each other again. Each member sends its whole view
            # with a chance that makes about DEAD_VIEW_SENDERS views reach the dead member per round, not
            # one from every member (at 1,000 members a crash cost 1,000 views every probe_dead_every).
            gone = self._rng.choice(dead)
            if self._rng.random() * max(1, len(self.alive_ids())) < DEAD_VIEW_SENDERS:
                actions.append(Send(gone.addr, GOSSIP, self._view.digest(gone.id, tombstones=False)))
            else:
                actions.append(Send(gone.addr, GOSSIP, (self.me, gone)))

    def _conclude(self, now: float, actions: list[Action]) -> None:
        """The probe's time is up: an ack is good health, silence makes the target a suspect."""
        p = self._prober.conclude()
        if p is None:
            return
        rec = self._view.record(p.target)
        if rec is None or rec.member.state not in (ALIVE, SUSPECT):
            return
        claim = dataclasses.replace(rec.member, state=SUSPECT, by=self.me.id)
        self._merger.merge([claim], now, actions, self.me.id)
        # The members we asked for help failed to reach it too, and are the likeliest to confirm: tell them
        # now rather than on our next probe of them, so that a real death is confirmed (Lifeguard) within a period.
        for addr in p.helpers:
            actions.append(Send(addr, GOSSIP, (self.me, claim)))

    def _expire(self, now: float, actions: list[Action]) -> None:
        """Suspicions and placeholders whose time ran out die; every 16 periods, old tombstones are forgotten."""
        self._suspicions.expire(now, actions)
        if self._rounds % 16 == 0:
            forget_after = self.config.tombstone_rounds * self.config.heartbeat_interval
            for mid in self._view.forget_tombstones(now, forget_after):
                self._prober.forget(mid)
            self._broadcasts.forget_hints(now)

    def _welcome(self, m: Member, now: float, actions: list[Action]) -> None:
        """Our own welcome's placeholder: a member (not probed, dropped if it never starts) without verification.

        At most ``MAX_PLACEHOLDERS`` at once: joins claiming made-up
        addresses (one source may send 5 a second, ``limits.join_*``) would
        otherwise fill our view with members that never start. Past the
        bound a newcomer is a candidate like any other, verified when it
        starts (a round trip later).
        """
        if m.id in self._view:
            return
        if self._view.placeholder_count() >= MAX_PLACEHOLDERS:
            self.stats.placeholders_deferred += 1
            self.candidates.offer(m, WELCOMED_INTRODUCER, now)
            return
        self.candidates.drop(m.id)
        self._view.add(m, now, placeholder=m.incarnation == 0)
        self._broadcasts.broadcast(m)
        actions.append(MemberUp(m))

    def _send_view(self, sender: str, actions: list[Action]) -> None:
        """A sync asked for our full view: to a verified member at once, to a candidate once it is verified."""
        rec = self._view.record(sender)
        if rec is not None and rec.member.state in (ALIVE, SUSPECT):
            actions.append(Send(rec.member.addr, GOSSIP, self._view.digest(sender)))
            return
        c = self.candidates.get(sender)
        if c is not None:
            c.wants_view = True

    def _leave(self) -> list[Action]:
        if self.me.state == LEFT:
            return []
        self.me = dataclasses.replace(self.me, state=LEFT)
        return [Send(m.addr, LEAVE, (self.me,)) for m in self.alive()]
