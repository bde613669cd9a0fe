"""What a split peer's ranks run with their pieces beyond plain averaging: drift correction and the square-root rate
rule (issue 48).

Both are the whole-model peer's methods (``gossiptrain.protocol.drift``,
``gossiptrain.protocol.lr_scaling``), each rank running them on its own piece
and its own optimizer. Both act element by element (the correction adds
``gain * c`` to each parameter; the rate scales each optimizer's step), so a
model's pieces corrected and stepped one by one are the whole model corrected
and stepped, provided every number that decides what they do is the same on
every rank. The group agrees on each of them:

- the gain: from the configuration, and from whether the model keeps running
  statistics on *any* rank (``drift_gain``: a BatchNorm in one pipeline stage
  turns the correction off on every stage), agreed when the group starts;
- the correction's memory: the leader's measure of the link's round trip in
  local steps, carried in the safe point's gather (``SplitGroup.safe_point``);
- the members the rate scaling counts: the leader's view, in the news every
  rank gets at the same safe point, used from the next optimizer step on;
- the model's norm the stability guard judges (``gossip.guard``): the sum of
  every rank's piece's squared norm, gathered at the safe point, so that
  every rank's guard backs off, puts its piece back and restarts its
  optimizer at the same safe point (``StabilityGuard.judge``), and the group
  then neither asks nor serves while the guard lets the sign settle. The
  guard judges the model as the safe point starts (the local step in, not
  yet the safe point's merges): one safe point later than a whole-model
  peer's, which judges at its end.

- quasi-global momentum, where the swarm asks for it (``gossip.momentum_mode
  = quasi-global``; off by default): whether it runs at a safe point is the
  group's word (every rank ready, past its warmup and not backed off, and
  the leader's link keeping up, as a whole-model pairwise peer's), and the
  change it clips is the whole model's: every rank's squared norm of its
  piece's change, summed in a second gather at the safe points where it
  runs (``momentum_ready``, ``momentum_measure``, ``momentum_apply``).

Each rank's optimizer is its own (an FSDP2 rank's holds its shard's state):
given (``Peer(..., optimizer=opt)`` on every rank) or found at its first step
(``optimizer_finder``), as a whole-model peer's is. The guard's refusal of
a partner whose model's norm is far from ours is the exchanges'
(``piece_exchange``: the request carries the norm the group judged).
Automatic compression and flow control are the group's (``SplitGroup``);
staleness weights the exchanges' own (``piece_exchange``).
"""

from __future__ import annotations

import logging
import math
from typing import Any, Sequence

import torch

from gossiptrain.config import GossipConfig
from gossiptrain.protocol.drift import DriftCorrection, drift_gain
from gossiptrain.protocol.lr_scaling import SwarmLrScaling, wants_scaling
from gossiptrain.protocol.momentum import QuasiGlobalMomentum, wants_quasi_global
from gossiptrain.protocol.stability import (
    DRIFT_CORRECTION,
    LR_SCALING,
    QUASI_GLOBAL_MOMENTUM,
    StabilityGuard,
    forget_state,
)
from gossiptrain.state.local_tensors import local

log = logging.getLogger(__name__)


