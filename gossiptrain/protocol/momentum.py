"""Quasi-global momentum (Lin et al., ICML 2021): SGD momentum that follows the swarm, not the peer's own shard.

With label-skewed shards a peer's local momentum buffer accumulates the
gradient of its own classes and keeps pushing its model there between
merges; averaging pulls the models together, momentum pulls them apart
again. Quasi-global momentum (QG-DSGDm) replaces the buffer after every safe
point by a running average of the model's actual change per step, local step
and merges together:

    d = (x_before_step - x_after_safe_point) / lr
    m <- mu m + (1 - mu) d

and the next SGD step uses ``m`` as its momentum buffer (torch's SGD then
steps by ``g + momentum * m``, the paper's update). The change includes what
averaging moved, so the buffer points where the swarm is going.

Works on ``torch.optim.SGD`` groups with momentum > 0 (others are left as
they are); ``mu`` is each group's own momentum. Costs two copies of the
model and a few element-wise operations per step.

**Not a default.** ``gossip.momentum_mode = "auto"`` (the default) runs
the optimizer's own momentum for every algorithm; ``quasi-global`` asks for
it. It was the default with pairwise, measured on the project's own
workload (below), until a user's model showed it unsafe (issue 46): an MLP
64-512-512-10 with SGD at lr 0.1 and momentum 0.9, 4 peers, went to NaN on
label-sorted shards over a shared 100 Mbit/s link (real processes, 2 runs
of 2; simulated, seed 1 of 0-1), and stalled at 0.958-0.961 test accuracy
on iid shards on loopback where the target was 0.97. Its buffer carries
every merge on for about ``1 / (1 - mu)`` steps, drift correction's replay
included, so a merge with a partner that drifted far is amplified tenfold
at mu = 0.9. A default must never do worse than plain averaging; this one
helps where it was tuned and breaks elsewhere. The stability guard
(``gossiptrain.protocol.stability``) backs it off first where it is asked
for and a blow-up starts.

What it did on the project's own workload: simulated, 4 peers, digits-small,
3 classes per shard, 2 ms steps, compression auto, seeds 0 and 1, time to a
mean test accuracy of 0.95: on 100 Mbit/s links pairwise 4.0 s -> 1.25 s (the first
sample), push-sum never in 6 s -> 5.0-5.25 s, neighbour and local SGD never
-> 1.25-1.5 s; on 1.7 Mbit/s links pairwise never in 20 s -> 10.3-18.5 s,
push-sum about even, but neighbour and local SGD fell from 0.81-0.87 to
0.48-0.58 after 20 s. And in a real run (experiments/wan.py, 100 Mbit/s,
seed 1) push-sum with it diverged to non-finite values: its model
``z = x / w`` jumps whenever a push arrives or leaves, and the buffer
carries each jump on.

With drift correction (``gossiptrain.protocol.drift``, on by default) the
two together are the fastest on links that keep up with the computation
(experiments/wan.py, pairwise, label-skewed digits-small, 3 seeds: 1 Gbit/s
0.51-0.53 s against 0.52-1.31 s with local momentum; 100 Mbit/s 0.53-1.85 s
against 1.04-1.32 s), but made pairwise diverge in the simulator on a
1.7 Mbit/s link, where flow control waits most of the time. So where it is
asked for (``quasi-global``), pairwise runs it only while its link keeps
up: while its safe points waited less than ``LINK_BOUND_SHARE`` of the time
lately (``SafePoint.wait_share``); past that the optimizer's own momentum runs.

**A warm start.** The buffer's average of changes builds up slowly: with
a constant gradient g it grows as m <- mu (2 - mu) m + (1 - mu) g, over
about 1 / (1 - mu)^2 = 100 steps at mu = 0.9, where the optimizer's own
momentum takes 1 / (1 - mu) = 10. Where training is short against that
(the first hundred steps matter), every pairwise swarm ran at about half
speed, one peer alone included: simulated (digits-small, 50 ms steps,
1 Gbit/s, iid, target 0.93 held 3 samples, seed 0) 1 peer 6.75 s against
4.5 s with local momentum; 4 peers 6.75 s against 3.75 s; 64 peers 6.75 s,
where DDP over 64 workers takes 3.75-10.25 s. So for its first
``WARMUP_SAFE_POINTS`` safe points the optimizer's own momentum runs, and
the average then starts from its buffer (``_follow``). How long is a
trade: 50 gave 4 peers 3.5 s (DDP over 4 workers: 3.5 s) but slowed a
real label-skewed run (experiments/wan.py, 100 Mbit/s, seeds 0-2: 0.52,
1.57, 1.31 s against 0.52-0.53 s), 35 gave 4.0 s and 0.53, 0.54, 1.06 s;
20, the default, gives 4 peers 5.5 s and one peer 5.25 s, the real
skewed run 0.53, 0.53, 0.53 s, the simulated skewed bed (2 ms steps; 100 Mbit/s
and 1 Gbit/s, 4 ms links, seeds 0-1, target 0.93) 0.30-0.35 s against
0.35-0.45 s, and 1.7 Mbit/s 1.15 s as before. A shorter memory of the
average instead (keeping half the past each step) never reached the
target on skewed shards, and none at all diverged.

**Clipped changes.** Over a shared 100 Mbit/s link (experiments/wan.py,
skewed digits-small) about one seed in three took 1-3.3 s to the target
instead of 0.52 s: one peer's accuracy fell by 0.2-0.8 for an evaluation
and the hold restarted. With the optimizer's own momentum there was no such
dip (but 0.78 s typically), so the buffer carried something: a safe point
whose change was far larger than usual. Each change now enters the buffer
at most ``CHANGE_CLIP`` times the median norm of the last ``CHANGE_HISTORY``
(clipped ones counted as clipped): seed 0, the most often slow, took 0.51-
0.53 s in 5 of 6 runs and 1.04 s once (before: 0.51-3.34 s, slow in 6 of 10),
and all 5 seeds twice over 0.52-0.78 s (medians 0.525 and 0.529).
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from typing import Callable, Iterator

import torch

from gossiptrain.config import GossipConfig

#: The algorithms ``momentum_mode = "auto"`` gives quasi-global momentum: none (see "Not a default" above).
AUTO_QUASI_GLOBAL: tuple[str, ...] = ()
#: Past this share of time spent waiting for the link (flow control), ``auto`` runs the optimizer's own momentum.
LINK_BOUND_SHARE = 0.5
#: A safe point's change enters the buffer at most this many times the median norm of recent ones (see _clip_scale).
CHANGE_CLIP = 3.0
#: Changes remembered for that median, and how many before it applies.
CHANGE_HISTORY = 64
CHANGE_WARMUP = 8
#: Safe points at the start during which the optimizer's own momentum runs; the buffer then starts from it.
WARMUP_SAFE_POINTS = 20


def wants_quasi_global(config: GossipConfig) -> bool:
    """Whether this swarm's SGD momentum is quasi-global."""
    if config.momentum_mode == "auto":
        return config.algorithm in AUTO_QUASI_GLOBAL
    return config.momentum_mode == "quasi-global"


