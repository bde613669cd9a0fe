"""Who is alive: a sans-IO SWIM membership state machine with Lifeguard's refinements.

Failure detection (SWIM, Das et al. 2002): every protocol period a member
probes one other, going round a shuffled list so that each member is probed
by everyone within a bounded number of periods. A probe is a ``ping`` that
must be ``ack``-ed within a timeout derived from measured round-trip times;
failing that, ``indirect_probes`` other members are asked (``ping-req``) to
ping the target for us, so that one lossy link cannot condemn a member. A
probe that nobody answered makes the target a *suspect*.

Suspicion, refuted or confirmed (SWIM + Lifeguard, Dadgar et al. 2018): the
suspicion spreads; the suspect, on hearing it, refutes it by raising its
incarnation number, which outranks the suspicion everywhere. Every member
runs its own suspicion timer: it starts long (a lone suspector may be the
one in trouble) and shrinks towards ``suspicion_timeout(n)`` as independent
members report the same suspicion, reaching it at ``suspicion_confirmations``
of them, or at as many as could confirm at all (in a swarm of 3, the one other
survivor: without that cap a small swarm's real deaths waited most of the
maximum). The members asked to help with a failed probe hear the suspicion at
once, so their confirmations come within a period. When the timer runs out
the member is declared dead. A member that keeps failing probes or has to
refute raises its local health multiplier, which stretches its own periods
and timeouts instead of letting it accuse healthy members.

Dissemination: updates (joins, suspicions, refutations, leaves) ride
piggybacked on probe messages, each a bounded number of times; now and then
two members exchange their full views (``sync``, anti-entropy), which is
also how a newcomer learns the swarm at once. A welcome's placeholder for a
newcomer (incarnation 0) is not probed while the newcomer builds its model,
and is dropped ``newcomer_grace`` seconds later if the newcomer never spoke
for itself (it died starting). A death verdict spreads too
(SWIM's confirm) and is remembered as a tombstone, so that stale news
cannot resurrect the member, not even at a member that never knew it; a
member wrongly declared dead (a healed partition, a paused process) hears
its verdict and refutes it with a higher incarnation.

Nothing is taken on trust (SECURITY.md, "Lying members"): a member heard
of is a candidate until it answers a nonce probe at the address claimed
(``gossiptrain.protocol.candidates``), or, if it pinged us, echoes the
nonce our ack to it carried (``_challenge``); gossip never moves a live member nor
raises its incarnation far; suspicions and deaths come only from live
members, a bounded number per period, and a death told of a member that
answered our own probe lately is only a suspicion. In a secure swarm an id
must be the one its address's key derives (``id_of``).

The machine never touches a socket or a clock: ``handle(event, now)`` returns
actions for its driver (the asyncio peer node, or the simulator) to carry
out, and ``next_timer()`` says when it next wants a ``Tick``.
"""

from __future__ import annotations

import bisect
import dataclasses
import math
import random
import re
import statistics
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Sequence

from gossiptrain.config import MembershipConfig
from gossiptrain.errors import ProtocolError
from gossiptrain.net.address_forms import is_client_address
from gossiptrain.net.kinds import ACK, GOSSIP, LEAVE, PING, PING_REQ, SYNC
from gossiptrain.protocol.candidates import Candidate, Candidates
from gossiptrain.protocol.rtt import MinRtt, smoothed

ALIVE, SUSPECT, DEAD, LEFT = "alive", "suspect", "dead", "left"
_STATES = (ALIVE, SUSPECT, DEAD, LEFT)
_ID_RE = re.compile(r"^[A-Za-z0-9_.:-]{1,64}$")
_MAX_ADDR = 256
_MAX_RELAYS = 64  # indirect probes we run for others at once; more are refused (bounded state)
# How far gossip from others may raise a member's incarnation: refutations raise it by one, so honest
# news never jumps far; a larger claim (a restart, a lie) is believed only from the member's own answer.
_INCARNATION_GAP = 1 << 16
_CANDIDATE_ATTEMPTS = 2  # probes a candidate gets before it is dropped as never answering
#: Members a report to the coordinator names as found dead, at most (the coordinator reads no more).
REPORTED_DEATHS = 16
#: About how many members send their whole view to a member they hold dead, per probe_dead_every periods.
DEAD_VIEW_SENDERS = 4
#: A probe's verdict is due by this share of its period; the rest is slack before the next probe starts.
PROBE_SHARE = 0.9
#: A measured timeout is at most this many protocol periods (``heartbeat_interval``): a member that answers
#: late on purpose stretches the probes of itself, and of others only this far.
MAX_RTO_PERIODS = 4
#: The swarm's timeout is the median of the last this many members' (``Membership._rto``): one slow member
#: stretches the probes of itself, not everyone's.
RTO_SAMPLES = 16
#: Placeholders of members we welcomed that have not started yet, at most (see ``Membership._welcome``).
MAX_PLACEHOLDERS = 16
#: The introducer our own welcomes' deferred newcomers are charged to in the candidate table.
WELCOMED_INTRODUCER = "welcomed by us"


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
        if type(raw) is list and list(map(type, raw)) in (_ENTRY_TYPES, _RELAY_ENTRY_TYPES):
            key = tuple(raw)
            known = _VALIDATED.get(key)
            if known is None:
                known = cls._checked(raw)
                if len(_VALIDATED) >= _VALIDATED_MAX:
                    _VALIDATED.clear()
                _VALIDATED[key] = known
            return known
        return cls._checked(raw)

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


def _anyone(address: str) -> bool:
    return True


def members_from_wire(raw: Any, limit: int) -> list[Member]:
    if not isinstance(raw, list):
        raise ProtocolError("members must be a list")
    if len(raw) > limit:
        raise ProtocolError(f"{len(raw)} members in one message, limit {limit}")
    return [Member.from_wire(r) for r in raw]


# -- events ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Tick:
    """Time has passed (at least until ``next_timer()``): start a period, time out probes and suspicions."""


@dataclass(frozen=True)
class Digest:
    """Entries received outside a probe: gossip, a full view (``reply``: send ours back), a welcome, a leave."""

    entries: Sequence[Member]
    sender: str = ""  # member id of the sender; empty for the coordinator or a welcome
    reply_to: str = ""  # the sender's address, where a full view (``reply``) or a refutation hint goes
    reply: bool = False
    source: str = ""  # the network source it came from (an IP), where the transport can tell: who introduced what


@dataclass(frozen=True)
class Welcomed:
    """We welcomed ``member`` ourselves: its placeholder (incarnation 0) is a member at once, not a candidate."""

    member: Member


@dataclass(frozen=True)
class Ping:
    """A direct probe of us (from a prober, or from a relay probing for someone else): answer with an ack."""

    sender: str
    reply_to: str
    seq: int
    entries: Sequence[Member] = ()
    source: str = ""


