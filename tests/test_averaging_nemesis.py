"""The averaging nemesis: fault schedules against pairwise and push-sum, the mass checked after every event.

See ``gossiptrain.testing.averaging_nemesis`` for the faults and the invariant.
The default run plays 200 generated schedules in all (50 per algorithm and codec); the slow set
plays thousands.
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

ALGORITHMS = ("pairwise", "push-sum")
CODECS = ("none", "int8")


def gossip(algorithm: str, compression: str = "none") -> GossipConfig:
    return GossipConfig(algorithm=algorithm, topology="complete", compression=compression)


@pytest.mark.parametrize("algorithm", ALGORITHMS)
@pytest.mark.parametrize("compression", CODECS)
@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(n=st.integers(2, 5), seed=st.integers(0, 2**16), schedule=schedules())
def test_no_schedule_of_faults_creates_or_destroys_mass(algorithm: str, compression: str, n: int, seed: int, schedule: list[Op]) -> None:
    Nemesis(n, gossip(algorithm, compression), seed=seed).run(schedule)


@pytest.mark.slow
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


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_a_loop_paused_past_the_exchange_timeout_loses_nothing(algorithm: str) -> None:
    report = Nemesis(2, gossip(algorithm), seed=1).run(paused_past_the_timeout())
    assert report.checks > 10 and report.delivered > 0


def test_the_nemesis_catches_a_machine_that_drops_late_replies() -> None:
    """The invariant check can fail: pairwise as it was (late replies ignored) is caught on the pause schedule."""
    from gossiptrain.protocol.averaging import PairwiseAveraging

    class DropsLateReplies(PairwiseAveraging):
        def _complete(self, msg, now):  # type: ignore[no-untyped-def]
            if self._inflight is None or self._inflight.xid != msg.xid:
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
