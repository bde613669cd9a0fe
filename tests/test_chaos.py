"""Chaos on loopback: real peer processes SIGKILLed at random and restarted while the swarm trains.

The kill schedule comes from a seeded generator (exponential gaps between
kills, so a Poisson process; exponential downtimes); what the peers do in
between is whatever the machine makes of it, so every check waits for its
condition with a bound and never asserts on a duration. Checked:

- every peer that is training across a window between two chaos events
  advances its step in that window (read from its metrics);
- no peer prints a traceback or an error, and no peer exits with an error;
- every restarted peer joins (through the coordinator or through a live
  peer, on its old shard), completes a state transfer before its first step,
  and starts close to the swarm's accuracy;
- the swarm's final mean test accuracy: near a churn-free run of the same
  length (the slow version) or above a floor (the short one).

Also here: the coordinator restarted mid-run (what tests/test_swarm.py's
restart test does not cover: training with several peers across the whole
outage, a brand-new peer welcomed by the restarted coordinator).
"""

from __future__ import annotations

import heapq
import random
import re
import signal
import statistics
import time
from dataclasses import dataclass, field
from typing import Any

import pytest

from gossiptrain.config import RunConfig
from gossiptrain.train.metrics import MetricsTail

from .conftest import fast_config
from .swarm import Proc, Procs, describe, next_host, wait_for

BAD_OUTPUT = re.compile(r"Traceback|unhandled|exception was never retrieved|\bERROR\b|\bCRITICAL\b", re.IGNORECASE)
PROGRESS_BOUND = 90.0  # seconds a live peer may take to show a new step (a bound on a wait, not a measurement)
START_BOUND = 120.0  # seconds for a (re)started peer to join, download and write its start record
EXIT_BOUND = 120.0  # seconds for all the peers stopped together to exit


_tails: dict[Any, MetricsTail] = {}


def records(p: Proc) -> list[dict[str, Any]]:
    """``p``'s metrics so far, read incrementally: these tests poll a dozen growing files for minutes."""
    if p.metrics not in _tails:
        _tails[p.metrics] = MetricsTail(p.metrics)
    return _tails[p.metrics].poll()


def latest(p: Proc) -> dict[str, Any]:
    return next((r for r in reversed(records(p)) if r.get("event") in ("eval", "done")), {})


def step_of(p: Proc) -> int:
    return latest(p).get("step", -1)


def started(p: Proc) -> dict[str, Any] | None:
    return next((r for r in records(p) if r.get("event") == "start"), None)


def bad_lines(p: Proc) -> list[str]:
    return [line for line in p.output().splitlines() if BAD_OUTPUT.search(line)]


@dataclass
class Slot:
    """One shard's peer across its incarnations (a restart is a new process on the same shard)."""

    shard: int
    lives: list[Proc] = field(default_factory=list)
    killed: list[float] = field(default_factory=list)  # time.time() of each kill

    @property
    def current(self) -> Proc:
        return self.lives[-1]

    def training(self) -> bool:
        return self.current.alive() and started(self.current) is not None


