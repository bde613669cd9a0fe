"""Gossip topologies and mixing/spectral tools, pure numpy and usable on their own.

    >>> import topologies
    >>> topologies.get("exponential").neighbours(8, 0)
    [1, 2, 4]

This package must not import gossiptrain or torch: researchers use it alone.
"""

from __future__ import annotations

from topologies.base import Topology
from topologies.graphs import Complete, Exponential, Hypercube, Ring, Torus, get, names
from topologies.mixing import (
    diameter,
    metropolis_hastings,
    mixing_matrix,
    spectral_gap,
    uniform_weights,
)

__all__ = [
    "Complete",
    "Exponential",
    "Hypercube",
    "Ring",
    "Topology",
    "Torus",
    "diameter",
    "get",
    "metropolis_hastings",
    "mixing_matrix",
    "names",
    "spectral_gap",
    "uniform_weights",
]
