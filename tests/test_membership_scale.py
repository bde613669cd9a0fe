"""SWIM at scale in the simulator: the real peer nodes on a lossy simulated network, membership only.

The slow version is the issue's acceptance run (1,000 peers, 1% message
loss); the default run has a 64-peer version of the same checks.
"""

from __future__ import annotations

from typing import Any

import pytest

from gossiptrain.config import RunConfig
from gossiptrain.net.transport.sim import LinkProfile
from gossiptrain.sim.cluster import Cluster, SimConfig
from gossiptrain.sim.faults import ChurnEvent
from gossiptrain.sim.vtime import run_virtual


def check_lossy_swarm(peers: int, crash_at: float, settle: float) -> None:
    """No live peer is ever declared dead; the crashed one leaves every view within ``dead_within(n)``."""
    run = RunConfig().with_overrides({"train.workload": "external"})
    bound = run.membership.dead_within(peers)
    duration = crash_at + bound + settle
    victim = peers // 2
    config = SimConfig(
        peers=peers, run=run, duration=duration, membership_only=True, sample_every=1.0,
        link=LinkProfile(loss=0.01), churn_trace=(ChurnEvent(crash_at, victim, "crash"),), seed=3,
    )
    cluster = Cluster(config)
    ids: dict[int, str] = {}
    views: dict[float, list[tuple[str, ...]]] = {}

    def on_sample(now: float, rows: list[dict[str, Any]]) -> None:
        for slot, p in cluster.peers.items():
            if p.node is not None:
                ids.setdefault(slot, p.node.me.id)
        views[now] = [p.node.view() for s, p in cluster.peers.items() if p.node is not None and s != victim]

    cluster.on_sample = on_sample
    run_virtual(cluster.run())

    gone = ids[victim]
    live = {mid for slot, mid in ids.items() if slot != victim}
    assert len(live) == peers - 1
    nodes = [p.node for s, p in cluster.peers.items() if p.node is not None and s != victim]
    wrongly = [(t, mid) for n in nodes for t, mid in n.deaths if mid in live]
    assert not wrongly, f"live peers declared dead: {wrongly[:5]}"
    verdicts = [t for n in nodes for t, mid in n.deaths if mid == gone]
    assert verdicts and max(verdicts) - crash_at <= bound  # each survivor that knew it decided for itself, in time
    for now, vs in views.items():
        if now >= crash_at + bound:
            assert all(gone not in v for v in vs), now
    final = views[max(views)]
    incomplete = [len(live - set(v)) for v in final if not set(v) >= live]
    assert not incomplete, f"{len(incomplete)} survivors miss members: {incomplete[:10]}"  # every survivor sees every other
    suspicions = sum(n.stats.members_suspected for n in nodes)
    assert suspicions > 0  # loss did cause suspicions, all refuted


def test_64_peers_with_one_percent_loss() -> None:
    check_lossy_swarm(64, crash_at=20.0, settle=10.0)


@pytest.mark.slow
@pytest.mark.timeout(7200)
def test_1000_peers_with_one_percent_loss() -> None:
    check_lossy_swarm(1000, crash_at=20.0, settle=5.0)
