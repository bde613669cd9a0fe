"""Leased data on real peers (``Peer.sampler``): loopback, each peer on its own 127.0.0.x, one of them killed."""

from __future__ import annotations

import signal
import threading
import time
from typing import Any

import pytest
import torch

from gossiptrain.errors import GossipError
from gossiptrain.runtime.peer import Peer
from gossiptrain.state.checkpoint import latest_good

from .conftest import fast_config
from .swarm import next_host, wait_for

SAMPLES = 3000
# No exchanges and no state download: the data is what is tested. Lease gossip fast enough for a short test.
QUIET = {"train.workload": "external", "gossip.exchange_every_steps": 2 * 10**9, "state.enabled": False,
         "data.gossip_interval": 0.05, "data.lease_time": 2.0}


class Trainer(threading.Thread):
    """A user's loop over ``peer.sampler``: counts each index it is given, steps every 32, paced to ``pace``/s."""

    def __init__(self, peer: Peer, counts: list[int], lock: threading.Lock, pace: float) -> None:
        super().__init__(daemon=True)
        self.peer, self.counts, self.lock, self.pace = peer, counts, lock, pace
        self.stop = threading.Event()
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            sampler = self.peer.sampler(SAMPLES)
            n = 0
            while not self.stop.is_set():
                for i in sampler:
                    with self.lock:
                        self.counts[i] += 1
                    n += 1
                    if n % 32 == 0:
                        self.peer.step()
                        time.sleep(32 / self.pace)
                    if self.stop.is_set():
                        return
        except GossipError:
            if not self.stop.is_set():
                raise
        except BaseException as e:  # the test reads it
            self.error = e


@pytest.mark.timeout(90)
def test_a_killed_peers_chunks_are_trained_by_the_others_and_every_sample_once_an_epoch(coordinator_factory: Any) -> None:
    coord = coordinator_factory(fast_config(**QUIET))
    join = coord.address.removeprefix("tcp://")
    peers = [Peer(torch.nn.Linear(4, 2), join=join, bind=f"{next_host()}:0", transfer_state=False) for _ in range(3)]
    counts, lock = [0] * SAMPLES, threading.Lock()
    trainers = [Trainer(p, counts, lock, pace) for p, pace in zip(peers, (3000.0, 3000.0, 1500.0))]
    try:
        assert [p.wait_for_peers(3, timeout=30) for p in peers] == [3, 3, 3]
        for t in trainers:
            t.start()
        victim = peers[2]
        # Mid-epoch: the victim holds chunks it has started, and has finished some.
        wait_for(lambda: victim.stats().get("chunks_done", 0) >= 5 and victim.stats().get("lease_chunks_held", 0) > 0,
                 30, "the victim to train some chunks")
        held = [g for g, _ in victim._node.leases.position()["held"]]
        epoch_then = peers[0].stats()["lease_epoch"]
        trainers[2].stop.set()
        victim._teardown()  # killed: no leave, its claims stand until membership finds it dead
        # On until both survivors' floors pass the victim's highest chunk (a peer holds up to 2 s of claims ahead,
        # which with chunks of 130 samples can reach epochs past the floor) and an epoch has finished since.
        wait_for(lambda: min(p._node.leases.machine.table.floor for p in peers[:2]) > max(held)
                 and peers[0].stats()["lease_epoch"] > epoch_then, 60, "the survivors past the victim's chunks",
                 state=lambda: str({k: v for k, v in peers[0].stats().items() if "lease" in k or "chunks" in k}))
        with lock:
            seen = list(counts)
        finished = min(p.stats()["lease_epoch"] for p in peers[:2])
        done = [all(p._node.leases.machine.table.is_done(g) for g in held) for p in peers[:2]]
        twice = sum(p.stats()["samples_trained_twice"] for p in peers[:2])
    finally:
        for t in trainers:
            t.stop.set()
        for p in peers:
            p.close()
        for t in trainers:
            t.join(10)
    assert not [t.error for t in trainers if t.error is not None]
    # Every sample was trained in each finished epoch: the victim's chunks too, taken over by the others.
    assert min(seen) >= finished
    # The chunks the victim held when it died (taken over if its claims had spread, else simply claimed) are done.
    assert held and done == [True, True]
    # Samples trained twice: claims that crossed (the victim's own it had started are not counted by anyone).
    assert twice <= 0.05 * sum(seen)


