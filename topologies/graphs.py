"""The built-in topology generators and the name registry the runtime looks them up in.

Every generator is defined for every n >= 1, not only for the sizes the graph
is famous for (powers of two, perfect squares), because churn makes the member
count arbitrary.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

from topologies.base import Topology


def _ceil_log2(n: int) -> int:
    """ceil(log2 n) for n >= 1, exactly (no float rounding at large powers of two)."""
    return (n - 1).bit_length()


@dataclass(frozen=True)
class Ring(Topology):
    """Undirected cycle: i talks to i-1 and i+1 (mod n)."""

    name = "ring"

    def _out(self, n: int, i: int, round: int) -> Iterable[int]:
        return ((i - 1) % n, (i + 1) % n)


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


@dataclass(frozen=True)
class Complete(Topology):
    """Every other member; gossip over it is "pick a random peer"."""

    name = "complete"

    def _out(self, n: int, i: int, round: int) -> Iterable[int]:
        return range(n)


_REGISTRY: dict[str, Topology] = {
    t.name: t for t in (Ring(), Torus(), Hypercube(), Exponential(), Complete())
}


def names() -> tuple[str, ...]:
    """Names accepted by `get`, for config validation and experiment sweeps."""
    return tuple(_REGISTRY)


def get(name: str) -> Topology:
    """The topology registered under `name`; ValueError lists the known names."""
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError(
            f"unknown topology {name!r}; known topologies: {', '.join(names())}"
        ) from None
