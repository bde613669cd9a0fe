"""The Topology interface: whom member i sends to among n members in a round.

A topology is a pure function of (n, i, round) over member *indices* 0..n-1.
Mapping indices to live peer ids as members come and go is the runtime's job;
keeping it out of here lets researchers use this package without gossiptrain.
"""

from __future__ import annotations

import operator
from abc import ABC, abstractmethod
from collections.abc import Iterable
from dataclasses import dataclass
from typing import ClassVar

import numpy as np


@dataclass(frozen=True)
class Topology(ABC):
    """A family of graphs, one per member count n (and per round when time-varying).

    Subclasses implement `_out`; the base class validates arguments and
    normalises the result, so every topology keeps the same contract: sorted,
    unique, in range, never the member itself.
    """

    name: ClassVar[str]
    # True when neighbours depend on `round` (one-peer schemes, resampled graphs).
    time_varying: ClassVar[bool] = False
    # True when j in neighbours(i) does not imply i in neighbours(j); averaging
    # schemes that need symmetric exchanges (pairwise) must symmetrize.
    directed: ClassVar[bool] = False

    def neighbours(self, n: int, i: int, round: int = 0) -> list[int]:
        """Out-neighbours of member i among n members, ascending, without i."""
        n, round = _check_size(n, round)
        i = operator.index(i)
        if not 0 <= i < n:
            raise ValueError(f"member index i={i} is outside [0, {n})")
        return self._clean(n, i, round)

    def adjacency(self, n: int, round: int = 0) -> np.ndarray:
        """Boolean (n, n) matrix with A[i, j] == (j in neighbours(n, i, round))."""
        n, round = _check_size(n, round)
        a = np.zeros((n, n), dtype=bool)  # (n, n)
        for i in range(n):
            a[i, self._clean(n, i, round)] = True
        return a

    @abstractmethod
    def _out(self, n: int, i: int, round: int) -> Iterable[int]:
        """Raw out-neighbours of a valid i; may repeat or include i itself."""

    def _clean(self, n: int, i: int, round: int) -> list[int]:
        # Small n makes generators collide (e.g. i-1 == i+1 on a ring of 2).
        return sorted({int(j) for j in self._out(n, i, round) if j != i})


def _check_size(n: int, round: int) -> tuple[int, int]:
    n = operator.index(n)
    round = operator.index(round)
    if n < 1:
        raise ValueError(f"member count n={n} must be at least 1")
    if round < 0:
        raise ValueError(f"round={round} must be non-negative")
    return n, round
