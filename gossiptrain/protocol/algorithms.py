"""The averaging algorithms by name: what ``gossip.algorithm`` selects.

All are sans-IO state machines with the same interface (``Averaging``):
``handle(event, now) -> actions``, fed at the trainer's safe points by
``SafePoint``, in a real peer and in the simulator alike.
"""

from __future__ import annotations

import random
from typing import Mapping

import torch

from gossiptrain.config import ALGORITHMS, GossipConfig
from gossiptrain.errors import ConfigError
from gossiptrain.protocol.averaging import Averaging
from gossiptrain.protocol.local_sgd import LocalSGD
from gossiptrain.protocol.neighbor import NeighborAveraging
from gossiptrain.protocol.pairwise import PairwiseAveraging
from gossiptrain.protocol.push_sum import PushSum

_BY_NAME: dict[str, type[Averaging]] = {
    "pairwise": PairwiseAveraging,
    "push-sum": PushSum,
    "neighbor": NeighborAveraging,
    "local-sgd": LocalSGD,
}
assert tuple(_BY_NAME) == ALGORITHMS, "config.ALGORITHMS and this table must agree"


def make_averaging(
    params: Mapping[str, torch.Tensor], config: GossipConfig, rng: random.Random, me: str = ""
) -> Averaging:
    """The state machine ``config.algorithm`` names, over the live ``params``."""
    try:
        cls = _BY_NAME[config.algorithm]
    except KeyError:
        raise ConfigError(f"gossip.algorithm is {config.algorithm!r}; known algorithms: {', '.join(_BY_NAME)}") from None
    return cls(params, config, rng, me=me)
