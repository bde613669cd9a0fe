"""End to end on loopback: a coordinator and real peer processes training digits."""

from __future__ import annotations

import signal
import socket
import time
from typing import Any, Callable

import pytest
import zmq

from gossiptrain.net.addressing import parse_hostport

from .conftest import fast_config
from .swarm import Procs, next_host


def members_everywhere(peers: list[Any], n: int) -> Callable[[], bool]:
    return lambda: all((p.latest() or {}).get("members") == n for p in peers)


def steps_of(p: Any) -> int:
    return (p.latest() or {}).get("step", 0)


def send_garbage(host_port: str) -> None:
    """Raw bytes that are not ZMTP, then a valid ZeroMQ message that is not a gossiptrain message."""
    host, port = parse_hostport(host_port)
    with socket.create_connection((host, port), timeout=5) as s:
        s.sendall(b"\xff\x00\x00\x00\x00\x00\x00\x00\x09\x7fGARBAGE" * 64)
    ctx = zmq.Context()
    try:
        dealer = ctx.socket(zmq.DEALER)
        dealer.linger = 1000
        dealer.connect(f"tcp://{host}:{port}")
        dealer.send_multipart([b"\x93not a header", b"\x00" * 100])
        dealer.send_multipart([b"\xc1"])
        dealer.close()
    finally:
        ctx.term()


def train_three_peers(procs: Procs, coordinator_factory: Any, steps: int, **overrides: object) -> list[dict[str, Any]]:
    """Three `gossiptrain peer` processes train digits for ``steps``; their "done" records."""
    coord = coordinator_factory(fast_config(**{"train.shards": 3, "train.max_steps": steps, **overrides}))
    join = coord.address.removeprefix("tcp://")
    # They start together (the rendezvous): a peer starting alone could take its few hundred steps, a
    # fraction of a second, before the others joined, and end with no exchange at all.
    peers = [procs.peer(join, "--wait-for", "3") for _ in range(3)]
    procs.wait_for(lambda: all(p.records("done") for p in peers) or any(not p.alive() for p in peers), 150, "3 peers to finish")
    for p in peers:
        assert p.wait(30) == 0, p.output()
    assert coord.coordinator.stats.joins_answered == 3
    return [p.records("done")[0] for p in peers]


@pytest.mark.slow  # the same command-line path trains 4 peers to 0.95 in the default run (test_cli's demo test); 8 s
def test_three_peers_train_digits_to_093(procs: Procs, coordinator_factory: Any) -> None:
    done = train_three_peers(procs, coordinator_factory, 500)
    for d in done:
        assert d["test_acc"] >= 0.93 and d["step"] == 500 and d["exchanges"] > 0, d
        assert d["waited_s"] >= 0 and d["compression_level"] in (0, 1, 2), d  # flow control and auto, in every line
    assert sorted(d["shard"] for d in done) == [0, 1, 2]


@pytest.mark.parametrize(("algorithm", "compression"), [("push-sum", "int8"), ("neighbor", "fp16")])
def test_other_algorithms_train_over_tcp_with_compression(
    procs: Procs, coordinator_factory: Any, algorithm: str, compression: str
) -> None:
    overrides = {"gossip.algorithm": algorithm, "gossip.compression": compression}
    for d in train_three_peers(procs, coordinator_factory, 300, **overrides):
        assert d["test_acc"] >= 0.9 and d["exchanges"] > 0 and d["dropped"] == 0, d


