"""Averaging loses nothing when a training loop pauses: real peers over TCP, no optimizer steps.

Each peer holds a ``Linear(64, 10)`` from its own seed and its loop only calls
``peer.step()`` every 5 ms, so averaging alone moves the models: they must
meet at the mean of the initial models. One loop stops calling ``step()`` for
3 s, three times the longest exchange timeout (as a loop that evaluates,
saves a checkpoint or waits for data does). Before requests were answered
on the network side, the paused peer later served requests whose senders had
timed out and given up, and the swarm converged 0.66 of the initial spread
away from the mean (2 peers; 0.17 with 4).
"""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
import torch

from gossiptrain import Peer

from .conftest import fast_config
from .swarm import next_host, wait_for

PAUSE = 3.0


class Loop:
    """A training loop without training: a safe point every 5 ms; ``pause`` seconds without one at the start."""

    def __init__(self, peer: Peer, pause: float = 0.0) -> None:
        self.peer, self.pause = peer, pause
        self.halt = threading.Event()
        self.paused = threading.Event()  # set while the pause lasts
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()

    def run(self) -> None:
        try:
            self.peer.step()  # one safe point first: a peer serves no one before it
            if self.pause:
                self.paused.set()
                self.halt.wait(self.pause)
                self.paused.clear()
            while not self.halt.is_set():
                self.peer.step()
                time.sleep(0.005)
        except BaseException as e:  # re-raised by the test
            self.error = e


def flat(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().double().flatten() for p in model.parameters()])


def settled(peer: Peer) -> torch.Tensor:
    """The peer's model with every merge it has made applied, and every replay drift correction still owes.

    Pairwise keeps merges made since the last safe point in ``pending``; drift
    correction (``gossiptrain.protocol.drift``) will replay each of them ``gain``
    times more, and still owes ``owed()`` of those already applied.
    """
    averaging: Any = peer._averaging
    drift = peer._safepoint.drift
    gain = drift.gain if drift is not None else 0.0
    owed = drift.owed() if drift is not None else [torch.zeros_like(p) for p in peer.model.parameters()]
    return torch.cat([(p.detach().double() + (1 + gain) * d.double() + o.double()).flatten()
                      for p, d, o in zip(peer.model.parameters(), averaging.pending, owed)])


@pytest.mark.timeout(120)
@pytest.mark.parametrize("n", [2, pytest.param(4, marks=pytest.mark.slow)])  # 4 peers: `make test-slow`
def test_a_paused_loop_costs_nothing_and_the_swarm_meets_at_the_initial_mean(coordinator_factory: Any, n: int) -> None:
    config = fast_config(**{
        "train.workload": "external", "train.shards": n, "state.enabled": False,
        "gossip.exchange_timeout_max": 1.0,  # so that the pause is three times the longest timeout
    })
    coord = coordinator_factory(config)
    join = coord.address.removeprefix("tcp://")
    models = []
    for seed in range(n):
        torch.manual_seed(seed)
        models.append(torch.nn.Linear(64, 10))
    initial = torch.stack([flat(m) for m in models])  # (n, 650)
    mean0 = initial.mean(0)
    spread = float((initial - mean0).norm(dim=1).max())
    peers = [Peer(m, join=join, bind=f"{next_host()}:0", transfer_state=False) for m in models]
    loops: list[Loop] = []
    try:
        wait_for(lambda: all(p.members == n for p in peers), 30, f"all {n} peers to see each other")
        loops = [Loop(peers[0], pause=PAUSE)] + [Loop(p) for p in peers[1:]]
        wait_for(loops[0].paused.is_set, 30, "the first loop to pause")
        served_before = peers[0].stats()["served"]
        # While its loop is paused, the paused peer answers its partners: their exchanges with it complete.
        wait_for(lambda: peers[0].stats()["served"] >= served_before + 5 or not loops[0].paused.is_set(), 30,
                 "the paused peer to serve requests")
        assert loops[0].paused.is_set(), "the pause ended before the paused peer had served 5 requests"
        assert peers[0].steps == 1  # still paused: every answer came from its network side
        wait_for(lambda: not loops[0].paused.is_set(), 30, "the pause to end")

        def close_together() -> bool:
            models_now = torch.stack([flat(p.model) for p in peers])
            return float((models_now - models_now.mean(0)).norm(dim=1).max()) < 1e-4 * spread

        wait_for(close_together, 60, "the models to meet")
    finally:
        for loop in loops:
            loop.halt.set()
        for loop in loops:
            loop.thread.join(30)
    try:
        for loop in loops:
            assert loop.error is None, loop.error
        # No loop starts an exchange now; those in flight finish within a round trip.
        wait_for(lambda: not any(p._averaging.busy for p in peers), 30, "the exchanges in flight to finish")
        final = torch.stack([settled(p) for p in peers])
        drift = float((final.mean(0) - mean0).norm()) / spread
        assert drift < 1e-5, f"the swarm's mean moved by {drift:.3g} of the initial spread"
        assert sum(p.stats()["timeouts"] for p in peers) == 0  # nobody waited for the paused loop
        assert sum(p.stats()["abandoned"] for p in peers) == 0
    finally:
        for p in peers:
            p.close()
