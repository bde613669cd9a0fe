"""Local SGD on one peer's shard: the part of training that knows nothing of gossip.

Both the CLI peer (real time) and the simulator (virtual time) step a
``LocalTrainer``; the gossip safe point runs between its steps.
"""

from __future__ import annotations

import math

import torch

from .config import TrainConfig
from .evaluation import EvalResult
from .workload import Workload, batches


class LocalTrainer:
    """A workload's model with its optimizer and an endless stream of batches from one shard."""

    def __init__(self, workload: Workload, model: torch.nn.Module, config: TrainConfig, shard: int) -> None:
        self.workload = workload
        self.model = model
        inputs, targets = workload.train_shard(shard, config.shards, config.seed)
        self.samples = len(targets)
        self.opt = torch.optim.SGD(model.parameters(), lr=config.lr, momentum=config.momentum, weight_decay=config.weight_decay)
        # Each shard shuffles with its own seed, so peers on different shards never march in lockstep.
        self._data = batches(inputs, targets, config.batch_size, seed=config.seed * 1000 + shard)
        self.loss_avg = math.nan  # exponential moving average of the training loss
        self.steps = 0
        model.train()

    def step(self) -> float:
        """One SGD step on the next mini-batch; returns its loss."""
        x, y = next(self._data)  # (B, ...) inputs, (B,) targets
        loss = self.workload.loss(self.model, x, y)
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        self.opt.step()
        value = loss.item()
        self.loss_avg = value if math.isnan(self.loss_avg) else 0.9 * self.loss_avg + 0.1 * value
        self.steps += 1
        return value

    def evaluate(self) -> EvalResult:
        return self.workload.evaluate(self.model)


def budget_spent(config: TrainConfig, steps: int, elapsed: float) -> bool:
    """Whether the run's step or time budget is used up (0 means no such budget)."""
    return (config.max_steps > 0 and steps >= config.max_steps) or (
        config.max_seconds > 0 and elapsed >= config.max_seconds
    )
