"""The simulator: the real peer logic in virtual time, reproducible, with faults on a schedule."""

from __future__ import annotations

import json
from typing import Any

import pytest

from gossiptrain.config import RunConfig
from gossiptrain.errors import ConfigError
from gossiptrain.sim.cluster import Cluster, SimConfig, simulate
from gossiptrain.sim.faults import ChurnEvent, PartitionSpec
from gossiptrain.sim.vtime import run_virtual

from .test_cli import run_cli


def logreg(**overrides: Any) -> RunConfig:
    return RunConfig().with_overrides({"train.workload": "logreg", "train.max_steps": 0, **overrides})


def members_only(**overrides: Any) -> RunConfig:
    return RunConfig().with_overrides({"train.workload": "external", **overrides})


def test_same_seed_same_run_other_seed_other_run() -> None:
    config = SimConfig(peers=4, run=logreg(**{"train.shards": 4}), duration=2, step_time=0.01, seed=7)
    first, second = simulate(config), simulate(config)
    assert first.rows and first.rows == second.rows
    other = simulate(SimConfig(peers=4, run=logreg(**{"train.shards": 4}), duration=2, step_time=0.01, seed=8))
    assert other.rows != first.rows
    assert first.summary["mean_test_acc"] > 0.8  # real learning happened, in virtual time (0.957 at 2 s)


def steps_by_peer(rows: list[dict[str, Any]]) -> dict[int, int]:
    last = max(r["time"] for r in rows)
    return {r["peer"]: r["step"] for r in rows if r["time"] == last}


def test_a_straggler_slows_only_itself_under_pairwise_averaging() -> None:
    # At 2.5 virtual s the others run at 1.005x their even pace and the straggler at 0.264x theirs (4 s: 1.003, 0.259).
    base = dict(peers=6, run=logreg(**{"train.shards": 6}), duration=2.5, step_time=0.01, seed=1, join_spread=0.1)
    even = steps_by_peer(simulate(SimConfig(**base)).rows)
    uneven = steps_by_peer(simulate(SimConfig(**base, speeds=(4.0, 1, 1, 1, 1, 1))).rows)
    fast = [uneven[p] for p in range(1, 6)]
    assert min(fast) >= 0.9 * min(even[p] for p in range(1, 6))  # the others are not held back
    assert uneven[0] <= 0.3 * min(fast)  # the straggler is about 4x slower


def test_a_partition_splits_membership_and_it_re_merges_after_the_heal() -> None:
    run = members_only(**{"membership.heartbeat_interval": 0.5})
    config = SimConfig(peers=8, run=run, duration=70, membership_only=True, partitions=(PartitionSpec(10, 40),))
    result = simulate(config)
    during = [r for r in result.rows if 10 + run.membership.dead_within(8) <= r["time"] < 40]
    after = [r for r in result.rows if r["time"] == max(r["time"] for r in result.rows)]
    assert during and all(r["members"] == 4 for r in during)  # each side sees only itself
    assert after and len(after) == 8 and all(r["members"] == 8 for r in after)


def test_a_crashed_peer_is_removed_from_every_view_and_readmitted_after_rejoining() -> None:
    run = members_only(**{"membership.heartbeat_interval": 0.5})
    trace = (ChurnEvent(5.0, 2, "crash"), ChurnEvent(30.0, 2, "join"))
    config = SimConfig(peers=6, run=run, duration=45, membership_only=True, churn_trace=trace)
    cluster = Cluster(config)
    seen: dict[float, dict[int, tuple[str, ...]]] = {}
    crashed_id: list[str] = []

    def on_sample(now: float, rows: list[dict[str, Any]]) -> None:
        seen[now] = {s: p.node.view() for s, p in cluster.peers.items() if p.node is not None}
        if now == 4.0:
            crashed_id.append(cluster.peers[2].node.me.id)

    cluster.on_sample = on_sample
    run_virtual(cluster.run())
    gone = crashed_id[0]
    bound = 5.0 + run.membership.dead_within(6)
    assert bound < 30
    for now, views in seen.items():
        if bound <= now < 30:
            assert 2 not in views and all(gone not in v for v in views.values()), (now, views)
    final = seen[max(seen)]
    assert len(final) == 6 and all(len(v) == 6 for v in final.values())
    rejoined = cluster.peers[2].node.me.id
    assert rejoined != gone and all(rejoined in v for v in final.values())


