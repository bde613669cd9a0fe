"""Local SGD on one peer's shard: the part of training that knows nothing of gossip.

Both the CLI peer (real time) and the simulator (virtual time) step a
``LocalTrainer``; the gossip safe point runs between its steps.
"""

from __future__ import annotations

import functools
import inspect
import logging
import math
import warnings
from typing import Any, Callable

import torch
from torch import Tensor

from gossiptrain.config import TrainConfig
from gossiptrain.errors import WorkloadError
from gossiptrain.runtime.leased_data import LeaseClient, LeasedBatches
from gossiptrain.state.checkpoint import Checkpoint, restore
from gossiptrain.train.evaluation import EvalResult
from gossiptrain.train.partition import class_histogram, describe
from gossiptrain.train.workload import Workload, batches

log = logging.getLogger(__name__)

# Keywords a partition-aware train_shard takes (see the Workload protocol).
_PARTITION_KEYWORDS = ("partition", "alpha", "classes_per_peer")
_LOGGED_CLASSES = 20  # histogram bins shown in the start-up log line


def make_optimizer(config: TrainConfig, model: torch.nn.Module) -> torch.optim.Optimizer:
    """The run's optimizer for ``model``: ``train.optimizer`` with ``train.lr`` and ``train.weight_decay``.

    SGD also takes ``train.momentum``; Adam keeps torch's betas (0.9, 0.999).
    """
    if config.optimizer == "adam":
        return torch.optim.Adam(model.parameters(), lr=config.lr, weight_decay=config.weight_decay)
    return torch.optim.SGD(model.parameters(), lr=config.lr, momentum=config.momentum, weight_decay=config.weight_decay)


def optimizer_for(workload: Workload | None, config: TrainConfig, model: torch.nn.Module) -> torch.optim.Optimizer:
    """The run's optimizer for ``model``: the workload's own where it brings one, else ``make_optimizer``'s.

    Every place that builds a run's optimizer (a peer, the CLI loop, the
    simulator's baselines) comes here, so the defaults meet the optimizer the
    user's loop really steps (a workload's ``make_optimizer(model, train_config)``,
    see the Workload protocol) and not one built from ``train.optimizer``.
    """
    build = getattr(workload, "make_optimizer", None) if workload is not None else None
    if build is None:
        return make_optimizer(config, model)
    optimizer = build(model, config)
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise WorkloadError(f"workload {workload.name!r}: make_optimizer returned {type(optimizer).__name__}, not a torch optimizer")
    return optimizer


#: ``train.lr_schedule = step``: the fractions of ``max_steps`` after which the rate is cut, and the cut each.
STEP_MILESTONES = (0.75, 0.9)
STEP_FACTOR = 0.1


def step_decay(step: int, *, total: int) -> float:
    """The rate's multiplier at ``step`` of ``total``: 1, then x STEP_FACTOR after each of STEP_MILESTONES."""
    return STEP_FACTOR ** sum(step >= fraction * total for fraction in STEP_MILESTONES)


def scheduler_for(
    workload: Workload | None, optimizer: torch.optim.Optimizer, config: TrainConfig
) -> torch.optim.lr_scheduler.LRScheduler | None:
    """The workload's learning-rate schedule over ``optimizer`` (``make_scheduler``), else ``train.lr_schedule``'s;
    None for a constant rate."""
    build = getattr(workload, "make_scheduler", None) if workload is not None else None
    if build is None:
        if config.lr_schedule == "step":
            # A partial of a module-level function, not a lambda: the schedule's state stays plain data.
            return torch.optim.lr_scheduler.LambdaLR(optimizer, functools.partial(step_decay, total=config.max_steps))
        return None
    if config.lr_schedule != "constant":
        raise WorkloadError(f"workload {workload.name!r} brings its own learning-rate schedule (make_scheduler): "
                            f"train.lr_schedule {config.lr_schedule!r} would be a second one; leave it constant")
    scheduler = build(optimizer, config)
    if scheduler is not None and not callable(getattr(scheduler, "step", None)):
        raise WorkloadError(f"workload {workload.name!r}: make_scheduler returned {type(scheduler).__name__}, which has no step()")
    return scheduler


def clip_norm_of(workload: Workload | None) -> float | None:
    """The workload's gradient clipping (``clip_grad_norm``): a positive norm, or None for none."""
    clip = getattr(workload, "clip_grad_norm", None) if workload is not None else None
    if clip is None:
        return None
    if isinstance(clip, bool) or not isinstance(clip, (int, float)) or not (0 < clip < math.inf):
        raise WorkloadError(f"workload {workload.name!r}: clip_grad_norm must be a positive number or None, got {clip!r}")
    return float(clip)