@pytest.mark.timeout(60)
def test_peers_leasing_different_datasets_ignore_each_others_tables(coordinator_factory: Any) -> None:
    coord = coordinator_factory(fast_config(**QUIET))
    join = coord.address.removeprefix("tcp://")
    a, b = (Peer(torch.nn.Linear(4, 2), join=join, bind=f"{next_host()}:0", transfer_state=False) for _ in range(2))
    try:
        assert [p.wait_for_peers(2, timeout=30) for p in (a, b)] == [2, 2]
        sa, sb = a.sampler(1000), b.sampler(2000)
        next(iter(sa)), next(iter(sb))
        wait_for(lambda: a._node.leases.refused > 0 and b._node.leases.refused > 0, 20, "each to refuse the other's table")
        with pytest.raises(ValueError, match="1000 samples, not 5"):
            a.sampler(5)
    finally:
        a.close()
        b.close()


@pytest.mark.timeout(120)
def test_cli_peers_with_leased_data_go_on_through_epochs_when_one_is_killed(procs: Any, coordinator_factory: Any) -> None:
    """`gossiptrain peer --data leased`: three processes lease digits-small's chunks; one is killed (SIGKILL)."""
    config = fast_config(**{"train.max_steps": 0, "train.max_seconds": 30.0, "data.mode": "leased",
                            "data.gossip_interval": 0.05, "data.lease_time": 2.0})
    coord = coordinator_factory(config)
    join = coord.address.removeprefix("tcp://")
    peers = [procs.peer(join, "--wait-for", "3") for _ in range(3)]
    epoch = lambda p: (p.latest() or {}).get("lease_epoch", 0)  # noqa: E731
    procs.wait_for(lambda: all(epoch(p) >= 2 for p in peers), 60, "every peer to see epoch 2")
    peers[2].kill()
    then = max(epoch(p) for p in peers[:2])
    procs.wait_for(lambda: all(epoch(p) >= then + 5 for p in peers[:2]), 60, "five more epochs without the killed peer")
    for p in peers[:2]:
        p.signal(2)  # Ctrl+C: each ends its run, says so in its last record, and exits 130
    for p in peers[:2]:
        assert p.wait(30) == 130, p.output()
        last = p.records("done")[0]
        assert last["lease_epoch"] >= then + 5 and last["chunks_done"] > 0, last
        assert last["samples_trained_twice"] <= 0.05 * last["step"] * config.train.batch_size, last


@pytest.mark.timeout(120)
def test_a_killed_cli_peer_resumed_from_its_checkpoint_takes_back_its_chunks(procs: Any, coordinator_factory: Any, tmp_path: Any) -> None:
    """The command line's part: the checkpoint holds the data position and ``--resume`` hands it to the leases.

    The peer trains alone, so nobody else can win its chunks meanwhile (with another peer training, a chunk the
    checkpoint lists may have gone to it in a race the checkpoint predates: then it is rightly not taken back;
    the core's tests cover the swarm's side, tests/test_leases.py).
    """
    # Two chunks an epoch (720 samples, 22 steps each) and a slowed peer: the chunk it holds at a checkpoint is
    # seconds from done, so stopping it just after one leaves that chunk unfinished, to be taken back.
    config = fast_config(**{"train.max_steps": 0, "train.max_seconds": 60.0, "data.mode": "leased", "data.chunks": 2,
                            "data.gossip_interval": 0.05, "data.ahead_seconds": 0.5})
    coord = coordinator_factory(config)
    join = coord.address.removeprefix("tcp://")
    ckpt = tmp_path / "ck"
    victim = procs.peer(join, "--slowdown", "40", "--checkpoint-dir", str(ckpt), "--checkpoint-every-steps", "1", name="victim")
    procs.wait_for(lambda: len(victim.records("checkpoint")) >= 3, 60, "three checkpoints")
    victim.signal(signal.SIGSTOP)  # frozen between two steps (or in one): its newest checkpoint is at most a step old
    saved = latest_good(ckpt).info.data
    victim.kill()
    assert saved is not None and saved["plan"][:2] == [1437, 2] and saved["held"], saved
    again = procs.peer(join, "--resume", str(ckpt), name="again")
    procs.wait_for(lambda: (again.latest() or {}).get("chunks_done", 0) >= 1, 60, "the resumed peer to finish a chunk")
    rec = again.latest() or {}
    assert rec["chunks_resumed"] == len(saved["held"]), (saved, rec)  # every chunk it held, from where it was
    again.signal(signal.SIGINT)
    assert again.wait(30) == 130