@pytest.mark.timeout(300)  # four tests' worth of waits, each bounded as before
def test_one_swarm_counts_garbage_survives_a_pause_sees_a_clean_leave_and_drops_a_killed_peer(
    procs: Procs, coordinator_factory: Any
) -> None:
    """Four peers of one swarm through four events, in order; each stage checks what a test of its own did.

    One swarm instead of three (a 3-peer one for the kill, a 2-peer one for the leave, a 3-peer one for
    the pause): starting peer processes is most of the cost of these tests. Each stage's precondition is
    checked by the one before it (everyone sees everyone, nobody was declared dead).

    1. Garbage at the coordinator's and at a peer's port is dropped and counted; nothing stops.
    2. SIGSTOP then SIGCONT within the suspicion timeout: the paused peer may be suspected, but it
       refutes and nobody drops it.
    3. SIGTERM: the peer leaves cleanly and fast; the leave is announced, not discovered by probing
       (the others count it as left, not dead).
    4. SIGKILL: the killed peer is dropped by the survivors, who keep training; then one survivor is
       interrupted (Ctrl+C: exit 130, it still writes its summary) and the other stopped (SIGTERM: exit 0).
    """
    coord = coordinator_factory(fast_config(**{"train.max_steps": 0, "train.max_seconds": 120}))
    join = coord.address.removeprefix("tcp://")
    peers = [procs.peer(join) for _ in range(4)]
    procs.wait_for(members_everywhere(peers, 4), 60, "every peer to see 4 members")

    # 1. Garbage.
    send_garbage(join)
    send_garbage(peers[0].latest()["address"].removeprefix("tcp://"))
    stats = coord.coordinator.stats
    procs.wait_for(lambda: stats.bad_messages >= 2, 10, "the coordinator to count the bad messages")
    procs.wait_for(lambda: coord.coordinator.transport.stats.handshake_failures >= 1, 10, "a failed handshake to be counted")
    procs.wait_for(lambda: (peers[0].latest() or {}).get("dropped", 0) >= 2, 20, "peer 0 to count the bad messages")

    # 2. A pause shorter than the suspicion timeout.
    paused, others = peers[3], peers[:3]
    before = steps_of(paused)
    pause = fast_config().membership.suspicion_timeout(4) / 2
    paused.signal(signal.SIGSTOP)
    try:
        time.sleep(pause)  # the pause under test (not a wait for a condition)
    finally:
        paused.signal(signal.SIGCONT)
    procs.wait_for(lambda: steps_of(paused) > before + 20, 60, "the paused peer to train again")
    others_later = [steps_of(p) + 20 for p in others]
    procs.wait_for(lambda: all(steps_of(p) > s for p, s in zip(others, others_later)), 60, "the others to report again")
    for p in peers:
        latest = p.latest() or {}
        assert latest.get("members_dead") == 0 and latest.get("members") == 4, ("after the pause", p.name, latest)

    # 3. A clean leave.
    leaver, stayers = peers[2], [peers[0], peers[1], peers[3]]
    leaver.signal(signal.SIGTERM)
    assert leaver.wait(5) == 0, leaver.output()
    # The leave is announced, not discovered by probing: the others see it before any suspicion could end.
    procs.wait_for(members_everywhere(stayers, 3), 30, "the leave to be seen")
    for p in stayers:
        seen = p.latest()
        assert seen["members_left"] == 1 and seen["members_dead"] == 0, ("after the leave", p.name, seen)

    # 4. A kill.
    victim, survivors = peers[1], [peers[0], peers[3]]
    victim.signal(signal.SIGKILL)
    victim.wait(10)
    procs.wait_for(members_everywhere(survivors, 2), 30, "survivors to drop the killed peer")
    before_steps = [steps_of(p) for p in survivors]
    procs.wait_for(
        lambda: all(steps_of(p) > b + 50 for p, b in zip(survivors, before_steps)), 30, "survivors to keep training"
    )
    interrupted, stopped = survivors
    interrupted.signal(signal.SIGINT)  # Ctrl+C
    assert interrupted.wait(5) == 130, interrupted.output()  # interrupted: it still leaves and writes its summary
    assert interrupted.records("done"), interrupted.output()
    stopped.signal(signal.SIGTERM)
    assert stopped.wait(10) == 0, stopped.output()
    assert stopped.records("done"), stopped.output()


# Reports every 0.5 s (fast_config's), not the default 2 s: the restarted coordinator relearns the swarm
# from the peers' reports, so that wait shrinks with the interval; nothing checked depends on it.
# digits-small, as fast_config's: the model's size is not what this test is about.
RESTART_SETTINGS = (
    "--workload", "digits-small",
    "--set", "membership.heartbeat_interval=0.2", "--set", "train.eval_every_seconds=0.3",
    "--set", "membership.report_interval=0.5",
)


def test_training_goes_on_without_the_coordinator_and_it_can_restart(procs: Procs) -> None:
    host = next_host()
    coordinator = procs.start(
        "coordinator", "--bind", f"{host}:0", "--seconds", "120", "--steps", "0",
        *RESTART_SETTINGS, name="coordinator",
    )
    line = procs.wait_for(lambda: "join with:" in coordinator.output() and coordinator.output(), 30, "the coordinator to listen")
    join = line.split("--join ")[1].split()[0]
    first = [procs.peer(join) for _ in range(2)]
    procs.wait_for(members_everywhere(first, 2), 60, "two peers to see each other")

    coordinator.signal(signal.SIGKILL)
    coordinator.wait(10)
    before = [steps_of(p) for p in first]
    procs.wait_for(lambda: all(steps_of(p) > b + 50 for p, b in zip(first, before)), 30, "training to go on")

    via_peer = first[0].latest()["address"].removeprefix("tcp://")
    late = procs.peer(via_peer, name="late")
    everyone = [*first, late]
    procs.wait_for(members_everywhere(everyone, 3), 60, "the late peer to join through a peer")

    # A coordinator restarted at the same address relearns the whole swarm from the peers' reports.
    restarted = procs.start(
        "coordinator", "--bind", join, "--seconds", "120", "--steps", "0",
        *RESTART_SETTINGS, name="restarted",
    )
    procs.wait_for(lambda: "3 members alive" in restarted.output(), 30, "the restarted coordinator to learn 3 members")

    late.signal(signal.SIGTERM)
    assert late.wait(10) == 0, late.output()
    assert late.records("done")[0]["exchanges"] > 0
    procs.wait_for(members_everywhere(first, 2), 30, "the others to see the clean leave")
