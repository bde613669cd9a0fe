"""A peer made of several workers (DDP inside, gossip between peers): identical workers, the CLI, a worker that dies."""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from gossiptrain.net.addressing import free_loopback_port
from gossiptrain.train.peer_workers import Workers

from .conftest import fast_config
from .group_ranks import NEWCOMER_RUN, SPLIT_RUN
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


# Pipeline stages through Peer run in the default run as CLI peers (test_cli_peers_whose_model_...[pipeline]).
@pytest.mark.parametrize("kind", ["fsdp", pytest.param("pipeline", marks=pytest.mark.slow)])
def test_two_split_peers_average_piece_by_piece_and_a_whole_model_is_refused_naming_both_layouts(
    procs: Procs, coordinator_factory: Any, tmp_path: Path, kind: str
) -> None:
    """Two peers of two ranks each, the model FSDP2-sharded or cut into pipeline stages, through ``Peer`` as a user
    writes it: both train, their ranks exchange their pieces (every rank counts the same exchanges: the group
    decides alike), and the final phase brings the two models together. A whole model joining that swarm is
    refused with one line naming both layouts."""
    coord = coordinator_factory(fast_config(**SPLIT_RUN))
    join = coord.address.removeprefix("tcp://")
    outs = {(p, r): tmp_path / f"{p}{r}.json" for p in "ab" for r in range(2)}
    ranks = []
    for peer, seed in (("a", 1), ("b", 2)):
        init = f"tcp://127.0.0.1:{free_loopback_port()}"
        ranks += [procs.start("split", kind, str(r), join, init, str(outs[(peer, r)]), str(seed), "60",
                              name=f"{kind}-{peer}{r}", module="tests.group_ranks") for r in range(2)]
    procs.wait_for(lambda: (spec := coord.coordinator.spec) is not None and spec.layout, 60, "a split peer to join")
    refused = tmp_path / "whole.json"
    ranks.append(procs.start("whole", join, str(refused), name="whole", module="tests.group_ranks"))
    assert [p.wait(120) for p in ranks] == [0] * 5, [p.output()[-2000:] for p in ranks]

    said = json.loads(refused.read_text())["error"]
    assert "whole on one rank" in said and f"split as {kind} over 2 ranks" in said, said
    got = {k: json.loads(v.read_text()) for k, v in outs.items()}
    for peer in "ab":
        leader, worker = got[(peer, 0)], got[(peer, 1)]
        assert (leader.get("kind"), worker.get("kind")) == ("SplitPeer", "SplitWorker"), (leader, worker)
        assert leader["id"] == worker["id"]
        counts = [{k: v for k, v in r["stats"].items() if k in ("completed", "served")} for r in (leader, worker)]
        assert counts[0] == counts[1] and sum(counts[0].values()) > 0, counts  # every rank applied the same ones

    def model(peer: str, tag: str) -> dict[str, torch.Tensor]:
        pieces = [load_file(f"{outs[(peer, r)]}.{tag}.safetensors") for r in range(2)]
        return {n: torch.cat([p[n] for p in pieces]) if kind == "fsdp" else p[n] for p in pieces for n in p}

    def apart(tag: str) -> float:
        a, b = model("a", tag), model("b", tag)
        return sum(float((a[n] - b[n]).norm()) for n in a)

    assert apart("end") < 0.5 * apart("start"), (apart("start"), apart("end"))  # averaged: from two models, nearly one
    for peer in "ab":  # the merged model: the pieces gathered, a file the unsplit model loads
        merged = load_file(f"{outs[(peer, 0)]}.merged.safetensors")
        assert got[(peer, 0)]["final"]["final_model"] == f"{outs[(peer, 0)]}.merged.safetensors"
        end = model(peer, "end")
        assert merged.keys() == end.keys() and all(torch.equal(merged[n], end[n]) for n in end)
        torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2)).load_state_dict(merged)


