"""`gossiptrain peer` flags that change who trains when and where others reach it, and neighbour eviction.

The CLI flags run real peer processes on loopback, each checked through
what the rest of the swarm sees: ``--advertise`` by the address the
coordinator and the other peer hand out and dial, ``--wait-for`` by when
the waiting peer's first record comes relative to the member that completes
the count, ``--slowdown`` by its step rate against an unslowed peer of the
same run, ``--resume-any-run`` by the state the resumed peer starts from.
Eviction past ``MAX_HELD_SENDERS`` runs on the neighbour-averaging state
machine itself, in process.
"""

from __future__ import annotations

import asyncio
import random
import signal
import socket
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from gossiptrain.config import GossipConfig, RunConfig
from gossiptrain.net.addressing import parse_hostport, plain_address, route_address
from gossiptrain.net.kinds import XPUSH
from gossiptrain.protocol.averaging_events import AtSafePoint, Received
from gossiptrain.protocol.neighbor import MAX_HELD_SENDERS, NeighborAveraging
from gossiptrain.runtime.swarm_client import SwarmClient
from gossiptrain.state.checkpoint import Checkpointer
from gossiptrain.train.local_trainer import make_optimizer
from gossiptrain.train.metrics import read_metrics
from gossiptrain.train.workload import load_workload

from .conftest import fast_config
from .swarm import Proc, Procs, next_host, run_forked, wait_for

# -- helpers -------------------------------------------------------------------------------


def join_of(coord: Any) -> str:
    """HOST:PORT of an in-process coordinator, as `--join` takes it."""
    return str(coord.address).removeprefix("tcp://")


def start_peer(procs: Procs, join: str, *flags: str, name: str) -> Proc:
    """A `gossiptrain peer` with exactly ``flags`` (``Procs.peer`` always adds ``--bind``, which --advertise tests must not)."""
    metrics = str(procs.workdir / f"{name}.jsonl")
    return procs.start("peer", "--join", join, "--quiet", "--metrics", metrics, *flags, name=name)


def host_of(address: str) -> str:
    """The host of a member address (``tcp://[::ffff:127.0.0.9]:4242`` -> ``::ffff:127.0.0.9``)."""
    return parse_hostport(plain_address(address))[0]


def members_known_by(address: str) -> dict[str, str]:
    """Live members (id -> address) as the coordinator or peer at ``address`` hands them out, asked over the network."""

    async def ask() -> dict[str, str]:
        async with SwarmClient(plain_address(address).removeprefix("tcp://"), advertise=next_host()) as client:
            roster = await client.query(attempts=3, timeout=2.0)
            return {m.id: m.addr for m in roster.members}

    return asyncio.run(ask())


def v4_mapped_reaches(host: str) -> bool:
    """Whether ``::ffff:HOST`` (the IPv4-mapped IPv6 form of HOST) reaches a listener bound on HOST here."""
    with socket.socket() as server:
        server.bind((host, 0))
        server.listen()
        try:
            with socket.socket(socket.AF_INET6) as client:
                client.settimeout(2)
                client.connect((f"::ffff:{host}", server.getsockname()[1]))
            return True
        except OSError:
            return False


def exchanging(p: Proc, members: int) -> bool:
    """Whether ``p``'s latest record shows ``members`` members and at least one exchange."""
    latest = p.latest() or {}
    return latest.get("members") == members and latest.get("exchanges", 0) > 0


def stop_all(*peers: Proc) -> None:
    """SIGTERM (a graceful leave), then each must exit 0: the flag under test did not break the way out."""
    for p in peers:
        p.signal(signal.SIGTERM)
    for p in peers:
        assert p.wait(30) == 0, p.output()[-3000:]


def step_rate(records: list[dict[str, Any]], lo: float, hi: float) -> float | None:
    """Steps per second between the first and last eval records written within [lo, hi] (wall clock); None if < 5."""
    inside = [r for r in records if lo <= r["time"] <= hi]
    if len(inside) < 5 or inside[-1]["time"] <= inside[0]["time"]:
        return None
    return (inside[-1]["step"] - inside[0]["step"]) / (inside[-1]["time"] - inside[0]["time"])


# -- --advertise -----------------------------------------------------------------------------