def test_a_swarm_that_runs_through_its_lease_window_faster_than_gossip_is_told_so_once(caplog: Any) -> None:
    """Many fast peers on a small dataset cut into small chunks: the window holds a fraction of a second of the
    swarm's work and peers wait for chunks. The peer says so once, naming the setting that helps."""
    import logging
    import random

    from gossiptrain.config import DataConfig
    from gossiptrain.protocol.leases import Claim
    from gossiptrain.runtime.leased_data import WARN_AFTER_WAITS, LeaseClient, plan_for

    now = [0.0]
    client = LeaseClient("me", plan_for(1437, DataConfig(mode="leased"), 0), DataConfig(mode="leased"),
                         live=lambda: ["me", "other"], now=lambda: now[0], rng=random.Random(0))
    table = client.machine.table
    caplog.set_level(logging.WARNING, logger="gossiptrain.runtime.leased_data")
    for _ in range(WARN_AFTER_WAITS + 20):
        # The other member holds every chunk of the window (it renews, so nothing lapses), and the floor rises
        # by 4,000 chunks a second: the window of 4,096 chunks holds about 1 s of the swarm's work.
        table.beat("other", int(now[0] * 100) + 1)
        for g in range(table.floor, table.floor + table.window):
            table.claims.setdefault(g, Claim(0, "other"))
        assert client.holding(32) == []
        now[0] += 0.02
        table.floor += 80  # 4,000 chunks a second
        table.claims = {g: c for g, c in table.claims.items() if g >= table.floor}
    warnings = [r.getMessage() for r in caplog.records if "window" in r.getMessage()]
    assert len(warnings) == 1 and "data.chunks, now 11 an epoch" in warnings[0], warnings
    assert 0.5 < client.machine.window_seconds(now[0]) < 2.0  # type: ignore[operator]


def test_a_sampler_pass_is_one_epoch_and_counts_what_it_gave_even_when_the_loop_breaks() -> None:
    """A lone member's pass: every index of the epoch once, the pass ending with the epoch; the samples a loop
    took before it broke off are counted as trained (a chunk's last report rides on the next claim)."""
    import random

    from gossiptrain.config import DataConfig
    from gossiptrain.runtime.leased_data import LeaseClient, LeasedSampler, plan_for

    config = DataConfig(mode="leased", chunks=7)
    client = LeaseClient("me", plan_for(1000, config, 0), config, live=lambda: ["me"], now=time.monotonic,
                         rng=random.Random(0))
    sampler = LeasedSampler(client, lambda: 1)
    first = list(sampler)
    assert sorted(first) == list(range(1000)) and client.machine.epoch == 1
    assert client.stats()["samples_trained"] == 1000
    second = list(sampler)
    assert sorted(second) == list(range(1000)) and second != first  # epoch 1's shuffle
    taken = []
    for i in sampler:
        taken.append(i)
        if len(taken) == 150:  # mid-chunk (chunks of 142-143)
            break
    assert client.stats()["samples_trained"] == 2150
    assert sorted(taken + list(sampler)) == list(range(1000))  # the pass after the break goes on from there
