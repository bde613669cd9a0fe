"""The swarm's model, known before any peer joins: the parameter spec a named workload builds.

A coordinator that knows it refuses a newcomer with another model at once
(the same refusal a peer gives), instead of learning the model from
whichever peer reports first, which could be the wrong one.
"""

from __future__ import annotations

import torch

from gossiptrain.config import RunConfig
from gossiptrain.protocol.param_spec import ParamSpec
from gossiptrain.train.workload import EXTERNAL, load_workload


def workload_spec(config: RunConfig) -> ParamSpec | None:
    """The parameters ``config.train.workload`` builds (names, dtypes, shapes), however its peers split it (an open
    layout, learnt from the first to join: ``ParamSpec.with_layout_of``); None for ``external``."""
    if config.train.workload == EXTERNAL:
        return None
    with torch.random.fork_rng():  # building a model draws from the global generator: leave it as it was
        model = load_workload(config.train.workload).build_model(config.train.seed)
    return ParamSpec.of(dict(model.named_parameters())).open_layout()
