"""Verifying candidates: a member heard of is a member only once it answers our own nonce at the address claimed.

Gossip about a member is a claim (``gossiptrain.protocol.candidates``): the
merge offers every member we do not know, and every move or big jump of one
we do, to the candidate table, and this probes each at the address it
claims with a random nonce, ``candidate_probes`` a period, twice at most.
Only an ack carrying that nonce makes it a member (``Verifier.on_ack``).

A candidate that pings us is verified in one message instead of two: our
ack to it carries a nonce of its own (``Verifier.challenge``), and only
whoever receives that ack at the address claimed can echo it back. A
client-mode candidate (behind NAT) that we cannot reach is probed through
a member that can (a ping-req: its introducer first, then others at
random).
"""

from __future__ import annotations

import dataclasses
import random
from typing import Callable, Sequence

from gossiptrain.config import MembershipConfig
from gossiptrain.net.kinds import GOSSIP, PING, PING_REQ, SYNC
from gossiptrain.protocol.candidates import Candidate, Candidates
from gossiptrain.protocol.member import ALIVE, DEAD, LEFT, SUSPECT, Member
from gossiptrain.protocol.swim.broadcasts import Broadcasts
from gossiptrain.protocol.swim.events import Ack, Action, MemberDown, MemberUp, Ping, Send
from gossiptrain.protocol.swim.probes import Prober
from gossiptrain.protocol.swim.timing import Timing
from gossiptrain.protocol.swim.view import View

_CANDIDATE_ATTEMPTS = 2  # probes a candidate gets before it is dropped as never answering