def test_a_dead_rank_ends_its_split_peer_and_the_other_peer_trains_on_with_every_rank_agreeing(
    procs: Procs, coordinator_factory: Any, tmp_path: Path
) -> None:
    """Rank 1 of peer a dies mid-run: a's leader gets the error at its next step (the group's collective) and
    leaves; b trains to the end, and its two ranks applied the same exchanges (none half-applied: a's requests
    b held were dropped on both ranks, b's own with a aborted on both)."""
    coord = coordinator_factory(fast_config(**SPLIT_RUN))
    join = coord.address.removeprefix("tcp://")
    outs = {(p, r): tmp_path / f"{p}{r}.json" for p in "ab" for r in range(2)}
    ranks = {}
    for peer, seed, die in (("a", 1, "20"), ("b", 2, "0")):
        init = f"tcp://127.0.0.1:{free_loopback_port()}"
        for r in range(2):
            ranks[(peer, r)] = procs.start("split", "fsdp", str(r), join, init, str(outs[(peer, r)]), str(seed), "80",
                                           die, name=f"{peer}{r}", module="tests.group_ranks")
    assert ranks[("a", 1)].wait(120) == 3
    assert [ranks[k].wait(120) for k in (("a", 0), ("b", 0), ("b", 1))] == [0, 0, 0], \
        [p.output()[-2000:] for p in ranks.values()]
    assert "RuntimeError" in json.loads(outs[("a", 0)].read_text())["error"]
    leader, worker = (json.loads(outs[("b", r)].read_text()) for r in range(2))
    assert leader["stats"]["steps"] == worker["stats"]["steps"] == 80
    # What a rank served and held may differ (one rank's request came, the other's did not); what was applied not.
    agreed = ("piece_started", "piece_committed", "piece_aborted", "piece_applied")
    counts = [{k: r["stats"][k] for k in agreed} for r in (leader, worker)]
    assert counts[0] == counts[1] and counts[0]["piece_started"] > 0, counts


def test_a_split_newcomer_downloads_every_ranks_piece_from_a_split_donor(
    procs: Procs, coordinator_factory: Any, tmp_path: Path
) -> None:
    """A 2-rank FSDP2 peer that trained; a 2-rank newcomer with another initial model joins it: each of its ranks
    holds, bit for bit, the piece of the donor's rank of its index (the donor takes no local step meanwhile), and
    with ``state.transfer_step`` counts on from the donor's steps."""
    coord = coordinator_factory(fast_config(**NEWCOMER_RUN))
    join = coord.address.removeprefix("tcp://")
    marker = tmp_path / "joined"
    out = {(role, r): tmp_path / f"{role}{r}" for role in ("donor", "newcomer") for r in range(2)}
    init = f"tcp://127.0.0.1:{free_loopback_port()}"
    procs_ = [procs.start("newcomer", "donor", str(r), join, init, str(out[("donor", r)]), str(marker),
                          name=f"donor{r}", module="tests.group_ranks") for r in range(2)]
    procs.wait_for(lambda: all(Path(f"{out[('donor', r)]}.trained.safetensors").exists() for r in range(2)), 60,
                   "the donor to train")
    init = f"tcp://127.0.0.1:{free_loopback_port()}"
    procs_ += [procs.start("newcomer", "newcomer", str(r), join, init, str(out[("newcomer", r)]), str(marker),
                           name=f"newcomer{r}", module="tests.group_ranks") for r in range(2)]
    assert [p.wait(120) for p in procs_] == [0] * 4, [p.output()[-2000:] for p in procs_]
    summary = json.loads(out[("newcomer", 0)].read_text())
    assert summary["state_transfer"] == "complete" and len(summary["state_donors"]) == 1, summary
    assert summary["steps_at_start"] >= 30, summary  # state.transfer_step: the donor's count (it trained 30 steps)
    for r in range(2):
        trained = load_file(f"{out[('donor', r)]}.trained.safetensors")
        joined = load_file(f"{out[('newcomer', r)]}.joined.safetensors")
        assert list(trained) == list(joined) and all(torch.equal(trained[n], joined[n]) for n in trained), r