def test_churn_from_a_rate_is_reproducible_and_training_goes_on() -> None:
    # The same expected churn as 20 virtual s at 0.3/s (about six crashes, each peer down for 3/8 of the run) in 4 s,
    # each crash back 1.5 s later: seeds 0-3 give 5-7 crashes and a mean accuracy of 0.952-0.956 (8 s at 0.75/s, back
    # after 3 s: 5-7 and 0.952-0.957; 20 s: 4-7 and 0.953-0.960), at a fraction of the wall time.
    config = SimConfig(peers=6, run=logreg(**{"train.shards": 6}), duration=4, step_time=0.01, churn_rate=1.5,
                       churn_downtime=1.5)
    a, b = simulate(config), simulate(config)
    assert a.summary["crashes"] > 0 and a.rows == b.rows
    assert a.summary["mean_test_acc"] > 0.8


def test_invalid_simulation_settings_name_the_field() -> None:
    with pytest.raises(ConfigError, match="sim.speeds"):
        SimConfig(peers=3, speeds=(1.0, 2.0))
    with pytest.raises(ConfigError, match="partition"):
        PartitionSpec.parse("10")
    with pytest.raises(ConfigError, match="sim.churn_trace"):
        SimConfig(peers=2, churn_trace=(ChurnEvent(1.0, 5, "crash"),))


