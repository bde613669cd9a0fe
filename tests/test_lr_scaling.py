"""The square-root rule for adaptive optimizers (``gossiptrain.protocol.lr_scaling``).

An Adam step under the hook is the step of an Adam at sqrt(members) times
the rate, bit for bit; outside ``step()`` the rate is the user's (a
scheduler and a checkpoint see what they set); a step that raises leaves
nothing scaled; ``close()`` gives the optimizer back; SGD is left alone
unless asked; and in the simulator an Adam swarm of 4 steps at twice the
rate while an SGD swarm steps at its own.
"""

from __future__ import annotations

import math

import pytest
import torch

from gossiptrain.config import GossipConfig, RunConfig
from gossiptrain.errors import ConfigError
from gossiptrain.protocol.lr_scaling import MAX_SCALED_MEMBERS, SwarmLrScaling, factor, wants_scaling
from gossiptrain.sim.cluster import SimConfig, simulate


def model_and_batch(seed: int = 0) -> tuple[torch.nn.Module, torch.Tensor, torch.Tensor]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))
    x = torch.randn(32, 8)  # (B, 8)
    y = torch.randint(3, (32,))  # (B,)
    return model, x, y


def train(model: torch.nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor, steps: int) -> None:
    for _ in range(steps):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()


def test_a_scaled_adam_step_is_the_step_of_adam_at_sqrt_members_times_the_rate() -> None:
    scaled_model, x, y = model_and_batch()
    plain_model, _, _ = model_and_batch()
    scaled = torch.optim.AdamW(scaled_model.parameters(), lr=0.003, weight_decay=0.1)
    plain = torch.optim.AdamW(plain_model.parameters(), lr=0.003 * 2.0, weight_decay=0.1)
    hooks = SwarmLrScaling(scaled, members=lambda: 4)
    train(scaled_model, scaled, x, y, 20)
    train(plain_model, plain, x, y, 20)
    for a, b in zip(scaled_model.parameters(), plain_model.parameters()):
        assert torch.equal(a, b)
    assert hooks.last_factor == 2.0
    assert scaled.param_groups[0]["lr"] == 0.003  # between steps the rate is the user's


def test_a_scheduler_and_the_optimizer_state_see_the_users_rate() -> None:
    model, x, y = model_and_batch()
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    SwarmLrScaling(opt, members=lambda: 9)
    seen = []
    for _ in range(6):
        train(model, opt, x, y, 1)
        sched.step()
        seen.append(opt.param_groups[0]["lr"])
    assert seen == pytest.approx([0.01, 0.005, 0.005, 0.0025, 0.0025, 0.00125])
    assert opt.state_dict()["param_groups"][0]["lr"] == pytest.approx(0.00125)


def test_a_step_that_raises_leaves_nothing_scaled_for_the_next() -> None:
    model, x, y = model_and_batch()
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    hooks = SwarmLrScaling(opt, members=lambda: 4)
    hooks._pre(opt, (), {})  # as if step() began and raised before its post hook
    assert opt.param_groups[0]["lr"] == pytest.approx(0.02)
    rates = []
    opt.register_step_pre_hook(lambda o, a, k: rates.append(o.param_groups[0]["lr"]))  # runs after ours
    train(model, opt, x, y, 1)
    assert rates == [pytest.approx(0.02)]  # scaled once, not twice
    assert opt.param_groups[0]["lr"] == 0.01


def test_close_gives_the_optimizer_back() -> None:
    model, x, y = model_and_batch()
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    hooks = SwarmLrScaling(opt, members=lambda: 4)
    hooks.close()
    rates = []
    opt.register_step_pre_hook(lambda o, a, k: rates.append(o.param_groups[0]["lr"]))
    train(model, opt, x, y, 1)
    assert rates == [0.01]


def test_which_optimizers_are_scaled_and_by_how_much() -> None:
    model, _, _ = model_and_batch()
    adam, sgd = torch.optim.Adam(model.parameters()), torch.optim.SGD(model.parameters(), lr=0.1)
    assert wants_scaling("auto", adam) and not wants_scaling("auto", sgd)
    assert wants_scaling("sqrt", sgd) and not wants_scaling("none", adam) and not wants_scaling("auto", None)
    assert factor(0) == factor(1) == 1.0
    assert factor(3) == math.sqrt(3)
    assert factor(10 * MAX_SCALED_MEMBERS) == math.sqrt(MAX_SCALED_MEMBERS)


def test_an_unknown_mode_is_refused_by_name() -> None:
    with pytest.raises(ConfigError, match="gossip.lr_scaling"):
        GossipConfig(lr_scaling="linear")


@pytest.mark.parametrize(("optimizer", "lr", "expected"), [("adam", 0.003, 2.0), ("sgd", 0.05, 1.0)])
def test_in_a_swarm_of_4_adam_steps_at_twice_the_rate_and_sgd_at_its_own(optimizer: str, lr: float, expected: float) -> None:
    run = RunConfig().with_overrides({
        "train.workload": "digits-small", "train.optimizer": optimizer, "train.lr": lr, "train.shards": 4,
        "train.eval_every_seconds": 0.5,
    })
    result = simulate(SimConfig(peers=4, run=run, duration=2.0, step_time=0.01, wait_for=4, join_spread=0.01, sample_every=0.5))
    last = [r for r in result.rows if r["time"] == result.rows[-1]["time"]]
    assert len(last) == 4
    assert all(r["step"] > 0 for r in last)
    assert [r["lr_scale"] for r in last] == [expected] * 4
