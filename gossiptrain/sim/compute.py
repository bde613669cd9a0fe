"""How long a simulated step takes: one model for gossip peers and synchronous workers alike.

A worker's step takes ``step_time * speed * contention * factor`` virtual
seconds: ``speed`` is its slowdown (a straggler's 4), ``contention`` how
much sharing the machine's cores slows everyone (``SimConfig.contention``),
and ``factor`` a draw with mean 1 for the step-to-step noise of a real
machine. Both systems draw from this one place, so that a comparison of
gossip and DDP never compares two noise models.

Two noise shapes: gamma with a coefficient of variation (``step_jitter``:
mild, light-tailed), and lognormal with the log's standard deviation
(``step_sigma``: heavy-tailed, as steps slowed by data loading, garbage
collection or a noisy neighbour are). Lognormal with mean 1 has
``mu = -sigma**2 / 2``.
"""

from __future__ import annotations

import random


def step_factor(rng: random.Random, jitter: float = 0.0, sigma: float = 0.0) -> float:
    """One step's time relative to the mean: 1, gamma (CV ``jitter``) or lognormal (``sigma``), mean 1 either way."""
    if sigma > 0:
        return rng.lognormvariate(-sigma * sigma / 2, sigma)
    if jitter > 0:
        shape = 1.0 / (jitter * jitter)
        return rng.gammavariate(shape, 1.0 / shape)
    return 1.0

