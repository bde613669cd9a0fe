"""Built-in workloads: what a peer trains (model, data shard, loss, evaluation).

Each module holds one workload written against the public protocol in
``gossiptrain.train.workload``; the runtime imports them by module path only when a
run asks for one. Nothing here may import the rest of gossiptrain.
"""

from __future__ import annotations

import math

import torch
from torch import nn

__all__ = ["init_linears"]


def init_linears(model: nn.Module, seed: int) -> nn.Module:
    """Initialise every nn.Linear in ``model`` from ``seed``, as PyTorch's default does.

    A private generator rather than ``torch.manual_seed``: building a model
    must not disturb the global RNG, which other peers in the same process
    (the simulator) draw from. Weights and biases are U(-1/sqrt(fan_in),
    1/sqrt(fan_in)), the distribution of nn.Linear.reset_parameters. Build the
    model on the meta device and ``to_empty`` it first to skip the default
    initialisation this replaces.
    """
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for layer in model.modules():
            if isinstance(layer, nn.Linear):
                bound = 1.0 / math.sqrt(layer.in_features)
                layer.weight.uniform_(-bound, bound, generator=generator)  # (out, in)
                if layer.bias is not None:
                    layer.bias.uniform_(-bound, bound, generator=generator)  # (out,)
    return model
