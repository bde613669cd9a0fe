"""Flow control: a peer takes at most ``gossip.max_steps_ahead`` local steps past its last completed averaging.

Past the bound, its safe point waits for the exchange in flight (pairwise)
or for the receipt of its last push (push-sum, neighbour, local SGD: see
``gossiptrain.protocol.receipts``), never past that exchange's timeout; on a
fast link nothing waits. In the simulator (real state machines and drivers,
virtual time), so that links of any speed cost no wall time.
"""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gossiptrain.config import ALGORITHMS, GossipConfig, RunConfig
from gossiptrain.errors import ConfigError
from gossiptrain.net.transport.sim import LinkProfile
from gossiptrain.protocol.averaging import AUTO_STEPS_AHEAD
from gossiptrain.protocol.averaging_events import AtSafePoint, Received
from gossiptrain.protocol.pairwise import PairwiseAveraging
from gossiptrain.protocol.push_sum import PUSH_STEPS_AHEAD, PushSum
from gossiptrain.sim.cluster import Cluster, SimConfig
from gossiptrain.sim.faults import ChurnEvent
from gossiptrain.sim.vtime import run_virtual


def logreg(**overrides: Any) -> RunConfig:
    return RunConfig().with_overrides({"train.workload": "logreg", "train.max_steps": 0, **overrides})


def test_the_machine_holds_only_past_the_bound_and_never_past_the_exchange_deadline() -> None:
    params = {"w": torch.zeros(3)}
    a = PairwiseAveraging(params, GossipConfig(max_steps_ahead=3), random.Random(0), me="A")
    (req,) = a.handle(AtSafePoint(1, ["B"]), 0.0)
    (inflight,) = a._inflight.values()
    deadline = inflight.deadline
    assert a.hold_until(0.0) is None  # 1 step past the last merge (none yet, at step 0)
    a.handle(AtSafePoint(3, ["B"]), 0.1)
    assert a.hold_until(0.1) == deadline  # 3 steps: wait for the reply...
    assert a.hold_until(deadline) is None  # ...but not past its timeout
    a.handle(Received("B", "xrep", req.xid, {"w": torch.ones(3)}), 0.2)  # the reply, on the network side
    assert a.hold_until(0.2) is None and not a.busy
    assert PairwiseAveraging(params, GossipConfig(), random.Random(0)).max_ahead == AUTO_STEPS_AHEAD
    # push-sum's automatic bound is its own (half: a push moves one end where an exchange moves two); a set one wins
    assert PushSum(params, GossipConfig(algorithm="push-sum"), random.Random(0)).flow_bound() == PUSH_STEPS_AHEAD
    assert PushSum(params, GossipConfig(algorithm="push-sum", max_steps_ahead=9), random.Random(0)).flow_bound() == 9
    with pytest.raises(ConfigError, match="gossip.max_steps_ahead"):
        GossipConfig(max_steps_ahead=-1)


def run_cluster(config: SimConfig) -> Cluster:
    cluster = Cluster(config)
    run_virtual(cluster.run())
    return cluster


@pytest.mark.parametrize("algorithm", ALGORITHMS)
@settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    bandwidth=st.floats(3e3, 3e5),
    latency=st.floats(0.0, 0.05),
    bound=st.integers(1, 6),
    seed=st.integers(0, 1000),
)
def test_no_peer_runs_more_than_the_bound_past_its_last_merge_whatever_the_link(
    algorithm: str, bandwidth: float, latency: float, bound: int, seed: int
) -> None:
    """Checked at every safe point: no local step began past the bound with an exchange in flight before its timeout."""
    run = logreg(**{"train.shards": 4, "gossip.max_steps_ahead": bound, "gossip.topology": "complete",
                    "gossip.algorithm": algorithm})
    config = SimConfig(peers=4, run=run, duration=3.0, step_time=0.01, seed=seed, sample_every=1.0,
                       link=LinkProfile(latency=latency, bandwidth=bandwidth))
    peers = list(run_cluster(config).peers.values())
    for peer in peers:
        assert peer.averaging.stats.overran == 0, peer.averaging.stats
    # The links were slow enough to matter: on each of them someone waited (local SGD rounds are 8 steps apart).
    if bandwidth < 1e4:
        assert sum(p.averaging.stats.waits for p in peers) > 0


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_on_a_fast_link_nothing_waits(algorithm: str) -> None:
    run = logreg(**{"train.shards": 4, "gossip.algorithm": algorithm})  # the automatic bound
    config = SimConfig(peers=4, run=run, duration=3.0, step_time=0.01, seed=1, sample_every=1.0,
                       link=LinkProfile(latency=0.0005, bandwidth=1e9))
    peers = list(run_cluster(config).peers.values())
    done = [p.averaging.stats.completed if algorithm == "pairwise" else p.averaging.stats.served for p in peers]
    assert all(n > 30 for n in done), done
    assert sum(p.averaging.stats.waits for p in peers) == 0


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_a_crashed_partner_holds_no_one_longer_than_the_exchange_timeout(algorithm: str) -> None:
    run = logreg(**{"train.shards": 3, "gossip.max_steps_ahead": 1, "gossip.exchange_timeout_max": 1.0,
                    "gossip.topology": "complete", "gossip.algorithm": algorithm, "gossip.local_steps": 2,
                    "gossip.compression": "none"})  # (message sizes fixed: the crash lands with a request in flight)
    # Only a request in flight when its partner crashes waits out a timeout (a later one to the closed address is
    # refused at once), so the crash moves until it lands on one; every run must keep the bound either way.
    timed_out = False
    for crash_at in (2.0, 2.05, 2.1, 2.15, 2.2, 2.25, 2.3, 2.35):
        config = SimConfig(peers=3, run=run, duration=6.0, step_time=0.01, seed=2, sample_every=1.0,
                           link=LinkProfile(latency=0.002, bandwidth=2e4), churn_trace=(ChurnEvent(crash_at, 1, "crash"),))
        cluster = run_cluster(config)
        survivors = [cluster.peers[0], cluster.peers[2]]  # slot 1 crashed and stays down
        assert all(p.averaging.stats.longest_wait_s <= 1.0 + 0.01 for p in survivors)  # virtual seconds: one timeout
        assert all(p.averaging.stats.waits > 0 for p in survivors)
        # they did ask the crashed one (and gave that up at its timeout, or sooner: replies come much faster)
        timed_out = any(p.averaging.stats.timeouts + p.averaging.stats.presumed_lost > 0 for p in survivors)
        if algorithm != "pairwise" or timed_out:  # a push to a closed address is refused at once: no timeout there
            break
    assert algorithm != "pairwise" or timed_out, "no crash landed on a request in flight"


def test_no_waiting_for_a_partner_that_timed_out_lately() -> None:
    """A stopped partner costs one timeout; while it is avoided, an exchange with it (the only one) holds no one."""
    a = PairwiseAveraging({"w": torch.zeros(3)}, GossipConfig(max_steps_ahead=1), random.Random(0), me="A")
    a.handle(AtSafePoint(1, ["B"]), 0.0)
    a.handle(AtSafePoint(2, ["B"]), 0.1)
    deadline = a.hold_until(0.1)
    assert deadline is not None
    a.handle(AtSafePoint(3, ["B"]), deadline + 0.01)  # timed out: B is avoided; B is still the only partner
    assert a.busy and a.stats.timeouts == 1
    a.handle(AtSafePoint(4, ["B"]), deadline + 0.02)
    assert a.hold_until(deadline + 0.02) is None
