"""What synchronous communication costs on the simulator's link model (``LinkProfile``).

Gossip messages in the simulator travel the simulated network one by one;
the synchronous baselines move whole models in collective patterns whose
cost has a closed form on the same links, so they are charged that instead
of being sent message by message:

- **Ring all-reduce** (what DDP's NCCL and gloo do for large buffers): a
  reduce-scatter and an all-gather, each ``n - 1`` phases in which every
  worker sends ``bytes / n`` to its ring neighbour at once. A phase ends
  when its slowest link has delivered, so the ring runs at its slowest
  link: ``2 (n-1)/n * bytes / min bandwidth + 2 (n-1) * max latency``.
- **Recursive halving and doubling** (Rabenseifner; what MPI and NCCL's
  trees do for small buffers, where the ring's ``2 (n-1)`` latencies
  dominate): the same bytes in ``2 ceil(log2 n)`` phases,
  ``2 (n-1)/n * bytes / min bandwidth + 2 ceil(log2 n) * max latency``.
  It assumes that any two workers talk at full speed at once (a switch),
  which the ring does not need; ``best`` takes the faster of the two, as
  the libraries choose by message size.
- **A parameter server's link** is one queue: transfers to (or from) the
  server are serialised on its network interface, in order of readiness,
  each taking ``bytes / bandwidth``, then arriving ``latency`` later. The
  two directions are separate (full duplex).

Jitter adds, per phase, the expected maximum of ``n`` uniform delays in
``[0, jitter]``: ``jitter * n / (n + 1)``. Loss is not charged: over TCP a
lost segment is a retransmission, which these models leave out.
"""

from __future__ import annotations

import math
from typing import Sequence

from gossiptrain.net.transport.sim import LinkProfile


#: The all-reduce algorithms ``allreduce_seconds`` knows (``SimConfig.allreduce``).
ALLREDUCE = ("ring", "halving-doubling", "best")


def ring_allreduce_seconds(n: int, nbytes: float, links: LinkProfile | Sequence[LinkProfile]) -> float:
    """Seconds to all-reduce ``nbytes`` over a ring of ``n`` workers on ``links`` (one profile, or one per ring link)."""
    return _allreduce(n, nbytes, links, phases=2 * (n - 1))


def halving_doubling_allreduce_seconds(n: int, nbytes: float, links: LinkProfile | Sequence[LinkProfile]) -> float:
    """Seconds to all-reduce ``nbytes`` among ``n`` workers by recursive halving, then doubling."""
    return _allreduce(n, nbytes, links, phases=2 * math.ceil(math.log2(n)) if n > 1 else 0)


def allreduce_seconds(algorithm: str, n: int, nbytes: float, links: LinkProfile | Sequence[LinkProfile]) -> float:
    """The all-reduce time of ``algorithm`` (one of ``ALLREDUCE``)."""
    if algorithm == "ring":
        return ring_allreduce_seconds(n, nbytes, links)
    if algorithm == "halving-doubling":
        return halving_doubling_allreduce_seconds(n, nbytes, links)
    if algorithm == "best":
        return min(ring_allreduce_seconds(n, nbytes, links), halving_doubling_allreduce_seconds(n, nbytes, links))
    raise ValueError(f"unknown all-reduce algorithm {algorithm!r} (one of {', '.join(ALLREDUCE)})")


def _allreduce(n: int, nbytes: float, links: LinkProfile | Sequence[LinkProfile], phases: int) -> float:
    if n <= 1 or nbytes <= 0:
        return 0.0
    ring = [links] if isinstance(links, LinkProfile) else list(links)
    if not ring:
        raise ValueError("an all-reduce needs at least one link profile")
    bandwidth = min(link.bandwidth for link in ring)
    per_phase = max(link.latency + link.jitter * n / (n + 1) for link in ring)
    return 2 * (n - 1) / n * nbytes / bandwidth + phases * per_phase


class SharedLink:
    """One direction of one network interface: transfers queue and leave one after another."""

    def __init__(self, link: LinkProfile) -> None:
        self.link = link
        self.free_at = 0.0  # when the last queued transfer has left the interface

    def send(self, ready: float, nbytes: float) -> float:
        """Queue ``nbytes`` that are ready to leave at ``ready``; returns when they have arrived."""
        start = max(ready, self.free_at)
        self.free_at = start + nbytes / self.link.bandwidth
        return self.free_at + self.link.latency + self.link.jitter / 2