class QuasiGlobalMomentum:
    """Call after each safe point (the model then holds this step's merges).

    A model split across ranks runs it in halves (``gossiptrain.runtime.piece_methods``): every rank ``tick``s
    with the group's word on whether it runs, ``measure``s its piece's change, and ``apply``s with the whole
    model's norm of the change (the sum of every rank's squares), so that the clip is the whole model's.
    ``local`` maps a parameter (or its buffer) to the tensor the arithmetic runs on: an FSDP2 shard's local
    tensor (None: the tensors themselves)."""

    def __init__(self, optimizer: torch.optim.Optimizer, active: Callable[[], bool] | None = None,
                 local: Callable[[torch.Tensor], torch.Tensor] | None = None) -> None:
        self.optimizer = optimizer
        self.active = active  # asked at every safe point (None: always); while False the optimizer's own momentum runs
        self.local = local
        self.enabled = isinstance(optimizer, torch.optim.SGD) and any(g.get("momentum", 0) > 0 for g in optimizer.param_groups)
        self._prev: dict[torch.Tensor, torch.Tensor] = {}  # the parameters after the last safe point
        self._m: dict[torch.Tensor, torch.Tensor] = {}  # the quasi-global momentum
        self._norms: deque[float] = deque(maxlen=CHANGE_HISTORY)  # recent step changes' norms (clipped ones as clipped)
        self.clipped = 0
        self.safe_points = 0  # seen so far (the first WARMUP_SAFE_POINTS run the optimizer's own momentum)
        self.suspended = False  # by the stability guard (gossiptrain.protocol.stability): the optimizer's own runs
        self._groups: list[tuple[list[torch.Tensor], list[torch.Tensor], float, float]] = []  # measured, to apply

    def __call__(self) -> None:
        if self.tick():
            self.apply(math.sqrt(self.measure()))

    def would_run(self) -> bool:
        """Whether the next safe point would run it, as far as this optimizer knows (the link's word apart)."""
        return self.enabled and not self.suspended and self.safe_points + 1 > WARMUP_SAFE_POINTS

    def tick(self, active: bool | None = None) -> bool:
        """Count this safe point; whether quasi-global momentum runs at it (``active``: the caller's word on the link,
        None: ask ``self.active``). Where it does not, our state follows the optimizer's own momentum."""
        if not self.enabled:
            return False
        self.safe_points += 1
        keeps_up = active if active is not None else (self.active is None or self.active())
        if self.suspended or self.safe_points <= WARMUP_SAFE_POINTS or not keeps_up:
            self._follow()
            return False
        return True

    def measure(self) -> float:
        """After ``tick`` said it runs: the change since the last safe point into the references' buffers; the squared
        norm of the change per unit of lr (what the clip judges: summed over the ranks of a split model)."""
        with torch.no_grad():
            # Per optimizer group, one foreach call per operation: a model of a few hundred tensors paid a few
            # Python-level torch calls per tensor here at every safe point (2.4 ms for 150 small tensors).
            self._groups = [group for group in self._tracked() if group[0]]  # (params, prevs, lr, mu) with a reference
            squares = 0.0  # of the changes per unit of lr
            for params, prevs, lr, _ in self._groups:
                torch._foreach_sub_(prevs, self._locals(params))  # the change (prev - p), in its reference's; / lr below
                # In the tensors' own dtype, and scaled by 1 / lr as a number: a float64 norm cost 10x a float32
                # one (1.27 against 0.13 ms for digits' 1.1M parameters, half of this call), and dividing the
                # tensors by lr first was a pass of its own.
                norms = torch._foreach_norm(prevs, 2)
                squares += float(torch.stack(norms).double().square().sum()) / lr**2
            for p in self._params():  # the first safe point, or a replaced parameter: a reference, a change next time
                prev = self._prev.get(p)
                if prev is None or prev.shape != self._of(p).shape:
                    self._prev[p] = self._of(p).detach().clone()
        return squares

    def apply(self, norm: float) -> None:
        """The buffers from the change ``measure`` took, clipped by ``norm`` (the whole model's norm of it)."""
        groups, self._groups = self._groups, []
        with torch.no_grad():
            scale = self._clip_scale(norm)
            for params, prevs, lr, mu in groups:
                for p, mine in zip(params, self._locals(params), strict=True):
                    if p not in self._m:
                        self._m[p] = torch.zeros_like(mine)
                ms = [self._m[p] for p in params]
                torch._foreach_mul_(ms, mu)
                torch._foreach_add_(ms, prevs, alpha=(1 - mu) * scale / lr)  # m <- mu m + (1 - mu) (clipped change / lr)
                buffers, kept = [], []
                for p, m in zip(params, ms, strict=True):
                    state = self.optimizer.state[p]
                    buf = state.get("momentum_buffer")
                    if buf is None:
                        if self.local is None:  # (a shard's buffer is the optimizer's to make: it has, by the warmup's end)
                            state["momentum_buffer"] = m.clone()
                    else:
                        buffers.append(self._of(buf))
                        kept.append(m)
                if buffers:
                    torch._foreach_copy_(buffers, kept)
                torch._foreach_copy_(prevs, self._locals(params))  # the reference for the next safe point

    def _of(self, t: torch.Tensor) -> torch.Tensor:
        """The tensor the arithmetic runs on: ``t`` itself, or its local shard."""
        return t if self.local is None else self.local(t)

    def _locals(self, params: list[torch.Tensor]) -> list[torch.Tensor]:
        return params if self.local is None else [self.local(p) for p in params]

    def suspend(self) -> None:
        """The stability guard saw a blow-up coming: the optimizer's own momentum from here, restarted.

        The buffer holds the recent changes, and with them whatever is blowing
        up: the optimizer starts a fresh one from its next gradient.
        """
        self.suspended = True
        for p in self._params():
            self.optimizer.state[p].pop("momentum_buffer", None)
        self._m.clear()

    def resume(self) -> None:
        """Tried again after the run settled: from a warm start, as at the beginning."""
        self.suspended = False
        self.safe_points = 0

    def mid_run(self) -> None:
        """The model was replaced by a running swarm's state (a newcomer's download): no warm start.

        The warm start is for a model at its first steps. A newcomer that
        downloaded a trained model and ran the optimizer's own momentum from
        a fresh buffer lost 0.1-0.35 test accuracy over its first 10-16 steps
        in about one join in three (tests/test_state_transfer.py, the
        1.1M-parameter digits MLP, 3 peers), then recovered; with the average
        of changes from its first safe point, as the swarm it joined runs, it
        did not.
        """
        self.safe_points = max(self.safe_points, WARMUP_SAFE_POINTS)

    def _params(self) -> Iterator[torch.Tensor]:
        """The parameters of groups with momentum (and a rate): the ones this buffer is for."""
        for group in self.optimizer.param_groups:
            if float(group.get("momentum", 0.0)) > 0 and float(group["lr"]) > 0:
                yield from group["params"]

    def _tracked(self) -> Iterator[tuple[list[torch.Tensor], list[torch.Tensor], float, float]]:
        """Per optimizer group with momentum: (parameters with a reference, their values after the last safe point, lr, momentum)."""
        for group in self.optimizer.param_groups:
            lr, mu = float(group["lr"]), float(group.get("momentum", 0.0))
            if mu <= 0 or lr <= 0:
                continue
            params, prevs = [], []
            for p in group["params"]:
                prev = self._prev.get(p)
                if prev is not None and prev.shape == self._of(p).shape:
                    params.append(p)
                    prevs.append(prev)
            yield params, prevs, lr, mu

    def _clip_scale(self, norm: float) -> float:
        """How much of this step's change (of ``norm``) enters the buffer: at most ``CHANGE_CLIP`` times the recent median.

        A change is the local step plus the merges of a safe point; one far
        larger than usual (a merge with a partner that drifted, several merges
        applied at once after a pause) would otherwise sit in the buffer and
        push the model on for tens of steps.
        """
        if norm == 0.0:
            return 1.0
        limit = CHANGE_CLIP * statistics.median(self._norms) if len(self._norms) >= CHANGE_WARMUP else math.inf
        self._norms.append(min(norm, limit))  # as entered: one outlier cannot raise the limit for the next
        if norm <= limit:
            return 1.0
        self.clipped += 1
        return limit / norm

    def _follow(self) -> None:
        """Inactive (or warming up): the optimizer's own momentum runs; our state follows it, so that the
        average starts from its buffer and the next change is measured from here."""
        with torch.no_grad():
            for p in self._params():
                mine = self._of(p)
                prev = self._prev.get(p)
                if prev is None or prev.shape != mine.shape:
                    self._prev[p] = mine.detach().clone()
                else:
                    prev.copy_(mine)
                buf = self.optimizer.state[p].get("momentum_buffer")
                if buf is not None:
                    buf = self._of(buf)
                    m = self._m.get(p)
                    if m is None or m.shape != buf.shape:
                        self._m[p] = buf.detach().clone()
                    else:
                        m.copy_(buf)
