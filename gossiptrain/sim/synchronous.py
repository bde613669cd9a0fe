"""Synchronous baselines in the simulator: DDP and a parameter server (sync and async), in virtual time.

The question the simulator answers for gossip ("how would this run on n
machines, each with its own accelerator?") has to be answered for the
systems gossip is compared with, on the same footing. So these run the same
real torch steps on the same shards and batch streams as simulated gossip
peers (``LocalTrainer``'s), with the same compute model
(``gossiptrain.sim.compute``: step time, stragglers, noise, shared cores)
and the same link model (``LinkProfile``, costed by
``gossiptrain.sim.collectives``). No network is simulated message by
message: a synchronous step's communication has a closed form.

- ``ddp``: every step each worker computes the gradient of its own batch on
  the one model all workers share; the gradients are averaged (divided by
  n and summed, as DDP's reducer does) and one optimizer step is taken. The
  step ends when the slowest worker's gradient is ready plus a ring
  all-reduce of the gradients (``allreduce``: ring by default, or recursive
  halving-doubling, or the faster of the two). (Real DDP overlaps the all-reduce with the
  backward pass bucket by bucket; this charges it after, which is exact
  when compute is short against the link and pessimistic by at most the
  backward pass otherwise.) On shared cores (``cores``) the compute phase
  lasts at least all the workers' computation over the cores, while a
  straggler's extra time is idling (``lockstep_compute_seconds``). Rank 0
  evaluates every ``train.eval_every_seconds`` and the others wait
  (``eval_time``).
- ``ps-sync``: each round the server sends the parameters to every worker
  (queued on its link), each computes a gradient and sends it back (queued
  again); the server averages them and steps: DDP's update, a star's cost.
- ``ps-async``: the server applies each gradient as it arrives (its
  optimizer at ``lr / n``: the same step per sample as the sync server)
  and sends the new parameters back to that worker only; gradients are
  computed on the parameters the worker last received (stale by however
  many updates others made meanwhile), as experiments/baselines does it.

**Crashes.** A synchronous job cannot step without every worker: a crash
(``churn_rate``/``churn_trace``) costs ``restart_cost`` virtual seconds
(DDP waits for its timeout, the job is restarted with a replacement and
reloads its checkpoint) and rolls the model back to the last checkpoint,
taken every ``checkpoint_every`` virtual seconds (0: after every step, the
most favourable to DDP). Crashes during a restart are absorbed by it. The
asynchronous server does not wait: a crashed worker's gradient in flight is
lost and it rejoins after ``churn_downtime``; the server never crashes.

Rows: one per sample time, for the whole job (every synchronous worker
holds the same model): ``step`` is each worker's gradients computed so far
(mean over workers for ``ps-async``), ``samples`` the samples in the
updates applied, ``workers`` how many there are.
"""

from __future__ import annotations

import copy
import heapq
import random
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch

from gossiptrain.errors import ConfigError
from gossiptrain.sim.collectives import SharedLink, allreduce_seconds
from gossiptrain.sim.compute import measure_step_time, shared_finish_times, step_factor
from gossiptrain.sim.faults import CRASH, JOIN, churn_events
from gossiptrain.sim.sim_config import SimConfig, SimResult
from gossiptrain.train.local_trainer import budget_spent, clip_norm_of, load_shard, optimizer_for, scheduler_for
from gossiptrain.train.workload import Workload, batches, load_workload

SYNCHRONOUS = ("ddp", "ps-sync", "ps-async")


@dataclass
class _Counters:
    """The job's state the sampler reads: counters only; the model is evaluated when sampled."""

    steps: float = 0.0  # gradients computed per worker (mean)
    samples: int = 0  # samples in the updates applied so far
    bytes_sent: float = 0.0  # per worker


