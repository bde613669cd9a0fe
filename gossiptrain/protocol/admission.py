"""Admission control for joins, and the warning an open swarm gives at start.

Answering a join costs the answerer a decode, a reply and, worse, a new
connection to whatever address the newcomer claims (its reachability
probe, ``gossiptrain.protocol.reachability``). So the coordinator and
every peer give each *source* a token bucket (``JoinLimiter``): a source
may send ``limits.join_burst`` joins at once and ``limits.join_rate_per_source``
a second after that; the excess is dropped and counted, before any work.
A source is the IP the connection came from, as ZeroMQ saw it (an IPv6
host is taken as its whole /64, which one machine usually owns); where the
transport cannot tell (sim://), it is the reply address the join claims.
The number of buckets is bounded (``limits.join_sources_tracked``); the
least recently seen source is forgotten first, which at worst hands it a
fresh burst. This is a per-source limit, not a global one: many sources
together can still send many joins (see SECURITY.md).

Sans-IO: the caller passes the time, so the simulator's virtual clock works.
"""

from __future__ import annotations

import ipaddress
import logging
from collections import OrderedDict

from gossiptrain.config import Limits
from gossiptrain.net.sources import source_of_ip

log = logging.getLogger(__name__)

#: Characters of a claimed reply address kept as a source key (bounds a bucket's memory).
MAX_CLAIMED_SOURCE = 128


class JoinLimiter:
    """A token bucket per source, for a bounded number of sources."""

    def __init__(
        self, rate: float, burst: int, max_sources: int, *, what: str = "joins", knobs: tuple[str, str] = ("join_burst", "join_rate_per_source")
    ) -> None:
        self.rate = rate
        self.burst = float(burst)
        self.max_sources = max_sources
        self.what = what  # for the warning: what is dropped, and the limits fields that set the bucket
        self.knobs = knobs
        self._buckets: OrderedDict[str, tuple[float, float, bool]] = OrderedDict()  # tokens, last seen, warned
        self.dropped = 0

    @classmethod
    def from_limits(cls, limits: Limits) -> "JoinLimiter":
        return cls(limits.join_rate_per_source, limits.join_burst, limits.join_sources_tracked)

    @classmethod
    def for_reports(cls, limits: Limits) -> "JoinLimiter":
        """The coordinator's bucket per source for members' reports (each answered with gossip to the reporter)."""
        return cls(limits.report_rate_per_source, limits.report_burst, limits.join_sources_tracked,
                   what="reports", knobs=("report_burst", "report_rate_per_source"))

    def __len__(self) -> int:
        """Sources tracked now (at most ``max_sources``)."""
        return len(self._buckets)

    def sources(self) -> list[str]:
        """The sources holding a bucket now, least recently seen first: what joins were charged to."""
        return list(self._buckets)

    def allow(self, source: str, now: float) -> bool:
        """Take a token for ``source``; False (and counted) if it has none left."""
        bucket = self._buckets.pop(source, None)
        if bucket is None:
            tokens, warned = self.burst, False
            if len(self._buckets) >= self.max_sources:
                self._buckets.popitem(last=False)  # the least recently seen
        else:
            tokens, last, warned = bucket
            tokens = min(self.burst, tokens + max(0.0, now - last) * self.rate)
        allowed = tokens >= 1.0
        if allowed:
            tokens -= 1.0
        else:
            self.dropped += 1
            if not warned:
                log.warning(
                    "dropping %s from %s: over limits.%s=%d, then limits.%s=%g/s",
                    self.what, source, self.knobs[0], int(self.burst), self.knobs[1], self.rate,
                )
                warned = True
        self._buckets[source] = (tokens, now, warned)  # (re)inserted last: the most recently seen
        return allowed


def join_source(ip: str | None, claimed_addr: str) -> str:
    """The source a join is charged to: the sender's IP (IPv6: its /64), else the address it claims.

    ``ip`` is what the transport saw (``Transport.source_of``); None where it cannot tell (sim://).
    """
    if ip is None:
        return "addr " + claimed_addr[:MAX_CLAIMED_SOURCE]
    try:
        ipaddress.ip_address(ip)
    except ValueError:
        return "ip " + ip[:MAX_CLAIMED_SOURCE]
    return source_of_ip(ip)  # the rule the transport's incoming bound uses too


def warn_open(role: str, address: str) -> None:
    """The warning every process without ``--secure`` logs once at start."""
    log.warning(
        "%s at %s runs an OPEN swarm: anyone who can reach it can join and send parameters, "
        "and traffic is not encrypted. Use --secure on a network you do not fully trust (see SECURITY.md).",
        role, address,
    )
