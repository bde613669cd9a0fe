"""Gossip topologies and mixing/spectral tools, pure numpy and usable on their own.

    >>> import topologies
    >>> topologies.get("exponential").neighbours(8, 0)
    [1, 2, 4]
    >>> topologies.parse("random-regular:degree=2,seed=7").neighbours(8, 0, round=3)
    [3, 4]

This package must not import gossiptrain or torch: researchers use it alone.
"""

from __future__ import annotations

from topologies.base import Topology
from topologies.cayley import Cayley
from topologies.components import components, connect_components
from topologies.edgelist import EdgeListFile, read_edge_list
from topologies.graphs import BaseK, Complete, Exponential, Hypercube, OnePeerExponential, Ring, Star, Torus
from topologies.mixing import (
    describe,
    describe_cost,
    diameter,
    gossip_weights,
    metropolis_hastings,
    mixing_matrix,
    spectral_gap,
    spectral_gap_over_period,
    uniform_weights,
)
from topologies.random_graphs import ErdosRenyi, RandomRegular, SmallWorld
from topologies.registry import get, names, parameters, parse

__all__ = [
    "BaseK",
    "Cayley",
    "Complete",
    "EdgeListFile",
    "ErdosRenyi",
    "Exponential",
    "Hypercube",
    "OnePeerExponential",
    "RandomRegular",
    "Ring",
    "SmallWorld",
    "Star",
    "Topology",
    "Torus",
    "components",
    "connect_components",
    "describe",
    "describe_cost",
    "diameter",
    "get",
    "gossip_weights",
    "metropolis_hastings",
    "mixing_matrix",
    "names",
    "parameters",
    "parse",
    "read_edge_list",
    "spectral_gap",
    "spectral_gap_over_period",
    "uniform_weights",
]
