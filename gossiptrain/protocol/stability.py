"""The stability guard: notice a run about to blow up, back the added methods off to plain averaging, retry later.

Every method this runtime adds on top of plain averaging (an outer step,
quasi-global momentum, drift correction, the square-root learning-rate
rule) was measured on the project's own workloads. A user's model and
optimizer may make one of them unstable: an MLP with SGD at lr 0.1 and
momentum 0.9 on label-sorted shards over a 100 Mbit/s link went to NaN
with quasi-global momentum and drift correction (issue 46), where plain
averaging trained. A peer cannot know in advance; it can watch its own
model, without the user's help, and step back before the damage is done.

**What it watches.** At the end of every safe point (the model then holds
the local step, the merges and every method's correction) one pass reads
the norm of the model. Blow-ups are exponential, training is not: a norm
that grew more than ``GROWTH`` times within ``WINDOW`` safe points is the
first sign, and a non-finite norm the last.

**What it does.** At a sign, the next method in ``BACKOFF_ORDER`` that is
still on is suspended (its state dropped: a momentum buffer or an owed
correction that carried the blow-up must not carry it on), the model is
put back to the last state the guard kept (every ``KEEP_EVERY`` safe
points, while nothing grew) and the optimizer restarts (``on_restore``:
its momentum carried the blow-up too), with one log line and a count in
``GuardStats``; while signs go on, one more method every ``GRACE`` safe
points, down to plain averaging. A model that became non-finite anyway
is put back the same way, with every method suspended at once. Growth is
judged from the ``WARMUP``-th safe point on (a fresh model's norm grows
fast), and a sign puts back only a state kept at most ``MAX_ROLLBACK``
safe points before (else only the optimizer restarts). After ``SETTLE`` safe points with no sign, the last method backed
off is tried again; one that trips the guard again waits twice as long
before its next try, so a method that does not suit this run ends up off.

With plain averaging alone and still a sign, there is nothing left to back
off: the guard says so once (partners whose models blew up, or the
optimizer's own rate), and keeps restoring a non-finite model.

**What the swarm does.** A peer's guard is its own, but a blow-up travels
through merges. A model put back replaces the one partners were being
served (``Averaging.model_put_back``: pairwise averaging forgets the
merges and exchanges in flight computed from the old one); while the guard
lets a sign settle (``settling``) the peer neither asks nor serves; and a
server refuses a request whose model norm (the requester's guard's, in the
request) is ``NORM_RATIO`` times from its own. On real processes
(experiments/user_loop.py, quasi-global momentum asked for on a 100 Mbit/s
skewed link) that took restores from hundreds a run to 0-1; the swarm
still did not train there, as quasi-global momentum does harm on that
workload without a blow-up a norm could show.

Sans-IO: it reads and writes tensors only; the caller gives the step.
"""

from __future__ import annotations

import logging
import math
from collections import deque
from dataclasses import asdict, dataclass
from typing import Callable, Protocol, Sequence

import torch

log = logging.getLogger(__name__)

#: Methods in the order they are backed off (the first is the first suspended), by the names the log uses.
OUTER_STEP = "outer step"
QUASI_GLOBAL_MOMENTUM = "quasi-global momentum"
DRIFT_CORRECTION = "drift correction"
LR_SCALING = "learning-rate scaling"
BACKOFF_ORDER: tuple[str, ...] = (OUTER_STEP, QUASI_GLOBAL_MOMENTUM, DRIFT_CORRECTION, LR_SCALING)

