"""Suspicion timers: when a suspect, or a welcome's placeholder that never started, is declared dead.

Suspicion, refuted or confirmed (SWIM + Lifeguard, Dadgar et al. 2018): the
suspicion spreads; the suspect, on hearing it, refutes it by raising its
incarnation (``merge``). Every member runs its own suspicion timer: it
starts long (a lone suspector may be the one in trouble) and shrinks
towards ``suspicion_timeout(n)`` as independent members report the same
suspicion, reaching it at ``suspicion_confirmations`` of them, or at as many
as could confirm at all (in a swarm of 3, the one other survivor: without
that cap a small swarm's real deaths waited most of the maximum). The
members asked to help with a failed probe hear the suspicion at once, so
their confirmations come within a period. When the timer runs out the
member is declared dead, and the verdict spreads (SWIM's confirm).

A welcome's placeholder for a newcomer (incarnation 0) is not probed while
the newcomer builds its model, and is dropped ``newcomer_grace`` seconds
later if the newcomer never spoke for itself (it died starting).
"""

from __future__ import annotations

import dataclasses
import math

from gossiptrain.config import MembershipConfig
from gossiptrain.protocol.member import DEAD
from gossiptrain.protocol.swim.broadcasts import Broadcasts
from gossiptrain.protocol.swim.events import Action, MemberDown
from gossiptrain.protocol.swim.timing import Timing
from gossiptrain.protocol.swim.view import Record, View


class Suspicions:
    """The timers of the suspects and of the placeholders in the view; their state is the records' (``View``)."""

    def __init__(self, config: MembershipConfig, view: View, timing: Timing, broadcasts: Broadcasts) -> None:
        self._config = config
        self._view = view
        self._timing = timing
        self._broadcasts = broadcasts

    def timeout(self, rec: Record, confirmers: int) -> float:
        """Lifeguard: from the maximum down to the minimum as independent suspicions arrive (log scale).

        ``confirmers`` is how many members could confirm a suspicion at all
        (``View.confirmers()``): Lifeguard's K is capped by it, since a swarm
        of 3 has one member besides the first suspector and could never reach
        3. Without the cap a real death there waits most of the maximum.
        """
        n = len(self._view) + 1
        stretch = self._timing.stretch()
        lo, hi = stretch * self._config.suspicion_timeout(n), stretch * self._config.suspicion_timeout_max(n)
        k = min(self._config.suspicion_confirmations, confirmers)
        if k <= 0:
            return lo  # nobody could confirm it (a swarm of two): the first suspicion is all there will be
        confirmations = min(k, max(0, len(rec.suspectors) - 1))
        return max(lo, hi - (hi - lo) * math.log(confirmations + 1) / math.log(k + 1))

    def deadlines(self) -> list[float]:
        """When each suspect's timer, and each placeholder's grace, runs out."""
        suspected = self._view.suspected()
        confirmers = self._view.confirmers() if suspected else 0
        times = [rec.changed_at + self.timeout(rec, confirmers) for rec in suspected]
        times += [rec.changed_at + self._config.newcomer_grace for rec in self._view.placeholders()]
        return times

    def expire(self, now: float, actions: list[Action]) -> None:
        """Declare dead the suspects whose timers ran out, and the placeholders whose members never started."""
        suspected = self._view.suspected()
        confirmers = self._view.confirmers() if suspected else 0
        for rec in suspected:
            if now - rec.changed_at >= self.timeout(rec, confirmers):
                suspectors = tuple(sorted(rec.suspectors))
                self._view.set(rec, dataclasses.replace(rec.member, state=DEAD, by=""), now)
                self._broadcasts.broadcast(rec.member)  # SWIM's confirm: a member that never heard of it must not take it up
                actions.append(MemberDown(rec.member, "dead", suspectors))
        for rec in self._view.placeholders():
            # A welcome's placeholder (its own entry has a start-time incarnation) that never started: not
            # probed meanwhile, since building a model takes a while; dropped on time, not at the next sweep.
            if now - rec.changed_at >= self._config.newcomer_grace:
                self._view.set(rec, dataclasses.replace(rec.member, state=DEAD), now)
                actions.append(MemberDown(rec.member, "dead"))
