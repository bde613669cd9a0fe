"""Who is first in line for a chunk: weighted rendezvous hashing over the live members, by their measured pace.

Members claim first the chunks they are first in line for, so two members
that see the same live view and paces never claim the same chunk, and
nobody has to hand anything out. The line is weighted by pace (Schindelhauer
and Schomaker's weighted rendezvous hashing: member m scores ``w_m /
-ln(u)`` for a uniform ``u`` drawn from the hash of chunk and member): a
member 4x slower is first for a quarter as many chunks. Unweighted, a slow
member was first for its equal share, trained those in order at its pace,
and the swarm's floor (the lowest chunk not done) crept up at that pace:
the others ran out of window and fought over the rest.

Paces are published in coarse buckets (half octaves), so that a member's
pace, which wobbles, changes the line only when it moves by 40% or more;
when one member's weight or the view changes, only the chunks whose first
place that member wins or loses move (the property of rendezvous hashing).
"""

from __future__ import annotations

import hashlib
import math
from typing import Sequence

_MASK = (1 << 64) - 1
#: The bucket of every member while nobody's pace is known (all alike then). Once some are, a member whose pace
#: we have not heard (a newcomer) counts as their median: counted as slow, a newcomer was first in line for
#: almost nothing and waited to steal.
UNKNOWN_BUCKET = 8


def pace_bucket(pace: float) -> int:
    """A pace in samples per second as a half-octave bucket: round(2 log2(pace)), 0..127."""
    if not pace > 0 or not math.isfinite(pace):
        return 0
    return max(0, min(127, round(2 * math.log2(max(pace, 1.0)))))


def bucket_weight(bucket: int) -> float:
    return 2.0 ** (bucket / 2)


def member_hash(member: str) -> int:
    return int.from_bytes(hashlib.blake2b(member.encode(), digest_size=8).digest(), "little")


def _mix(x: int) -> int:
    """splitmix64's finaliser: a well-spread 64-bit hash of ``x``."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK
    return x ^ (x >> 31)


class Assignment:
    """The line for each chunk among ``members`` (ids) with their pace ``buckets``; memoised until they change."""

    def __init__(self) -> None:
        self._key: tuple[tuple[str, int], ...] = ()
        self._members: list[tuple[str, int, float]] = []  # (id, its hash, its weight)
        self._owner: dict[int, str] = {}
        self._hashes: dict[str, int] = {}

    def update(self, members: Sequence[str], buckets: dict[str, int]) -> bool:
        """The live members (ids) and their pace buckets (absent: the median of theirs that are known, see
        UNKNOWN_BUCKET); whether the line changed (a no-op if not)."""
        known = sorted(buckets[m] for m in members if m in buckets)
        unknown = known[len(known) // 2] if known else UNKNOWN_BUCKET
        key = tuple((m, buckets.get(m, unknown)) for m in sorted(members))
        if key == self._key:
            return False
        self._key = key
        self._members = [(m, self._hash(m), bucket_weight(b)) for m, b in key]
        self._owner.clear()
        return True

    def owner(self, g: int) -> str:
        """The member first in line for chunk ``g``."""
        got = self._owner.get(g)
        if got is None:
            got = self._owner[g] = max(self._members, key=lambda m: self._score(g, m[1], m[2]))[0]
            if len(self._owner) > 1 << 16:  # a window is far smaller; a long run must not grow this forever
                self._owner.clear()
        return got

    def rank(self, g: int, member: str) -> int:
        """``member``'s place in line for chunk ``g``: 0 first, len(members) if it is not a member."""
        mine = next((m for m in self._members if m[0] == member), None)
        if mine is None:
            return len(self._members)
        s = self._score(g, mine[1], mine[2])
        return sum(1 for m in self._members if m[0] != member and (self._score(g, m[1], m[2]), m[0]) > (s, member))

    def _score(self, g: int, h: int, w: float) -> float:
        u = ((_mix(g * 0x9E3779B97F4A7C15 ^ h) >> 11) | 1) / float(1 << 53)  # (0, 1)
        return w / -math.log(u)

    def _hash(self, member: str) -> int:
        h = self._hashes.get(member)
        if h is None:
            if len(self._hashes) > 1 << 14:
                self._hashes.clear()
            h = self._hashes[member] = member_hash(member)
        return h