class Chaos:
    """A swarm of ``n`` `gossiptrain peer` processes (peer i on shard i) and a seeded kill/restart schedule.

    Kills come at exponential gaps of mean ``mean_gap`` seconds, each taking
    a random slot whose peer is training, never more than ``max_down`` at a
    time (a kill due then is skipped, as the simulator's churn does); a
    killed slot restarts after an exponential downtime of mean ``mean_down``
    (``min_down`` at least), joining alternately through the coordinator and
    through a live peer. Before each event every peer that was training at
    the previous one must have advanced its step (a bounded wait).
    """

    def __init__(self, procs: Procs, join: str, n: int, seed: int, *extra: str, prefix: str = "peer") -> None:
        self.procs = procs
        self.prefix = prefix  # names its processes' logs and metrics: one per swarm of a test
        self.join = join
        self.extra = [*extra, "--threads", "1"]
        self.rng = random.Random(seed)
        self.slots = [Slot(i) for i in range(n)]
        self.restarts = 0
        self.windows = 0
        self.joined_via_peer = 0
        for s in self.slots:
            self._launch(s, join)

    def _launch(self, slot: Slot, join: str) -> None:
        name = f"{self.prefix}{slot.shard}" + (f"-r{len(slot.lives)}" if slot.lives else "")
        slot.lives.append(self.procs.peer(join, "--shard", str(slot.shard), *self.extra, name=name))

    def every_life(self) -> list[Proc]:
        return [p for s in self.slots for p in s.lives]

    def restarted(self) -> list[Proc]:
        return [p for s in self.slots for p in s.lives[1:]]

    def wait_all_training(self, members: int | None = None) -> None:
        def ready() -> bool:
            live = [s.current for s in self.slots if s.current.alive()]
            return all(started(p) and (members is None or latest(p).get("members") == members) for p in live)

        what = f"every live peer to train{f' and see {members} members' if members else ''}"
        wait_for(ready, START_BOUND, what, interval=0.25, state=lambda: describe(self.every_life()))

    def _progress_since(self, steps: dict[Proc, int]) -> None:
        """Every peer that was training at the last event and still lives has stepped since (bounded wait)."""
        wait_for(
            lambda: all(step_of(p) > s for p, s in steps.items() if p.alive()),
            PROGRESS_BOUND, f"every live peer to step past {', '.join(f'{p.name}@{s}' for p, s in steps.items())}",
            interval=0.25, state=lambda: describe(self.every_life()),
        )
        self.windows += 1

    def _snapshot(self) -> dict[Proc, int]:
        return {s.current: step_of(s.current) for s in self.slots if s.training()}

    def run(self, duration: float, mean_gap: float, mean_down: float, min_down: float, max_down: int, max_kills: int) -> int:
        """Kill and restart for ``duration`` seconds (at most ``max_kills`` kills); returns the kills done."""
        began = time.monotonic()
        events: list[tuple[float, int, str, int]] = []  # (due, seq, kind, slot)
        seq = 0
        t = began + self.rng.expovariate(1 / mean_gap)
        events.append((t, seq, "kill", -1))
        kills = 0
        steps = self._snapshot()
        protected: dict[int, Proc] = {}  # slot -> the newcomer joining through it (do not kill its join target)
        while events:
            due, _, kind, index = heapq.heappop(events)
            if kind == "kill" and (due > began + duration or kills >= max_kills):
                continue
            while (left := due - time.monotonic()) > 0:
                time.sleep(min(left, 0.2))  # the chaos schedule itself, not a wait for a condition
            self._progress_since(steps)
            protected = {i: p for i, p in protected.items() if p.alive() and not started(p)}
            if kind == "kill":
                down = sum(not s.current.alive() for s in self.slots)
                choices = [s for s in self.slots if s.training() and s.shard not in protected]
                if down < max_down and len(choices) > 1:
                    victim = self.rng.choice(choices)
                    victim.current.signal(signal.SIGKILL)
                    victim.current.wait(10)
                    victim.killed.append(time.time())
                    kills += 1
                    downtime = max(min_down, self.rng.expovariate(1 / mean_down))
                    seq += 1
                    heapq.heappush(events, (time.monotonic() + downtime, seq, "restart", victim.shard))
                seq += 1
                heapq.heappush(events, (time.monotonic() + self.rng.expovariate(1 / mean_gap), seq, "kill", -1))
            else:
                slot = self.slots[index]
                via = self.join
                donors = [s for s in self.slots if s.training()]
                if self.restarts % 2 == 1 and donors:  # every other restart joins through a live peer
                    target = self.rng.choice(donors)
                    via = started(target.current)["address"].removeprefix("tcp://")  # type: ignore[index]
                    self.joined_via_peer += 1
                self._launch(slot, via)
                if via != self.join:
                    protected[target.shard] = slot.current
                self.restarts += 1
            steps = self._snapshot()
        self.wait_all_training()
        self._progress_since(self._snapshot())
        return kills

    def stop(self) -> list[dict[str, Any]]:
        """SIGTERM every live peer; each must write its done record and exit 0. Returns those records.

        The bound on the exit is generous: after its done record (a fraction of a second after the
        signal) a peer spends seconds in interpreter shutdown on a loaded machine (freeing torch).
        """
        # First, a bounded wait until every restart has others' evaluations to be compared with (check_lives).
        wait_for(lambda: all(self.others_at_start(p) for p in self.restarted()), 60,
                 "the others' evaluations around each restart", interval=0.25, state=lambda: describe(self.every_life()))
        live = [s.current for s in self.slots if s.current.alive()]
        for p in live:
            p.signal(signal.SIGTERM)

        def done(p: Proc) -> dict[str, Any] | None:
            return next((r for r in records(p) if r.get("event") == "done"), None)

        wait_for(lambda: all(done(p) for p in live), 60, "every peer's done record", interval=0.25,
                 state=lambda: describe(live))
        deadline = time.monotonic() + EXIT_BOUND
        for p in live:
            assert p.wait(max(1.0, deadline - time.monotonic())) == 0, p.output()[-3000:]
        return [done(p) for p in live]  # type: ignore[misc]

    def check_lives(self) -> None:
        """No bad output anywhere; every restart completed its state transfer and started near the swarm."""
        problems = {p.name: bad_lines(p) for p in self.every_life() if bad_lines(p)}
        assert not problems, problems
        for p in self.every_life():
            assert started(p) is not None, f"{p.name} never started training:\n{p.output()[-3000:]}"
        for p in self.restarted():
            start = started(p)
            assert start is not None
            assert start["state_transfer"] == "complete" and start["state_donors"], (p.name, start)
            others = self.others_at_start(p)  # stop() waited for these: never empty, the check is never skipped
            assert others, f"no other peer evaluated around {p.name}'s start"
            # A fresh model is near 0.1 here; the donor's snapshot is about as good as the others.
            assert start["test_acc"] >= statistics.median(others) - 0.1, (p.name, start["test_acc"], others)

    def others_at_start(self, p: Proc) -> list[float]:
        """What the others had when ``p`` started: each one's last evaluation in the 3 s before its start.

        If none had one there (an evaluation round missed on a loaded machine), the others' first
        evaluations after it: the swarm's next word on its accuracy, which stop() waits for.
        """
        start = started(p)
        if start is None:
            return []
        evals = {q: [r for r in records(q) if r.get("event") == "eval"] for q in self.every_life() if q is not p}
        before = [e[-1]["test_acc"] for e in (
            [r for r in rs if start["time"] - 3.0 < r["time"] <= start["time"]] for rs in evals.values()
        ) if e]
        if before:
            return before
        return [after[0]["test_acc"] for after in ([r for r in rs if r["time"] > start["time"]] for rs in evals.values()) if after]


