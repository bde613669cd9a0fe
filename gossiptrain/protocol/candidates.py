"""Members heard of but not verified yet: a bounded table, each entry charged to whoever introduced it.

Gossip about a member is a claim, not a fact. Anyone can gossip thousands
of made-up members, or a real member's id at their own address; believing
it makes every peer probe, dial and pick members that never answer. So a
member we only heard of (from someone else, or from a message that says it
is that member: in an open swarm nothing proves who sent a message) is a
*candidate*: ``Membership`` probes it at the address claimed with a random
nonce, and only an ack carrying that nonce and that id (which only the
process listening at that address can send; in a secure swarm, only the one
holding the address's CURVE key) makes it a member. Memberlist and Consul
take gossip on trust; this is the step they lack, in the spirit of
Lifeguard's "a member is what answers our own probes".

The table holds at most ``capacity`` candidates, at most ``per_introducer``
from any one introducer (the network source of the message where the
transport knows it, else the sender's id), so one liar fills a quarter of
it at most and honest newcomers still get in. An introducer whose
candidates keep not answering (``per_introducer`` more failures than
successes) is quarantined for ``quarantine_for`` seconds, as a member whose
updates keep failing validation is (``gossiptrain.protocol.quarantine``):
its introductions are not even taken.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from dataclasses import dataclass
from typing import Iterator

from gossiptrain.protocol.member import Member

#: Places past the capacity for pingers' own claims (``Candidates.offer``'s ``direct``).
DIRECT_RESERVE = 32
_STRIKES_TRACKED = 1024  # introducers whose record of failures we keep (least recently charged forgotten)


@dataclass
class Candidate:
    """A claimed member waiting for its own answer at the address claimed."""

    claim: Member
    introducer: str
    heard_at: float
    seq: int = 0  # the nonce of our probe in flight (0: not probed yet)
    deadline: float = 0.0  # our probe's answer is due by then
    sent_at: float = 0.0  # when we sent it
    earlier: tuple[int, float] = (0, 0.0)  # the probe before it (nonce, when sent): its answer, if late, still counts
    attempts: int = 0  # probes sent
    wants_view: bool = False  # it asked for our full view (a sync): sent once it is verified
    via: str = ""  # the member asked to probe it for us (a client we cannot reach ourselves); "": probed directly


@dataclass
class CandidateStats:
    candidates_verified: int = 0  # answered our probe: now members
    candidates_unanswered: int = 0  # dropped: never answered at the address claimed
    candidates_refused: int = 0  # not taken: the table or the introducer's share was full, or it was quarantined
    introducers_quarantined: int = 0  # times an introducer's introductions were ignored for a while

    def to_dict(self) -> dict[str, int]:
        return dict(self.__dict__)


class Candidates:
    """The bounded table of candidates, by member id."""

    def __init__(self, capacity: int, per_introducer: int, quarantine_for: float) -> None:
        self.capacity = capacity
        self.per_introducer = per_introducer
        self.quarantine_for = quarantine_for
        self.stats = CandidateStats()
        self._by_id: dict[str, Candidate] = {}
        self._by_seq: dict[int, str] = {}
        self._held: Counter[str] = Counter()  # introducer -> its candidates in the table
        self._strikes: OrderedDict[str, int] = OrderedDict()  # introducer -> failures less successes (>= 0)
        self._quarantined: dict[str, float] = {}  # introducer -> until when its introductions are ignored

    def __len__(self) -> int:
        return len(self._by_id)

    def __contains__(self, member_id: str) -> bool:
        return member_id in self._by_id

    def __iter__(self) -> Iterator[Candidate]:
        return iter(list(self._by_id.values()))

    def get(self, member_id: str) -> Candidate | None:
        return self._by_id.get(member_id)

    def offer(self, claim: Member, introducer: str, now: float, *, direct: bool = False) -> Candidate | None:
        """Take a claim as a candidate; None if refused. A newer claim at the same address updates a waiting one.

        ``direct``: the claim is a pinger's own, challenged on our ack to it (``swim.verification.Verifier.challenge``);
        such claims may use ``DIRECT_RESERVE`` places past ``capacity``, since they leave the table one
        round trip later, so that at a swarm's start hearsay filling the table does not stop them.
        """
        held = self._by_id.get(claim.id)
        if held is not None:
            if claim.addr == held.claim.addr and claim.incarnation > held.claim.incarnation:
                held.claim = claim  # the first address claimed is the one probed: nobody may redirect a candidate
            return held
        until = self._quarantined.get(introducer)
        if until is not None and until > now:
            self.stats.candidates_refused += 1
            return None
        room = self.capacity + (DIRECT_RESERVE if direct else 0)
        if len(self._by_id) >= room or self._held[introducer] >= self.per_introducer:
            self.stats.candidates_refused += 1
            return None
        c = Candidate(claim, introducer, now)
        self._by_id[claim.id] = c
        self._held[introducer] += 1
        return c

    def probing(self, c: Candidate, seq: int, now: float, deadline: float) -> None:
        """We sent ``c`` a probe with nonce ``seq`` at ``now``: its ack is due by ``deadline``.

        The probe before it stays answerable: on a link slower than the
        first deadline (sent before any round trip was measured) the answer
        to the first probe comes during the second.
        """
        if c.earlier[0]:
            self._by_seq.pop(c.earlier[0], None)
        if c.seq:
            c.earlier = (c.seq, c.sent_at)
        c.seq, c.sent_at, c.deadline, c.attempts = seq, now, deadline, c.attempts + 1
        self._by_seq[seq] = c.claim.id

    def answered(self, seq: int, sender: str) -> tuple[Candidate, float] | None:
        """The candidate that ``seq`` probed and when that probe was sent, if the ack is its own or relayed by the
        member we asked (then it leaves the table); else None."""
        mid = self._by_seq.get(seq)
        if mid is None or (mid != sender and (not sender or self._by_id[mid].via != sender)):
            return None
        c = self._remove(mid)
        sent_at = c.sent_at if seq == c.seq else c.earlier[1]
        self._charge(c.introducer, -1)
        self.stats.candidates_verified += 1
        return c, sent_at

    def unanswered(self, c: Candidate, now: float) -> None:
        """Drop ``c``, which never answered, and charge its introducer (quarantined past its share)."""
        self._remove(c.claim.id)
        self.stats.candidates_unanswered += 1
        if self._charge(c.introducer, +1) >= self.per_introducer:
            self._strikes.pop(c.introducer, None)
            self._quarantined[c.introducer] = now + self.quarantine_for
            self.stats.introducers_quarantined += 1

    def drop(self, member_id: str) -> None:
        """Forget a candidate without judging it (it became a member some other way, or a placeholder expired)."""
        if member_id in self._by_id:
            self._remove(member_id)

    def next_deadline(self) -> float | None:
        return min((c.deadline for c in self._by_id.values() if c.seq), default=None)

    def forget_quarantines(self, now: float) -> None:
        for key in [k for k, until in self._quarantined.items() if until <= now]:
            del self._quarantined[key]

    def _remove(self, member_id: str) -> Candidate:
        c = self._by_id.pop(member_id)
        for seq in (c.seq, c.earlier[0]):
            if seq:
                self._by_seq.pop(seq, None)
        self._held[c.introducer] -= 1
        if self._held[c.introducer] <= 0:
            del self._held[c.introducer]
        return c

    def _charge(self, introducer: str, delta: int) -> int:
        strikes = max(0, self._strikes.pop(introducer, 0) + delta)
        if strikes:
            self._strikes[introducer] = strikes
            while len(self._strikes) > _STRIKES_TRACKED:
                self._strikes.popitem(last=False)
        return strikes
