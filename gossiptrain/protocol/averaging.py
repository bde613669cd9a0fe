"""The averaging layer's vocabulary, and asynchronous pairwise averaging (AD-PSGD).

Every algorithm (see ``gossiptrain.protocol.algorithms``) is a sans-IO state machine
with ``handle(event, now) -> actions``; this module defines the events,
actions, statistics and the shared base (validation, compression, staleness),
and the default algorithm, pairwise averaging:

One exchange: the initiator sends its model ``s_a`` to a partner; the
partner replies with its own ``s_b`` and moves by ``a (s_a - s_b)``; when the
reply arrives the initiator moves by ``a (s_b - s_a)`` (``a`` = 1/2 without
staleness weighting). Adding the difference instead of overwriting with the
average keeps the local steps the initiator took while the exchange was in
flight (Lian et al., AD-PSGD).

**Invariant.** The sum of every member's model, plus the corrections that
replies in flight owe their requesters, changes only by local (optimizer)
steps: an exchange is applied on both sides or on neither. The pieces:

- *Requests are answered at once, never waiting for the training loop.*
  The network side handles requests and replies as they arrive
  (``network_kinds``), against ``view``: our model as of the last safe point
  (``base``, a frozen copy the safe point takes) plus every merge since
  (``pending``, which the next safe point adds to the live parameters: only
  the training loop touches those). A loop paused for evaluation, a
  checkpoint or slow data costs its partners nothing, and no request waits in
  a queue to be served after its requester gave up. A reply goes out before
  the server's own merge is computed (``after_send``): that arithmetic is off the
  exchange's critical path.
- *A late reply is applied, not dropped.* A timeout only lets us start
  another exchange; the timed-out one stays remembered (the latest
  ``OVERDUE_KEPT`` of them, for ``OVERDUE_SECONDS``), and its reply, whenever
  it comes, is applied as if on time. Only a reply later than the horizon, or
  than ``OVERDUE_KEPT`` newer timeouts, is abandoned (``stats.abandoned``,
  with a warning): by then it is most likely lost, and waiting for it would
  stop the peer averaging; one from a member we saw die is forgotten quietly
  (its model left the swarm with it).
- *A reply we could not send is taken back*: the driver reports it
  (``Undelivered``) and the server undoes its merge.
- *Crossing requests* (two peers asking each other at once) are served by
  the smaller id only, so the pair averages once instead of swapping.

The one fault this cannot absorb is a reply the network loses after it was
sent (a connection that breaks with the message in it, which in practice
means the requester died); the server has moved, the requester never will.

**Exchanges in flight.** Where the link's latency alone takes more than a
local step (a WAN), a peer keeps up to ``concurrency()`` exchanges in flight, with
different partners, each asking for weight ``1/(k+1)``; the partner answers
with at most what it can take (the reply's ``a``, which both ends apply).
What may be taken back of the model a peer sent (its exchanges in flight,
and the requests it served since) adds to at most 1 (``_committed``), so
every model stays in the convex hull of the swarm's; a request beyond that
is refused (``busy``). Each timeout adapts to measured round trips (as TCP's
RTO does), so a dead or slow partner costs one timeout and is then avoided
for a while; it never blocks training for longer.

**Flow control.** A peer may take at most ``gossip.max_steps_ahead`` local
steps (``AUTO_STEPS_AHEAD`` by default) past its last merge; past that, its
safe point waits for the exchange in flight (``hold_until``), never past that
exchange's timeout, and not at all for a partner that timed out lately (a
stopped or dead one costs one timeout, then is avoided, see ``_avoid``). On a link fast enough for a round trip within the bound
nothing waits; on a slow one, peers compute at the link's pace instead of
drifting toward their own shards (overlap-bounded SGP does the same).
"""

from __future__ import annotations

import logging
import math
import random
from collections import Counter, OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

import torch

from gossiptrain.config import GossipConfig
from gossiptrain.errors import ProtocolError
from gossiptrain.net.kinds import XNAK, XREP, XREQ
from gossiptrain.protocol.auto_compression import AutoCompression
from gossiptrain.protocol.compression import AutoCodec, get_codec
from gossiptrain.protocol.merges import PendingMerges
from gossiptrain.protocol.receipts import Receipts
from gossiptrain.protocol.robust import NormClip, norms
from gossiptrain.protocol.rtt import RttEstimator, rtt_bucket
from gossiptrain.protocol.staleness import StalenessPolicy, staleness_buckets
from gossiptrain.protocol.step_timer import StepTimer
from gossiptrain.state.host_buffers import BufferPool, common_device, to_device

log = logging.getLogger(__name__)


#: Scalars an exchange message may carry besides its xid, and their allowed ranges (checked by
#: the node before an event reaches an algorithm): push-sum weight, pairwise mixing weight,
#: sender's out-degree (Metropolis-Hastings weights), sender's model version, edge sequence number.
META_RANGES: dict[str, tuple[type, float, float]] = {
    "w": (float, 0.0, float(1 << 24)),
    "a": (float, 0.0, 0.5),
    "deg": (int, 0, 1 << 24),
    "ver": (int, 0, (1 << 63) - 1),
    "seq": (int, 0, (1 << 63) - 1),  # top-k neighbour averaging: message number on its edge (0: dense reset)
}


