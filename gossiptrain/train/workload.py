"""What a peer trains: the Workload protocol, and finding a workload by name.

The runtime knows nothing about models or data sets; a workload brings the
model, the peer's shard of the training data, the loss and the evaluation.
This is the small public surface that ``peers`` (and users' own workloads)
code against. Built-in workloads live in the ``peers`` package and are
imported by module path only when asked for, so importing the runtime never
imports them.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator
from typing import Any, Protocol, runtime_checkable

import torch
from torch import Tensor

from gossiptrain.errors import WorkloadError
from gossiptrain.train.evaluation import EvalResult
from gossiptrain.train.partition import SCHEMES as PARTITIONS
from gossiptrain.train.partition import class_histogram, partition_indices

__all__ = [
    "EXTERNAL",
    "PARTITIONS",
    "EvalResult",
    "Workload",
    "WorkloadError",
    "batches",
    "builtin_workloads",
    "class_histogram",
    "load_workload",
    "partition_indices",
    "shard_indices",
]

# Reserved name: the user trains their own model through the Python API.
EXTERNAL = "external"

# Built-in names map to "module:attr" paths, imported only when asked for.
_BUILTINS: dict[str, str] = {
    "charlm": "peers.charlm:CharLMWorkload",
    "digits": "peers.digits:DigitsWorkload",
    "digits-small": "peers.digits:small",
    "logreg": "peers.logreg:LogRegWorkload",
}

# Attributes a bare "package.module" path is searched for, in order.
_DEFAULT_ATTRS = ("workload", "Workload")

_MEMBERS = ("name", "build_model", "train_shard", "loss", "evaluate")


@runtime_checkable
class Workload(Protocol):
    """A model, a data set split into shards, a loss and an evaluation.

    Every peer of a run must get the same model from the same seed and
    disjoint shards from the same (index, count, seed); that is what makes
    averaging parameters across peers meaningful.

    Optional: a ``num_classes: int`` attribute (for classifiers), used for
    the class histogram a trainer logs at start; without it the histogram
    has ``targets.max() + 1`` bins.

    Optional, the user's own training loop (read with ``getattr``, so a
    workload without them trains as before; see
    ``gossiptrain.train.local_trainer.optimizer_for``):

    - ``make_optimizer(model, train_config) -> torch.optim.Optimizer``: the
      optimizer that steps ``model``; it replaces the one ``train.optimizer``,
      ``train.lr``, ``train.momentum`` and ``train.weight_decay`` would build
      (the workload then sets its own). Peers, the CLI loop and the
      simulator's baselines all use it, so averaging's added methods (momentum,
      learning-rate scaling) act on the optimizer that really steps.
    - ``make_scheduler(optimizer, train_config) -> LRScheduler | None``: a
      learning-rate schedule, stepped once per local step, after
      ``optimizer.step()``.
    - ``clip_grad_norm: float | None``: clip the gradient to this total L2
      norm before each ``optimizer.step()`` (None: no clipping).
    """

    name: str

    def build_model(self, seed: int) -> torch.nn.Module:
        """A fresh model, identical for identical seeds."""
        ...

    def train_shard(self, index: int, count: int, seed: int) -> tuple[Tensor, Tensor]:
        """Shard ``index`` of ``count`` of the training split: inputs (N, ...), targets (N,).

        Deterministic from ``seed``; the ``count`` shards of one seed are
        disjoint, cover the training split, and differ in size by at most one.

        Workloads that can split by label (the built-ins do) also take the
        keywords ``partition: str = "iid"``, ``alpha: float = 0.5`` and
        ``classes_per_peer: int = 2`` (see ``shard_indices``); non-iid shards
        may differ in size. The trainer passes them only for a non-iid
        ``train.partition``, so this three-argument form is enough for iid.
        """
        ...

    def loss(self, model: torch.nn.Module, inputs: Tensor, targets: Tensor) -> Tensor:
        """The scalar training loss of ``model`` on one mini-batch."""
        ...

    def evaluate(self, model: torch.nn.Module) -> EvalResult:
        """Metrics on a fixed held-out split, in eval mode without autograd.

        Leaves the model in the mode it was in.
        """
        ...


def builtin_workloads() -> tuple[str, ...]:
    """Names ``load_workload`` resolves without a module path."""
    return tuple(_BUILTINS)


def load_workload(name: str) -> Workload:
    """Resolve a built-in name, "package.module:attr" or "package.module" to a Workload.

    ``attr`` (dotted for nested lookups) may be a Workload instance, a class,
    or a zero-argument factory. A bare module path uses its ``workload``
    attribute, else its ``Workload`` attribute.
    """
    spec = name.strip()
    if spec == EXTERNAL:
        raise WorkloadError(
            f"workload {name!r} is reserved: it means you train your own model "
            "through the Python API, so there is nothing to load by name"
        )
    path = _BUILTINS.get(spec, spec)
    module_name, sep, attr_path = path.partition(":")
    if not module_name or (sep and not attr_path) or ":" in attr_path:
        raise WorkloadError(
            f"workload {name!r}: expected one of {', '.join(builtin_workloads())}, "
            "'package.module:attr' or 'package.module'"
        )
    module = _import(name, module_name)
    if attr_path:
        target = _lookup(name, module, module_name, attr_path)
    else:
        found = [a for a in _DEFAULT_ATTRS if hasattr(module, a)]
        if not found:
            raise WorkloadError(
                f"workload {name!r}: module {module_name!r} has neither a 'workload' "
                "nor a 'Workload' attribute; name one with 'module:attr'"
            )
        target = getattr(module, found[0])
    return _instantiate(name, target)


def shard_indices(
    labels: Tensor | int,
    index: int,
    count: int,
    seed: int,
    *,
    partition: str = "iid",
    alpha: float = 0.5,
    classes_per_peer: int = 2,
) -> Tensor:
    """Indices (n,) into the training split for shard ``index`` of ``count``.

    ``labels`` is the split's targets (N,), or just its size N for iid (the
    only scheme that ignores labels). iid: one permutation from ``seed`` cut
    into ``count`` contiguous parts whose sizes differ by at most one.
    dirichlet / classes-per-peer: label-skewed shards, see
    ``gossiptrain.train.partition.partition_indices``. Either way peers sharing a
    seed get disjoint shards that together cover the split.
    """
    if isinstance(labels, int):
        if partition != "iid":
            raise WorkloadError(f"partition {partition!r} needs the labels, not just the sample count")
        labels = torch.empty(labels, dtype=torch.int64)  # (N,) placeholder: iid only reads the length
    return partition_indices(labels, index, count, seed, partition, alpha, classes_per_peer)


def batches(
    inputs: Tensor, targets: Tensor, batch_size: int, seed: int
) -> Iterator[tuple[Tensor, Tensor]]:
    """Endless mini-batches (B, ...), (B,), reshuffled every epoch from ``seed``.

    Every batch holds ``batch_size`` distinct samples: an epoch is one
    permutation cut into ``n // batch_size`` batches, and its remainder waits
    for a later shuffle (as DataLoader's drop_last). A shard smaller than
    ``batch_size`` yields the whole shard, reshuffled, as each batch.
    """
    n = inputs.shape[0]
    if targets.shape[0] != n:
        raise WorkloadError(f"batches: {n} inputs but {targets.shape[0]} targets")
    if n == 0:
        raise WorkloadError("batches: the shard is empty")
    if batch_size < 1:
        raise WorkloadError(f"batches: batch_size must be >= 1, got {batch_size}")
    return _batch_stream(inputs, targets, min(batch_size, n), seed)


def _batch_stream(
    inputs: Tensor, targets: Tensor, size: int, seed: int
) -> Iterator[tuple[Tensor, Tensor]]:
    n = inputs.shape[0]
    generator = torch.Generator().manual_seed(seed)
    while True:
        order = torch.randperm(n, generator=generator)  # (n,)
        # One gather per epoch, then each batch is a slice of it: the same batches as gathering each one.
        epoch_inputs, epoch_targets = inputs[order], targets[order]  # (n, ...), (n,)
        for start in range(0, n - size + 1, size):
            yield epoch_inputs[start : start + size], epoch_targets[start : start + size]


def _import(name: str, module_name: str) -> Any:
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        # Only "not found" if the missing module is the one asked for (or a
        # parent); a missing dependency inside it is an import failure.
        missing = exc.name or ""
        if module_name == missing or module_name.startswith(missing + "."):
            raise WorkloadError(f"workload {name!r}: module {module_name!r} not found") from exc
        raise WorkloadError(
            f"workload {name!r}: importing module {module_name!r} failed: {exc}"
        ) from exc
    except Exception as exc:
        raise WorkloadError(
            f"workload {name!r}: importing module {module_name!r} failed: "
            f"{type(exc).__name__}: {exc}"
        ) from exc


def _lookup(name: str, module: Any, module_name: str, attr_path: str) -> Any:
    target = module
    for part in attr_path.split("."):
        if not hasattr(target, part):
            raise WorkloadError(
                f"workload {name!r}: module {module_name!r} has no attribute {attr_path!r}"
            )
        target = getattr(target, part)
    return target


def _instantiate(name: str, target: Any) -> Workload:
    # A class is checked first: the class object itself carries the protocol's
    # attributes and would pass the isinstance check below.
    if isinstance(target, type) or (not isinstance(target, Workload) and callable(target)):
        try:
            target = target()
        except Exception as exc:
            raise WorkloadError(
                f"workload {name!r}: constructing it failed: {type(exc).__name__}: {exc}"
            ) from exc
    if not isinstance(target, Workload) or isinstance(target, type):
        missing = [m for m in _MEMBERS if not hasattr(target, m)]
        detail = f"missing {', '.join(missing)}" if missing else "a class, not an instance"
        raise WorkloadError(
            f"workload {name!r}: {type(target).__name__} object is not a Workload ({detail})"
        )
    if not isinstance(target.name, str):
        raise WorkloadError(f"workload {name!r}: its 'name' is not a string")
    return target
