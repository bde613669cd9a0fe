"""State transfer of optimizer state (``state.transfer_optimizer``).

In process: a donor's and a newcomer's ``StateEndpoint`` talk through the
real wire codec on one event loop, with the donor's safe point running as a
task; then the simulator, where a rejoining peer takes its donor's momentum.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import threading
import time
from typing import Any, Callable, Iterator

import pytest
import torch

from gossiptrain.config import RunConfig
from gossiptrain.errors import ProtocolError
from gossiptrain.net import kinds
from gossiptrain.net.wire import DTYPES, Message, decode, encode
from gossiptrain.protocol.state_transfer import TransferResult
from gossiptrain.runtime.clock import REAL_CLOCK
from gossiptrain.runtime.peer import Peer
from gossiptrain.runtime.state_endpoint import SnapshotHook, StateEndpoint, catch_up
from gossiptrain.sim.cluster import Cluster, SimConfig
from gossiptrain.sim.faults import ChurnEvent
from gossiptrain.state.optimizer_state import optimizer_template, parameter_names
from gossiptrain.state.snapshot import Manifest, Snapshot, install, state_tensors, table_layout, tensors_from

from .conftest import fast_config
from .swarm import next_host
from .test_state_transfer import run_cluster

RUN = RunConfig().with_overrides({
    "state.chunk_bytes": 1024, "state.request_timeout": 1.0, "state.max_seconds": 10.0, "state.transfer_optimizer": True,
})


def model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(20, 16), torch.nn.BatchNorm1d(16), torch.nn.ReLU(), torch.nn.Linear(16, 3))


def trained(seed: int, make_opt: Callable[[torch.nn.Module], torch.optim.Optimizer], steps: int = 5) -> tuple[Any, Any]:
    """A model and its optimizer after a few steps: momentum buffers (or moments) that are not zero."""
    m = model(seed)
    opt = make_opt(m)
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x, y = torch.randn(32, 20, generator=gen), torch.randint(0, 3, (32,), generator=gen)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(m(x), y).backward()
        opt.step()
    return m, opt


def sgd(m: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9)


def adam(m: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.Adam(m.parameters(), lr=0.01)


class Wired:
    """Endpoints by member id, delivering each message through encode/decode on the running loop."""

    def __init__(self, run: RunConfig) -> None:
        self.run = run
        self.endpoints: dict[str, StateEndpoint] = {}
        self.tamper: Callable[[str, str, dict[str, Any], dict[str, torch.Tensor]], dict[str, torch.Tensor]] = (
            lambda sender, kind, body, tensors: tensors
        )

    def add(self, me: str) -> StateEndpoint:
        def send(addr: str, kind: str, body: dict[str, Any], tensors: dict[str, torch.Tensor]) -> bool:
            tensors = self.tamper(me, kind, body, tensors)
            frames = encode(Message(kind, me, f"sim://{me}:1", "fp", 0, body, tensors), self.run.limits)
            to = addr.removeprefix("sim://").partition(":")[0]
            asyncio.get_running_loop().call_soon(lambda: self.endpoints[to].on_message(decode(frames, self.run.limits)))
            return True

        endpoint = StateEndpoint(self.run, send=send, address_of=lambda m: f"sim://{m}:1", clock=REAL_CLOCK)
        self.endpoints[me] = endpoint
        return endpoint


async def safe_points(hook: SnapshotHook, samples: int) -> None:
    """A donor's trainer reaching its safe point every millisecond (it does not train meanwhile)."""
    while True:
        hook(7, samples)
        await asyncio.sleep(0.001)


def transfer(
    donors: dict[str, tuple[torch.nn.Module, torch.optim.Optimizer | None]],
    newcomer: torch.nn.Module,
    new_opt: torch.optim.Optimizer | None,
    run: RunConfig = RUN,
    tamper: Any = None,
) -> tuple[TransferResult, list[torch.Tensor] | None]:
    """Run catch_up for ``newcomer`` against ``donors``; install what came, as Peer does."""
    wired = Wired(run)
    if tamper is not None:
        wired.tamper = tamper

    async def main() -> tuple[TransferResult, list[torch.Tensor] | None]:
        tasks = []
        for name, (m, opt) in donors.items():
            endpoint = wired.add(name)
            endpoint.mark_ready()
            hook = SnapshotHook(endpoint, m, endpoint.offer_snapshot, REAL_CLOCK, optimizer=opt)
            tasks.append(asyncio.create_task(safe_points(hook, samples=320)))
        mine = wired.add("new")
        try:
            result, values = await catch_up_all(mine, newcomer, new_opt, ["new", *donors])
        finally:
            for t in tasks:
                t.cancel()
        return result, values

    async def catch_up_all(endpoint: StateEndpoint, m: torch.nn.Module, opt: Any, members: list[str]) -> Any:
        return await catch_up(
            endpoint, m, me="new", members=lambda: members, rng=random.Random(0), clock=REAL_CLOCK, optimizer=opt
        )

    result, values = asyncio.run(main())
    if values is not None:
        install(state_tensors(newcomer), values)
        if result.optimizer_state is not None:
            assert new_opt is not None
            new_opt.load_state_dict(result.optimizer_state)
    return result, values


