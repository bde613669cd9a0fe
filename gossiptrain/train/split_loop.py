"""The CLI peer whose model is split across its workers: ``gossiptrain peer --nproc-per-peer N --shard-model fsdp|pipeline``.

Every rank runs this same loop (``gossiptrain.runtime.split_peer`` is what
``Peer`` makes of it). The swarm checks a split peer's layout at join, so
the model must exist, split, before joining: each rank builds the workload's
model from the run it was given (``--workload``, ``--config``: required
here) and splits it (``split_model``):

- ``fsdp``: FSDP2 over the group (``fully_shard`` on each of the model's
  ``layers``, if it has any, then on the root); each rank trains on its own
  part of the peer's shard, as DDP ranks do;
- ``pipeline``: the model's ``stage(index, stages)`` cuts it
  (``peers.charlm:transformer`` has one); GPipe over the stages
  (``PipelineSteps``), every stage on the same batches.

Rank 0 decides for the group (``Peer.agree``): whether to go on, to save a
checkpoint (every rank its piece: ``gossiptrain.runtime.piece_checkpoints``;
``--resume`` restores the newest step all ranks hold), to evaluate. An
evaluation gathers the pieces on rank 0 into an unsplit copy of the model
(``GatheredEvaluation``): the one moment a worker holds the whole model,
as ``gossiptrain export`` does. Rank 0 writes the metrics and the progress
line; the others ignore Ctrl+C and follow.
"""

from __future__ import annotations

import logging
import threading
import time
from contextlib import nullcontext
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import Tensor

from gossiptrain.errors import CheckpointError, ConfigError
from gossiptrain.protocol.pieces import PieceLayout
from gossiptrain.runtime import piece_checkpoints
from gossiptrain.runtime.peer import Peer
from gossiptrain.runtime.peer_group import PeerGroup
from gossiptrain.state.checkpoint import Checkpointer
from gossiptrain.train.evaluation import EvalResult
from gossiptrain.train.local_trainer import LocalTrainer, budget_spent, optimizer_for
from gossiptrain.train.metrics import MetricsLog
from gossiptrain.train.peer_workers import WorkerFailed, Workers, why_the_group_failed
from gossiptrain.train.progress import Progress
from gossiptrain.train.workload import Workload, load_workload

log = logging.getLogger(__name__)

SHARD_MODELS = ("fsdp", "pipeline")
#: Micro-batches a pipeline's batch is cut into (GPipe: the stages work on different ones at once).
MICROBATCHES = 2


def split_model(model: torch.nn.Module, how: str, rank: int, size: int) -> torch.nn.Module:
    """``model`` split for rank ``rank`` of ``size``: FSDP2 shards, or its pipeline stage (see the module docstring)."""
    if how == "fsdp":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (size,))
        layers = getattr(model, "layers", None)
        for layer in layers if isinstance(layers, torch.nn.ModuleList) else ():
            fully_shard(layer, mesh=mesh)
        return fully_shard(model, mesh=mesh)
    if how == "pipeline":
        stage = getattr(model, "stage", None)
        if not callable(stage):
            raise ConfigError(f"--shard-model pipeline: the workload's model ({type(model).__name__}) has no "
                              "stage(index, stages) method that cuts it into pipeline stages (peers.charlm:transformer has)")
        return stage(rank, size)
    raise ConfigError(f"--shard-model is one of {', '.join(SHARD_MODELS)}, not {how!r}")


class PipelineSteps:
    """Forward and backward of one batch through the pipeline's stages (GPipe); the batch's loss, on every rank."""

    def __init__(self, stage: torch.nn.Module, workload: Workload, rank: int, size: int, group: Any) -> None:
        from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

        def loss_fn(output: Tensor, target: Tensor) -> Tensor:  # the workload's loss of the last stage's output
            return workload.loss(lambda _: output, output, target)  # type: ignore[arg-type]

        self.rank, self.last, self.group = rank, size - 1, group
        self.schedule = ScheduleGPipe(PipelineStage(stage, rank, size, torch.device("cpu"), group=group),
                                      n_microbatches=MICROBATCHES, loss_fn=loss_fn)
        self.source = dist.get_global_rank(group, self.last)
        self._loss = torch.zeros(1)

    def __call__(self, x: Tensor, y: Tensor) -> Tensor:
        losses: list[Tensor] = []
        if self.rank == 0:
            self.schedule.step(x)
        elif self.rank == self.last:
            self.schedule.step(target=y, losses=losses)
        else:
            self.schedule.step()
        if losses:
            self._loss.fill_(float(sum(float(v) for v in losses) / len(losses)))
        dist.broadcast(self._loss, self.source, group=self.group)  # the last stage's loss, for every rank's records
        return self._loss[0].clone()


