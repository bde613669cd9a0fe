"""A peer made of several workers (DDP inside, gossip between peers): identical workers, the CLI, a worker that dies."""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path
from typing import Any

import pytest

from gossiptrain.net.addressing import free_loopback_port
from gossiptrain.train.peer_workers import Workers

from .conftest import fast_config
from .swarm import Procs



def test_every_worker_holds_the_leaders_parameters_after_every_safe_point(
    procs: Procs, coordinator_factory: Any, tmp_path: Path
) -> None:
    config = fast_config(**{"train.shards": 2, "train.max_steps": 0, "train.max_seconds": 60})
    coord = coordinator_factory(config)
    join = coord.address.removeprefix("tcp://")
    outs = [str(tmp_path / f"rank{r}.json") for r in range(2)]
    init = f"tcp://127.0.0.1:{free_loopback_port()}"
    # Forked from the test worker's process that imported torch already (tests/zygote.py), as CLI peers are.
    ranks = [procs.start("train", str(r), join, init, outs[r], "80", name=f"rank{r}", module="tests.group_ranks")
             for r in range(2)]
    ranks.append(procs.start("solo", join, "200", name="solo", module="tests.group_ranks"))  # someone to average with
    assert [p.wait(120) for p in ranks] == [0, 0, 0], [p.output()[-2000:] for p in ranks]
    leader, worker = (json.loads(Path(o).read_text()) for o in outs)
    assert (leader["kind"], worker["kind"]) == ("Peer", "GroupWorker") and leader["id"] == worker["id"]
    assert len(leader["digests"]) == 82 and leader["digests"] == worker["digests"]  # after every sync, bit for bit
    assert leader["exchanges"] > 0  # merges moved the leader's model, and the worker holds it all the same


@pytest.mark.parametrize("kind", ["fsdp", "pipeline"])
def test_a_peer_whose_ranks_each_hold_a_piece_of_the_model_is_refused_on_every_rank(
    procs: Procs, coordinator_factory: Any, tmp_path: Path, kind: str
) -> None:
    """Syncing rank 0's parameters over the others would overwrite their shards or stages: refused, saying how the
    model is split, on both ranks (neither waits for the other in a collective), and the leader leaves."""
    coord = coordinator_factory(fast_config(**{"train.shards": 2, "train.max_steps": 0, "train.max_seconds": 60}))
    join = coord.address.removeprefix("tcp://")
    outs = [str(tmp_path / f"rank{r}.json") for r in range(2)]
    init = f"tcp://127.0.0.1:{free_loopback_port()}"
    ranks = [procs.start("split", kind, str(r), join, init, outs[r], name=f"{kind}{r}", module="tests.group_ranks")
             for r in range(2)]
    assert [p.wait(120) for p in ranks] == [0, 0], [p.output()[-2000:] for p in ranks]
    said = [json.loads(Path(o).read_text())["error"] for o in outs]
    assert said[0] == said[1], said
    if kind == "fsdp":  # the parameters are DTensors: refused before anything is contacted
        assert "is a DTensor" in said[0] and "not built yet" in said[0]
    else:  # each rank's own parameters: found at the first collective, after the leader joined
        assert "pipeline over 2 ranks" in said[0] and "every rank must hold the whole model" in said[0]


def test_workers_environment() -> None:
    assert Workers.from_environment({}) is None
    assert Workers.from_environment({"GOSSIPTRAIN_WORKER_RANK": "1", "GOSSIPTRAIN_WORKER_SIZE": "2",
                                     "GOSSIPTRAIN_WORKER_INIT": "tcp://127.0.0.1:5"}) == Workers(1, 2, "tcp://127.0.0.1:5")
    torchrun = {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "::1", "MASTER_PORT": "29500"}
    assert Workers.from_environment(torchrun) == Workers(0, 2, "tcp://[::1]:29500")
    assert Workers.from_environment({"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "h", "MASTER_PORT": "1"}) is None


def _children(pid: int) -> list[int]:
    """Processes whose parent is ``pid`` (from /proc: the worker ranks a peer started)."""
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True)
    return [int(x) for x in out.stdout.split()]


def test_two_peers_of_two_workers_train_together_and_a_dead_worker_ends_only_its_peer(
    procs: Procs, coordinator_factory: Any
) -> None:
    coord = coordinator_factory(fast_config(**{"train.shards": 2, "train.max_steps": 0, "train.max_seconds": 120}))
    join = coord.address.removeprefix("tcp://")
    a = procs.peer(join, "--nproc-per-peer", "2")
    b = procs.peer(join, "--nproc-per-peer", "2")

    def learned(p: Any) -> bool:
        r = p.latest()
        return r is not None and r.get("members") == 2 and r.get("exchanges", 0) > 0 and r.get("test_acc", 0) >= 0.9

    procs.wait_for(lambda: learned(a) and learned(b), 90, "both two-worker peers to exchange and learn")
    workers = procs.wait_for(lambda: _children(a.popen.pid), 10, "peer a's second worker")
    os.kill(workers[0], signal.SIGKILL)
    assert a.wait(60) == 1  # its peer left the swarm with a message, not a hang
    assert "gossiptrain peer: error: a worker of peer" in a.output() and "Traceback" not in a.output()
    before = b.latest()["step"]
    procs.wait_for(lambda: (r := b.latest())["step"] > before and r["members"] == 1 and r, 60,
                   "peer b to train on alone")
