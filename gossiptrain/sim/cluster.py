"""A simulated cluster: a coordinator and many peers in one process, in virtual time.

``simulate(SimConfig)`` builds the simulated network, starts the
coordinator and the peers (each the real protocol stack, see
``gossiptrain.sim.peer``), applies the fault schedule (stragglers, link
profile, loss, partitions, churn), samples every peer every ``sample_every``
virtual seconds, and returns the time series and a summary. Everything
random comes from ``SimConfig.seed``; with an explicit ``step_time`` two runs
of the same configuration give identical results.

Interrupted (Ctrl+C: ``KeyboardInterrupt``), ``simulate`` raises
``SimInterrupted``, a ``KeyboardInterrupt`` that carries what was computed:
the rows sampled so far and a summary marked ``"interrupted": true`` whose
``virtual_seconds`` is the virtual time reached.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import gc
import logging
import math
import random
import time
from typing import Any, Callable, Iterator

import torch

from gossiptrain.net.transport import listen
from gossiptrain.net.transport.sim import SimNetwork
from gossiptrain.runtime.coordinator import Coordinator, coordinator_limits
from gossiptrain.sim.batched_steps import StepBatcher
from gossiptrain.sim.compute import measure_step_time
from gossiptrain.sim.faults import PartitionSpec, churn_events
from gossiptrain.sim.log_gate import LogGate
from gossiptrain.sim.peer import SimPeer, SimPeerSpec
from gossiptrain.sim.sim_config import SYSTEMS, SimConfig, SimResult  # noqa: F401  (re-exported: users import them from here)
from gossiptrain.sim.vtime import LoopClock, run_virtual
from gossiptrain.train.workload import Workload, load_workload

log = logging.getLogger(__name__)

COORDINATOR = "sim://coordinator"
#: The cyclic collector's thresholds while a simulation runs (CPython's default: 700, 10, 10). A run allocates
#: millions of short-lived objects (messages, events, actions): at the default, 500 and 1,000 members spent
#: 17-18% of their CPU time in collections; 2% at these, and the 1,000-member run peaked at the same 2.95 GB.
RUN_GC_THRESHOLD = (100_000, 50, 100)


class SimInterrupted(KeyboardInterrupt):
    """Ctrl+C during ``simulate``: still a KeyboardInterrupt, carrying the partial ``result``."""

    def __init__(self, result: SimResult) -> None:
        super().__init__(f"simulation interrupted at virtual time {result.summary['virtual_seconds']} s")
        self.result = result


class Cluster:
    """Owns the simulated world of one run; ``run()`` drives it to the end."""

    def __init__(
        self,
        config: SimConfig,
        on_sample: Callable[[float, list[dict[str, Any]]], None] | None = None,
        on_started: Callable[[int], None] | None = None,
    ) -> None:
        self.config = config
        self.on_sample = on_sample
        self.on_started = on_started  # called with the peers started so far, while they start (before the first sample)
        run = config.run
        self.workload: Workload | None = None
        self.base_model: torch.nn.Module | None = None
        if not config.membership_only:
            self.workload = load_workload(run.train.workload)
            torch.manual_seed(run.train.seed)
            self.base_model = self.workload.build_model(run.train.seed)
        self.step_time = config.step_time or (
            measure_step_time(self.workload, self.base_model, run) if self.workload and self.base_model else 0.0
        )
        self.speeds = config.peer_speeds()
        self.contention = config.contention()
        self.rng = random.Random(config.seed)
        self.network = SimNetwork(config.link, seed=self.rng.getrandbits(32))
        self.peers: dict[int, SimPeer] = {}  # slot -> current incarnation
        self.tasks: dict[int, asyncio.Task[None]] = {}
        self.generations = [0] * config.peers
        self.rows: list[dict[str, Any]] = []
        self.crashes = 0
        self.time_to_target: float | None = None
        self.swarm_time_to_target: float | None = None  # the same, for the peers' averaged model (see _sample)
        self._swarm_model: torch.nn.Module | None = None
        self.swarm_acc: float | None = None  # the averaged model's accuracy at the last sample
        self.reached = 0.0  # virtual time the run got to (its end, or where it was interrupted)
        self.log_gate = LogGate()  # the peers' warnings: counted for the summary, each logged only with -v
        # The peers' local steps computed in stacked calls (gossiptrain.sim.batched_steps), where asked for
        self.batcher = StepBatcher() if config.batch_steps and not config.membership_only else None
        self._wall_start: float | None = None

    # -- peers -----------------------------------------------------------------------------

    def _make_model(self) -> torch.nn.Module:
        assert self.base_model is not None
        return copy.deepcopy(self.base_model)  # every peer starts from the same point

    def _start(self, slot: int) -> None:
        spec = SimPeerSpec(
            slot,
            self.generations[slot],
            self.speeds[slot],
            self.step_time,
            self.config.exchange_time,
            self.contention,
            poison=self.config.rogue_scale if slot in self.config.rogue else 1.0,
            eval_time=self.config.eval_time,
            step_jitter=self.config.step_jitter,
            step_sigma=self.config.step_sigma,
            wait_for=self.config.wait_for,
            client=slot in self.config.behind_nat,
            relay=slot in self.config.relays,
        )
        peer = SimPeer(
            spec,
            network=self.network,
            join=COORDINATOR,
            local=self.config.run,
            workload=self.workload,
            make_model=None if self.config.membership_only else self._make_model,
            seed=self.rng.getrandbits(32),
            batcher=self.batcher,
        )
        self.peers[slot] = peer
        self.tasks[slot] = asyncio.get_running_loop().create_task(peer.run(), name=spec.name)

    async def _crash(self, slot: int) -> None:
        task = self.tasks.pop(slot, None)
        if task is None or task.done():
            return
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        self.peers.pop(slot, None)
        self.crashes += 1

    async def _rejoin(self, slot: int) -> None:
        if slot in self.tasks:
            return
        self.generations[slot] += 1
        self._start(slot)

    # -- schedules -------------------------------------------------------------------------

    async def _churn(self) -> None:
        events = churn_events(self.config, random.Random(self.rng.getrandbits(32)))
        loop = asyncio.get_running_loop()
        for event in events:
            await asyncio.sleep(max(0.0, event.time - loop.time()))
            if event.kind == "crash":
                await self._crash(event.peer)
            else:
                await self._rejoin(event.peer)

    async def _partitions(self, spec: PartitionSpec) -> None:
        loop = asyncio.get_running_loop()
        await asyncio.sleep(max(0.0, spec.start - loop.time()))
        cut = max(1, min(self.config.peers - 1, round(spec.fraction * self.config.peers)))
        side_a = [p.transport.address for s, p in self.peers.items() if s < cut and p.transport]
        side_b = [p.transport.address for s, p in self.peers.items() if s >= cut and p.transport]
        # The coordinator stays on side A: a partition cuts peers, the bootstrap service is one of them.
        self.network.partition([[*side_a, COORDINATOR], side_b])
        await asyncio.sleep(spec.heal - spec.start)
        self.network.heal()

    # -- sampling --------------------------------------------------------------------------

    def _sample(self, now: float) -> list[dict[str, Any]]:
        if self.batcher is not None:  # every step under way into its model first: what one-by-one steps would show
            self.batcher.flush()
        live = {s: p for s, p in self.peers.items() if p.node is not None}
        # A view may name members that no longer exist: a crashed incarnation not yet declared dead
        # (its rejoin has a new id), or an id whose join answer was lost (its peer joined again under
        # another). Only the simulator knows which entries are live peers; it counts both.
        live_ids = {p.node.me.id for p in live.values() if p.node is not None}
        rows = []
        flat: dict[int, torch.Tensor] = {}
        for slot, peer in live.items():
            model = peer.model
            if model is not None:
                flat[slot] = torch.cat([p.detach().reshape(-1) for p in model.parameters()])  # (P,)
        center = torch.stack(list(flat.values())).mean(0) if flat else None  # (P,)
        swarm_acc = self.swarm_acc = self._swarm_accuracy(center) if center is not None else None
        for slot, peer in sorted(live.items()):
            row: dict[str, Any] = {"time": round(now, 6), "peer": slot, "id": peer.node.me.id if peer.node else ""}
            row["generation"] = peer.spec.generation
            if self.config.rogue:
                row["rogue"] = slot in self.config.rogue
            stats = peer.stats()
            view = peer.node.view() if peer.node else ()
            row["members"] = stats.pop("members")  # entries in its view, itself included
            row["members_live"] = sum(1 for m in view if m in live_ids)  # ...that are live peers now
            row["members_stale"] = row["members"] - row["members_live"]  # ...that name no live peer
            row.update(stats)
            if peer.trainer is not None:
                result = peer.trainer.evaluate()
                row.update(step=peer.trainer.steps, loss=peer.trainer.loss_avg, test_acc=result.accuracy, test_loss=result.loss)
                row.update(result.extras())
                assert center is not None
                row["consensus_distance"] = float(torch.linalg.vector_norm(flat[slot] - center))
                row["swarm_acc"] = swarm_acc  # the peers' averaged model, what a final consensus hands out
            rows.append(row)
        return rows

    def _swarm_accuracy(self, center: torch.Tensor) -> float:
        """Test accuracy of the live peers' averaged model (center: all parameters, flat)."""
        assert self.workload is not None and self.base_model is not None
        if self._swarm_model is None:
            self._swarm_model = copy.deepcopy(self.base_model)
        with torch.no_grad():
            torch.nn.utils.vector_to_parameters(center, self._swarm_model.parameters())
        return self.workload.evaluate(self._swarm_model).accuracy

    async def _sampler(self, stop: asyncio.Event) -> None:
        loop = asyncio.get_running_loop()
        streak: list[float] = []  # sample times of the current run of samples at or above the target
        swarm_streak: list[float] = []  # ...of the averaged model
        while True:
            await asyncio.sleep(self.config.sample_every)
            now = self.reached = loop.time()
            rows = self._sample(now)
            self.rows.extend(rows)
            if self.on_sample:
                self.on_sample(now, rows)
            accs = [r["test_acc"] for r in rows if "test_acc" in r and not r.get("rogue")]
            target = self.config.target_accuracy
            if target and self.swarm_time_to_target is None:
                swarm_streak = swarm_streak + [now] if self.swarm_acc is not None and self.swarm_acc >= target else []
                if len(swarm_streak) >= self.config.target_hold:
                    self.swarm_time_to_target = swarm_streak[0]
            if target and accs and sum(accs) / len(accs) >= target:
                streak.append(now)
                if len(streak) >= self.config.target_hold:
                    self.time_to_target = streak[0]  # when it was first reached, of the run that held
                    stop.set()
            else:
                streak.clear()

    # -- the run ---------------------------------------------------------------------------

    async def run(self) -> SimResult:
        """Run to the end; cancelled (Ctrl+C under ``simulate``), stop every task first, then re-raise."""
        self._wall_start = time.perf_counter()
        loop = asyncio.get_running_loop()
        stop = asyncio.Event()
        background: list[asyncio.Task[None]] = []
        with self.log_gate.installed(), self.network.activate():
            transport = listen(COORDINATOR, coordinator_limits(self.config.run.limits), network=self.network)
            async with transport, Coordinator(self.config.run, transport, clock=LoopClock(), seed=self.rng.getrandbits(32)):
                if self.config.coordinator_relay:  # between clients (behind_nat), as `gossiptrain coordinator` does
                    transport.serve_as_relay(loop.time())
                try:
                    # Peers start evenly over join_spread, as machines do: not all in the same instant.
                    gap = self.config.join_spread / self.config.peers
                    for slot in range(self.config.peers):
                        self._start(slot)
                        if self.on_started:
                            self.on_started(slot + 1)
                        if gap:
                            await asyncio.sleep(gap)
                    background += [asyncio.create_task(self._sampler(stop), name="sampler"), asyncio.create_task(self._churn(), name="churn")]
                    background += [asyncio.create_task(self._partitions(p)) for p in self.config.partitions]
                    try:
                        await asyncio.wait_for(stop.wait(), timeout=max(0.0, self.config.duration - loop.time()))
                    except TimeoutError:
                        pass
                finally:
                    self.reached = loop.time()
                    for task in [*background, *self.tasks.values()]:
                        task.cancel()
                    results = await asyncio.gather(*background, *self.tasks.values(), return_exceptions=True)
                for r in results:
                    if isinstance(r, BaseException) and not isinstance(r, asyncio.CancelledError):
                        raise r
        return self.result()

    def result(self, *, interrupted: bool = False) -> SimResult:
        """The rows so far and their summary (also of a run cut short: ``interrupted``)."""
        wall = time.perf_counter() - self._wall_start if self._wall_start is not None else 0.0
        return SimResult(self.rows, {**self._summary(self.reached, wall), "interrupted": interrupted})

    def _summary(self, virtual: float, wall: float) -> dict[str, Any]:
        last_time = self.rows[-1]["time"] if self.rows else 0.0
        live = [r for r in self.rows if r["time"] == last_time]
        last = [r for r in live if not r.get("rogue")]  # means are over the honest peers

        def mean(key: str) -> float | None:
            """Mean of ``key`` over the peers' last samples, skipping missing and NaN values."""
            values = [r[key] for r in last if isinstance(r.get(key), (int, float)) and not math.isnan(r[key])]
            return sum(values) / len(values) if values else None

        summary: dict[str, Any] = {
            "peers": self.config.peers,
            "seed": self.config.seed,
            "duration": self.config.duration,
            "virtual_seconds": round(virtual, 3),  # reached: less than duration at a target or an interrupt
            "wall_seconds": round(wall, 3),
            "step_time": self.step_time,
            "contention": self.contention,
            "live_peers": len(live),
            "crashes": self.crashes,
            "mean_members": mean("members"),  # entries in a view, stale ones included
            "mean_members_live": mean("members_live"),  # ...of them live peers (at most live_peers)
            "mean_members_stale": mean("members_stale"),
            "network": self.network.stats.to_dict(),
            # The simulated peers' warnings (a scheduled fault's given-up exchanges...), by kind: not logged one by one
            "log_warnings": dict(self.log_gate.counts.most_common()),
        }
        if not self.config.membership_only:
            summary.update(
                mean_test_acc=mean("test_acc"),
                mean_step=mean("step"),
                consensus_distance=mean("consensus_distance"),
                exchanges_per_peer=mean("exchanges"),
                bytes_sent_per_peer=mean("bytes_sent"),
                time_to_target=self.time_to_target,
                swarm_time_to_target=self.swarm_time_to_target,
                mean_swarm_acc=mean("swarm_acc"),
            )
        return summary


