"""``gossip.compression = "auto"``: send none, fp16 or int8, whichever the measured link calls for.

A user does not know, and should not have to, whether the link is fast
enough for full-precision models. What decides it is how long an exchange
takes against how many local steps flow control lets a peer run meanwhile
(``Averaging.flow_bound``): past the bound the training loop waits for the
link. So the policy measures both and compares:

- the step time: seconds between safe points, less the seconds flow control
  waited (smoothed);
- the exchange time: from sending one of our messages to its answer (a
  pairwise reply, a push's receipt), smoothed, so that a link that changes is
  followed within a few exchanges. The shortest ever seen stands for what
  does not shrink with fewer bytes (latency, the partner's reaction); the
  rest scales with the bytes of a level.

If an exchange at the current level would take longer than ``bound`` steps,
it moves to the first level that fits (or the last, int8); if the next more
faithful level would take under 3/4 of the bound, after a few exchanges at
this one, it moves back up a level. It starts at fp16 (``START_LEVEL``):
on a fast link, none after a few exchanges; on a 100 Mbit link shared by
peers with 1 MB models, int8 within a few exchanges. Measured on the zoo's
``layernorm-adamw-iid-100mbit`` (experiments/zoo.py, virtual seconds to the
target, seeds 0-4): starting at fp16 0.12, 0.12, 0.19, 0.20, 0.18, at none
0.21, 0.20, 0.12, 0.17, 0.15, plain averaging 0.12, 0.15, 0.12, 0.11, 0.10.
Each message is encoded at one level and receivers read the level
off the wire (``compression.AutoCodec``), so both ends of an exchange still
agree exactly on what was sent: pairwise and push-sum conserve the swarm's
sum at every level, as with a fixed lossy codec. A pairwise reply is at least
as lossy as its request (``PairwiseAveraging._encode_reply``): a peer that
moved to int8 gets int8 both ways, so its trial measures its level, not its
partners'.

Slow exchanges need not be the link's fault: 4 peers on 2 cores answer each
other late because they wait for the CPU, and the bytes are not what takes
the time. So every move to a lossier level is a trial: after a few
exchanges there, if they are not at least ``TRIAL_SAVING`` shorter than
before (and not so much longer that the link itself must have slowed), the
policy goes back and tries no lossier level for ``BLOCK_EXCHANGES``
exchanges, twice as many after each failed trial. Measured on this machine
(experiments/wan.py, 1 Gbit/s, label-skewed digits-small, 3 seeds): auto
without the trial sent int8 there, with round trips of 15-19 ms against
8-11 ms at none, and the swarm took 1.85-4.38 s to the target against
1.02-2.31 s at none; over 100 Mbit/s int8 is right (43 ms round trips at
none, 2.10-3.38 s to the target against 3.98-7.40 s).
"""

from __future__ import annotations

import logging
import statistics
from collections import deque
from typing import Sequence

import torch

from gossiptrain.protocol.compression import AUTO_LEVELS, AutoCodec
from gossiptrain.protocol.step_timer import StepTimer

log = logging.getLogger(__name__)

#: Exchanges measured at a level before moving to a more faithful one (no flapping on one fast exchange).
SETTLE_EXCHANGES = 4
#: Weight of a new measurement in the smoothed exchange time.
LINK_SMOOTHING = 0.25
#: Move to a more faithful level only if its exchanges would take under this share of the bound (hysteresis).
UP_SHARE = 0.75
#: A lossier level is kept only if its exchanges take at most (1 - this) of the time measured before the move...
TRIAL_SAVING = 0.2
#: ...or over this many times that: then the link itself slowed down meanwhile, and the lossier level stays.
LINK_CHANGED = 3.0
#: Exchanges after a failed trial before a lossier level is tried again; doubles after each failure, up to MAX_BLOCK.
BLOCK_EXCHANGES = 32
MAX_BLOCK = 1024
#: The level before anything is measured: fp16 halves the first exchanges' bytes at far less error than int8 (on a
#: 100 Mbit/s link a swarm that is done in a few dozen steps spent them waiting for full-precision models), and the
#: policy leaves it once measured as it leaves any level. Not a trial: nothing was measured to compare it with.
START_LEVEL = 1