@dataclass(frozen=True)
class PingReq:
    """Somebody's direct probe of ``target`` failed: probe it for them and pass the ack back."""

    sender: str
    reply_to: str
    seq: int
    target: str
    target_addr: str
    entries: Sequence[Member] = ()
    source: str = ""


@dataclass(frozen=True)
class Ack:
    """The answer to one of our pings (direct, or relayed from an indirect probe).

    ``challenge``: the pinged member had us as a candidate and asks us to echo this nonce back in an ack of
    our own, which verifies us there in one message instead of a probe and its answer (see ``_challenge``).
    """

    sender: str
    seq: int
    entries: Sequence[Member] = ()
    source: str = ""
    challenge: int = 0


@dataclass(frozen=True)
class Leave:
    """We are leaving: announce it to everyone we know."""


Event = Tick | Digest | Ping | PingReq | Ack | Leave | Welcomed

# -- actions -----------------------------------------------------------------------------



@dataclass(frozen=True)
class Send:
    """Send ``entries`` to the member at ``addr`` as a message of ``kind``, with the probe fields it needs."""

    addr: str
    kind: str
    entries: tuple[Member, ...]
    seq: int = 0  # ping, ping-req, ack
    target: str = ""  # ping-req: the member to probe
    target_addr: str = ""
    challenge: int = 0  # ack: a nonce for the pinger to echo, verifying it as our candidate (``Ack.challenge``)


@dataclass(frozen=True)
class MemberUp:
    member: Member
    rejoined: bool = False  # we had it dead or gone: a restart, or a refuted verdict


@dataclass(frozen=True)
class MemberDown:
    member: Member
    reason: str  # "dead" (suspected and never refuted, or welcomed and never started) or "left" (announced)
    suspectors: tuple[str, ...] = ()  # for a death: the members whose suspicions we had heard (us included), sorted


@dataclass(frozen=True)
class Suspected:
    """We now suspect ``member`` (from our own probe or from gossip); it stays in the view until declared dead."""

    member: Member


Action = Send | MemberUp | MemberDown | Suspected


@dataclass
class _Record:
    member: Member
    changed_at: float  # local time of the last state change (tombstones are forgotten from it)
    suspectors: set[str] = field(default_factory=set)  # independent members that suspect it (this incarnation)
    rtt: tuple[float, float] | None = None  # smoothed round trip of our direct probes of it, and its variation


@dataclass
class _Probe:
    """Our probe of one member in this period."""

    target: str
    seq: int
    sent_at: float
    direct_deadline: float  # then ask others (ping-req)
    deadline: float  # then suspect it
    indirect_sent: bool = False
    acked: bool = False
    helpers: tuple[str, ...] = ()  # addresses of the members asked to probe it for us (ping-req)
    helper_ids: tuple[str, ...] = ()  # and their ids: only they may pass an ack on


@dataclass
class _Relay:
    """An indirect probe we run for ``origin``: pass the target's ack back under the origin's seq."""

    origin_addr: str
    origin_seq: int
    expires: float
    target: str  # the member probed: only its own ack is passed back


@dataclass
class HealthStats:
    """What the failure detector did, for metrics lines and tests."""

    probes: int = 0
    probes_failed: int = 0  # neither a direct nor an indirect ack in time
    indirect_probes: int = 0  # probes that needed ping-req
    suspicions: int = 0  # members we came to suspect (own probes and gossip)
    refutations: int = 0  # times we had to refute a suspicion of ourselves
    acks_from_others: int = 0  # acks to our probes from a member other than the one probed: ignored
    redirects_refused: int = 0  # a live member claimed at another address: refused (only its own answer moves it)
    jumps_refused: int = 0  # an incarnation raised far by someone else's gossip: refused (only its owner raises it)
    verdicts_refused: int = 0  # suspicions and deaths told by strangers, or past one member's share of a period
    verdicts_doubted: int = 0  # a death told of a member that answers our own probes: taken as a suspicion
    hearsay_refused: int = 0  # tombstones of members we never knew, past the bound we keep
    forged_ids_refused: int = 0  # secure swarm: an id claimed at an address whose key does not derive it
    placeholders_deferred: int = 0  # newcomers we welcomed past MAX_PLACEHOLDERS: candidates, not members, until they start

    def to_dict(self) -> dict[str, int]:
        return dict(self.__dict__)


