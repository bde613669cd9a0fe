"""The deterministic topology generators: rings, tori, cubes, exponential and base-(k+1) graphs.

Every generator is defined for every n >= 1, not only for the sizes the graph
is famous for (powers of two, perfect squares), because churn makes the member
count arbitrary. Seeded random graphs live in random_graphs.py.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

from topologies.base import Topology
from topologies.cayley import Cayley, cayley


def _ceil_log2(n: int) -> int:
    """ceil(log2 n) for n >= 1, exactly (no float rounding at large powers of two)."""
    return (n - 1).bit_length()


def _ceil_log(n: int, base: int) -> int:
    """Digits needed to write 0..n-1 in `base`: the smallest L with base^L >= n, exactly."""
    digits, reach = 0, 1
    while reach < n:
        digits, reach = digits + 1, reach * base
    return digits


@dataclass(frozen=True)
class Ring(Topology):
    """Undirected cycle: i talks to i-1 and i+1 (mod n)."""

    name = "ring"

    def _out(self, n: int, i: int, round: int) -> Iterable[int]:
        return ((i - 1) % n, (i + 1) % n)

    def _cayley(self, n: int, round: int) -> Cayley | None:
        return cayley((n,), [(-1,), (1,)])


@dataclass(frozen=True)
class Torus(Topology):
    """2-D torus laid out row-major on ceil(sqrt n) columns; every row and column is a ring.

    When the columns divide n this is the usual r x c torus (4 x 4 for n = 16).
    Otherwise the last row is short: it wraps within its own members and the
    columns it lacks wrap one row earlier. Column 0 is always full, so the
    graph stays connected, and degree never exceeds 4.
    """

    name = "torus"

    def _out(self, n: int, i: int, round: int) -> Iterable[int]:
        cols = math.isqrt(n - 1) + 1  # ceil(sqrt(n)) for n >= 1
        row, col = divmod(i, cols)
        row_len = min(cols, n - row * cols)
        col_len = (n - 1 - col) // cols + 1  # rows that have a member in this column
        return (
            row * cols + (col - 1) % row_len,
            row * cols + (col + 1) % row_len,
            ((row - 1) % col_len) * cols + col,
            ((row + 1) % col_len) * cols + col,
        )

    def _cayley(self, n: int, round: int) -> Cayley | None:
        cols = math.isqrt(n - 1) + 1
        if n % cols:
            return None  # a short last row: not the same graph from every member
        return cayley((n // cols, cols), [(0, -1), (0, 1), (-1, 0), (1, 0)])


@dataclass(frozen=True)
class Hypercube(Topology):
    """Undirected hypercube: i talks to i XOR 2^k for each k with that index < n.

    For n not a power of two this is the induced subgraph on 0..n-1, which is
    still connected: clearing i's highest set bit gives a smaller index, so
    every member has a path down to 0.
    """

    name = "hypercube"

    def _out(self, n: int, i: int, round: int) -> Iterable[int]:
        return (j for k in range(_ceil_log2(n)) if (j := i ^ (1 << k)) < n)

    def _cayley(self, n: int, round: int) -> Cayley | None:
        if n & (n - 1):
            return None  # not a power of two: an induced subgraph, not the same from every member
        bits = _ceil_log2(n)  # XOR with 2^k is adding 1 to binary digit k in Z_2^bits
        return cayley((2,) * bits, [tuple(int(a == b) for a in range(bits)) for b in range(bits)]) if bits else cayley((1,), [])


@dataclass(frozen=True)
class Exponential(Topology):
    """Static exponential graph (Ying et al. 2021): i -> i + 2^k mod n, k < ceil(log2 n).

    Directed, out-degree ceil(log2 n) (less where hops collide for small n),
    with a spectral gap that shrinks only logarithmically in n.
    """

    name = "exponential"
    directed = True

    def _out(self, n: int, i: int, round: int) -> Iterable[int]:
        return ((i + (1 << k)) % n for k in range(_ceil_log2(n)))

    def _cayley(self, n: int, round: int) -> Cayley | None:
        return cayley((n,), [((1 << k) % n,) for k in range(_ceil_log2(n))])


@dataclass(frozen=True)
class Complete(Topology):
    """Every other member; gossip over it is "pick a random peer"."""

    name = "complete"

    def _out(self, n: int, i: int, round: int) -> Iterable[int]:
        return range(n)

    def _cayley(self, n: int, round: int) -> Cayley | None:
        return cayley((n,), [(j,) for j in range(1, n)])


@dataclass(frozen=True)
class Star(Topology):
    """Member 0 is the hub; everyone else talks only to it.

    Diameter 2 and the fewest edges of any connected graph, but the hub carries
    all traffic: a baseline that shows what a central server costs.
    """

    name = "star"

    def _out(self, n: int, i: int, round: int) -> Iterable[int]:
        return range(1, n) if i == 0 else (0,)

    def _mean_degree(self, n: int, round: int) -> float:
        return 2.0 * (n - 1) / n


@dataclass(frozen=True)
class OnePeerExponential(Topology):
    """One-peer exponential graph (Ying et al. 2021): at round r, i -> i + 2^(r mod tau) mod n.

    tau = ceil(log2 n) is the period. One message per member per round, yet
    for n a power of two, averaging with weight 1/2 over one period gives the
    exact average; for other n the union over a period is the static
    exponential graph, so it still mixes.
    """

    name = "one-peer-exponential"
    directed = True
    time_varying = True

    def _period(self, n: int) -> int:
        return max(1, _ceil_log2(n))

    def _out(self, n: int, i: int, round: int) -> Iterable[int]:
        return ((i + (1 << (round % self._period(n)))) % n,)

    def _cayley(self, n: int, round: int) -> Cayley | None:
        return cayley((n,), [((1 << (round % self._period(n))) % n,)])


@dataclass(frozen=True)
class BaseK(Topology):
    """Base-(k+1) graph (Takezawa et al. 2023), at most k neighbours per round.

    Members are written in base b = k + 1 with L = ceil(log_b n) digits. In
    round r, i talks to the members that differ from it only in digit r mod L.
    For n = b^L those are cliques of b members, and averaging uniformly within
    them for L rounds gives the exact average: this is the paper's "simple
    Base-(k+1) graph". For other n we keep the same rule on the members that
    exist (the paper's exact construction for such n needs non-uniform
    weights), so a member may have fewer than k neighbours, or none, in some
    rounds. The union over a period stays connected: setting one digit of i
    to 0 gives a smaller index, hence a member, so every member reaches 0.
    """

    name = "base-k"
    time_varying = True

    k: int = 1  # maximum degree; the graph is base-(k + 1)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.k < 1:
            raise ValueError(f"topology 'base-k': k must be at least 1, got {self.k}")

    def _period(self, n: int) -> int:
        return max(1, _ceil_log(n, self.k + 1))

    def _out(self, n: int, i: int, round: int) -> Iterable[int]:
        b = self.k + 1
        place = b ** (round % self._period(n))
        first = i - (i // place) % b * place  # i with digit r set to 0
        return (j for v in range(b) if (j := first + v * place) < n)

    def _cayley(self, n: int, round: int) -> Cayley | None:
        b, digits = self.k + 1, self._period(n)
        if n == 1:
            return cayley((1,), [])
        if b**digits != n:
            return None  # members missing: not the same graph from every member
        axis = digits - 1 - round % digits  # digit r (place b^r) is axis digits-1-r in C order
        return cayley((b,) * digits, [tuple(v if a == axis else 0 for a in range(digits)) for v in range(1, b)])
