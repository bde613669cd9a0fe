"""Mixing matrices and the graph numbers that predict how fast gossip averages.

Metropolis-Hastings weights (Xiao & Boyd 2004) need only each member's and
its neighbour's degree, so a peer can compute its own row locally; that makes
them the default for neighbour averaging. The spectral gap and diameter let
experiments compare topologies before running them.
"""

from __future__ import annotations

from collections import deque

import numpy as np

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
