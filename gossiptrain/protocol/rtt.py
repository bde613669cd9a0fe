"""A smoothed round-trip time and the adaptive timeout it gives (RFC 6298): for exchanges and push receipts."""

from __future__ import annotations

#: An answer this many typical round trips late (or past the timeout RFC 6298 would compute from the answers that
#: came) is presumed lost: ``RttEstimator.late_after``. Its timeout, which backs off and starts at a guess of
#: seconds, stays what makes it overdue; the presumption only stops others waiting for it.
LATE_ROUND_TRIPS = 2.0


def smoothed(srtt: float | None, rttvar: float, sample: float) -> tuple[float, float]:
    """Jacobson's smoothed round trip and its variation after one more ``sample`` (RFC 6298): the first sample
    sets them (its variation half of it)."""
    if srtt is None:
        return sample, sample / 2
    return 0.875 * srtt + 0.125 * sample, 0.75 * rttvar + 0.25 * abs(srtt - sample)


class RttEstimator:
    """Smoothed round-trip time and variance (RFC 6298) giving an adaptive timeout."""

    def __init__(self, floor: float, ceiling: float) -> None:
        self.floor, self.ceiling = floor, ceiling
        self.srtt: float | None = None
        self.rttvar = 0.0
        # The smoothed round trip of answers that came, which timeouts do not inflate: how long an answer
        # usually takes (``backoff`` makes the timeout patient; this stays what the link does)
        self.typical: float | None = None

    def observe(self, rtt: float) -> None:
        self.typical = rtt if self.typical is None else 0.875 * self.typical + 0.125 * rtt
        self.srtt, self.rttvar = smoothed(self.srtt, self.rttvar, rtt)

    def late_after(self) -> float | None:
        """Seconds after which an answer is presumed lost (``LATE_ROUND_TRIPS``); None before any answer came."""
        typical = self.typical
        if typical is None:
            return None
        return max(LATE_ROUND_TRIPS * typical, typical + 4 * self.rttvar)

    def presumed_lost_at(self, now: float, deadline: float) -> float:
        """When an answer to a message sent ``now`` is presumed lost: ``late_after`` from now, never past ``deadline``
        (the timeout, which stays what makes it overdue); the deadline itself before any answer came."""
        late = self.late_after()
        return deadline if late is None else min(deadline, now + late)

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


#: How long a minimum round trip stands before newer samples replace it (BBR keeps its min_rtt 10 s as well).
MIN_RTT_WINDOW_S = 10.0


class MinRtt:
    """The shortest round trip of the last ``MIN_RTT_WINDOW_S`` (to about a window): the link's latency, queues excluded.

    A smoothed round trip grows with the bytes queued ahead of a message; the
    minimum of small messages over a few seconds does not, so it tells a far
    link (a WAN) from a busy one (a shared 100 Mbit/s link).
    """

    def __init__(self, window: float = MIN_RTT_WINDOW_S) -> None:
        self.window = window
        self._current: tuple[float, float] | None = None  # (shortest, when its window began)
        self._previous: float | None = None  # the shortest of the window before

    def observe(self, rtt: float, now: float) -> None:
        current = self._current
        if current is None or now - current[1] >= self.window:
            self._previous = current[0] if current is not None else None
            self._current = (rtt, now)
        elif rtt < current[0]:
            self._current = (rtt, current[1])

    @property
    def value(self) -> float | None:
        """The shortest round trip of this window and the one before (None before any sample)."""
        current = self._current[0] if self._current is not None else None
        if self._previous is None or current is None:
            return current if current is not None else self._previous
        return min(self._previous, current)