class PieceMethods:
    """One rank's drift correction over its piece and rate scaling of its optimizer (see the module docstring).

    ``params``: the rank's piece, as the views its exchanges write; ``running_stats``: whether the model keeps
    running statistics on any rank of the group (agreed, so that every rank has the same gain)."""

    def __init__(self, params: Sequence[torch.Tensor], gossip: GossipConfig, *, running_stats: bool) -> None:
        self.gossip = gossip
        self.gain = drift_gain(gossip, running_stats=running_stats)
        self.drift = DriftCorrection(params, self.gain) if self.gain > 0 else None
        self.members = 1  # the live members the leader counted at the last safe point, ourselves included
        self.optimizers: list[torch.optim.Optimizer] = []
        self.scalings: list[SwarmLrScaling] = []
        self.quasi_global = wants_quasi_global(gossip)
        self.momenta: list[QuasiGlobalMomentum] = []  # quasi-global momentum of each optimizer, where asked for
        self._running: list[QuasiGlobalMomentum] = []  # those that measured at this safe point, to apply
        self.downloaded = False  # the piece came from a running swarm (quasi-global momentum: no warm start)
        self.guard = StabilityGuard(params) if gossip.guard else None
        self.safe_points = 0  # the guard's clock: safe points, alike on every rank
        if self.guard is not None and self.drift is not None:
            self.guard.add(DRIFT_CORRECTION, self.drift)

    def bind(self, optimizer: torch.optim.Optimizer) -> list[str]:
        """This rank's optimizer (given, or found at its first step, before that step): the correction follows its
        rate (``DriftCorrection.follow_rate``) and Adam and its kin step at ``sqrt(members)`` times it (``lr_scaling =
        auto``). What it got, in words (for a log line)."""
        self.optimizers.append(optimizer)
        got = []
        if self.drift is not None and self.drift.rate is None:
            self.drift.rate = lambda: optimizer.param_groups[0]["lr"]
            got.append(f"drift correction (gain {self.gain:g})")
        if self.quasi_global:
            momentum = QuasiGlobalMomentum(optimizer, local=local)
            if momentum.enabled:
                if self.downloaded:
                    momentum.mid_run()
                self.momenta.append(momentum)
                if self.guard is not None:
                    self.guard.add(QUASI_GLOBAL_MOMENTUM, momentum)
                got.append("quasi-global momentum")
        if wants_scaling(self.gossip.lr_scaling, optimizer):
            scaling = SwarmLrScaling(optimizer, lambda: self.members)
            self.scalings.append(scaling)
            if self.guard is not None:
                self.guard.add(LR_SCALING, scaling)
            got.append("square-root lr scaling")
        if self.guard is not None:  # a piece put back: this optimizer's state carried the blow-up too
            self.guard.on_restore(lambda: forget_state(optimizer))
        return got

    def piece_square(self) -> float | None:
        """This rank's share of what the guard judges: its piece's squared norm (None: no guard)."""
        return self.guard.squared_norm() if self.guard is not None else None

    def judge(self, squares: list[float]) -> bool:
        """The guard's verdict on the whole model, from every rank's ``piece_square`` (in rank order, the same list on
        every rank): whether this rank's piece was put back (every rank's was, at the same safe point)."""
        self.safe_points += 1
        if self.guard is None:
            return False
        return self.guard.judge(self.safe_points, math.sqrt(sum(squares)))

    @property
    def settling(self) -> bool:
        """A sign within the guard's grace: the group neither asks nor serves (``StabilityGuard.settling``)."""
        return self.guard is not None and self.guard.settling

    def before(self) -> None:
        """The safe point starts: before any merge lands in the piece."""
        if self.drift is not None:
            self.drift.before()

    def after(self, round_trip_steps: float | None) -> None:
        """The safe point's merges are in the piece: add the correction (the memory paced by the leader's measure of
        the link's round trip, in local steps; None: not measured)."""
        if self.drift is not None:
            self.drift.after(round_trip_steps=round_trip_steps)

    def took_download(self) -> None:
        """The piece came from a running swarm: quasi-global momentum starts without its warmup (``mid_run``)."""
        self.downloaded = True
        for m in self.momenta:
            m.mid_run()

    def momentum_ready(self) -> bool:
        """This rank's part of the group's word on quasi-global momentum at the next safe point: an optimizer that
        runs it, every one past its warmup and not backed off (False also where none is asked for or bound yet)."""
        return bool(self.momenta) and all(m.would_run() for m in self.momenta)

    def momentum_measure(self, runs: bool) -> float | None:
        """Quasi-global momentum's first half, at the last safe point of a local step (``runs``: the group's word,
        alike on every rank): this piece's squared norm of the change, for the group to sum; None where it does not
        run (every rank alike: the optimizers' own momentum ran, and our state followed it)."""
        self._running = [m for m in self.momenta if m.tick(active=runs)]
        if not self._running:
            return None
        return sum(m.measure() for m in self._running)

    def momentum_apply(self, norm: float) -> None:
        """The second half: the buffers of the optimizers that ran it, from their changes, clipped by the whole
        model's ``norm`` of the change."""
        running, self._running = self._running, []
        for m in running:
            m.apply(norm)

    def no_more_steps(self) -> None:
        """The final phase: no local steps any more, so no drift to correct; the models only meet (as a whole-model
        peer's final phase). Every rank alike, at the same safe point."""
        self.drift = None

    @property
    def lr_scale(self) -> float:
        """The multiplier of this rank's last optimizer step (1: none)."""
        return self.scalings[0].last_factor if self.scalings else 1.0

    def stats(self) -> dict[str, Any]:
        out: dict[str, Any] = {"drift_gain": self.gain, "lr_scale": self.lr_scale}
        if self.guard is not None:
            out.update(self.guard.stats.to_dict())
            out["guard_off"] = ", ".join(self.guard.backed_off)
        return out

    def close(self) -> None:
        """The optimizers step at the user's rate again (a peer that left the swarm)."""
        for scaling in self.scalings:
            scaling.close()
        self.scalings = []
