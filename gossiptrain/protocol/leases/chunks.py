"""Which samples a chunk holds: the dataset cut into a stream of chunks, epoch after epoch.

Every member computes the same plan from three numbers the swarm agrees on
(the dataset's size, the chunks per epoch and a seed), so chunks are named
by one integer and never by their samples. Chunk ``g`` of the stream is
chunk ``g % chunks`` of epoch ``g // chunks``; each epoch shuffles the whole
dataset with its own seed and cuts the permutation into ``chunks`` slices
of sizes differing by at most one. So an epoch's chunks hold every sample
exactly once, and a sample meets different neighbours each epoch.

Why a stream rather than one epoch at a time: on a small dataset a fast swarm
finishes an epoch in a fraction of a second, quicker than gossip crosses the
swarm; numbering chunks across epochs lets a peer claim ahead into the next
epochs (``gossiptrain.protocol.leases.table``'s window) without waiting for
the last chunk of this one.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch

#: Chunks per epoch when not set: a dead or superseded peer's loss is at most a few chunks, 1/256 of an
#: epoch each; the done bitmap of a window of two epochs is 64 bytes; claims ahead of a few seconds are
#: tens of chunks for 64 peers. Fewer when the dataset is small: a chunk holds at least MIN_CHUNK_SAMPLES.
DEFAULT_CHUNKS = 256
#: Samples a chunk holds at least (4 batches of 32). A claim per batch only costs bookkeeping, and the window
#: of claimable chunks (``core.MIN_WINDOW`` chunks) must hold seconds of the swarm's work: cut into chunks of
#: 32, digits' 1,437 samples made a window of 2 s for 4 real peers on loopback, and a peer paused by an
#: exchange let the others run out of it (stalls of 0.3 s); 16 simulated peers waited for a chunk 139 times
#: in 3 s with chunks of 32 and never with chunks of 130 (experiments/data_balance.py --sim-chunks).
MIN_CHUNK_SAMPLES = 128


def default_chunks(samples: int) -> int:
    """Chunks per epoch for a dataset of ``samples``: DEFAULT_CHUNKS, fewer so that each holds MIN_CHUNK_SAMPLES."""
    if samples < 1:
        raise ValueError(f"a dataset to lease needs at least 1 sample, not {samples}")
    return max(1, min(DEFAULT_CHUNKS, samples // MIN_CHUNK_SAMPLES))


@dataclass(frozen=True)
class ChunkPlan:
    """The swarm's cut of ``samples`` indices into ``chunks`` chunks per epoch, shuffled per epoch by ``seed``."""

    samples: int
    chunks: int
    seed: int = 0

    def __post_init__(self) -> None:
        if self.samples < 1:
            raise ValueError(f"a dataset to lease needs at least 1 sample, not {self.samples}")
        if not 1 <= self.chunks <= self.samples:
            raise ValueError(f"chunks per epoch must be 1..{self.samples} (the samples), not {self.chunks}")

    def epoch_of(self, g: int) -> int:
        return g // self.chunks

    def size(self, g: int) -> int:
        """Samples in chunk ``g``: the first ``samples % chunks`` chunks of an epoch hold one more."""
        base, extra = divmod(self.samples, self.chunks)
        return base + (1 if g % self.chunks < extra else 0)

    def indices(self, g: int) -> list[int]:
        """The dataset indices of chunk ``g``, in the order to train them."""
        base, extra = divmod(self.samples, self.chunks)
        c = g % self.chunks
        start = c * base + min(c, extra)
        return _permutation(self.samples, self.seed, self.epoch_of(g))[start : start + self.size(g)]

    def to_wire(self) -> list[int]:
        return [self.samples, self.chunks, self.seed]


@lru_cache(maxsize=4)
def _permutation(samples: int, seed: int, epoch: int) -> list[int]:
    """Epoch ``epoch``'s shuffle of range(samples): the same on every member (torch's CPU generator)."""
    gen = torch.Generator().manual_seed((seed * 1_000_003 + epoch) % (1 << 63))
    return torch.randperm(samples, generator=gen).tolist()  # (samples,)
