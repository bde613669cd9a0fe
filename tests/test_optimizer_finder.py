"""A ``Peer`` without ``optimizer=`` finds the optimizer that steps its model (``gossiptrain.runtime.optimizer_finder``).

A loop that never names its optimizer gets what one that does gets: quasi-global
momentum, the square-root rate scaling from the very first step, a donor's
optimizer state; an optimizer over other parameters is ignored, ``optimizer=None``
installs nothing, two optimizers over one model are each bound (and newcomers
get no optimizer state), and ``close()`` leaves no hook behind.

Real peers on loopback, each on its own 127.0.0.x with port 0, joined through an in-process coordinator.
"""

from __future__ import annotations

import asyncio
import logging
import random
from typing import Any

import pytest
import torch

import gossiptrain.protocol.momentum as momentum_module
from gossiptrain.runtime import optimizer_finder
from gossiptrain.runtime.clock import REAL_CLOCK
from gossiptrain.runtime.optimizer_finder import FIND_OPTIMIZER
from gossiptrain.runtime.peer import Peer
from gossiptrain.runtime.state_endpoint import SnapshotHook, aside_state_dict, catch_up
from gossiptrain.state.snapshot import state_tensors

from .conftest import fast_config
from .swarm import next_host, wait_for
from .test_optimizer_transfer import (
    RUN,
    Wired,
    adam,
    assert_same_state,
    model,
    optimizer_state,
    safe_points,
    sgd,
    trained,
    trained_donor,
)

# No exchanges and no state download: what the optimizer gets is all that differs between two runs.
QUIET = {"train.workload": "external", "gossip.exchange_every_steps": 2 * 10**9, "state.enabled": False}

OptimizerChoice = Any  # an optimizer, None, or FIND_OPTIMIZER (the default: not passed)


#: Quasi-global momentum is no default (gossiptrain.protocol.momentum): asked for, it shows whether the optimizer is bound.
QUASI_GLOBAL = {"gossip.momentum_mode": "quasi-global"}


def join_of(coordinator_factory: Any, shards: int, **overrides: Any) -> str:
    coord = coordinator_factory(fast_config(**{**QUIET, "train.shards": shards, **overrides}))
    return coord.address.removeprefix("tcp://")


def new_peer(module: torch.nn.Module, join: str, optimizer: OptimizerChoice = FIND_OPTIMIZER) -> Peer:
    kwargs = {} if optimizer is FIND_OPTIMIZER else {"optimizer": optimizer}
    return Peer(module, join=join, bind=f"{next_host()}:0", transfer_state=False, **kwargs)


def net(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))


def train_step(module: torch.nn.Module, opt: torch.optim.Optimizer, gen: torch.Generator) -> None:
    x, y = torch.randn(16, 6, generator=gen), torch.randint(0, 3, (16,), generator=gen)  # (B, 6), (B,)
    opt.zero_grad()
    torch.nn.functional.cross_entropy(module(x), y).backward()
    opt.step()


def buffers(opt: torch.optim.Optimizer, key: str) -> list[torch.Tensor]:
    return [opt.state[p][key].clone() for g in opt.param_groups for p in g["params"]]


@pytest.fixture
def short_warmup(monkeypatch: pytest.MonkeyPatch) -> None:
    """Quasi-global momentum from the third safe point on: a few steps show whether it runs."""
    monkeypatch.setattr(momentum_module, "WARMUP_SAFE_POINTS", 2)


# -- (a) the same handling, named or not -------------------------------------------------------------


def sgd_run(join: str, optimizer: str, steps: int = 6) -> tuple[dict[str, Any], list[torch.Tensor]]:
    """A one-member swarm, SGD with momentum 0.9: its stats and momentum buffers after ``steps`` steps."""
    module = net(0)
    opt = torch.optim.SGD(module.parameters(), lr=0.05, momentum=0.9)
    choice = {"given": opt, "found": FIND_OPTIMIZER, "none": None}[optimizer]
    with new_peer(module, join, choice) as peer:
        assert peer.stats()["optimizer"] == {"given": "given", "found": "waiting", "none": "none"}[optimizer]
        gen = torch.Generator().manual_seed(1)
        for _ in range(steps):
            train_step(module, opt, gen)
            peer.step()
        stats = peer.stats()
        assert (peer.optimizer is opt) == (optimizer != "none")
        return stats, buffers(opt, "momentum_buffer")


