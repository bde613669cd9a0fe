"""The member table: what we hold of every member, ourselves included, and the indexes kept in step with it.

SWIM's view, memberlist's node map. Here a claim about a member is only
recorded: which claim wins is the merge's rule (``merge``), when a suspect
dies the suspicion timer's (``suspicion``). Every change goes through
``add``, ``set`` or ``amend``, so that the indexes kept beside the records
never drift from them:

- by address: the ids seen at each address (one address, one live member:
  a process answering there under a new id replaces the old one);
- the live ids, sorted, and ``alive()``'s sorted members: a node's view is
  asked for at each of the n^2 membership events of a swarm's start, and
  sorting each time made that n^3 log n;
- the ids held dead (now and then one is sent its verdict, in case it is
  alive behind a healed partition), and those of them we were only told of
  (hearsay: a tombstone of a member we never knew, kept so that stale news
  of it cannot bring it in, but never probed: its address is someone
  else's word);
- the suspects (their timers run) and a welcome's placeholders not started
  yet (their grace runs);
- how many started live members there are: who could confirm a suspicion.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Iterable

from gossiptrain.net.address_forms import is_client_address
from gossiptrain.protocol.member import ALIVE, DEAD, LEFT, SUSPECT, Member


@dataclass(slots=True)
class Record:
    """What we hold of one member other than ourselves.

    A view holds one for every member (n^2 in a swarm): slots, and no set of its own until someone suspects it
    (``suspectors`` is replaced, never changed in place).
    """

    member: Member
    changed_at: float  # local time of the last state change (tombstones are forgotten from it)
    suspectors: frozenset[str] = frozenset()  # independent members that suspect it (this incarnation)
    rtt: tuple[float, float] | None = None  # smoothed round trip of our direct probes of it, and its variation


class View:
    """Ourselves (``me``) and a record per other member we know of, with the indexes kept from them."""

    def __init__(self, me: Member) -> None:
        self.me = me
        self._records: dict[str, Record] = {}
        self._by_addr: dict[str, dict[str, None]] = {}  # address -> ids seen there (ordered: runs repeat); see at_addr
        self._version = 0  # one more at every change of _records (see _index), for alive()'s cache
        self._alive_cache: tuple[int, Member, list[Member]] | None = None
        self._live_version = 0  # one more whenever a record becomes live or stops being live (for alive_ids)
        self._live_sorted: list[str] = []  # the ids of the live records (alive or suspect), sorted
        self._dead_ids: dict[str, None] = {}  # the ids of the records held dead (kept by _index), in order
        self._gone: dict[str, None] = {}  # the ids of the records held dead or left (kept by _index): the tombstones
        self._alive_ids_cache: tuple[tuple[int, str | None], tuple[str, ...]] | None = None
        self._hearsay: set[str] = set()  # tombstones of members we never knew (bounded by the merge)
        self._suspects: set[str] = set()  # whose suspicion timers run
        self._newcomers: set[str] = set()  # a welcome's placeholders (incarnation 0) not started yet
        self._started = 0  # live records at an incarnation > 0 (kept by _index): who could confirm a suspicion
        self._live_clients = 0  # live records at a client-mode address (behind NAT; kept by _index)

    # -- reading ---------------------------------------------------------------------------

    def __len__(self) -> int:
        """How many members we hold records of (not counting ourselves)."""
        return len(self._records)

    def __contains__(self, member_id: str) -> bool:
        return member_id in self._records

    def record(self, member_id: str) -> Record | None:
        return self._records.get(member_id)

    def records(self) -> Iterable[Record]:
        return self._records.values()

    def get(self, member_id: str) -> Member | None:
        if member_id == self.me.id:
            return self.me
        rec = self._records.get(member_id)
        return rec.member if rec else None

    def rtt(self, member_id: str | None) -> tuple[float, float] | None:
        """The smoothed round trip of our probes of ``member_id`` and its variation; None if never measured."""
        rec = self._records.get(member_id) if member_id is not None else None
        return rec.rtt if rec is not None else None

    def alive(self) -> list[Member]:
        """Live members including ourselves (suspects too: not dead yet), sorted by id; kept sorted between changes."""
        if self._alive_cache is None or self._alive_cache[0] != self._version or self._alive_cache[1] is not self.me:
            out = [r.member for r in self._records.values() if r.member.state in (ALIVE, SUSPECT)]
            if self.me.state == ALIVE:
                out.append(self.me)
            self._alive_cache = (self._version, self.me, sorted(out, key=lambda m: m.id))
        return list(self._alive_cache[2])

    def alive_ids(self) -> tuple[str, ...]:
        """The ids of ``alive()``: recomputed only when who is live changes; the ids of live records are kept sorted as
        they change (``_index``), so an answer is a copy, not a scan and a sort."""
        key = (self._live_version, self.me.id if self.me.state == ALIVE else None)
        if self._alive_ids_cache is None or self._alive_ids_cache[0] != key:
            ids = self._live_sorted
            if key[1] is not None:
                ids = ids.copy()
                _insert_sorted(ids, key[1])
            self._alive_ids_cache = (key, tuple(ids))
        return self._alive_ids_cache[1]

    def at_addr(self, addr: str) -> list[Record]:
        """The records whose member is at ``addr`` now (the index may hold ids that moved or were forgotten)."""
        out = []
        for mid in self._by_addr.get(addr, ()):
            rec = self._records.get(mid)
            if rec is not None and rec.member.addr == addr:
                out.append(rec)
        return out

    def known_dead(self) -> list[Member]:
        """The members held dead that we knew ourselves: a tombstone we were told of names an address someone else chose."""
        return [self._records[mid].member for mid in self._dead_ids if mid not in self._hearsay]

    def suspected(self) -> list[Record]:
        """The records held suspect: their suspicion timers run."""
        return [self._records[mid] for mid in self._suspects]

    def suspect_ids(self) -> list[str]:
        return sorted(self._suspects)

    def has_suspects(self) -> bool:
        return bool(self._suspects)

    def live_clients(self) -> int:
        """How many live members (not counting ourselves) are client-mode members, which not everyone can send to."""
        return self._live_clients

    def placeholders(self) -> list[Record]:
        """The records of a welcome's placeholders (incarnation 0) whose members have not started yet: their grace runs."""
        return [self._records[mid] for mid in self._newcomers]

    def placeholder_count(self) -> int:
        return len(self._newcomers)

    def hearsay(self) -> int:
        """How many tombstones of members we never knew we hold."""
        return len(self._hearsay)

    def confirmers(self) -> int:
        """Members that could confirm a suspicion: the started live ones, us included, less the suspect and the first suspector."""
        return self._started + 1 - 2

    def alive_count_is_one(self) -> bool:
        """Exactly one record alive (stops at the second: a large view costs no more than a small one)."""
        alive = 0
        for r in self._records.values():
            if r.member.state == ALIVE:
                alive += 1
                if alive > 1:
                    return False
        return alive == 1

    def digest(self, to: str = "", tombstones: bool = True) -> tuple[Member, ...]:
        """Our full view, with what we know of the departed; the recipient always hears its own verdict.

        Without ``tombstones`` (sent to a member we hold dead, which may be
        alive behind a healed partition): only the living and the recipient's
        own verdict, so that it refutes without condemning its own side.
        """
        out = [self.me] + [r.member for r in self._records.values() if tombstones or r.member.state != DEAD or r.member.id == to]
        return tuple(out)

    # -- changing --------------------------------------------------------------------------

    def add(self, member: Member, now: float, *, hearsay: bool = False, placeholder: bool = False) -> Record:
        """A record for a member we hold none of; ``hearsay``: a tombstone of a member we never knew; ``placeholder``:
        our own welcome's entry for a newcomer that has not started yet."""
        rec = Record(member, now)
        self._records[member.id] = rec
        self._index(member)
        if hearsay:
            self._hearsay.add(member.id)
        if placeholder:
            self._newcomers.add(member.id)
        return rec

    def vouch(self, member_id: str) -> None:
        """``member_id`` answered our own probe: whatever we were told of it, we know it now."""
        self._hearsay.discard(member_id)

    def set(self, rec: Record, member: Member, now: float) -> None:
        """Record a new claim about a member, keeping the suspect index in step."""
        if member.state != SUSPECT or member.incarnation != rec.member.incarnation or rec.member.state != SUSPECT:
            rec.suspectors = frozenset()
        self._index(member, rec.member)
        rec.member = member
        rec.changed_at = now
        if member.state == SUSPECT:
            self._suspects.add(member.id)
        else:
            self._suspects.discard(member.id)
        if member.state == ALIVE and member.incarnation == 0:
            self._newcomers.add(member.id)
        else:
            self._newcomers.discard(member.id)

    def amend(self, rec: Record, member: Member) -> None:
        """Replace the claim without a change of state: its timers and suspectors stay as they are."""
        self._index(member, rec.member)
        rec.member = member

    def forget_tombstones(self, now: float, forget_after: float) -> list[str]:
        """Drop the dead and departed whose verdict is older than ``forget_after`` seconds; returns their ids."""
        forgotten = []
        for mid in list(self._gone):  # not every record: a sweep of a view of n members was n^2 a swarm's period
            rec = self._records[mid]
            if now - rec.changed_at > forget_after:
                del self._records[mid]
                self._dead_ids.pop(mid, None)
                del self._gone[mid]
                self._version += 1  # (a dead or left record: who is live is unchanged)
                self._by_addr.get(rec.member.addr, {}).pop(mid, None)
                if not self._by_addr.get(rec.member.addr, True):
                    del self._by_addr[rec.member.addr]
                self._hearsay.discard(mid)
                forgotten.append(mid)
        return forgotten

    def _index(self, member: Member, old: Member | None = None) -> None:
        """Called wherever a record is added (``old`` None) or its member changes from ``old``: notes where
        ``member`` is, for ``at_addr`` (every record's current address is always in the index), and that
        ``alive()`` (and, if liveness changed, ``alive_ids()``) must be computed again."""
        self._by_addr.setdefault(member.addr, {})[member.id] = None
        self._version += 1
        self._started += _is_started(member) - (old is not None and _is_started(old))
        self._live_clients += _is_live_client(member) - (old is not None and _is_live_client(old))
        if member.state == DEAD:
            self._dead_ids[member.id] = None
        elif old is not None and old.state == DEAD:
            self._dead_ids.pop(member.id, None)
        if member.state in (DEAD, LEFT):
            self._gone[member.id] = None
        elif old is not None and old.state in (DEAD, LEFT):
            del self._gone[member.id]
        live = member.state in (ALIVE, SUSPECT)
        if live != (old is not None and old.state in (ALIVE, SUSPECT)):
            self._live_version += 1
            if live:
                _insert_sorted(self._live_sorted, member.id)
            else:
                _remove_sorted(self._live_sorted, member.id)


def _is_started(m: Member) -> bool:
    """A live member past its welcome's placeholder: one that probes and could confirm a suspicion."""
    return m.state in (ALIVE, SUSPECT) and m.incarnation > 0


def _is_live_client(m: Member) -> bool:
    return m.state in (ALIVE, SUSPECT) and is_client_address(m.addr)


def _insert_sorted(ids: list[str], mid: str) -> None:
    """Insert ``mid`` into the sorted ``ids`` unless it is there."""
    i = bisect.bisect_left(ids, mid)
    if i == len(ids) or ids[i] != mid:
        ids.insert(i, mid)


def _remove_sorted(ids: list[str], mid: str) -> None:
    """Remove ``mid`` from the sorted ``ids`` if it is there."""
    i = bisect.bisect_left(ids, mid)
    if i < len(ids) and ids[i] == mid:
        del ids[i]
