"""One simulated peer: the real protocol stack, driven in virtual time.

A ``SimPeer`` joins through the real join protocol, runs the real
``PeerNode`` (membership, join answering, exchange routing), the real
averaging state machine behind the same ``SafePoint``, and real torch steps
on its shard. Only two things differ from a peer process: its transport is
``sim://`` and the time a local step takes is charged to the virtual clock
(``step_time * speed``) instead of being spent.

A crash is the cancellation of its task: no leave is announced, its
transport disappears from the simulated network, and messages in flight to
it are lost, as with a killed process.
"""

from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass
from typing import Callable

import torch

from gossiptrain.config import RunConfig
from gossiptrain.net.transport import listen
from gossiptrain.net.addressing import client_address
from gossiptrain.net.transport.sim import SimNetwork, SimTransport
from gossiptrain.protocol.averaging import Averaging
from gossiptrain.protocol.joining import JoinRequest
from gossiptrain.protocol.lr_scaling import SwarmLrScaling
from gossiptrain.protocol.param_spec import ParamSpec
from gossiptrain.protocol.state_transfer import TransferResult
from gossiptrain.runtime.assembly import install_transfer, node_for, training_side
from gossiptrain.runtime.join_client import join_swarm
from gossiptrain.runtime.peer_network import PeerNode
from gossiptrain.runtime.safepoint import SafePoint
from gossiptrain.runtime.state_endpoint import catch_up
from gossiptrain.sim.batched_steps import StepBatcher
from gossiptrain.sim.compute import step_factor
from gossiptrain.sim.vtime import LoopClock
from gossiptrain.train.local_trainer import LocalTrainer, budget_spent, optimizer_for
from gossiptrain.train.workload import Workload


@dataclass(frozen=True)
class SimPeerSpec:
    """Who a simulated peer is and how fast it computes."""

    index: int  # its slot in the cluster (0..peers-1); a rejoin keeps the slot
    generation: int  # 0 for the first start, then one more for each rejoin
    speed: float  # slowdown factor: a step takes step_time * speed * contention virtual seconds
    step_time: float  # virtual seconds per local step at speed 1, alone on a core
    exchange_time: float = 0.0  # virtual seconds of computation per exchange operation (snapshot or merge)
    contention: float = 1.0  # peers per core: computation is slowed by this when cores are shared
    poison: float = 1.0  # a rogue peer sends valid parameters scaled by this (1: honest)
    step_jitter: float = 0.0  # coefficient of variation of a step's time (gamma distributed with mean 1)
    step_sigma: float = 0.0  # or lognormal step times with this sigma (mean 1): gossiptrain.sim.compute
    eval_time: float = 0.0  # virtual seconds of one test-set evaluation (a real peer evaluates on its training thread)
    wait_for: int = 0  # train only once this many members (itself included) are ready, as `peer --wait-for`
    client: bool = False  # behind NAT: nobody can dial it, it joins as a client-mode member
    relay: bool = False  # it relays between clients, as `gossiptrain peer --relay` (never a client itself)

    @property
    def name(self) -> str:
        return f"peer{self.index}" if self.generation == 0 else f"peer{self.index}.{self.generation}"