#: Timed-out pairwise exchanges remembered so that a late reply is still applied (each holds one model copy);
#: past that many, the oldest is given up (its reply most likely lost).
OVERDUE_KEPT = 4
#: How long a timed-out exchange's reply is still applied; later, the exchange is abandoned.
OVERDUE_SECONDS = 120.0
#: Flow control (``gossip.max_steps_ahead = 0``): local steps a pairwise peer may take past its last merge before
#: its safe point waits for the exchange in flight. Where a round trip takes fewer steps (a fast link) nothing
#: ever waits; on a slow link computation slows to the link's pace instead of drifting apart (chosen by measurement:
#: experiments/flow_control.py).
AUTO_STEPS_AHEAD = 8
#: Automatic exchanges in flight (``gossip.exchanges_in_flight = 0``): at most this many at once...
MAX_IN_FLIGHT = 3
#: ...and a second one only once the latency takes more than this many steps over one.
ROUND_TRIP_SLACK = 0.5
#: Automatic flow control on a far link: at most this many steps past a round trip (``PairwiseAveraging.flow_bound``)...
ROUND_TRIP_STEPS_AHEAD = 2
#: ...and never more than this many in all: past it, peers on skewed shards drift apart faster than merges pull them
#: together (real processes, 50 ms each way, a round trip of 70 steps: unbounded, non-finite after 33 s).
MAX_AUTO_STEPS_AHEAD = 3 * AUTO_STEPS_AHEAD
#: A request is refused (busy) rather than served with a mixing weight below this (see PairwiseAveraging._committed).
MIN_SHARE = 0.1


@dataclass(frozen=True)
class ParamSpec:
    """Names, dtypes and shapes of the parameters a swarm averages; all peers must agree."""

    entries: tuple[tuple[str, str, tuple[int, ...]], ...]

    @classmethod
    def of(cls, params: Mapping[str, torch.Tensor]) -> "ParamSpec":
        return cls(tuple((n, str(t.dtype).removeprefix("torch."), tuple(t.shape)) for n, t in params.items()))

    def to_wire(self) -> list[list[object]]:
        return [[n, d, list(s)] for n, d, s in self.entries]

    @classmethod
    def from_wire(cls, raw: object) -> "ParamSpec":
        if not isinstance(raw, list):
            raise ProtocolError("parameter spec must be a list")
        out = []
        for e in raw:
            if (
                not isinstance(e, list)
                or len(e) != 3
                or not isinstance(e[0], str)
                or not isinstance(e[1], str)
                or not isinstance(e[2], list)
                or not all(type(d) is int and d >= 0 for d in e[2])
            ):
                raise ProtocolError("malformed parameter spec entry")
            out.append((e[0], e[1], tuple(e[2])))
        return cls(tuple(out))

    def mismatch(self, other: "ParamSpec") -> str | None:
        """A sentence naming the first difference, or None if the specs agree."""
        mine = {n: (d, s) for n, d, s in self.entries}
        theirs = {n: (d, s) for n, d, s in other.entries}
        for name in mine:  # in model order, so the same models always give the same sentence
            if name not in theirs:
                return f"parameter {name!r} exists here but not in the swarm's model"
        for name in theirs:
            if name not in mine:
                return f"parameter {name!r} exists in the swarm's model but not here"
        for name, (d, s) in mine.items():
            td, ts = theirs[name]
            if s != ts:
                return f"parameter {name!r} has shape {list(s)} here but {list(ts)} in the swarm"
            if d != td:
                return f"parameter {name!r} has dtype {d} here but {td} in the swarm"
        return None


# -- events ------------------------------------------------------------------------------


@dataclass(frozen=True)
class AtSafePoint:
    """A safe point after local step ``step``; ``partners`` are the topology's neighbours now.

    ``latency``: the shortest round trip of small messages lately (membership's
    probes), None where unknown.
    """

    step: int
    partners: Sequence[str]
    latency: float | None = None


@dataclass(frozen=True)
class Received:
    """An exchange message from ``sender`` (kind xreq, xrep or xnak), already decoded."""

    sender: str
    kind: str
    xid: int
    tensors: Mapping[str, torch.Tensor] = field(default_factory=dict)
    step: int = 0  # the sender's local step when it sent this
    meta: Mapping[str, float | int] = field(default_factory=dict)  # keys and ranges: META_RANGES


@dataclass(frozen=True)
class Undelivered:
    """The driver could not put our ``kind`` message ``xid`` for ``to`` on the wire (queue full, address unknown)."""

    to: str
    kind: str
    xid: int


@dataclass(frozen=True)
class MemberGone:
    """Membership declared ``member`` dead or gone: nothing more will come from it."""

    member: str


Event = AtSafePoint | Received | Undelivered | MemberGone

# -- actions -----------------------------------------------------------------------------


@dataclass(frozen=True)
class SendExchange:
    """Put an exchange message on the wire to member ``to``."""

    to: str
    kind: str
    xid: int
    tensors: Mapping[str, torch.Tensor]
    meta: Mapping[str, float | int] = field(default_factory=dict)  # keys and ranges: META_RANGES


@dataclass(frozen=True)
class Rejected:
    """An update was refused before touching the model; ``reason`` says why (for counters and logs)."""

    sender: str
    reason: str


Action = SendExchange | Rejected