class Membership:
    """The membership view of one member. Feed it events; carry out the actions it returns."""

    def __init__(
        self,
        me: Member,
        config: MembershipConfig,
        rng: random.Random,
        candidates: int = 128,
        nonces: random.Random | None = None,
        id_of: Callable[[str], str | None] | None = None,
        can_reach: Callable[[str], bool] | None = None,
    ) -> None:
        """``candidates``: members heard of but not verified yet that we hold at once (``limits.candidates``).

        ``nonces`` draws the probe sequence numbers, which prove that an ack
        came from whoever got the probe: a real peer passes an OS-seeded
        generator (a ``--seed`` must not make them guessable); by default
        ``rng`` (the simulator's runs repeat exactly).

        ``id_of`` (a secure swarm): the member id an address entitles its
        holder to; a claim of any other id at that address is refused.

        ``can_reach``: whether a message to an address can leave now (the
        transport's ``can_reach``). A client-mode member (behind NAT) can be
        reached only by members it has sent to; the others neither probe it
        nor ask it to probe, so it is never suspected for what nobody could
        send it, and its liveness is judged by those it talks to.
        """
        self.me = me
        self.config = config
        self.stats = HealthStats()
        self._rng = rng
        self._nonces = nonces or rng
        self._id_of = id_of
        self._can_reach = can_reach or _anyone
        self._records: dict[str, _Record] = {}
        self._by_addr: dict[str, dict[str, None]] = {}  # address -> ids seen there (ordered: runs repeat); see _at_addr
        self._version = 0  # one more at every change of _records (see _index), for alive()'s cache
        self._alive_cache: tuple[int, Member, list[Member]] | None = None
        self._live_version = 0  # one more whenever a record becomes live or stops being live (for alive_ids)
        self._live_sorted: list[str] = []  # the ids of the live records (alive or suspect), sorted
        self._dead_ids: dict[str, None] = {}  # the ids of the records held dead (kept by _index), in order
        self._alive_ids_cache: tuple[tuple[int, str | None], tuple[str, ...]] | None = None
        forget_after = config.tombstone_rounds * config.heartbeat_interval
        self.candidates = Candidates(candidates, max(1, candidates // 4), quarantine_for=forget_after)
        self._candidate_budget = config.candidate_probes  # candidate probes left this period
        self._hearsay: set[str] = set()  # tombstones of members we never knew (bounded: 4 x candidates)
        self._last_ack: dict[str, float] = {}  # member id -> when it last answered our own probe (evidence of life)
        self._verdicts: dict[str, int] = {}  # sender -> suspicions and deaths taken from it this period
        self._suspects: set[str] = set()
        self._newcomers: set[str] = set()  # a welcome's placeholders (incarnation 0) not started yet
        self._started = 0  # live records at an incarnation > 0 (kept by _index): who could confirm a suspicion
        self._rounds = 0
        self._next_period: float | None = None  # set by the first tick
        self._next_sync = 0.0
        self._sync_gap = 0.0  # doubles from one period to config.sync_interval: a newcomer swaps views often at first
        self._probe: _Probe | None = None
        self._unanswered: _Probe | None = None  # the last probe concluded without an answer: a late one is measured
        self._probe_order: list[str] = []
        self._relays: dict[int, _Relay] = {}
        self._broadcasts: deque[list[Any]] = deque()  # [entry, transmits left], fresh first
        self._queued: dict[str, list[Any]] = {}  # member id -> its item in _broadcasts
        self._hinted: dict[str, float] = {}  # member id -> when we last told it what we think of it
        self.health = 0  # Lifeguard's local health multiplier, 0 (healthy) .. config.max_health
        self._rtos: deque[float] = deque(maxlen=RTO_SAMPLES)  # timeouts of the last members measured (_rto)
        self._median_rto: float | None = None  # their median
        # The shortest direct probe round trip lately: the link's latency (averaging keeps more exchanges in flight
        # on a far link: PairwiseAveraging.concurrency)
        self.min_rtt = MinRtt()

    # -- queries ---------------------------------------------------------------------------

    def trust_stats(self) -> dict[str, int]:
        """What gossip we did not believe (counters), and how many candidates wait now."""
        s, c = self.stats, self.candidates.stats
        refused = s.redirects_refused + s.jumps_refused + s.verdicts_refused + s.hearsay_refused + s.forged_ids_refused
        return {
            **c.to_dict(),
            **{k: v for k, v in s.to_dict().items() if k.endswith(("_refused", "_doubted", "_deferred"))},
            "candidates": len(self.candidates),
            "gossip_refused": refused + c.candidates_refused + c.candidates_unanswered,
        }

    def alive(self) -> list[Member]:
        """Live members including ourselves (suspects too: not dead yet), sorted by id (the order topologies index).

        Kept sorted between changes: with n members every one of the n^2
        membership events of a swarm's start asks for it (a node's view is
        rebuilt at each), and sorting each time made that n^3 log n.
        """
        if self._alive_cache is None or self._alive_cache[0] != self._version or self._alive_cache[1] is not self.me:
            out = [r.member for r in self._records.values() if r.member.state in (ALIVE, SUSPECT)]
            if self.me.state == ALIVE:
                out.append(self.me)
            self._alive_cache = (self._version, self.me, sorted(out, key=lambda m: m.id))
        return list(self._alive_cache[2])

    def alive_ids(self) -> tuple[str, ...]:
        """The ids of ``alive()``, sorted: recomputed only when who is live changes, not at every refreshed claim.

        A node's view is this; with n members it is asked for at each of the
        n^2 membership events of a swarm's start. The ids of live records are
        kept sorted as they change (``_index``), so an answer is a copy, not a
        scan and a sort.
        """
        key = (self._live_version, self.me.id if self.me.state == ALIVE else None)
        if self._alive_ids_cache is None or self._alive_ids_cache[0] != key:
            ids = self._live_sorted
            if key[1] is not None:
                ids = ids.copy()
                _insert_sorted(ids, key[1])
            self._alive_ids_cache = (key, tuple(ids))
        return self._alive_ids_cache[1]

    def get(self, member_id: str) -> Member | None:
        if member_id == self.me.id:
            return self.me
        rec = self._records.get(member_id)
        return rec.member if rec else None

    def is_alive(self, member_id: str) -> bool:
        m = self.get(member_id)
        return m is not None and m.state in (ALIVE, SUSPECT)

    def suspects(self) -> list[str]:
        return sorted(self._suspects)

    def sample(self, k: int) -> list[Member]:
        """Up to ``k`` live members, ourselves always included (a newcomer's seed list)."""
        others = [m for m in self.alive() if m.id != self.me.id]
        picked = self._rng.sample(others, min(k - 1, len(others))) if k > 1 else []
        return [self.me, *picked]

    def free_shard(self, shards: int) -> int:
        return least_loaded_shard((m.shard for m in self.alive()), shards)

    def period(self) -> float:
        """The protocol period now: ``heartbeat_interval``, or what the measured round trips need, if longer.

        A probe's verdict takes its direct timeout, then indirect probes'
        two legs (to a helper, and the helper's to the target), all within
        ``PROBE_SHARE`` of a period: three probe timeouts. On a far link
        (150 ms one way) half a period of 0.5 s was shorter than a round
        trip, so every probe went indirect and every lost message made a
        suspicion (``tests/test_membership.py``). Stretched by our local
        health multiplier when we are struggling.
        """
        rto = self._rto(None)
        needed = 0.0 if rto is None else 3 * max(rto, self.config.min_probe_timeout) / PROBE_SHARE
        return max(self.config.heartbeat_interval, needed) * (1 + self.health)

    def probe_timeout(self, member_id: str | None = None) -> float:
        """How long a direct ping may take: the measured RTT plus four deviations (as TCP), at least twice the RTT.

        ``member_id``'s own round trips where we measured them (a swarm may
        mix near and far members), else the median timeout of the last
        members measured; before any measurement, half a period. Stretched
        by the health multiplier.
        """
        c = self.config
        rto = self._rto(member_id)
        if rto is None:
            rto = c.heartbeat_interval / 2
        return max(rto, c.min_probe_timeout) * (1 + self.health)

    def _rto(self, member_id: str | None) -> float | None:
        """RFC 6298's timeout from ``member_id``'s round trips; for None or a member never measured, the median of
        the last ``RTO_SAMPLES`` members measured; None before any measurement."""
        rec = self._records.get(member_id) if member_id is not None else None
        if rec is not None and rec.rtt is not None:
            return self._rto_of(rec.rtt)
        return self._median_rto

    def _rto_of(self, estimate: tuple[float, float]) -> float:
        """The timeout of a smoothed round trip and its variation, at least twice the round trip (as TCP's), at most
        ``MAX_RTO_PERIODS`` protocol periods: a member that answers late on purpose gets no further."""
        srtt, rttvar = estimate
        return min(srtt + max(4 * rttvar, srtt), MAX_RTO_PERIODS * self.config.heartbeat_interval)

    def _probe_span(self, member_id: str, period: float) -> float:
        """Seconds from a probe of ``member_id`` to its verdict: its direct timeout, then the two legs of the
        indirect probes; never under ``PROBE_SHARE`` of ``period``."""
        if self._rto(member_id) is None:
            return PROBE_SHARE * period
        return max(PROBE_SHARE * period, 2 * self.probe_timeout(member_id) + self.probe_timeout())

    def _stretch(self) -> float:
        """How many nominal periods one takes now for the round trips (1 on a near link): suspicions, which wait for
        refutations to travel, wait that much longer."""
        return self.period() / (1 + self.health) / self.config.heartbeat_interval

    def next_timer(self) -> float:
        """The latest local time at which the machine needs its next ``Tick``."""
        if self._next_period is None:
            return 0.0
        times = [self._next_period]
        p = self._probe
        if p is not None and not p.acked:
            times.append(p.deadline if p.indirect_sent else p.direct_deadline)
        confirmers = self._confirmers() if self._suspects else 0
        for mid in self._suspects:
            rec = self._records[mid]
            times.append(rec.changed_at + self._suspicion_timeout(rec, confirmers))
        for mid in self._newcomers:
            times.append(self._records[mid].changed_at + self.config.newcomer_grace)
        due = self.candidates.next_deadline()
        if due is not None:
            times.append(due)
        return min(times)

    # -- the state machine -----------------------------------------------------------------

    def handle(self, event: Event, now: float) -> list[Action]:
        if isinstance(event, Tick):
            return self._tick(now)
        actions: list[Action] = []
        if isinstance(event, Welcomed):
            self._welcome(event.member, now, actions)
        elif isinstance(event, Ping):
            self._merge(event.entries, now, actions, event.sender, event.source)
            challenge = self._challenge(event, now)
            actions.append(Send(event.reply_to, ACK, self._piggyback(event.sender), seq=event.seq, challenge=challenge))
        elif isinstance(event, PingReq):
            self._merge(event.entries, now, actions, event.sender, event.source)
            self._relay(event, now, actions)
        elif isinstance(event, Ack):
            self._on_ack(event, now, actions)  # first: a candidate it verifies is then a member the entries may name
            self._merge(event.entries, now, actions, event.sender, event.source)
        elif isinstance(event, Digest):
            self._merge(event.entries, now, actions, event.sender, event.source)
            if event.reply:
                self._send_view(event.sender, actions)
        elif isinstance(event, Leave):
            return self._leave()
        else:
            raise TypeError(f"unknown event {event!r}")
        if isinstance(event, (Digest, PingReq)) and event.sender:
            self._hint(event.sender, now, actions)  # a ping's ack already carries the hint
        self._probe_candidates(now, actions)
        return actions

    def _tick(self, now: float) -> list[Action]:
        actions: list[Action] = []
        if self.me.state != ALIVE:
            return actions
        if self._next_period is None:  # first tick: a newcomer swaps views with someone at once
            self._next_period = now
            self._next_sync = now
            self._sync_gap = self.config.heartbeat_interval
        self._expire(now, actions)
        self._expire_candidates(now, actions)
        p = self._probe
        if p is not None and (p.acked or now >= p.deadline):
            self._conclude(p, now, actions)
        elif p is not None and not p.indirect_sent and now >= p.direct_deadline:
            self._ask_others(p, now, actions)
        if now >= self._next_period:
            self._start_period(now, actions)
        self._probe_candidates(now, actions)
        return actions

    # -- probing ---------------------------------------------------------------------------

    def _start_period(self, now: float, actions: list[Action]) -> None:
        self._rounds += 1
        self._candidate_budget = self.config.candidate_probes
        self._verdicts.clear()
        period = self.period()
        self._next_period = now + period * self._rng.uniform(0.9, 1.1)
        if self._probe is not None:
            self._conclude(self._probe, now, actions)
        target = self._next_target()
        if target is not None:
            seq = self._nonce()
            deadline = now + self._probe_span(target.id, period)
            self._next_period = max(self._next_period, deadline)  # a far member's probe ends before the next starts
            self._probe = _Probe(target.id, seq, now, now + self.probe_timeout(target.id), deadline=deadline)
            self.stats.probes += 1
            actions.append(Send(target.addr, PING, self._piggyback(target.id), seq=seq))
        if now >= self._next_sync:
            # Swarms start together: the first views swapped are partial, so swap again soon, then less often.
            self._sync_gap = min(2 * self._sync_gap, self.config.sync_interval)
            self._next_sync = now + self._sync_gap
            others = [m for m in self.alive() if m.id != self.me.id and self._can_reach(m.addr)]
            if others:
                peer = self._rng.choice(others)
                actions.append(Send(peer.addr, SYNC, self._digest(peer.id)))
        # Only members we knew ourselves: a tombstone we were told of names an address someone else chose.
        dead = [] if self._rounds % self.config.probe_dead_every else [
            self._records[mid].member for mid in self._dead_ids if mid not in self._hearsay
        ]
        if dead:
            # A member we think dead may be alive behind a healed partition: its own tombstone makes it
            # refute, and a view lets both sides find each other again. Each member sends its whole view
            # with a chance that makes about DEAD_VIEW_SENDERS views reach the dead member per round, not
            # one from every member (at 1,000 members a crash cost 1,000 views every probe_dead_every).
            gone = self._rng.choice(dead)
            if self._rng.random() * max(1, len(self.alive_ids())) < DEAD_VIEW_SENDERS:
                actions.append(Send(gone.addr, GOSSIP, self._digest(gone.id, tombstones=False)))
            else:
                actions.append(Send(gone.addr, GOSSIP, (self.me, gone)))

    def _next_target(self) -> Member | None:
        """Round robin over a shuffled list (SWIM's bounded detection time), reshuffled when used up.

        Members at incarnation 0 are a welcome's placeholders, not started
        yet: they are not probed (see ``_expire``).
        """
        for _ in range(2):  # what is left of this round, then a fresh one
            while self._probe_order:
                m = self.get(self._probe_order.pop())
                if m is not None and m.state in (ALIVE, SUSPECT) and m.id != self.me.id and m.incarnation > 0 \
                        and self._can_reach(m.addr):
                    return m
            self._probe_order = [m.id for m in self.alive() if m.id != self.me.id and m.incarnation > 0]
            self._rng.shuffle(self._probe_order)
        return None

    def _ask_others(self, p: _Probe, now: float, actions: list[Action]) -> None:
        p.indirect_sent = True
        target = self.get(p.target)
        helpers = [
            m for m in self.alive() if m.id not in (self.me.id, p.target) and m.state == ALIVE and self._can_reach(m.addr)
        ]
        if target is None or not helpers:
            return
        self.stats.indirect_probes += 1
        asked = self._rng.sample(helpers, min(self.config.indirect_probes, len(helpers)))
        p.helpers = tuple(h.addr for h in asked)
        p.helper_ids = tuple(h.id for h in asked)
        for h in asked:
            actions.append(
                Send(h.addr, PING_REQ, self._piggyback(h.id), seq=p.seq, target=target.id, target_addr=target.addr)
            )

    def _conclude(self, p: _Probe, now: float, actions: list[Action]) -> None:
        """The probe's time is up: an ack is good health, silence makes the target a suspect."""
        self._probe = None
        if p.acked:
            self.health = max(0, self.health - 1)
            return
        self._unanswered = p
        self.stats.probes_failed += 1
        self.health = min(self.config.max_health, self.health + 1)
        rec = self._records.get(p.target)
        if rec is None or rec.member.state not in (ALIVE, SUSPECT):
            return
        claim = dataclasses.replace(rec.member, state=SUSPECT, by=self.me.id)
        self._merge([claim], now, actions, self.me.id)
        # The members we asked for help failed to reach it too, and are the likeliest to confirm: tell them
        # now rather than on our next probe of them, so that a real death is confirmed (Lifeguard) within a period.
        for addr in p.helpers:
            actions.append(Send(addr, GOSSIP, (self.me, claim)))

    def _on_ack(self, event: Ack, now: float, actions: list[Action]) -> None:
        answer = self.candidates.answered(event.seq, event.sender)
        if answer is not None:
            candidate, sent_at = answer
            if not candidate.via and len(self._rtos) < RTO_SAMPLES:
                # Its own answer to our ping: a round trip (through a helper it is two), the first ones a newcomer
                # has. Only until members' probes fill the window: candidates come in bursts, and a burst of made-up
                # members answering late would otherwise stretch everyone's period (the probes' round robin takes
                # each member once a round).
                self._measured(candidate.claim.id, now - sent_at)
            self._verified(candidate, event.entries, now, actions)
            self._echo(event, candidate.claim.addr, actions)
            return
        relay = self._relays.get(event.seq)
        if relay is not None:
            if event.sender == relay.target:  # another member now at the target's address proves nothing
                del self._relays[event.seq]
                actions.append(Send(relay.origin_addr, ACK, self._piggyback(""), seq=relay.origin_seq))
            return
        p = self._probe
        late = self._unanswered
        if late is not None and late.seq == event.seq and event.sender == late.target:
            # Its answer to a probe already concluded: a round trip longer than our timeouts, which follow it from
            # now on (no verdict changes: the member refutes a suspicion itself). Without this a link slower than
            # the first timeouts (half a period) was never measured, and every probe of it failed.
            self._unanswered = None
            self._measured(late.target, now - late.sent_at)
            self.min_rtt.observe(now - late.sent_at, now)
            return
        if p is None or p.seq != event.seq or p.acked:
            return
        if event.sender != p.target and event.sender not in p.helper_ids:
            # An ack from whoever answers at the target's address now (a restart under a new id, a second id
            # after a lost welcome) must not keep the old id alive for ever.
            self.stats.acks_from_others += 1
            return
        p.acked = True
        if event.sender == p.target:
            self._last_ack[p.target] = now  # its own answer to our nonce: evidence against a death told by others
            rec = self._records.get(p.target)
            if rec is not None:
                self._echo(event, rec.member.addr, actions)
            self._measured(p.target, now - p.sent_at)  # its own answer, if after we asked others too: one ping
            self.min_rtt.observe(now - p.sent_at, now)

    def _measured(self, member_id: str, rtt: float) -> None:
        """``member_id`` answered our own ping after ``rtt`` seconds: its timeout, and the swarm's, follow.

        ``min_rtt``, which averaging reads as the link's latency, is the caller's: it takes our probes of
        members only, as before candidates were measured. Their answers come before exchanges load the link,
        and moved averaging's settings (tests/test_momentum.py's skewed run fell from 0.94 to 0.89).
        """
        rec = self._records.get(member_id)
        estimate = smoothed(*(rec.rtt if rec is not None and rec.rtt is not None else (None, 0.0)), rtt)
        if rec is not None:
            rec.rtt = estimate
        self._rtos.append(self._rto_of(estimate))
        self._median_rto = statistics.median(self._rtos)

    def _relay(self, event: PingReq, now: float, actions: list[Action]) -> None:
        for seq in [s for s, r in self._relays.items() if r.expires <= now]:
            del self._relays[seq]
        if len(self._relays) >= _MAX_RELAYS or event.target == self.me.id:
            return
        seq = self._nonce()
        self._relays[seq] = _Relay(event.reply_to, event.seq, now + 2 * self.period(), event.target)
        actions.append(Send(event.target_addr, PING, self._piggyback(event.target), seq=seq))

    # -- suspicion and death ---------------------------------------------------------------

    def _suspicion_timeout(self, rec: _Record, confirmers: int) -> float:
        """Lifeguard: from the maximum down to the minimum as independent suspicions arrive (log scale).

        ``confirmers`` is how many members could confirm a suspicion at all
        (``_confirmers()``): Lifeguard's K is capped by it, since a swarm of 3
        has one member besides the first suspector and could never reach 3.
        Without the cap a real death there waits most of the maximum.
        """
        n = len(self._records) + 1
        stretch = self._stretch()
        lo, hi = stretch * self.config.suspicion_timeout(n), stretch * self.config.suspicion_timeout_max(n)
        k = min(self.config.suspicion_confirmations, confirmers)
        if k <= 0:
            return lo  # nobody could confirm it (a swarm of two): the first suspicion is all there will be
        confirmations = min(k, max(0, len(rec.suspectors) - 1))
        return max(lo, hi - (hi - lo) * math.log(confirmations + 1) / math.log(k + 1))

    def _confirmers(self) -> int:
        """Members that could confirm a suspicion: the started live ones, us included, less the suspect and the first suspector."""
        return self._started + 1 - 2

    def _expire(self, now: float, actions: list[Action]) -> None:
        confirmers = self._confirmers() if self._suspects else 0
        for mid in list(self._suspects):
            rec = self._records[mid]
            if now - rec.changed_at >= self._suspicion_timeout(rec, confirmers):
                suspectors = tuple(sorted(rec.suspectors))
                self._set(rec, dataclasses.replace(rec.member, state=DEAD, by=""), now)
                self._broadcast(rec.member)  # SWIM's confirm: a member that never heard of it must not take it up
                actions.append(MemberDown(rec.member, "dead", suspectors))
        for mid in list(self._newcomers):
            # A welcome's placeholder (its own entry has a start-time incarnation) that never started: not
            # probed meanwhile, since building a model takes a while; dropped on time, not at the next sweep.
            rec = self._records[mid]
            if now - rec.changed_at >= self.config.newcomer_grace:
                self._set(rec, dataclasses.replace(rec.member, state=DEAD), now)
                actions.append(MemberDown(rec.member, "dead"))
        if self._rounds % 16 == 0:
            forget_after = self.config.tombstone_rounds * self.config.heartbeat_interval
            for mid, rec in list(self._records.items()):
                if rec.member.state in (DEAD, LEFT) and now - rec.changed_at > forget_after:
                    del self._records[mid]
                    self._dead_ids.pop(mid, None)
                    self._version += 1  # (a dead or left record: who is live is unchanged)
                    self._by_addr.get(rec.member.addr, {}).pop(mid, None)
                    if not self._by_addr.get(rec.member.addr, True):
                        del self._by_addr[rec.member.addr]
                    self._hearsay.discard(mid)
                    self._last_ack.pop(mid, None)
            for mid, t in list(self._hinted.items()):
                if now - t > self.config.heartbeat_interval:
                    del self._hinted[mid]

    def _index(self, member: Member, old: Member | None = None) -> None:
        """Called wherever a record is added (``old`` None) or its member changes from ``old``: notes where
        ``member`` is, for ``_at_addr`` (every record's current address is always in the index), and that
        ``alive()`` (and, if liveness changed, ``alive_ids()``) must be computed again."""
        self._by_addr.setdefault(member.addr, {})[member.id] = None
        self._version += 1
        self._started += _is_started(member) - (old is not None and _is_started(old))
        if member.state == DEAD:
            self._dead_ids[member.id] = None
        elif old is not None and old.state == DEAD:
            self._dead_ids.pop(member.id, None)
        live = member.state in (ALIVE, SUSPECT)
        if live != (old is not None and old.state in (ALIVE, SUSPECT)):
            self._live_version += 1
            if live:
                _insert_sorted(self._live_sorted, member.id)
            else:
                _remove_sorted(self._live_sorted, member.id)

    def _at_addr(self, addr: str) -> list[_Record]:
        """The records whose member is at ``addr`` now (the index may hold ids that moved or were forgotten)."""
        out = []
        for mid in self._by_addr.get(addr, ()):
            rec = self._records.get(mid)
            if rec is not None and rec.member.addr == addr:
                out.append(rec)
        return out

    def _set(self, rec: _Record, member: Member, now: float) -> None:
        """Record a new claim about a member, keeping the suspect index in step."""
        if member.state != SUSPECT or member.incarnation != rec.member.incarnation or rec.member.state != SUSPECT:
            rec.suspectors = set()
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

    # -- merging what we hear --------------------------------------------------------------

    def _merge(self, entries: Iterable[Member], now: float, actions: list[Action], sender: str = "", source: str = "") -> None:
        """SWIM's precedence, with nothing taken on trust.

        A higher incarnation wins; at equal ones, suspect beats alive and left
        beats both. On top of that: a member we do not know, one claimed at
        another address, or one raised far past the incarnation we know, is
        only a candidate until it answers our own probe there (``_verified``);
        suspicions and deaths are taken only from live members, a bounded
        number per sender and period; and a death told of a member that
        answered our own probe lately is only a suspicion (it refutes it).
        """
        id_of, me, records, introducer = self._id_of, self.me.id, self._records, source or sender or "?"
        for e in entries:
            if id_of is not None and id_of(e.addr) != e.id:
                self.stats.forged_ids_refused += 1  # a secure swarm's ids are their keys': nobody claims another's
                continue
            if e.id == me:
                self._refute(e)
                continue
            rec = records.get(e.id)
            if e.state == ALIVE:
                # Most entries are news we have (a sync repeats the whole view): skip them without a call.
                if rec is None or e.incarnation > rec.member.incarnation:
                    self._merge_alive(e, rec, now, introducer)
            elif rec is None:
                if e.state in (DEAD, LEFT) and self._live_sender(sender):
                    self._remember_hearsay(e, now)  # stale news of it arriving later must not bring it in
                # news of a stranger's suspicion is not taken
            elif e.incarnation > rec.member.incarnation + _INCARNATION_GAP:
                self.stats.jumps_refused += 1
            elif e.state == SUSPECT:
                if rec.member.state in (ALIVE, SUSPECT) and e.incarnation >= rec.member.incarnation:
                    if self._verdict_allowed(sender):
                        self._merge_suspicion(e, rec, now, actions)
            elif rec.member.state in (DEAD, LEFT):
                if e.state == LEFT and rec.member.state == DEAD and e.incarnation >= rec.member.incarnation:
                    self._index(e, rec.member)
                    rec.member = e  # it had left, not died: remember it so
            elif e.incarnation >= rec.member.incarnation:
                if e.state == LEFT and sender == e.id:
                    self._down(rec, e, now, actions)  # its own leave
                elif not self._verdict_allowed(sender):
                    pass
                elif self._answered_lately(e.id, now):
                    # It answered our own probe within a suspicion timeout: one member's word does not remove
                    # it. Suspect it instead (the teller counts as a suspector) and probe it next: if alive, it
                    # hears the suspicion and refutes it; if not, our own timer confirms the death.
                    self.stats.verdicts_doubted += 1
                    self._merge_suspicion(dataclasses.replace(e, state=SUSPECT, by=sender), rec, now, actions)
                    self._probe_order.append(e.id)
                else:
                    self._down(rec, e, now, actions)

    def _merge_alive(self, e: Member, rec: _Record | None, now: float, introducer: str) -> None:
        """An alive claim: a refutation is taken as told; a newcomer, a move or a big jump waits for verification."""
        if rec is None:
            self.candidates.offer(e, introducer, now)
            return
        old = rec.member
        if e.incarnation <= old.incarnation:
            return
        if e.addr != old.addr and old.state in (ALIVE, SUSPECT):
            self.stats.redirects_refused += 1  # nobody moves a live member: it answers where it is (memberlist's rule)
            return
        if old.state in (DEAD, LEFT) or old.incarnation == 0 or e.incarnation > old.incarnation + _INCARNATION_GAP:
            self.candidates.offer(e, introducer, now)  # a rejoin, a start or a restart: it must answer for itself
            return
        self._set(rec, e, now)  # a refutation: one more than the suspicion it outranks
        self._broadcast(e)

    def _merge_suspicion(self, e: Member, rec: _Record, now: float, actions: list[Action]) -> None:
        old = rec.member
        if old.state == ALIVE or e.incarnation > old.incarnation:
            self._set(rec, e, now)
            self.stats.suspicions += 1
            actions.append(Suspected(e))
        elif e.by and e.by not in rec.suspectors and len(rec.suspectors) <= self.config.suspicion_confirmations:
            self._index(e, rec.member)
            rec.member = e  # an independent confirmation: pass it on, and the timer shrinks
        else:
            return
        if e.by == self.me.id or self._live_sender(e.by):  # a made-up suspector confirms nothing
            rec.suspectors.add(e.by)
        self._broadcast(e)

    def _down(self, rec: _Record, e: Member, now: float, actions: list[Action]) -> None:
        old = rec.member
        suspectors = tuple(sorted(rec.suspectors)) if old.state == SUSPECT and e.state == DEAD else ()
        self._set(rec, dataclasses.replace(e, by=""), now)
        self._broadcast(rec.member)
        actions.append(MemberDown(rec.member, "left" if e.state == LEFT else "dead", suspectors))

    def _live_sender(self, sender: str) -> bool:
        rec = self._records.get(sender)
        return rec is not None and rec.member.state in (ALIVE, SUSPECT) and rec.member.incarnation > 0

    def _verdict_allowed(self, sender: str) -> bool:
        """Suspicions and deaths are taken from ourselves and from live members, at most ``verdicts_per_sender`` a period."""
        if sender == self.me.id:
            return True
        if not self._live_sender(sender) or self._verdicts.get(sender, 0) >= self.config.verdicts_per_sender:
            self.stats.verdicts_refused += 1
            return False
        self._verdicts[sender] = self._verdicts.get(sender, 0) + 1
        return True

    def _answered_lately(self, member_id: str, now: float) -> bool:
        at = self._last_ack.get(member_id)
        return at is not None and now - at < self.config.suspicion_timeout_max(len(self._records) + 1)

    def _remember_hearsay(self, e: Member, now: float) -> None:
        if len(self._hearsay) >= 4 * self.candidates.capacity:
            self.stats.hearsay_refused += 1
            return
        self._records[e.id] = _Record(e, now)
        self._index(e)
        self._hearsay.add(e.id)
        self.candidates.drop(e.id)

    def _welcome(self, m: Member, now: float, actions: list[Action]) -> None:
        """Our own welcome's placeholder: a member (not probed, dropped if it never starts) without verification.

        At most ``MAX_PLACEHOLDERS`` at once: joins claiming made-up
        addresses (one source may send 5 a second, ``limits.join_*``) would
        otherwise fill our view with members that never start. Past the
        bound a newcomer is a candidate like any other, verified when it
        starts (a round trip later).
        """
        if m.id in self._records:
            return
        if len(self._newcomers) >= MAX_PLACEHOLDERS:
            self.stats.placeholders_deferred += 1
            self.candidates.offer(m, WELCOMED_INTRODUCER, now)
            return
        self.candidates.drop(m.id)
        self._records[m.id] = _Record(m, now)
        self._index(m)
        if m.incarnation == 0:
            self._newcomers.add(m.id)
        self._broadcast(m)
        actions.append(MemberUp(m))

    # -- verifying candidates --------------------------------------------------------------

    def _nonce(self) -> int:
        """A probe's sequence number: random, so that only whoever got the probe can answer it."""
        return self._nonces.getrandbits(62) | 1

    def _probe_candidates(self, now: float, actions: list[Action]) -> None:
        """Probe candidates not probed yet (placeholders wait for their start), ``candidate_probes`` a period."""
        if self.me.state != ALIVE or self._candidate_budget <= 0 or not len(self.candidates):
            return  # called after every message: a flood past this period's budget costs no walk of the table
        for c in self.candidates:
            if self._candidate_budget <= 0:
                return
            if c.seq == 0 and c.claim.incarnation > 0:
                self._probe_candidate(c, now, actions)

    def _challenge(self, ping: Ping, now: float) -> int:
        """A nonce for our ack to ``ping`` when its sender is a candidate we have not probed yet; else 0.

        The ack goes to the address the candidate claims, as our probe would, and only whoever receives
        it there can echo the nonce: the same proof in one message (the echo) instead of two, which at a
        swarm's start, when everyone verifies everyone, saves a quarter of the traffic. It costs no
        probe budget (the budget bounds what we send to addresses only heard of; this ack goes to the
        pinger anyway), and a challenge never echoed is probed again later, as an unanswered probe is.
        """
        if self.me.state != ALIVE:
            return 0
        c = self.candidates.get(ping.sender)
        own = ping.entries[0] if ping.entries else None
        if c is None and own is not None and own.id == ping.sender and own.state == ALIVE and ping.sender not in self._records:
            if self._id_of is None or self._id_of(own.addr) == own.id:
                c = self.candidates.offer(own, ping.source or ping.sender, now, direct=True)  # _merge's offer was refused
        if c is None or c.seq != 0 or c.claim.incarnation == 0 or c.claim.addr != ping.reply_to:
            return 0
        seq = self._nonce()
        self.candidates.probing(c, seq, now, now + self.period() * (1 + c.attempts))
        return seq

    def _echo(self, ack: Ack, addr: str, actions: list[Action]) -> None:
        """Answer the challenge on an ack to our own probe, at the address we probed (never one the ack names)."""
        if ack.challenge and self.me.state == ALIVE:
            actions.append(Send(addr, ACK, self._piggyback(ack.sender), seq=ack.challenge))

    def _probe_candidate(self, c: Candidate, now: float, actions: list[Action]) -> None:
        """Probe ``c`` at the address it claims; a client we cannot reach, through a member that may (ping-req).

        A client-mode member (behind NAT) is reached only over connections
        it opened, and it never opens one to another client: two clients
        verify each other through a reachable member, the introducer first,
        then others at random, as SWIM's indirect probes do.
        """
        direct = self._can_reach(c.claim.addr)
        relay = None if direct else self._relay_for(c)
        if not direct and relay is None:
            if c.seq:  # asked before, nobody to ask now: forget it (gossip brings it back); else it waits
                self.candidates.drop(c.claim.id)
            return
        self._candidate_budget -= 1
        seq = self._nonce()
        self.candidates.probing(c, seq, now, now + self.period() * (1 + c.attempts))
        if relay is None:
            c.via = ""
            actions.append(Send(c.claim.addr, PING, (self.me,), seq=seq))
        else:
            c.via = relay.id
            actions.append(
                Send(relay.addr, PING_REQ, self._piggyback(relay.id), seq=seq, target=c.claim.id, target_addr=c.claim.addr)
            )

    def _relay_for(self, c: Candidate) -> Member | None:
        """Whom to ask to probe candidate ``c`` for us: its introducer at the first attempt, else anyone we reach."""
        rec = self._records.get(c.introducer)
        if c.attempts == 0 and rec is not None and rec.member.state == ALIVE and self._can_reach(rec.member.addr):
            return rec.member
        helpers = [
            m for m in self.alive()
            if m.id not in (self.me.id, c.claim.id) and m.state == ALIVE and m.incarnation > 0 and self._can_reach(m.addr)
        ]
        return self._rng.choice(helpers) if helpers else None

    def _expire_candidates(self, now: float, actions: list[Action]) -> None:
        for c in self.candidates:
            if c.seq and now >= c.deadline:
                if c.attempts < _CANDIDATE_ATTEMPTS and self._candidate_budget > 0:
                    self._probe_candidate(c, now, actions)  # a lost probe, or a newcomer still starting: once more
                elif c.attempts >= _CANDIDATE_ATTEMPTS and c.via:
                    self.candidates.drop(c.claim.id)  # the members asked could not reach it: nobody lied, tried later
                elif c.attempts >= _CANDIDATE_ATTEMPTS:
                    self.candidates.unanswered(c, now)
            elif c.claim.incarnation == 0 and now - c.heard_at >= self.config.newcomer_grace:
                self.candidates.drop(c.claim.id)  # someone else's placeholder that never started
        if self._rounds % 16 == 0:
            self.candidates.forget_quarantines(now)

    def _verified(self, c: Candidate, entries: Sequence[Member], now: float, actions: list[Action]) -> None:
        """A candidate answered our probe at the address claimed: take it (as its own entry says, if it sent one)."""
        own = entries[0] if entries else None
        m = own if own is not None and own.id == c.claim.id and own.addr == c.claim.addr and own.state == ALIVE else c.claim
        m = m if m.incarnation >= c.claim.incarnation else c.claim
        self._last_ack[m.id] = now
        self._hearsay.discard(m.id)
        for r in self._at_addr(m.addr):
            if r.member.id != m.id and r.member.state in (ALIVE, SUSPECT):
                # One address, one live member: the process there now answers as m (a restart under a new id).
                self._set(r, dataclasses.replace(r.member, state=DEAD, by=""), now)
                actions.append(MemberDown(r.member, "dead"))
        rec = self._records.get(m.id)
        if rec is None:
            self._records[m.id] = _Record(m, now)
            self._index(m)
            self._probe_order.insert(self._rng.randint(0, len(self._probe_order)), m.id)
            actions.append(MemberUp(m))
        elif m.incarnation > rec.member.incarnation:
            old = rec.member
            self._set(rec, m, now)
            if old.state in (DEAD, LEFT):
                actions.append(MemberUp(m, rejoined=True))
            elif old.incarnation == 0:
                self._probe_order.insert(self._rng.randint(0, len(self._probe_order)), m.id)
        else:
            return
        self._broadcast(m)
        if c.wants_view:
            actions.append(Send(m.addr, GOSSIP, self._digest(m.id)))  # the full view its sync asked for
        if self._alive_count_is_one():
            actions.append(Send(m.addr, SYNC, self._digest(m.id)))  # our first member: swap views with it at once

    def _alive_count_is_one(self) -> bool:
        """Exactly one record alive (stops at the second: a large view costs no more than a small one)."""
        alive = 0
        for r in self._records.values():
            if r.member.state == ALIVE:
                alive += 1
                if alive > 1:
                    return False
        return alive == 1

    def _send_view(self, sender: str, actions: list[Action]) -> None:
        """A sync asked for our full view: to a verified member at once, to a candidate once it is verified."""
        rec = self._records.get(sender)
        if rec is not None and rec.member.state in (ALIVE, SUSPECT):
            actions.append(Send(rec.member.addr, GOSSIP, self._digest(sender)))
            return
        c = self.candidates.get(sender)
        if c is not None:
            c.wants_view = True

    def _refute(self, claim: Member) -> None:
        """A claim that we are suspect, dead or gone, or one from a newer incarnation: outrank it.

        Only we raise our incarnation; a claim far above it is a lie that no
        member took (``_INCARNATION_GAP``), so we do not chase it there.
        """
        if self.me.state != ALIVE:
            return
        stale = claim.incarnation < self.me.incarnation or (claim.incarnation == self.me.incarnation and claim.state == ALIVE)
        if stale:
            return
        if claim.incarnation > self.me.incarnation + _INCARNATION_GAP:
            self.stats.jumps_refused += 1
            return
        self.stats.refutations += 1
        if claim.state != ALIVE:
            self.health = min(self.config.max_health, self.health + 1)  # others could not hear us: slow down
        # No need to queue it: we ride on every message we send, and each member that takes it passes it on.
        self.me = dataclasses.replace(self.me, incarnation=max(self.me.incarnation, claim.incarnation) + 1)

    def _hint(self, sender: str, now: float, actions: list[Action]) -> None:
        """A member we hold suspect or dead just spoke to us: tell it, at most once a period, so it can refute.

        The hint goes to the address we hold for it, never to one the message names (no reflection).
        """
        rec = self._records.get(sender)
        if rec is None or rec.member.state not in (SUSPECT, DEAD):
            return
        last = self._hinted.get(sender)
        if last is not None and now - last < self.config.heartbeat_interval:
            return
        self._hinted[sender] = now
        actions.append(Send(rec.member.addr, GOSSIP, (self.me, rec.member)))

    # -- what we send ----------------------------------------------------------------------

    def _broadcast(self, entry: Member) -> None:
        """Queue an update to ride on our next messages, replacing older news of the same member."""
        item = [entry, self.config.retransmits(len(self._records) + 1)]
        old = self._queued.get(entry.id)
        if old is not None:
            old[1] = 0  # dropped lazily when it comes round
        self._queued[entry.id] = item
        self._broadcasts.appendleft(item)

    def _piggyback(self, to: str) -> tuple[Member, ...]:
        """Ourselves, what the recipient should know about itself, and up to ``max_piggyback`` queued updates."""
        out = [self.me]
        rec = self._records.get(to)
        if rec is not None and rec.member.state in (SUSPECT, DEAD):
            out.append(rec.member)  # Lifeguard's buddy system: a suspect hears it from its prober first
        taken = 0
        for _ in range(len(self._broadcasts)):
            if taken == self.config.max_piggyback:
                break
            item = self._broadcasts.popleft()
            entry, left = item
            if left <= 0:
                if self._queued.get(entry.id) is item:
                    del self._queued[entry.id]
                continue
            if entry.id != to:
                out.append(entry)
                taken += 1
                item[1] = left - 1
            self._broadcasts.append(item)
        return tuple(out)

    def _digest(self, to: str = "", tombstones: bool = True) -> tuple[Member, ...]:
        """Our full view, with what we know of the departed; the recipient always hears its own verdict.

        Without ``tombstones`` (sent to a member we hold dead, which may be
        alive behind a healed partition): only the living and the recipient's
        own verdict, so that it refutes without condemning its own side.
        """
        out = [self.me] + [r.member for r in self._records.values() if tombstones or r.member.state != DEAD or r.member.id == to]
        return tuple(out)

    def _leave(self) -> list[Action]:
        if self.me.state == LEFT:
            return []
        self.me = dataclasses.replace(self.me, state=LEFT)
        return [Send(m.addr, LEAVE, (self.me,)) for m in self.alive()]


def _is_started(m: Member) -> bool:
    """A live member past its welcome's placeholder: one that probes and could confirm a suspicion."""
    return m.state in (ALIVE, SUSPECT) and m.incarnation > 0


def least_loaded_shard(held: Iterable[int], shards: int) -> int:
    """The shard fewest live members train (lowest index on ties): a newcomer fills a gap first."""
    load = [0] * shards
    for s in held:
        if 0 <= s < shards:
            load[s] += 1
    return min(range(shards), key=lambda s: (load[s], s))


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
