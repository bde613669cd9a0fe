"""How long a simulated step takes: one model for gossip peers and synchronous workers alike.

A worker's step takes ``step_time * speed * contention * factor`` virtual
seconds: ``speed`` is its slowdown (a straggler's 4), ``contention`` how
much sharing the machine's cores slows everyone (``SimConfig.contention``),
and ``factor`` a draw with mean 1 for the step-to-step noise of a real
machine. Both systems draw from this one place, so that a comparison of
gossip and DDP never compares two noise models. ``step_time`` is
``SimConfig.step_time``, or where that is None what ``measure_step_time``
measures: the median of real steps of the workload on this machine.

Two noise shapes: gamma with a coefficient of variation (``step_jitter``:
mild, light-tailed), and lognormal with the log's standard deviation
(``step_sigma``: heavy-tailed, as steps slowed by data loading, garbage
collection or a noisy neighbour are). Lognormal with mean 1 has
``mu = -sigma**2 / 2``.

On shared cores (a simulated machine that several workers share, as this
2-core one does), ``shared_finish_times`` says when lockstep workers'
computations finish, sharing the cores among those computing at once.
"""

from __future__ import annotations

import copy
import math
import random
import statistics
import time
from typing import Sequence

import torch

from gossiptrain.config import RunConfig
from gossiptrain.train.local_trainer import LocalTrainer
from gossiptrain.train.workload import Workload


def step_factor(rng: random.Random, jitter: float = 0.0, sigma: float = 0.0) -> float:
    """One step's time relative to the mean: 1, gamma (CV ``jitter``) or lognormal (``sigma``), mean 1 either way."""
    if sigma > 0:
        return rng.lognormvariate(-sigma * sigma / 2, sigma)
    if jitter > 0:
        shape = 1.0 / (jitter * jitter)
        return rng.gammavariate(shape, 1.0 / shape)
    return 1.0


def shared_finish_times(starts: Sequence[float], works: Sequence[float], cores: float) -> list[float]:
    """When each job finishes: job i becomes ready at ``starts[i]`` and needs ``works[i]`` seconds of one core.

    Processor sharing, as an OS scheduler shares cores among busy
    processes: while k jobs are running each advances at min(1, cores / k).
    ``cores`` 0 means a core per job (every job runs at full speed). Exact:
    the rates change only when a job starts or finishes, and between those
    events each running job's remaining work falls linearly.
    """
    n = len(starts)
    if cores <= 0:
        return [s + w for s, w in zip(starts, works)]
    left = [float(w) for w in works]
    finish = [math.inf] * n
    pending = sorted(range(n), key=lambda i: starts[i])
    running: list[int] = []
    now = starts[pending[0]] if pending else 0.0
    nxt = 0
    while nxt < n or running:
        while nxt < n and starts[pending[nxt]] <= now:
            i = pending[nxt]
            nxt += 1
            if left[i] <= 0:
                finish[i] = max(now, starts[i])
            else:
                running.append(i)
        if not running:
            if nxt >= n:
                break
            now = starts[pending[nxt]]
            continue
        rate = min(1.0, cores / len(running))
        done_in = min(left[i] for i in running) / rate
        arrive_in = starts[pending[nxt]] - now if nxt < n else math.inf
        dt = min(done_in, arrive_in)
        now += dt
        for i in running:
            left[i] -= dt * rate
        still = []
        for i in running:
            if left[i] <= 1e-15:
                finish[i] = now
            else:
                still.append(i)
        running = still
    return finish


def measure_step_time(workload: Workload, model: torch.nn.Module, run: RunConfig, steps: int = 20) -> float:
    """Median wall seconds of one local step of this workload on this machine (one thread)."""
    trainer = LocalTrainer(workload, copy.deepcopy(model), run.train, shard=0)
    for _ in range(3):
        trainer.step()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        trainer.step()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)