#: Safe points over which the model's norm growth is judged.
WINDOW = 16
#: A norm this many times the smallest of the last WINDOW safe points is a sign of a blow-up. At 1.5 one peer of a
#: healthy label-skewed swarm on a 100 Mbit/s link (real processes, experiments/user_loop.py) backed off drift
#: correction once in 5,900 steps; blow-ups grow far faster (35 -> 240 in 25 steps, then 1e13), so 2 costs them a step.
GROWTH = 2.0
#: Safe points at the start during which growth is not judged; non-finite always is. A fresh model's norm may grow
#: several times over in a few steps (digits-small at SGD 0.2/0.9: 2-10x in 8 safe points around step 40), which is
#: training, not a blow-up: judged from step 8, every run of it rolled back to its first step and stalled at 0.2.
WARMUP = 200
#: The guard keeps a copy of the model this often, while no sign was seen (what a non-finite model is restored to).
KEEP_EVERY = 25
#: The model is kept only while its norm is within this of the window's smallest...
CALM = 1.1
#: ...and at most this many times the norm of the state kept before. A model that collapsed is calm too (its norm
#: huge and steady): kept, it was what every restore went back to, and a real swarm restored 500-1,600 times, at
#: chance accuracy, until its budget ran out.
KEEP_GROWTH = 2.0
#: A sign puts the model back only to a state kept at most this many safe points before (older: the optimizer restarts only).
MAX_ROLLBACK = 4 * KEEP_EVERY
#: Safe points after a sign before the next growth is judged: the swarm needs a while to settle after a back-off (its
#: partners' models still carry the blow-up); a sign every WINDOW took a label-skewed swarm down to plain averaging.
GRACE = 4 * WINDOW
#: Safe points without a sign before the last method backed off is tried again (doubled at each relapse).
SETTLE = 500
#: Two models whose norms are this far apart are not averaged (the server refuses): one of them blew up. A model
#: that blew up and then stayed huge is steady, so its own guard sees no growth; its partners' restored models went
#: non-finite again, hundreds of times, by averaging with it (real processes, experiments/user_loop.py). Healthy
#: peers of one swarm were never near this (past the warmup, when norms are compared at all).
NORM_RATIO = 100.0


class Switch(Protocol):
    """A method the guard can turn off and on again."""

    def suspend(self) -> None:
        """Stop acting on the model, and drop what state could carry a blow-up on."""

    def resume(self) -> None:
        """Act again, starting afresh."""


@dataclass
class GuardStats:
    """What the guard did, for ``Peer.stats()``, metrics and ``gossiptrain status``."""

    backoffs: int = 0  # methods suspended at a sign of a blow-up (a restore's suspensions included)
    restores: int = 0  # times the model was non-finite and put back to the last state kept
    retries: int = 0  # methods tried again after the run settled
    backed_off: int = 0  # methods suspended now
    signs: int = 0  # signs seen (growth or non-finite), including those with nothing left to back off

    def to_dict(self) -> dict[str, int]:
        return {f"guard_{k}": v for k, v in asdict(self).items()}


