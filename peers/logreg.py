"""The logreg workload: multinomial logistic regression on synthetic data.

A convex problem with a known answer and a model of a few dozen parameters:
the workload for fast protocol tests and for checking that averaging
converges where theory says it must. The data comes from a fixed seed, so
every peer and every run sees the same data set; the run seed only picks the
shards and the initial weights.
"""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from gossiptrain.train.evaluation import EvalResult, evaluate_classifier
from gossiptrain.train.workload import WorkloadError, shard_indices
from peers import init_linears

__all__ = ["LogRegWorkload"]

DATA_SEED = 20240501  # fixed: the data set is part of the workload, not the run
SIGNAL = 4.0  # std of the teacher's logits: large against NOISE, so mostly separable
NOISE = 0.5  # std of the logit noise that makes the classes overlap a little


@functools.lru_cache(maxsize=8)
def _teacher(dim: int, classes: int) -> Tensor:
    generator = torch.Generator().manual_seed(DATA_SEED)
    # Rows of norm about one, so that x @ w has unit variance for x ~ N(0, I).
    return torch.randn(classes, dim, generator=generator) / math.sqrt(dim)  # (K, D)


@functools.lru_cache(maxsize=16)
def _sample(dim: int, classes: int, samples: int, stream: int) -> tuple[Tensor, Tensor]:
    # One generator per split, so the test set does not depend on the train size.
    generator = torch.Generator().manual_seed(DATA_SEED + stream)
    x = torch.randn(samples, dim, generator=generator)  # (N, D)
    scores = SIGNAL * (x @ _teacher(dim, classes).T)  # (N, K)
    scores = scores + NOISE * torch.randn(samples, classes, generator=generator)
    return x, scores.argmax(dim=1)  # (N, D), (N,) int64


class LogRegWorkload:
    """nn.Linear(dim, classes) with cross-entropy on teacher-labelled Gaussian inputs.

    Labels are the argmax of a fixed random linear teacher plus a little
    noise, so the classes are linearly separable up to that noise.
    """

    name = "logreg"

    def __init__(
        self, dim: int = 32, classes: int = 2, train_samples: int = 4096, test_samples: int = 1024
    ) -> None:
        for field, value, least in (
            ("dim", dim, 1),
            ("classes", classes, 2),
            ("train_samples", train_samples, 1),
            ("test_samples", test_samples, 1),
        ):
            if value < least:
                raise WorkloadError(f"logreg: {field} must be >= {least}, got {value}")
        self.dim = dim
        self.classes = classes
        self.num_classes = classes  # the Workload protocol's optional name for it
        self._train = _sample(dim, classes, train_samples, stream=1)
        self._test = _sample(dim, classes, test_samples, stream=2)

    def build_model(self, seed: int) -> nn.Module:
        """The linear model, initialised from ``seed`` without touching the global RNG."""
        model = nn.Linear(self.dim, self.classes, device="meta").to_empty(device="cpu")
        return init_linears(model, seed)

    def train_shard(
        self,
        index: int,
        count: int,
        seed: int,
        *,
        partition: str = "iid",
        alpha: float = 0.5,
        classes_per_peer: int = 2,
    ) -> tuple[Tensor, Tensor]:
        """Shard ``index`` of ``count``: inputs (n, dim) float32, targets (n,) int64.

        ``partition`` and its parameters pick how labels spread over shards
        (``gossiptrain.train.workload.shard_indices``).
        """
        x, y = self._train
        chosen = shard_indices(
            y, index, count, seed, partition=partition, alpha=alpha, classes_per_peer=classes_per_peer
        )  # (n,)
        return x[chosen], y[chosen]

    def loss(self, model: nn.Module, inputs: Tensor, targets: Tensor) -> Tensor:
        """Mean cross-entropy of the logits (B, classes) against targets (B,)."""
        return F.cross_entropy(model(inputs), targets)

    def evaluate(self, model: nn.Module) -> EvalResult:
        """Metrics on the fixed synthetic test split."""
        return evaluate_classifier(model, *self._test, self.classes)
