"""Seeded random topologies: Erdős–Rényi, random out-regular (Epidemic Learning), small world.

Every peer must compute the same graph without talking to the others, so
each sample comes from a numpy generator seeded only by the parameters, the
member count and (for resampled graphs) the round: same inputs, same graph,
on every machine. Static samples are cached per member count because the
runtime asks for one member's neighbours at a time.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from topologies.base import Topology
from topologies.components import connect_components

# Distinct first seed words keep the three generators' streams apart when
# their other seed words coincide.
_ER_STREAM, _REGULAR_STREAM, _SMALL_WORLD_STREAM = 0xE5, 0x5E, 0x5A

Graph = tuple[tuple[int, ...], ...]  # out-neighbours of each member


def _rng(*key: int) -> np.random.Generator:
    return np.random.default_rng(list(key))


def _lists(adjacency: np.ndarray) -> Graph:
    return tuple(tuple(int(j) for j in np.flatnonzero(row)) for row in adjacency)


def _check_seed(topology: str, seed: int) -> None:
    if seed < 0:
        raise ValueError(f"topology {topology!r}: seed must be non-negative, got {seed}")


def _check_probability(topology: str, param: str, value: float | None) -> None:
    if value is not None and not 0.0 <= value <= 1.0:
        raise ValueError(f"topology {topology!r}: {param} must be in [0, 1], got {value}")


def _check_degree(topology: str, param: str, degree: int | None, n: int) -> None:
    if degree is not None and degree > n - 1:
        raise ValueError(
            f"topology {topology!r}: {param}={degree} needs at least {degree + 1} peers, have {n}"
        )


@dataclass(frozen=True)
class ErdosRenyi(Topology):
    """G(n, p): each undirected edge present with probability p, fixed for the run.

    The default p = min(1, 2 ln n / n) is twice the connectivity threshold, so
    the sample is connected with high probability. When it is not, the
    components are bridged by `connect_components` (smallest member of each
    component to the smallest member of the next), which keeps the graph
    connected for every p, p = 0 included (then it is a path over 0..n-1).
    """

    name = "erdos-renyi"
    dense_sample = True

    p: float | None = None  # edge probability; None: min(1, 2 ln n / n)
    seed: int = 0

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_probability(self.name, "p", self.p)
        _check_seed(self.name, self.seed)

    def edge_probability(self, n: int) -> float:
        """The p used for n members."""
        return self.p if self.p is not None else min(1.0, 2.0 * math.log(n) / n)

    def _out(self, n: int, i: int, round: int) -> Iterable[int]:
        return _erdos_renyi(self.edge_probability(n), self.seed, n)[i]

    def _mean_degree(self, n: int, round: int) -> float:
        return self.edge_probability(n) * (n - 1)  # sampling a member would draw the whole n x n sample


@functools.lru_cache(maxsize=64)
def _erdos_renyi(p: float, seed: int, n: int) -> Graph:
    coins = _rng(_ER_STREAM, seed, n).random((n, n))  # (n, n); only the upper triangle is used
    upper = np.triu(coins < p, k=1)  # (n, n)
    return _lists(connect_components(upper))


@dataclass(frozen=True)
class RandomRegular(Topology):
    """Random out-regular graph resampled every round, as in Epidemic Learning (de Vos et al. 2023).

    This is EL-Local: in round r, member i sends to `degree` distinct other
    members drawn uniformly by a generator seeded by (seed, r, i), so each
    member decides alone and in-degrees vary. (EL-Oracle instead samples one
    undirected regular graph per round, which needs global coordination.)
    No round's sample is guaranteed connected; with the default degree 3
    a disconnected round is vanishingly rare, and across rounds the samples
    mix regardless, which is what the paper's analysis relies on.
    """

    name = "random-regular"
    directed = True
    time_varying = True

    degree: int | None = None  # out-degree; None: min(3, n - 1)
    seed: int = 0

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.degree is not None and self.degree < 1:
            raise ValueError(f"topology {self.name!r}: degree must be at least 1, got {self.degree}")
        _check_seed(self.name, self.seed)

    def out_degree(self, n: int) -> int:
        """The out-degree used for n members."""
        return self.degree if self.degree is not None else min(3, n - 1)

    def _check_peers(self, n: int) -> None:
        _check_degree(self.name, "degree", self.degree, n)

    def _out(self, n: int, i: int, round: int) -> Iterable[int]:
        d = self.out_degree(n)
        if d == 0:
            return ()
        picks = _rng(_REGULAR_STREAM, self.seed, round, i).choice(n - 1, size=d, replace=False)  # (d,)
        return (int(j) + (j >= i) for j in picks)  # skip over i itself


@dataclass(frozen=True)
class SmallWorld(Topology):
    """Watts–Strogatz small world: a ring lattice whose edges are rewired with probability beta.

    Each member starts linked to its k nearest members (k/2 on each side).
    Then, for each lattice edge (i, i + j), j = 1..k/2, with probability beta
    its far end moves to a uniformly drawn member that i is not yet linked to.
    Rewiring can split the graph; the split is repaired by `connect_components`.
    The default k = 4 (2 when n < 5) keeps tiny swarms valid.
    """

    name = "small-world"
    dense_sample = True

    k: int | None = None  # lattice degree, even; None: 4, or 2 when n < 5
    beta: float = 0.1  # rewiring probability
    seed: int = 0

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.k is not None and (self.k < 2 or self.k % 2):
            raise ValueError(f"topology {self.name!r}: k must be an even number >= 2, got {self.k}")
        _check_probability(self.name, "beta", self.beta)
        _check_seed(self.name, self.seed)

    def lattice_degree(self, n: int) -> int:
        """The k used for n members."""
        return self.k if self.k is not None else (4 if n >= 5 else 2)

    def _check_peers(self, n: int) -> None:
        _check_degree(self.name, "k", self.k, n)

    def _out(self, n: int, i: int, round: int) -> Iterable[int]:
        return _small_world(self.lattice_degree(n), self.beta, self.seed, n)[i]

    def _mean_degree(self, n: int, round: int) -> float:
        return float(self.lattice_degree(n))  # rewiring keeps the edge count; sampling would build the n x n graph


@functools.lru_cache(maxsize=64)
def _small_world(k: int, beta: float, seed: int, n: int) -> Graph:
    rng = _rng(_SMALL_WORLD_STREAM, seed, n)
    a = np.zeros((n, n), dtype=bool)  # (n, n) symmetric
    idx = np.arange(n)  # (n,)
    for j in range(1, k // 2 + 1):
        a[idx, (idx + j) % n] = a[(idx + j) % n, idx] = True
    np.fill_diagonal(a, False)  # n = 1 links a member to itself
    for j in range(1, k // 2 + 1):
        for u in range(n):
            if rng.random() >= beta:
                continue
            v = (u + j) % n
            free = np.flatnonzero(~a[u])  # (m,) not yet linked, u itself included
            free = free[free != u]
            if not a[u, v] or free.size == 0:
                continue  # already moved (small n visits an edge twice), or u links to all
            w = int(free[rng.integers(free.size)])
            a[u, v] = a[v, u] = False
            a[u, w] = a[w, u] = True
    return _lists(connect_components(a))