def test_simulate_command_prints_a_json_summary(tmp_path: Any) -> None:
    out = tmp_path / "series.csv"
    result = run_cli(
        "simulate", "--peers", "4", "--workload", "logreg", "--duration", "2", "--step-time", "0.01",
        "--stragglers", "0.25:4", "--wait-for", "4", "--eval-time", "0.002", "--step-jitter", "0.2", "--out", str(out), "--json",
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    assert summary["peers"] == 4 and summary["virtual_seconds"] == pytest.approx(2.0)
    header = out.read_text().splitlines()[0].split(",")
    assert {"time", "peer", "step", "test_acc", "consensus_distance", "bytes_sent", "staleness_mean", "started", "refused"} <= set(header)


def test_a_very_slow_peer_answers_every_request_at_once_and_blocks_no_one() -> None:
    # The slow peer's safe point comes every 0.8 s; pairwise requests are answered on its network side
    # meanwhile, so its partners never wait for its loop (before: its queue filled, the rest were refused).
    run = logreg(**{"train.shards": 6, "gossip.topology": "complete", "limits.averaging_queue": 1})
    config = SimConfig(peers=6, run=run, duration=4, step_time=0.01, speeds=(80.0, 1, 1, 1, 1, 1), seed=3)
    cluster = Cluster(config)
    run_virtual(cluster.run())
    slow = cluster.peers[0]
    fast = [cluster.peers[s] for s in range(1, 6)]
    assert slow.node is not None and slow.node.stats.exchange_queue_full == 0
    assert slow.averaging is not None and slow.averaging.stats.served > 10 * slow.trainer.steps  # many per safe point
    assert sum(p.averaging.stats.timeouts for p in fast if p.averaging) == 0  # nobody waited for the slow loop
    steps = [p.trainer.steps for p in fast if p.trainer]
    assert min(steps) >= 0.9 * (config.duration - config.join_spread) / 0.01 * 0.5  # the fast peers kept stepping


def test_a_very_slow_push_sum_peer_refuses_what_it_cannot_take_and_the_mass_comes_back() -> None:
    # Pushes wait for the receiver's safe point in a queue of one: the rest are refused at once, with their mass.
    run = logreg(**{"train.shards": 6, "gossip.topology": "complete", "gossip.algorithm": "push-sum",
                    "limits.averaging_queue": 1})
    config = SimConfig(peers=6, run=run, duration=4, step_time=0.01, speeds=(80.0, 1, 1, 1, 1, 1), seed=3)
    cluster = Cluster(config)
    run_virtual(cluster.run())
    slow = cluster.peers[0]
    fast = [cluster.peers[s] for s in range(1, 6)]
    assert slow.node is not None and slow.node.stats.exchange_queue_full > 0  # its queue filled
    assert sum(p.averaging.stats.refused for p in fast if p.averaging) > 0  # ...and the pushers were told at once
    assert sum(p.averaging.stats.lost for p in fast if p.averaging) == 0  # ...and took every refused push back
    steps = [p.trainer.steps for p in fast if p.trainer]
    assert min(steps) >= 0.9 * (config.duration - config.join_spread) / 0.01 * 0.5


def test_a_topology_that_cannot_exist_at_this_size_is_refused_before_anything_starts() -> None:
    with pytest.raises(ConfigError, match="random-regular.*degree=6 needs at least 7 peers"):
        SimConfig(peers=4, run=logreg(**{"gossip.topology": "random-regular:degree=6"}))
    SimConfig(peers=4, run=members_only(**{"gossip.topology": "random-regular:degree=6"}), membership_only=True)


def test_with_wait_for_no_peer_trains_before_the_swarm_is_complete() -> None:
    # Peers join over 2 virtual s; with the start line each waits for all four, as `peer --wait-for 4` does.
    base = dict(peers=4, run=logreg(**{"train.shards": 4}), duration=2.5, step_time=0.01, seed=2, join_spread=2.0,
                sample_every=0.25)
    free = simulate(SimConfig(**base)).rows
    lined = simulate(SimConfig(**base, wait_for=4)).rows
    starts_free = {r["peer"]: r["started"] for r in free if "started" in r}
    starts_lined = {r["peer"]: r["started"] for r in lined if "started" in r}
    ready = {r["peer"]: r["ready"] for r in lined if "ready" in r}  # joined and past the state download
    assert len(starts_lined) == len(ready) == 4
    assert min(starts_free.values()) < 1.0  # without it the first peer starts alone
    assert min(starts_lined.values()) >= max(ready.values()) >= 1.5  # the last one joins at 1.5 s
    # The first to count four tells the others at once (gossiptrain.protocol.rendezvous): a message, not a round.
    assert max(starts_lined.values()) - min(starts_lined.values()) < 0.05


def test_evaluation_time_and_step_jitter_cost_virtual_time_and_stay_reproducible() -> None:
    base = dict(peers=3, run=logreg(**{"train.shards": 3, "train.eval_every_seconds": 0.1}), duration=2, step_time=0.01, seed=4)
    plain = steps_by_peer(simulate(SimConfig(**base)).rows)
    evaluating = steps_by_peer(simulate(SimConfig(**base, eval_time=0.05)).rows)
    # an evaluation every 0.1 s costing 0.05 s: about a third of the time goes to evaluating
    assert all(evaluating[p] < 0.8 * plain[p] for p in plain)
    jittery = SimConfig(**base, step_jitter=0.5)
    first, second = simulate(jittery), simulate(jittery)
    assert first.rows == second.rows
    jittered = steps_by_peer(first.rows)
    assert jittered != plain  # step times vary...
    assert all(0.7 * plain[p] < jittered[p] < 1.3 * plain[p] for p in plain)  # ...around the same mean
    with pytest.raises(ConfigError, match="step_jitter"):
        SimConfig(step_jitter=-1)
    with pytest.raises(ConfigError, match="wait_for"):
        SimConfig(peers=2, wait_for=3)
