"""The averaging nemesis: fault schedules against every algorithm, its invariant checked after every event.

See ``gossiptrain.testing.averaging_nemesis`` for the faults and the invariants
(pairwise and push-sum: exact mass; neighbor and local-sgd: nothing made up,
the models inside the initial box). The default run plays 312 generated
schedules in all (50 per algorithm uncompressed, 25 per algorithm with int8,
whose runs cost two to three times as much, and 12 for the largest outer
step); the slow set plays thousands more (top-k's among them).
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gossiptrain.config import GossipConfig
from gossiptrain.testing.averaging_nemesis import (
    Deliver,
    FailSend,
    InvariantViolation,
    Jump,
    Kill,
    Nemesis,
    Op,
    Pause,
    Resume,
    SafePoint,
    schedules,
)

ALGORITHMS = ("pairwise", "push-sum", "neighbor", "local-sgd")
CONSERVING = ("pairwise", "push-sum")
CODECS = ("none", "int8")


def gossip(algorithm: str, compression: str = "none", **more: object) -> GossipConfig:
    return GossipConfig(algorithm=algorithm, topology="complete", compression=compression, **more)  # type: ignore[arg-type]


#: Generated schedules per algorithm in the default run, by codec: int8's runs cost two to three times as much.
EXAMPLES = {"none": 50, "int8": 25}


@pytest.mark.parametrize("algorithm", ALGORITHMS)
@pytest.mark.parametrize("compression", CODECS)
def test_no_schedule_of_faults_creates_or_destroys_mass(algorithm: str, compression: str) -> None:
    @settings(max_examples=EXAMPLES[compression], deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(n=st.integers(2, 5), seed=st.integers(0, 2**16), schedule=schedules())
    def check(n: int, seed: int, schedule: list[Op]) -> None:
        Nemesis(n, gossip(algorithm, compression), seed=seed).run(schedule)

    check()


@pytest.mark.slow  # 10 s of faults on one codec: `make test-slow`; the other nemesis schedules stay in the default run
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(n=st.integers(2, 5), seed=st.integers(0, 2**16), schedule=schedules())
def test_top_k_neighbor_averaging_makes_nothing_up_and_heals(n: int, seed: int, schedule: list[Op]) -> None:
    """CHOCO's per-edge references under faults: a refused, lost or dead member's edge never pulls forever."""
    Nemesis(n, gossip("neighbor", "topk:ratio=0.5"), seed=seed).run(schedule, heal_rounds=150)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])  # 600 heal rounds each
@given(n=st.integers(2, 6), seed=st.integers(0, 2**16), schedule=schedules())
def test_the_largest_accepted_outer_step_stays_in_its_box_and_heals(n: int, seed: int, schedule: list[Op]) -> None:
    """outer_lr 0.4, momentum 0.8 (step 2, config.MAX_OUTER_STEP): the extrapolation stays bounded, the peers agree."""
    Nemesis(n, gossip("local-sgd", outer_lr=0.4, outer_momentum=0.8, local_steps=2), seed=seed).run(schedule, heal_rounds=600)


def test_an_outer_step_past_the_limit_drifts_with_no_gradient() -> None:
    """Why 0.3/0.9 is refused: 6 peers, no fault, no local step, and the swarm leaves its box (config.MAX_OUTER_STEP)."""
    from gossiptrain import config

    setting = GossipConfig.__new__(GossipConfig)  # past validation, as the nemesis found it before the limit
    for name, value in vars(gossip("local-sgd", local_steps=1)).items():
        object.__setattr__(setting, name, value)
    object.__setattr__(setting, "outer_lr", 0.3)
    object.__setattr__(setting, "outer_momentum", 0.9)
    assert 0.3 / (1 - 0.9) > config.MAX_OUTER_STEP
    with pytest.raises(InvariantViolation, match="outside the initial models' box|from p0"):
        Nemesis(6, setting, seed=0).run([], heal_rounds=300)


def test_top_k_edges_of_a_member_that_died_or_went_silent_leave_the_mixing() -> None:
    """Found by the nemesis: 4 peers, queues of 2, each round one push refused; the stale references held them apart."""
    report = Nemesis(4, gossip("neighbor", "topk:ratio=0.5"), seed=0).run([], heal_rounds=50)
    assert report.refused_full > 0  # every round, the third push into a queue of 2 is refused
    ops: list[Op] = [SafePoint(i) for i in range(4) for _ in range(3)] + [Deliver(0)] * 12 + [Kill(3)]
    nemesis = Nemesis(4, gossip("neighbor", "topk:ratio=0.5"), seed=1, queue=8)
    nemesis.run(ops, heal_rounds=60)
    assert nemesis.report.killed == 1
    for machine in nemesis.machines[:3]:
        assert machine is not None and "p3" not in machine.choco.inn and "p3" not in machine.choco.out


@pytest.mark.slow
@pytest.mark.timeout(1800)  # 2,000 schedules of up to 200 faults: over the default 180 s on 2 busy cores
@pytest.mark.parametrize("algorithm", ALGORITHMS)
@settings(max_examples=2000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(n=st.integers(2, 8), seed=st.integers(0, 2**16), schedule=schedules(max_ops=200))
def test_soak_no_schedule_of_faults_creates_or_destroys_mass(algorithm: str, n: int, seed: int, schedule: list[Op]) -> None:
    Nemesis(n, gossip(algorithm), seed=seed).run(schedule)


def paused_past_the_timeout() -> list[Op]:
    """The issue's case: p1's loop pauses, p0 asks it, times out, asks again; p1 answers everything meanwhile."""
    ops: list[Op] = [SafePoint(0), SafePoint(1), Pause(1)]
    for _ in range(3):
        ops += [SafePoint(0, 0.5), Jump(11.0), Deliver(0), Deliver(0), SafePoint(0)]
    return ops + [Resume(1), SafePoint(1)]


@pytest.mark.parametrize("algorithm", CONSERVING)
def test_a_loop_paused_past_the_exchange_timeout_loses_nothing(algorithm: str) -> None:
    report = Nemesis(2, gossip(algorithm), seed=1).run(paused_past_the_timeout())
    assert report.checks > 10 and report.delivered > 0


def test_the_nemesis_catches_a_machine_that_drops_late_replies() -> None:
    """The invariant check can fail: pairwise as it was (late replies ignored) is caught on the pause schedule."""
    from gossiptrain.protocol.pairwise import PairwiseAveraging

    class DropsLateReplies(PairwiseAveraging):
        def _complete(self, msg, now):  # type: ignore[no-untyped-def]
            if msg.xid not in self._inflight:
                self.stats.late += 1
                return []
            return super()._complete(msg, now)

    nemesis = Nemesis(2, gossip("pairwise"), seed=1)
    nemesis.machines = [DropsLateReplies(nemesis.params[i], gossip("pairwise"), __import__("random").Random(i), me=nemesis.ids[i])
                        for i in range(2)]
    with pytest.raises(InvariantViolation, match="mass"):
        # p1's first request is refused (p0 has not started); p0 asks p1, times out, asks again; p1 answers both.
        nemesis.run([SafePoint(1), Deliver(0), Deliver(0), SafePoint(0), Jump(11.0), SafePoint(0)] + [Deliver(0)] * 4)
    # The same schedule against the real machine passes.
    Nemesis(2, gossip("pairwise"), seed=1).run([SafePoint(1), Deliver(0), Deliver(0), SafePoint(0), Jump(11.0), SafePoint(0)] + [Deliver(0)] * 4)


def test_the_nemesis_catches_a_push_sum_that_forgets_refused_pushes() -> None:
    from gossiptrain.protocol.push_sum import PushSum

    class Forgets(PushSum):
        def _take_back(self, msg):  # type: ignore[no-untyped-def]
            return []

    nemesis = Nemesis(2, gossip("push-sum"), seed=1, queue=1)
    nemesis.machines = [Forgets(nemesis.params[i], gossip("push-sum"), __import__("random").Random(i), me=nemesis.ids[i])
                        for i in range(2)]
    # p1 is paused with a full queue: p0's second push is refused, and the refusal comes back.
    with pytest.raises(InvariantViolation):
        nemesis.run([Pause(1), SafePoint(0), Deliver(0), SafePoint(0), Deliver(0), Deliver(0), Resume(1)])


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_deaths_failed_sends_and_full_queues_are_absorbed(algorithm: str) -> None:
    ops: list[Op] = []
    for r in range(6):
        ops += [SafePoint(i, 0.25) for i in range(4)] + [FailSend(r % 4), Deliver(3), Deliver(1)]
    ops += [Pause(2)] + [SafePoint(i) for i in (0, 1, 3) for _ in range(3)] + [Deliver(0)] * 6
    ops += [Kill(1), Deliver(0), Deliver(2), Jump(2.0), Resume(2)]
    report = Nemesis(4, gossip(algorithm), seed=5, queue=1).run(ops)
    assert report.killed == 1 and report.failed_sends > 0 and report.checks > 40