@pytest.mark.timeout(120)
def test_advertised_address_is_what_the_coordinator_and_the_other_peer_record_and_dial(
    procs: Procs, coordinator_factory: Any
) -> None:
    """Peers behind NAT or with several interfaces name the address others must use: the swarm must use that one.

    ``host-only`` gives ``--advertise HOST`` and no ``--bind``: it must listen
    there too (the default would be the route to the coordinator, 127.0.0.1).
    ``mapped`` binds 127.0.0.x and advertises its IPv4-mapped IPv6 form: a
    different string for the same listener, so a swarm that used the bound
    address instead of the advertised one is caught. In a two-member swarm
    every exchange of either peer needs the other to dial it at its recorded
    address.
    """
    coord = coordinator_factory(fast_config(**{"train.shards": 2, "train.max_steps": 0, "train.max_seconds": 90}))
    join = join_of(coord)
    advertised = next_host()
    assert route_address(host_of(coord.address)) != advertised  # else the default would pass for --advertise
    host_only = start_peer(procs, join, "--advertise", advertised, name="host-only")
    expected = {host_only.name: advertised}
    bound = next_host()
    if v4_mapped_reaches(bound):
        other = start_peer(procs, join, "--bind", f"{bound}:0", "--advertise", f"::ffff:{bound}", name="mapped")
        expected[other.name] = f"::ffff:{bound}"
    else:  # no IPv6 sockets here: the second peer only completes the swarm
        other = procs.peer(join, host=bound, name="plain")
        expected[other.name] = bound
    peers = (host_only, other)
    procs.wait_for(lambda: all(exchanging(p, members=2) for p in peers), 60, "both peers to exchange with each other")
    own = {p.name: p.records("start")[0] for p in peers}
    for p in peers:
        assert host_of(own[p.name]["address"]) == expected[p.name], own[p.name]
        assert parse_hostport(plain_address(own[p.name]["address"]))[1] > 0  # port 0 bound to a real one
    ids = {p.name: own[p.name]["peer"] for p in peers}
    by_coordinator = members_known_by(coord.address)
    by_host_only = members_known_by(own[host_only.name]["address"])  # answered at its advertised address
    by_other = members_known_by(own[other.name]["address"])
    assert by_coordinator == {ids[p.name]: own[p.name]["address"] for p in peers}, by_coordinator
    assert by_other[ids[host_only.name]] == own[host_only.name]["address"], by_other
    assert by_host_only[ids[other.name]] == own[other.name]["address"], by_host_only
    stop_all(*peers)


# -- --wait-for ------------------------------------------------------------------------------


@pytest.mark.slow  # 7 s of real peers: `make test-slow`; the rendezvous is in the default run in tests/test_sim.py and test_rendezvous.py
@pytest.mark.timeout(150)
def test_wait_for_holds_training_until_the_count_is_reached_counting_the_peer_itself(
    procs: Procs, coordinator_factory: Any
) -> None:
    """A start line for experiments: nobody with ``--wait-for 3`` takes a step before the third member exists.

    ``early`` (--wait-for 3) joins with ``plain`` (no flag, trains at once).
    While ``plain`` keeps seeing two members, ``early`` writes nothing: its
    ``start`` record comes only with its first step. ``late`` (--wait-for 3)
    is launched after that; ``early``'s ``start`` record must come after the
    launch, with three members at its first evaluation. ``late`` itself must
    start too: the count includes the peer (an off-by-one would hold both
    forever).
    """
    coord = coordinator_factory(fast_config(**{"train.shards": 3, "train.max_steps": 0, "train.max_seconds": 90}))
    join = join_of(coord)
    early = procs.peer(join, "--wait-for", "3", name="early")
    plain = procs.peer(join, name="plain")
    procs.wait_for(
        lambda: len([r for r in plain.records("eval") if r["members"] == 2]) >= 4, 60, "plain to see early for a while"
    )
    assert early.alive() and early.records() == [], early.records()[:2]  # joined (plain sees it), not training
    assert plain.records("start")[0]["step"] == 0 and plain.records("eval")[-1]["step"] > 0  # no flag: trains at once
    # ... and averages with early meanwhile: a peer at the rendezvous answers with the model it holds.
    procs.wait_for(lambda: plain.records("eval")[-1]["exchanges"] > 0, 30, "plain to complete an exchange with early")
    assert early.records() == []
    launched = time.time()
    late = procs.peer(join, "--wait-for", "3", name="late")
    procs.wait_for(lambda: early.records("eval") and late.records("eval"), 60, "early and late to train")
    (start,) = early.records("start")
    assert start["time"] >= launched, (start, launched)
    assert early.records("eval")[0]["members"] == 3, early.records("eval")[0]
    assert late.records("eval")[0]["members"] == 3, late.records("eval")[0]
    stop_all(early, plain, late)


