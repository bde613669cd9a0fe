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
from collections import OrderedDict
from typing import Sequence

import torch

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


#: Lines (member ids and buckets) whose owners are remembered for every ``Assignment`` of this process that sees
#: the same line: in a simulator, hundreds of members compute the same owner of each chunk (a pure function of
#: the line); each computes it once per process instead of once per member. The oldest lines are forgotten.
SHARED_LINES = 8
_shared: OrderedDict[tuple[tuple[str, int], ...], dict[int, str]] = OrderedDict()  # line -> chunk -> owner


def _owners_of(key: tuple[tuple[str, int], ...]) -> dict[int, str]:
    owners = _shared.get(key)
    if owners is None:
        owners = _shared[key] = {}
        while len(_shared) > SHARED_LINES:
            _shared.popitem(last=False)
    else:
        _shared.move_to_end(key)
    return owners


#: Scores computed at once: chunks x members of one tensor op (fewer, larger ops: a thread pool that waits for a
#: busy core costs per op). 4,096 chunks' owners among 256 members, on this machine: 20 ms on one torch thread,
#: 0.5 s on two with the other core busy, against 0.7-0.8 s scored one by one in Python.
OWNER_SCORES = 16_384


def _signed(x: int) -> int:
    """A 64-bit pattern as torch's int64 holds it."""
    x &= _MASK
    return x - (1 << 64) if x >= 1 << 63 else x


def _shift(x: torch.Tensor, k: int) -> torch.Tensor:
    """Logical right shift of int64 bit patterns (torch's is arithmetic)."""
    return (x >> k) & ((1 << (64 - k)) - 1)


def _first_in_line(start: int, count: int, h: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The index of the first in line for chunks start..start+count-1 among members of hashes ``h`` (n,) as int64
    and weights ``w`` (n,): ``Assignment._score`` over a (count, n) grid, with the same bits (int64 arithmetic
    wraps as _mix's mask does)."""
    g = torch.arange(start, start + count, dtype=torch.int64)  # (G,)
    x = (g[:, None] * _signed(0x9E3779B97F4A7C15)) ^ h[None, :]  # (G, n)
    x = x + _signed(0x9E3779B97F4A7C15)
    x = (x ^ _shift(x, 30)) * _signed(0xBF58476D1CE4E5B9)
    x = (x ^ _shift(x, 27)) * _signed(0x94D049BB133111EB)
    x = x ^ _shift(x, 31)
    u = (_shift(x, 11) | 1).to(torch.float64) / float(1 << 53)  # (G, n) in (0, 1)
    return (w[None, :] / -torch.log(u)).argmax(dim=1)  # (G,): ties go to the first, as max() does


class Assignment:
    """The line for each chunk among ``members`` (ids) with their pace ``buckets``; memoised until they change."""

    def __init__(self) -> None:
        self._key: tuple[tuple[str, int], ...] = ()
        self._members: list[tuple[str, int, float]] = []  # (id, its hash, its weight)
        self._by_id: dict[str, tuple[str, int, float]] = {}
        self._h = torch.zeros(0, dtype=torch.int64)  # (n,) the members' hashes as int64 bit patterns
        self._w = torch.zeros(0, dtype=torch.float64)  # (n,) their weights
        self._owners: dict[int, str] = {}  # chunk -> its first in line (shared with Assignments of this line)
        self._rank: dict[tuple[int, str, int], int] = {}  # (chunk, member, cap) -> its capped place
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
        self._by_id = {m[0]: m for m in self._members}
        self._h = torch.tensor([_signed(m[1]) for m in self._members], dtype=torch.int64)  # (n,)
        self._w = torch.tensor([m[2] for m in self._members], dtype=torch.float64)  # (n,)
        self._owners = _owners_of(key)
        self._rank.clear()
        return True

    def owner(self, g: int) -> str:
        """The member first in line for chunk ``g``."""
        owners = self._owners
        got = owners.get(g)
        if got is None:
            if len(owners) > 1 << 16:  # a window is far smaller; a long run must not grow this forever
                owners.clear()
            block = max(1, OWNER_SCORES // len(self._members))
            start = g - g % block
            ids = [m[0] for m in self._members]
            for k, best in enumerate(_first_in_line(start, block, self._h, self._w).tolist()):
                owners[start + k] = ids[best]
            got = owners[g]
        return got

    def rank(self, g: int, member: str, cap: int | None = None) -> int:
        """``member``'s place in line for chunk ``g``: 0 first, len(members) if it is not a member; counted up to
        ``cap`` at most. With a small cap this is O(1) expected for a chunk it is far back in line for: a member
        finds its own chunks among n members' in O(n) per chunk found, not O(n^2) as with ``owner``."""
        limit = len(self._members) if cap is None else cap
        key = (g, member, limit)
        got = self._rank.get(key)
        if got is not None:
            return got
        mine = self._by_id.get(member)
        if mine is None:
            return len(self._members)
        s = self._score(g, mine[1], mine[2])
        got = 0
        for m in self._members:
            if m[0] != member and (self._score(g, m[1], m[2]), m[0]) > (s, member):
                got += 1
                if got >= limit:
                    break
        if len(self._rank) > 1 << 16:  # as the owners: a long run must not grow this forever
            self._rank.clear()
        self._rank[key] = got
        return got

    def is_first(self, g: int, member: str) -> bool:
        """Whether ``member`` is first in line for chunk ``g``."""
        return self.owner(g) == member

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
