"""Putting one peer together after a welcome: the same parts for ``Peer`` (real time) and ``SimPeer`` (virtual).

Both turn a ``Welcome`` into a network side (``PeerNode``), an averaging
state machine behind a ``SafePoint``, and a snapshot hook that offers our
state to newcomers; both install a downloaded state the same way. They
differ only in where things run: ``Peer`` drives the node on its own event
loop thread and hands actions across with ``call_soon``, the simulator runs
everything on one virtual-time loop. Keeping the assembly here means a new
part (or a changed order) reaches real and simulated peers together, which
is what keeps the simulator faithful.

What the swarm adds to an optimizer (quasi-global momentum, the rate
scaling, its state offered to newcomers, a downloaded state loaded into it)
is given by one function, ``bind_optimizer``: at construction where the
optimizer is given, and at its first step where ``Peer`` finds it
(``gossiptrain.runtime.optimizer_finder``), so that the two paths cannot differ.
"""

from __future__ import annotations

import asyncio
import logging
import random
from dataclasses import dataclass, field
from typing import Callable

import torch

from gossiptrain.net.transport import Transport
from gossiptrain.protocol.algorithms import make_averaging
from gossiptrain.protocol.averaging import Averaging
from gossiptrain.protocol.averaging_events import SendExchange
from gossiptrain.protocol.drift import DriftCorrection, drift_gain, keeps_running_stats
from gossiptrain.protocol.joining import Welcome
from gossiptrain.protocol.lr_scaling import SwarmLrScaling, wants_scaling
from gossiptrain.protocol.member import Member
from gossiptrain.protocol.momentum import LINK_BOUND_SHARE, QuasiGlobalMomentum, wants_quasi_global
from gossiptrain.protocol.local_sgd import LocalSGD
from gossiptrain.protocol.param_spec import ParamSpec
from gossiptrain.protocol.stability import (
    DRIFT_CORRECTION,
    LR_SCALING,
    OUTER_STEP,
    QUASI_GLOBAL_MOMENTUM,
    StabilityGuard,
    forget_state,
)
from gossiptrain.protocol.state_transfer import TransferResult
from gossiptrain.runtime.clock import Clock
from gossiptrain.runtime.peer_network import PeerNode
from gossiptrain.runtime.safepoint import SafePoint
from gossiptrain.runtime.state_endpoint import SnapshotHook, StateCopy, aside_state_dict
from gossiptrain.state.snapshot import install