@dataclass
class AveragingStats:
    started: int = 0
    completed: int = 0  # exchanges we initiated and applied
    served: int = 0  # exchanges others initiated and we applied
    timeouts: int = 0
    presumed_lost: int = 0  # replies (pairwise) or receipts (pushes) many typical round trips late: not waited for
    in_flight_most: int = 0  # pairwise: the most exchanges we had in flight at once (several on a far link)
    refused: int = 0  # partner answered xnak (busy); push-sum: pushes refused, their mass taken back
    late: int = 0  # replies that arrived after their timeout (pairwise: applied all the same)
    abandoned: int = 0  # pairwise: timed-out exchanges forgotten before their reply came (its merge is lost)
    undelivered: int = 0  # replies we could not send, so we took back their merge
    crossed: int = 0  # requests refused because we had asked the same partner at the same time
    busy: int = 0  # requests refused because we had already served one while ours was in flight
    rejected: int = 0  # updates refused by validation
    stale_dropped: int = 0  # updates refused for being beyond the staleness bound
    unsendable: int = 0  # times our own model could not be sent (non-finite values)
    clipped: int = 0  # robust: updates whose difference was scaled down (likely poisoned, or far behind)
    lost: int = 0  # push-sum: refused pushes whose mass could not come back (refused as unreadable)
    rtt_ms: float = 0.0  # smoothed round trip of completed exchanges, request sent to reply applied
    waits: int = 0  # flow control (the driver's): safe points that waited for the exchange in flight
    waited_s: float = 0.0  # ...and the seconds they waited in all
    longest_wait_s: float = 0.0  # ...and the longest single wait (never past an exchange timeout)
    overran: int = 0  # the driver's check: local steps begun while flow control said to wait (0 unless a bug)
    compression_level: int = 0  # compression "auto": the level now (0 none, 1 fp16, 2 int8: compression.AUTO_LEVELS)
    compression_switches: int = 0  # ...and how often it changed
    buffers: int = 0  # exchange buffers allocated so far (gossiptrain.state.host_buffers): constant once exchanges are steady
    # staleness (our step minus the sender's step, floored at 0) -> applied updates
    staleness: Counter[int] = field(default_factory=Counter)
    # round trips measured (request to reply applied, or push to receipt), by bucket: upper bound in seconds -> count
    rtt_hist: Counter[float] = field(default_factory=Counter)

    def round_trip(self, seconds: float, srtt: float | None) -> None:
        """One measured round trip, and the smoothed one it moved to."""
        self.rtt_ms = 1000 * (srtt or 0.0)
        self.rtt_hist[rtt_bucket(seconds)] += 1

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {k: v for k, v in self.__dict__.items() if k not in ("staleness", "rtt_hist")}
        # A copy first: another thread (the network side answering requests) may add a bucket meanwhile, and
        # iterating the live Counter then raised "dictionary changed size" in a peer's metrics line.
        staleness = Counter(dict(self.staleness))
        out["staleness_mean"] = mean_staleness(staleness)
        out["staleness_hist"] = staleness_buckets(staleness)
        out["rtt_hist"] = {f"{bound:g}": n for bound, n in sorted(dict(self.rtt_hist).items())}
        return out


def wire_bytes(wire: Mapping[str, torch.Tensor]) -> int:
    """Bytes of a message's tensors on the wire."""
    return sum(t.numel() * t.element_size() for t in wire.values())


def mean_staleness(histogram: Counter[int]) -> float:
    total = sum(histogram.values())
    return sum(s * n for s, n in histogram.items()) / total if total else 0.0


@dataclass
class _InFlight:
    xid: int
    partner: str
    snapshot: list[torch.Tensor]
    sent_at: float
    deadline: float  # the timeout: then the partner is avoided for a while and the reply waited for as overdue
    expected_by: float  # past this (replies usually come much sooner) it is presumed lost (see _live) until its deadline
    share: float = 0.5  # the mixing weight we asked for (the partner may answer with less: its reply's "a")
    served_meanwhile: float = 0.0  # the weights of the requests we served while this one was in flight (see _serve)
    may_hold: bool = True  # flow control may wait for it (not when the partner was one we are avoiding)
    nbytes: int = 0  # of the request on the wire
    presumed_lost: bool = False  # its reply is far later than replies come (expected_by passed)
    partner_gone: bool = False  # membership declared the partner dead or gone (MemberGone)


@dataclass
class _Served:
    """A request we served: we move by ``a (remote - sent)``, computed once the reply is out, undone if it never was."""

    xid: int
    to: str
    remote: list[torch.Tensor]
    sent: list[torch.Tensor]
    a: float
    delta: list[torch.Tensor] | None = None  # remote - sent, once computed (_settle)


