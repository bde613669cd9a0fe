"""Every algorithm trains for real in the simulator (8 peers, digits-small), and topology matters under label skew.

The full algorithm x topology matrix and the Dirichlet ordering take minutes,
so they are marked slow (``make test-slow``); the default run trains each
algorithm once, each on a different topology.
"""

from __future__ import annotations

import pytest

import topologies
from gossiptrain.config import ALGORITHMS, GossipConfig, RunConfig
from gossiptrain.net.transport.sim import LinkProfile
from gossiptrain.protocol.push_sum import PushSum
from gossiptrain.sim.cluster import Cluster, SimConfig, simulate
from gossiptrain.sim.vtime import run_virtual

TOPOLOGIES = tuple(name for name in topologies.names() if name != "file")


def digits_run(algorithm: str, topology: str, seed: int = 1, **overrides: object) -> SimConfig:
    run = RunConfig().with_overrides(
        {
            "train.workload": "digits-small",  # learns as the 1.1M-parameter MLP does, at a tenth of the compute
            "train.shards": 8,
            "train.max_steps": 0,
            "train.eval_every_seconds": 0.5,
            "train.seed": seed,
            "gossip.topology": topology,
            "gossip.algorithm": algorithm,
            "gossip.local_steps": 4,
            **overrides,
        }
    )
    # Stops as soon as the mean accuracy of the live peers holds 0.9 for two samples.
    return SimConfig(
        peers=8, run=run, duration=20, step_time=0.01, seed=seed, sample_every=0.5, target_accuracy=0.9, target_hold=2
    )


def reaches_target(config: SimConfig) -> float:
    result = simulate(config)
    assert result.summary["time_to_target"] is not None, result.summary
    assert result.summary["mean_test_acc"] >= 0.9
    return float(result.summary["time_to_target"])


@pytest.mark.parametrize(
    ("algorithm", "topology"),
    [("pairwise", "ring"), ("push-sum", "one-peer-exponential"), ("neighbor", "torus"), ("local-sgd", "exponential")],
)
def test_each_algorithm_trains_digits_to_090(algorithm: str, topology: str) -> None:
    reaches_target(digits_run(algorithm, topology))


@pytest.mark.slow
@pytest.mark.parametrize("topology", TOPOLOGIES)
@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_every_algorithm_and_topology_trains_digits_to_090(algorithm: str, topology: str) -> None:
    reaches_target(digits_run(algorithm, topology))


@pytest.mark.slow
@pytest.mark.parametrize("seed", [1, 2])
def test_better_connected_topologies_hold_label_skewed_peers_closer_together(seed: int) -> None:
    """Dirichlet(0.1) shards: each peer sees mostly one or two classes, so mixing speed decides how far apart they are.

    Spectral gaps on 8 peers (`gossiptrain topology NAME --peers 8`): ring
    0.20, exponential 0.50, complete 1.0. This test once compared times to
    0.9 (4.5, 4.0 and 3.0 virtual s, seed 1); since drift correction and
    several exchanges in flight, every topology reaches it at the same
    sample (2.0 s) and the accuracies agree to the third digit, so what it
    compares now is the peers' mean consensus distance over the first 2
    virtual seconds (measured, seeds 1 and 2: ring 0.065 and 0.084,
    exponential 0.055 and 0.066, complete 0.052 and 0.066).
    """
    import dataclasses
    import statistics

    skew = {"train.partition": "dirichlet", "train.partition_alpha": 0.1, "train.eval_every_seconds": 0.25}
    apart = {}
    for topology in ("ring", "exponential", "complete"):
        config = dataclasses.replace(digits_run("pairwise", topology, seed=seed, **skew), duration=2.01, sample_every=0.25,
                                     target_accuracy=0.0)
        rows = simulate(config).rows
        apart[topology] = statistics.mean(r["consensus_distance"] for r in rows)
        assert statistics.mean(r["test_acc"] for r in rows if r["time"] == max(x["time"] for x in rows)) >= 0.9
    assert apart["complete"] < 0.9 * apart["ring"], apart
    assert apart["exponential"] < 0.9 * apart["ring"], apart


def test_local_sgd_with_outer_momentum_trains_and_a_diverging_setting_is_refused_by_name() -> None:
    """Outer Nesterov momentum at the largest accepted step trains; DiLoCo's 0.7/0.9 (every peer non-finite) is refused."""
    from gossiptrain.config import MAX_OUTER_MOMENTUM, MAX_OUTER_STEP, GossipConfig
    from gossiptrain.errors import ConfigError

    reaches_target(digits_run("local-sgd", "exponential", **{"gossip.outer_lr": 0.4, "gossip.outer_momentum": 0.8}))
    assert 0.4 / (1 - 0.8) == pytest.approx(MAX_OUTER_STEP) and MAX_OUTER_MOMENTUM == 0.8
    with pytest.raises(ConfigError, match=r"gossip.outer_momentum.*drifts.*stable: outer_lr 1.0 with outer_momentum 0.5"):
        GossipConfig(algorithm="local-sgd", outer_lr=0.7, outer_momentum=0.9)
    with pytest.raises(ConfigError, match=r"gossip.outer_momentum.*diverges.*stable: outer_lr 1.0 with outer_momentum 0.5"):
        GossipConfig(algorithm="local-sgd", outer_lr=0.7, outer_momentum=0.7)  # 2.33: momentum allowed, step not


def push_sum_weights(topology: str, seed: int = 0) -> list[float]:
    """Every push-sum peer's weight, every 0.025 virtual s, over 0.5 s: 4 peers on 3 classes each, 4 ms links."""
    run = RunConfig().with_overrides({
        "train.workload": "digits-small", "train.shards": 4, "train.partition": "classes-per-peer",
        "train.partition_classes": 3, "train.max_steps": 0, "train.max_seconds": 0, "train.seed": seed,
        "train.eval_every_seconds": 100, "gossip.algorithm": "push-sum", "gossip.topology": topology,
    })
    seen: list[float] = []

    def on_sample(now: float, rows: list[dict[str, object]]) -> None:
        seen.extend(p.averaging.weight for p in cluster.peers.values() if isinstance(p.averaging, PushSum))

    cluster = Cluster(SimConfig(peers=4, run=run, duration=0.5, seed=seed, step_time=0.002, wait_for=4, join_spread=0.0,
                                link=LinkProfile(latency=0.004, bandwidth=1.25e8), sample_every=0.025), on_sample=on_sample)
    run_virtual(cluster.run())
    assert len(seen) >= 4 * 15
    return seen


def test_push_sum_weights_stay_balanced_on_its_own_graph() -> None:
    """The default topology gives push-sum the one-peer exponential graph, where each member hears from one member
    per round as it pushes to one: weights stay near 1 (0.5-1.0). Partners drawn at random from the static graph let
    them wander (down to 0.07-0.17 and up to 1.75-1.95 over 0.5 s, seeds 0-2; out of 0.5-2.0 within 0.15 s), and a
    member with little weight trains on its own classes alone."""
    assert GossipConfig(algorithm="push-sum").topology_spec == "one-peer-exponential"
    balanced = push_sum_weights("auto")
    assert 0.5 <= min(balanced) and max(balanced) <= 2.0, (min(balanced), max(balanced))
    wandering = push_sum_weights("exponential")
    assert min(wandering) < 0.5 or max(wandering) > 2.0, (min(wandering), max(wandering))
