"""What a simulated run is: ``SimConfig`` (its configuration) and ``SimResult`` (what it returns).

A module of their own, below ``gossiptrain.sim.cluster`` (gossip) and
``gossiptrain.sim.synchronous`` (the synchronous baselines), which both take
a ``SimConfig`` and return a ``SimResult``, so that neither imports the
other for them. ``gossiptrain.sim.cluster`` still offers both names.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import topologies
from gossiptrain.config import RunConfig
from gossiptrain.errors import ConfigError
from gossiptrain.net.transport.sim import LinkProfile
from gossiptrain.sim.collectives import ALLREDUCE
from gossiptrain.sim.faults import ChurnEvent, PartitionSpec

#: The simulator's memory, fitted on runs measured with ``/usr/bin/time -v`` (docs/how-to/simulator.md, "How fast it
#: runs"): once the swarm has gossiped, every view holds every member, under 1 KB an entry (n^2 in all: 0.82 GB at
#: 1,000 members, membership only, 40 virtual s; 1 KB leaves room); each peer's own runtime about 64 KB; each
#: training peer some 16 copies of the model's parameters and buffers (its model, gradients, optimizer state, averaging
#: buffers: digits' 4.5 MB model, 68 MB a peer).
VIEW_ENTRY_BYTES = 1 << 10
PEER_BYTES = 64 << 10
MODEL_COPIES_PER_PEER = 16


def memory_estimate(peers: int, run: RunConfig, model_bytes: int, *, membership_only: bool = False, system: str = "gossip") -> int:
    """Bytes a simulation of ``peers`` adds to this process at its peak, from sizes known before building anything.

    ``model_bytes``: one copy of the workload's parameters and buffers (0 with ``membership_only``). The
    synchronous baselines hold one model and no views. A topology that samples a dense graph (erdos-renyi,
    small-world) adds its n x n sample.
    """
    if system != "gossip":
        return 8 * model_bytes + peers * PEER_BYTES
    per_peer = PEER_BYTES + (0 if membership_only else MODEL_COPIES_PER_PEER * model_bytes)
    estimate = peers * per_peer + peers * peers * VIEW_ENTRY_BYTES + 4 * model_bytes
    if not membership_only and topologies.parse(run.gossip.topology_spec).dense_sample:
        estimate += 10 * peers * peers  # the random draws (float64) and the boolean graph built from them
    return estimate


#: What ``SimConfig.system`` may be: gossip (the runtime's peers) or a synchronous baseline (gossiptrain.sim.synchronous).
SYSTEMS = ("gossip", "ddp", "ps-sync", "ps-async")


@dataclass(frozen=True)
class SimConfig:
    """One simulated run. ``run`` is the swarm's configuration, as a coordinator would hold it."""

    peers: int = 8
    run: RunConfig = field(default_factory=RunConfig)
    duration: float = 60.0  # virtual seconds
    seed: int = 0
    step_time: float | None = None  # virtual seconds per local step at speed 1; None: measure it here
    speeds: tuple[float, ...] = ()  # per-peer slowdown factors (overrides stragglers/slowdown)
    stragglers: float = 0.0  # fraction of peers that are slow
    slowdown: float = 4.0  # how much slower a straggler computes
    link: LinkProfile = field(default_factory=LinkProfile)
    partitions: tuple[PartitionSpec, ...] = ()
    churn_rate: float = 0.0  # crashes per virtual second across the cluster (Poisson)
    churn_downtime: float = 5.0  # virtual seconds a crashed peer stays down before it rejoins
    churn_trace: tuple[ChurnEvent, ...] = ()  # explicit crash/join events (added to the Poisson ones)
    exchange_time: float = 0.0  # virtual seconds of computation per exchange operation (0: free)
    cores: float = 0.0  # cores the peers share (0: one each); fewer cores than busy peers slow everyone
    step_jitter: float = 0.0  # coefficient of variation of a step's time (gamma distributed, mean 1; 0: every step alike)
    step_sigma: float = 0.0  # heavy-tailed step times instead: lognormal with this sigma, mean 1 (gossiptrain.sim.compute)
    eval_time: float = 0.0  # virtual seconds of one test-set evaluation, charged every train.eval_every_seconds (0: free)
    wait_for: int = 0  # as `peer --wait-for N`: a peer trains once N members (itself included) are ready
    join_spread: float = 1.0  # virtual seconds over which the initial peers start (evenly spaced)
    sample_every: float = 1.0  # virtual seconds between samples of every peer
    membership_only: bool = False  # no model, no training: just the membership protocol
    target_accuracy: float = 0.0  # stop early once the live peers' mean test accuracy reaches it (0: never)
    target_hold: int = 1  # ...and holds it for this many consecutive samples (one noisy crossing is not enough)
    rogue: tuple[int, ...] = ()  # peers (by index) that send valid parameters scaled by rogue_scale (poisoning)
    rogue_scale: float = 100.0
    system: str = "gossip"  # or a synchronous baseline on the same compute and links: ddp, ps-sync, ps-async
    restart_cost: float = 30.0  # synchronous baselines: virtual seconds a crash costs (timeout, restart, reload)
    checkpoint_every: float = 0.0  # ...and they resume from a checkpoint this often (0: after every step)
    allreduce: str = "ring"  # ddp: ring, halving-doubling or best (gossiptrain.sim.collectives)
    behind_nat: tuple[int, ...] = ()  # peers (by index) nobody can dial: client-mode members (Transport.become_client)
    relays: tuple[int, ...] = ()  # peers (by index) that relay between clients, as `gossiptrain peer --relay`
    coordinator_relay: bool = True  # the coordinator relays between clients (`gossiptrain coordinator --no-relay`: off)
    # Peers' local steps computed in stacked calls where their models allow (gossiptrain.sim.batched_steps): the same
    # parameters up to float rounding; False: every step on its own, as before
    batch_steps: bool = True

    def __post_init__(self) -> None:
        def need(ok: bool, name: str, msg: str) -> None:
            if not ok:
                raise ConfigError(f"sim.{name} {msg}")

        need(self.peers >= 1, "peers", f"must be >= 1, got {self.peers}")
        need(self.duration > 0, "duration", "must be > 0")
        need(self.step_time is None or self.step_time > 0, "step_time", "must be > 0")
        need(all(s >= 1 for s in self.speeds), "speeds", "are slowdown factors and must be >= 1")
        need(not self.speeds or len(self.speeds) == self.peers, "speeds", f"needs one factor per peer ({self.peers})")
        need(0 <= self.stragglers <= 1, "stragglers", "is a fraction in [0, 1]")
        need(self.slowdown >= 1, "slowdown", "must be >= 1")
        need(self.churn_rate >= 0, "churn_rate", "must be >= 0")
        need(self.churn_downtime >= 0, "churn_downtime", "must be >= 0")
        need(self.sample_every > 0, "sample_every", "must be > 0")
        need(self.exchange_time >= 0, "exchange_time", "must be >= 0")
        need(self.join_spread >= 0, "join_spread", "must be >= 0")
        need(self.cores >= 0, "cores", "must be >= 0 (0: one core per peer)")
        need(self.eval_time >= 0, "eval_time", "must be >= 0")
        need(0 <= self.step_jitter <= 10, "step_jitter", "is a coefficient of variation in [0, 10]")
        need(0 <= self.step_sigma <= 5, "step_sigma", "is a lognormal sigma in [0, 5]")
        need(not (self.step_jitter and self.step_sigma), "step_sigma", "and step_jitter are two noise shapes: set one")
        need(self.system in SYSTEMS, "system", f"must be one of {', '.join(SYSTEMS)}, got {self.system!r}")
        need(self.restart_cost >= 0, "restart_cost", "must be >= 0")
        need(self.allreduce in ALLREDUCE, "allreduce", f"must be one of {', '.join(ALLREDUCE)}, got {self.allreduce!r}")
        need(self.checkpoint_every >= 0, "checkpoint_every", "must be >= 0 (0: after every step)")
        need(self.system == "gossip" or not self.membership_only, "system", "needs a model: not with membership_only")
        need(self.system == "gossip" or not (self.rogue or self.partitions), "system",
             "is a synchronous baseline: rogue peers and partitions are simulated for gossip only")
        need(0 <= self.wait_for <= self.peers, "wait_for", f"is a member count in [0, peers={self.peers}]")
        need(0 <= self.target_accuracy <= 1, "target_accuracy", "is an accuracy in [0, 1]")
        need(self.target_hold >= 1, "target_hold", "must be >= 1")
        need(all(0 <= i < self.peers for i in self.rogue), "rogue", f"names a peer outside 0..{self.peers - 1}")
        need(all(0 <= i < self.peers for i in self.behind_nat), "behind_nat", f"names a peer outside 0..{self.peers - 1}")
        need(self.system == "gossip" or not self.behind_nat, "behind_nat", "is simulated for gossip only")
        need(all(0 <= i < self.peers for i in self.relays), "relays", f"names a peer outside 0..{self.peers - 1}")
        need(not set(self.relays) & set(self.behind_nat), "relays", "names a peer behind NAT: nobody could reach it to relay")
        for e in self.churn_trace:
            need(0 <= e.peer < self.peers, "churn_trace", f"names peer {e.peer}, but there are {self.peers}")
        if not self.membership_only:
            # The peer count is known here, so a topology that cannot exist at this size is an error before
            # anything starts (a real swarm, whose size changes, falls back to the complete graph instead).
            spec = self.run.gossip.topology_spec
            try:
                topologies.parse(spec).neighbours(self.peers, 0, 0)
            except ValueError as e:
                raise ConfigError(f"gossip.topology {spec!r} does not work with {self.peers} peers: {e}") from None

    def contention(self) -> float:
        """How much slower computation runs because peers share ``cores``.

        A peer with slowdown s computes 1/s of the time (a straggler idles the
        rest), so the busy peers number sum(1/s); past ``cores`` they share.
        """
        if self.cores <= 0:
            return 1.0
        return max(1.0, sum(1.0 / s for s in self.peer_speeds()) / self.cores)

    def peer_speeds(self) -> list[float]:
        """Slowdown of each peer: explicit ``speeds``, or the first ``stragglers`` fraction slowed."""
        if self.speeds:
            return list(self.speeds)
        slow = round(self.stragglers * self.peers)
        return [self.slowdown if i < slow else 1.0 for i in range(self.peers)]


@dataclass
class SimResult:
    rows: list[dict[str, Any]]  # one per live peer per sample
    summary: dict[str, Any]
