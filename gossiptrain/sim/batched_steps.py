"""Simulated peers' local steps computed together: one stacked call for every peer that has a step under way.

Every simulated peer takes real torch steps, one small model at a time; at
a thousand peers the per-call overhead of those small steps adds up. A
peer's step depends only on its parameters as its last safe point left
them and on its next batch, and nothing else reads or writes the live
parameters between the step's start and the peer's next safe point: every
algorithm touches them only at safe points (what arrives meanwhile waits
for the next; pairwise answers partners from its frozen copy of the model,
``view``), and the cluster's sampler settles every step under way before
it reads a model (``flush``). So a peer's step may be
computed at any moment between the two, and ``StepBatcher`` computes the
steps of every peer that started one in a single call: the peers' parameters
stacked, each peer's batch beside them, and ``torch.func.vmap`` over
``grad_and_value`` of the workload's own loss (``functional_call`` of one
peer's module with each peer's parameters). Each peer's gradients then go
into its own ``.grad`` and its own optimizer steps them, clips and
schedules as ``LocalTrainer.step`` would: the optimizer state, the data
order and every protocol message stay the peer's own.

What is batched together: peers whose models have the same parameter names,
shapes and dtypes, the same workload type and batches of the same shapes.
Steps that cannot be batched are taken one by one, at once, as before: a
model with buffers (BatchNorm's running statistics change in the forward
pass) or with dropout (vmap draws its randomness otherwise than a peer
alone), a pipeline stage or a DDP wrapper, a group of one, or a group whose
stacked call failed (said once in the log, then one by one).

The stacked call gives the same gradients as one peer's backward pass up to
float rounding (a batched matrix product adds in another order):
``tests/test_batched_steps.py`` checks the parameters after many steps of
every built-in workload, and a simulated swarm's accuracy curve, against
steps taken one by one.
"""

from __future__ import annotations

import logging
import weakref
from dataclasses import dataclass
from typing import Any, Hashable

import torch
from torch import Tensor
from torch.func import functional_call, grad_and_value, vmap

from gossiptrain.train.local_trainer import LocalTrainer

log = logging.getLogger(__name__)

__all__ = ["BatchStats", "StepBatcher", "batchable"]


@dataclass
class BatchStats:
    """What the batcher did (``Cluster.batcher.stats``; experiments/sim_speed.py reports it)."""

    stacked_calls: int = 0  # vmapped calls
    stacked_steps: int = 0  # steps computed in them
    single_steps: int = 0  # steps taken one by one (not batchable, or alone in their group)


@dataclass
class _Pending:
    trainer: LocalTrainer
    x: Tensor
    y: Tensor
    key: Hashable


def batchable(trainer: LocalTrainer) -> str | None:
    """Why ``trainer``'s steps cannot be computed in a stacked call (None: they can)."""
    model = trainer.model
    if trainer.pipeline is not None or trainer.forward is not model:
        return "a pipeline stage or a wrapped model"
    if any(True for _ in model.buffers()):
        return "the model keeps buffers (running statistics change in the forward pass)"
    if any(isinstance(m, torch.nn.modules.dropout._DropoutNd) and m.p > 0 for m in model.modules()):
        return "the model has dropout (a stacked call draws its randomness otherwise)"
    if not all(p.requires_grad for p in model.parameters()):
        return "some parameters are frozen"
    return None


