"""Asynchronous pairwise averaging (AD-PSGD) as a sans-IO state machine.

One exchange: the initiator snapshots its parameters ``s_a`` and sends them
to a partner; the partner replies with its own snapshot ``s_b`` and moves to
the average at once; when the reply arrives the initiator adds
``(s_b - s_a) / 2``. Adding the difference instead of overwriting with the
average keeps the local steps the initiator took while the exchange was in
flight (Lian et al., AD-PSGD). The two changes sum to zero, so the swarm's
mean parameter is conserved by every completed exchange.

At most one exchange is in flight per peer. Its timeout adapts to measured
round trips (as TCP's RTO does), so a dead or slow partner costs one timeout
and is then avoided for a while; it never blocks training.

The machine is driven at the trainer's safe points (between optimizer
steps): it reads and writes the live parameters there and nowhere else, and
returns ``SendExchange`` actions for the driver to put on the wire.
"""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass, field
from typing import Mapping, Sequence

import torch

from .config import GossipConfig

XREQ, XREP, XNAK = "xreq", "xrep", "xnak"


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
        from .errors import ProtocolError

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
class Tick:
    """A safe point after local step ``step``; ``partners`` are the topology's neighbours now."""

    step: int
    partners: Sequence[str]


@dataclass(frozen=True)
class Received:
    """An exchange message from ``sender`` (kind xreq, xrep or xnak), already decoded."""

    sender: str
    kind: str
    xid: int
    tensors: Mapping[str, torch.Tensor] = field(default_factory=dict)
    step: int = 0  # the sender's local step when it sent this


Event = Tick | Received

# -- actions -----------------------------------------------------------------------------


@dataclass(frozen=True)
class SendExchange:
    """Put an exchange message on the wire to member ``to``."""

    to: str
    kind: str
    xid: int
    tensors: Mapping[str, torch.Tensor]


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
    refused: int = 0  # partner answered xnak (busy)
    late: int = 0  # replies that arrived after their timeout
    crossed: int = 0  # requests refused because we had asked the same partner at the same time
    rejected: int = 0  # updates refused by validation
    rtt_ms: float = 0.0  # smoothed round trip of completed exchanges, request sent to reply applied
    # staleness (our step minus the sender's step, floored at 0) -> applied updates
    staleness: Counter[int] = field(default_factory=Counter)

    def to_dict(self) -> dict[str, int]:
        out = {k: v for k, v in self.__dict__.items() if k != "staleness"}
        out["staleness_mean"] = mean_staleness(self.staleness)
        return out


def mean_staleness(histogram: Counter[int]) -> float:
    total = sum(histogram.values())
    return sum(s * n for s, n in histogram.items()) / total if total else 0.0


@dataclass
class _InFlight:
    xid: int
    partner: str
    snapshot: list[torch.Tensor]
    sent_at: float
    deadline: float


class RttEstimator:
    """Smoothed round-trip time and variance (RFC 6298) giving an adaptive timeout."""

    def __init__(self, floor: float, ceiling: float) -> None:
        self.floor, self.ceiling = floor, ceiling
        self.srtt: float | None = None
        self.rttvar = 0.0

    def observe(self, rtt: float) -> None:
        if self.srtt is None:
            self.srtt, self.rttvar = rtt, rtt / 2
        else:
            self.rttvar = 0.75 * self.rttvar + 0.25 * abs(self.srtt - rtt)
            self.srtt = 0.875 * self.srtt + 0.125 * rtt

    def timeout(self) -> float:
        if self.srtt is None:
            guess = max(self.floor, min(self.ceiling, 2.0))
            return guess
        return max(self.floor, min(self.ceiling, self.srtt + 4 * self.rttvar))

    def backoff(self) -> None:
        """After a timeout, be more patient next time (the partner or network may be slow)."""
        self.srtt = min(self.ceiling, (self.srtt or self.floor) * 2)


