"""Dissemination: the updates that ride piggybacked on our probe messages, and the hints that let a suspect refute.

Updates (joins, suspicions, refutations, leaves, deaths) are not sent on
their own: each rides on the probe messages we send anyway, a bounded
number of times (``MembershipConfig.retransmits``, which grows with the
log of the swarm), fresh news first, and newer news of a member replaces
the older (memberlist's transmit-limited queue). Every message also
carries ourselves, and what the recipient should know about itself:
Lifeguard's buddy system, a suspect hears its suspicion from its prober
first. A member we hold suspect or dead that speaks to us is told so, at
most once a period, so that it can refute.

Full views (``sync``, anti-entropy) are ``View.digest``.
"""

from __future__ import annotations

from collections import deque
from typing import Any

from gossiptrain.config import MembershipConfig
from gossiptrain.net.kinds import GOSSIP
from gossiptrain.protocol.member import DEAD, SUSPECT, Member
from gossiptrain.protocol.swim.events import Action, Send
from gossiptrain.protocol.swim.view import View


class Broadcasts:
    """The queue of updates to piggyback, and when we last hinted each member of what we think of it."""

    def __init__(self, config: MembershipConfig, view: View) -> None:
        self._config = config
        self._view = view
        self._queue: deque[list[Any]] = deque()  # [entry, transmits left], fresh first
        self._queued: dict[str, list[Any]] = {}  # member id -> its item in _queue
        self._hinted: dict[str, float] = {}  # member id -> when we last told it what we think of it

    def broadcast(self, entry: Member) -> None:
        """Queue an update to ride on our next messages, replacing older news of the same member."""
        item = [entry, self._config.retransmits(len(self._view) + 1)]
        old = self._queued.get(entry.id)
        if old is not None:
            old[1] = 0  # dropped lazily when it comes round
        self._queued[entry.id] = item
        self._queue.appendleft(item)

    def piggyback(self, to: str) -> tuple[Member, ...]:
        """Ourselves, what the recipient should know about itself, and up to ``max_piggyback`` queued updates."""
        out = [self._view.me]
        rec = self._view.record(to)
        if rec is not None and rec.member.state in (SUSPECT, DEAD):
            out.append(rec.member)  # Lifeguard's buddy system: a suspect hears it from its prober first
        taken = 0
        for _ in range(len(self._queue)):
            if taken == self._config.max_piggyback:
                break
            item = self._queue.popleft()
            entry, left = item
            if left <= 0:
                if self._queued.get(entry.id) is item:
                    del self._queued[entry.id]
                continue
            if entry.id != to:
                out.append(entry)
                taken += 1
                item[1] = left - 1
            self._queue.append(item)
        return tuple(out)

    def hint(self, sender: str, now: float, actions: list[Action]) -> None:
        """A member we hold suspect or dead just spoke to us: tell it, at most once a period, so it can refute.

        The hint goes to the address we hold for it, never to one the message names (no reflection).
        """
        rec = self._view.record(sender)
        if rec is None or rec.member.state not in (SUSPECT, DEAD):
            return
        last = self._hinted.get(sender)
        if last is not None and now - last < self._config.heartbeat_interval:
            return
        self._hinted[sender] = now
        actions.append(Send(rec.member.addr, GOSSIP, (self._view.me, rec.member)))

    def forget_hints(self, now: float) -> None:
        """Forget the hints older than a period (they only rate-limit the next)."""
        for mid, t in list(self._hinted.items()):
            if now - t > self._config.heartbeat_interval:
                del self._hinted[mid]