class LocalTrainer:
    """A workload's model with its optimizer and an endless stream of batches from one shard.

    ``optimizer`` is one made by ``optimizer_for`` before (a peer's, which
    state transfer may have filled in); by default a fresh one. The
    workload's schedule (``make_scheduler``) steps after every optimizer
    step and its ``clip_grad_norm`` clips the gradient before it, as the
    user's own loop would. A peer made
    of several workers gives each its ``worker`` = (rank, size): rank r
    trains on every size-th sample of the shard, with batches of its own
    order, through ``forward`` (the model under DDP, which averages the
    workers' gradients); evaluation always uses ``model`` itself. A pipeline
    stage's ``pipeline`` runs a batch through every stage instead (forward
    and backward; its loss): see ``gossiptrain.train.split_loop``.
    """

    def __init__(
        self, workload: Workload, model: torch.nn.Module, config: TrainConfig, shard: int,
        optimizer: torch.optim.Optimizer | None = None, *, worker: tuple[int, int] = (0, 1),
        forward: torch.nn.Module | None = None, leases: Callable[[int], LeaseClient] | None = None,
        pipeline: Callable[[Tensor, Tensor], Tensor] | None = None,
    ) -> None:
        self.workload = workload
        self.model = model
        self.forward = forward if forward is not None else model
        self.pipeline = pipeline  # a pipeline stage's: forward and backward of a batch through every stage, its loss
        rank, size = worker
        if leases is not None and size > 1:
            raise WorkloadError("leased data (data.mode = leased) is not built for a peer of several workers yet")
        # Leased (data.mode = leased): the whole training set, batches from the chunks the swarm leases us.
        inputs, targets = workload.train_shard(0, 1, config.seed) if leases is not None else load_shard(workload, config, shard)
        if size > 1:  # (N, ...) -> (about N / size, ...): this worker's part of the shard
            inputs, targets = inputs[rank::size], targets[rank::size]
        self.samples = len(targets)
        # Samples per class on this shard: what the partition gave this peer ([] if not a classifier).
        self.class_histogram: list[int] = _histogram(workload, targets)
        if leases is None:  # a leased peer's data is the whole set; node.use_leases logs its plan
            _log_shard(config, shard, self.samples, self.class_histogram)
        self.opt = optimizer if optimizer is not None else optimizer_for(workload, config, model)
        self.scheduler = scheduler_for(workload, self.opt, config)
        self.clip = clip_norm_of(workload)
        # One source of batches: the chunks leased to us, or our shard's endless shuffle (each shard shuffles with
        # its own seed, so peers on different shards never march in lockstep).
        self.leased = LeasedBatches(leases(len(targets)), inputs, targets, config.batch_size) if leases is not None else None
        self._data = batches(inputs, targets, config.batch_size, seed=config.seed * 1000 + shard + 1_000_003 * rank) \
            if leases is None else iter(())
        self.loss_avg = math.nan  # exponential moving average of the training loss
        self.steps = 0
        self.samples_seen = 0  # samples consumed by step(); both counters continue across a resume
        model.train()

    def step(self) -> float | None:
        """One optimizer step on the next mini-batch (clipped, then scheduled, where the workload says); returns its
        loss, or None where the data is leased and no chunk can be claimed now (wait a little, then step again)."""
        batch = self.next_batch()
        return None if batch is None else self.train_on(*batch)

    def train_on(self, x: Tensor, y: Tensor) -> float:
        """One optimizer step on the batch ``x`` (B, ...), ``y`` (B,): the gradient, then ``apply_gradients``."""
        if self.pipeline is not None:
            self.opt.zero_grad(set_to_none=True)
            loss = self.pipeline(x, y)  # the stages' forward and backward (gossiptrain.train.split_loop)
        else:
            loss = self.workload.loss(self.forward, x, y)
            self.opt.zero_grad(set_to_none=True)
            loss.backward()
        return self.apply_gradients(loss.item(), len(y))

    def next_batch(self) -> tuple[Tensor, Tensor] | None:
        """The next mini-batch, (B, ...) inputs and (B,) targets; None where the data is leased and no chunk can be
        claimed now. (``step`` is this, the gradient, then ``apply_gradients``; the simulator computes the gradients
        of many peers' batches at once between the two: ``gossiptrain.sim.batched_steps``.)"""
        if self.leased is not None:
            return self.leased.next()
        return next(self._data)

    def apply_gradients(self, loss: float, samples: int) -> float:
        """The gradients of a batch of ``samples`` are in the parameters' ``.grad``: clip them where the workload
        says, step the optimizer and the schedule, and count the step; its ``loss``, returned."""
        if self.clip is not None:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.clip)
        self.opt.step()
        if self.scheduler is not None:
            self.scheduler.step()
        self.loss_avg = loss if math.isnan(self.loss_avg) else 0.9 * self.loss_avg + 0.1 * loss
        self.steps += 1
        self.samples_seen += samples
        if self.leased is not None:
            self.leased.commit()  # trained now: the swarm may count these samples
        return loss

    def load_state(
        self, checkpoint: Checkpoint, *, fingerprint: str | None = None, run: dict[str, Any] | None = None,
        allow_other_run: bool = False,
    ) -> None:
        """Continue from a checkpoint: its model and optimizer state and its counters (see checkpoint.restore)."""
        restore(checkpoint, self.model, self.opt, fingerprint=fingerprint, run=run, allow_other_run=allow_other_run)
        self.samples_seen = checkpoint.info.samples_seen
        self.continue_from(checkpoint.info.step)

    def continue_from(self, step: int) -> None:
        """Go on counting from ``step`` (a checkpoint's, or a donor's with ``state.transfer_step``), at the rate a
        schedule that is a function of the step (LambdaLR: ``train.lr_schedule``, the zoo's) has there."""
        self.steps = step
        if isinstance(self.scheduler, torch.optim.lr_scheduler.LambdaLR):
            self.scheduler.last_epoch = step - 1  # step() counts this one
            with warnings.catch_warnings():  # "scheduler.step() before optimizer.step()": meant, not a slip here
                warnings.simplefilter("ignore", UserWarning)
                self.scheduler.step()

    def evaluate(self) -> EvalResult:
        return self.workload.evaluate(self.model)


