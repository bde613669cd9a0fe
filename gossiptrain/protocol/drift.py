"""Drift correction: replay what averaging undid, so that label-skewed peers stop drifting between merges.

With label-skewed shards each local step pushes a peer's model toward its
own classes, and each merge pulls it back toward its partners. What a merge
moves a peer by is, on average over partners, proportional to the swarm's
mean minus its own model: the direction of the bias its own data keeps
adding. So a peer can correct its drift from what it already has, with no
extra bytes: it keeps an exponential moving average ``c`` of the merge
displacements of its safe points and adds ``gain * c`` to its model after
every safe point:

    m = x_after_merges - x_before_merges        (zero at a safe point without merges)
    c <- (1 - beta) c + beta m                  (beta = 1 / MEMORY_STEPS)
    x <- x + gain * c

Each merge is thus replayed ``gain`` times more, spread over the next
``MEMORY_STEPS`` or so steps: a smoothed over-relaxation of averaging that
cancels the persistent part of the drift (the noisy part averages out in
``c``). It works with any optimizer (SGD, Adam) and algorithm, since it only
reads the parameters before and after a safe point.

**Push-sum's merges are stale.** Pairwise and neighbour averaging move a
peer by its partners' models minus the model it sent them, so the local
steps it took since stay whole. Push-sum's receiver moves toward a pushed
model that left its sender before the receiver's latest local step,
against the receiver's model of now: the merge undoes a share of that
step, and the correction replayed the undoing. Across a swarm that agrees
that share is all a merge does, so every peer's ``c`` pointed against the
swarm's progress: 16 peers, iid, 50 ms steps, the mean ``c`` at a cosine of
-0.85 to -0.98 with the swarm's progress, its size (times the gain) about
the progress itself. Push-sum so learned slower the more peers it had
(digits-small to 0.93, seed 1: 16 peers 19.5 s against 6.5 s with no
correction; 64 peers not in 40 s against 14.0 s). So a ``merges_stale``
algorithm reports the share of the model its merges replaced
(``take_stale_share``) and the displacement is measured from the model as
the last safe point left it, adding that share of the local step back:
``m + share * (x_before_merges - x_last_safe_point)``. Across an agreeing
swarm that is zero (the mean ``c`` at a cosine of 0.00 with the progress);
16 peers 7.0 s, 64 peers 15.5 s, 64 peers on skewed shards 33.75 s (not
in 40 s without a correction). A push older than one of the receiver's
steps still undoes the steps between, uncorrected: on the 4-peer bed
below (2 ms steps, 4 ms links) push-sum took 2.0-2.5 s at 1 Gbit/s and
1.75 s at 100 Mbit/s, against 1.0-2.0 s and 1.5 s replaying the undoing
and 7.75-10 s with no correction; on the real link
(``experiments/wan.py``, push-sum, skewed, 6 runs against 3) 1.02-1.80 s
at 1 Gbit/s against 1.03-1.55 s, 1.03-2.31 s at 100 Mbit/s against
1.04-2.05 s.

**Paced by the link's round trip.** Each merge answers the drift of a
round trip ago. On a far link, replayed at a near link's pace, the
correction drove label-skewed peers apart: simulated, 4 peers, digits-small,
3 classes per peer, 10 ms steps, 50 ms each way (a round trip of 10 steps),
seeds 0-4, the farthest peer's distance from the peers' mean model after
8 virtual s was 0.9-5.0 (LAN: 0.01-0.03) and one peer's accuracy fell to
0.69; at seed 1 the swarm collapsed by 20 s (distances of 24-77, accuracy
0.16-0.52). At 100 ms each way it diverged at seeds 0-1 within 8 s. A
gain of 3, or of 2, held them together, as did a longer memory: so the
memory is at least ``MEMORY_ROUND_TRIPS`` round trips of the link
(``memory_for``, from the round trip of small messages and the step time;
near links keep ``MEMORY_STEPS``). At 50 ms: distances 0.29-0.39 after 8 s
and still falling at 22 s, time to 0.9 held (sampled every 0.05 s) 2.45-2.75
s against 2.40-2.65 s before; at 100 ms, together at 22 s (0.05-0.18). The
gain stays one number for the whole swarm, which conservation needs (both
ends of a merge replay it equally); the memory is each peer's own pace, and
a change of it rescales ``c`` so that what is owed stays the same.

**It falls with the rate.** The merges ``c`` remembers were measured at
the rate of their time; a peer whose optimizer is known (given, or found
stepping the model) scales ``c`` down as the optimizer's rate falls
(``follow_rate``): a cut by 10 forgives nine tenths of what was owed. Without
it, on a run of 84 steps whose rate was cut by 10 at 75% and 90% (16
simulated peers, digits-small, Dirichlet label skew, experiments/relaysgd_table.py
--epochs 30), the peers' own models ended 6-14 points below their average
(87.5, 83.2, 75.6% at alpha 1, 0.1, 0.01, against all-reduce's 94.4, 94.2,
93.9%); with it 93.6, 92.3, 91.7%, at their average (without any
correction: 93.3, 91.6, 89.7%). Every peer of a swarm runs the same schedule
at about the same step, so the swarm's sum of what is owed, about zero,
stays about zero.

**Nothing is lost.** Since ``sum_t c_t + (1 - beta) c_T / beta = sum_t m_t``
exactly, what a peer has added plus what it still owes (``owed``) is always
``gain`` times the sum of its merge displacements; with pairwise averaging
those sum to zero over the swarm, so the swarm's sum counting what is owed
is conserved (``tests/test_drift.py`` checks both).

Measured in the simulator (4 peers starting together, digits-small, 3
classes per shard, 2 ms steps; links of 1 Gbit/s and 100 Mbit/s with 4 ms
latency, 1.7 Mbit/s with 0.5 ms; time to a mean test accuracy of 0.93 held
for 3 samples, seeds 0-2), pairwise:

| | 1 Gbit/s | 100 Mbit/s | 1.7 Mbit/s |
| --- | --- | --- | --- |
| quasi-global momentum, no correction (the default before) | 0.83, 0.97, 1.49 s | 1.03, 2.13, 2.13 s | 10.4 s, not in 12 s (0.91, 0.84) |
| local momentum, gain 4 | 0.69, 0.75, 0.59 s | 0.65, 0.85, 0.85 s | 7.9, 7.7, 8.4 s |
| the same, iid shards | 0.21, 0.21, 0.25 s (before: 0.31-0.33) | 0.25-0.27 s (0.35) | 2.0-2.1 s (3.0-3.3) |
| gain 4, quasi-global momentum while the link keeps up (the default) | 0.33, 0.33, 0.37 s | 0.55, 0.55, 0.57 s | 7.1, 9.5, 6.9 s |

Seed 0, 1 Gbit/s, gain 4: push-sum 4.91 -> 1.27 s, neighbor 3.97 -> 0.55 s,
local-sgd not in 6 s -> 0.81 s; at 1.7 Mbit/s push-sum 0.67 -> 0.82 after
12 s, neighbor and local-sgd not in 12 s -> 5.2 s. Gains 6 and 8 (local
momentum) were no faster than 4. With quasi-global momentum, which carries
merges on in the optimizer's buffer as well, the correction is faster
still where the link keeps up (pairwise 0.33-0.37 s at 1 Gbit/s,
0.55-0.57 s at 100 Mbit/s) but made pairwise diverge at 1.7 Mbit/s even at
gain 2 (accuracy 0.32-0.37 after 12 s). So ``gossip.drift_gain = -1``
(auto) is 4 for every algorithm, and pairwise's quasi-global momentum,
where asked for, runs only while its link keeps up (``gossiptrain.protocol.momentum``):
6.9-9.5 s at 1.7 Mbit/s, as with local momentum. It is no longer a default
(issue 46: with it, a user's MLP went to NaN).
"""