class StabilityGuard:
    """Call once at the end of each safe point with the step; see the module docstring."""

    def __init__(
        self,
        params: Sequence[torch.Tensor],
        *,
        window: int = WINDOW,
        growth: float = GROWTH,
        warmup: int = WARMUP,
        settle: int = SETTLE,
        keep_every: int = KEEP_EVERY,
        max_rollback: int | None = None,
        grace: int | None = None,
    ) -> None:
        if window < 2 or growth <= 1 or settle < 1 or keep_every < 1:
            raise ValueError(f"guard: window {window} >= 2, growth {growth} > 1, settle {settle} >= 1, keep_every {keep_every} >= 1")
        self.params = list(params)
        self.window, self.growth, self.warmup, self.settle, self.keep_every = window, growth, warmup, settle, keep_every
        self.max_rollback = 4 * keep_every if max_rollback is None else max_rollback
        self.grace = 4 * window if grace is None else grace
        self.stats = GuardStats()
        self._switches: dict[str, list[Switch]] = {}  # method -> its switches (several optimizers: several)
        self._off: list[str] = []  # methods suspended, in the order they were
        self._relapses: dict[str, int] = {}  # method -> times it tripped the guard after a retry
        self._restore_hooks: list[Callable[[], None]] = []
        self._norms: deque[float] = deque(maxlen=window + 1)
        self._calls = 0
        self._quiet = 0  # safe points since the last sign (or the start)
        self._kept: list[torch.Tensor] | None = None  # the last state kept (finite, no sign in sight)
        self._kept_step: int | None = None
        self._kept_norm = math.inf  # the norm of the state kept (the first is kept whatever it is)
        self._said_nothing_left = False

    # -- wiring ------------------------------------------------------------------------------

    def add(self, method: str, switch: Switch) -> None:
        """Put ``switch`` under the guard as ``method`` (one of ``BACKOFF_ORDER``); suspended at once if that method is off."""
        if method not in BACKOFF_ORDER:
            raise ValueError(f"unknown method {method!r}; known: {', '.join(BACKOFF_ORDER)}")
        self._switches.setdefault(method, []).append(switch)
        if method in self._off:  # added late (an optimizer found at its first step) while backed off
            switch.suspend()

    def on_restore(self, hook: Callable[[], None]) -> None:
        """Call ``hook`` after the model was restored (the optimizer drops its non-finite state)."""
        self._restore_hooks.append(hook)

    @property
    def backed_off(self) -> tuple[str, ...]:
        """The methods suspended now, in the order they were."""
        return tuple(self._off)

    def is_on(self, method: str) -> bool:
        return method not in self._off

    @property
    def norm(self) -> float | None:
        """The model's norm at the last safe point, once past the warmup and finite (None before: a fresh
        model's norm says nothing yet); partners compare it with theirs (``PairwiseAveraging._serve``)."""
        if self._calls <= self.warmup or not self._norms:
            return None
        return self._norms[-1]

    @property
    def settling(self) -> bool:
        """A sign was seen within the last ``grace`` safe points: the peer keeps out of averaging meanwhile
        (``PairwiseAveraging.model_put_back``), so that a blow-up is neither handed on nor taken back."""
        return self.stats.signs > 0 and self._quiet < self.grace

    # -- the safe point ----------------------------------------------------------------------

    def __call__(self, step: int) -> bool:
        """Judge the model after safe point ``step``: whether it was put back (the caller's averaging must then forget
        what it computed from the model it replaced: ``Averaging.model_put_back``)."""
        return self.judge(step, math.sqrt(self.squared_norm()))

    def squared_norm(self) -> float:
        """The squared norm of ``params`` (one pass, one sync). A model split across ranks sums its pieces' (every
        rank the same sum) and gives ``judge`` its root, so that every rank's guard decides alike."""
        with torch.no_grad():
            norms = torch._foreach_norm([p.detach() for p in self.params], 2) if self.params else []
            return float(torch.stack(norms).double().square().sum()) if norms else 0.0

    def judge(self, step: int, norm: float) -> bool:
        """``__call__`` with the model's norm given (a split model's, from every rank's piece): whether ``params``
        were put back. Decisions depend on the norms and steps only, so guards given the same ones agree."""
        self._calls += 1
        if not math.isfinite(norm):
            return self._restore(step)
        self._norms.append(norm)
        smallest = min(self._norms)
        graced = self.stats.signs == 0 or self._quiet >= self.grace
        judged = self._calls > self.warmup and graced and len(self._norms) > self.window // 2
        if judged and norm > self.growth * smallest > 0:
            return self._sign(step, f"the model's norm grew {norm / smallest:.2f}x in {len(self._norms) - 1} safe points")
        self._quiet += 1
        # Kept only where nothing grows: a quiet window, and a norm near the window's smallest (not a blow-up's start).
        # (past the state kept by far, but quiet for as long as a retry waits: a model that grew the slow way)
        near = norm <= KEEP_GROWTH * self._kept_norm or self._quiet >= self.settle
        calm = self._quiet >= self.window and norm <= CALM * smallest and near
        if self._kept_step is None or (self._calls % self.keep_every == 0 and calm):
            self._keep(step, norm)
        if self._off and self._quiet >= self._patience(self._off[-1]):
            self._retry(step)
        return False

    def _sign(self, step: int, why: str) -> bool:
        self.stats.signs += 1
        self._quiet = 0
        self._norms.clear()  # judge the next WINDOW safe points afresh: one more method at most per window
        method = self._next_on()
        if method is None:
            if not self._said_nothing_left:
                self._said_nothing_left = True
                log.warning("stability: %s at step %d, with every added method already off: the model still grows "
                            "(partners that blew up, or the optimizer's own rate: is it too high?)", why, step)
            return False
        if self.stats.retries and method in self._relapses:
            self._relapses[method] += 1
        self._suspend(method)
        back = self._put_back(step, self.max_rollback)
        log.warning("stability: %s at step %d: backing off %s (off now: %s)%s", why, step, method, ", ".join(self._off),
                    f"; back to the state of step {self._kept_step}" if back else "")
        return back

    def _restore(self, step: int) -> bool:
        self.stats.signs += 1
        self._quiet = 0
        self._norms.clear()
        for method in BACKOFF_ORDER:
            if method in self._switches and method not in self._off:
                self._suspend(method)
        back = self._put_back(step)
        self.stats.restores += 1
        if self.stats.restores & (self.stats.restores - 1) == 0:  # 1st, 2nd, 4th, ...: never a line per step
            where = f"restored the state of step {self._kept_step}" if back else "no finite state kept to restore"
            log.error("stability: the model became non-finite at step %d (%d times so far): %s; off now: %s",
                      step, self.stats.restores, where, ", ".join(self._off) or "nothing (plain averaging already)")
        return back

    def _put_back(self, step: int, within: int | None = None) -> bool:
        """The model back to the last state kept (if kept at most ``within`` steps ago), and the optimizers' state
        forgotten (``on_restore``): whether the model was put back.

        A blow-up under way lives in the model and in the optimizer's momentum
        as much as in the method that started it: turning the method off alone
        left a label-skewed swarm 5x farther apart than one that never blew up.
        A state kept long ago would cost more progress than the blow-up did.
        """
        kept = self._kept
        if kept is not None and within is not None and self._kept_step is not None and step - self._kept_step > within:
            kept = None
        if kept is not None:
            with torch.no_grad():
                torch._foreach_copy_([p.detach() for p in self.params], kept)
        for hook in self._restore_hooks:
            hook()
        return kept is not None

    def _patience(self, method: str) -> int:
        """Quiet safe points before ``method`` is tried again: ``settle``, doubled for each relapse (at most 64x)."""
        return self.settle * 2 ** min(6, self._relapses.get(method, 0))

    def _retry(self, step: int) -> None:
        waited = self._quiet
        method = self._off.pop()
        for switch in self._switches.get(method, []):
            switch.resume()
        self._relapses.setdefault(method, 0)
        self._quiet = self.grace  # judged at once: a method that blows up again is caught as soon as it does
        self.stats.retries += 1
        self.stats.backed_off = len(self._off)
        log.info("stability: no sign for %d safe points at step %d: trying %s again", waited, step, method)

    def _suspend(self, method: str) -> None:
        for switch in self._switches.get(method, []):
            switch.suspend()
        self._off.append(method)
        self.stats.backoffs += 1
        self.stats.backed_off = len(self._off)

    def _next_on(self) -> str | None:
        """The first method of ``BACKOFF_ORDER`` that this peer runs and that is still on."""
        return next((m for m in BACKOFF_ORDER if m in self._switches and m not in self._off), None)

    def _keep(self, step: int, norm: float) -> None:
        with torch.no_grad():
            live = [p.detach() for p in self.params]
            if self._kept is None:
                self._kept = [p.clone() for p in live]
            else:
                torch._foreach_copy_(self._kept, live)
        self._kept_step = step
        self._kept_norm = max(norm, 1e-12)


def forget_state(optimizer: torch.optim.Optimizer) -> int:
    """Forget the optimizer's per-parameter state (momentum, Adam's moments); returns for how many parameters.

    After the model was put back, a momentum buffer or an Adam moment that
    carried the blow-up (or went to NaN) would carry it on at the next step.
    Forgotten state starts afresh at the next ``step()``, as for a new
    parameter: a restart of the optimizer, the rates and groups untouched.
    """
    count = len(optimizer.state)
    optimizer.state.clear()
    return count
