"""The training loop of a CLI peer: a workload's model, trained on its shard, averaged by gossip.

``run_peer`` joins, builds the model the swarm's configuration names, trains
until the budget (steps or seconds) is spent or ``stop`` is set, evaluates
on the workload's held-out test set every ``train.eval_every_seconds``, and
writes progress to the terminal and metrics as JSON lines. It returns the
final summary. Everything about the network lives in ``Peer``.

With a checkpoint directory it saves a checkpoint every so often at a step
boundary and once at the end; with ``resume`` it starts from the newest
intact checkpoint there (model, optimizer, step count, and its shard unless
another is asked for). See ``gossiptrain.state.checkpoint``.

The checkpoint directory, the resume directory, the final model and the
metrics file may be URLs (``s3://``, ``gs://``, ...; see
``gossiptrain.state.storage``); ``PeerOptions`` checks their schemes and
backends when it is made, before the peer joins.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from contextlib import ExitStack, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from gossiptrain.config import RunConfig, SecurityConfig
from gossiptrain.errors import CheckpointError, ConfigError
from gossiptrain.runtime.peer import Peer
from gossiptrain.runtime.peer_network import MEMBER_EVENTS
from gossiptrain.state import storage
from gossiptrain.state.checkpoint import Checkpoint, Checkpointer, latest_good, list_checkpoints, restore
from gossiptrain.train.local_trainer import LocalTrainer, budget_spent, optimizer_for
from gossiptrain.train.metrics import MetricsLog, RecordSink, Tee
from gossiptrain.train.peer_workers import WorkerFailed, Workers, why_the_group_failed
from gossiptrain.train.split_loop import SHARD_MODELS, run_split_peer
from gossiptrain.train.progress import Progress
from gossiptrain.train.prometheus import PrometheusExporter, parse_listen
from gossiptrain.train.tensorboard import TensorBoardLog
from gossiptrain.train.workload import Workload, load_workload

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PeerOptions:
    """Local settings of one peer process (the run's settings come from the swarm)."""

    join: str  # HOST:PORT of the coordinator or any live peer
    bind: str | None = None  # HOST:PORT to listen on (default: the advertised host, port 0)
    advertise: str | None = None  # host others use to reach us (default: the route to the join host)
    metrics: str | Path | None = None  # JSON-lines file (or URL)
    tensorboard: str | Path | None = None  # TensorBoard runs: DIR/<peer id>
    prometheus: str | None = None  # serve /metrics at [HOST:]PORT (host 127.0.0.1 unless given)
    expect: RunConfig | None = None  # refuse to join a swarm running anything else
    shard: int | None = None  # ask for this shard instead of the least trained one
    join_attempts: int | None = None  # default: membership.join_attempts
    slowdown: float = 1.0  # >1 makes this peer a straggler: it idles (slowdown-1) x each step's compute time
    threads: int = 1  # torch intra-op threads: one per peer keeps several peers per machine fair
    wait_for: int = 0  # do not train until this many members (us included) are ready to train; 0: start at once
    progress: bool = True
    checkpoint_dir: str | Path | None = None  # save checkpoints here (periodically and at the end); a path or URL
    checkpoint_every_seconds: float = 60.0  # 0: no time-based saves
    checkpoint_every_steps: int = 0  # 0: no step-based saves
    checkpoint_keep: int = 3  # complete checkpoints kept; older ones are deleted once a newer one is complete
    resume: str | Path | None = None  # start from the newest intact checkpoint in this directory (or URL)
    resume_any_run: bool = False  # accept a checkpoint of another run (its tensors must still fit the model)
    security: SecurityConfig | None = None  # --secure: CURVE keys and allow-list (see SECURITY.md)
    final_model: str | Path | None = None  # at the end of the run, write the swarm's merged model here (or URL)
    workers: Workers | None = None  # one of several worker processes of this peer (--nproc-per-peer, torchrun)
    reachable: str | None = None  # --reachable auto|yes|no (None: Peer's default, $GOSSIPTRAIN_REACHABLE or auto)
    relay: bool = False  # --relay: pass messages between peers behind NAT (if we are reachable)
    shard_model: str | None = None  # --shard-model fsdp|pipeline: the model split across the workers (split_loop)

    def __post_init__(self) -> None:
        if not self.slowdown >= 1:
            raise ConfigError(f"--slowdown is a slowdown factor and must be >= 1, got {self.slowdown}")
        if self.threads < 1:
            raise ConfigError(f"--threads must be >= 1, got {self.threads}")
        if self.wait_for < 0:
            raise ConfigError(f"--wait-for is a member count and must be >= 0, got {self.wait_for}")
        if not 0 <= self.checkpoint_every_seconds < float("inf"):
            raise ConfigError(f"--checkpoint-every must be a number of seconds >= 0, got {self.checkpoint_every_seconds}")
        if self.checkpoint_every_steps < 0:
            raise ConfigError(f"--checkpoint-every-steps must be >= 0, got {self.checkpoint_every_steps}")
        if self.checkpoint_keep < 1:
            raise ConfigError(f"--checkpoint-keep must be >= 1, got {self.checkpoint_keep}")
        if self.shard_model is not None and self.shard_model not in SHARD_MODELS:
            raise ConfigError(f"--shard-model is one of {', '.join(SHARD_MODELS)}, not {self.shard_model!r}")
        if self.resume_any_run and self.resume is None:
            raise ConfigError("--resume-any-run needs --resume DIR")
        # A URL fsspec cannot serve fails now, not at the first checkpoint or at the end of the run.
        for flag, value in (("--checkpoint-dir", self.checkpoint_dir), ("--resume", self.resume),
                            ("--final-model", self.final_model), ("--metrics", self.metrics)):
            storage.check_location(value, flag)


class _Rate:
    """Events per second over the last window, for the live exchange rate."""

    def __init__(self) -> None:
        self._last: tuple[float, int] | None = None
        self.value = 0.0

    def update(self, now: float, count: int) -> float:
        if self._last is not None and now > self._last[0]:
            self.value = (count - self._last[1]) / (now - self._last[0])
        self._last = (now, count)
        return self.value


def run_peer(
    options: PeerOptions, stop: threading.Event | None = None, on_training: Callable[[], None] | None = None
) -> dict[str, Any]:
    """Join, train until the budget or ``stop``, leave; return the final summary record.

    ``on_training`` is called once joined: until then an interrupt should abort
    the join, afterwards it should stop training gracefully.
    """
    stop = stop or threading.Event()
    torch.set_num_threads(options.threads)
    workers = options.workers
    if options.shard_model is not None and workers is None:
        raise ConfigError("--shard-model splits the model across a peer's workers: give it several "
                          "(--nproc-per-peer N, N >= 2, or torchrun)")
    group = workers.init_group() if workers is not None else None
    if options.shard_model is not None and workers is not None:  # every rank the same loop (gossiptrain.train.split_loop)
        return run_split_peer(options, workers, group, stop, on_training)
    if workers is not None and workers.rank > 0:
        return _run_worker(options, workers, group)
    workloads: dict[str, Workload] = {}
    # Both before joining: a missing checkpoint or an unusable directory fails without touching the swarm.
    resume = latest_good(options.resume) if options.resume is not None else None
    shard = options.shard if options.shard is not None or resume is None else resume.info.shard

    def build(config: RunConfig, shard: int) -> torch.nn.Module:
        workloads["w"] = load_workload(config.train.workload)
        torch.manual_seed(config.train.seed)  # every peer starts from the same point
        model = workloads["w"].build_model(config.train.seed)
        if resume is not None:  # before averaging sees the model: it starts from the restored parameters
            restore(resume, model, fingerprint=config.fingerprint(), run=config.to_dict(), allow_other_run=options.resume_any_run)
        return model

    progress = Progress(enabled=options.progress)
    checkpointer = (
        Checkpointer(
            options.checkpoint_dir, keep=options.checkpoint_keep, every_seconds=options.checkpoint_every_seconds,
            every_steps=options.checkpoint_every_steps,
        )
        if options.checkpoint_dir is not None
        else None
    )
    with checkpointer or nullcontext(), MetricsLog(options.metrics) as metrics, Peer(
        build, join=options.join, bind=options.bind, advertise=options.advertise, config=options.expect, shard=shard,
        join_attempts=options.join_attempts, security=options.security,
        transfer_state=resume is None,  # a checkpoint asked for on purpose is not overwritten by a download
        optimizer=lambda config, model: optimizer_for(workloads["w"], config.train, model), group=group, reachable=options.reachable,
        relay=options.relay,
    ) as peer:
        workload = workloads["w"]
        if peer.taken_from_swarm:  # the run fields we did not set, as the swarm runs them
            print(f"peer {peer.id}: from the swarm: {', '.join(peer.taken_from_swarm)}", file=sys.stderr, flush=True)
        if on_training:
            on_training()
        # Log lines above the live line, never on it; and a line for each member that joins, leaves or dies.
        with progress.logs_above(MEMBER_EVENTS, accept=lambda record: getattr(record, "peer_id", None) == peer.id):
            if options.wait_for and not _wait_for_members(peer, options.wait_for, stop, progress, serve=resume is None):
                return {"event": "stopped", "peer": peer.id, "step": 0}
            with ExitStack() as stack:
                sinks: list[RecordSink] = [metrics]
                if options.tensorboard is not None:
                    sinks.append(stack.enter_context(TensorBoardLog(Path(options.tensorboard) / peer.id)))
                if options.prometheus is not None:
                    exporter = stack.enter_context(PrometheusExporter(*parse_listen(options.prometheus)))
                    print(f"peer {peer.id}: Prometheus metrics at {exporter.url}", file=sys.stderr, flush=True)
                    sinks.append(exporter)
                return _train(
                    peer, workload, Tee(*sinks), progress, stop, options.slowdown, checkpointer=checkpointer,
                    resume=resume, resume_any_run=options.resume_any_run, final_model=options.final_model,
                    workers=workers, group=group,
                )


def _run_worker(options: PeerOptions, workers: Workers, group: Any) -> dict[str, Any]:
    """Rank > 0 of a peer made of several workers: train with DDP beside rank 0, follow its decisions and model."""
    workloads: dict[str, Workload] = {}

    def build(config: RunConfig, shard: int) -> torch.nn.Module:
        workloads["w"] = load_workload(config.train.workload)
        torch.manual_seed(config.train.seed)
        return workloads["w"].build_model(config.train.seed)  # rank 0's parameters come with the first sync

    with Peer(build, join=options.join, group=group, optimizer=lambda config, model: optimizer_for(workloads["w"], config.train, model)) as peer:
        cfg = peer.config.train
        try:  # the same collectives in the same order as rank 0's run_peer and _train
            if options.wait_for and peer.wait_for_peers(options.wait_for) < options.wait_for:
                return {"event": "stopped", "peer": peer.id, "worker": workers.rank, "step": 0}  # as rank 0 did
            trainer = LocalTrainer(workloads["w"], peer.model, cfg, peer.shard, optimizer=peer.optimizer,
                                   worker=(workers.rank, workers.size), forward=_data_parallel(peer.model, group))
            while peer.agree(False):
                trainer.step()
                peer.step(samples_seen=trainer.samples_seen * workers.size)
            peer.finish("budget")
        except RuntimeError as e:  # a collective failed: rank 0 (or another worker) is gone
            raise WorkerFailed(f"worker {workers.rank} of peer {peer.id}: its group failed ({why_the_group_failed(e)})") from None
    return {"event": "worker-done", "peer": peer.id, "worker": workers.rank, "step": peer.steps}


def _data_parallel(model: torch.nn.Module, group: Any) -> torch.nn.Module:
    """``model`` under DDP in ``group``: what the workers' forward and backward go through (gradients averaged)."""
    from torch.nn.parallel import DistributedDataParallel

    return DistributedDataParallel(model, process_group=group)


def _wait_for_members(peer: Peer, count: int, stop: threading.Event, progress: Progress, *, serve: bool) -> bool:
    """A rendezvous (``Peer.wait_for_peers``), with the progress line; False if stopped first.

    ``serve``: answer partners' exchanges meanwhile, unless a checkpoint is still to be loaded.
    """
    def show(ready: int) -> None:
        progress.update(f"peer {peer.id}: waiting for {count} members ready to train, {ready} so far")

    return peer.wait_for_peers(count, stop=stop, serve=serve, on_wait=show) >= count


def _train(
    peer: Peer, workload: Workload, metrics: RecordSink, progress: Progress, stop: threading.Event, slowdown: float,
    *, checkpointer: Checkpointer | None = None, resume: Checkpoint | None = None, resume_any_run: bool = False,
    final_model: str | Path | None = None, workers: Workers | None = None, group: Any = None,
) -> dict[str, Any]:
    """The training loop: a local step, the peer's safe point, checkpoints and evaluations when due; then the end.

    With ``workers`` this is rank 0 of a peer made of several: the same loop,
    with DDP under the local step, the loop's decisions taken for the whole
    group (``peer.agree``), and a failed worker turned into ``WorkerFailed``
    once this peer has left the swarm.
    """
    cfg = peer.config.train
    size = workers.size if workers is not None else 1
    forward = _data_parallel(peer.model, group) if group is not None else None
    leases = (lambda n: peer.leases(n)) if peer.config.data.mode == "leased" else None
    trainer = LocalTrainer(workload, peer.model, cfg, peer.shard, optimizer=peer.optimizer, worker=(0, size), forward=forward,
                           leases=leases)
    resumed = _resume(peer, trainer, resume, resume_any_run) if resume is not None else {}
    report = _Report(peer, trainer, metrics, progress, checkpointer, resumed)
    next_eval = report.started + cfg.eval_every_seconds
    try:
        while peer.agree(not stop.is_set() and not peer.finish_requested and not budget_spent(cfg, peer.steps, report.elapsed())):
            computed = time.perf_counter()
            if trainer.step() is None:  # leased data: nothing to claim now (the window is full of others' claims)
                peer.wait_for_data()
                continue
            if slowdown > 1:  # an emulated slow machine: idle, so the others keep the CPU
                time.sleep((slowdown - 1) * (time.perf_counter() - computed))
            peer.step(samples_seen=trainer.samples_seen * size)  # apply finished exchanges, answer requests, start the next
            if checkpointer is not None and checkpointer.due(peer.steps):
                report.save_checkpoint()
            if time.monotonic() >= next_eval:
                report.record("eval")
                next_eval = time.monotonic() + cfg.eval_every_seconds
        final: dict[str, Any] = {"finish": "signal"}
        if not stop.is_set():  # the budget is spent, or the swarm was asked to stop: the final phase (gossiptrain.protocol.finish)
            reason = "stop" if peer.finish_requested else "budget"
            progress.update(f"peer {peer.id}: step {peer.steps}, final phase ({reason})")
            final = peer.finish(reason, final_model=final_model, abort=stop.is_set).to_record()
        elif workers is not None:
            peer.finish("signal", abort=lambda: True)  # the other workers wait for the group's last sync
    except RuntimeError as e:
        if workers is None:
            raise
        raise WorkerFailed(f"a worker of peer {peer.id} is gone ({why_the_group_failed(e)}); this peer left the swarm") from None
    if checkpointer is not None and (report.checkpoint_step != peer.steps or final.get("final_rounds")):
        report.save_checkpoint()  # the final state (after the final phase's averaging), also when stopped by a signal
    if checkpointer is not None:
        final["checkpoint"] = report.newest_checkpoint()
    summary = report.record("done", **final)
    progress.finish(
        f"peer {peer.id} done: {summary['step']} steps in {summary['elapsed']:.1f} s, "
        f"test accuracy {summary['test_acc']:.3f}, {summary['exchanges']} exchanges{report.checkpoint_line(summary)}"
    )
    return summary


def _resume(peer: Peer, trainer: LocalTrainer, resume: Checkpoint, resume_any_run: bool) -> dict[str, Any]:
    """Load a checkpoint into the trainer and the peer's step count; the fields the start record gets."""
    trainer.load_state(resume, fingerprint=peer.fingerprint, run=peer.config.to_dict(), allow_other_run=resume_any_run)
    peer.resume_at(trainer.steps)
    peer.restore_averaging(resume.info.averaging)  # push-sum: the weight it had, so it rejoins with its own mass
    if trainer.leased is not None and resume.info.data is not None:  # the chunks it held, from where they were
        if not trainer.leased.client.resume(resume.info.data):
            log.warning("not taking back the checkpoint's chunks: it leased another dataset (plan %s, now %s)",
                        resume.info.data["plan"], trainer.leased.client.plan.to_wire())
    elif resume.info.shard != peer.shard and trainer.leased is None:
        log.warning("resuming a checkpoint of shard %d on shard %d (the swarm assigned it)", resume.info.shard, peer.shard)
    log.info("resumed from %s at step %d", resume.info.path, resume.info.step)
    return {"resumed_from": str(resume.info.path), "resumed_step": resume.info.step,
            "resumed_averaging": peer.averaging_state()}  # as the machine holds it now


class _Report:
    """What the loop writes: the start record, evaluations, checkpoints (counted), the live progress line."""

    def __init__(
        self, peer: Peer, trainer: LocalTrainer, metrics: RecordSink, progress: Progress,
        checkpointer: Checkpointer | None, resumed: dict[str, Any],
    ) -> None:
        self.peer, self.trainer, self.metrics, self.progress, self.checkpointer = peer, trainer, metrics, progress, checkpointer
        self.base = {"peer": peer.id, "shard": peer.shard, "address": peer.address}
        self.saved = self.failed = 0
        self.checkpoint_step = -1
        self.rate = _Rate()
        # What this peer starts from (the downloaded state, a checkpoint, or the initial weights), before any exchange.
        initial = trainer.evaluate()
        metrics.write({
            "event": "start", "time": time.time(), **self.base, "samples": trainer.samples, "fingerprint": peer.fingerprint,
            "step": peer.steps, "samples_seen": trainer.samples_seen, "test_acc": initial.accuracy, **resumed,
            **peer.transfer_summary(),
        })
        self.started = time.monotonic()

    def elapsed(self) -> float:
        return time.monotonic() - self.started

    def save_checkpoint(self) -> None:
        """Save now, synchronously, at a step boundary: nothing else touches the model (digits MLP: ~50 ms)."""
        assert self.checkpointer is not None
        peer, trainer = self.peer, self.trainer
        began = time.perf_counter()
        try:
            info = self.checkpointer.save(
                trainer.model, trainer.opt, step=peer.steps, samples_seen=trainer.samples_seen, fingerprint=peer.fingerprint,
                peer=peer.id, shard=peer.shard, run=peer.config.to_dict(), averaging=peer.averaging_state(),
                data=trainer.leased.client.position() if trainer.leased is not None else None,
            )
        except CheckpointError as e:  # keep training: a full disk should not end the run, but say so loudly
            self.failed += 1  # once per save due (the checkpointer tries again at the next one, not at every step)
            log.error("checkpoint at step %d failed (training goes on; the next scheduled checkpoint tries again): %s", peer.steps, e)
            return
        self.saved += 1
        self.checkpoint_step = peer.steps
        self.metrics.write({
            "event": "checkpoint", "time": time.time(), **self.base, "step": info.step, "samples_seen": info.samples_seen,
            "path": str(info.path), "seconds": round(time.perf_counter() - began, 4),
        })

    def newest_checkpoint(self) -> str | None:
        """The newest complete checkpoint in the directory: this run's last good save, else one from before; None: none."""
        assert self.checkpointer is not None
        if self.checkpointer.last_saved is not None:
            return str(self.checkpointer.last_saved)
        try:
            found = list_checkpoints(self.checkpointer.directory)
        except CheckpointError:
            return None
        return str(found[0]) if found else None

    def checkpoint_line(self, summary: dict[str, Any]) -> str:
        """For the summary line: the newest checkpoint, and how many saves failed if any."""
        if self.checkpointer is None:
            return ""
        failed = f" ({self.failed} checkpoint saves failed)" if self.failed else ""
        return f", newest checkpoint {summary['checkpoint'] or 'none'}{failed}"

    def record(self, event: str, **extra: Any) -> dict[str, Any]:
        """Evaluate, write one metrics record and update the progress line; the record."""
        peer, trainer = self.peer, self.trainer
        now = time.monotonic()
        result = trainer.evaluate()
        stats = peer.stats()
        exchanges = stats["completed"] + stats["served"]
        rec = {
            "event": event,
            "time": time.time(),
            "elapsed": round(now - self.started, 3),
            **self.base,
            "step": peer.steps,
            "loss": trainer.loss_avg,
            "test_loss": result.loss,
            "test_acc": result.accuracy,
            "precision": result.precision,
            "recall": result.recall,
            "f1": result.f1,
            **result.extras(),
            "members": stats["members"],
            "exchanges": exchanges,
            "exchanges_per_s": round(self.rate.update(now, exchanges), 2),
            "timeouts": stats["timeouts"],
            "presumed_lost": stats["presumed_lost"],  # pairwise: replies far later than usual, not waited for
            "in_flight_most": stats["in_flight_most"],  # pairwise: most exchanges in flight at once (far links)
            "refused": stats["refused"],  # our requests the partner turned down (busy with its own)
            "declined": stats["crossed"] + stats["busy"],  # requests we turned down
            "staleness_mean": round(stats["staleness_mean"], 3),
            "staleness_hist": stats["staleness_hist"],
            "rtt_ms": round(stats["rtt_ms"], 2),
            "rtt_hist": stats["rtt_hist"],  # round trips by bucket: upper bound in seconds -> count
            "waited_s": round(stats["waited_s"], 3),  # flow control: the loop waited for the link
            "compression_level": stats["compression_level"],  # compression auto: 0 none, 1 fp16, 2 int8
            # The stability guard (gossiptrain.protocol.stability): added methods off now, and non-finite models restored
            "guard_backed_off": stats.get("guard_backed_off", 0),
            "guard_restores": stats.get("guard_restores", 0),
            "bytes_sent": stats["bytes_sent"],
            "bytes_received": stats["bytes_received"],
            "dropped": stats["bad_messages"] + stats["wrong_run"] + stats["rejected"],
            "handshake_failures": stats["handshake_failures"],
            # Behind NAT (a client-mode member) everything comes back over connections it opened: the two are equal.
            "messages_received": stats["messages_received"],
            "received_over_own": stats["received_over_own"],
            "sent_over_routes": stats["sent_over_routes"],  # to client-mode members, over the connections they opened
            "received_relayed": stats["received_relayed"],  # from another client-mode member, through a relay
            "relayed": stats["relayed"],  # as a relay (--relay): messages passed between client-mode members
            "relay_dropped": stats["relay_dropped"],  # ...and not passed on (no route, over the budget, not relaying)
            "members_dead": stats["members_dead"],
            "suspicions": stats["suspicions"],  # members we came to suspect: each refuted, or then dead
            "members_left": stats["members_left"],
            # membership gossip not believed: made-up or unanswering members, redirections, far jumps, verdicts
            "gossip_refused": stats["gossip_refused"],
        }
        if "lease_epoch" in stats:  # leased data (gossiptrain.protocol.leases): the swarm's epoch, what we trained
            rec.update({k: stats[k] for k in ("lease_epoch", "lease_epoch_chunks_done", "lease_epoch_chunks", "chunks_done",
                                              "chunks_taken_over", "chunks_resumed", "claims_lost", "samples_trained_twice", "lease_waits")})
        if self.checkpointer is not None:
            rec.update(checkpoints=self.saved, checkpoint_failures=self.failed)
        rec.update(extra)
        self.metrics.write(rec)
        peer.report(loss=trainer.loss_avg, test_loss=result.loss, test_acc=result.accuracy)  # for `gossiptrain status`
        self.progress.update(
            f"peer {peer.id} shard {peer.shard}/{peer.config.train.shards} | step {peer.steps} | "
            f"loss {trainer.loss_avg:.3f} | acc {result.accuracy:.3f} | peers {stats['members']} | "
            f"{rec['exchanges_per_s']:.1f} ex/s"
        )
        return rec
