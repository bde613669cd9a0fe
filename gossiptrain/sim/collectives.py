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
- **A parameter server's link** is one queue: transfers to (or from) the
  server are serialised on its network interface, in order of readiness,
  each taking ``bytes / bandwidth``, then arriving ``latency`` later. The
  two directions are separate (full duplex).

Jitter adds, per phase, the expected maximum of ``n`` uniform delays in
``[0, jitter]``: ``jitter * n / (n + 1)``. Loss is not charged: over TCP a
lost segment is a retransmission, which these models leave out.
"""

from __future__ import annotations

from typing import Sequence

from gossiptrain.net.transport.sim import LinkProfile


def ring_allreduce_seconds(n: int, nbytes: float, links: LinkProfile | Sequence[LinkProfile]) -> float:
    """Seconds to all-reduce ``nbytes`` over a ring of ``n`` workers on ``links`` (one profile, or one per ring link)."""
    if n <= 1 or nbytes <= 0:
        return 0.0
    ring = [links] if isinstance(links, LinkProfile) else list(links)
    if not ring:
        raise ValueError("ring_allreduce_seconds needs at least one link profile")
    bandwidth = min(link.bandwidth for link in ring)
    per_phase = max(link.latency + link.jitter * n / (n + 1) for link in ring)
    return 2 * (n - 1) / n * nbytes / bandwidth + 2 * (n - 1) * per_phase


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
