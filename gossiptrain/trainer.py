"""The training loop of a CLI peer: a workload's model, trained on its shard, averaged by gossip.

``run_peer`` joins, builds the model the swarm's configuration names, trains
until the budget (steps or seconds) is spent or ``stop`` is set, evaluates
on the workload's held-out test set every ``train.eval_every_seconds``, and
writes progress to the terminal and metrics as JSON lines. It returns the
final summary. Everything about the network lives in ``Peer``.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from .config import RunConfig
from .errors import ConfigError
from .metrics import MetricsLog
from .peer import Peer
from .progress import Progress
from .local_training import LocalTrainer, budget_spent
from .workload import Workload, load_workload

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PeerOptions:
    """Local settings of one peer process (the run's settings come from the swarm)."""

    join: str  # HOST:PORT of the coordinator or any live peer
    bind: str | None = None  # HOST:PORT to listen on (default: the advertised host, port 0)
    advertise: str | None = None  # host others use to reach us (default: the route to the join host)
    metrics: str | Path | None = None  # JSON-lines file
    expect: RunConfig | None = None  # refuse to join a swarm running anything else
    shard: int | None = None  # ask for this shard instead of the least trained one
    join_attempts: int | None = None  # default: membership.join_attempts
    slowdown: float = 1.0  # >1 makes this peer a straggler: it idles (slowdown-1) x each step's compute time
    threads: int = 1  # torch intra-op threads: one per peer keeps several peers per machine fair
    progress: bool = True

    def __post_init__(self) -> None:
        if not self.slowdown >= 1:
            raise ConfigError(f"--slowdown is a slowdown factor and must be >= 1, got {self.slowdown}")
        if self.threads < 1:
            raise ConfigError(f"--threads must be >= 1, got {self.threads}")


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
    workloads: dict[str, Workload] = {}

    def build(config: RunConfig, shard: int) -> torch.nn.Module:
        workloads["w"] = load_workload(config.train.workload)
        torch.manual_seed(config.train.seed)  # every peer starts from the same point
        return workloads["w"].build_model(config.train.seed)

    progress = Progress(enabled=options.progress)
    with MetricsLog(options.metrics) as metrics, Peer(
        build, join=options.join, bind=options.bind, advertise=options.advertise, config=options.expect, shard=options.shard,
        join_attempts=options.join_attempts,
    ) as peer:
        workload = workloads["w"]
        if on_training:
            on_training()
        return _train(peer, workload, metrics, progress, stop, options.slowdown)


def _train(
    peer: Peer, workload: Workload, metrics: MetricsLog, progress: Progress, stop: threading.Event, slowdown: float
) -> dict[str, Any]:
    cfg = peer.config.train
    trainer = LocalTrainer(workload, peer.model, cfg, peer.shard)
    base = {"peer": peer.id, "shard": peer.shard, "address": peer.address}
    metrics.write({"event": "start", "time": time.time(), **base, "samples": trainer.samples, "fingerprint": peer.fingerprint})
    started = time.monotonic()
    next_eval = started + cfg.eval_every_seconds
    rate = _Rate()

    def record(event: str) -> dict[str, Any]:
        now = time.monotonic()
        result = trainer.evaluate()
        stats = peer.stats()
        exchanges = stats["completed"] + stats["served"]
        rec = {
            "event": event,
            "time": time.time(),
            "elapsed": round(now - started, 3),
            **base,
            "step": peer.steps,
            "loss": trainer.loss_avg,
            "test_loss": result.loss,
            "test_acc": result.accuracy,
            "precision": result.precision,
            "recall": result.recall,
            "f1": result.f1,
            "members": stats["members"],
            "exchanges": exchanges,
            "exchanges_per_s": round(rate.update(now, exchanges), 2),
            "timeouts": stats["timeouts"],
            "staleness_mean": round(stats["staleness_mean"], 3),
            "rtt_ms": round(stats["rtt_ms"], 2),
            "bytes_sent": stats["bytes_sent"],
            "bytes_received": stats["bytes_received"],
            "dropped": stats["bad_messages"] + stats["wrong_run"] + stats["rejected"],
            "handshake_failures": stats["handshake_failures"],
            "members_dead": stats["members_dead"],
            "members_left": stats["members_left"],
        }
        metrics.write(rec)
        progress.update(
            f"peer {peer.id} shard {peer.shard}/{cfg.shards} | step {peer.steps} | loss {trainer.loss_avg:.3f} | "
            f"acc {result.accuracy:.3f} | peers {stats['members']} | {rec['exchanges_per_s']:.1f} ex/s"
        )
        return rec

    while not stop.is_set() and not budget_spent(cfg, peer.steps, time.monotonic() - started):
        computed = time.perf_counter()
        trainer.step()
        if slowdown > 1:  # an emulated slow machine: idle, so the others keep the CPU
            time.sleep((slowdown - 1) * (time.perf_counter() - computed))
        peer.step()
        if time.monotonic() >= next_eval:
            record("eval")
            next_eval = time.monotonic() + cfg.eval_every_seconds
    summary = record("done")
    progress.finish(
        f"peer {peer.id} done: {summary['step']} steps in {summary['elapsed']:.1f} s, "
        f"test accuracy {summary['test_acc']:.3f}, {summary['exchanges']} exchanges"
    )
    return summary
