"""What ``Peer`` takes in place of a model or an optimizer: a factory it calls once the swarm's configuration is known.

A module of their own, below ``gossiptrain.runtime.peer`` and
``gossiptrain.runtime.group_worker``, which both take them.
"""

from __future__ import annotations

from typing import Callable

import torch

from gossiptrain.config import RunConfig

#: ``(config, shard) -> module``: the model, built for the swarm's run and the shard it gave us.
ModelFactory = Callable[[RunConfig, int], torch.nn.Module]
#: ``(config, model) -> optimizer``: the optimizer of the model a ``ModelFactory`` built.
OptimizerFactory = Callable[[RunConfig, torch.nn.Module], torch.optim.Optimizer]
