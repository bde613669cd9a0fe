"""Mixing matrices and the graph numbers that predict how fast gossip averages.

Metropolis-Hastings weights (Xiao & Boyd 2004) need only each member's and
its neighbour's degree, so a peer can compute its own row locally; that makes
them the default for neighbour averaging. The spectral gap and diameter let
experiments compare topologies before running them; `describe` gathers them,
over a whole period for time-varying topologies.

Graphs that look the same from every member (rings, exponential graphs,
tori with full rows: `topologies.cayley`) are described in closed form,
without an n x n matrix, at any n. Any other graph takes dense matrices:
`describe_cost` estimates their memory and time before anything is built.
"""

from __future__ import annotations

from collections import deque

import numpy as np

from topologies import cayley
from topologies.base import Topology


def _as_graph(adjacency: np.ndarray) -> np.ndarray:
    """Validated (n, n) bool matrix with self-loops dropped (they carry no exchange)."""
    a = np.asarray(adjacency)
    if a.ndim != 2 or a.shape[0] != a.shape[1]:
        raise ValueError(f"adjacency must be a square matrix, got shape {a.shape}")
    if a.shape[0] < 1:
        raise ValueError("adjacency must have at least one member")
    g = a.astype(bool)  # (n, n)
    np.fill_diagonal(g, False)
    return g


def _symmetrized(adjacency: np.ndarray) -> np.ndarray:
    g = _as_graph(adjacency)
    return g | g.T  # (n, n)


def metropolis_hastings(adjacency: np.ndarray) -> np.ndarray:
    """Symmetric, doubly stochastic, nonnegative weights on the symmetrized graph.

    W_ij = 1 / (1 + max(d_i, d_j)) on edges, W_ii = 1 - sum of the rest of row i.
    The diagonal is always positive (at least 1 / (1 + d_i)), so gossip never
    throws away a member's own value.
    """
    s = _symmetrized(adjacency)  # (n, n)
    degree = s.sum(axis=1)  # (n,)
    w = np.where(s, 1.0 / (1.0 + np.maximum.outer(degree, degree)), 0.0)  # (n, n)
    np.fill_diagonal(w, 1.0 - w.sum(axis=1))
    return w


def uniform_weights(adjacency: np.ndarray) -> np.ndarray:
    """Row i: 1 / (1 + outdeg_i) on i and each out-neighbour, as in Ying et al. 2021.

    Row stochastic only; doubly stochastic on regular circulant graphs such as
    the exponential graph with n a power of two, which is where its closed-form
    spectral gap 2 / (1 + log2 n) holds.
    """
    g = _as_graph(adjacency)  # (n, n)
    w = g / (1.0 + g.sum(axis=1, keepdims=True))  # (n, n)
    np.fill_diagonal(w, 1.0 - w.sum(axis=1))
    return w


def spectral_gap(w: np.ndarray) -> float:
    """1 - ||W - 11^T/n||_2: the per-round contraction of disagreement (1 = exact average).

    Near 0 for a disconnected graph; 1.0 for a single member, who is already
    at consensus.
    """
    w = np.asarray(w, dtype=np.float64)
    if w.ndim != 2 or w.shape[0] != w.shape[1] or w.shape[0] < 1:
        raise ValueError(f"mixing matrix must be square and non-empty, got shape {w.shape}")
    n = w.shape[0]
    if n == 1:
        return 1.0
    return float(1.0 - np.linalg.norm(w - 1.0 / n, ord=2))


def diameter(adjacency: np.ndarray) -> int:
    """Longest shortest path of the symmetrized graph: rounds for news to reach everyone.

    Raises ValueError when the graph is disconnected, since then some members
    never hear from others and no finite answer is right.
    """
    s = _symmetrized(adjacency)
    n = s.shape[0]
    adj = [np.flatnonzero(row).tolist() for row in s]
    longest = 0
    for source in range(n):
        dist = [-1] * n
        dist[source] = 0
        queue = deque([source])
        while queue:
            u = queue.popleft()
            for v in adj[u]:
                if dist[v] < 0:
                    dist[v] = dist[u] + 1
                    queue.append(v)
        if min(dist) < 0:
            missing = dist.index(-1)
            raise ValueError(f"graph is disconnected: {missing} is unreachable from {source}")
        longest = max(longest, max(dist))
    return longest


def mixing_matrix(topology: Topology, n: int, round: int = 0) -> np.ndarray:
    """Metropolis-Hastings weights for `topology` on n members in `round`."""
    return metropolis_hastings(topology.adjacency(n, round))


def gossip_weights(topology: Topology, n: int, round: int) -> np.ndarray:
    """The weights gossip would use on `topology` in one round, chosen by direction.

    Undirected: Metropolis-Hastings (symmetric, doubly stochastic). Directed:
    uniform over each member and its out-neighbours. Its transpose is the
    column-stochastic matrix push-sum (SGP) mixes with, and a matrix and its
    transpose share their singular values, so the spectral gap is the same.
    """
    a = topology.adjacency(n, round)  # (n, n)
    return uniform_weights(a) if topology.directed else metropolis_hastings(a)


