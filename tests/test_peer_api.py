"""The in-process ``Peer`` API's smaller paths: the rendezvous, a member's stop, ``resume_at``'s refusals, and
what ``import gossiptrain`` loads.

Real peers on loopback, each on its own 127.0.0.x with port 0, joined through an in-process coordinator.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from typing import Any

import pytest
import torch

from gossiptrain.errors import GossipError
from gossiptrain.runtime.peer import Peer
from gossiptrain.runtime.preflight import ThreadCheck

from .conftest import fast_config
from .swarm import ROOT, next_host, wait_for

# No exchanges and no state download: these tests are about the API, not about averaging.
QUIET = {"train.workload": "external", "gossip.exchange_every_steps": 2 * 10**9, "state.enabled": False}


def join_of(coordinator_factory: Any, shards: int) -> str:
    coord = coordinator_factory(fast_config(**QUIET, **{"train.shards": shards}))
    return coord.address.removeprefix("tcp://")


def peer(join: str) -> Peer:
    return Peer(torch.nn.Linear(4, 2), join=join, bind=f"{next_host()}:0", transfer_state=False)


@pytest.mark.timeout(60)
def test_wait_for_peers_returns_the_count_and_times_out_when_it_never_comes(coordinator_factory: Any) -> None:
    join = join_of(coordinator_factory, shards=2)
    peers: list[Peer] = []
    try:
        peers.append(peer(join))
        assert peers[0].wait_for_peers(1, timeout=30) == 1  # itself: at once
        peers.append(peer(join))
        assert [p.wait_for_peers(2, timeout=30) for p in peers] == [2, 2]
        assert all(p.members == 2 for p in peers)
        # Nobody else is coming: the rendezvous for a third member ends in TimeoutError, naming what it saw.
        with pytest.raises(TimeoutError, match="only 2 of 3 members"):
            peers[0].wait_for_peers(3, timeout=0.5)
        assert peers[0].members == 2  # and the peer is still a member
    finally:
        for p in peers:
            p.close()
    with pytest.raises(GossipError, match="closed"):
        peers[0].wait_for_peers(3, timeout=30)  # a closed peer says so rather than waiting out the timeout


@pytest.mark.timeout(60)
def test_peers_sharing_a_machine_at_torchs_thread_count_get_one_warning(
    coordinator_factory: Any, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch,
) -> None:
    import gossiptrain.runtime.preflight as peer_module  # the warning's logger

    monkeypatch.setattr(ThreadCheck, "warned", False)  # once per process: this test's process included
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    join = join_of(coordinator_factory, shards=2)
    threads = torch.get_num_threads()
    peers = [peer(join), peer(join)]  # two peers of one machine (127.0.0.x), as two processes on it would be
    try:
        with caplog.at_level(logging.WARNING, logger=peer_module.__name__):
            assert [p.wait_for_peers(2, timeout=30) for p in peers] == [2, 2]
            for p in peers:
                p.step()  # at one thread each (as this test process runs): nothing to say
            assert not [r for r in caplog.records if r.name == peer_module.__name__]
            torch.set_num_threads(max(2, cores))  # torch's default: one per core
            for _ in range(3):
                for p in peers:
                    p.step()
        (warning,) = [r for r in caplog.records if r.name == peer_module.__name__]  # one line, once
        assert f"2 peers on this machine each run {max(2, cores)} torch threads on its {cores} cores" in warning.getMessage()
        assert f"torch.set_num_threads({max(1, cores // 2)})" in warning.getMessage()
    finally:
        torch.set_num_threads(threads)
        for p in peers:
            p.close()


@pytest.mark.timeout(60)
def test_request_stop_reaches_the_other_members(coordinator_factory: Any) -> None:
    join = join_of(coordinator_factory, shards=2)
    peers: list[Peer] = []
    try:
        peers = [peer(join), peer(join)]
        wait_for(lambda: all(p.members == 2 for p in peers), 30, "both peers to see each other")
        assert not any(p.finish_requested for p in peers)
        peers[0].request_stop("test over")
        wait_for(lambda: peers[1].finish_requested, 30, "the other member to hear the stop")
        wait_for(lambda: peers[0].finish_requested, 30, "the requesting member to see its own stop")
    finally:
        for p in peers:
            p.close()


@pytest.mark.timeout(60)
def test_resume_at_refuses_a_negative_step_and_any_call_after_a_step(coordinator_factory: Any) -> None:
    join = join_of(coordinator_factory, shards=1)
    p = peer(join)
    try:
        with pytest.raises(GossipError, match="must be >= 0, got -1"):
            p.resume_at(-1)
        assert p.steps == 0  # the refused call changed nothing
        p.resume_at(5)
        assert p.steps == 5
        p.step()
        assert p.steps == 6  # counting on from the resumed step
        with pytest.raises(GossipError, match=r"resume_at\(3\) after 6 steps"):
            p.resume_at(3)
        assert p.steps == 6  # the refused call changed nothing
    finally:
        p.close()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("make, problem, remedy", [
    (lambda: torch.nn.BatchNorm1d(4, affine=False), "the model has no parameters (only buffers: running_mean, running_var",
     "at least one torch.nn.Parameter"),
    (lambda: torch.nn.Linear(4, 2, device="meta"), "the model's parameter 'weight' is on the meta device", "model.to_empty("),
], ids=["buffers-only", "meta"])
def test_a_model_no_swarm_can_average_is_refused_before_anything_is_contacted(make: Any, problem: str, remedy: str) -> None:
    import re
    import socket
    import threading

    with socket.socket() as listener:  # the join address: a dial would show as a pending connection
        listener.bind((next_host(), 0))
        listener.listen()
        listener.setblocking(False)
        join = "%s:%d" % listener.getsockname()
        threads = set(threading.enumerate())
        with pytest.raises(ValueError, match=re.escape(problem)) as refused:
            Peer(make(), join=join, join_attempts=1, config=fast_config(**{"membership.join_timeout": 1.0}))
        assert remedy in str(refused.value) and "\n" not in str(refused.value)  # one line: the problem and what to do
        assert set(threading.enumerate()) == threads  # no network side was started
        with pytest.raises(BlockingIOError):
            listener.accept()  # nobody dialled the join address


@pytest.mark.timeout(60)
def test_import_gossiptrain_loads_no_network_stack() -> None:
    # gossiptrain/__init__.py: Peer, simulate and the rest are imported on first use, so that importing the
    # package does not pull in the network stack (ZeroMQ, asyncio, the transports, the runtime) nor torch.
    code = (
        "import json, sys\n"
        "import gossiptrain\n"
        "print(json.dumps(sorted(sys.modules)))\n"
        "gossiptrain.Peer\n"  # the lazy name still resolves
        "print(json.dumps(sorted(sys.modules)))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=50, cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert result.returncode == 0, result.stderr
    before, after = (set(json.loads(line)) for line in result.stdout.splitlines())

    def heavy(modules: set[str]) -> list[str]:
        return sorted(
            m for m in modules
            if m.split(".")[0] in ("zmq", "asyncio", "torch", "msgpack")
            or m.startswith(("gossiptrain.net", "gossiptrain.runtime", "gossiptrain.sim", "gossiptrain.train"))
        )

    assert heavy(before) == [], heavy(before)
    assert {m for m in before if m.startswith("gossiptrain")} == {
        "gossiptrain", "gossiptrain.config", "gossiptrain.errors", "gossiptrain.codec_spec",
    }
    # The check can fail: the first use of Peer does load them.
    assert {"zmq", "asyncio", "gossiptrain.runtime.peer"} <= set(heavy(after)), heavy(after)