def load_shard(workload: Workload, config: TrainConfig, shard: int) -> tuple[Tensor, Tensor]:
    """A peer's training shard as ``train.partition`` cuts it (the baselines in experiments/ cut theirs here too)."""
    if config.partition == "iid":
        # The three-argument call: workloads written before partitions keep working.
        return workload.train_shard(shard, config.shards, config.seed)
    if not _accepts_partition(workload):
        raise WorkloadError(
            f"workload {workload.name!r}: train.partition is {config.partition!r}, but its train_shard "
            f"does not take the keywords {', '.join(_PARTITION_KEYWORDS)}; use train.partition = 'iid' "
            "or add them (see the Workload protocol)"
        )
    return workload.train_shard(  # type: ignore[call-arg]
        shard,
        config.shards,
        config.seed,
        partition=config.partition,
        alpha=config.partition_alpha,
        classes_per_peer=config.partition_classes,
    )


def _accepts_partition(workload: Workload) -> bool:
    # Checked up front rather than by catching TypeError, which would also
    # swallow a TypeError raised inside a workload that does take them.
    try:
        params = inspect.signature(workload.train_shard).parameters
    except (TypeError, ValueError):  # no signature to read (a builtin): let the call decide
        return True
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return True
    return all(
        name in params and params[name].kind is not inspect.Parameter.POSITIONAL_ONLY
        for name in _PARTITION_KEYWORDS
    )


def _histogram(workload: Workload, targets: Tensor) -> list[int]:
    # Only integer class targets have a histogram; regression workloads get [].
    if targets.ndim != 1 or targets.numel() == 0 or targets.dtype.is_floating_point or targets.dtype.is_complex:
        return []
    if targets.dtype == torch.bool or int(targets.min()) < 0:
        return []
    classes = getattr(workload, "num_classes", None)
    if not isinstance(classes, int) or classes <= int(targets.max()):
        classes = int(targets.max()) + 1
    return class_histogram(targets, None, classes)


def _log_shard(config: TrainConfig, shard: int, samples: int, histogram: list[int]) -> None:
    # A peer's data is the first thing to check when its accuracy lags under non-IID shards.
    scheme = describe(config.partition, config.partition_alpha, config.partition_classes)
    classes = ""
    if histogram:
        # Long label sets (hundreds of classes) would flood the log: show the first few.
        more = ", ..." if len(histogram) > _LOGGED_CLASSES else ""
        classes = f", classes [{', '.join(map(str, histogram[:_LOGGED_CLASSES]))}{more}]"
    log.info("shard %d/%d (%s): %d samples%s", shard, config.shards, scheme, samples, classes)


def budget_spent(config: TrainConfig, steps: int, elapsed: float) -> bool:
    """Whether the run's step or time budget is used up (0 means no such budget)."""
    return (config.max_steps > 0 and steps >= config.max_steps) or (
        config.max_seconds > 0 and elapsed >= config.max_seconds
    )