def config_flags(config: RunConfig) -> list[str]:
    """``--set`` flags that give a CLI process ``config``: one per field that differs from the defaults."""
    default = RunConfig().to_dict()
    return [
        a for section, fields in config.to_dict().items() for name, value in fields.items()
        if default[section][name] != value for a in ("--set", f"{section}.{name}={value}")
    ]


def chaos_config(peers: int) -> RunConfig:
    return fast_config(**{"train.shards": peers, "train.max_steps": 0, "train.max_seconds": 900})


# Slow (~30 s of a 2-core default run, over the 5-minute budget): each of its faults has a default test of
# its own (test_swarm: a kill, a join through a live peer; test_checkpoint: a resume; test_state_transfer:
# the joiner's download); this one checks them together: `make test-slow`.
@pytest.mark.slow
@pytest.mark.timeout(420)  # 80-110 s here with other jobs loading the machine (load ~10); the bound is generous
def test_chaos_short(procs: Procs, coordinator_factory: Any) -> None:
    """Four peers, two of them killed and restarted (one through the coordinator, one through a live peer).

    Four, not six: the same faults (kills, a restart through the coordinator, one through a live peer, with
    one peer down at a time and two live donors left), with a third fewer processes on two cores, where each
    restarted peer's start-up competes with the others' training. The six-peer swarm is the slow test below.
    """
    coord = coordinator_factory(chaos_config(4))
    chaos = Chaos(procs, coord.address.removeprefix("tcp://"), 4, seed=11)
    chaos.wait_all_training(members=4)
    kills = chaos.run(duration=30, mean_gap=1.5, mean_down=1.0, min_down=0.5, max_down=1, max_kills=2)
    assert kills == 2 and chaos.restarts == 2 and chaos.joined_via_peer == 1
    chaos.wait_all_training(members=4)
    done = chaos.stop()
    chaos.check_lives()
    assert len(done) == 4
    mean_acc = statistics.mean(d["test_acc"] for d in done)
    assert mean_acc >= 0.9, done


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_chaos_for_minutes_matches_a_churn_free_run(procs: Procs, coordinator_factory: Any) -> None:
    """Six peers for about three minutes, Poisson kills every 8 s on average, down 4 s on average, two at most.

    Then the same swarm for the same time without churn: the final mean test
    accuracies must be within one point.
    """
    coord = coordinator_factory(chaos_config(6))
    chaos = Chaos(procs, coord.address.removeprefix("tcp://"), 6, seed=5)
    chaos.wait_all_training(members=6)
    t0 = time.monotonic()
    kills = chaos.run(duration=180, mean_gap=8.0, mean_down=4.0, min_down=0.5, max_down=2, max_kills=1000)
    chaos.wait_all_training(members=6)
    trained = time.monotonic() - t0
    churned = chaos.stop()
    chaos.check_lives()
    assert kills >= 5 and chaos.restarts == kills and chaos.joined_via_peer >= 2, (kills, chaos.restarts)

    calm_coord = coordinator_factory(chaos_config(6))
    calm = Chaos(procs, calm_coord.address.removeprefix("tcp://"), 6, seed=5, prefix="calm")
    calm.wait_all_training(members=6)
    end = time.monotonic() + trained
    while time.monotonic() < end:
        before = calm._snapshot()
        time.sleep(min(5.0, max(0.0, end - time.monotonic())))  # the run's length, not a wait for a condition
        calm._progress_since(before)
    quiet = calm.stop()
    calm.check_lives()
    with_churn = statistics.mean(d["test_acc"] for d in churned)
    without = statistics.mean(d["test_acc"] for d in quiet)
    assert abs(with_churn - without) <= 0.01, (with_churn, without, kills)