class StepBatcher:
    """The cluster's: ``begin`` a peer's step where it would take it, ``finish`` it at its next safe point."""

    def __init__(self) -> None:
        self._pending: dict[int, _Pending] = {}  # id(trainer) -> its step under way
        # Per trainer: its parameters' names, shapes and dtypes where its steps may be stacked, else None (asked once)
        self._signatures: weakref.WeakKeyDictionary[LocalTrainer, tuple[Any, ...] | None] = weakref.WeakKeyDictionary()
        self._failed: set[Hashable] = set()  # groups whose stacked call raised: one by one from then on
        self.stats = BatchStats()

    def begin(self, trainer: LocalTrainer) -> bool:
        """Start ``trainer``'s next step: its batch is drawn now (the data order is the one-by-one order), its gradient
        computed by the next ``flush``; a step that cannot be stacked is taken at once. False where leased data had no
        chunk to claim (as ``LocalTrainer.step`` returning None)."""
        if id(trainer) in self._pending:
            raise RuntimeError("a peer began a step while its last one is still under way")
        if trainer not in self._signatures:
            self._signatures[trainer] = _signature(trainer) if batchable(trainer) is None else None
        signature = self._signatures[trainer]
        if signature is None:
            self.stats.single_steps += 1
            return trainer.step() is not None
        batch = trainer.next_batch()
        if batch is None:
            return False
        x, y = batch
        key = (signature, tuple(x.shape), x.dtype, tuple(y.shape), y.dtype)  # alike peers, batches of one shape
        self._pending[id(trainer)] = _Pending(trainer, x, y, key)
        return True

    def finish(self, trainer: LocalTrainer) -> None:
        """``trainer``'s step is in its parameters once this returns (every step under way computed, if it was not)."""
        if id(trainer) in self._pending:
            self.flush()

    def flush(self) -> None:
        """Compute every step under way: one stacked call per group of alike peers, one by one otherwise."""
        pending, self._pending = self._pending, {}
        groups: dict[Hashable, list[_Pending]] = {}
        for p in pending.values():
            groups.setdefault(p.key, []).append(p)
        for key, items in groups.items():
            computed = None
            if len(items) > 1 and key not in self._failed:
                try:
                    computed = self._stacked(items)
                except Exception as e:  # an op without a batching rule, say: correct, only slower, from now on
                    self._failed.add(key)
                    log.warning("batched steps: a stacked call failed (%s): these peers step one by one", e)
            if computed is None:
                for p in items:
                    self._single(p)
                continue
            grads, losses = computed  # applied apart from the call: an optimizer's error is not a stacking failure
            for k, p in enumerate(items):
                p.trainer.opt.zero_grad(set_to_none=True)
                for param, grad in zip(p.trainer.model.parameters(), grads, strict=True):
                    param.grad = grad[k]
                p.trainer.apply_gradients(losses[k], len(p.y))
            self.stats.stacked_calls += 1
            self.stats.stacked_steps += len(items)

    def _single(self, p: _Pending) -> None:
        p.trainer.train_on(p.x, p.y)
        self.stats.single_steps += 1

    def _stacked(self, items: list[_Pending]) -> tuple[list[Tensor], list[float]]:
        """The gradients of every item's batch at its peer's parameters, in one call: per parameter (in the
        models' order) a (K, ...) tensor, and the K losses."""
        first = items[0].trainer
        module, workload = first.model, first.workload
        named = [dict(p.trainer.model.named_parameters()) for p in items]
        names = list(named[0])
        # (K, ...) per parameter: the K peers' values side by side
        stacked = {n: torch.stack([params[n].detach() for params in named]) for n in names}
        xs = torch.stack([p.x for p in items])  # (K, B, ...)
        ys = torch.stack([p.y for p in items])  # (K, B, ...)

        def loss_of(params: dict[str, Tensor], x: Tensor, y: Tensor) -> Tensor:
            return workload.loss(_Applied(module, params), x, y)  # type: ignore[arg-type]

        grads, losses = vmap(grad_and_value(loss_of))(stacked, xs, ys)  # {name: (K, ...)}, (K,)
        return [grads[n] for n in names], [float(v) for v in losses.tolist()]


class _Applied:
    """``module`` with other parameters: what a workload's loss calls as its model (``model(inputs)``)."""

    def __init__(self, module: torch.nn.Module, params: dict[str, Tensor]) -> None:
        self.module = module
        self.params = params

    def __call__(self, *args: Any) -> Any:
        return functional_call(self.module, self.params, args)


def _signature(trainer: LocalTrainer) -> tuple[Any, ...]:
    """What peers whose steps one stacked call computes share (besides their batches' shapes): the model's and
    the workload's types, and the parameters' names, shapes and dtypes."""
    params = tuple((n, tuple(p.shape), p.dtype) for n, p in trainer.model.named_parameters())
    return (type(trainer.model), type(trainer.workload), params)