# -- --slowdown ------------------------------------------------------------------------------

SLOWDOWN = 10


@pytest.mark.timeout(120)
def test_slowdown_lowers_the_peer_step_rate_against_an_unslowed_peer_of_the_same_run(
    procs: Procs, coordinator_factory: Any
) -> None:
    """Straggler experiments rely on it: ``--slowdown 10`` idles 9x each step's compute, so that peer steps slower.

    Compared as a ratio of step rates over the same stretch of wall time, on
    one machine, so load slows both. Ideally 1/10 (measured 0.065, alone and
    beside tests/test_swarm.py); a loaded machine can starve the CPU-bound
    peer more than the idling one, hence the margin to 0.3. A flag that does
    nothing gives about 1, one applied at a third of its strength about 0.3.
    """
    coord = coordinator_factory(fast_config(**{"train.shards": 2, "train.max_steps": 0, "train.max_seconds": 90}))
    join = join_of(coord)
    fast = procs.peer(join, name="fast")
    slow = procs.peer(join, "--slowdown", str(SLOWDOWN), name="slow")

    def rates() -> tuple[float, float] | None:
        f, s = fast.records("eval"), slow.records("eval")
        if not f or not s:
            return None
        lo, hi = max(f[0]["time"], s[0]["time"]), min(f[-1]["time"], s[-1]["time"])
        rf, rs = step_rate(f, lo, hi), step_rate(s, lo, hi)
        return (rf, rs) if rf is not None and rs is not None else None

    rate_fast, rate_slow = procs.wait_for(rates, 60, "five evaluations of both peers over the same stretch")
    assert rate_slow > 0, "the slowed peer must still train"
    assert rate_slow / rate_fast < 0.3, (rate_slow, rate_fast)
    assert slow.records("eval")[-1]["exchanges"] > 0  # and still averages with the other
    stop_all(fast, slow)


# -- --resume-any-run ------------------------------------------------------------------------

CHECKPOINT_STEP = 10


def other_runs_checkpoint(directory: Path, swarm: RunConfig) -> tuple[RunConfig, float]:
    """A checkpoint (model and SGD momentum, shard 1, step 10) of a run that differs from ``swarm`` in train.lr.

    Returns that run and the checkpointed model's test accuracy (one torch
    thread, as the peer evaluates), which differs from the initial model's:
    a peer that starts from it shows it in its ``start`` record.
    """
    other = swarm.with_overrides({"train.lr": 0.2})
    workload = load_workload(swarm.train.workload)
    model = workload.build_model(seed=5)
    opt = make_optimizer(other.train, model)
    x, y = workload.train_shard(1, swarm.train.shards, swarm.train.seed)
    for i in range(3):
        loss = torch.nn.functional.cross_entropy(model(x[32 * i : 32 * (i + 1)]), y[32 * i : 32 * (i + 1)])
        opt.zero_grad()
        loss.backward()
        opt.step()
    with Checkpointer(directory) as ck:
        ck.save(model, opt, step=CHECKPOINT_STEP, samples_seen=32 * CHECKPOINT_STEP, fingerprint=other.fingerprint(),
                shard=1, run=other.to_dict())
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        accuracy = workload.evaluate(model).accuracy
        initial = workload.evaluate(workload.build_model(swarm.train.seed)).accuracy
    finally:
        torch.set_num_threads(threads)
    assert accuracy != initial  # else the start record could not tell the checkpoint from a fresh model
    return other, accuracy


def resume_cli(join: str, ckpt: Path, metrics: Path, *extra: str) -> Any:
    """`gossiptrain peer --resume CKPT` to completion (bounded; killed on an overrun), forked from the test fork
    server (tests/zygote.py), its stdout and stderr apart; its output files beside ``metrics``."""
    args = ["peer", "--join", join, "--bind", f"{next_host()}:0", "--quiet", "--metrics", str(metrics), "--resume", str(ckpt),
            *extra]
    return run_forked(args, 60, "gossiptrain peer --resume", metrics.parent)