@pytest.mark.timeout(60)
def test_sgd_found_without_being_named_gets_quasi_global_momentum_as_if_given(
    coordinator_factory: Any, short_warmup: None
) -> None:
    join = join_of(coordinator_factory, shards=1, **QUASI_GLOBAL)
    given, given_buffers = sgd_run(join, "given")
    found, found_buffers = sgd_run(join, "found")
    plain, plain_buffers = sgd_run(join, "none")
    assert (given["optimizer"], found["optimizer"], plain["optimizer"]) == ("given", "found", "none")
    assert given["optimizer_class"] == found["optimizer_class"] == "SGD" and "optimizer_class" not in plain
    assert given["lr_scale"] == found["lr_scale"] == plain["lr_scale"] == 1.0  # SGD is not scaled
    assert all(torch.equal(a, b) for a, b in zip(given_buffers, found_buffers, strict=True))
    # The optimizer's own momentum (optimizer=None) is another buffer: quasi-global momentum ran in both others.
    assert not all(torch.equal(a, b) for a, b in zip(given_buffers, plain_buffers, strict=True))


def adam_pair_run(join: str, optimizer: str, steps: int = 4) -> tuple[list[dict[str, Any]], list[list[torch.Tensor]]]:
    """Two peers in this process, Adam each, stepped in turn once both see each other: stats and parameters."""
    modules = [net(0), net(1)]
    opts = [torch.optim.Adam(m.parameters(), lr=0.01) for m in modules]
    choices = [{"given": o, "found": FIND_OPTIMIZER, "none": None}[optimizer] for o in opts]
    peers: list[Peer] = []
    try:
        peers = [new_peer(m, join, c) for m, c in zip(modules, choices, strict=True)]
        wait_for(lambda: all(p.members == 2 for p in peers), 30, "both peers to see each other")
        gens = [torch.Generator().manual_seed(10 + i) for i in range(2)]
        for _ in range(steps):
            for m, o, p, g in zip(modules, opts, peers, gens, strict=True):
                train_step(m, o, g)
                p.step()
        if optimizer != "none":  # each peer bound its own optimizer, not the other's
            assert [p.optimizer for p in peers] == opts
        return [p.stats() for p in peers], [[t.detach().clone() for t in m.parameters()] for m in modules]
    finally:
        for p in peers:
            p.close()


@pytest.mark.timeout(90)
def test_adam_found_in_a_swarm_of_two_steps_at_the_scaled_rate_from_its_first_step(coordinator_factory: Any) -> None:
    join = join_of(coordinator_factory, shards=2)
    given, given_params = adam_pair_run(join, "given")
    found, found_params = adam_pair_run(join, "found")
    plain, plain_params = adam_pair_run(join, "none")
    for stats in given + found:
        assert stats["lr_scale"] == pytest.approx(2**0.5) and stats["optimizer_class"] == "Adam"
    assert [s["optimizer"] for s in given + found + plain] == ["given"] * 2 + ["found"] * 2 + ["none"] * 2
    assert [s["lr_scale"] for s in plain] == [1.0, 1.0]
    # No exchanges: each model is its own loop's. Found, every step (the first included) ran at the rate given had.
    for a, b, c in zip(given_params, found_params, plain_params, strict=True):
        assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
        assert not all(torch.equal(x, z) for x, z in zip(a, c, strict=True))