# -- the coordinator restarted mid-run -------------------------------------------------------


@pytest.mark.slow  # 70-110 s; the default run has tests/test_swarm.py's shorter coordinator restart
@pytest.mark.timeout(420)
def test_coordinator_restarted_mid_run_training_goes_on_and_joins_resume(procs: Procs) -> None:
    """Three peers train through a coordinator outage; the restarted one relearns them and welcomes a newcomer."""
    host = next_host()
    settings = config_flags(fast_config(**{"train.max_seconds": 600, "train.max_steps": 0, "train.shards": 4}))
    coordinator = procs.start("coordinator", "--bind", f"{host}:0", *settings, name="coordinator")
    line = procs.wait_for(lambda: "join with:" in coordinator.output() and coordinator.output(), 30, "the coordinator to listen")
    join = line.split("--join ")[1].split()[0]  # HOST:PORT, the port the OS picked: the restart binds it again
    first = [procs.peer(join, "--threads", "1") for _ in range(3)]
    procs.wait_for(lambda: all((p.latest() or {}).get("members") == 3 for p in first), 90, "three peers to see each other")

    coordinator.signal(signal.SIGKILL)
    coordinator.wait(10)
    # While it is down: every peer keeps stepping and exchanging, and nobody is dropped.
    for _ in range(3):
        before = {p: ((p.latest() or {}).get("step", 0), (p.latest() or {}).get("exchanges", 0)) for p in first}
        procs.wait_for(
            lambda: all(step_of(p) > s + 20 and (p.latest() or {}).get("exchanges", 0) > x for p, (s, x) in before.items()),
            PROGRESS_BOUND, "every peer to step and exchange without the coordinator",
        )

    restarted = procs.start("coordinator", "--bind", join, *settings, name="restarted")
    procs.wait_for(lambda: "3 members alive" in restarted.output(), 60, "the restarted coordinator to relearn 3 members")
    newcomer = procs.peer(join, "--threads", "1", name="newcomer")
    everyone = [*first, newcomer]
    procs.wait_for(lambda: re.search(r"welcomed \S+ at \S+ \(shard 3\)", restarted.output()), 60,
                   "the restarted coordinator to welcome the newcomer onto the free shard")
    procs.wait_for(lambda: all((p.latest() or {}).get("members") == 4 for p in everyone), 90, "all four to see each other")
    start = started(newcomer)
    assert start is not None and start["shard"] == 3 and start["state_transfer"] == "complete", start
    before = {p: step_of(p) for p in everyone}
    procs.wait_for(lambda: all(step_of(p) > s + 20 for p, s in before.items()), PROGRESS_BOUND, "all four to train on")
    procs.wait_for(lambda: (newcomer.latest() or {}).get("exchanges", 0) > 0, PROGRESS_BOUND, "the newcomer to exchange")
    procs.wait_for(lambda: "4 members alive" in restarted.output(), 60, "the restarted coordinator to count the newcomer")

    for p in everyone:
        p.signal(signal.SIGTERM)
    deadline = time.monotonic() + EXIT_BOUND
    for p in everyone:
        assert p.wait(max(1.0, deadline - time.monotonic())) == 0, p.output()[-3000:]
        assert p.records("done"), p.output()[-3000:]
        assert not bad_lines(p), (p.name, bad_lines(p))
    assert not bad_lines(coordinator) and not bad_lines(restarted)