@pytest.mark.timeout(90)
def test_resume_refuses_another_runs_checkpoint_with_exit_2_naming_the_difference(
    tmp_path: Path, coordinator_factory: Any
) -> None:
    """A checkpoint of another run must not slip into this one unnoticed: exit 2, the runs and the field named."""
    swarm = fast_config(**{"train.shards": 2, "train.max_steps": 40})
    other, _ = other_runs_checkpoint(tmp_path / "ck", swarm)
    coord = coordinator_factory(swarm)
    result = resume_cli(join_of(coord), tmp_path / "ck", tmp_path / "refused.jsonl")
    assert result.returncode == 2, result
    assert (f"is of run {other.fingerprint()}, not of this run {swarm.fingerprint()} (train.lr: 0.2 vs 0.05); "
            "allow another run (--resume-any-run)") in result.stderr, result.stderr
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "refused.jsonl").exists() or "start" not in (tmp_path / "refused.jsonl").read_text()


@pytest.mark.timeout(90)
def test_resume_any_run_starts_from_another_runs_checkpoint_and_counts_on(tmp_path: Path, coordinator_factory: Any) -> None:
    """Fine-tuning under new hyperparameters: the checkpoint's model, step and shard, the swarm's run."""
    swarm = fast_config(**{"train.shards": 2, "train.max_steps": 40})
    _, accuracy = other_runs_checkpoint(tmp_path / "ck", swarm)
    coord = coordinator_factory(swarm)
    metrics = tmp_path / "resumed.jsonl"
    result = resume_cli(join_of(coord), tmp_path / "ck", metrics, "--resume-any-run")
    assert result.returncode == 0, result
    assert "of another run" in result.stderr and "(train.lr: 0.2 vs 0.05)" in result.stderr  # said, not silent
    records = read_metrics(metrics)
    (start,) = [r for r in records if r["event"] == "start"]
    assert start["fingerprint"] == swarm.fingerprint()  # it runs the swarm's run, not the checkpoint's
    assert (start["resumed_step"], start["step"], start["samples_seen"]) == (CHECKPOINT_STEP, CHECKPOINT_STEP, 320)
    assert start["shard"] == 1  # the checkpoint's (an empty swarm would hand out shard 0)
    assert start["test_acc"] == accuracy  # the checkpoint's parameters, before any step or exchange
    (done,) = [r for r in records if r["event"] == "done"]
    assert done["step"] == 40 and done["finish"] == "budget"  # counted on from 10 to the run's 40


@pytest.mark.timeout(90)
def test_a_peer_refused_for_its_checkpoint_is_not_counted(tmp_path: Path, coordinator_factory: Any) -> None:
    """A refused resume never trains, so, like a peer whose model is refused after the welcome, it must withdraw."""
    swarm = fast_config(**{"train.shards": 2, "train.max_steps": 40})
    other_runs_checkpoint(tmp_path / "ck", swarm)
    coord = coordinator_factory(swarm)
    result = resume_cli(join_of(coord), tmp_path / "ck", tmp_path / "refused.jsonl")
    assert result.returncode == 2, result
    assert coord.coordinator.stats.joins_answered == 1  # it was welcomed (the run is known only then)
    # A withdrawal is a message the coordinator handles in milliseconds; expiry would take ~20 s.
    wait_for(lambda: coord.coordinator.members() == [], 3, "the coordinator to drop the refused peer")


# -- neighbour averaging: eviction past MAX_HELD_SENDERS ---------------------------------------

DIM = MAX_HELD_SENDERS + 8


def neighbor() -> tuple[dict[str, torch.Tensor], NeighborAveraging]:
    """A D-PSGD machine on a zero vector with one element per possible sender."""
    params = {"x": torch.zeros(DIM, dtype=torch.float64)}
    return params, NeighborAveraging(params, GossipConfig(algorithm="neighbor", topology="ring"), random.Random(0), me="me")


