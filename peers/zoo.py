"""A zoo of workloads nobody tuned the runtime's defaults on: each brings its own training loop.

The defaults on top of plain averaging (quasi-global momentum, drift
correction, Adam's square-root rate, flow control, auto compression) were
tuned on ``digits-small`` and ``charlm`` with ``train.optimizer``'s SGD or
Adam. Here each workload is what a user would write: a model (an MLP, a
small CNN, BatchNorm, LayerNorm with dropout, a GRU and a small transformer
over text) and the loop around it (SGD with or without momentum or Nesterov,
Adam, AdamW with weight decay, linear warmup then cosine decay, gradient
clipping), through the Workload protocol's optional ``make_optimizer``,
``make_scheduler`` and ``clip_grad_norm``. ``train.optimizer``, ``train.lr``,
``train.momentum`` and ``train.weight_decay`` are then unused; the batch size
stays ``train.batch_size`` (experiments/zoo.py sets it per cell).

The data is the digits workload's bundled 8x8 images and charlm's
standard-library text: nothing is downloaded. Every workload is addressable
as ``peers.zoo:NAME`` (a zero-argument factory), ``NAMES`` lists them.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import torch
from torch import nn

from gossiptrain.train.workload import WorkloadError
from peers.charlm import CharLMWorkload
from peers.digits import CLASSES, FEATURES, DigitsWorkload

if TYPE_CHECKING:  # peers import only the Workload protocol of gossiptrain at run time
    from gossiptrain.config import TrainConfig

__all__ = ["NAMES", "Recipe", "ZooCharLM", "ZooDigits", "warmup_cosine"]

SIDE = 8  # digits are 8x8 images


@dataclass(frozen=True)
class Recipe:
    """The user's loop around the model: optimizer, schedule and clipping."""

    optimizer: str  # sgd, adam or adamw
    lr: float
    momentum: float = 0.0  # sgd only
    nesterov: bool = False  # sgd only
    weight_decay: float = 0.0  # sgd and adam: L2 in the gradient; adamw: decoupled
    warmup: int = 0  # steps of linear warmup from lr / warmup to lr, then cosine decay (0: a constant rate)
    decay: int = 0  # steps of the cosine decay after the warmup, down to FLOOR x lr, which then stays
    clip: float | None = None  # clip the gradient to this L2 norm before each step

    def build(self, params: list[nn.Parameter]) -> torch.optim.Optimizer:
        if self.optimizer == "sgd":
            return torch.optim.SGD(params, lr=self.lr, momentum=self.momentum, nesterov=self.nesterov, weight_decay=self.weight_decay)
        if self.optimizer == "adam":
            return torch.optim.Adam(params, lr=self.lr, weight_decay=self.weight_decay)
        if self.optimizer == "adamw":
            return torch.optim.AdamW(params, lr=self.lr, weight_decay=self.weight_decay)
        raise WorkloadError(f"zoo: unknown optimizer {self.optimizer!r} (sgd, adam or adamw)")


#: Where the cosine decay ends, as a fraction of the peak rate (a schedule that ends at 0 stops learning).
FLOOR = 0.05


def warmup_cosine(step: int, *, warmup: int, decay: int) -> float:
    """The rate's multiplier at ``step``: linear from 1/warmup to 1 over ``warmup`` steps, cosine to FLOOR over ``decay``."""
    if step < warmup:
        return (step + 1) / warmup
    done = min(1.0, (step - warmup) / max(1, decay))
    return FLOOR + (1 - FLOOR) * 0.5 * (1 + math.cos(math.pi * done))


class _Loop:
    """The Workload protocol's optional members, from a ``Recipe``."""

    recipe: Recipe

    @property
    def clip_grad_norm(self) -> float | None:
        return self.recipe.clip

    def make_optimizer(self, model: nn.Module, train_config: TrainConfig) -> torch.optim.Optimizer:
        return self.recipe.build([p for p in model.parameters() if p.requires_grad])

    def make_scheduler(
        self, optimizer: torch.optim.Optimizer, train_config: TrainConfig
    ) -> torch.optim.lr_scheduler.LRScheduler | None:
        if not self.recipe.warmup:
            return None
        # A partial of a module-level function, not a lambda: the schedule's state stays plain data.
        schedule = functools.partial(warmup_cosine, warmup=self.recipe.warmup, decay=self.recipe.decay)
        return torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)