class GatheredEvaluation:
    """Every rank's piece and buffers gathered on rank 0 into an unsplit copy of the model, evaluated there (a
    collective: ``PeerGroup.whole_state``)."""

    def __init__(self, workload: Workload, seed: int, layout: PieceLayout, group: PeerGroup) -> None:
        self.workload, self.layout, self.group = workload, layout, group
        self.replica = workload.build_model(seed) if group.leader else None  # rank 0: the unsplit model, loaded each time

    def __call__(self, model: torch.nn.Module) -> EvalResult | None:
        """rank 0: the evaluation of the model the pieces make now; other ranks: None."""
        state = self.group.whole_state(model, self.layout)
        if state is None or self.replica is None:
            return None
        try:
            self.replica.load_state_dict(state)
        except RuntimeError as e:  # the pieces are not this workload's model: evaluating the replica's own would mislead
            raise ValueError(f"the gathered pieces do not fit the unsplit {type(self.replica).__name__}: {e}") from None
        return self.workload.evaluate(self.replica)


def run_split_peer(options: Any, workers: Workers, group: Any, stop: threading.Event | None = None,
                   on_training: Callable[[], None] | None = None) -> dict[str, Any]:
    """Join as one rank of a split peer, train until the budget or ``stop`` (rank 0's), leave; rank 0's summary."""
    stop = stop or threading.Event()
    how = options.shard_model
    if options.expect is None:
        raise ConfigError("--shard-model builds and splits the model before joining: name the run's workload "
                          "(--workload NAME, or --config FILE)")
    unbuilt = [flag for flag, given in (("--tensorboard", options.tensorboard), ("--prometheus", options.prometheus),
                                         ("--slowdown", options.slowdown > 1)) if given]
    if unbuilt:
        raise ConfigError(f"{', '.join(unbuilt)} with --shard-model: not built for split peers yet (--metrics is)")
    if options.expect.data.mode == "leased":
        raise ConfigError("data.mode = leased with --shard-model: not built for split peers yet (each peer trains its shard)")
    config = options.expect
    workload = load_workload(config.train.workload)
    torch.manual_seed(config.train.seed)  # every peer starts from the same point
    model = split_model(workload.build_model(config.train.seed), how, workers.rank, workers.size)
    optimizer = optimizer_for(workload, config.train, model)
    leader = workers.rank == 0
    progress = Progress(enabled=options.progress and leader)
    try:
        with (MetricsLog(options.metrics) if leader else nullcontext()) as metrics, Peer(
            model, join=options.join, bind=options.bind, advertise=options.advertise, config=config, shard=options.shard,
            join_attempts=options.join_attempts, security=options.security, group=group, optimizer=optimizer,
            reachable=options.reachable, relay=options.relay, transfer_state=options.resume is None,
        ) as peer:
            if on_training:
                on_training()
            return _train(peer, workload, model, optimizer, options, workers, metrics, progress, stop)
    except RuntimeError as e:  # a collective failed: a worker is gone
        raise WorkerFailed(f"a worker of peer (rank {workers.rank} of {workers.size}) is gone or failed "
                           f"({why_the_group_failed(e)}); this peer left the swarm") from None