from __future__ import annotations

import math
from typing import Callable, Sequence

import torch

from gossiptrain.config import GossipConfig

#: The moving average's memory in safe points (beta = 1 / this): long against the steps between merges.
MEMORY_STEPS = 100
#: ...and at least this many of the link's round trips (counted in local steps): on a far link the merges
#: answer the drift of a round trip ago, and a replay paced for a near one drove peers apart (see the module).
MEMORY_ROUND_TRIPS = 15
#: ``gossip.drift_gain = -1`` (auto): the gain every algorithm gets (see the module docstring).
AUTO_GAIN = 4.0
#: ``c``'s scale is folded into its tensors (one pass) once it falls below this or rises above its inverse.
RESCALE_BELOW = 2.0**-20


def drift_gain(config: GossipConfig, running_stats: bool = False) -> float:
    """The gain this swarm's peers use (0: off); ``running_stats``: the model keeps statistics in buffers (BatchNorm).

    ``auto`` leaves a model with running statistics uncorrected. What such a
    model computes depends on buffers that averaging never touches: each
    peer's stay its own, and on skewed shards they disagree. Replaying the
    parameters' merges then moved the models away from what their own
    statistics expect: in the workload zoo (experiments/zoo.py,
    batchnorm-dir0.1-fast, 4 peers, Dirichlet 0.1) the correction was the
    whole difference between plain averaging's 0.13 / never / 0.20 s to 0.95
    and the defaults' 0.07 / never / never (3 seeds), the only cell where it
    did harm. Every peer of a swarm has the same model, so the gain is still
    one number for the whole swarm.
    """
    if config.drift_gain >= 0:
        return config.drift_gain
    return 0.0 if running_stats else AUTO_GAIN


