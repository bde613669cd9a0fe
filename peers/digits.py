"""The digits workload: scikit-learn's 8x8 handwritten digits and an MLP.

Small enough to train in seconds on a CPU, large enough (about 1.1M
parameters) that exchanging parameters costs real bandwidth: the reference
workload for tests, benchmarks and the experiments. The data ships with
scikit-learn, so nothing is downloaded; this package bundles it with its
fixed split (``BUNDLED``, 115 KB), so a peer never imports scikit-learn.

``digits-small`` (``small()``) is the same data with a 19,210-parameter MLP
(one hidden layer of 256): it reaches the same accuracies in about as many
steps at a tenth of the compute and a sixtieth of the bytes per exchange, for
tests and quick checks of the runtime where the model's size is not the point.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from gossiptrain.train.evaluation import EvalResult, evaluate_classifier
from gossiptrain.train.workload import WorkloadError, shard_indices
from peers import init_linears

__all__ = ["DigitsWorkload", "small"]

FEATURES = 64  # 8x8 pixels
CLASSES = 10
PIXEL_MAX = 16.0  # load_digits pixels are integers in [0, 16]
TEST_FRACTION = 0.2
SPLIT_SEED = 0  # the held-out split never depends on the run seed


#: scikit-learn's digits (1797 images of 0-16 pixel values) and this workload's fixed split, as
#: ``bundled_split`` computes them; a test checks that the file still equals it.
BUNDLED = Path(__file__).with_name("data") / "digits.safetensors"


def bundled_split() -> dict[str, Tensor]:
    """The tensors of ``BUNDLED``, from scikit-learn: a stratified 20% test split with a fixed seed."""
    import numpy as np
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    x, y = load_digits(return_X_y=True)
    train_index, test_index = train_test_split(
        np.arange(len(y)), test_size=TEST_FRACTION, stratify=y, random_state=SPLIT_SEED
    )
    return {
        "pixels": torch.as_tensor(x, dtype=torch.uint8),
        "labels": torch.as_tensor(y, dtype=torch.uint8),
        "train_index": torch.as_tensor(train_index, dtype=torch.int16),
        "test_index": torch.as_tensor(test_index, dtype=torch.int16),
    }


@dataclass(frozen=True)
class _Split:
    train_x: Tensor  # (1437, 64) float32 in [0, 1]
    train_y: Tensor  # (1437,) int64
    test_x: Tensor  # (360, 64)
    test_y: Tensor  # (360,)


class DigitsWorkload:
    """MLP 64 -> hidden (-> hidden) * (depth - 1) -> 10 with ReLU, cross-entropy.

    At the defaults (hidden=1024, depth=2) the model has 1,126,410 parameters.
    The test split is a fixed stratified 20% (360 of 1797 images).
    """

    num_classes = CLASSES
    _split: ClassVar[_Split | None] = None  # loaded once per process

    def __init__(self, hidden: int = 1024, depth: int = 2, name: str = "digits") -> None:
        if hidden < 1:
            raise WorkloadError(f"digits: hidden must be >= 1, got {hidden}")
        if depth < 1:
            raise WorkloadError(f"digits: depth must be >= 1, got {depth}")
        self.name = name
        self.hidden = hidden
        self.depth = depth
        self._data = self._load()

    @classmethod
    def _load(cls) -> _Split:
        if cls._split is None:
            # The bundled split (BUNDLED): importing sklearn would cost every peer process about 1.2 s of CPU.
            from safetensors.torch import load_file

            data = load_file(str(BUNDLED))  # an inert tensor format, shipped in this package
            pixels = data["pixels"].to(torch.float32) / PIXEL_MAX  # (1797, 64)
            labels = data["labels"].to(torch.int64)  # (1797,)
            train, test = data["train_index"].to(torch.int64), data["test_index"].to(torch.int64)
            cls._split = _Split(train_x=pixels[train], train_y=labels[train], test_x=pixels[test], test_y=labels[test])
        return cls._split

    def build_model(self, seed: int) -> nn.Module:
        """The MLP, initialised from ``seed`` without touching the global RNG."""
        widths = [FEATURES] + [self.hidden] * self.depth
        layers: list[nn.Module] = []
        for fan_in, fan_out in zip(widths, widths[1:]):
            layers += [nn.Linear(fan_in, fan_out, device="meta"), nn.ReLU()]
        layers.append(nn.Linear(self.hidden, CLASSES, device="meta"))
        model = nn.Sequential(*layers).to_empty(device="cpu")
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
        """Shard ``index`` of ``count``: inputs (n, 64) float32, targets (n,) int64.

        ``partition`` and its parameters pick how labels spread over shards
        (``gossiptrain.train.workload.shard_indices``).
        """
        x, y = self._data.train_x, self._data.train_y
        chosen = shard_indices(
            y, index, count, seed, partition=partition, alpha=alpha, classes_per_peer=classes_per_peer
        )  # (n,)
        return x[chosen], y[chosen]

    def loss(self, model: nn.Module, inputs: Tensor, targets: Tensor) -> Tensor:
        """Mean cross-entropy of the logits (B, 10) against targets (B,)."""
        return F.cross_entropy(model(inputs), targets)

    def evaluate(self, model: nn.Module) -> EvalResult:
        """Metrics on the fixed 360-image test split."""
        return evaluate_classifier(model, self._data.test_x, self._data.test_y, CLASSES)


def small() -> DigitsWorkload:
    """The built-in ``digits-small``: the same data and split, MLP 64 -> 256 -> 10 (19,210 parameters)."""
    return DigitsWorkload(hidden=256, depth=1, name="digits-small")
