"""What the averaging algorithms and their drivers say to each other: events in, actions out, and the counters.

Every algorithm (``gossiptrain.protocol.algorithms``) is a sans-IO state
machine, ``handle(event, now) -> actions``, driven by ``SafePoint`` and the
peer's network side in a real peer and by the simulator in virtual time. The
drivers, the tests and every algorithm build and read these types, and
``protocol.receipts`` writes ``AveragingStats``; keeping them here, below the
base ``Averaging`` and the algorithms, lets all of those import them without
importing each other (``receipts`` and ``averaging`` did, in a circle).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import torch

from gossiptrain.protocol.rtt import rtt_bucket
from gossiptrain.protocol.staleness import staleness_buckets


#: Scalars an exchange message may carry besides its xid, and their allowed ranges (checked by
#: the node before an event reaches an algorithm): push-sum weight, pairwise mixing weight,
#: sender's out-degree (Metropolis-Hastings weights), sender's model version, edge sequence number, model norm.
META_RANGES: dict[str, tuple[type, float, float]] = {
    "w": (float, 0.0, float(1 << 24)),
    "a": (float, 0.0, 0.5),
    "deg": (int, 0, 1 << 24),
    "ver": (int, 0, (1 << 63) - 1),
    "seq": (int, 0, (1 << 63) - 1),  # top-k neighbour averaging: message number on its edge (0: dense reset)
    "norm": (float, 0.0, 1e300),  # pairwise: the requester's model norm at its last safe point (stability guard)
}


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
    """Counters of one peer's averaging, for its metrics line, ``swarm status`` and the tests.

    Shared by every algorithm and written by the drivers too (flow control's
    waits) and by ``protocol.receipts``, which is why it lives below all of them.
    """

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
    put_back: int = 0  # pairwise: exchanges in flight forgotten because the stability guard put our model back
    settling: int = 0  # pairwise: requests refused while the stability guard let a blow-up settle
    norm_apart: int = 0  # pairwise: requests refused because the two models' norms were far apart (one blew up)
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
    """The mean of a staleness histogram (staleness -> updates); 0 where it is empty."""
    total = sum(histogram.values())
    return sum(s * n for s, n in histogram.items()) / total if total else 0.0
