"""What we believe of what we hear: SWIM's precedence of claims, with nothing taken on trust.

SWIM's rule: a higher incarnation wins; at equal ones, suspect beats alive
and left beats both. The suspect, on hearing its suspicion, refutes it by
raising its incarnation, which outranks the suspicion everywhere (only a
member raises its own incarnation: ``Merger.merge`` does it for us when a
claim about us arrives). A death verdict spreads too (SWIM's confirm) and
is remembered as a tombstone, so that stale news cannot resurrect the
member, not even at a member that never knew it (hearsay); a member
wrongly declared dead (a healed partition, a paused process) hears its
verdict and refutes it with a higher incarnation.

Nothing is taken on trust (SECURITY.md, "Lying members"): a member heard
of is a candidate until it answers a nonce probe at the address claimed
(``verification``); gossip never moves a live member nor raises its
incarnation far (``_INCARNATION_GAP``); suspicions and deaths come only
from live members, a bounded number per period, and a death told of a
member that answered our own probe lately is only a suspicion. In a secure
swarm an id must be the one its address's key derives (``id_of``).
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Iterable

from gossiptrain.config import MembershipConfig
from gossiptrain.protocol.candidates import Candidates
from gossiptrain.protocol.member import ALIVE, DEAD, LEFT, SUSPECT, Member
from gossiptrain.protocol.swim.broadcasts import Broadcasts
from gossiptrain.protocol.swim.events import Action, HealthStats, MemberDown, Suspected
from gossiptrain.protocol.swim.probes import Prober
from gossiptrain.protocol.swim.timing import Timing
from gossiptrain.protocol.swim.view import Record, View

# How far gossip from others may raise a member's incarnation: refutations raise it by one, so honest
# news never jumps far; a larger claim (a restart, a lie) is believed only from the member's own answer.
_INCARNATION_GAP = 1 << 16


class Merger:
    """Takes what others tell us into the view, by SWIM's precedence and our own rules of evidence.

    Its own state is how many verdicts (suspicions and deaths) each sender
    has had taken this period (``new_period`` clears it).
    """

    def __init__(
        self,
        config: MembershipConfig,
        view: View,
        candidates: Candidates,
        broadcasts: Broadcasts,
        prober: Prober,
        timing: Timing,
        stats: HealthStats,
        id_of: Callable[[str], str | None] | None,
    ) -> None:
        self._config = config
        self._view = view
        self._candidates = candidates
        self._broadcasts = broadcasts
        self._prober = prober
        self._timing = timing
        self._stats = stats
        self._id_of = id_of
        self._verdicts: dict[str, int] = {}  # sender -> suspicions and deaths taken from it this period

    def new_period(self) -> None:
        self._verdicts.clear()

    def merge(self, entries: Iterable[Member], now: float, actions: list[Action], sender: str = "", source: str = "") -> None:
        """SWIM's precedence, with nothing taken on trust.

        A higher incarnation wins; at equal ones, suspect beats alive and left
        beats both. On top of that: a member we do not know, one claimed at
        another address, or one raised far past the incarnation we know, is
        only a candidate until it answers our own probe there (``Verifier``);
        suspicions and deaths are taken only from live members, a bounded
        number per sender and period; and a death told of a member that
        answered our own probe lately is only a suspicion (it refutes it).
        """
        id_of, me, view, introducer = self._id_of, self._view.me.id, self._view, source or sender or "?"
        for e in entries:
            if id_of is not None and id_of(e.addr) != e.id:
                self._stats.forged_ids_refused += 1  # a secure swarm's ids are their keys': nobody claims another's
                continue
            if e.id == me:
                self._refute(e)
                continue
            rec = view.record(e.id)
            if e.state == ALIVE:
                # Most entries are news we have (a sync repeats the whole view): skip them without a call.
                if rec is None or e.incarnation > rec.member.incarnation:
                    self._merge_alive(e, rec, now, introducer)
            elif rec is None:
                if e.state in (DEAD, LEFT) and self._live_sender(sender):
                    self._remember_hearsay(e, now)  # stale news of it arriving later must not bring it in
                # news of a stranger's suspicion is not taken
            elif e.incarnation > rec.member.incarnation + _INCARNATION_GAP:
                self._stats.jumps_refused += 1
            elif e.state == SUSPECT:
                if rec.member.state in (ALIVE, SUSPECT) and e.incarnation >= rec.member.incarnation:
                    if self._verdict_allowed(sender):
                        self._merge_suspicion(e, rec, now, actions)
            elif rec.member.state in (DEAD, LEFT):
                if e.state == LEFT and rec.member.state == DEAD and e.incarnation >= rec.member.incarnation:
                    view.amend(rec, e)  # it had left, not died: remember it so
            elif e.incarnation >= rec.member.incarnation:
                if e.state == LEFT and sender == e.id:
                    self._down(rec, e, now, actions)  # its own leave
                elif not self._verdict_allowed(sender):
                    pass
                elif self._answered_lately(e.id, now):
                    # It answered our own probe within a suspicion timeout: one member's word does not remove
                    # it. Suspect it instead (the teller counts as a suspector) and probe it next: if alive, it
                    # hears the suspicion and refutes it; if not, our own timer confirms the death.
                    self._stats.verdicts_doubted += 1
                    self._merge_suspicion(dataclasses.replace(e, state=SUSPECT, by=sender), rec, now, actions)
                    self._prober.probe_soon(e.id)
                else:
                    self._down(rec, e, now, actions)

    def _merge_alive(self, e: Member, rec: Record | None, now: float, introducer: str) -> None:
        """An alive claim: a refutation is taken as told; a newcomer, a move or a big jump waits for verification."""
        if rec is None:
            self._candidates.offer(e, introducer, now)
            return
        old = rec.member
        if e.incarnation <= old.incarnation:
            return
        if e.addr != old.addr and old.state in (ALIVE, SUSPECT):
            self._stats.redirects_refused += 1  # nobody moves a live member: it answers where it is (memberlist's rule)
            return
        if old.state in (DEAD, LEFT) or old.incarnation == 0 or e.incarnation > old.incarnation + _INCARNATION_GAP:
            self._candidates.offer(e, introducer, now)  # a rejoin, a start or a restart: it must answer for itself
            return
        self._view.set(rec, e, now)  # a refutation: one more than the suspicion it outranks
        self._broadcasts.broadcast(e)

    def _merge_suspicion(self, e: Member, rec: Record, now: float, actions: list[Action]) -> None:
        old = rec.member
        if old.state == ALIVE or e.incarnation > old.incarnation:
            self._view.set(rec, e, now)
            self._stats.suspicions += 1
            actions.append(Suspected(e))
        elif e.by and e.by not in rec.suspectors and len(rec.suspectors) <= self._config.suspicion_confirmations:
            self._view.amend(rec, e)  # an independent confirmation: pass it on, and the timer shrinks
        else:
            return
        if e.by == self._view.me.id or self._live_sender(e.by):  # a made-up suspector confirms nothing
            rec.suspectors = rec.suspectors | {e.by}
        self._broadcasts.broadcast(e)

    def _down(self, rec: Record, e: Member, now: float, actions: list[Action]) -> None:
        old = rec.member
        suspectors = tuple(sorted(rec.suspectors)) if old.state == SUSPECT and e.state == DEAD else ()
        self._view.set(rec, dataclasses.replace(e, by=""), now)
        self._broadcasts.broadcast(rec.member)
        actions.append(MemberDown(rec.member, "left" if e.state == LEFT else "dead", suspectors))

    def _live_sender(self, sender: str) -> bool:
        rec = self._view.record(sender)
        return rec is not None and rec.member.state in (ALIVE, SUSPECT) and rec.member.incarnation > 0

    def _verdict_allowed(self, sender: str) -> bool:
        """Suspicions and deaths are taken from ourselves and from live members, at most ``verdicts_per_sender`` a period."""
        if sender == self._view.me.id:
            return True
        if not self._live_sender(sender) or self._verdicts.get(sender, 0) >= self._config.verdicts_per_sender:
            self._stats.verdicts_refused += 1
            return False
        self._verdicts[sender] = self._verdicts.get(sender, 0) + 1
        return True

    def _answered_lately(self, member_id: str, now: float) -> bool:
        at = self._prober.last_answer(member_id)
        return at is not None and now - at < self._config.suspicion_timeout_max(len(self._view) + 1)

    def _remember_hearsay(self, e: Member, now: float) -> None:
        if self._view.hearsay() >= 4 * self._candidates.capacity:
            self._stats.hearsay_refused += 1
            return
        self._view.add(e, now, hearsay=True)
        self._candidates.drop(e.id)

    def _refute(self, claim: Member) -> None:
        """A claim that we are suspect, dead or gone, or one from a newer incarnation: outrank it.

        Only we raise our incarnation; a claim far above it is a lie that no
        member took (``_INCARNATION_GAP``), so we do not chase it there.
        """
        me = self._view.me
        if me.state != ALIVE:
            return
        stale = claim.incarnation < me.incarnation or (claim.incarnation == me.incarnation and claim.state == ALIVE)
        if stale:
            return
        if claim.incarnation > me.incarnation + _INCARNATION_GAP:
            self._stats.jumps_refused += 1
            return
        self._stats.refutations += 1
        if claim.state != ALIVE:
            self._timing.struggling()  # others could not hear us: slow down
        # No need to queue it: we ride on every message we send, and each member that takes it passes it on.
        self._view.me = dataclasses.replace(me, incarnation=max(me.incarnation, claim.incarnation) + 1)
