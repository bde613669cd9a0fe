"""What goes in and out of ``Membership.handle``: the events a driver feeds it, the actions it returns, and its counters.

The machine is sans-IO: the driver (the asyncio peer node, or the
simulator) turns each received message into an event (``Ping``,
``PingReq``, ``Ack``, ``Digest``), tells it that time passed (``Tick``) or
that we welcomed someone or are leaving, and carries out the actions it
returns: messages to send (``Send``) and changes of the live set to act on
(``MemberUp``, ``MemberDown``, ``Suspected``). ``HealthStats`` counts what
the failure detector did, for metrics lines and tests.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from gossiptrain.protocol.member import Member

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
    our own, which verifies us there in one message instead of a probe and its answer (see
    ``gossiptrain.protocol.swim.verification.Verifier.challenge``).
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

# -- counters ----------------------------------------------------------------------------


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
