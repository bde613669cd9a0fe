"""gossiptrain: asynchronous gossip (decentralized) training for PyTorch over ZeroMQ.

Public API: ``Peer`` (join a swarm from your own training loop),
``simulate`` and ``SimConfig`` (a whole swarm in one process, in virtual
time), the run configuration dataclasses, the ``Workload`` protocol, and the
errors. Heavier names are imported on first use, so that importing a small
submodule does not pull in the network stack.

The layers, each importing only those below it (enforced by the import-linter
contracts in pyproject.toml, checked in the default test run)::

    cli/ | testing/ | integrations/
                     the gossiptrain command, one module per subcommand | kits for tests |
                     other frameworks' loops as members (a Hugging Face Trainer callback)
    sim/             a swarm in virtual time: simulated peers, faults, rounds
    train/           workloads, shards, evaluation, local steps, metrics, the CLI peer's loop
    runtime/         real-time drivers: clock, endpoints, the peer's network side, coordinator, Peer
    protocol/        sans-IO state machines: membership, joining, admission, finish,
                     averaging algorithms, state-transfer fetcher and donor
    state/           tensor streams, checkpoints, merged models, atomic files, storage (paths, fsspec URLs)
    net/             wire codec, message kinds, dtypes, addressing, keys, transports
    config, errors, service, codec_spec   the foundation every layer may use

The rules beyond "only downwards": ``protocol`` imports no event loop,
thread, clock, socket or wire message, and holds no ``send`` callback (it
takes events and ``now`` and returns actions); only ``runtime`` turns wire
messages into events; ``state`` holds no networking; only the transport
registry (``gossiptrain.net.transport.listen``) names a backend, which
``cli`` and ``sim`` choose by URL scheme; nothing imports ``cli``,
``testing`` or ``integrations``; no module imports another module's private names.
``topologies`` (a sibling package) imports neither gossiptrain nor torch,
and ``peers`` uses only the public ``Workload`` protocol.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from gossiptrain.config import GossipConfig, Limits, MembershipConfig, RunConfig, TrainConfig
from gossiptrain.errors import (
    CheckpointError,
    ConfigError,
    GossipError,
    JoinError,
    MismatchError,
    ProtocolError,
    TransportClosed,
    WorkloadError,
)

if TYPE_CHECKING:
    from gossiptrain.runtime.peer import Peer
    from gossiptrain.sim.cluster import simulate
    from gossiptrain.sim.sim_config import SimConfig, SimResult
    from gossiptrain.train.evaluation import EvalResult
    from gossiptrain.train.workload import Workload, load_workload

__version__ = "0.1.0"

_LAZY = {
    "Peer": "gossiptrain.runtime.peer",
    "simulate": "gossiptrain.sim.cluster",
    "SimConfig": "gossiptrain.sim.sim_config",
    "SimResult": "gossiptrain.sim.sim_config",
    "Workload": "gossiptrain.train.workload",
    "load_workload": "gossiptrain.train.workload",
    "EvalResult": "gossiptrain.train.evaluation",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'gossiptrain' has no attribute {name!r}")


__all__ = [
    "CheckpointError",
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
    "SimConfig",
    "SimResult",
    "TrainConfig",
    "TransportClosed",
    "Workload",
    "WorkloadError",
    "load_workload",
    "simulate",
]