log = logging.getLogger(__name__)


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
    """What the training loop calls at each safe point: averaging, and offering our state to newcomers.

    The optimizer's parts may come late: where ``Peer`` finds the optimizer at
    its first step, ``bind_optimizer`` sets them then.
    """

    node: PeerNode
    model: torch.nn.Module
    averaging: Averaging
    safepoint: SafePoint
    snapshots: SnapshotHook
    lr_scaling: SwarmLrScaling | None = None  # the first optimizer's that is scaled (``close()`` gives them back)
    momentum: QuasiGlobalMomentum | None = None  # quasi-global momentum, where this swarm runs it (the first optimizer's)
    optimizers: list[torch.optim.Optimizer] = field(default_factory=list)  # bound, in order
    scalings: list[SwarmLrScaling] = field(default_factory=list)  # every bound optimizer's
    momenta: list[QuasiGlobalMomentum] = field(default_factory=list)  # every bound optimizer's
    guard: StabilityGuard | None = None  # backs the methods above off at a sign of a blow-up (gossip.guard)
    downloaded: bool = False  # the model holds a running swarm's state (install_transfer): no momentum warm start
    aside: TransferResult | None = None  # an optimizer state downloaded before any optimizer was bound, for the first
    aside_outcome: str = ""  # what became of it at binding: "installed" or "refused"

    def close(self) -> None:
        """The peer leaves: every scaled optimizer steps at the user's rate again (they outlive the peer)."""
        for scaling in self.scalings:
            scaling.close()
        self.scalings.clear()

    def _after_safe_point(self) -> None:
        """Several optimizers bound: each one's quasi-global momentum after the safe point."""
        for momentum in self.momenta:
            momentum()


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
    copy to its state endpoint, on whatever thread the node runs. ``optimizer``
    (None: none yet, or none at all) is bound at once (``bind_optimizer``).
    """
    averaging = make_averaging(dict(model.named_parameters()), node.config.gossip, rng, me=node.me.id)
    safepoint = SafePoint(node, averaging, clock, send)
    if (gain := drift_gain(node.config.gossip, running_stats=keeps_running_stats(model))) > 0:
        safepoint.drift = DriftCorrection(averaging.params, gain, stale_merges=averaging.merges_stale, reported=averaging.reports_moves)
    snapshots = SnapshotHook(node.state, model, offer, clock)
    side = TrainingSide(node, model, averaging, safepoint, snapshots)
    if node.config.gossip.guard:
        guard = safepoint.guard = side.guard = StabilityGuard(averaging.params)
        if safepoint.drift is not None:
            guard.add(DRIFT_CORRECTION, safepoint.drift)
        if isinstance(averaging, LocalSGD) and averaging.has_outer_step:
            guard.add(OUTER_STEP, averaging)
    if optimizer is not None:
        bind_optimizer(side, optimizer)
    return side


def bind_optimizer(side: TrainingSide, optimizer: torch.optim.Optimizer) -> list[str]:
    """Give ``optimizer`` what this swarm runs with it; what it got, in words (for a log line).

    Quasi-global momentum (SGD with momentum, where ``gossip.momentum_mode``
    asks for it), Adam's square-root rate scaling (``gossip.lr_scaling``), and
    for the first optimizer bound: its state offered to newcomers, and a
    state downloaded before it was known (``side.aside``) loaded into it. A
    second optimizer over the model (``gossiptrain.runtime.optimizer_finder``)
    gets its own momentum and scaling; newcomers then get no optimizer state,
    which carries one optimizer's. On the training thread, before the
    optimizer's next step.
    """
    gossip = side.node.config.gossip
    side.optimizers.append(optimizer)
    if side.guard is not None:  # a model put back (a blow-up, a non-finite model): this optimizer restarts
        side.guard.on_restore(lambda: _forget_state(optimizer))
    if len(side.optimizers) == 1:
        if side.aside is not None:
            _load_aside(side, optimizer)
        side.snapshots.give_optimizer(optimizer)
        if side.safepoint.drift is not None:  # the correction falls with the user's rate (DriftCorrection.follow_rate)
            side.safepoint.drift.rate = lambda: optimizer.param_groups[0]["lr"]
    elif len(side.optimizers) == 2:
        side.snapshots.give_optimizer(None)
        if side.node.config.state.transfer_optimizer:
            log.info("two optimizers step this model (%s): state transfer carries no optimizer state from here on "
                     "(it holds one optimizer's); pass optimizer= to share one", ", ".join(type(o).__name__ for o in side.optimizers))
    got = []
    if wants_quasi_global(gossip):
        safepoint = side.safepoint
        # auto: only while the link keeps up (with drift correction it diverged where flow control waits most)
        keeps_up = (lambda: safepoint.wait_share < LINK_BOUND_SHARE) if gossip.algorithm == "pairwise" else None
        momentum = QuasiGlobalMomentum(optimizer, active=keeps_up)
        if side.downloaded:
            momentum.mid_run()
        side.momenta.append(momentum)
        if side.guard is not None and momentum.enabled:
            side.guard.add(QUASI_GLOBAL_MOMENTUM, momentum)
        safepoint.after = momentum if len(side.momenta) == 1 else side._after_safe_point
        if side.momentum is None or (momentum.enabled and not side.momentum.enabled):
            side.momentum = momentum
        if momentum.enabled:
            got.append("quasi-global momentum")
    if wants_scaling(gossip.lr_scaling, optimizer):
        node = side.node
        scaling = SwarmLrScaling(optimizer, lambda: len(node.view()))  # the live members, ourselves included
        side.scalings.append(scaling)
        if side.guard is not None:
            side.guard.add(LR_SCALING, scaling)
        side.lr_scaling = side.lr_scaling or scaling
        got.append("square-root lr scaling")
    return got


def _forget_state(optimizer: torch.optim.Optimizer) -> None:
    if forgotten := forget_state(optimizer):
        log.info("stability: %s forgot its state of %d parameters (momentum, moments): it starts them afresh",
                 type(optimizer).__name__, forgotten)


def _load_aside(side: TrainingSide, optimizer: torch.optim.Optimizer) -> None:
    """The optimizer state downloaded before ``optimizer`` was known, into it; one that does not fit is dropped, said."""
    result, side.aside = side.aside, None
    assert result is not None
    fitted = aside_state_dict(side.model, optimizer, result)
    if isinstance(fitted, dict):
        try:
            optimizer.load_state_dict(fitted)
        except (ValueError, KeyError, TypeError, RuntimeError) as e:  # torch's own refusals of a state dict
            fitted = f"load_state_dict refused it ({e!r:.200})"
        else:
            log.info("state transfer: the donor's optimizer state is in the %s found", type(optimizer).__name__)
            side.aside_outcome = "installed"
            return
    side.aside_outcome = "refused"
    log.warning("state transfer: the optimizer state downloaded does not fit the %s found (%s): it starts from "
                "its own fresh state", type(optimizer).__name__, fitted)


def install_transfer(result: TransferResult, values: list[torch.Tensor] | None, side: TrainingSide) -> None:
    """Put a downloaded state into the live model (and optimizer), on the training thread, before any step.

    An optimizer state that came while no optimizer was bound
    (``result.optimizer_aside``) waits on the side for the first one bound.
    """
    if values is None:
        return
    install(side.snapshots.tensors, values)
    side.downloaded = True
    for momentum in side.momenta:
        momentum.mid_run()
    if result.optimizer_state is not None and side.optimizers:
        side.optimizers[0].load_state_dict(result.optimizer_state)
    elif result.optimizer_aside:
        side.aside = result
