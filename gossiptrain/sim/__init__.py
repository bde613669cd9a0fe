"""Simulated clusters: many peers in one process, in virtual time, with faults on a schedule.

``simulate(SimConfig(...))`` runs one simulation and returns a ``SimResult``
(rows of per-peer samples, and a summary). The names are imported on first
use, so that the CLI can describe its flags without loading torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from gossiptrain.sim.cluster import Cluster, simulate
    from gossiptrain.sim.faults import ChurnEvent, PartitionSpec
    from gossiptrain.sim.sim_config import SimConfig, SimResult

_LAZY = {
    "Cluster": "gossiptrain.sim.cluster",
    "SimConfig": "gossiptrain.sim.sim_config",
    "SimResult": "gossiptrain.sim.sim_config",
    "simulate": "gossiptrain.sim.cluster",
    "ChurnEvent": "gossiptrain.sim.faults",
    "PartitionSpec": "gossiptrain.sim.faults",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'gossiptrain.sim' has no attribute {name!r}")


__all__ = ["ChurnEvent", "Cluster", "PartitionSpec", "SimConfig", "SimResult", "simulate"]