def simulate(
    config: SimConfig,
    on_sample: Callable[[float, list[dict[str, Any]]], None] | None = None,
    on_started: Callable[[int], None] | None = None,
) -> SimResult:
    """Run one simulation to its end (``duration`` or the target accuracy) in virtual time.

    ``on_sample(now, rows)`` gets every sample; ``on_started(count)`` the peers started so far, as they start.

    ``config.system`` other than ``gossip`` runs a synchronous baseline
    (``gossiptrain.sim.synchronous``) on the same compute and link model.

    Ctrl+C (a ``KeyboardInterrupt``) once the cluster is running raises
    ``SimInterrupted`` with the rows so far and a summary marked interrupted.
    """
    if config.system != "gossip":
        from gossiptrain.sim.synchronous import SynchronousJob

        job = SynchronousJob(config, on_sample)
        try:
            return job.run()
        except KeyboardInterrupt:
            raise SimInterrupted(job.result(job.reached, interrupted=True)) from None
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # one simulated peer computes at a time; one thread keeps runs bit-identical
    try:
        cluster = Cluster(config, on_sample, on_started)
        try:
            with _rare_collections():
                return run_virtual(cluster.run())
        except SimInterrupted:
            raise
        except KeyboardInterrupt:
            # asyncio's Ctrl+C handler cancelled the run (which stopped its tasks), or the interrupt
            # came straight through (a second Ctrl+C, or no handler off the main thread).
            raise SimInterrupted(cluster.result(interrupted=True)) from None
    finally:
        torch.set_num_threads(threads)


@contextlib.contextmanager
def _rare_collections() -> Iterator[None]:
    """Run the block with ``RUN_GC_THRESHOLD``, then the thresholds as they were: garbage is the same, collected less often."""
    before = gc.get_threshold()
    gc.set_threshold(*RUN_GC_THRESHOLD)
    try:
        yield
    finally:
        gc.set_threshold(*before)
