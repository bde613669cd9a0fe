"""A rank's optimizer state in a split peer's state transfer (``state.transfer_optimizer``, issue 48).

A whole-model peer's download can carry the donor's optimizer state
(``gossiptrain.state.optimizer_state``: named tensors, never unpickled). A
rank of a split peer carries its own shard's: the same names and keys, each
tensor as the rank holds it (an FSDP2 parameter's state is a ``DTensor``:
its local shard, ``local_tensors.local``; a pipeline stage's, as it is).
The newcomer's rank checks what came against a template of its own
optimizer at those local shapes, and makes each value the kind of tensor its
parameter's state is before loading it (``local_tensors.like_param``).

Split peers usually find their optimizer at their first step, after the
download: what came then waits (``SplitGroup``) and is loaded when the
optimizer is bound.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from gossiptrain.state.local_tensors import like_param, local
from gossiptrain.state.optimizer_state import (
    OptimizerTemplate,
    fitted_state_dict,
    optimizer_template,
    optimizer_tensors,
    parameter_names,
)

Named = list[tuple[str, torch.Tensor]]
Scalars = tuple[tuple[str, int | float], ...]


def listed(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> tuple[Named, Scalars] | str:
    """This rank's optimizer state as named local tensors and scalars, or why it cannot be given."""
    got = optimizer_tensors(parameter_names(model), optimizer, local)
    if isinstance(got, str):
        return got
    return got[0], tuple(got[1])


def template(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> OptimizerTemplate | str:
    """What this rank's optimizer state looks like once it has stepped, at the shapes the rank holds."""
    return optimizer_template(model, optimizer, local)


def load(model: torch.nn.Module, optimizer: torch.optim.Optimizer, named: Sequence[tuple[str, torch.Tensor]],
         scalars: Scalars) -> str | None:
    """Load a donor rank's optimizer state into ``optimizer``; why not (nothing loaded), or None."""
    state = fitted_state_dict(model, optimizer, named, scalars, local)
    if isinstance(state, str):
        return state
    params = [p for group in optimizer.param_groups for p in group["params"]]
    entries: dict[int, dict[str, Any]] = state["state"]
    for index, entry in entries.items():
        for key, value in entry.items():
            if isinstance(value, torch.Tensor):
                entry[key] = like_param(value, params[index])  # a DTensor laid out as its parameter, where it is one
    optimizer.load_state_dict(state)
    return None