# -- (b) (c) what is not bound -------------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_an_optimizer_over_other_parameters_is_ignored_and_one_over_some_of_ours_is_bound(coordinator_factory: Any) -> None:
    join = join_of(coordinator_factory, shards=1, **{"gossip.lr_scaling": "sqrt"})  # every bound optimizer hooked
    module, other = net(0), net(1)
    other_opt = torch.optim.SGD(other.parameters(), lr=0.1, momentum=0.9)
    extra = torch.nn.Parameter(torch.zeros(3))
    mixed = torch.optim.SGD([*module.parameters(), extra], lr=0.1)  # this model's parameters and one more
    with new_peer(module, join) as peer:
        gen = torch.Generator().manual_seed(0)
        for _ in range(3):
            train_step(other, other_opt, gen)
        assert peer.stats()["optimizer"] == "waiting" and peer.optimizer is None
        assert not other_opt._optimizer_step_pre_hooks  # nothing hooked on it
        train_step(module, mixed, gen)
        peer.step()
        stats = peer.stats()
        assert stats["optimizer"] == "found" and stats["optimizer_class"] == "SGD" and peer.optimizer is mixed
        assert len(mixed._optimizer_step_pre_hooks) == 1  # the rate scaling
        train_step(other, other_opt, gen)
        assert not other_opt._optimizer_step_pre_hooks and peer.stats()["optimizer_class"] == "SGD"


@pytest.mark.timeout(60)
def test_explicit_none_installs_no_hook_and_finds_nothing(coordinator_factory: Any) -> None:
    join = join_of(coordinator_factory, shards=1, **{"gossip.lr_scaling": "sqrt"})
    module = net(0)
    opt = torch.optim.Adam(module.parameters(), lr=0.01)
    watching = optimizer_finder.watching()
    with new_peer(module, join, None) as peer:
        assert optimizer_finder.watching() == watching
        gen = torch.Generator().manual_seed(0)
        for _ in range(3):
            train_step(module, opt, gen)
            peer.step()
        stats = peer.stats()
        assert stats["optimizer"] == "none" and "optimizer_class" not in stats and stats["lr_scale"] == 1.0
        assert peer.optimizer is None and not opt._optimizer_step_pre_hooks and peer._momentum is None


# -- (d) two optimizers over one model -------------------------------------------------------------------