def keeps_running_stats(model: torch.nn.Module) -> bool:
    """Whether ``model`` normalises with statistics it keeps in buffers (BatchNorm and its kin tracking running stats)."""
    return any(
        isinstance(m, torch.nn.modules.batchnorm._NormBase) and m.track_running_stats for m in model.modules()
    )


def memory_for(round_trip_steps: float | None, least: int = MEMORY_STEPS) -> int:
    """The moving average's memory for a link whose round trip takes ``round_trip_steps`` local steps (None: unknown)."""
    if round_trip_steps is None or not math.isfinite(round_trip_steps):
        return least
    return max(least, math.ceil(MEMORY_ROUND_TRIPS * round_trip_steps))


class DriftCorrection:
    """Call ``before()`` as a safe point starts and ``after()`` once its merges are in the parameters.

    ``stale_merges``: the algorithm merges partners' models against ours as
    it is now (push-sum), so ``after`` is given the share of the model its
    merges replaced and measures their displacement from the model as the
    last safe point left it (see the module docstring).

    ``reported``: the algorithm says what its safe point added
    (``Averaging.reports_moves``: pairwise), and ``after`` is given it as
    ``moved``; ``before`` then copies nothing and ``after`` subtracts
    nothing. At a safe point without merges the correction is then one pass
    over the model (adding ``gain * c``), against five with the copy and the
    subtraction: ``c``'s decay is a number (``c`` is held as ``_c_scale *
    _c``), not a pass. A pairwise safe point without merges, correction
    included, took 0.93-1.12 ms for digits' 1.1M parameters (a local step
    is about 5 ms) and takes 0.40-0.47 ms; for the 4.3M-parameter
    charlm-large 6.3-7.2 ms, now 2.3-3.4 ms (one thread; see the README).

    ``memory_steps`` is the least memory; ``after`` lengthens it on a link
    whose round trip takes many steps (``memory_for``).
    """

    def __init__(
        self, params: Sequence[torch.Tensor], gain: float, memory_steps: int = MEMORY_STEPS, stale_merges: bool = False,
        reported: bool = False,
    ) -> None:
        self.params = list(params)
        if memory_steps < 2:
            raise ValueError(f"memory_steps must be >= 2, got {memory_steps}")
        if reported and stale_merges:
            raise ValueError("stale merges are measured against the last safe point's model: they cannot be reported")
        self.gain = gain
        self.least_memory = memory_steps
        self.memory = memory_steps  # safe points; beta = 1 / memory
        # The model as the safe point began (``before``); None where the safe point reports what it added.
        self._before = None if reported else [torch.empty_like(p) for p in self.params]
        # The smoothed merge displacement per safe point is ``_c_scale * _c``: decaying it, or rescaling it for a
        # new memory, changes the number only (renormalised into the tensors when it leaves [2^-20, 2^20]).
        self._c = [torch.zeros_like(p) for p in self.params]
        self._c_scale = 1.0
        # The model as the last safe point left it: before the local step the merged models did not take.
        self._settled = [torch.empty_like(p) for p in self.params] if stale_merges else None
        self._has_settled = False  # no safe point yet (a downloaded state may still replace the model)
        self.suspended = False  # by the stability guard (gossiptrain.protocol.stability): adds nothing
        # The optimizer's learning rate now (None: no optimizer known): where it falls, what is owed falls with it
        # (``follow_rate``). ``_rate`` is the rate at the last safe point.
        self.rate: Callable[[], float] | None = None
        self._rate: float | None = None

    def suspend(self) -> None:
        """The stability guard backs off: add nothing more, and forget what is owed (it may carry the blow-up)."""
        self.suspended = True
        self._forget()

    def resume(self) -> None:
        """Tried again: from nothing owed."""
        self.suspended = False
        self._forget()

    def _forget(self) -> None:
        with torch.no_grad():
            torch._foreach_zero_(self._c)
        self._c_scale = 1.0
        self._has_settled = False

    def before(self) -> None:
        if self._before is not None and not self.suspended:
            with torch.no_grad():
                torch._foreach_copy_(self._before, [p.detach() for p in self.params])

    @property
    def reported(self) -> bool:
        """Whether ``after`` is told what the safe point added (``moved``) instead of measuring it."""
        return self._before is None

    @property
    def beta(self) -> float:
        return 1.0 / self.memory

    def after(
        self, stale_share: float = 0.0, round_trip_steps: float | None = None,
        moved: tuple[Sequence[torch.Tensor], float] | None = None,
    ) -> None:
        """Add this safe point's correction.

        ``stale_share``: the share of the model its stale merges replaced;
        ``round_trip_steps``: the link's round trip in local steps, lately (None: unknown);
        ``moved``: with ``reported``, ``(terms, scale)``: the safe point added ``scale * terms`` (no terms: nothing).
        """
        before = self._before
        if before is None and moved is None:
            raise ValueError("a reported drift correction needs what the safe point moved")
        if self.suspended:
            return
        self._pace(memory_for(round_trip_steps, self.least_memory))
        if self.rate is not None:
            self.follow_rate(self.rate())
        beta = self.beta
        self._c_scale *= 1 - beta  # c <- (1 - beta) c
        with torch.no_grad():  # in place, in the buffers made once: nothing is allocated per step
            live = [p.detach() for p in self.params]
            settled = self._settled
            if before is None:  # c <- c + beta m, m reported
                assert moved is not None
                terms, scale = moved
                if len(terms):
                    torch._foreach_add_(self._c, list(terms), alpha=beta * scale / self._c_scale)
            else:
                undid = settled is not None and self._has_settled and stale_share > 0
                if undid:  # settled - before: minus the local step just taken
                    torch._foreach_sub_(settled, before)
                torch._foreach_sub_(before, live)  # minus what this safe point's merges moved us by
                if undid:  # ...plus the share of the local step they undid
                    torch._foreach_add_(before, settled, alpha=stale_share)
                torch._foreach_add_(self._c, before, alpha=-beta / self._c_scale)
            torch._foreach_add_(live, self._c, alpha=self.gain * self._c_scale)
            if settled is not None:
                torch._foreach_copy_(settled, live)
                self._has_settled = True
            if not RESCALE_BELOW <= self._c_scale <= 1 / RESCALE_BELOW:
                torch._foreach_mul_(self._c, self._c_scale)
                self._c_scale = 1.0

    def _pace(self, memory: int) -> None:
        """Replay at a new memory: ``c`` rescaled so that what is owed, ``gain (memory - 1) c``, stays the same.

        Only a change of a tenth or more is taken, so that a round trip
        measured a little differently does not rescale at every safe point.
        """
        if abs(memory - self.memory) * 10 < self.memory:
            return
        self._c_scale *= (self.memory - 1) / (memory - 1)
        self.memory = memory

    def follow_rate(self, rate: float) -> None:
        """The optimizer's learning rate is ``rate`` now: where it fell since the last safe point, scale ``c`` (and
        so what is owed) down by as much.

        A peer's drift per step is its rate times its data's bias: after a cut
        the drift still to correct is that much smaller (the module docstring,
        "It falls with the rate", has the measurement). A rate that rises (a
        warmup) is followed from the next cut on, never up: what was measured
        at a small rate is not inflated.
        """
        if not (rate > 0 and math.isfinite(rate)):
            return
        last, self._rate = self._rate, rate
        if last is not None and rate < last:
            self._c_scale *= rate / last

    def owed(self) -> list[torch.Tensor]:
        """What is still to be added of the merges seen so far, if no more came: gain (1 - beta) / beta * c."""
        return [c * (self._c_scale * self.gain * (1 - self.beta) / self.beta) for c in self._c]