class Averaging:
    """What every algorithm shares: the live parameters, validation, compression and staleness.

    Subclasses implement ``handle``. ``busy`` says an exchange is in flight;
    ``version`` counts merges applied to the local model (sent with pushes so a
    receiver can drop an older model from a sender it already has a newer one of).

    ``network_kinds``: the message kinds the driver hands over as they arrive,
    on the network side (a real peer's loop thread), instead of queueing them
    for the next safe point. An algorithm that takes any must never touch
    ``params`` while handling them; ``AtSafePoint`` is the only event that may.
    The driver serialises all calls to ``handle`` and ``after_send``, and
    calls ``after_send`` once it has sent what a network-side event returned.
    """

    network_kinds: frozenset[str] = frozenset()
    #: Flow control's bound where ``gossip.max_steps_ahead`` is 0 (automatic).
    auto_steps_ahead: int = AUTO_STEPS_AHEAD
    #: Merges move the model toward partners' models of before our last local step, against the model as it
    #: is now, not against the one we sent (push-sum): they undo part of that step (``take_stale_share``).
    merges_stale: bool = False
    #: ``moved`` says what each safe point added to the live parameters, so the drift correction reads it instead
    #: of copying the model before the safe point and subtracting after (two passes over the model fewer).
    reports_moves: bool = False

    def __init__(
        self, params: Mapping[str, torch.Tensor], config: GossipConfig, rng: random.Random, me: str = ""
    ) -> None:
        self.me = me  # our member id (breaks ties between peers)
        self.names = list(params)
        self.params = [p for p in params.values()]
        self.spec = ParamSpec.of(params)
        # Snapshots, merge differences and codec outputs come from here and are reused once dropped (they may be
        # on the wire meanwhile: see gossiptrain.state.host_buffers); received tensors move to ``device`` to merge.
        self.buffers = BufferPool()
        self.device = common_device(self.params)
        self.config = config
        self.rng = rng
        self.stats = AveragingStats()
        self.codec = get_codec(config.compression, "gossip.compression")
        # compression "auto": the level follows the measured link (``protocol.auto_compression``)
        self.steps = StepTimer()  # the local step time, flow control's waits excluded
        self.auto = AutoCompression(self.codec, self.params, self.steps) if isinstance(self.codec, AutoCodec) else None
        self.staleness = StalenessPolicy(config.staleness_weighting, config.staleness_exponent, config.staleness_bound)
        self.clip = NormClip(config.robust_clip) if config.robust else None
        # Fault injection for robustness experiments (the simulator's rogue peers, tests): this peer
        # scales what it sends by this factor. 1.0, honest, everywhere else.
        self.poison = 1.0
        self.version = 0
        self._moved: tuple[list[torch.Tensor], float] = ([], 0.0)  # see take_moved
        self._next_xid = rng.getrandbits(31)
        self._step = 0  # our latest local step, from the last AtSafePoint
        # Flow control: local steps past the last completed averaging before the loop waits (see hold_until).
        self.max_ahead = config.max_steps_ahead or self.auto_steps_ahead
        self.receipts = Receipts(config, self.stats)  # pushing algorithms: pushes not yet acknowledged (protocol.receipts)
        self.receipts.on_round_trip = self._link_measured

    @property
    def lossless(self) -> bool:
        """Whether what we send now is decoded exactly (the level of ``auto`` may change between messages)."""
        return self.codec.name == "none"

    def flow_bound(self) -> int:
        """Local steps past the last completed averaging before the training loop waits (``hold_until``)."""
        return self.max_ahead

    def round_trip_steps(self, latency: float | None) -> float | None:
        """A round trip of ``latency`` seconds in our local steps (None: either not measured yet)."""
        step = self.steps.step_time
        return latency / step if latency is not None and step else None

    def compression_bound(self) -> int:
        """Local steps an exchange may take before ``auto`` compression sends fewer bytes: flow control's bound."""
        return self.flow_bound()

    def _at_step(self, step: int, now: float) -> None:
        """Every algorithm's first move at a safe point: note the step (and, for ``auto``, the step time)."""
        self._step = step
        self.steps.at_step(step, now, self.stats.waited_s)

    def _link_measured(self, seconds: float, nbytes: int) -> None:
        """One of our messages of ``nbytes`` got its answer (reply, receipt) after ``seconds``."""
        if self.auto is not None:
            self.auto.exchanged(seconds, nbytes, self.compression_bound())
            self.stats.compression_level = self.auto.codec.level
            self.stats.compression_switches = self.auto.switches

    @property
    def busy(self) -> bool:
        return False

    def handle(self, event: Event, now: float) -> list[Action]:
        raise NotImplementedError

    def after_send(self) -> None:
        """Do the arithmetic the last ``handle`` deferred until its messages were sent (pairwise: a served merge).

        Every ``handle`` does it first, so a driver that never calls this
        loses nothing; one that calls it after sending gets replies out sooner.
        """

    def take_stale_share(self) -> float:
        """The share of the model the merges since the last call replaced (``merges_stale`` algorithms; else 0)."""
        return 0.0

    def take_moved(self) -> tuple[list[torch.Tensor], float]:
        """``(terms, scale)``: the last safe point added ``scale * terms`` to the live parameters (no terms: nothing).

        Where ``reports_moves``; once per safe point (the tensors are then the
        caller's to read, and let go), and only read.
        """
        moved, self._moved = self._moved, ([], 0.0)
        return moved

    def checkpoint_state(self) -> dict[str, float]:
        """What a checkpoint must keep of this machine besides the model (push-sum: its weight); {}: nothing."""
        return {}

    def restore_state(self, state: Mapping[str, float]) -> None:
        """Take back what ``checkpoint_state`` gave, before the first safe point (a resumed peer)."""

    def serve_as_is(self) -> None:
        """Before the first safe point: answer partners from the model as it is now (a peer at a rendezvous).

        Only pairwise refuses requests before its first safe point (the model
        might still be replaced); pushes are taken at safe points anyway.
        """

    def hold_until(self, now: float) -> float | None:
        """Flow control: until when the training loop should wait after the last safe point (None: go on).

        Pairwise waits for its reply in flight (its own override); pushing
        algorithms for the receipt of their oldest push (``protocol.receipts``).
        The driver waits on the network side's progress, never past the returned time.
        """
        return self.receipts.hold_until(self._step, now, self.flow_bound())

    # -- helpers for subclasses --------------------------------------------------------------

    def _like(self) -> dict[str, torch.Tensor]:
        return dict(zip(self.names, self.params))

    def _snapshot(self) -> list[torch.Tensor]:
        """A copy of the parameters to keep (pooled copies are for what is sent: ``_frozen``)."""
        return [p.detach().clone() for p in self.params]

    def _frozen(self, values: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Copies of ``values`` to send and remember while they move on, in reused buffers."""
        return self.buffers.copies(values)

    def _encode(self, values: Sequence[torch.Tensor]) -> tuple[dict[str, torch.Tensor], list[torch.Tensor]]:
        """Wire tensors for ``values`` (in host memory), and what a receiver will decode from them (on our device)."""
        if self.poison != 1.0:  # a rogue member: valid tensors, scaled; it keeps its own model sane
            wire = self.codec.encode({n: v * self.poison for n, v in zip(self.names, values)})
            return self.buffers.to_host(wire), list(values)
        wire = self.codec.encode(dict(zip(self.names, values)), pool=self.buffers)
        if self.lossless:
            sent = list(values)
        else:
            decoded = self.codec.decode(wire, like=self._like(), pool=self.buffers)
            sent = [decoded[n] for n in self.names]
        wire = self.buffers.to_host(wire)
        self.stats.buffers = self.buffers.made
        return wire, sent

    def _encode_own(self, values: Sequence[torch.Tensor]) -> tuple[dict[str, torch.Tensor], list[torch.Tensor]] | None:
        """``_encode``, or None if our own model cannot be sent (non-finite: training diverged)."""
        try:
            return self._encode(values)
        except ProtocolError as e:
            self.stats.unsendable += 1
            if self.stats.unsendable & (self.stats.unsendable - 1) == 0:  # 1st, 2nd, 4th, ...: not every step
                log.error("not sending our model (%d times so far): %s; has training diverged?", self.stats.unsendable, e)
            return None

    def _new_xid(self) -> int:
        self._next_xid = (self._next_xid + 1) % (1 << 31)
        return self._next_xid

    def _validated(self, msg: Received) -> list[torch.Tensor] | Rejected:
        """The remote tensors in parameter order, decoded and checked, or why they cannot touch the model.

        The codec's decode checks names, dtypes, shapes and finiteness against
        our own parameters before anything is written.
        """
        try:
            decoded = self.codec.decode(to_device(msg.tensors, self.device), like=self._like(), pool=self.buffers)
        except ProtocolError as e:
            self.stats.rejected += 1
            return Rejected(msg.sender, str(e))
        return [decoded[n] for n in self.names]

    def _staleness_weight(self, msg: Received, symmetric: bool = False) -> float | None:
        """The policy's factor for ``msg`` (None: drop it); counts the drop."""
        s = abs(self._step - msg.step) if symmetric else self._step - msg.step
        weight = self.staleness.weight(s)
        if weight is None:
            self.stats.stale_dropped += 1
        return weight

    def _clip_factor(self, remote: Sequence[torch.Tensor], own: Sequence[torch.Tensor], sender: str = "") -> float | None:
        """Robust mode: the scale (0, 1] for moving by ``remote - own``, None to refuse it; 1 when robust is off."""
        if self.clip is None:
            return 1.0
        factor = self.clip.factor(*norms(remote, own), sender=sender)
        if factor is None:
            self.stats.rejected += 1
        elif factor < 1.0:
            self.stats.clipped += 1
        return factor

    def _record_staleness(self, msg: Received) -> None:
        self.stats.staleness[max(0, self._step - msg.step)] += 1


class PairwiseAveraging(Averaging):
    """AD-PSGD pairwise averaging; requests and replies are handled on the network side (see the module).

    Both ends of an exchange move by the same mixing weight ``a`` toward each
    other (0.5 without staleness weighting): the server picks it from the
    step difference and sends it with its reply, so the two changes still
    sum to zero. With a lossy codec each end moves toward what the other
    decoded, ``x += a * (D(C(x_remote)) - D(C(x_own)))``, which keeps the
    sum zero too.

    ``view`` is our model as others see it: ``base`` (a frozen copy of the
    live parameters taken at the last safe point) plus ``pending`` (the
    merges made since); the live parameters are ``view`` plus the local steps
    taken since that safe point. Snapshots are never written once taken, so
    they go on the wire as they are and their encoding is kept for the next
    message that sends the same model (``_encoded``).
    """

    network_kinds = frozenset({XREQ, XREP, XNAK})
    reports_moves = True  # a safe point adds ``pending`` and nothing else

    def __init__(
        self, params: Mapping[str, torch.Tensor], config: GossipConfig, rng: random.Random, me: str = ""
    ) -> None:
        super().__init__(params, config, rng, me)
        self.rtt = RttEstimator(config.exchange_timeout_min, config.exchange_timeout_max)
        self._base = self._frozen(self.params)  # the live parameters at the last safe point (never written)
        self._view: list[torch.Tensor] | None = self._base  # base + pending, frozen; None: not computed since a merge
        self._pending = PendingMerges(self.params, self.buffers)  # merges not yet added to the live parameters
        self._unsettled: _Served | None = None  # a reply sent whose merge is not computed yet (_settle)
        # the last view encoded, the codec (level) it was encoded at, and the encoding: sent again as it is
        self._encoded: tuple[list[torch.Tensor], str, tuple[dict[str, torch.Tensor], list[torch.Tensor]]] | None = None
        self._inflight: dict[int, _InFlight] = {}  # xid -> our exchange in flight, oldest first
        self._overdue: OrderedDict[int, _InFlight] = OrderedDict()  # timed out, reply still welcome
        self._last_served: _Served | None = None  # the last request served, with its merge: to undo
        self._last_start_step = -(10**9)
        self._avoid_until: dict[str, float] = {}
        self._ready = False  # before our first safe point the model may still be replaced (state transfer)
        self._merged_at_step = 0  # our step at the last merge (completed or served): flow control counts from it
        self._latency: float | None = None  # the link's round trip without queues, from the last safe point

    @property
    def busy(self) -> bool:
        return bool(self._inflight)

    @property
    def view(self) -> list[torch.Tensor]:
        """Our model as partners see it now: ``base`` plus the merges made since (frozen: do not write to it).

        For inspection (tests); like every call into the machine, with the driver's lock held.
        """
        self._settle()
        return self._current()

    @property
    def pending(self) -> list[torch.Tensor]:
        """The merges made since the last safe point, which the next one adds to the live parameters (as ``view``)."""
        self._settle()
        return self._pending.values()

    def serve_as_is(self) -> None:
        if not self._ready:  # nothing merged yet (requests were refused): the model others see is the live one
            self._base = self._view = self._frozen(self.params)  # a downloaded state replaced the parameters in place
            self._ready = True

    def after_send(self) -> None:
        self._settle()

    def _settle(self) -> None:
        served = self._unsettled
        if served is not None:
            self._unsettled = None
            served.delta = self._pending.difference(served.remote, served.sent)  # kept to undo this merge
            self._pending.add(served.delta, served.a)  # ...and held as pending's sum while it is the only merge
            served.remote = served.sent = []  # an undo needs only the delta: let the received frames go

    def hold_until(self, now: float) -> float | None:
        deadlines = [x.expected_by for x in self._live() if x.may_hold and now < x.expected_by]
        if not deadlines or self._step - self._merged_at_step < self.flow_bound():
            return None
        return min(deadlines)  # the driver asks again after each merge: one completed exchange lets the loop go on

    def handle(self, event: Event, now: float) -> list[Action]:
        self._settle()
        if isinstance(event, AtSafePoint):
            return self._tick(event, now)
        if isinstance(event, Received):
            if event.kind == XREQ:
                return self._serve(event)
            if event.kind == XREP:
                return self._complete(event, now)
            if event.kind == XNAK:
                return self._refused(event, now)
            return []  # another algorithm's message (a misconfigured sender): ignore
        if isinstance(event, Undelivered):
            return self._undelivered(event)
        if isinstance(event, MemberGone):
            # A reply it sent before it went may still be on the wire, carrying the other half of its merge: it is
            # applied if it comes; if not, the exchange is given up quietly (its model left the swarm with it).
            for x in [*self._inflight.values(), *self._overdue.values()]:
                if x.partner == event.member:
                    x.partner_gone = True
            return []
        raise TypeError(f"unknown event {event!r}")

    # -- the safe point ----------------------------------------------------------------------

    def _tick(self, tick: AtSafePoint, now: float) -> list[Action]:
        self._at_step(tick.step, now)
        self._latency = tick.latency
        self._ready = True
        self._apply_pending()
        self._expire(now)
        for inflight in list(self._inflight.values()):
            if now >= inflight.expected_by and not inflight.presumed_lost:
                inflight.presumed_lost = True  # far later than replies come: most likely lost
                self.stats.presumed_lost += 1
            if now >= inflight.deadline:
                self.stats.timeouts += 1
                self.rtt.backoff()
                self._link_measured(now - inflight.sent_at, inflight.nbytes)  # it took at least that long
                self._avoid(inflight.partner, now)
                del self._inflight[inflight.xid]
                self._overdue[inflight.xid] = inflight
        while len(self._overdue) >= OVERDUE_KEPT:
            # That many replies outstanding: the oldest is most likely lost, not late (a dropped message, a relay
            # past its budget). Waiting for it would stop this peer averaging for up to OVERDUE_SECONDS (with 1%
            # of messages lost, for good after a few seconds: experiments/latency_loss.py); give it up instead.
            gone = [xid for xid, x in self._overdue.items() if x.partner_gone]
            oldest = gone[0] if gone else next(iter(self._overdue))
            self._abandon(self._overdue.pop(oldest), f"{OVERDUE_KEPT} newer exchanges timed out since")
        k = self.concurrency()
        if len(self._live()) >= k or len(self._inflight) >= 2 * k or tick.step - self._last_start_step < self.config.exchange_every_steps:
            return []
        asked = {x.partner for x in self._inflight.values()}
        partner, healthy = self._pick([p for p in tick.partners if p not in asked], now)
        if partner is None:
            if not tick.partners:
                self._merged_at_step = tick.step  # alone: nobody to drift from, nothing to wait for
            return []
        encoded = self._encode_view()  # == the live parameters: pending was just applied
        if encoded is None:
            return []
        wire, sent = encoded
        xid = self._new_xid()
        share = 1.0 / (k + 1)  # 1/2 with one exchange in flight, 1/(k+1) with up to k
        deadline = now + self.rtt.timeout()
        # Presumed lost a few typical round trips late (rtt.LATE_ROUND_TRIPS), well before its patient timeout:
        # waiting for that on every lost message stalled peers for seconds with 1% of messages lost
        # (experiments/latency_loss.py). One presumed lost holds no one: see _live.
        self._inflight[xid] = _InFlight(xid, partner, sent, now, deadline, self.rtt.presumed_lost_at(now, deadline),
                                        share=share, may_hold=healthy, nbytes=wire_bytes(wire))
        self._last_start_step = tick.step
        self.stats.started += 1
        self.stats.in_flight_most = max(self.stats.in_flight_most, len(self._inflight))
        meta: dict[str, float | int] = {"ver": self.version}
        if share < 0.5:
            meta["a"] = share
        return [SendExchange(partner, XREQ, xid, wire, meta)]

    def concurrency(self) -> int:
        """How many exchanges we may have in flight: ``gossip.exchanges_in_flight``, or as many as the latency takes steps.

        On a far link (a WAN), whose latency alone takes several local steps,
        one exchange per round trip averages too rarely to hold peers on
        skewed shards together; a few at once, each with a smaller weight, do
        (experiments/latency_loss.py). The latency is that of small messages
        (``AtSafePoint.latency``), not the exchanges' own round trip: on a
        near link that is only busy (a shared 100 Mbit/s one), exchanges at
        once share its bytes and each takes as much longer. On a near link
        this is 1.
        """
        if self.config.exchanges_in_flight:
            return self.config.exchanges_in_flight
        steps = self.round_trip_steps(self._latency)
        if steps is None:
            return 1
        return max(1, min(MAX_IN_FLIGHT, math.ceil(steps - ROUND_TRIP_SLACK)))

    def flow_bound(self) -> int:
        """Flow control's bound: ``gossip.max_steps_ahead``, or ``AUTO_STEPS_AHEAD`` and at least a round trip.

        No merge can come sooner than a round trip of the link after the
        request left. Where that alone took more steps than the bound (a far
        link), a peer with few partners to ask waited at most safe points:
        simulated, 4 skewed peers, 10 ms steps, 50 ms each way, the first
        peers lost a quarter of their steps while the swarm gathered, and at
        100 ms each way a peer ran at half speed for the whole run. So the
        automatic bound is the round trip in steps plus ``ROUND_TRIP_STEPS_AHEAD``
        (experiments/latency_loss.py's setting: 50 ms, seeds 0-4, sampled
        every 0.05 s, 2.5 s median to the target against 2.7 s; 100 ms, the
        experiment's seeds 0-2, 3.75-9.25 s against 5.0-9.5 s). On a near
        link nothing changes. On a link far beyond that the bound stops at
        ``MAX_AUTO_STEPS_AHEAD`` and peers compute at the link's pace again:
        real processes (experiments/real_delay.py, 50 ms each way, steps of
        about 1.7 ms, a round trip of 70 of them, seed 0) reached the target
        in 7.1 s with 8, 9.2 s with 16, 7.4 s with 24, and unbounded drifted
        apart until their models were non-finite after 33 s.
        """
        steps = self.round_trip_steps(self._latency)
        if self.config.max_steps_ahead or steps is None:
            return self.max_ahead
        return max(self.max_ahead, min(MAX_AUTO_STEPS_AHEAD, math.ceil(steps) + ROUND_TRIP_STEPS_AHEAD))

    def _committed(self) -> float:
        """The weights our exchanges in flight may still take back of the model we sent, and what we served since.

        A reply moves us by ``a (s_partner - s_sent)``, taking back a share ``a``
        of what we sent; served requests since it left took shares too. While
        the shares add to at most 1 our model still holds what each reply takes
        back, so every merge stays in the convex hull of the models.
        """
        live = self._live()
        return sum(x.share for x in live) + max((x.served_meanwhile for x in live), default=0.0)

    def _live(self) -> list[_InFlight]:
        """Our exchanges in flight not presumed lost.

        One presumed lost holds no one: not the loop (flow control), not a
        place among ``concurrency``, not a share of ``_committed``. Should its
        reply come after all, it is applied, and the shares taken back may
        then add to a little over 1 (rare: most are lost).
        """
        return [x for x in self._inflight.values() if not x.presumed_lost]

    def _apply_pending(self) -> None:
        """Add the merges made since the last safe point to the live parameters, and take a new ``base``."""
        self._pending.add_to(self.params)
        self._moved = self._pending.moved()  # for the drift correction (take_moved): what this safe point added
        self._pending.clear()
        self._base = self._view = self._frozen(self.params)
        # _last_served stays undoable through pending: the network side releases the lock between our reply
        # and its failed send, so a safe point may apply the merge before the Undelivered comes back.

    def _current(self) -> list[torch.Tensor]:
        """``view``, computed once after each merge (the merge itself only adds to ``pending``)."""
        if self._view is None:
            view = self.buffers.like(self.params)
            self._pending.plus(self._base, view)
            self._view = view
        return self._view

    def _encode_view(self) -> tuple[dict[str, torch.Tensor], list[torch.Tensor]] | None:
        """``view`` encoded to send (``_encode_own``); a view sent again is not encoded again (the codecs keep no state)."""
        values = self._current()
        cached = self._encoded
        if cached is not None and cached[0] is values and cached[1] == self.codec.name:
            return cached[2]
        encoded = self._encode_own(values)
        if encoded is not None:
            self._encoded = (values, self.codec.name, encoded)
        return encoded

    def _pick(self, partners: Sequence[str], now: float) -> tuple[str | None, bool]:
        """A partner, preferring those that have not timed out lately; and whether it is one of those."""
        if not partners:
            return None, False
        fresh = [p for p in partners if self._avoid_until.get(p, 0.0) <= now]
        return self.rng.choice(fresh or list(partners)), bool(fresh)

    def _avoid(self, partner: str, now: float) -> None:
        self._avoid_until[partner] = now + 4 * self.rtt.timeout()

    # -- merging (network side) ----------------------------------------------------------------

    def _merged(self) -> None:
        """Note a merge: ``view`` moves (``pending`` takes by how much, now or once the reply is sent: ``_settle``)."""
        self._view = None
        self.version += 1
        self._merged_at_step = self._step

    # -- answering -------------------------------------------------------------------------

    def _serve(self, msg: Received) -> list[Action]:
        if not self._ready:  # our model is not the one we will train yet: the requester asks someone else
            self.stats.busy += 1
            return [SendExchange(msg.sender, XNAK, msg.xid, {})]
        if self.me > msg.sender and any(x.partner == msg.sender for x in self._inflight.values()):
            # We asked each other at the same time. Serving both requests would not average the
            # two models but swap them (each side adds the other's difference twice). The smaller
            # id serves; we refuse, and our own request will be answered.
            self.stats.crossed += 1
            return [SendExchange(msg.sender, XNAK, msg.xid, {})]
        share = min(float(msg.meta.get("a", 0.5)), 1.0 - self._committed())
        if share < MIN_SHARE:
            # Our replies in flight will each take back their share of what we sent (see _committed): serving
            # more now could leave the convex hull of the models (and overshoot). With one exchange in flight
            # at 1/2, one request is served meanwhile.
            self.stats.busy += 1
            return [SendExchange(msg.sender, XNAK, msg.xid, {})]
        remote = self._validated(msg)
        if isinstance(remote, Rejected):
            return [remote, SendExchange(msg.sender, XNAK, msg.xid, {})]
        weight = self._staleness_weight(msg, symmetric=True)  # both ends must agree: |step difference|
        if weight is None:
            return [SendExchange(msg.sender, XNAK, msg.xid, {})]
        encoded = self._encode_reply(msg)
        if encoded is None:
            return [SendExchange(msg.sender, XNAK, msg.xid, {})]
        wire, sent = encoded
        clip = self._clip_factor(remote, sent, msg.sender)
        if clip is None:
            return [Rejected(msg.sender, "difference far beyond recent ones (robust)"), SendExchange(msg.sender, XNAK, msg.xid, {})]
        a = share * weight * clip
        self._last_served = self._unsettled = _Served(msg.xid, msg.sender, remote, sent, a)  # moved by _settle
        self._merged()
        self.stats.served += 1
        self._record_staleness(msg)
        for x in self._live():
            x.served_meanwhile += a
        return [SendExchange(msg.sender, XREP, msg.xid, wire, {"a": a, "ver": self.version})]

    def _encode_reply(self, request: Received) -> tuple[dict[str, torch.Tensor], list[torch.Tensor]] | None:
        """Our model for a reply, with ``auto`` at least as lossy as the request.

        A requester that measured its link slow enough for int8 gets int8 both
        ways, so that its exchanges are as short as its level makes them and
        the trial of that level (``protocol.auto_compression``) measures the
        level, not the partner's. Before, 4 peers on a 100 Mbit/s link ended on
        mixed levels: those at none judged int8 no shorter, because their
        partners answered at none, and went back (experiments/wan.py, skewed
        digits-small, seed 0: 1.32 s to the target against 0.54 s at int8).
        """
        codec = self.codec
        if not isinstance(codec, AutoCodec):
            return self._encode_view()
        own = codec.level
        codec.level = max(own, codec.level_of(request.tensors))
        try:
            return self._encode_view()
        finally:
            codec.level = own

    def _undelivered(self, event: Undelivered) -> list[Action]:
        if event.kind == XREQ:  # our request never left: as a refusal
            return self._refused(Received(event.to, XNAK, event.xid), 0.0)
        served = self._last_served
        if event.kind == XREP and served is not None and served.xid == event.xid and served.to == event.to:
            # The requester will never apply its half: take ours back (pending, or in the model already: the next
            # safe point subtracts it there). handle computed it first (_settle), so its delta is there.
            assert served.delta is not None
            self._pending.add(served.delta, -served.a)
            self._view = None
            self._last_served = None
            self.stats.served -= 1
            self.stats.undelivered += 1
        return []

    def _complete(self, msg: Received, now: float) -> list[Action]:
        inflight = self._inflight.get(msg.xid)
        on_time = inflight is not None and inflight.partner == msg.sender
        if not on_time:
            inflight = self._overdue.get(msg.xid)
            if inflight is None or inflight.partner != msg.sender:
                self.stats.late += 1
                if inflight is None:  # not ours, or abandoned already (counted then)
                    log.debug("a reply from %s to an exchange we do not know (xid %d)", msg.sender, msg.xid)
                return []
            del self._overdue[msg.xid]
            self.stats.late += 1
        else:
            del self._inflight[msg.xid]
        assert inflight is not None
        remote = self._validated(msg)
        if isinstance(remote, Rejected):
            return [remote]
        # The server already moved by this weight; robust mode may move us less (then the pair's sum changes).
        clip = self._clip_factor(remote, inflight.snapshot, msg.sender)
        if clip is None:
            return [Rejected(msg.sender, "difference far beyond recent ones (robust)")]
        a = float(msg.meta.get("a", 0.5)) * clip
        # keep local progress made in flight: x <- x + a * (x_remote - x_sent)
        self._merged()
        self._pending.add_difference(remote, inflight.snapshot, a)
        if now <= inflight.deadline:  # before its timeout (if after its presumed loss): the link as it is now
            self.rtt.observe(now - inflight.sent_at)
            self.stats.round_trip(now - inflight.sent_at, self.rtt.srtt)
            self._link_measured(now - inflight.sent_at, inflight.nbytes)
        self.stats.completed += 1
        self._record_staleness(msg)
        return []

    def _refused(self, msg: Received, now: float) -> list[Action]:
        # A refusal costs no waiting (the partner was busy, or we crossed), so unlike a timeout
        # it does not make us avoid the partner.
        inflight = self._inflight.get(msg.xid)
        if inflight is not None and inflight.partner == msg.sender:
            del self._inflight[msg.xid]
            self.stats.refused += 1
        elif msg.xid in self._overdue and self._overdue[msg.xid].partner == msg.sender:
            del self._overdue[msg.xid]  # refused after all: nothing to wait for
            self.stats.refused += 1
        return []

    # -- overdue exchanges ---------------------------------------------------------------------

    def _expire(self, now: float) -> None:
        self._forget(lambda x: now - x.sent_at > OVERDUE_SECONDS, f"no reply in {OVERDUE_SECONDS:.0f} s")

    def _forget(self, which: Callable[[_InFlight], bool], why: str) -> None:
        for xid in [xid for xid, x in self._overdue.items() if which(x)]:
            self._abandon(self._overdue.pop(xid), why)

    def _abandon(self, exchange: _InFlight, why: str) -> None:
        if exchange.partner_gone:
            log.debug("gave up on the exchange with %s, which is gone (%s)", exchange.partner, why)
            return
        self.stats.abandoned += 1
        log.warning(
            "gave up on the exchange with %s (%s): if its reply still comes, the pair's sum will have moved",
            exchange.partner, why,
        )