class PairwiseAveraging:
    """AD-PSGD pairwise averaging over the live ``params`` (mutated in place at safe points)."""

    def __init__(
        self, params: Mapping[str, torch.Tensor], config: GossipConfig, rng: random.Random, me: str = ""
    ) -> None:
        self.me = me  # our member id: breaks the tie when two peers start an exchange with each other
        self.names = list(params)
        self.params = [p for p in params.values()]
        self.spec = ParamSpec.of(params)
        self.config = config
        self.rng = rng
        self.stats = AveragingStats()
        self.rtt = RttEstimator(config.exchange_timeout_min, config.exchange_timeout_max)
        self._inflight: _InFlight | None = None
        self._next_xid = rng.getrandbits(31)
        self._last_start_step = -(10**9)
        self._step = 0  # our latest local step, from the last Tick
        self._avoid_until: dict[str, float] = {}

    @property
    def busy(self) -> bool:
        return self._inflight is not None

    def handle(self, event: Event, now: float) -> list[Action]:
        if isinstance(event, Tick):
            return self._tick(event, now)
        if isinstance(event, Received):
            if event.kind == XREQ:
                return self._serve(event)
            if event.kind == XREP:
                return self._complete(event, now)
            if event.kind == XNAK:
                return self._refused(event, now)
        raise TypeError(f"unknown event {event!r}")

    # -- initiating ------------------------------------------------------------------------

    def _tick(self, tick: Tick, now: float) -> list[Action]:
        self._step = tick.step
        inflight = self._inflight
        if inflight is not None:
            if now < inflight.deadline:
                return []
            self.stats.timeouts += 1
            self.rtt.backoff()
            self._avoid(inflight.partner, now)
            self._inflight = None
        if tick.step - self._last_start_step < self.config.exchange_every_steps:
            return []
        partner = self._pick(tick.partners, now)
        if partner is None:
            return []
        snapshot = self._snapshot()
        xid = self._new_xid()
        self._inflight = _InFlight(xid, partner, snapshot, now, now + self.rtt.timeout())
        self._last_start_step = tick.step
        self.stats.started += 1
        return [SendExchange(partner, XREQ, xid, dict(zip(self.names, snapshot)))]

    def _pick(self, partners: Sequence[str], now: float) -> str | None:
        if not partners:
            return None
        fresh = [p for p in partners if self._avoid_until.get(p, 0.0) <= now]
        return self.rng.choice(fresh or list(partners))

    def _avoid(self, partner: str, now: float) -> None:
        self._avoid_until[partner] = now + 4 * self.rtt.timeout()

    # -- answering -------------------------------------------------------------------------

    def _serve(self, msg: Received) -> list[Action]:
        inflight = self._inflight
        if inflight is not None and inflight.partner == msg.sender and self.me > msg.sender:
            # We asked each other at the same time. Serving both requests would not average the
            # two models but swap them (each side adds the other's difference twice). The smaller
            # id serves; we refuse, and our own request will be answered.
            self.stats.crossed += 1
            return [SendExchange(msg.sender, XNAK, msg.xid, {})]
        remote = self._validated(msg)
        if isinstance(remote, Rejected):
            return [remote, SendExchange(msg.sender, XNAK, msg.xid, {})]
        snapshot = self._snapshot()
        with torch.no_grad():
            # x <- (x + x_remote) / 2, in place (x == snapshot now, so this is x + (x_remote - snapshot) / 2)
            torch._foreach_lerp_(self.params, remote, 0.5)
        self.stats.served += 1
        self.stats.staleness[max(0, self._step - msg.step)] += 1
        return [SendExchange(msg.sender, XREP, msg.xid, dict(zip(self.names, snapshot)))]

    def _complete(self, msg: Received, now: float) -> list[Action]:
        inflight = self._inflight
        if inflight is None or inflight.xid != msg.xid or inflight.partner != msg.sender:
            self.stats.late += 1
            return []
        remote = self._validated(msg)
        self._inflight = None
        if isinstance(remote, Rejected):
            return [remote]
        with torch.no_grad():
            # keep local progress made in flight: x <- x + (x_remote - x_sent) / 2, without temporaries
            torch._foreach_add_(self.params, remote, alpha=0.5)
            torch._foreach_add_(self.params, inflight.snapshot, alpha=-0.5)
        self.rtt.observe(now - inflight.sent_at)
        self.stats.rtt_ms = (self.rtt.srtt or 0.0) * 1000
        self.stats.completed += 1
        self.stats.staleness[max(0, self._step - msg.step)] += 1
        return []

    def _refused(self, msg: Received, now: float) -> list[Action]:
        # A refusal costs no waiting (the partner was busy, or we crossed), so unlike a timeout
        # it does not make us avoid the partner.
        inflight = self._inflight
        if inflight is not None and inflight.xid == msg.xid and inflight.partner == msg.sender:
            self._inflight = None
            self.stats.refused += 1
        return []

    # -- helpers ---------------------------------------------------------------------------

    def _snapshot(self) -> list[torch.Tensor]:
        return [p.detach().clone() for p in self.params]

    def _new_xid(self) -> int:
        self._next_xid = (self._next_xid + 1) % (1 << 31)
        return self._next_xid

    def _validated(self, msg: Received) -> list[torch.Tensor] | Rejected:
        """The remote tensors in parameter order, or why they cannot touch the model."""
        if list(msg.tensors) != self.names:
            self.stats.rejected += 1
            return Rejected(msg.sender, "parameter names differ from ours")
        out = []
        for p, name in zip(self.params, self.names):
            t = msg.tensors[name]
            if t.shape != p.shape or t.dtype != p.dtype:
                self.stats.rejected += 1
                return Rejected(msg.sender, f"{name}: got {t.dtype} {list(t.shape)}, want {p.dtype} {list(p.shape)}")
            out.append(t)
        if not all(bool(torch.isfinite(t).all()) for t in out):  # one pass; rejected before any write
            self.stats.rejected += 1
            return Rejected(msg.sender, "non-finite values")
        return out
