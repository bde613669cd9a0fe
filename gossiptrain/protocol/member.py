"""A member as gossiped, and the checks every entry from the wire passes.

A member entry is what every membership message carries: an id, the
address it answers at, its shard, its incarnation (raised only by the member
itself) and what the sender claims about it (alive, suspect, dead or left;
for a suspicion, who suspects). Everything that speaks of members (the
membership machine, joining, the coordinator, the end of a run) shares this
record, so it lives below all of them: it imports no protocol machine.

Entries from the wire are validated field by field (``Member.from_wire``);
anything malformed is a ``ProtocolError``, never a member.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Iterable

from gossiptrain.errors import ProtocolError
from gossiptrain.net.address_forms import is_client_address

ALIVE, SUSPECT, DEAD, LEFT = "alive", "suspect", "dead", "left"
_STATES = (ALIVE, SUSPECT, DEAD, LEFT)
_ID_RE = re.compile(r"^[A-Za-z0-9_.:-]{1,64}$")
_MAX_ADDR = 256
#: Members a report to the coordinator names as found dead, at most (the coordinator reads no more).
REPORTED_DEATHS = 16

#: The field types of a well-formed member entry (id, addr, shard, incarnation, state, by); a relay's has a
#: seventh, ``True`` (``Member.relay``), and everyone else's only these six.
_ENTRY_TYPES = [str, str, int, int, str, str]
_RELAY_ENTRY_TYPES = [*_ENTRY_TYPES, bool]
#: Entries already validated, by their exact fields (Member.from_wire); cleared when full.
_VALIDATED: dict[tuple[Any, ...], "Member"] = {}
_VALIDATED_MAX = 1 << 16


@dataclass(frozen=True)
class Member:
    """One member as gossiped: identity, where to reach it, its shard and what is claimed about it."""

    id: str
    addr: str
    shard: int
    incarnation: int  # raised only by the member itself: at every process start and to refute a suspicion
    state: str = ALIVE
    by: str = ""  # for a suspicion: the member that suspects (Lifeguard counts independent suspectors)
    relay: bool = False  # it passes messages between client-mode members (`gossiptrain peer --relay`), set by itself

    def to_wire(self) -> list[Any]:
        """The entry as sent: one list per member object, built once (members are immutable, and the same
        entry rides on many messages). Senders put it in bodies as is; nobody may modify it."""
        wire = self.__dict__.get("_wire")
        if wire is None:
            wire = [self.id, self.addr, self.shard, self.incarnation, self.state, self.by]
            if self.relay:
                wire.append(True)
            object.__setattr__(self, "_wire", wire)
        return wire

    @classmethod
    def from_wire(cls, raw: Any) -> "Member":
        """Validate one gossiped entry; anything malformed is a ProtocolError.

        The same entries arrive again and again (each member's is gossiped
        by all), so a valid one is remembered by its exact fields and
        returned (members are immutable) without checking it again: only
        when every field has exactly the type a valid entry has, so that
        no value that merely compares equal (True for 1, 1.0 for 1) can
        pass for a checked one.
        """
        if type(raw) is not list:
            return cls._checked(raw)
        try:
            key = tuple(raw)
            known = _VALIDATED.get(key)
        except TypeError:  # an unhashable field: malformed
            return cls._checked(raw)
        # A hit equals a valid entry field by field. Strings equal only strings, so only the numbers can be
        # something else that compares equal (True or 1.0 for 1): their types are checked, not the strings'.
        if known is not None and type(raw[2]) is int and type(raw[3]) is int and (len(raw) == 6 or raw[6] is True):
            return known
        if list(map(type, raw)) not in (_ENTRY_TYPES, _RELAY_ENTRY_TYPES):
            return cls._checked(raw)
        known = cls._checked(raw)
        if len(_VALIDATED) >= _VALIDATED_MAX:
            _VALIDATED.clear()
        _VALIDATED[key] = known
        return known

    @classmethod
    def _checked(cls, raw: Any) -> "Member":
        if not isinstance(raw, list) or len(raw) not in (6, 7):
            raise ProtocolError("member entry must be a list of 6 fields (7 for a relay)")
        mid, addr, shard, inc, state, by = raw[:6]
        relay = len(raw) == 7
        if relay and raw[6] is not True:
            raise ProtocolError(f"bad member relay flag {raw[6]!r:.40} (a relay's entry ends in true, others have 6 fields)")
        if not isinstance(mid, str) or not _ID_RE.match(mid):
            raise ProtocolError(f"bad member id {mid!r:.80}")
        if not isinstance(addr, str) or len(addr) > _MAX_ADDR or "://" not in addr:
            raise ProtocolError(f"bad member address {addr!r:.80}")
        for name, v in (("shard", shard), ("incarnation", inc)):
            if type(v) is not int or v < 0 or v >= 1 << 63:
                raise ProtocolError(f"bad member {name} {v!r:.40}")
        if state not in _STATES:
            raise ProtocolError(f"bad member state {state!r:.40}")
        if not isinstance(by, str) or (by and not _ID_RE.match(by)):
            raise ProtocolError(f"bad suspector id {by!r:.80}")
        if relay and is_client_address(addr):
            raise ProtocolError(f"a client-mode member cannot relay: {addr!r:.80}")
        return cls(mid, addr, shard, inc, state, by, relay)


def members_from_wire(raw: Any, limit: int) -> list[Member]:
    """A message's list of member entries, each validated; more than ``limit`` of them is a ProtocolError."""
    if not isinstance(raw, list):
        raise ProtocolError("members must be a list")
    if len(raw) > limit:
        raise ProtocolError(f"{len(raw)} members in one message, limit {limit}")
    return [Member.from_wire(r) for r in raw]


def least_loaded_shard(held: Iterable[int], shards: int) -> int:
    """The shard fewest live members train (lowest index on ties): a newcomer fills a gap first."""
    load = [0] * shards
    for s in held:
        if 0 <= s < shards:
            load[s] += 1
    return min(range(shards), key=lambda s: (load[s], s))