class TwoParts(torch.nn.Module):
    """A GAN's shape: a generator and a discriminator in one module, each with its own optimizer."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.generator = torch.nn.Linear(4, 6)
        self.discriminator = torch.nn.Linear(6, 1)


@pytest.mark.timeout(60)
def test_two_optimizers_over_one_model_each_get_their_own_and_newcomers_no_optimizer_state(
    coordinator_factory: Any, caplog: pytest.LogCaptureFixture
) -> None:
    join = join_of(coordinator_factory, shards=1, **{"state.transfer_optimizer": True, **QUASI_GLOBAL})
    module = TwoParts()
    opt_g = torch.optim.Adam(module.generator.parameters(), lr=0.01)
    opt_d = torch.optim.SGD(module.discriminator.parameters(), lr=0.05, momentum=0.9)
    gen = torch.Generator().manual_seed(0)
    with caplog.at_level(logging.INFO, logger="gossiptrain"), new_peer(module, join) as peer:
        for _ in range(2):
            z = torch.randn(8, 4, generator=gen)  # (B, 4)
            opt_g.zero_grad()
            (-module.discriminator(module.generator(z)).mean()).backward()
            opt_g.step()
            opt_d.zero_grad()
            module.discriminator(module.generator(z).detach()).mean().backward()
            opt_d.step()
            peer.step()
        stats = peer.stats()
        assert stats["optimizer"] == "found" and stats["optimizer_class"] == "Adam, SGD"
        side = peer._side
        assert side is not None and side.optimizers == [opt_g, opt_d]
        assert [m.optimizer for m in side.momenta] == [opt_g, opt_d] and side.momenta[1].enabled
        assert [s.optimizer for s in side.scalings] == [opt_g]  # Adam's rate is scaled, SGD's is not (auto)
        assert side.snapshots.optimizer is None  # a newcomer's download carries no optimizer state
    found = [r.getMessage() for r in caplog.records if "found the optimizer" in r.getMessage()]
    assert len(found) == 2 and "Adam, with square-root lr scaling" in found[0]
    assert "SGD, with quasi-global momentum" in found[1]
    assert sum("two optimizers step this model (Adam, SGD)" in r.getMessage() for r in caplog.records) == 1


# -- (e) close() ------------------------------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_close_removes_the_hooks_and_gives_the_optimizer_back(coordinator_factory: Any) -> None:
    join = join_of(coordinator_factory, shards=1, **{"gossip.lr_scaling": "sqrt"})
    from torch.optim.optimizer import _global_optimizer_pre_hooks as global_hooks  # torch's own table

    before_watching, before_hooks = optimizer_finder.watching(), len(global_hooks)
    module = net(0)
    opt = torch.optim.Adam(module.parameters(), lr=0.01)
    peer = new_peer(module, join)
    try:
        assert optimizer_finder.watching() == before_watching + 1
        assert len(global_hooks) == before_hooks + (before_watching == 0)  # one torch hook per process
        train_step(module, opt, torch.Generator().manual_seed(0))
        assert peer.stats()["optimizer"] == "found" and opt._optimizer_step_pre_hooks
    finally:
        peer.close()
    assert optimizer_finder.watching() == before_watching and len(global_hooks) == before_hooks
    assert not opt._optimizer_step_pre_hooks and not opt._optimizer_step_post_hooks
    rates: list[float] = []
    opt.register_step_pre_hook(lambda o, a, k: rates.append(o.param_groups[0]["lr"]))
    train_step(module, opt, torch.Generator().manual_seed(1))
    assert rates == [0.01]  # the user's rate again
    # A new peer on another model is not handed the closed one's optimizer.
    again = net(1)
    with new_peer(again, join) as fresh:
        train_step(module, opt, torch.Generator().manual_seed(2))
        assert fresh.stats()["optimizer"] == "waiting"


# -- (f) a donor's optimizer state reaches a found optimizer -----------------------------------------------


def step_once(m: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    gen = torch.Generator().manual_seed(5)
    x, y = torch.randn(32, 20, generator=gen), torch.randint(0, 3, (32,), generator=gen)  # (B, 20), (B,)
    opt.zero_grad()
    torch.nn.functional.cross_entropy(m(x), y).backward()
    opt.step()


@pytest.mark.timeout(90)
def test_a_downloaded_optimizer_state_is_loaded_into_the_optimizer_found_before_its_first_step(
    coordinator_factory: Any,
) -> None:
    with trained_donor(coordinator_factory, adam) as (join, donor_model, donor_opt):
        newcomer_model = model(2)
        new_opt = adam(newcomer_model)
        seen: list[dict[str, torch.Tensor]] = []
        # Registered before the peer binds the optimizer: runs after the binding, before the first step itself.
        new_opt.register_step_pre_hook(lambda o, a, k: seen.append({k: v.clone() for k, v in optimizer_state(newcomer_model, o).items()}))
        with Peer(newcomer_model, join=join, bind=f"{next_host()}:0") as newcomer:
            assert newcomer.transfer_summary()["state_optimizer"] == "waiting"
            assert_same_state(newcomer_model, donor_model)
            assert not new_opt.state  # not stepped yet: the donor's state waits for it
            step_once(newcomer_model, new_opt)
            stats = newcomer.stats()
            assert stats["optimizer"] == "found" and stats["optimizer_class"] == "Adam"
            assert newcomer.transfer_summary()["state_optimizer"] == "installed"
        theirs = optimizer_state(donor_model, donor_opt)
        assert len(seen) == 1 and seen[0].keys() == theirs.keys()
        assert any(k.endswith("exp_avg") for k in theirs)
        assert all(torch.equal(seen[0][k], theirs[k]) for k in theirs)


@pytest.mark.timeout(90)
def test_a_downloaded_optimizer_state_that_does_not_fit_the_one_found_is_dropped_with_a_warning(
    coordinator_factory: Any, caplog: pytest.LogCaptureFixture
) -> None:
    with trained_donor(coordinator_factory, sgd) as (join, donor_model, _):
        newcomer_model = model(2)
        new_opt = adam(newcomer_model)  # the donor's is SGD with momentum: its buffers are no Adam state
        seen: list[int] = []
        new_opt.register_step_pre_hook(lambda o, a, k: seen.append(len(o.state)))
        with caplog.at_level(logging.INFO, logger="gossiptrain"), Peer(newcomer_model, join=join, bind=f"{next_host()}:0") as newcomer:
            assert_same_state(newcomer_model, donor_model)  # the parameters came all the same
            step_once(newcomer_model, new_opt)  # trains on, from its own fresh state
            assert newcomer.stats()["optimizer"] == "found" and newcomer.transfer_summary()["state_optimizer"] == "refused"
        assert seen == [0] and new_opt.state  # nothing loaded before the first step; the step made its own
        warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and "does not fit the Adam" in r.getMessage()]
        assert len(warned) == 1 and "own fresh state" in warned[0], warned


# -- the download kept aside, in process (the fetcher and aside_state_dict, no Peer) ---------------------


def download_aside(donor: torch.nn.Module, donor_opt: torch.optim.Optimizer | None, newcomer: torch.nn.Module) -> Any:
    """catch_up with no optimizer known yet (``keep_optimizer``), from one donor through the real wire codec."""
    wired = Wired(RUN)

    async def main() -> Any:
        endpoint = wired.add("a")
        endpoint.mark_ready()
        hook = SnapshotHook(endpoint, donor, endpoint.offer_snapshot, REAL_CLOCK, optimizer=donor_opt)
        task = asyncio.create_task(safe_points(hook, samples=320))
        try:
            return await catch_up(
                wired.add("new"), newcomer, me="new", members=lambda: ["new", "a"], rng=random.Random(0),
                clock=REAL_CLOCK, keep_optimizer=True,
            )
        finally:
            task.cancel()

    return asyncio.run(main())


def test_a_state_kept_aside_fits_the_optimizer_found_only_if_it_is_the_donors_kind() -> None:
    donor, donor_opt = trained(1, sgd)
    newcomer = model(2)
    result, values = download_aside(donor, donor_opt, newcomer)
    assert result.ok and values is not None and result.optimizer and result.optimizer_state is None, result.reason
    assert {name.rpartition("/")[2] for name, _ in result.optimizer_aside} == {"momentum_buffer"}
    why = aside_state_dict(newcomer, adam(newcomer), result)  # found: another kind than the donor's
    assert isinstance(why, str) and "is missing" in why
    mine = sgd(newcomer)
    fitted = aside_state_dict(newcomer, mine, result)
    assert isinstance(fitted, dict), fitted
    mine.load_state_dict(fitted)
    theirs, ours = optimizer_state(donor, donor_opt), optimizer_state(newcomer, mine)
    assert theirs.keys() == ours.keys() and all(torch.equal(ours[k], theirs[k]) for k in theirs)


def test_a_donor_without_optimizer_state_gives_the_parameters_alone() -> None:
    donor, _ = trained(1, sgd)
    newcomer = model(2)
    result, values = download_aside(donor, None, newcomer)
    assert result.ok and values is not None and not result.optimizer and result.optimizer_aside == (), result
    assert not result.optimizer_problem


def test_an_optimizer_state_too_large_to_take_unseen_gives_the_parameters_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    import gossiptrain.protocol.state_transfer.assembly as assembly

    monkeypatch.setattr(assembly, "ANY_OPTIMIZER_SHARE", 0)  # any optimizer state is too large
    donor, donor_opt = trained(1, sgd)
    newcomer = model(2)
    result, values = download_aside(donor, donor_opt, newcomer)
    assert result.ok and values is not None and not result.optimizer and result.optimizer_aside == (), result
    assert "ANY_OPTIMIZER_SHARE=0" in result.optimizer_problem
    assert all(torch.equal(v, t) for v, t in zip(values, state_tensors(donor), strict=True))  # the donor's parameters
