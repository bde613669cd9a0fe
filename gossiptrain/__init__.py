"""gossiptrain: asynchronous gossip (decentralized) training for PyTorch over ZeroMQ.

Public API: ``Peer`` (join a swarm from your own training loop), the run
configuration dataclasses, the ``Workload`` protocol, and the errors.
Heavier names (``Peer``, ``Workload``) are imported on first use, so that
importing a small submodule does not pull in the network stack.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from gossiptrain.config import GossipConfig, Limits, MembershipConfig, RunConfig, TrainConfig
from gossiptrain.errors import ConfigError, GossipError, JoinError, MismatchError, ProtocolError, WorkloadError

if TYPE_CHECKING:
    from gossiptrain.train.evaluation import EvalResult
    from gossiptrain.runtime.peer import Peer
    from gossiptrain.train.workload import Workload, load_workload

__version__ = "0.1.0"

_LAZY = {
    "Peer": "gossiptrain.runtime.peer",
    "Workload": "gossiptrain.train.workload",
    "load_workload": "gossiptrain.train.workload",
    "EvalResult": "gossiptrain.train.evaluation",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'gossiptrain' has no attribute {name!r}")


__all__ = [
    "ConfigError",
    "EvalResult",
    "GossipConfig",
    "GossipError",
    "JoinError",
    "Limits",
    "MembershipConfig",
    "MismatchError",
    "Peer",
    "ProtocolError",
    "RunConfig",
    "TrainConfig",
    "Workload",
    "WorkloadError",
    "load_workload",
]
