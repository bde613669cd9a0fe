"""Quarantine: a member whose updates keep failing validation is ignored for a while.

One rejected update can be an accident (a peer restarted with another model
a moment before the swarm noticed); several within ``seconds`` are not. A
quarantined member is not picked as a partner, and its exchange messages are
refused at the safe point before they cost a decode or a merge. The state is
bounded: strikes are remembered for at most ``MAX_TRACKED`` members.
"""

from __future__ import annotations

import logging
from collections import OrderedDict, deque
from dataclasses import dataclass

log = logging.getLogger(__name__)

MAX_TRACKED = 1024


@dataclass
class QuarantineStats:
    quarantined: int = 0  # times a member was put in quarantine
    quarantine_refused: int = 0  # exchange messages refused from quarantined members

    def to_dict(self) -> dict[str, int]:
        return dict(self.__dict__)


class Quarantine:
    """``after`` rejected updates within ``seconds`` quarantine a member for ``seconds``."""

    def __init__(self, after: int, seconds: float) -> None:
        self.after = after
        self.seconds = seconds
        self.stats = QuarantineStats()
        self._strikes: OrderedDict[str, deque[float]] = OrderedDict()
        self._until: OrderedDict[str, float] = OrderedDict()

    def blocks(self, member: str, now: float) -> bool:
        """True while ``member`` is quarantined."""
        until = self._until.get(member)
        if until is None:
            return False
        if now < until:
            return True
        del self._until[member]
        return False

    def refused(self) -> None:
        self.stats.quarantine_refused += 1

    def offence(self, member: str, now: float) -> None:
        """Record a rejected update from ``member``; quarantine it on the ``after``-th within ``seconds``."""
        strikes = self._strikes.pop(member, None) or deque(maxlen=self.after)
        strikes.append(now)
        self._strikes[member] = strikes  # most recent last: the oldest is evicted first
        while len(self._strikes) > MAX_TRACKED:
            self._strikes.popitem(last=False)
        if len(strikes) >= self.after and now - strikes[0] <= self.seconds and self.seconds > 0:
            self._until[member] = now + self.seconds
            while len(self._until) > MAX_TRACKED:
                self._until.popitem(last=False)
            del self._strikes[member]
            self.stats.quarantined += 1
            log.warning(
                "quarantined %s for %.0f s: %d updates rejected within %.0f s", member, self.seconds, self.after, self.seconds
            )