class AutoCompression:
    """Chooses ``codec.level`` from measured step time and link speed."""

    def __init__(self, codec: AutoCodec, params: Sequence[torch.Tensor], steps: StepTimer | None = None) -> None:
        self.codec = codec
        codec.level = START_LEVEL
        self.steps = steps or StepTimer()  # the step time (the averaging machine's own, shared)
        # Bytes of one model at each level: (levels,)
        self.level_bytes = [sum(p.numel() * codec.element_bytes(lv, p.dtype) for p in params)
                            for lv in range(len(AUTO_LEVELS))]
        self.exchange_time: float | None = None  # seconds from our message to its answer at the current level, smoothed
        self.floor: float | None = None  # the shortest exchange seen: what fewer bytes do not shorten
        self.switches = 0
        self._at_level = 0  # exchanges measured since the last switch
        self._trial: tuple[int, float] | None = None  # (level we left for a lossier one, its exchange time then)
        self._recent: deque[float] = deque(maxlen=8)  # exchange times measured at this level, latest last
        self._blocked = 0  # exchanges left before a lossier level may be tried again
        self._block_len = BLOCK_EXCHANGES

    @property
    def step_time(self) -> float | None:
        """Seconds of one local step (waits excluded), smoothed."""
        return self.steps.step_time

    def at_step(self, step: int, now: float, waited_s: float) -> None:
        """A safe point after local step ``step`` (for a policy not fed by an averaging machine's timer)."""
        self.steps.at_step(step, now, waited_s)

    def exchanged(self, seconds: float, nbytes: int, bound: int) -> None:
        """One of our messages of ``nbytes`` got its answer ``seconds`` after we sent it; ``bound``: flow control's."""
        if nbytes <= 0 or seconds < 0:
            return
        floor = self.floor = seconds if self.floor is None else min(self.floor, seconds)
        # As if sent at the current level (it may have left before the last switch)
        here = floor + (seconds - floor) * self.level_bytes[self.codec.level] / nbytes
        t = self.exchange_time
        self.exchange_time = here if t is None else t + LINK_SMOOTHING * (here - t)
        self._recent.append(here)
        self._at_level += 1
        self._blocked = max(0, self._blocked - 1)
        if self._trial is not None and self._at_level >= SETTLE_EXCHANGES:
            self._judge(self._trial)
            return
        self._choose(bound)

    def _judge(self, trial: tuple[int, float]) -> None:
        """The verdict on a lossier level: keep it if its exchanges are shorter, else go back and wait a while."""
        left, before = trial
        self._trial = None
        now = statistics.median(self._recent)  # what this level took, unsmoothed (the smoothed time began as a guess)
        if now <= (1 - TRIAL_SAVING) * before or now >= LINK_CHANGED * before:
            self._block_len = BLOCK_EXCHANGES
            return
        log.info("compression %s -> %s: exchanges took %.3f s at %s against %.3f s at %s: fewer bytes do not make "
                 "them shorter (the link is not what slows them); no lossier level for %d exchanges",
                 AUTO_LEVELS[self.codec.level], AUTO_LEVELS[left], now, AUTO_LEVELS[self.codec.level], before,
                 AUTO_LEVELS[left], self._block_len)
        self._switch(left, before)
        self._blocked, self._block_len = self._block_len, min(2 * self._block_len, MAX_BLOCK)

    def predicted(self, level: int) -> float:
        """Seconds an exchange would take at ``level`` on the link as measured."""
        if self.exchange_time is None or self.floor is None:
            return 0.0
        now = self.level_bytes[self.codec.level]
        return self.floor + (self.exchange_time - self.floor) * self.level_bytes[level] / now

    def _choose(self, bound: int) -> None:
        if not self.step_time or self.exchange_time is None:
            return  # no time passes between steps (a machine driven by hand): nothing to compare
        budget = bound * self.step_time
        level = self.codec.level
        new = level
        if self.predicted(level) > budget and not self._blocked:
            new = next((lv for lv in range(level + 1, len(AUTO_LEVELS)) if self.predicted(lv) <= budget),
                       len(AUTO_LEVELS) - 1)
        elif level > 0 and self._at_level >= SETTLE_EXCHANGES and self.predicted(level - 1) < UP_SHARE * budget:
            new = level - 1
        if new != level:
            log.info("compression %s -> %s: an exchange takes %.3f s at %s, flow control allows %d steps of %.1f ms",
                     AUTO_LEVELS[level], AUTO_LEVELS[new], self.predicted(level), AUTO_LEVELS[level], bound,
                     1000 * self.step_time)
            if new > level and self._trial is None:  # lossier: a trial, judged after a few exchanges there
                self._trial = (level, statistics.median(self._recent))  # what this level took lately, unsmoothed
            self._switch(new, self.predicted(new))  # the prior at the new level, until it is measured there

    def _switch(self, level: int, exchange_time: float) -> None:
        self.exchange_time = exchange_time
        self.codec.level = level
        self.switches += 1
        self._at_level = 0
        self._recent.clear()
