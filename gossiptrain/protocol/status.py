"""What ``gossiptrain status`` and ``gossiptrain dashboard`` learn of a member: asked of the member itself.

A visitor first asks any member (or the coordinator) who is alive
(``query`` -> ``roster``, ``gossiptrain.protocol.finish``), then sends each
member a ``status?`` carrying the run's fingerprint; each answers with one
``status``: a fixed set of numbers about itself (``MemberStatus``), never a
list that grows with the swarm (its partners are capped at
``MAX_PARTNERS``). So an answer is bounded in size whatever the swarm's
size, nothing is piggybacked on training traffic, and a member that is
never asked spends nothing. Asks are rate limited per source like queries
(``StatusAnswerer``): a tool polling too fast, or a flood of forged asks,
is dropped unanswered.

The answer is built on the member's network thread from counters its
training loop leaves behind (``gossiptrain.runtime.peer``): answering never
waits for, or locks, the training loop, so a hung or hostile visitor costs
training nothing. ``idle_s`` (seconds since the loop's last safe point) is
what shows a member whose network side answers while its loop is stuck.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any, Mapping

from gossiptrain.config import Limits
from gossiptrain.errors import ProtocolError
from gossiptrain.protocol.admission import JoinLimiter

JOINING, TRAINING, FINAL, DONE = "joining", "training", "final", "done"
PHASES = (JOINING, TRAINING, FINAL, DONE)
MAX_PARTNERS = 16  # topology neighbours named in one answer (the dashboard draws the graph from them)
MAX_ID_CHARS = 128  # a member id longer than this is not a member's
RATE_WINDOW_S = 1.0  # exchanges per second are measured over at least this long

_INTS = ("shard", "step", "samples", "members", "exchanges", "bytes_sent", "bytes_received")
_FLOATS = ("exchanges_per_s", "staleness_mean", "rtt_ms", "idle_s", "uptime_s")
_OPTIONAL_FLOATS = ("loss", "test_loss", "test_acc")
_OPTIONAL_INTS = ("backed_off", "restores")  # 0 where a member of an older version does not say
_LEASE_INTS = ("lease_epoch", "lease_chunks_done")  # None where a member trains a fixed shard (data.mode = shards)


@dataclass(frozen=True)
class MemberStatus:
    """One member as it reports itself (``id`` and ``addr`` are where the answer came from, not claims)."""

    id: str
    addr: str
    phase: str = TRAINING
    shard: int = 0
    step: int = 0
    samples: int = 0
    members: int = 1  # its view, itself included
    exchanges: int = 0  # completed and served
    exchanges_per_s: float = 0.0
    bytes_sent: int = 0
    bytes_received: int = 0
    staleness_mean: float = 0.0  # steps, of the updates it merged
    rtt_ms: float = 0.0  # smoothed exchange round trip
    idle_s: float = 0.0  # since its training loop's last safe point
    uptime_s: float = 0.0
    loss: float | None = None  # what its loop last reported (``Peer.report``); None if it reports nothing
    test_loss: float | None = None
    test_acc: float | None = None
    backed_off: int = 0  # added methods its stability guard has turned off now (gossiptrain.protocol.stability)
    restores: int = 0  # times its model became non-finite and was restored
    lease_epoch: int | None = None  # leased data: the swarm's epoch as this member sees it (gossiptrain.protocol.leases)
    lease_chunks_done: int | None = None  # ...and the chunks of it done
    partners: tuple[str, ...] = field(default=())

    def to_body(self) -> dict[str, Any]:
        """The wire body: every field but the id and address, which the message itself carries."""
        body = asdict(self)
        del body["id"], body["addr"]
        body["partners"] = list(self.partners[:MAX_PARTNERS])
        return body

    @classmethod
    def from_body(cls, sender: str, addr: str, body: Any) -> "MemberStatus":
        """Validate a ``status`` body; anything malformed or out of range is a ProtocolError."""
        if not isinstance(body, dict):
            raise ProtocolError("a status body is a map")
        values: dict[str, Any] = {}
        for name in _INTS:
            v = body.get(name)
            if type(v) is not int or v < 0:
                raise ProtocolError(f"status: {name} must be an int >= 0")
            values[name] = v
        for name in _FLOATS:
            values[name] = _number(body.get(name), name)
        for name in _OPTIONAL_INTS:
            v = body.get(name, 0)
            if type(v) is not int or v < 0:
                raise ProtocolError(f"status: {name} must be an int >= 0")
            values[name] = v
        for name in _LEASE_INTS:
            v = body.get(name)
            if v is not None and (type(v) is not int or v < 0):
                raise ProtocolError(f"status: {name} must be an int >= 0 or absent")
            values[name] = v
        for name in _OPTIONAL_FLOATS:
            v = body.get(name)
            values[name] = None if v is None else _number(v, name, signed=name == "loss")
        phase, partners = body.get("phase"), body.get("partners")
        if phase not in PHASES:
            raise ProtocolError(f"status: phase must be one of {', '.join(PHASES)}")
        if (
            not isinstance(partners, list) or len(partners) > MAX_PARTNERS
            or not all(isinstance(p, str) and 0 < len(p) <= MAX_ID_CHARS for p in partners)
        ):
            raise ProtocolError(f"status: partners must be a list of at most {MAX_PARTNERS} member ids")
        return cls(sender, addr, phase=phase, partners=tuple(partners), **values)


def _number(v: Any, name: str, *, signed: bool = False) -> float:
    if type(v) not in (int, float) or not math.isfinite(v) or (v < 0 and not signed):
        raise ProtocolError(f"status: {name} must be a finite number" + ("" if signed else " >= 0"))
    return float(v)


class RecentRate:
    """Events per second over the last window of at least ``RATE_WINDOW_S`` (since the start until then)."""

    def __init__(self, started: float) -> None:
        self._mark = (started, 0)
        self._value: float | None = None

    def update(self, now: float, count: int) -> float:
        at, seen = self._mark
        if now - at >= RATE_WINDOW_S:
            self._value = (count - seen) / (now - at)
            self._mark = (now, count)
        elif self._value is None:  # not one window yet: the mean since the start
            return count / max(now - at, 1e-9)
        return self._value


class StatusAnswerer:
    """A member's side: who may be answered now (a token bucket per source), and the exchange rate."""

    def __init__(self, limits: Limits, started: float) -> None:
        self.started = started
        self._limiter = JoinLimiter(
            limits.join_rate_per_source, limits.join_burst, limits.join_sources_tracked, what="status asks",
        )
        self._rate = RecentRate(started)

    @property
    def throttled(self) -> int:
        """Asks dropped over their source's rate (the limiter counts them)."""
        return self._limiter.dropped

    def answer(self, source: str, now: float, status: Mapping[str, Any]) -> dict[str, Any] | None:
        """The ``status`` body for an ask from ``source``, or None to drop it (over its rate).

        ``status`` holds ``MemberStatus``'s fields as the runtime read them
        (``id`` and ``addr`` aside); the rate and the uptime are added here.
        """
        if not self._limiter.allow(source, now):
            return None
        fields = {k: round(v, 4) if isinstance(v, float) else v for k, v in status.items()}  # 4 decimals say enough
        fields["exchanges_per_s"] = round(self._rate.update(now, int(fields.get("exchanges", 0))), 3)
        fields["uptime_s"] = round(max(0.0, now - self.started), 3)
        return MemberStatus("", "", **fields).to_body()