def spectral_gap_over_period(topology: Topology, n: int, round: int = 0) -> float:
    """Spectral gap of the product of one period's mixing matrices, from `round` on.

    For a static topology this is the one-round gap. For a time-varying one it
    is what a whole cycle achieves: 1.0 for the one-peer exponential graph with
    n a power of two (exact averaging), though each of its rounds alone mixes
    poorly. Directed graphs whose weights are not doubly stochastic (random
    out-neighbours) converge to a weighted average instead, and their gap by
    this formula can be low or negative. Cayley graphs (`topologies.cayley`)
    are answered in closed form, without the n x n matrices.
    """
    graphs = _cayley_period(topology, n, round)
    if graphs is not None:
        return cayley.gap_over_period(graphs, topology.directed)
    product = np.eye(n)  # (n, n)
    for r in range(round, round + topology.period(n)):
        # U_0 U_1 ... is the transpose of push-sum's P_last ... P_0: same norm.
        product = product @ gossip_weights(topology, n, r)  # (n, n)
    return spectral_gap(product)


def describe(topology: Topology, n: int, round: int = 0) -> dict[str, object]:
    """The numbers that predict how a topology gossips on n members, JSON-ready.

    Degrees are out-degrees over the period starting at `round`: "degree" is
    their mean (messages a member sends per round), "max_degree" the largest.
    "diameter" is that of the symmetrized union of the period's graphs, None
    when it is disconnected.

    Cayley graphs (`topologies.cayley`: rings, exponential graphs, ...) take
    O(n log n) time and O(n) memory; other graphs take dense n x n matrices,
    see `describe_cost`.
    """
    period = topology.period(n)
    rounds = _cayley_period(topology, n, round)
    if rounds is not None:
        degrees = [len(g.generators) for g in rounds]
        union = cayley.Cayley(rounds[0].shape, np.concatenate([g.generators for g in rounds]))
        return _summary(
            topology, n, round,
            degree=float(np.mean(degrees)),
            max_degree=int(max(degrees)),
            hops=cayley.eccentricity(union),
            gap=cayley.gap_over_period(rounds, topology.directed),
        )
    graphs = [topology.adjacency(n, r) for r in range(round, round + period)]  # period x (n, n)
    out_degree = np.array([a.sum(axis=1) for a in graphs])  # (period, n)
    union = np.logical_or.reduce(graphs)  # (n, n)
    try:
        hops: int | None = diameter(union)
    except ValueError:
        hops = None
    return _summary(
        topology, n, round,
        degree=float(out_degree.mean()),
        max_degree=int(out_degree.max()),
        hops=hops,
        gap=spectral_gap_over_period(topology, n, round),
    )


def _summary(topology: Topology, n: int, round: int, *, degree: float, max_degree: int, hops: int | None, gap: float) -> dict[str, object]:
    return {
        "name": topology.name,
        "spec": topology.spec,
        "peers": n,
        "round": round,
        "degree": degree,
        "max_degree": max_degree,
        "diameter": hops,
        "spectral_gap": gap,
        "weights": "uniform" if topology.directed else "metropolis-hastings",
        "directed": topology.directed,
        "time_varying": topology.time_varying,
        "period": topology.period(n),
    }


def _cayley_period(topology: Topology, n: int, round: int) -> list[cayley.Cayley] | None:
    """The period's graphs from `round` on as Cayley graphs of one group, or None when one is not."""
    graphs = []
    for r in range(round, round + topology.period(n)):
        graph = topology.cayley(n, r)
        if graph is None or (graphs and graph.shape != graphs[0].shape):
            return None
        graphs.append(graph)
    return graphs


# What `describe` costs on the dense path, fitted on a 2-core machine: peak memory is the period's boolean
# adjacency matrices and their union plus about five float64 n x n matrices at once (weights, the period's product,
# its copy the SVD works on); time is the SVD and the period's matrix products (n^3 each) plus one breadth-first search
# per member in Python for the diameter (n x edges).
_DENSE_FLOAT_MATRICES = 5
_SECONDS_PER_N3 = 1.5e-9
_SECONDS_PER_EDGE_VISIT = 2e-7


def describe_cost(topology: Topology, n: int, round: int = 0) -> tuple[int, float]:
    """Estimated peak bytes and seconds of `describe(topology, n, round)`, before building anything.

    Cayley graphs: O(n) memory, O(n log n) time. Other graphs: dense n x n
    matrices.
    """
    period = topology.period(n)
    if _cayley_period(topology, n, round) is not None:
        return 64 * n * period + (1 << 20), 1e-6 * n * period
    degree = max(1.0, topology.mean_degree(n, round))
    edges = 2.0 * n * degree * period  # symmetrized union, both directions
    memory = (period + 2) * n * n + _DENSE_FLOAT_MATRICES * 8 * n * n
    seconds = _SECONDS_PER_N3 * float(n) ** 3 * (period + 1) + _SECONDS_PER_EDGE_VISIT * n * edges
    return int(memory), seconds