# -- digits models ---------------------------------------------------------------------------


def mlp(hidden: int = 512, depth: int = 2) -> nn.Module:
    """64 -> hidden (x depth) -> 10 with ReLU; at 512 x 2, 301,066 parameters (the issue's model)."""
    widths = [FEATURES] + [hidden] * depth
    layers: list[nn.Module] = []
    for fan_in, fan_out in zip(widths, widths[1:]):
        layers += [nn.Linear(fan_in, fan_out), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(hidden, CLASSES))


def cnn(channels: int = 16) -> nn.Module:
    """Two 3x3 convolutions and a max-pool over the 8x8 image: (B, 64) -> (B, 10), about 10k parameters."""
    return nn.Sequential(
        nn.Unflatten(1, (1, SIDE, SIDE)),  # (B, 1, 8, 8)
        nn.Conv2d(1, channels, 3, padding=1), nn.ReLU(),  # (B, c, 8, 8)
        nn.Conv2d(channels, 2 * channels, 3, padding=1), nn.ReLU(),  # (B, 2c, 8, 8)
        nn.MaxPool2d(2),  # (B, 2c, 4, 4)
        nn.Flatten(),  # (B, 32c)
        nn.Linear(2 * channels * (SIDE // 2) ** 2, CLASSES),
    )


def batchnorm_mlp(hidden: int = 256) -> nn.Module:
    """64 -> (Linear, BatchNorm, ReLU) x 2 -> 10: running statistics are buffers, which averaging leaves local."""
    return nn.Sequential(
        nn.Linear(FEATURES, hidden), nn.BatchNorm1d(hidden), nn.ReLU(),
        nn.Linear(hidden, hidden), nn.BatchNorm1d(hidden), nn.ReLU(),
        nn.Linear(hidden, CLASSES),
    )


def layernorm_dropout_mlp(hidden: int = 256, dropout: float = 0.2) -> nn.Module:
    """64 -> (Linear, LayerNorm, ReLU, Dropout) x 2 -> 10: a noisy gradient and normalised activations."""
    return nn.Sequential(
        nn.Linear(FEATURES, hidden), nn.LayerNorm(hidden), nn.ReLU(), nn.Dropout(dropout),
        nn.Linear(hidden, hidden), nn.LayerNorm(hidden), nn.ReLU(), nn.Dropout(dropout),
        nn.Linear(hidden, CLASSES),
    )


class ZooDigits(DigitsWorkload, _Loop):
    """The digits data, split and evaluation, with another model and the user's own loop."""

    def __init__(self, name: str, model: Callable[[], nn.Module], recipe: Recipe) -> None:
        super().__init__(name=name)
        self._model = model
        self.recipe = recipe

    def build_model(self, seed: int) -> nn.Module:
        """The model, initialised from ``seed`` without disturbing the global RNG (peers share a process in the simulator)."""
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            return self._model()


class ZooCharLM(CharLMWorkload, _Loop):
    """charlm's text and evaluation (validation loss in nats per byte) with a small model and the user's own loop."""

    def __init__(self, name: str, recipe: Recipe, *, context: int = 16, embed: int = 32, hidden: int = 64,
                 layers: int = 0, heads: int = 4) -> None:
        super().__init__(context=context, embed=embed, hidden=hidden, layers=layers, heads=heads)
        self.name = name
        self.recipe = recipe


# -- the zoo ---------------------------------------------------------------------------------

#: The issue's failing case: SGD lr 0.1, momentum 0.9 (batch 32 in its cells).
ISSUE_SGD = Recipe("sgd", 0.1, momentum=0.9)


def mlp_momentum() -> ZooDigits:
    """The issue's model and loop: MLP 64-512-512-10 (301,066 parameters), SGD lr 0.1 momentum 0.9."""
    return ZooDigits("zoo-mlp-momentum", mlp, ISSUE_SGD)


def mlp_sgd() -> ZooDigits:
    """The same MLP with plain SGD (no momentum) at lr 0.2."""
    return ZooDigits("zoo-mlp-sgd", mlp, Recipe("sgd", 0.2))


def mlp_slow_momentum() -> ZooDigits:
    """The same MLP, SGD lr 0.01 momentum 0.9: a small rate (meant for large batches)."""
    return ZooDigits("zoo-mlp-slow-momentum", mlp, Recipe("sgd", 0.01, momentum=0.9))


def mlp_adam() -> ZooDigits:
    """The same MLP with Adam at lr 0.001 (torch's default)."""
    return ZooDigits("zoo-mlp-adam", mlp, Recipe("adam", 0.001))


def mlp_clipped() -> ZooDigits:
    """The same MLP, SGD lr 0.2 momentum 0.9, the gradient clipped to norm 1 in the loop (which holds it back)."""
    return ZooDigits("zoo-mlp-clipped", mlp, Recipe("sgd", 0.2, momentum=0.9, clip=1.0))


def cnn_nesterov() -> ZooDigits:
    """A small CNN on the 8x8 images, SGD lr 0.05 with Nesterov momentum 0.9 and weight decay 5e-4."""
    return ZooDigits("zoo-cnn-nesterov", cnn, Recipe("sgd", 0.05, momentum=0.9, nesterov=True, weight_decay=5e-4))


def cnn_sgd() -> ZooDigits:
    """The small CNN with plain SGD at lr 0.05."""
    return ZooDigits("zoo-cnn-sgd", cnn, Recipe("sgd", 0.05))


def cnn_cosine() -> ZooDigits:
    """The small CNN, AdamW lr 0.003 weight decay 0.05, 50 steps of linear warmup then cosine decay over 1,000."""
    return ZooDigits("zoo-cnn-cosine", cnn, Recipe("adamw", 0.003, weight_decay=0.05, warmup=50, decay=1000))


def batchnorm_momentum() -> ZooDigits:
    """An MLP with BatchNorm (its running statistics stay each peer's own), SGD lr 0.05 momentum 0.9."""
    return ZooDigits("zoo-batchnorm-momentum", batchnorm_mlp, Recipe("sgd", 0.05, momentum=0.9))


def layernorm_adamw() -> ZooDigits:
    """An MLP with LayerNorm and dropout 0.2, AdamW lr 0.002 weight decay 0.01."""
    return ZooDigits("zoo-layernorm-adamw", layernorm_dropout_mlp, Recipe("adamw", 0.002, weight_decay=0.01))


def gru_adam() -> ZooCharLM:
    """A small GRU charlm (context 16, embed 32, hidden 64: 43,648 parameters), Adam lr 0.003, the gradient clipped to norm 1."""
    return ZooCharLM("zoo-gru-adam", Recipe("adam", 0.003, clip=1.0))


def transformer_adamw() -> ZooCharLM:
    """A small causal transformer charlm (2 pre-norm layers of width 48, 4 heads, context 16: 82,240 parameters),
    AdamW lr 0.002 weight decay 0.01, 30 steps of warmup then cosine decay over 1,500, the gradient clipped to norm 1."""
    recipe = Recipe("adamw", 0.002, weight_decay=0.01, warmup=30, decay=1500, clip=1.0)
    return ZooCharLM("zoo-transformer-adamw", recipe, embed=48, layers=2, heads=4)


#: Every zoo workload by its factory's name (``peers.zoo:NAME``).
NAMES: tuple[str, ...] = (
    "mlp_momentum", "mlp_sgd", "mlp_slow_momentum", "mlp_adam", "mlp_clipped", "cnn_nesterov", "cnn_sgd",
    "cnn_cosine", "batchnorm_momentum", "layernorm_adamw", "gru_adam", "transformer_adamw",
)
