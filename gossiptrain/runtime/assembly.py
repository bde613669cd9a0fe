"""Putting one peer together after a welcome: the same parts for ``Peer`` (real time) and ``SimPeer`` (virtual).

Both turn a ``Welcome`` into a network side (``PeerNode``), an averaging
state machine behind a ``SafePoint``, and a snapshot hook that offers our
state to newcomers; both install a downloaded state the same way. They
differ only in where things run: ``Peer`` drives the node on its own event
loop thread and hands actions across with ``call_soon``, the simulator runs
everything on one virtual-time loop. Keeping the assembly here means a new
part (or a changed order) reaches real and simulated peers together, which
is what keeps the simulator faithful.
"""

from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass
from typing import Callable

import torch

from gossiptrain.net.transport import Transport
from gossiptrain.protocol.algorithms import make_averaging
from gossiptrain.protocol.averaging import Averaging, ParamSpec, SendExchange
from gossiptrain.protocol.drift import DriftCorrection, drift_gain
from gossiptrain.protocol.joining import Welcome
from gossiptrain.protocol.lr_scaling import SwarmLrScaling, wants_scaling
from gossiptrain.protocol.membership import Member
from gossiptrain.protocol.momentum import LINK_BOUND_SHARE, QuasiGlobalMomentum, wants_quasi_global
from gossiptrain.protocol.state_transfer import TransferResult
from gossiptrain.runtime.clock import Clock
from gossiptrain.runtime.peer_network import PeerNode
from gossiptrain.runtime.safepoint import SafePoint
from gossiptrain.runtime.state_endpoint import SnapshotHook, StateCopy
from gossiptrain.state.snapshot import install


def node_for(
    welcome: Welcome,
    *,
    address: str,
    incarnation: int,
    transport: Transport,
    clock: Clock,
    rng: random.Random,
    spec: ParamSpec | None,
    nonces: random.Random | None = None,
    relay: bool = False,
) -> PeerNode:
    """The (unstarted) network side of the member ``welcome`` admitted, seeded with the members it named.

    ``incarnation`` must outrank whatever the swarm remembers of an earlier
    process under this id (even its death): callers pass the current time in
    microseconds, wall-clock or virtual. ``nonces``: see ``Membership``.
    ``relay``: we relay between client-mode members: the transport serves as
    a relay and our entry says so. Call on the transport's event loop.
    """
    if relay:
        transport.serve_as_relay(asyncio.get_running_loop().time())
    me = Member(welcome.member_id, address, welcome.shard, incarnation=incarnation, relay=relay)
    return PeerNode(
        me=me,
        config=welcome.config,
        transport=transport,
        clock=clock,
        rng=rng,
        spec=spec,
        coordinator=welcome.coordinator,
        seeds=welcome.members,
        nonces=nonces,
    )


@dataclass
class TrainingSide:
    """What the training loop calls at each safe point: averaging, and offering our state to newcomers."""

    averaging: Averaging
    safepoint: SafePoint
    snapshots: SnapshotHook
    lr_scaling: SwarmLrScaling | None = None  # close() it when the peer leaves: its optimizer steps at the user's rate
    momentum: QuasiGlobalMomentum | None = None  # quasi-global momentum, where this swarm runs it


def training_side(
    node: PeerNode,
    model: torch.nn.Module,
    *,
    clock: Clock,
    rng: random.Random,
    optimizer: torch.optim.Optimizer | None,
    send: Callable[[SendExchange], None],
    offer: Callable[[StateCopy], None],
) -> TrainingSide:
    """The averaging machine over ``model``'s parameters, its safe point, and the donor's snapshot hook.

    ``send`` carries an averaging action to the node and ``offer`` a state
    copy to its state endpoint, on whatever thread the node runs.
    """
    averaging = make_averaging(dict(model.named_parameters()), node.config.gossip, rng, me=node.me.id)
    safepoint = SafePoint(node, averaging, clock, send)
    momentum = None
    gossip = node.config.gossip
    if optimizer is not None and wants_quasi_global(gossip):
        # auto: only while the link keeps up (with drift correction it diverged where flow control waits most)
        keeps_up = (lambda: safepoint.wait_share < LINK_BOUND_SHARE) if gossip.momentum_mode == "auto" else None
        safepoint.after = momentum = QuasiGlobalMomentum(optimizer, active=keeps_up)
    if (gain := drift_gain(gossip)) > 0:
        safepoint.drift = DriftCorrection(averaging.params, gain, stale_merges=averaging.merges_stale, reported=averaging.reports_moves)
    snapshots = SnapshotHook(node.state, model, offer, clock, optimizer=optimizer)
    scaling = None
    if optimizer is not None and wants_scaling(gossip.lr_scaling, optimizer):
        scaling = SwarmLrScaling(optimizer, lambda: len(node.view()))  # the live members, ourselves included
    return TrainingSide(averaging, safepoint, snapshots, scaling, momentum)


def install_transfer(
    result: TransferResult,
    values: list[torch.Tensor] | None,
    snapshots: SnapshotHook,
    optimizer: torch.optim.Optimizer | None,
    momentum: QuasiGlobalMomentum | None = None,
) -> None:
    """Put a downloaded state into the live model (and optimizer), on the training thread, before any step."""
    if values is None:
        return
    install(snapshots.tensors, values)
    if momentum is not None:
        momentum.mid_run()
    if result.optimizer_state is not None and optimizer is not None:
        optimizer.load_state_dict(result.optimizer_state)
