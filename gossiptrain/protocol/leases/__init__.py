"""Leased chunks of a shared dataset: every sample trained about equally often, whatever happens to the peers.

Where every peer can read the whole dataset (a shared filesystem, an object
store, a dataset every peer builds), static shards tie each sample to one
peer: a slow peer's samples are trained less, a dead peer's not at all. With
leases the dataset is a stream of small chunks (``chunks``), peers claim
the chunks they will train in the next seconds, and the claims, completions
and renewals spread by gossip in a table every member holds (``table``), so
no master hands anything out and nothing is lost with any one member. The
member's machine is ``core``.
"""

from gossiptrain.protocol.leases.chunks import DEFAULT_CHUNKS, ChunkPlan, default_chunks
from gossiptrain.protocol.leases.core import Leases, LeaseSettings, LeaseStats, SendLeases
from gossiptrain.protocol.leases.table import Claim, LeaseTable

__all__ = [
    "DEFAULT_CHUNKS", "ChunkPlan", "Claim", "LeaseSettings", "LeaseStats", "LeaseTable", "Leases", "SendLeases",
    "default_chunks",
]
