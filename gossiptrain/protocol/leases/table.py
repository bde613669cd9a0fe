"""The swarm's lease state as one member holds it: what is done, who claims what, and who still renews.

Every member holds a copy and merges the copies it hears; merging is
commutative, associative and idempotent (a state-based CRDT), so copies
converge whatever the order, loss or repetition of messages:

- ``floor``: every chunk below it is done (the greater floor wins);
- ``done``: the chunks at or above the floor that are done (a union);
- ``claims``: for each chunk not done, the claim that wins (``Claim.wins``):
  the higher term, and at the same term the lower member id. A chunk is
  taken over from a dead or silent holder by claiming it at the next term;
- ``beats``: each claiming member's renewal counter (the greater wins). A
  holder that trains bumps its counter; a member that sees a holder's
  counter stand still for the lease time, or its holder dead, may take its
  chunks over (``gossiptrain.protocol.leases.core``);
- ``paces``: each member's pace bucket as of its latest counter (which says
  how many chunks it is first in line for: ``assignment``).

Claims are allowed only in a window of ``window`` chunks above the floor:
what a message carries is bounded, and a member cannot run epochs ahead of
a chunk the swarm has not trained.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable

from gossiptrain.errors import ProtocolError

_MAX_ID = 64  # as membership's member ids
_MAX_TERM = (1 << 31) - 1


@dataclass(frozen=True)
class Claim:
    """``owner`` trains the chunk; ``term`` counts the takeovers of that chunk."""

    term: int
    owner: str

    def wins(self, other: Claim) -> bool:
        """Whether this claim beats ``other``: a later term, or the same term and the lower id (deterministic)."""
        return (self.term, other.owner) > (other.term, self.owner)


class LeaseTable:
    """One member's copy of the lease state (see the module docstring)."""

    def __init__(self, window: int) -> None:
        if window < 1:
            raise ValueError(f"a lease window holds at least 1 chunk, not {window}")
        self.window = window
        self.floor = 0
        self.done: set[int] = set()  # chunks >= floor that are done
        self.claims: dict[int, Claim] = {}  # chunk -> its winning claim (chunks >= floor, not done)
        self.beats: dict[str, int] = {}  # owner -> its renewal counter (owners that claim something, and ourselves)
        self.paces: dict[str, int] = {}  # owner -> its pace bucket at that counter (gossiptrain.protocol.leases.assignment)

    # -- queries ----------------------------------------------------------------------------------

    def is_done(self, g: int) -> bool:
        return g < self.floor or g in self.done

    def in_window(self, g: int) -> bool:
        return self.floor <= g < self.floor + self.window

    def claim_of(self, g: int) -> Claim | None:
        return self.claims.get(g)

    # -- changes ----------------------------------------------------------------------------------

    def put_claim(self, g: int, claim: Claim) -> bool:
        """Record ``claim`` on chunk ``g`` if it wins over what is there; whether it did."""
        if self.is_done(g) or not self.in_window(g):
            return False
        old = self.claims.get(g)
        if old is not None and not claim.wins(old):
            return old == claim
        self.claims[g] = claim
        return True

    def mark_done(self, g: int) -> None:
        if self.is_done(g):
            return
        self.done.add(g)
        self.claims.pop(g, None)
        self._advance()

    def beat(self, owner: str, count: int, pace: int | None = None) -> bool:
        """``owner``'s renewal counter is at least ``count``, with pace bucket ``pace`` then; whether that is news."""
        if count > self.beats.get(owner, -1):
            self.beats[owner] = count
            if pace is not None:
                self.paces[owner] = pace
            else:
                self.paces.pop(owner, None)
            return True
        return False

    def merge(self, other: LeaseTable) -> None:
        """Take in another member's copy (the rules of the module docstring)."""
        if other.floor > self.floor:
            self.floor = other.floor
            self.done = {g for g in self.done if g >= self.floor}
            self.claims = {g: c for g, c in self.claims.items() if g >= self.floor}
        for g in other.done:
            if g >= self.floor:
                self.done.add(g)
        for g, c in other.claims.items():
            if not self.is_done(g) and self.in_window(g):
                old = self.claims.get(g)
                if old is None or c.wins(old):
                    self.claims[g] = c
        for g in [g for g in self.claims if g in self.done]:
            del self.claims[g]
        for owner, count in other.beats.items():
            self.beat(owner, count, other.paces.get(owner))
        self._advance()

    def prune_beats(self, keep: Iterable[str]) -> None:
        """Forget the counters of members that claim nothing (and are not in ``keep``): the table stays bounded."""
        owners = {c.owner for c in self.claims.values()} | set(keep)
        self.beats = {o: b for o, b in self.beats.items() if o in owners}
        self.paces = {o: p for o, p in self.paces.items() if o in owners}

    def _advance(self) -> None:
        while self.floor in self.done:
            self.done.discard(self.floor)
            self.floor += 1

    # -- the wire ---------------------------------------------------------------------------------

    def to_wire(self) -> dict[str, Any]:
        """A msgpack-able body: the done chunks as runs above the floor, claims and beats by owner index."""
        runs: list[list[int]] = []
        for g in sorted(self.done):
            off = g - self.floor
            if off >= self.window:
                break
            if runs and runs[-1][0] + runs[-1][1] == off:
                runs[-1][1] += 1
            else:
                runs.append([off, 1])
        owners = sorted(self.beats.keys() | {c.owner for c in self.claims.values()})
        index = {o: i for i, o in enumerate(owners)}
        claims = [[g - self.floor, c.term, index[c.owner]] for g, c in sorted(self.claims.items())]
        return {"f": self.floor, "d": runs, "c": claims, "o": owners,
                "b": [self.beats.get(o, -1) for o in owners], "p": [self.paces.get(o, -1) for o in owners]}

    @classmethod
    def from_wire(cls, body: Any, window: int) -> LeaseTable:
        """The table a peer sent; ProtocolError where it is malformed or past the bounds of ``window``."""
        if not isinstance(body, dict):
            raise ProtocolError("a lease table is a map")
        floor, runs, claims, owners, beats, paces = (body.get(k) for k in ("f", "d", "c", "o", "b", "p"))
        if type(floor) is not int or not 0 <= floor < (1 << 62):
            raise ProtocolError("a lease table's floor is an int in 0..2**62")
        if not isinstance(runs, list) or len(runs) > (window + 1) // 2:
            raise ProtocolError(f"a lease table's done chunks are at most {(window + 1) // 2} runs")
        if not isinstance(owners, list) or len(owners) > window + 1:
            raise ProtocolError(f"a lease table names at most {window + 1} owners")
        if not all(type(o) is str and 0 < len(o) <= _MAX_ID for o in owners) or len(set(owners)) != len(owners):
            raise ProtocolError("a lease table's owners are distinct member ids of 1-64 characters")
        if not isinstance(beats, list) or len(beats) != len(owners):
            raise ProtocolError("a lease table has one beat per owner")
        if not all(type(b) is int and -1 <= b <= _MAX_TERM for b in beats):
            raise ProtocolError("a lease table's beats are ints in -1..2**31-1")
        if not isinstance(paces, list) or len(paces) != len(owners) or not all(type(p) is int and -1 <= p <= 127 for p in paces):
            raise ProtocolError("a lease table has one pace bucket (-1..127) per owner")
        if not isinstance(claims, list) or len(claims) > window:
            raise ProtocolError(f"a lease table holds at most {window} claims")
        table = cls(window)
        table.floor = floor
        for run in runs:
            if not (isinstance(run, list) and len(run) == 2 and all(type(x) is int for x in run)):
                raise ProtocolError("a lease table's done run is [offset, length]")
            off, length = run
            if not (0 <= off and 1 <= length and off + length <= window):
                raise ProtocolError("a lease table's done run is past its window")
            table.done.update(range(floor + off, floor + off + length))
        named = [Claim(0, o) for o in owners]  # term-0 claims shared by every entry that needs no other term
        done, got = table.done, table.claims
        for entry in claims:
            if not (type(entry) is list and len(entry) == 3):
                raise ProtocolError("a lease claim is [offset, term, owner index]")
            off, term, who = entry
            if not (type(off) is int and type(term) is int and type(who) is int):
                raise ProtocolError("a lease claim is [offset, term, owner index]")
            if not (0 <= off < window and 0 <= term <= _MAX_TERM and 0 <= who < len(owners)):
                raise ProtocolError("a lease claim is past its table's window, terms or owners")
            g = floor + off
            if g in done:
                continue
            claim = named[who] if term == 0 else Claim(term, owners[who])
            old = got.get(g)
            if old is None or claim.wins(old):  # a sender that repeats a chunk: the rule picks, as put_claim would
                got[g] = claim
        for o, b, p in zip(owners, beats, paces):
            if b >= 0:
                table.beat(o, b, p if p >= 0 else None)
        table._advance()
        return table