class SimPeer:
    """Runs until cancelled (a crash, or the end of the simulation)."""

    def __init__(
        self,
        spec: SimPeerSpec,
        *,
        network: SimNetwork,
        join: str,
        local: RunConfig,
        workload: Workload | None,
        make_model: Callable[[], torch.nn.Module] | None,
        seed: int,
        batcher: StepBatcher | None = None,
    ) -> None:
        self.spec = spec
        self.batcher = batcher  # the cluster's: local steps computed together with other peers' (None: one by one)
        self.network = network
        self.join = join
        self.local = local
        self.workload = workload
        self.make_model = make_model
        self.rng = random.Random(seed)
        self.jitter_rng = random.Random(seed ^ 0x5EED)  # its own stream: jitter on or off leaves the protocol's draws alone
        self.clock = LoopClock()
        self.node: PeerNode | None = None
        self.trainer: LocalTrainer | None = None
        self.averaging: Averaging | None = None
        self.safepoint: SafePoint | None = None
        self.lr_scaling: SwarmLrScaling | None = None  # the square-root rule on this incarnation's optimizer, if adaptive
        self.transport: SimTransport | None = None
        self.joined_at: float | None = None
        self.transfer: TransferResult | None = None  # how its state download went (None: there was none)
        self.ready_at: float | None = None  # virtual time it was ready to train (joined, state downloaded)
        self.started_at: float | None = None  # virtual time its training began

    @property
    def model(self) -> torch.nn.Module | None:
        return self.trainer.model if self.trainer else None

    async def run(self) -> None:
        limits = self.local.limits
        transport = self.transport = listen(f"sim://{self.spec.name}:0", limits, network=self.network)
        async with transport:
            if self.spec.client:  # as Peer does once it knows nobody can dial it (gossiptrain.protocol.reachability)
                transport.become_client(client_address(transport.address))
            welcome = await join_swarm(
                transport,
                self.join,
                JoinRequest(),
                advertise=transport.address,
                limits=limits,
                clock=self.clock,
                attempts=self.local.membership.join_attempts,
                attempt_timeout=self.local.membership.join_timeout,
                rng=self.rng,
            )
            config = welcome.config
            model = self.make_model() if self.make_model else None
            params = dict(model.named_parameters()) if model is not None else {}
            node = self.node = node_for(
                welcome,
                address=transport.address,
                incarnation=int(self.clock.now() * 1e6) + 1,  # virtual microseconds, as Peer uses wall-clock ones
                transport=transport,
                clock=self.clock,
                rng=self.rng,
                spec=ParamSpec.of(params) if model is not None else None,
                relay=self.spec.relay,
            )
            if self.spec.client:  # as Peer does: other clients through a relaying member, else the coordinator
                node.use_relays()
            async with node:
                self.joined_at = self.clock.now()
                if model is None or self.workload is None:
                    await asyncio.Event().wait()  # membership only: the node's own tasks do the work
                    return
                optimizer = optimizer_for(self.workload, config.train, model)  # the workload's own, where it brings one
                side = training_side(
                    node, model, clock=self.clock, rng=self.rng, optimizer=optimizer,
                    send=node.send_exchange, offer=node.state.offer_snapshot,
                )
                self.averaging = side.averaging
                self.lr_scaling = side.lr_scaling
                self.averaging.poison = self.spec.poison
                safepoint, snapshots = side.safepoint, side.snapshots
                self.safepoint = safepoint
                await node.seeds_verified()
                if config.state.enabled and any(m != node.me.id for m in node.view()):
                    # As Peer does: the swarm's current state first, then training (virtual time passes meanwhile).
                    self.transfer, values = await catch_up(
                        node.state, model, me=node.me.id, members=node.view, rng=self.rng, clock=self.clock,
                        optimizer=optimizer,
                    )
                    install_transfer(self.transfer, values, side)
                node.mark_ready()
                self.ready_at = self.clock.now()
                if self.spec.wait_for:  # the rendezvous, as the peer command's (Peer.wait_for_peers)
                    safepoint.serve_as_is()  # answer partners while waiting
                    node.wait_for(self.spec.wait_for)
                    while not node.released.is_set():
                        await asyncio.sleep(0.01)
                leases = (lambda n: node.use_leases(n, config.train.seed)) if config.data.mode == "leased" else None
                trainer = self.trainer = LocalTrainer(self.workload, model, config.train, welcome.shard, optimizer=optimizer,
                                                      leases=leases)
                if self.transfer is not None and self.transfer.ok and config.state.transfer_step:
                    trainer.continue_from(self.transfer.step)
                started = self.started_at = self.clock.now()
                spec = self.spec
                next_eval = started + config.train.eval_every_seconds
                batcher = self.batcher
                while not budget_spent(config.train, trainer.steps, self.clock.now() - started):
                    # The step, now or (batched) by the end of the virtual time it costs: nothing reads the live
                    # parameters meanwhile (gossiptrain.sim.batched_steps)
                    if not (batcher.begin(trainer) if batcher is not None else trainer.step() is not None):
                        await asyncio.sleep(spec.step_time)  # leased data: nothing to claim now; tables come meanwhile
                        continue
                    try:
                        await asyncio.sleep(spec.step_time * spec.speed * spec.contention * self._jitter())  # its cost
                    finally:  # (a crash or the end mid-step: the step is taken, as it was before the sleep unbatched)
                        if batcher is not None:
                            batcher.finish(trainer)
                    before = self._exchange_ops()
                    safepoint(trainer.steps)
                    snapshots(trainer.steps, trainer.samples_seen)
                    if (hold := safepoint.hold()) > 0:  # flow control, as Peer.step waits, in virtual time
                        waiting_since = self.clock.now()
                        while hold > 0:
                            await asyncio.sleep(min(hold, spec.step_time))
                            hold = safepoint.hold()
                        safepoint.waited(self.clock.now() - waiting_since)
                    if spec.exchange_time > 0 and (ops := self._exchange_ops() - before):
                        await asyncio.sleep(ops * spec.exchange_time * spec.contention)
                    if spec.eval_time > 0 and self.clock.now() >= next_eval:  # the cluster samples accuracy; this is its cost
                        await asyncio.sleep(spec.eval_time * spec.contention)
                        next_eval = self.clock.now() + config.train.eval_every_seconds
                await node.leave()
                await asyncio.Event().wait()  # finished: stay reachable until the simulation ends

    def _jitter(self) -> float:
        """A step's time relative to the mean (1 without noise): the compute model synchronous workers share."""
        return step_factor(self.jitter_rng, self.spec.step_jitter, self.spec.step_sigma)

    def _exchange_ops(self) -> int:
        """Exchange operations so far that cost computation: snapshots sent and merges applied."""
        s = self.averaging.stats if self.averaging else None
        return s.started + s.served + s.completed if s else 0

    def stats(self) -> dict[str, float]:
        """Counters for the time series (zeros before the peer has joined)."""
        out: dict[str, float] = {"members": len(self.node.view()) if self.node else 0}
        if self.node is not None:
            health = self.node.membership.stats  # its probes that failed, members it suspected, suspicions of it refuted
            out.update(probes_failed=health.probes_failed, suspicions=health.suspicions, refutations=health.refutations)
        if self.ready_at is not None:
            out["ready"] = self.ready_at
        if self.started_at is not None:
            out["started"] = self.started_at
        if self.transport is not None:
            out["bytes_sent"] = self.transport.stats.bytes_sent
            out["bytes_received"] = self.transport.stats.bytes_received
        if self.averaging is not None and self.trainer is None:
            out["step"] = 0  # still downloading its state (gossiptrain.protocol.state_transfer): no step taken yet
        if self.averaging is not None:
            s = self.averaging.stats
            out.update(
                exchanges=s.completed + s.served,
                timeouts=s.timeouts,
                refused=s.refused,
                declined=s.crossed + s.busy,
                staleness_mean=s.to_dict()["staleness_mean"],
                rtt_ms=s.rtt_ms,
                waited_s=s.waited_s,
                compression_level=s.compression_level,
            )
        if self.safepoint is not None:
            out["wait_share"] = self.safepoint.wait_share  # lately; quasi-global momentum's `auto` reads it
            # The last optimizer step's multiplier of the rate (gossiptrain.protocol.lr_scaling); 1: not scaled
            out["lr_scale"] = self.lr_scaling.last_factor if self.lr_scaling is not None else 1.0
            if (guard := self.safepoint.guard) is not None:  # the stability guard: methods off now, NaN models restored
                out.update(guard_backed_off=guard.stats.backed_off, guard_restores=guard.stats.restores)
        if self.node is not None and self.node.leases is not None:  # leased data: the epoch, chunks done, twice
            out.update({k: float(v) for k, v in self.node.leases.stats().items()})
        return out
