"""A smoothed round-trip time and the adaptive timeout it gives (RFC 6298): for exchanges and push receipts."""

from __future__ import annotations


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
        # Before any measurement, double the guess we timed out with (not the floor: that was shorter than it).
        self.srtt = min(self.ceiling, (self.srtt if self.srtt is not None else self.timeout()) * 2)


#: Upper bounds (seconds) of the round-trip histogram peers keep and export (``gossiptrain_exchange_round_trip_seconds``).
RTT_BUCKETS_S = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0)


def rtt_bucket(seconds: float) -> float:
    """The smallest bucket bound at or above ``seconds`` (``inf`` past the last)."""
    for bound in RTT_BUCKETS_S:
        if seconds <= bound:
            return bound
    return float("inf")