@pytest.mark.parametrize("how", [pytest.param("fsdp", marks=pytest.mark.slow), "pipeline"])  # FSDP2: the API tests
def test_cli_peers_whose_model_is_split_across_their_workers_train_exchange_and_export(
    procs: Procs, coordinator_factory: Any, tmp_path: Path, how: str
) -> None:
    """`gossiptrain peer --nproc-per-peer 2 --shard-model fsdp|pipeline`, two such peers: both train to their
    budget, exchange their pieces, evaluate the model the pieces make, checkpoint per rank; `gossiptrain export`
    gathers a checkpoint, and `--final-model` the pieces at the end, into a state_dict the unsplit model loads."""
    workload = "tests.split_workload:tiny"
    config = fast_config(**{"train.shards": 2, "train.max_steps": 60, "train.max_seconds": 60,
                            "train.workload": workload, "train.eval_every_seconds": 0.5})
    coord = coordinator_factory(config)
    join = coord.address.removeprefix("tcp://")
    ckpt = [tmp_path / f"ckpt{i}" for i in range(2)]
    final = tmp_path / "final.safetensors"  # the first peer's model at the end, its pieces gathered
    peers = [procs.peer(join, "--nproc-per-peer", "2", "--shard-model", how, "--workload", workload, "--wait-for", "2",
                        "--checkpoint-dir", str(ckpt[i]), "--checkpoint-every-steps", "20",
                        *(["--final-model", str(final)] if i == 0 else [])) for i in range(2)]
    assert [p.wait(120) for p in peers] == [0, 0], [p.output()[-3000:] for p in peers]
    for p in peers:
        done = p.latest()
        assert done is not None and done["event"] == "done" and done["layout"] == how and done["ranks"] == 2, done
        assert done["step"] == 60 and done["exchanges"] > 0, done
        start = p.records("start")[0]
        assert done["test_loss"] < start["test_loss"] and len(p.records("eval")) > 0, (start, done)  # it learned
        assert sorted(x.name for x in ckpt[peers.index(p)].iterdir()) == ["rank-0", "rank-1"]
    from gossiptrain.runtime.piece_checkpoints import gather  # what `gossiptrain export` writes (test_piece_checkpoints)
    from tests.split_workload import tiny

    state, info = gather(ckpt[0])
    assert info.info.step == 60
    tiny().build_model(0).load_state_dict(state)  # an ordinary state_dict of the unsplit model
    assert peers[0].latest()["final_model"] == str(final)  # type: ignore[index]
    tiny().build_model(0).load_state_dict(load_file(final))  # so is the final model


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


def test_shard_model_is_refused_before_anything_starts_where_it_cannot_work() -> None:
    """--shard-model without several workers, of an unknown kind, or without the run's workload: one line each."""
    from gossiptrain.config import RunConfig
    from gossiptrain.errors import ConfigError
    from gossiptrain.train.peer_loop import PeerOptions, run_peer
    from gossiptrain.train.split_loop import run_split_peer

    with pytest.raises(ConfigError, match="is one of fsdp, pipeline"):
        PeerOptions(join="127.0.0.1:1", shard_model="tensor")
    with pytest.raises(ConfigError, match="give it several"):
        run_peer(PeerOptions(join="127.0.0.1:1", shard_model="fsdp"))
    workers = Workers(1, 2, "tcp://127.0.0.1:1")  # (never reached: every refusal comes before the group)
    with pytest.raises(ConfigError, match="name the run's workload"):
        run_split_peer(PeerOptions(join="127.0.0.1:1", shard_model="fsdp"), workers, None)
    expect = RunConfig().with_overrides({"train.workload": "digits-small"})
    with pytest.raises(ConfigError, match="--tensorboard with --shard-model"):
        run_split_peer(PeerOptions(join="127.0.0.1:1", shard_model="fsdp", expect=expect, tensorboard="/tmp/tb"), workers, None)
