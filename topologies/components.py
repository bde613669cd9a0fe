"""Connected components, and the one deterministic rule that joins them.

Random graphs (Erdős–Rényi, rewired small worlds) can come out disconnected,
and a disconnected gossip graph never reaches consensus. Every generator that
can split repairs its sample with `connect_components`, so the repair is the
same, documented rule everywhere; edge-list files use `components` to name a
member that cannot be reached.
"""

from __future__ import annotations

import numpy as np


def components(adjacency: np.ndarray) -> list[list[int]]:
    """Components of the symmetrized graph, each ascending, ordered by their smallest member."""
    a = np.asarray(adjacency, dtype=bool)
    s = a | a.T  # (n, n)
    n = s.shape[0]
    label = np.full(n, -1)  # (n,) component index per member, -1 unvisited
    out: list[list[int]] = []
    for root in range(n):
        if label[root] >= 0:
            continue
        label[root] = len(out)
        members, stack = [root], [root]
        while stack:
            u = stack.pop()
            for v in np.flatnonzero(s[u] & (label < 0)):
                label[v] = len(out)
                members.append(int(v))
                stack.append(int(v))
        out.append(sorted(members))
    return out


def connect_components(adjacency: np.ndarray) -> np.ndarray:
    """A symmetric copy with one bridge between consecutive components.

    Components are ordered by their smallest member; the smallest member of
    component c is joined to the smallest member of component c + 1. That adds
    exactly (components - 1) edges, the fewest that can connect the graph,
    and depends only on the sample, so every peer computes the same repair.
    """
    a = np.asarray(adjacency, dtype=bool)
    s: np.ndarray = a | a.T  # (n, n)
    roots = [c[0] for c in components(s)]
    for u, v in zip(roots, roots[1:]):
        s[u, v] = s[v, u] = True
    return s