class Verifier:
    """Probes the candidate table's members and takes in those that answer; its own state is this period's budget."""

    def __init__(
        self,
        config: MembershipConfig,
        view: View,
        candidates: Candidates,
        prober: Prober,
        broadcasts: Broadcasts,
        timing: Timing,
        rng: random.Random,
        can_reach: Callable[[str], bool],
        id_of: Callable[[str], str | None] | None,
    ) -> None:
        self._config = config
        self._view = view
        self._candidates = candidates
        self._prober = prober
        self._broadcasts = broadcasts
        self._timing = timing
        self._rng = rng
        self._can_reach = can_reach
        self._id_of = id_of
        self._budget = config.candidate_probes  # candidate probes left this period

    def new_period(self) -> None:
        self._budget = self._config.candidate_probes

    def probe_new(self, now: float, actions: list[Action]) -> None:
        """Probe candidates not probed yet (placeholders wait for their start), ``candidate_probes`` a period."""
        if self._view.me.state != ALIVE or self._budget <= 0 or not len(self._candidates):
            return  # called after every message: a flood past this period's budget costs no walk of the table
        for c in self._candidates:
            if self._budget <= 0:
                return
            if c.seq == 0 and c.claim.incarnation > 0:
                self._probe(c, now, actions)

    def challenge(self, ping: Ping, now: float) -> int:
        """A nonce for our ack to ``ping`` when its sender is a candidate we have not probed yet; else 0.

        The ack goes to the address the candidate claims, as our probe would, and only whoever receives
        it there can echo the nonce: the same proof in one message (the echo) instead of two, which at a
        swarm's start, when everyone verifies everyone, saves a quarter of the traffic. It costs no
        probe budget (the budget bounds what we send to addresses only heard of; this ack goes to the
        pinger anyway), and a challenge never echoed is probed again later, as an unanswered probe is.
        """
        if self._view.me.state != ALIVE:
            return 0
        c = self._candidates.get(ping.sender)
        own = ping.entries[0] if ping.entries else None
        if c is None and own is not None and own.id == ping.sender and own.state == ALIVE and ping.sender not in self._view:
            if self._id_of is None or self._id_of(own.addr) == own.id:
                c = self._candidates.offer(own, ping.source or ping.sender, now, direct=True)  # the merge's offer was refused
        if c is None or c.seq != 0 or c.claim.incarnation == 0 or c.claim.addr != ping.reply_to:
            return 0
        seq = self._prober.nonce()
        self._candidates.probing(c, seq, now, now + self._timing.period() * (1 + c.attempts))
        return seq

    def _probe(self, c: Candidate, now: float, actions: list[Action]) -> None:
        """Probe ``c`` at the address it claims; a client we cannot reach, through a member that may (ping-req).

        A client-mode member (behind NAT) is reached only over connections
        it opened, and it never opens one to another client: two clients
        verify each other through a reachable member, the introducer first,
        then others at random, as SWIM's indirect probes do.
        """
        direct = self._can_reach(c.claim.addr)
        relay = None if direct else self._relay_for(c)
        if not direct and relay is None:
            if c.seq:  # asked before, nobody to ask now: forget it (gossip brings it back); else it waits
                self._candidates.drop(c.claim.id)
            return
        self._budget -= 1
        seq = self._prober.nonce()
        self._candidates.probing(c, seq, now, now + self._timing.period() * (1 + c.attempts))
        if relay is None:
            c.via = ""
            actions.append(Send(c.claim.addr, PING, (self._view.me,), seq=seq))
        else:
            c.via = relay.id
            actions.append(
                Send(
                    relay.addr, PING_REQ, self._broadcasts.piggyback(relay.id), seq=seq,
                    target=c.claim.id, target_addr=c.claim.addr,
                )
            )

    def _relay_for(self, c: Candidate) -> Member | None:
        """Whom to ask to probe candidate ``c`` for us: its introducer at the first attempt, else anyone we reach."""
        rec = self._view.record(c.introducer)
        if c.attempts == 0 and rec is not None and rec.member.state == ALIVE and self._can_reach(rec.member.addr):
            return rec.member
        me = self._view.me.id
        helpers = [
            m for m in self._view.alive()
            if m.id not in (me, c.claim.id) and m.state == ALIVE and m.incarnation > 0 and self._can_reach(m.addr)
        ]
        return self._rng.choice(helpers) if helpers else None

    def expire(self, now: float, actions: list[Action], sweep: bool) -> None:
        """Probe again the candidates whose answers are overdue, or drop them; ``sweep``: forget old quarantines too."""
        for c in self._candidates:
            if c.seq and now >= c.deadline:
                if c.attempts < _CANDIDATE_ATTEMPTS and self._budget > 0:
                    self._probe(c, now, actions)  # a lost probe, or a newcomer still starting: once more
                elif c.attempts >= _CANDIDATE_ATTEMPTS and c.via:
                    self._candidates.drop(c.claim.id)  # the members asked could not reach it: nobody lied, tried later
                elif c.attempts >= _CANDIDATE_ATTEMPTS:
                    self._candidates.unanswered(c, now)
            elif c.claim.incarnation == 0 and now - c.heard_at >= self._config.newcomer_grace:
                self._candidates.drop(c.claim.id)  # someone else's placeholder that never started
        if sweep:
            self._candidates.forget_quarantines(now)

    def on_ack(self, event: Ack, now: float, actions: list[Action]) -> bool:
        """A candidate's answer to our probe of it (or its echo of our challenge) makes it a member; False if the ack
        answers no candidate probe."""
        answer = self._candidates.answered(event.seq, event.sender)
        if answer is None:
            return False
        candidate, sent_at = answer
        if not candidate.via and self._timing.filling():
            # Its own answer to our ping: a round trip (through a helper it is two), the first ones a newcomer
            # has. Only until members' probes fill the window: candidates come in bursts, and a burst of made-up
            # members answering late would otherwise stretch everyone's period (the probes' round robin takes
            # each member once a round).
            self._prober.measured(candidate.claim.id, now - sent_at)
        self._verified(candidate, event.entries, now, actions)
        self._prober.echo(event, candidate.claim.addr, actions)
        return True

    def _verified(self, c: Candidate, entries: Sequence[Member], now: float, actions: list[Action]) -> None:
        """A candidate answered our probe at the address claimed: take it (as its own entry says, if it sent one)."""
        own = entries[0] if entries else None
        m = own if own is not None and own.id == c.claim.id and own.addr == c.claim.addr and own.state == ALIVE else c.claim
        m = m if m.incarnation >= c.claim.incarnation else c.claim
        self._prober.answered(m.id, now)
        self._view.vouch(m.id)
        for r in self._view.at_addr(m.addr):
            if r.member.id != m.id and r.member.state in (ALIVE, SUSPECT):
                # One address, one live member: the process there now answers as m (a restart under a new id).
                self._view.set(r, dataclasses.replace(r.member, state=DEAD, by=""), now)
                actions.append(MemberDown(r.member, "dead"))
        rec = self._view.record(m.id)
        if rec is None:
            self._view.add(m, now)
            self._prober.schedule(m.id)
            actions.append(MemberUp(m))
        elif m.incarnation > rec.member.incarnation:
            old = rec.member
            self._view.set(rec, m, now)
            if old.state in (DEAD, LEFT):
                actions.append(MemberUp(m, rejoined=True))
            elif old.incarnation == 0:
                self._prober.schedule(m.id)
        else:
            return
        self._broadcasts.broadcast(m)
        if c.wants_view:
            actions.append(Send(m.addr, GOSSIP, self._view.digest(m.id)))  # the full view its sync asked for
        if self._view.alive_count_is_one():
            actions.append(Send(m.addr, SYNC, self._view.digest(m.id)))  # our first member: swap views with it at once
