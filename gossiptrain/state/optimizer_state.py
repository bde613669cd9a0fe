"""Optimizer state as named tensors, and what a newcomer's optimizer expects (``state.transfer_optimizer``).

A donor lists its optimizer's state (``optimizer_tensors``) as tensors named
``optimizer/<parameter>/<key>`` (SGD's ``momentum_buffer``; Adam's
``exp_avg``, ``exp_avg_sq`` and ``step``) and non-tensor numbers as
scalars, in the optimizer's parameter order with keys sorted, so that equal
models and optimizers list equal tables. A newcomer's optimizer has no state
before its first step; ``optimizer_template`` steps a throwaway copy once on
zero gradients to learn the names, dtypes and shapes to expect, and turns
downloaded values that match them into ``Optimizer.load_state_dict``'s
argument. Nothing here unpickles anything.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import torch

from gossiptrain.state.snapshot import OPTIMIZER_PREFIX, Entry, entries_of, first_difference


def optimizer_tensors(
    names: Mapping[int, str], optimizer: torch.optim.Optimizer, local: Callable[[torch.Tensor], torch.Tensor] | None = None
) -> tuple[list[tuple[str, torch.Tensor]], list[tuple[str, int | float]]] | str:
    """The optimizer's state as named tensors and scalars (``optimizer/<param>/<key>``), or why it cannot be sent.

    ``names`` maps ``id(parameter)`` to its name in the model. In the
    optimizer's parameter order, keys sorted: every member with the same
    model and optimizer lists the same names in the same order. ``local``:
    each tensor as a rank of a split model holds it (an FSDP2 shard's local
    tensor, ``gossiptrain.state.local_tensors.local``; never gathered).
    """
    tensors: list[tuple[str, torch.Tensor]] = []
    scalars: list[tuple[str, int | float]] = []
    for group in optimizer.param_groups:
        for p in group["params"]:
            if id(p) not in names:
                return f"it holds a parameter of shape {list(p.shape)} that is not one of the model's"
            state = optimizer.state.get(p, {})
            for key in sorted(state, key=str):
                value = state[key]
                name = f"{OPTIMIZER_PREFIX}{names[id(p)]}/{key}"
                if not isinstance(key, str):
                    return f"its state of {names[id(p)]!r} has a key of type {type(key).__name__}"
                if isinstance(value, torch.Tensor):
                    tensors.append((name, value if local is None else local(value)))
                elif type(value) in (int, float):
                    scalars.append((name, value))
                else:
                    return f"its state {name!r} is a {type(value).__name__}, neither a tensor nor a number"
    return tensors, scalars


def parameter_names(model: torch.nn.Module) -> dict[int, str]:
    return {id(p): n for n, p in model.named_parameters()}


@dataclass(frozen=True)
class OptimizerTemplate:
    """The optimizer state a newcomer takes: names, dtypes and shapes of the tensors, names and types of the scalars."""

    entries: tuple[Entry, ...]
    like: tuple[torch.Tensor, ...]  # meta tensors with those dtypes and shapes, for decode_state
    scalars: tuple[tuple[str, type], ...]
    index: dict[str, tuple[int, str]]  # "optimizer/<param>/<key>" -> (the parameter's number in state_dict(), key)
    param_groups: list[dict[str, Any]]  # ours, kept as they are (the hyperparameters are the run's)

    def state_dict(
        self, values: Sequence[torch.Tensor], scalars: Sequence[tuple[str, int | float]]
    ) -> dict[str, Any] | str:
        """``Optimizer.load_state_dict``'s argument from downloaded values, or why they do not fit."""
        expected = dict(self.scalars)
        got = dict(scalars)
        odd = sorted(set(expected) ^ set(got))
        if odd:
            return f"scalar {odd[0]!r} is {'missing' if odd[0] in expected else 'not expected'}"
        state: dict[int, dict[str, Any]] = {}
        for (name, _, _), tensor in zip(self.entries, values, strict=True):
            index, key = self.index[name]
            state.setdefault(index, {})[key] = tensor
        for name, number in got.items():
            want = expected[name]
            if type(number) is not want and not (want is float and type(number) is int):
                return f"scalar {name!r} is a {type(number).__name__}, we expect a {want.__name__}"
            index, key = self.index[name]
            state.setdefault(index, {})[key] = want(number)
        return {"state": state, "param_groups": [dict(g) for g in self.param_groups]}


def optimizer_template(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, local: Callable[[torch.Tensor], torch.Tensor] | None = None
) -> OptimizerTemplate | str:
    """What ``optimizer``'s state looks like once it has stepped, or why that cannot be told.

    An optimizer creates its state at its first step, so a newcomer's is
    empty: a throwaway copy of it, over copies of the parameters, steps once
    on zero gradients and shows the names, dtypes and shapes to expect.
    ``local``: as ``optimizer_tensors``'s, the shapes a rank of a split model
    holds (its ``state_dict`` then needs each value made the parameter's kind
    again: ``local_tensors.like_param``).
    """
    names = parameter_names(model)
    params = [p for g in optimizer.param_groups for p in g["params"]]
    if any(id(p) not in names for p in params):
        return "the optimizer holds a parameter that is not one of the model's"
    clones = {id(p): p.detach().clone().requires_grad_(p.requires_grad) for p in params}
    groups = [
        {**{k: v for k, v in g.items() if k != "params"}, "params": [clones[id(p)] for p in g["params"]]}
        for g in optimizer.param_groups
    ]
    try:
        probe = type(optimizer)(groups, **optimizer.defaults)
        for c in clones.values():
            if c.requires_grad:
                c.grad = torch.zeros_like(c)
        probe.step()
    except Exception as e:  # an optimizer that needs a closure, or takes other arguments: no state transfer
        return f"a copy of {type(optimizer).__name__} could not step ({e!r:.200})"
    listed = optimizer_tensors({id(clones[id(p)]): names[id(p)] for p in params}, probe, local)
    if isinstance(listed, str):
        return listed
    tensors, scalars = listed
    number = {names[id(p)]: i for i, p in enumerate(params)}  # torch's state_dict numbers parameters in group order
    index: dict[str, tuple[int, str]] = {}
    for name, _ in [*tensors, *scalars]:
        pname, _, key = name.removeprefix(OPTIMIZER_PREFIX).rpartition("/")
        index[name] = (number[pname], key)
    like = tuple(torch.empty(t.shape, dtype=t.dtype, device="meta") for _, t in tensors)
    return OptimizerTemplate(
        entries_of(tensors), like, tuple((n, type(v)) for n, v in scalars), index, optimizer.state_dict()["param_groups"]
    )


def fitted_state_dict(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, named: Sequence[tuple[str, torch.Tensor]],
    scalars: Sequence[tuple[str, int | float]], local: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> dict[str, Any] | str:
    """``optimizer.load_state_dict``'s argument from a donor's optimizer state (named tensors and scalars), or why it
    does not fit ``optimizer``: checked against its template (``local``: at a split model's rank's shapes), name,
    dtype and shape of every tensor, and type of every scalar."""
    template = optimizer_template(model, optimizer, local)
    if isinstance(template, str):
        return template
    got = entries_of(named)
    if got != template.entries:
        return first_difference(template.entries, got)
    return template.state_dict([t for _, t in named], scalars)
