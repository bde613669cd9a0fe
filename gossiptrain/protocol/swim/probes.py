"""The probe cycle: whom we ping each period, who helps when it does not answer, and the probes we run for others.

Failure detection (SWIM, Das et al. 2002): every protocol period a member
probes one other, going round a shuffled list so that each member is probed
by everyone within a bounded number of periods. A probe is a ``ping`` that
must be ``ack``-ed within a timeout derived from measured round-trip times
(``timing``); failing that, ``indirect_probes`` other members are asked
(``ping-req``) to ping the target for us, so that one lossy link cannot
condemn a member. A probe that nobody answered makes the target a
*suspect*: ``Prober.conclude`` hands it back, and ``Membership`` spreads
the suspicion (``merge``).

A probe's sequence number is a random nonce (``nonce``): only whoever got
the probe can answer it, so an ack is evidence of life at the address
probed, and only the target's own ack (or a helper's relay of it) counts.
A client-mode member (behind NAT, ``can_reach`` false) is neither probed
nor asked to probe: nobody could send it the ping, and its liveness is
judged by those it talks to.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Callable

from gossiptrain.config import MembershipConfig
from gossiptrain.net.kinds import ACK, PING, PING_REQ
from gossiptrain.protocol.member import ALIVE, SUSPECT, Member
from gossiptrain.protocol.swim.broadcasts import Broadcasts
from gossiptrain.protocol.swim.events import Ack, Action, HealthStats, PingReq, Send
from gossiptrain.protocol.swim.timing import Timing
from gossiptrain.protocol.swim.view import View

_MAX_RELAYS = 64  # indirect probes we run for others at once; more are refused (bounded state)


@dataclass
class Probe:
    """Our probe of one member in this period."""

    target: str
    seq: int
    sent_at: float
    direct_deadline: float  # then ask others (ping-req)
    deadline: float  # then suspect it
    indirect_sent: bool = False
    acked: bool = False
    helpers: tuple[str, ...] = ()  # addresses of the members asked to probe it for us (ping-req)
    helper_ids: tuple[str, ...] = ()  # and their ids: only they may pass an ack on


@dataclass
class _Relay:
    """An indirect probe we run for ``origin``: pass the target's ack back under the origin's seq."""

    origin_addr: str
    origin_seq: int
    expires: float
    target: str  # the member probed: only its own ack is passed back


class Prober:
    """Our probe in flight, the round-robin order of targets, the probes we relay for others, and who answered lately."""

    def __init__(
        self,
        config: MembershipConfig,
        view: View,
        timing: Timing,
        broadcasts: Broadcasts,
        stats: HealthStats,
        rng: random.Random,
        nonces: random.Random,
        can_reach: Callable[[str], bool],
    ) -> None:
        self._config = config
        self._view = view
        self._timing = timing
        self._broadcasts = broadcasts
        self._stats = stats
        self._rng = rng
        self._nonces = nonces
        self._can_reach = can_reach
        self.in_flight: Probe | None = None
        self._unanswered: Probe | None = None  # the last probe concluded without an answer: a late one is measured
        self._order: list[str] = []
        self._relays: dict[int, _Relay] = {}
        self._last_ack: dict[str, float] = {}  # member id -> when it last answered our own probe (evidence of life)

    def nonce(self) -> int:
        """A probe's sequence number: random, so that only whoever got the probe can answer it."""
        return self._nonces.getrandbits(62) | 1

    # -- our probe -------------------------------------------------------------------------

    def start(self, now: float, period: float, actions: list[Action]) -> float | None:
        """Ping the next target; returns the time its verdict is due (None if there is nobody to probe)."""
        target = self._next_target()
        if target is None:
            return None
        seq = self.nonce()
        estimate = self._view.rtt(target.id)
        deadline = now + self._timing.probe_span(estimate, period)
        self.in_flight = Probe(target.id, seq, now, now + self._timing.probe_timeout(estimate), deadline=deadline)
        self._stats.probes += 1
        actions.append(Send(target.addr, PING, self._broadcasts.piggyback(target.id), seq=seq))
        return deadline

    def next_deadline(self) -> float | None:
        """When the probe in flight next needs a tick: to ask others, or for its verdict."""
        p = self.in_flight
        if p is not None and not p.acked:
            return p.deadline if p.indirect_sent else p.direct_deadline
        return None

    def _next_target(self) -> Member | None:
        """Round robin over a shuffled list (SWIM's bounded detection time), reshuffled when used up.

        Members at incarnation 0 are a welcome's placeholders, not started
        yet: they are not probed (see ``Suspicions.expire``).
        """
        me = self._view.me.id
        for _ in range(2):  # what is left of this round, then a fresh one
            while self._order:
                m = self._view.get(self._order.pop())
                if m is not None and m.state in (ALIVE, SUSPECT) and m.id != me and m.incarnation > 0 \
                        and self._can_reach(m.addr):
                    return m
            self._order = [m.id for m in self._view.alive() if m.id != me and m.incarnation > 0]
            self._rng.shuffle(self._order)
        return None

    def probe_soon(self, member_id: str) -> None:
        """Make ``member_id`` our next target (a death told of a member that answers us: see whether it still does)."""
        self._order.append(member_id)

    def schedule(self, member_id: str) -> None:
        """Put a new member somewhere in what is left of this round."""
        self._order.insert(self._rng.randint(0, len(self._order)), member_id)

    def ask_others(self, now: float, actions: list[Action]) -> None:
        """The direct ping of the probe in flight went unanswered: ask ``indirect_probes`` live members to ping it."""
        p = self.in_flight
        assert p is not None
        p.indirect_sent = True
        target = self._view.get(p.target)
        me = self._view.me.id
        helpers = [
            m for m in self._view.alive() if m.id not in (me, p.target) and m.state == ALIVE and self._can_reach(m.addr)
        ]
        if target is None or not helpers:
            return
        self._stats.indirect_probes += 1
        asked = self._rng.sample(helpers, min(self._config.indirect_probes, len(helpers)))
        p.helpers = tuple(h.addr for h in asked)
        p.helper_ids = tuple(h.id for h in asked)
        for h in asked:
            actions.append(
                Send(h.addr, PING_REQ, self._broadcasts.piggyback(h.id), seq=p.seq, target=target.id, target_addr=target.addr)
            )

    def conclude(self) -> Probe | None:
        """The probe's time is up: an ack is good health; a probe nobody answered is returned, its target to suspect."""
        p = self.in_flight
        assert p is not None
        self.in_flight = None
        if p.acked:
            self._timing.recovering()
            return None
        self._unanswered = p
        self._stats.probes_failed += 1
        self._timing.struggling()
        return p

    def on_ack(self, event: Ack, now: float, actions: list[Action]) -> None:
        """An ack that is no candidate's: a target's answer to a probe we relay, to our probe, or to one concluded."""
        relay = self._relays.get(event.seq)
        if relay is not None:
            if event.sender == relay.target:  # another member now at the target's address proves nothing
                del self._relays[event.seq]
                actions.append(Send(relay.origin_addr, ACK, self._broadcasts.piggyback(""), seq=relay.origin_seq))
            return
        p = self.in_flight
        late = self._unanswered
        if late is not None and late.seq == event.seq and event.sender == late.target:
            # Its answer to a probe already concluded: a round trip longer than our timeouts, which follow it from
            # now on (no verdict changes: the member refutes a suspicion itself). Without this a link slower than
            # the first timeouts (half a period) was never measured, and every probe of it failed.
            self._unanswered = None
            self.measured(late.target, now - late.sent_at)
            self._timing.min_rtt.observe(now - late.sent_at, now)
            return
        if p is None or p.seq != event.seq or p.acked:
            return
        if event.sender != p.target and event.sender not in p.helper_ids:
            # An ack from whoever answers at the target's address now (a restart under a new id, a second id
            # after a lost welcome) must not keep the old id alive for ever.
            self._stats.acks_from_others += 1
            return
        p.acked = True
        if event.sender == p.target:
            self.answered(p.target, now)  # its own answer to our nonce: evidence against a death told by others
            rec = self._view.record(p.target)
            if rec is not None:
                self.echo(event, rec.member.addr, actions)
            self.measured(p.target, now - p.sent_at)  # its own answer, if after we asked others too: one ping
            self._timing.min_rtt.observe(now - p.sent_at, now)

    def echo(self, ack: Ack, addr: str, actions: list[Action]) -> None:
        """Answer the challenge on an ack to our own probe, at the address we probed (never one the ack names)."""
        if ack.challenge and self._view.me.state == ALIVE:
            actions.append(Send(addr, ACK, self._broadcasts.piggyback(ack.sender), seq=ack.challenge))

    def measured(self, member_id: str, rtt: float) -> None:
        """``member_id`` answered our own ping after ``rtt`` seconds: its timeout, and the swarm's, follow.

        ``min_rtt``, which averaging reads as the link's latency, is the caller's: it takes our probes of
        members only, as before candidates were measured. Their answers come before exchanges load the link,
        and moved averaging's settings (tests/test_momentum.py's skewed run fell from 0.94 to 0.89).
        """
        rec = self._view.record(member_id)
        estimate = self._timing.measured(rec.rtt if rec is not None else None, rtt)
        if rec is not None:
            rec.rtt = estimate

    # -- evidence of life ------------------------------------------------------------------

    def answered(self, member_id: str, now: float) -> None:
        """``member_id`` answered our own nonce at its address just now."""
        self._last_ack[member_id] = now

    def last_answer(self, member_id: str) -> float | None:
        """When ``member_id`` last answered our own probe; None if it never did (or we forgot it)."""
        return self._last_ack.get(member_id)

    def forget(self, member_id: str) -> None:
        """Its record is gone: so is what we knew of its answers."""
        self._last_ack.pop(member_id, None)

    # -- probes we run for others ----------------------------------------------------------

    def relay(self, event: PingReq, now: float, actions: list[Action]) -> None:
        """Ping ``event.target`` for the member whose direct probe of it failed, and pass the target's ack back."""
        for seq in [s for s, r in self._relays.items() if r.expires <= now]:
            del self._relays[seq]
        if len(self._relays) >= _MAX_RELAYS or event.target == self._view.me.id:
            return
        seq = self.nonce()
        self._relays[seq] = _Relay(event.reply_to, event.seq, now + 2 * self._timing.period(), event.target)
        actions.append(Send(event.target_addr, PING, self._broadcasts.piggyback(event.target), seq=seq))
