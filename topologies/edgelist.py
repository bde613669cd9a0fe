"""A topology read from a file, for graphs no generator makes (a measured network, a paper's figure).

Two formats, chosen by the file's suffix:

- ``*.toml``: ``edges = [[0, 1], [1, 2]]``, optional ``directed = true``
  (default false) and ``peers = N`` (default: largest id + 1).
- anything else: one ``i j`` pair per line; ``#`` starts a comment; always
  undirected.

The file is read once, when the topology is made, so a bad file fails at
configuration time rather than in the middle of a run. A file describes one
member count: asking it for another raises, because no rule says how a
hand-drawn graph should grow or shrink under churn.
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from topologies.base import Topology
from topologies.components import components

Edge = tuple[int, int]


@dataclass(frozen=True)
class EdgeListFile(Topology):
    """The graph in the edge-list file at `path` (TOML or plain text)."""

    name = "file"

    path: str
    _graph: tuple[tuple[int, ...], ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        super().__post_init__()
        edges, peers, directed = read_edge_list(self.path)
        graph = _validated(self.path, edges, peers, directed)  # (n, n)
        object.__setattr__(self, "_graph", tuple(tuple(int(j) for j in np.flatnonzero(r)) for r in graph))
        # The class default is False; a directed file makes this instance directed.
        object.__setattr__(self, "directed", directed)

    @property
    def fixed_n(self) -> int:
        return len(self._graph)

    def _check_peers(self, n: int) -> None:
        if n != self.fixed_n:
            raise ValueError(
                f"edge list {self.path} is a graph on {self.fixed_n} peers "
                f"(0..{self.fixed_n - 1}); asked for {n} peers"
            )

    def _out(self, n: int, i: int, round: int) -> tuple[int, ...]:
        return self._graph[i]


def read_edge_list(path: str) -> tuple[list[Edge], int | None, bool]:
    """(edges, declared peer count or None, directed) from a file, checking only its syntax."""
    try:
        if path.endswith(".toml"):
            with open(path, "rb") as f:
                return _from_toml(path, tomllib.load(f))
        with open(path, encoding="utf-8") as f:
            return _from_text(path, f.read()), None, False
    except tomllib.TOMLDecodeError as e:
        raise ValueError(f"edge list {path}: invalid TOML: {e}") from None
    except OSError as e:
        raise ValueError(f"edge list {path}: cannot read: {e.strerror or e}") from None


def _from_toml(path: str, data: dict[str, Any]) -> tuple[list[Edge], int | None, bool]:
    unknown = sorted(set(data) - {"edges", "directed", "peers"})
    if unknown:
        raise ValueError(f"edge list {path}: unknown key(s) {', '.join(unknown)}; known: edges, directed, peers")
    if "edges" not in data:
        raise ValueError(f"edge list {path}: missing 'edges = [[i, j], ...]'")
    raw = data["edges"]
    if not isinstance(raw, list):
        raise ValueError(f"edge list {path}: 'edges' must be a list of [i, j] pairs")
    edges: list[Edge] = []
    for k, pair in enumerate(raw):
        if not (isinstance(pair, list) and len(pair) == 2 and all(_is_int(x) for x in pair)):
            raise ValueError(f"edge list {path}: edges[{k}] must be a pair of integers [i, j], got {pair!r}")
        edges.append((pair[0], pair[1]))
    directed = data.get("directed", False)
    if not isinstance(directed, bool):
        raise ValueError(f"edge list {path}: 'directed' must be true or false, got {directed!r}")
    peers = data.get("peers")
    if peers is not None and not (_is_int(peers) and peers >= 1):
        raise ValueError(f"edge list {path}: 'peers' must be a positive integer, got {peers!r}")
    return edges, peers, directed


def _from_text(path: str, text: str) -> list[Edge]:
    edges: list[Edge] = []
    for number, line in enumerate(text.splitlines(), start=1):
        words = line.split("#", 1)[0].split()
        if not words:
            continue
        try:
            if len(words) != 2:
                raise ValueError
            edges.append((int(words[0]), int(words[1])))
        except ValueError:
            raise ValueError(f"edge list {path} line {number}: expected 'i j', got {line.strip()!r}") from None
    return edges


def _validated(path: str, edges: list[Edge], peers: int | None, directed: bool) -> np.ndarray:
    """The (n, n) adjacency of a well-formed, connected edge list; ValueError naming what is wrong."""
    if not edges and peers is None:
        raise ValueError(f"edge list {path}: no edges")
    n = peers if peers is not None else 1 + max(max(e) for e in edges)
    for i, j in edges:
        for peer in (i, j):
            if not 0 <= peer < n:
                raise ValueError(f"edge list {path}: edge {i} {j} names peer {peer}, outside [0, {n})")
        if i == j:
            raise ValueError(f"edge list {path}: self-loop {i} {j} (a peer does not gossip with itself)")
    a = np.zeros((n, n), dtype=bool)  # (n, n)
    if edges:
        src, dst = np.array(edges).T  # (m,), (m,)
        a[src, dst] = True
    if not directed:
        a |= a.T
    parts = components(a)
    if len(parts) > 1:
        raise ValueError(
            f"edge list {path}: graph is disconnected ({len(parts)} components): "
            f"peer {parts[1][0]} cannot reach peer 0"
        )
    return a


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)