def _train(peer: Peer, workload: Workload, model: torch.nn.Module, optimizer: torch.optim.Optimizer, options: Any,
           workers: Workers, metrics: Any, progress: Progress, stop: threading.Event) -> dict[str, Any]:
    group = PeerGroup(workers.init_group())
    cfg = peer.config.train
    layout: PieceLayout = peer.layout  # type: ignore[attr-defined]
    fsdp = layout.kind == "fsdp"
    pipeline = PipelineSteps(model, workload, workers.rank, workers.size, group.group) if not fsdp else None
    trainer = LocalTrainer(workload, model, cfg, peer.shard, optimizer=optimizer,
                           worker=(workers.rank, workers.size) if fsdp else (0, 1), pipeline=pipeline)
    per_sample = workers.size if fsdp else 1  # FSDP ranks train on batches of their own; stages on the same ones
    evaluate = GatheredEvaluation(workload, cfg.seed, layout, group)
    checkpointer = Checkpointer(
        piece_checkpoints.rank_directory(options.checkpoint_dir, workers.rank), keep=options.checkpoint_keep,
        every_seconds=options.checkpoint_every_seconds, every_steps=options.checkpoint_every_steps,
    ) if options.checkpoint_dir is not None else None
    resumed = {}
    if options.resume is not None:
        step = piece_checkpoints.resume(group, options.resume, model, optimizer, layout,
                                        fingerprint=None if options.resume_any_run else peer.fingerprint)
        peer.resume_at(step)
        trainer.continue_from(step)
        resumed = {"resumed_from": str(options.resume), "resumed_step": step}
    if options.wait_for and peer.wait_for_peers(options.wait_for, stop=stop if workers.rank == 0 else None) < options.wait_for:
        return {"event": "stopped", "peer": peer.id, "step": 0}
    base = {"peer": peer.id, "shard": peer.shard, "address": peer.address, "layout": layout.kind, "ranks": layout.ranks}
    started = time.monotonic()

    def record(event: str, **extra: Any) -> dict[str, Any]:
        """Evaluate (every rank), and on rank 0 write one record and update the progress line."""
        result = evaluate(model)
        if result is None:
            return {}
        stats = peer.stats()
        rec = {"event": event, "time": time.time(), "elapsed": round(time.monotonic() - started, 3), **base,
               "step": peer.steps, "samples_seen": trainer.samples_seen * per_sample, "loss": trainer.loss_avg,
               "test_loss": result.loss, "test_acc": result.accuracy, **result.extras(), "members": stats["members"],
               "exchanges": stats["completed"] + stats["served"], "aborted": stats.get("piece_aborted", 0),
               "bytes_sent": stats.get("bytes_sent", 0), "bytes_received": stats.get("bytes_received", 0), **extra}
        metrics.write(rec)
        peer.report(loss=trainer.loss_avg, test_loss=result.loss, test_acc=result.accuracy)
        progress.update(f"peer {peer.id} ({layout.kind} x {layout.ranks}) | step {peer.steps} | loss {trainer.loss_avg:.3f} "
                        f"| acc {result.accuracy:.3f} | peers {stats['members']}")
        return rec

    record("start", **resumed, **peer.transfer_summary())
    next_eval = time.monotonic() + cfg.eval_every_seconds
    saved = 0
    while peer.agree(not stop.is_set() and not peer.finish_requested and not budget_spent(cfg, peer.steps, time.monotonic() - started)):
        trainer.step()
        peer.step(samples_seen=trainer.samples_seen * per_sample)
        if peer.agree(checkpointer is not None and checkpointer.due(peer.steps)):
            saved += _save(checkpointer, peer, trainer, layout, workers.rank, per_sample)
        if peer.agree(time.monotonic() >= next_eval):
            record("eval")
            next_eval = time.monotonic() + cfg.eval_every_seconds
    reason = "signal" if stop.is_set() else "stop" if peer.finish_requested else "budget"
    progress.update(f"peer {peer.id}: step {peer.steps}, final phase ({reason})")
    # rank 0 writes this peer's model, every rank's piece gathered (SplitPeer.finish)
    final = peer.finish(reason, final_model=options.final_model if workers.rank == 0 else None,
                        abort=stop.is_set).to_record()
    if checkpointer is not None:
        saved += _save(checkpointer, peer, trainer, layout, workers.rank, per_sample)
    summary = record("done", **final, checkpoints=saved)
    if summary:
        progress.finish(f"peer {peer.id} done: {summary['step']} steps in {summary['elapsed']:.1f} s, "
                        f"test accuracy {summary['test_acc']:.3f}, {summary['exchanges']} exchanges")
    return summary or {"event": "worker-done", "peer": peer.id, "worker": workers.rank, "step": peer.steps}


def _save(checkpointer: Checkpointer, peer: Peer, trainer: LocalTrainer, layout: PieceLayout, rank: int,
          per_sample: int) -> int:
    """This rank's piece and optimizer state (every rank at the same step: rank 0 said when); 1 if saved."""
    try:
        checkpointer.save(trainer.model, trainer.opt, step=peer.steps, samples_seen=trainer.samples_seen * per_sample,
                          fingerprint=peer.fingerprint, peer=peer.id, shard=peer.shard, run=peer.config.to_dict(),
                          piece=piece_checkpoints.piece_info(layout, rank))
    except CheckpointError as e:  # training goes on; resume takes the newest step every rank saved
        log.error("checkpoint at step %d failed on rank %d (training goes on): %s", peer.steps, rank, e)
        return 0
    return 1
