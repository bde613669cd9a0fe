"""The model and optimizer inside the wrappers training libraries put around them.

A peer averages parameters by name, hooks the optimizer's ``step()`` (the
swarm's learning-rate scaling), reads and loads its state (state transfer)
and gives SGD's momentum its quasi-global buffer. A wrapper is the real
thing for none of those: DDP's ``module.`` prefix would make a peer's names
differ from a single-process peer's (the join refuses a different model),
and accelerate's ``AcceleratedOptimizer`` is no ``torch.optim.SGD`` (its
momentum would silently stay local). So ``Peer`` takes what is inside:
a loop written with ``accelerate`` (``accelerator.prepare(model,
optimizer, ...)``) or DDP passes what it trains with.
"""

from __future__ import annotations

from typing import TypeVar

import torch

T = TypeVar("T")


def inner_model(model: T) -> T:
    """The module a ``DistributedDataParallel`` wraps (its parameters are the same tensors), else ``model``."""
    while isinstance(model, torch.nn.parallel.DistributedDataParallel):
        model = model.module
    return model


def inner_optimizer(optimizer: T) -> T:
    """The torch optimizer accelerate's ``AcceleratedOptimizer`` holds (``.optimizer``), else ``optimizer``."""
    inner = getattr(optimizer, "optimizer", None)
    while isinstance(inner, torch.optim.Optimizer):
        optimizer, inner = inner, getattr(inner, "optimizer", None)  # type: ignore[assignment]
    return optimizer