def push(nb: NeighborAveraging, sender: int, ver: int) -> None:
    """Sender ``sender``'s model: zero but for element ``sender``, so the merged vector shows whose models were mixed."""
    x = torch.zeros(DIM, dtype=torch.float64)
    x[sender] = 1000.0
    assert nb.handle(Received(f"s{sender}", XPUSH, ver, {"x": x}, step=1, meta={"deg": 1, "ver": ver}), 0.0) == []


def mixed_senders(params: dict[str, torch.Tensor]) -> set[int]:
    return {i for i, v in enumerate(params["x"].tolist()) if v != 0.0}


@pytest.mark.parametrize("senders", [MAX_HELD_SENDERS, MAX_HELD_SENDERS + 1, MAX_HELD_SENDERS + 7])
def test_neighbor_holds_at_most_max_senders_and_evicts_the_oldest(senders: int) -> None:
    """Memory stays bounded under many senders, and what goes is the oldest model, never a newer one (nor one too many)."""
    params, nb = neighbor()
    for i in range(senders):
        push(nb, i, ver=1)
    nb.handle(AtSafePoint(1, []), 0.0)
    kept = set(range(max(0, senders - MAX_HELD_SENDERS), senders))
    assert mixed_senders(params) == kept
    assert nb.stats.served == len(kept)
    weights = [float(params["x"][i]) / 1000.0 for i in kept]
    assert max(weights) == pytest.approx(min(weights))  # every held model mixed alike
    assert sum(weights) < 1.0  # still a convex combination: the degree counts the held models, not every sender seen


def test_a_sender_with_a_newer_model_is_not_the_oldest_any_more() -> None:
    """Eviction goes by the latest arrival: a neighbour that keeps sending is kept, a silent one goes first."""
    params, nb = neighbor()
    for i in range(MAX_HELD_SENDERS):
        push(nb, i, ver=1)
    push(nb, 0, ver=2)  # s0 sends again: its held model is now the newest
    push(nb, MAX_HELD_SENDERS, ver=1)  # one too many: s1 (oldest held) goes, not s0
    nb.handle(AtSafePoint(1, []), 0.0)
    assert mixed_senders(params) == {0, *range(2, MAX_HELD_SENDERS + 1)}
    assert nb.stats.served == MAX_HELD_SENDERS and nb.stats.late == 0


def test_an_evicted_sender_is_merged_again_when_it_sends_after_the_merge() -> None:
    """Eviction drops one model, not the sender: its next model counts like anyone's."""
    params, nb = neighbor()
    for i in range(MAX_HELD_SENDERS + 1):
        push(nb, i, ver=1)
    nb.handle(AtSafePoint(1, []), 0.0)
    assert 0 not in mixed_senders(params)
    push(nb, 0, ver=2)
    nb.handle(AtSafePoint(1, []), 0.0)
    assert 0 in mixed_senders(params) and nb.stats.served == MAX_HELD_SENDERS + 1


def test_a_coordinator_bound_to_every_interface_is_reported_to_where_it_was_dialled() -> None:
    """Bound to 0.0.0.0 it names itself tcp://0.0.0.0:PORT; a peer that reported there would report to itself."""
    from gossiptrain.net.addressing import with_host_if_wildcard
    from gossiptrain.runtime.coordinator_process import BackgroundCoordinator
    from gossiptrain.runtime.peer import Peer

    assert with_host_if_wildcard("tcp://0.0.0.0:7070?curve=ab", "10.0.0.5") == "tcp://10.0.0.5:7070?curve=ab"
    assert with_host_if_wildcard("tcp://[::]:7070", "fd00::1") == "tcp://[fd00::1]:7070"
    assert with_host_if_wildcard("tcp://127.0.0.3:7070", "10.0.0.5") == "tcp://127.0.0.3:7070"
    coord = BackgroundCoordinator(fast_config(), bind="0.0.0.0:0")
    try:
        port = int(coord.address.rsplit(":", 1)[1])
        model = torch.nn.Linear(4, 2)
        with Peer(model, join=f"127.0.0.1:{port}", bind="127.0.0.7:0", config=fast_config()) as peer:
            assert peer._node is not None and peer._node.coordinator == f"tcp://127.0.0.1:{port}"
            wait_for(lambda: coord.coordinator.stats.reports > 0, 30, "a report to reach the coordinator")
    finally:
        coord.close()
