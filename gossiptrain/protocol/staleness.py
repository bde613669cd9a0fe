"""How much a received model counts, given how stale it is.

Asynchronous peers merge models that were sent some steps ago. Staleness is
the step difference between receiver and sender (every message carries the
sender's step). A policy turns it into a weight in (0, 1] that scales the
mixing weight the algorithm would otherwise use, or refuses the update when
it is beyond a bound:

- ``constant``: weight 1 (plain AD-PSGD / D-PSGD).
- ``polynomial``: weight 1 / (1 + s) ** exponent (as in asynchronous SGD
  with staleness-aware learning rates; exponent 0.5 is a common choice).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

WEIGHTINGS = ("constant", "polynomial")


@dataclass(frozen=True)
class StalenessPolicy:
    weighting: str = "constant"
    exponent: float = 0.5  # polynomial only
    bound: int = 0  # updates more than this many steps stale are dropped; 0: no bound

    def __post_init__(self) -> None:
        if self.weighting not in WEIGHTINGS:
            raise ValueError(f"unknown staleness weighting {self.weighting!r}; known: {', '.join(WEIGHTINGS)}")
        if not self.exponent >= 0:
            raise ValueError(f"staleness exponent must be >= 0, got {self.exponent}")
        if self.bound < 0:
            raise ValueError(f"staleness bound must be >= 0 (0: none), got {self.bound}")

    def weight(self, staleness: int) -> float | None:
        """The factor for an update ``staleness`` steps old, or None if it must be dropped."""
        s = max(0, staleness)
        if self.bound and s > self.bound:
            return None
        if self.weighting == "constant" or s == 0:
            return 1.0
        return float((1.0 + s) ** -self.exponent)


def staleness_buckets(histogram: Counter[int]) -> dict[str, int]:
    """The histogram in power-of-two buckets ("0", "1", "2-3", "4-7", ...): small enough for every metrics line."""
    out: dict[str, int] = {}
    for s, n in sorted(histogram.items()):
        lo = 0 if s == 0 else 1 << (s.bit_length() - 1)
        hi = 0 if s == 0 else (lo << 1) - 1
        key = str(lo) if lo == hi else f"{lo}-{hi}"
        out[key] = out.get(key, 0) + n
    return out


def bucket_bounds(key: str) -> tuple[int, int]:
    """(lowest, highest) staleness of a ``staleness_buckets`` key: "0" -> (0, 0), "4-7" -> (4, 7)."""
    lo, _, hi = key.partition("-")
    return int(lo), int(hi or lo)
