"""How long things take here: the probe timeouts measured from round trips, and Lifeguard's local health.

A probe is a ping that must be acked within a timeout derived from
measured round-trip times (RFC 6298's, as TCP's): each member's own where
we measured it (a swarm may mix near and far members), else the median of
the last ``RTO_SAMPLES`` members measured, so that one slow member stretches
the probes of itself, not everyone's. A member that answers late on purpose
gets no further than ``MAX_RTO_PERIODS`` periods. The protocol period
stretches to hold a probe's direct timeout and the indirect probes' two
legs.

Lifeguard's local health multiplier (memberlist's awareness, Dadgar et al.
2018): a member that keeps failing probes or has to refute suspicions of
itself raises it, which stretches its own periods and timeouts instead of
letting it accuse healthy members; probes answered in time lower it again.
"""

from __future__ import annotations

import statistics
from collections import deque

from gossiptrain.config import MembershipConfig
from gossiptrain.protocol.rtt import MinRtt, smoothed

#: A probe's verdict is due by this share of its period; the rest is slack before the next probe starts.
PROBE_SHARE = 0.9
#: A measured timeout is at most this many protocol periods (``heartbeat_interval``): a member that answers
#: late on purpose stretches the probes of itself, and of others only this far.
MAX_RTO_PERIODS = 4
#: The swarm's timeout is the median of the last this many members' (``Timing.rto``): one slow member
#: stretches the probes of itself, not everyone's.
RTO_SAMPLES = 16

#: A smoothed round trip and its variation (``gossiptrain.protocol.rtt.smoothed``).
Estimate = tuple[float, float]


class Timing:
    """Lifeguard's health multiplier and the timeouts of the round trips measured; knows no member, only estimates."""

    def __init__(self, config: MembershipConfig) -> None:
        self.config = config
        self.health = 0  # Lifeguard's local health multiplier, 0 (healthy) .. config.max_health
        self._rtos: deque[float] = deque(maxlen=RTO_SAMPLES)  # timeouts of the last members measured (rto)
        self._median_rto: float | None = None  # their median
        # The shortest direct probe round trip lately: the link's latency (averaging keeps more exchanges in flight
        # on a far link: PairwiseAveraging.concurrency)
        self.min_rtt = MinRtt()

    # -- health ----------------------------------------------------------------------------

    def struggling(self) -> None:
        """A probe nobody answered, or a suspicion of us to refute: others could not hear us, so slow down."""
        self.health = min(self.config.max_health, self.health + 1)

    def recovering(self) -> None:
        """A probe answered in time."""
        self.health = max(0, self.health - 1)

    # -- timeouts --------------------------------------------------------------------------

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
        rto = self.rto(None)
        needed = 0.0 if rto is None else 3 * max(rto, self.config.min_probe_timeout) / PROBE_SHARE
        return max(self.config.heartbeat_interval, needed) * (1 + self.health)

    def probe_timeout(self, estimate: Estimate | None = None) -> float:
        """How long a direct ping may take: the measured RTT plus four deviations (as TCP), at least twice the RTT.

        A member's own round trips (``estimate``) where we measured them (a
        swarm may mix near and far members), else the median timeout of the
        last members measured; before any measurement, half a period.
        Stretched by the health multiplier.
        """
        c = self.config
        rto = self.rto(estimate)
        if rto is None:
            rto = c.heartbeat_interval / 2
        return max(rto, c.min_probe_timeout) * (1 + self.health)

    def probe_span(self, estimate: Estimate | None, period: float) -> float:
        """Seconds from a probe of a member (its round trips ``estimate``) to its verdict: its direct timeout, then the
        two legs of the indirect probes; never under ``PROBE_SHARE`` of ``period``."""
        if self.rto(estimate) is None:
            return PROBE_SHARE * period
        return max(PROBE_SHARE * period, 2 * self.probe_timeout(estimate) + self.probe_timeout())

    def stretch(self) -> float:
        """How many nominal periods one takes now for the round trips (1 on a near link): suspicions, which wait for
        refutations to travel, wait that much longer."""
        return self.period() / (1 + self.health) / self.config.heartbeat_interval

    def rto(self, estimate: Estimate | None) -> float | None:
        """RFC 6298's timeout from a member's round trips ``estimate``; for None (a member never measured), the median
        of the last ``RTO_SAMPLES`` members measured; None before any measurement."""
        if estimate is not None:
            return self.rto_of(estimate)
        return self._median_rto

    def rto_of(self, estimate: Estimate) -> float:
        """The timeout of a smoothed round trip and its variation, at least twice the round trip (as TCP's), at most
        ``MAX_RTO_PERIODS`` protocol periods: a member that answers late on purpose gets no further."""
        srtt, rttvar = estimate
        return min(srtt + max(4 * rttvar, srtt), MAX_RTO_PERIODS * self.config.heartbeat_interval)

    # -- measuring -------------------------------------------------------------------------

    def filling(self) -> bool:
        """Fewer than ``RTO_SAMPLES`` members measured yet: the swarm's timeout still takes candidates' answers."""
        return len(self._rtos) < RTO_SAMPLES

    def measured(self, estimate: Estimate | None, rtt: float) -> Estimate:
        """A member (its round trips so far ``estimate``, None if never measured) answered our own ping after ``rtt``
        seconds: returns its new estimate, whose timeout the swarm's median now counts."""
        estimate = smoothed(*(estimate if estimate is not None else (None, 0.0)), rtt)
        self._rtos.append(self.rto_of(estimate))
        self._median_rto = statistics.median(self._rtos)
        return estimate