class SynchronousJob:
    """One run of a synchronous baseline over ``config.peers`` workers; ``run()`` returns a ``SimResult``."""

    def __init__(self, config: SimConfig, on_sample: Callable[[float, list[dict[str, Any]]], None] | None = None) -> None:
        if config.system not in SYNCHRONOUS:
            raise ConfigError(f"sim.system {config.system!r} is not a synchronous baseline ({', '.join(SYNCHRONOUS)})")
        self.config = config
        self.on_sample = on_sample
        train = config.run.train
        self.workload: Workload = load_workload(train.workload)
        torch.manual_seed(train.seed)  # as the Cluster builds its base model: the same initial point
        self.model = self.workload.build_model(train.seed)
        self.model.train()
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.nbytes = sum(p.numel() * p.element_size() for p in self.params)  # a gradient (or a model) on the wire
        if config.step_time is None:
            self.step_time = measure_step_time(self.workload, self.model, config.run)
        else:
            self.step_time = config.step_time
        # The workload's own optimizer, schedule and clipping where it brings them (as a gossip peer's LocalTrainer).
        self.optimizer = optimizer_for(self.workload, train, self.model)
        if config.system == "ps-async":  # each of the n gradients at lr / n: the sync server's step per sample
            for group in self.optimizer.param_groups:
                group["lr"] = group["lr"] / config.peers
        self.scheduler = scheduler_for(self.workload, self.optimizer, train)  # after the rates are set: its base
        self.clip = clip_norm_of(self.workload)
        self.n = config.peers
        self.streams: list[Iterator[tuple[torch.Tensor, torch.Tensor]]] = []
        for i in range(self.n):
            shard = i % train.shards if train.shards else i
            inputs, targets = load_shard(self.workload, train, shard)
            self.streams.append(batches(inputs, targets, train.batch_size, seed=train.seed * 1000 + shard))
        self.speeds = config.peer_speeds()
        self.contention = config.contention()
        self.rng = random.Random(config.seed)
        self.noise = random.Random(config.seed ^ 0x5EED)  # step-time draws, apart from the churn schedule's
        self.events = churn_events(config, random.Random(self.rng.getrandbits(32)))
        self.rows: list[dict[str, Any]] = []
        self.state = _Counters()
        self.time_to_target: float | None = None
        self.restarts = 0
        self.crashes = 0
        self.lost_steps = 0
        self.step_seconds: list[float] = []  # per synchronous step: compute of the slowest + communication
        self.comm_seconds = 0.0
        self.staleness: list[int] = []  # ps-async: per gradient applied, the server's updates it missed
        self._next_sample = 1  # the index of the next sample time
        self._streak: list[float] = []
        self._evaluated: tuple[int, dict[str, Any]] | None = None  # (updates, metrics): evaluate each model once
        self._updates = 0
        self._idle = [0.0] * self.n  # shared cores: what each (straggling) worker idles before its next step
        self._stopped = False
        self.reached = 0.0  # virtual time the run got to (where it stopped, if interrupted)
        self._wall_start = time.perf_counter()

    # -- the pieces every system shares ---------------------------------------------------

    def compute_seconds(self, worker: int) -> float:
        """Virtual seconds of one step of ``worker``: the gossip peers' compute model."""
        c = self.config
        return self.step_time * self.speeds[worker] * self.contention * step_factor(self.noise, c.step_jitter, c.step_sigma)

    def lockstep_compute_seconds(self) -> float:
        """The compute phase of one DDP step: from the last all-reduce until the slowest gradient is ready.

        Each worker computes ``step_time`` (times its noise) of work. On
        machines of their own a straggler's work takes ``speed`` times
        longer. On shared cores (``cores``: the real baseline on this
        machine) a straggler is emulated as experiments/baselines does it:
        it idles ``speed - 1`` times its previous step's compute before the
        next one, and the cores are shared among whoever computes at the
        time (``shared_finish_times``), so its idling frees them for the
        others. Checked against gloo here: experiments/fidelity.py --only-ddp.
        """
        c = self.config
        factors = [step_factor(self.noise, c.step_jitter, c.step_sigma) for _ in range(self.n)]
        if c.cores <= 0:
            return max(self.step_time * s * f for s, f in zip(self.speeds, factors))
        works = [self.step_time * f for f in factors]
        finish = shared_finish_times(self._idle, works, c.cores)
        self._idle = [(s - 1) * (end - start) for s, start, end in zip(self.speeds, self._idle, finish)]
        return max(finish)

    def accumulate_gradient(self, worker: int) -> int:
        """Add the gradient of ``worker``'s next batch, at the model as it is, to ``.grad``; returns the batch size."""
        x, y = next(self.streams[worker])  # (B, ...) inputs, (B,) targets
        loss = self.workload.loss(self.model, x, y)
        loss.backward()
        return len(y)

    def averaged_step(self) -> None:
        """One update with the mean of the gradients accumulated from all n workers (DDP's update)."""
        with torch.no_grad():
            for p in self.params:
                if p.grad is not None:
                    p.grad.div_(self.n)  # a sum of n gradients / n: DDP divides, then all-reduces a sum
        self.optimizer_step()

    def optimizer_step(self) -> None:
        """One update from the gradient in ``.grad``, as the user's loop takes it: clipped, stepped, scheduled.

        Under DDP the user's loop clips the all-reduced gradient (what every
        rank holds after backward) and steps its schedule once per step.
        """
        if self.clip is not None:
            torch.nn.utils.clip_grad_norm_(self.params, self.clip)
        self.optimizer.step()
        if self.scheduler is not None:
            self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self._updates += 1

    def sample_until(self, now: float) -> None:
        """Emit the samples due up to virtual time ``now`` (the model as of then); sets ``_stopped`` at the target."""
        self.reached = max(self.reached, min(now, self.config.duration))
        while not self._stopped and self._next_sample * self.config.sample_every <= min(now, self.config.duration) + 1e-12:
            t = self._next_sample * self.config.sample_every  # k * every, not a running sum: no drift in the times
            self._next_sample += 1
            self._sample(t)

    def _sample(self, t: float) -> None:
        if self._evaluated is None or self._evaluated[0] != self._updates:
            result = self.workload.evaluate(self.model)
            self._evaluated = (self._updates, {"test_acc": result.accuracy, "test_loss": result.loss, **result.extras()})
        row = {
            "time": round(t, 6), "peer": 0, "id": self.config.system, "system": self.config.system,
            "workers": self.n, "members": self.n, "step": self.state.steps, "samples": self.state.samples,
            "bytes_sent": self.state.bytes_sent, "consensus_distance": 0.0, "restarts": self.restarts,
            **self._evaluated[1],
        }
        self.rows.append(row)
        if self.on_sample:
            self.on_sample(t, [row])
        target = self.config.target_accuracy
        if target and row["test_acc"] >= target:
            self._streak.append(t)
            if len(self._streak) >= self.config.target_hold:
                self.time_to_target = self._streak[0]
                self._stopped = True
        else:
            self._streak.clear()

    # -- the systems ------------------------------------------------------------------------

    def run(self) -> SimResult:
        threads = torch.get_num_threads()
        torch.set_num_threads(1)  # as simulate(): one thread keeps runs bit-identical
        try:
            if self.config.system == "ps-async":
                end = self._run_async_server()
            else:
                end = self._run_synchronous()
        finally:
            torch.set_num_threads(threads)
        return self.result(end)

    def _run_synchronous(self) -> float:
        """DDP or the sync server: rounds back to back, each as slow as its slowest worker plus its communication."""
        c = self.config
        now = 0.0
        crashes = iter(e for e in self.events if e.kind == CRASH)
        next_crash = next(crashes, None)
        checkpoint = self._checkpoint()
        checkpoint_at = 0.0
        next_eval = c.run.train.eval_every_seconds
        star_in, star_out = SharedLink(c.link), SharedLink(c.link)
        while now < c.duration and not self._stopped and not budget_spent(c.run.train, int(self.state.steps), now):
            if c.system == "ddp":
                compute = self.lockstep_compute_seconds()
                comm = allreduce_seconds(c.allreduce, self.n, self.nbytes, c.link)
                end = now + compute + comm
                sent = 2 * (self.n - 1) / self.n * self.nbytes if self.n > 1 else 0.0
            else:
                star_out.free_at = star_in.free_at = now
                arrived = [star_out.send(now, self.nbytes) for _ in range(self.n)]  # the parameters, one worker after another
                ready = sorted(a + self.compute_seconds(w) for w, a in enumerate(arrived))
                end = max(star_in.send(r, self.nbytes) for r in ready)  # the gradients, queued on the way in
                compute, comm = end - now, 0.0
                sent = self.nbytes
            if next_crash is not None and next_crash.time < end:
                # A worker died during this step: the job waits, restarts and reloads its last checkpoint.
                self.sample_until(next_crash.time)
                self.crashes += 1
                self.restarts += 1
                self.lost_steps += self._updates - checkpoint[0]
                now = next_crash.time + c.restart_cost
                self._restore(checkpoint)
                while next_crash is not None and next_crash.time < now:  # crashes while restarting: absorbed
                    next_crash = next(crashes, None)
                self.sample_until(now)
                continue
            self.state.samples += sum(self.accumulate_gradient(w) for w in range(self.n))
            self.averaged_step()
            self.state.steps += 1
            self.state.bytes_sent += sent
            self.step_seconds.append(end - now)
            self.comm_seconds += comm
            self.sample_until(end - 1e-12)  # samples before the step ended see the model before it
            now = end
            if c.eval_time > 0 and now >= next_eval:  # rank 0 evaluates while the others wait (idle) at the next all-reduce
                now += c.eval_time
                next_eval = now + c.run.train.eval_every_seconds
            if c.checkpoint_every <= 0 or now - checkpoint_at >= c.checkpoint_every:
                checkpoint, checkpoint_at = self._checkpoint(), now
            self.sample_until(now)
        return self._finish(min(now, c.duration))

    def _run_async_server(self) -> float:
        """The async server: an event queue of gradients arriving, one update each, parameters back to the sender."""
        c = self.config
        to_workers, to_server = SharedLink(c.link), SharedLink(c.link)
        pending: dict[int, tuple[int, int, list[torch.Tensor]]] = {}  # worker -> (updates when sent, samples, its gradient)
        generation = [0] * self.n
        up = [True] * self.n
        steps = [0] * self.n
        queue: list[tuple[float, int, str, int, int]] = []  # (time, order, kind, worker, generation); kinds:
        # "ready" (a gradient computed, to queue on the server's link), "gradient" (it arrived), crash, join
        order = 0

        def push(t: float, kind: str, worker: int) -> None:
            nonlocal order
            order += 1
            heapq.heappush(queue, (t, order, kind, worker, generation[worker]))

        max_steps = c.run.train.max_steps

        def dispatch(now: float, worker: int) -> None:
            """Send the current parameters to ``worker``; its gradient on them arrives back later."""
            if max_steps and steps[worker] >= max_steps:
                return  # its budget is spent (train.max_steps, per worker as for a gossip peer)
            got = to_workers.send(now, self.nbytes)
            samples = self.accumulate_gradient(worker)  # the model as sent: later updates do not reach this worker's copy
            grad = [p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p) for p in self.params]
            pending[worker] = (self._updates, samples, grad)
            self.optimizer.zero_grad(set_to_none=True)
            push(got + self.compute_seconds(worker), "ready", worker)  # queued on the server's link when ready, in order

        for w in range(self.n):
            dispatch(0.0, w)
        for e in self.events:
            push(e.time, e.kind, e.peer)
        now, end = 0.0, c.duration
        while queue and not self._stopped:
            t, _, kind, worker, gen = heapq.heappop(queue)
            if t >= c.duration or (c.run.train.max_seconds and t >= c.run.train.max_seconds):
                end = min(t, c.duration)
                break
            self.sample_until(t - 1e-12)
            now = t
            if kind == CRASH and up[worker]:
                up[worker] = False
                generation[worker] += 1  # its gradient in flight is lost
                pending.pop(worker, None)
                self.crashes += 1
            elif kind == JOIN and not up[worker]:
                up[worker] = True
                dispatch(now, worker)
            elif kind == "ready" and gen == generation[worker]:
                # Transfers join the server's queue as they become ready: a straggler's later gradient must not
                # hold the faster ones behind it.
                push(to_server.send(now, self.nbytes), "gradient", worker)
            elif kind == "gradient" and gen == generation[worker]:
                sent_at, samples, grad = pending.pop(worker)
                self.state.samples += samples
                self.staleness.append(self._updates - sent_at)  # updates by others since its parameters left
                for p, g in zip(self.params, grad):
                    p.grad = g
                self.optimizer_step()  # the schedule steps per server update
                steps[worker] += 1
                self.state.steps = sum(steps) / self.n
                self.state.bytes_sent += self.nbytes / self.n  # per worker, on average
                dispatch(now, worker)
        else:
            end = now  # stopped at the target, or every worker's budget spent
        return self._finish(end)

    def _finish(self, end: float) -> float:
        """The samples due by ``end``, and one at ``end`` itself: the summary describes the model as it ended."""
        self.sample_until(end)
        if not self._stopped and (not self.rows or self.rows[-1]["time"] < round(end, 6)):
            self._sample(end)
        return end

    # -- checkpoints (the synchronous restart) --------------------------------------------

    def _checkpoint(self) -> tuple[int, dict[str, Any], dict[str, Any], float, int, dict[str, Any] | None]:
        schedule = copy.deepcopy(self.scheduler.state_dict()) if self.scheduler is not None else None
        return (self._updates, copy.deepcopy(self.model.state_dict()), copy.deepcopy(self.optimizer.state_dict()),
                self.state.steps, self.state.samples, schedule)

    def _restore(self, checkpoint: tuple[int, dict[str, Any], dict[str, Any], float, int, dict[str, Any] | None]) -> None:
        self._updates, model, optimizer, self.state.steps, self.state.samples, schedule = checkpoint
        self.model.load_state_dict(model)
        self.optimizer.load_state_dict(optimizer)
        if self.scheduler is not None and schedule is not None:
            self.scheduler.load_state_dict(schedule)
        self._evaluated = None

    # -- results ----------------------------------------------------------------------------

    def result(self, reached: float, *, interrupted: bool = False) -> SimResult:
        last = self.rows[-1] if self.rows else {}
        steps = self.step_seconds
        summary: dict[str, Any] = {
            "system": self.config.system,
            "peers": self.n,
            "seed": self.config.seed,
            "duration": self.config.duration,
            "virtual_seconds": round(reached, 3),
            "wall_seconds": round(time.perf_counter() - self._wall_start, 3),
            "step_time": self.step_time,
            "contention": self.contention,
            "live_peers": self.n,
            "crashes": self.crashes,
            "restarts": self.restarts,
            "lost_steps": self.lost_steps,
            "model_bytes": self.nbytes,
            "mean_test_acc": last.get("test_acc"),
            "mean_step": last.get("step"),
            "samples": last.get("samples"),
            "consensus_distance": 0.0,
            "bytes_sent_per_peer": last.get("bytes_sent"),
            "time_to_target": self.time_to_target,
            "steps_per_second": len(steps) / sum(steps) if steps else None,
            "comm_share": self.comm_seconds / sum(steps) if steps else None,
            "staleness_mean": sum(self.staleness) / len(self.staleness) if self.staleness else None,
            "interrupted": interrupted,
        }
        return SimResult(self.rows, summary)