def optimizer_state(m: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    names = parameter_names(m)
    return {f"{names[id(p)]}/{k}": v for p, state in opt.state.items() for k, v in state.items()}


def assert_same_state(a: torch.nn.Module, b: torch.nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


# -- in process ------------------------------------------------------------------------------


@pytest.mark.parametrize("make_opt", [sgd, adam], ids=["sgd-momentum", "adam"])
def test_a_newcomer_takes_its_donors_optimizer_state_bit_for_bit(make_opt: Any) -> None:
    donor, donor_opt = trained(1, make_opt)
    newcomer = model(2)
    new_opt = make_opt(newcomer)
    result, values = transfer({"a": (donor, donor_opt)}, newcomer, new_opt)
    assert result.ok and values is not None and result.optimizer and not result.optimizer_problem, result.reason
    assert result.samples == 320 and result.step == 7
    assert_same_state(newcomer, donor)
    theirs, mine = optimizer_state(donor, donor_opt), optimizer_state(newcomer, new_opt)
    assert theirs.keys() == mine.keys() and len(mine) >= 4
    for key in theirs:
        assert torch.equal(mine[key], theirs[key]) and mine[key].dtype == theirs[key].dtype, key
        assert mine[key].data_ptr() != theirs[key].data_ptr()  # a copy of its own, not the donor's memory
    # The newcomer trains on from there with its own hyperparameters, exactly as the donor would.
    assert new_opt.param_groups[0]["lr"] == donor_opt.param_groups[0]["lr"]


def test_without_the_setting_only_the_parameters_come() -> None:
    donor, donor_opt = trained(1, sgd)
    newcomer = model(2)
    new_opt = sgd(newcomer)
    run = RUN.with_overrides({"state.transfer_optimizer": False})
    result, _ = transfer({"a": (donor, donor_opt)}, newcomer, new_opt, run=run)
    assert result.ok and not result.optimizer and result.optimizer_state is None
    assert_same_state(newcomer, donor)
    assert not new_opt.state  # nothing installed: its first step starts the momentum afresh


def test_another_optimizer_is_named_and_the_parameters_alone_are_installed(caplog: Any) -> None:
    caplog.set_level(logging.INFO, logger="gossiptrain.protocol.state_transfer")
    donor, donor_opt = trained(1, adam)
    newcomer = model(2)
    new_opt = sgd(newcomer)
    result, values = transfer({"a": (donor, donor_opt)}, newcomer, new_opt)
    assert result.ok and values is not None and not result.optimizer and result.optimizer_state is None
    assert "momentum_buffer" in result.optimizer_problem and result.optimizer_problem.startswith("a:"), result
    assert_same_state(newcomer, donor)  # the parameters (and batch-norm buffers) came all the same
    assert not new_opt.state
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert any("does not fit our optimizer" in e and "parameters only" in e for e in errors), errors


def test_a_donor_without_an_optimizer_gives_its_parameters() -> None:
    donor = model(1)
    newcomer = model(2)
    new_opt = sgd(newcomer)
    result, _ = transfer({"a": (donor, None)}, newcomer, new_opt)
    assert result.ok and not result.optimizer and "no optimizer state" in result.optimizer_problem
    assert_same_state(newcomer, donor)


def test_non_finite_momentum_is_refused_and_an_honest_donor_serves() -> None:
    liar, liar_opt = trained(1, sgd)
    honest, honest_opt = trained(3, sgd)
    with torch.no_grad():
        next(iter(liar_opt.state.values()))["momentum_buffer"][0] = float("nan")
    newcomer = model(2)
    new_opt = sgd(newcomer)
    result, values = transfer({"liar": (liar, liar_opt), "honest": (honest, honest_opt)}, newcomer, new_opt)
    assert result.ok and result.optimizer and result.donors == ("honest",), result
    assert_same_state(newcomer, honest)
    mine, theirs = optimizer_state(newcomer, new_opt), optimizer_state(honest, honest_opt)
    assert all(torch.equal(mine[k], theirs[k]) for k in theirs)


def test_optimizer_bytes_changed_on_the_way_fail_their_checksum() -> None:
    donor, donor_opt = trained(1, sgd)
    newcomer, fresh = model(2), model(2)
    new_opt = sgd(newcomer)
    flipped: list[int] = []

    def flip_the_last_chunk(sender: str, kind: str, body: dict[str, Any], tensors: dict[str, torch.Tensor]) -> Any:
        if kind == kinds.SREP and "hashes" in body:
            flipped.append(len(body["hashes"]))  # remember the chunk count
        elif kind == kinds.SREP and flipped and body["index"] == flipped[0] - 1:  # the optimizer's bytes end the stream
            return {"chunk": tensors["chunk"].clone().bitwise_xor_(1)}
        return tensors

    result, values = transfer({"a": (donor, donor_opt)}, newcomer, new_opt, tamper=flip_the_last_chunk)
    assert not result.ok and values is None and "no live member left" in result.reason, result
    assert_same_state(newcomer, fresh) and not new_opt.state  # nothing installed


@contextlib.contextmanager
def trained_donor(coordinator_factory: Any, make_opt: Any) -> Iterator[tuple[str, torch.nn.Module, torch.optim.Optimizer]]:
    """A member that trained a few steps with ``make_opt`` (given to its Peer), at its safe points: the join address."""
    config = fast_config(**{
        "train.workload": "external", "train.shards": 2, "state.transfer_optimizer": True,
        "gossip.exchange_every_steps": 2 * 10**9,  # no exchange: the donor's state stays what it is
    })
    join = coordinator_factory(config).address.removeprefix("tcp://")
    donor_model, donor_opt = trained(1, make_opt)
    donor = Peer(donor_model, join=join, bind=f"{next_host()}:0", optimizer=donor_opt)
    halt = threading.Event()

    def loop() -> None:  # the donor's training loop, without the training: safe points only
        while not halt.is_set():
            donor.step(samples_seen=640)
            time.sleep(0.005)

    stepping = threading.Thread(target=loop, daemon=True)
    stepping.start()
    try:
        yield join, donor_model, donor_opt
    finally:
        halt.set()
        stepping.join(10)
        donor.close()



def test_a_peer_joining_over_tcp_installs_its_donors_momentum(coordinator_factory: Any) -> None:
    """Real Peers (this process, loopback TCP): the optimizer given to Peer is what state transfer fills in."""
    with trained_donor(coordinator_factory, sgd) as (join, donor_model, donor_opt):
        newcomer_model = model(2)
        new_opt = sgd(newcomer_model)
        with Peer(newcomer_model, join=join, bind=f"{next_host()}:0", optimizer=new_opt) as newcomer:
            summary = newcomer.transfer_summary()
            assert summary["state_transfer"] == "complete" and summary["state_optimizer"] == "installed", summary
            assert newcomer.transfer is not None and newcomer.transfer.samples == 640
            assert_same_state(newcomer_model, donor_model)
            theirs, mine = optimizer_state(donor_model, donor_opt), optimizer_state(newcomer_model, new_opt)
            assert theirs.keys() == mine.keys() and all(torch.equal(mine[k], theirs[k]) for k in theirs)


# -- the template and the manifest, sans IO --------------------------------------------------


def test_the_template_is_what_a_stepped_optimizer_holds_and_leaves_the_original_alone() -> None:
    m = model(1)
    before = {k: v.clone() for k, v in m.state_dict().items()}
    for make_opt, keys in [(sgd, {"momentum_buffer"}), (adam, {"exp_avg", "exp_avg_sq", "step"})]:
        opt = make_opt(m)
        template = optimizer_template(m, opt)
        assert not isinstance(template, str), template
        assert {name.rpartition("/")[2] for name, _, _ in template.entries} == keys
        assert len(template.entries) == len(keys) * len(list(m.parameters()))
        assert not opt.state  # the original never stepped
    assert all(torch.equal(before[k], v) for k, v in m.state_dict().items())
    plain = optimizer_template(m, torch.optim.SGD(m.parameters(), lr=0.1))  # no momentum: no state to take
    assert not isinstance(plain, str) and plain.entries == ()
    other = torch.nn.Linear(2, 2)
    assert "not one of the model's" in str(optimizer_template(m, torch.optim.SGD(other.parameters(), lr=0.1)))


def test_optimizer_state_that_does_not_fit_the_template_is_refused() -> None:
    m = model(1)
    template = optimizer_template(m, adam(m))
    assert not isinstance(template, str)
    values = [torch.zeros(shape, dtype=DTYPES[d]) for _, d, shape in template.entries]
    assert isinstance(template.state_dict(values, ()), dict)
    assert "not expected" in str(template.state_dict(values, (("optimizer/0.weight/count", 3),)))


def test_a_manifest_table_must_add_up_and_hash_to_its_layout() -> None:
    entries = (("w", "float32", (2, 3)), ("optimizer/w/momentum_buffer", "float32", (2, 3)))
    snap = Snapshot.build(
        torch.zeros(48, dtype=torch.uint8), step=1, layout=table_layout(entries), chunk_bytes=1024, tensors=entries,
        samples=64, scalars=(("optimizer/w/count", 2),),
    )
    body = snap.manifest.to_body()
    assert Manifest.from_body(body) == snap.manifest
    bad_tables: list[Any] = [
        [["w", "float32", [2, 3]]],  # 24 bytes, the state 48
        [["w", "float32", [2, 3]], ["w", "float32", [2, 3]]],  # a name twice (and the layout differs)
        [["w", "pickle", [2, 3]], ["v", "float32", [2, 3]]],  # a dtype the wire does not know
        [["w", "float32", [2, 3]], ["optimizer/w/momentum_buffer", "float32", [3, 2]]],  # adds up, another layout
        "w",
    ]
    for table in bad_tables:
        with pytest.raises(ProtocolError):
            Manifest.from_body({**body, "tensors": table})
    for scalars in ([["optimizer/w/count", float("nan")]], [["w/count", 1]], [["optimizer/w/count", "2"]], [[1, 2]]):
        with pytest.raises(ProtocolError):
            Manifest.from_body({**body, "scalars": scalars})
    with pytest.raises(ProtocolError):
        Manifest.from_body({**body, "samples": -1})


# -- the simulator -----------------------------------------------------------------------------


def test_a_peer_rejoining_in_the_simulator_takes_its_donors_momentum() -> None:
    run = RunConfig().with_overrides({
        "train.workload": "logreg", "train.max_steps": 0, "train.shards": 3, "state.transfer_optimizer": True,
    })
    trace = (ChurnEvent(1.0, 2, "crash"), ChurnEvent(3.0, 2, "join"))
    cluster = Cluster(SimConfig(peers=3, run=run, duration=3.5, step_time=0.1, sample_every=0.5, seed=4, churn_trace=trace))
    served: list[Snapshot] = []
    loaded: list[list[torch.Tensor]] = []
    build = Snapshot.build
    load = torch.optim.SGD.load_state_dict

    def spy_build(data: torch.Tensor, **kw: Any) -> Snapshot:
        served.append(build(data, **kw))
        return served[-1]

    def spy_load(self: torch.optim.Optimizer, state: dict[str, Any]) -> None:
        load(self, state)
        loaded.append([v.clone() for s in self.state.values() for v in s.values() if isinstance(v, torch.Tensor)])

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(Snapshot, "build", staticmethod(spy_build))
        mp.setattr(torch.optim.SGD, "load_state_dict", spy_load)
        run_cluster(cluster)
    late = cluster.peers[2]
    assert late.transfer is not None and late.transfer.ok and late.transfer.optimizer, late.transfer
    (snap,) = [s for s in served if s.manifest.digest == late.transfer.digest]
    table = snap.manifest.tensors
    assert table is not None and any(n.startswith("optimizer/") for n, _, _ in table)
    tensors = tensors_from(table, snap.data)
    assert isinstance(tensors, dict) and loaded  # the last load is the rejoined peer's (others may have caught up at start)
    momentum = [v for n, v in tensors.items() if n.startswith("optimizer/")]
    assert len(momentum) == len(loaded[-1]) and any(bool(m.abs().sum() > 0) for m in momentum)
    for m in momentum:  # what it installed is exactly the donor's momentum at its snapshot
        assert any(torch.equal(m, got) for got in loaded[-1])
