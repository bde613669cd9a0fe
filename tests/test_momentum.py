"""Quasi-global momentum (``gossiptrain.protocol.momentum``): SGD's buffer follows the model's real change.

Unit checks of the update against the paper's formulas, and in the simulator
the label-skew gain that made it the default for pairwise.
"""

from __future__ import annotations

import statistics

import pytest
import torch

from gossiptrain.config import GossipConfig
from gossiptrain.errors import ConfigError
from gossiptrain.protocol.momentum import QuasiGlobalMomentum, wants_quasi_global

from .swarm import skewed_sim_final

LR, MU = 0.1, 0.9


@pytest.fixture
def no_warmup(monkeypatch: pytest.MonkeyPatch) -> None:
    """The update from the first safe point on (the unit checks below), without the warm start."""
    import gossiptrain.protocol.momentum as momentum

    monkeypatch.setattr(momentum, "WARMUP_SAFE_POINTS", 0)


def sgd_step(p: torch.Tensor, opt: torch.optim.Optimizer, grad: float) -> None:
    p.grad = torch.full_like(p, grad)
    opt.step()


def test_the_buffer_is_the_running_average_of_the_models_change_merges_included(no_warmup: None) -> None:
    p = torch.nn.Parameter(torch.zeros(3))
    opt = torch.optim.SGD([p], lr=LR, momentum=MU)
    qg = QuasiGlobalMomentum(opt)
    qg()  # the first safe point: the reference model
    sgd_step(p, opt, 1.0)  # x: 0 -> -0.1 (d = 1)
    qg()
    m = (1 - MU) * 1.0
    assert torch.allclose(opt.state[p]["momentum_buffer"], torch.full((3,), m))
    sgd_step(p, opt, 1.0)  # steps by g + mu m = 1 + 0.9 * 0.1
    with torch.no_grad():
        p.add_(0.5)  # a merge at this safe point moved the model by +0.5
    qg()
    d = (1 + MU * m) - 0.5 / LR  # the local step's change and the merge's, per unit of lr
    m = MU * m + (1 - MU) * d
    assert torch.allclose(opt.state[p]["momentum_buffer"], torch.full((3,), m), atol=1e-6)


def test_a_change_far_larger_than_recent_ones_enters_the_buffer_clipped_and_does_not_raise_the_limit(no_warmup: None) -> None:
    from gossiptrain.protocol.momentum import CHANGE_CLIP, CHANGE_WARMUP

    p = torch.nn.Parameter(torch.zeros(4))
    opt = torch.optim.SGD([p], lr=LR, momentum=MU)
    qg = QuasiGlobalMomentum(opt)
    qg()
    for _ in range(CHANGE_WARMUP):  # ordinary safe points: the model moves by lr * 1 per coordinate
        with torch.no_grad():
            p.sub_(LR)
        qg()
    before = opt.state[p]["momentum_buffer"].clone()
    with torch.no_grad():
        p.sub_(100 * LR)  # a merge 100 times the usual change
    qg()
    d = CHANGE_CLIP * 1.0  # entered at the limit: CHANGE_CLIP times the median change (1 per coordinate, per lr)
    assert torch.allclose(opt.state[p]["momentum_buffer"], MU * before + (1 - MU) * d, atol=1e-6)
    assert qg.clipped == 1
    with torch.no_grad():
        p.sub_(5 * LR)  # 5 times the usual: clipped again, since the outlier entered the history clipped
    qg()
    assert qg.clipped == 2


def test_groups_of_different_rates_are_measured_per_unit_of_their_own_rate_and_clipped_as_one(no_warmup: None) -> None:
    """The clip looks at the whole change per unit of lr: each group's change is divided by its own rate."""
    import math

    from gossiptrain.protocol.momentum import CHANGE_CLIP, CHANGE_WARMUP

    fast, slow = torch.nn.Parameter(torch.zeros(4)), torch.nn.Parameter(torch.zeros(4))
    opt = torch.optim.SGD([{"params": [fast], "lr": 0.1}, {"params": [slow], "lr": 0.01}], lr=0.1, momentum=MU)
    qg = QuasiGlobalMomentum(opt)
    qg()
    for _ in range(CHANGE_WARMUP):  # each coordinate moves by its group's lr: 1 per unit of lr everywhere
        with torch.no_grad():
            fast.sub_(0.1)
            slow.sub_(0.01)
        qg()
    assert qg.clipped == 0
    before = [opt.state[p]["momentum_buffer"].clone() for p in (fast, slow)]
    with torch.no_grad():
        fast.sub_(0.1)
        slow.sub_(100 * 0.01)  # 100 per unit of lr in the slow group only
    qg()
    scale = CHANGE_CLIP * math.sqrt(8) / math.sqrt(4 * 1**2 + 4 * 100**2)  # the limit over the whole change's norm
    assert qg.clipped == 1
    assert torch.allclose(opt.state[fast]["momentum_buffer"], MU * before[0] + (1 - MU) * 1 * scale, atol=1e-6)
    assert torch.allclose(opt.state[slow]["momentum_buffer"], MU * before[1] + (1 - MU) * 100 * scale, atol=1e-5)


def test_while_inactive_the_optimizers_own_momentum_runs_and_a_return_starts_from_it(no_warmup: None) -> None:
    p = torch.nn.Parameter(torch.zeros(3))
    opt = torch.optim.SGD([p], lr=LR, momentum=MU)
    active = [True]
    qg = QuasiGlobalMomentum(opt, active=lambda: active[0])
    qg()
    sgd_step(p, opt, 1.0)
    qg()  # active: the buffer is the running average of the change, (1 - mu) * 1
    active[0] = False
    sgd_step(p, opt, 1.0)  # torch's own momentum: buf <- mu buf + g
    with torch.no_grad():
        p.add_(0.5)  # a merge, which the inactive hook leaves out of the buffer
    qg()
    own = MU * (1 - MU) + 1.0
    assert torch.allclose(opt.state[p]["momentum_buffer"], torch.full((3,), own))
    active[0] = True
    sgd_step(p, opt, 0.0)  # steps by mu * own
    qg()  # back: the average goes on from the buffer, with this step's change only (not the merge before)
    expected = MU * own + (1 - MU) * (MU * own)
    assert torch.allclose(opt.state[p]["momentum_buffer"], torch.full((3,), expected), atol=1e-6)


def test_the_first_safe_points_run_the_optimizers_own_momentum_then_the_buffer_starts_from_it() -> None:
    from gossiptrain.protocol.momentum import WARMUP_SAFE_POINTS

    p = torch.nn.Parameter(torch.zeros(3))
    opt = torch.optim.SGD([p], lr=LR, momentum=MU)
    qg = QuasiGlobalMomentum(opt)
    own = 0.0
    for _ in range(WARMUP_SAFE_POINTS):
        sgd_step(p, opt, 1.0)  # torch's heavy ball: buf <- mu buf + g
        with torch.no_grad():
            p.add_(0.01)  # a merge, left out of the buffer while warming up
        qg()
        own = MU * own + 1.0
        assert torch.allclose(opt.state[p]["momentum_buffer"], torch.full((3,), own), atol=1e-5)
    sgd_step(p, opt, 1.0)  # steps by g + mu * own
    with torch.no_grad():
        p.add_(0.5)
    qg()  # the average now, from the warm buffer: this step's change and the merge's
    d = (1.0 + MU * own) - 0.5 / LR
    expected = MU * own + (1 - MU) * d
    assert torch.allclose(opt.state[p]["momentum_buffer"], torch.full((3,), expected), atol=1e-4)


def test_a_newcomer_that_downloaded_a_running_swarms_model_starts_without_the_warm_start() -> None:
    p = torch.nn.Parameter(torch.zeros(3))
    opt = torch.optim.SGD([p], lr=LR, momentum=MU)
    qg = QuasiGlobalMomentum(opt)
    qg.mid_run()  # as install_transfer calls it, before the first step
    qg()  # the first safe point: the reference model, as without a warm start
    sgd_step(p, opt, 1.0)
    with torch.no_grad():
        p.add_(0.05)  # a merge: in the buffer at once (during a warm start it would be left out)
    qg()
    expected = (1 - MU) * (1.0 - 0.05 / LR)
    assert torch.allclose(opt.state[p]["momentum_buffer"], torch.full((3,), expected), atol=1e-5)


def test_it_leaves_adam_and_sgd_without_momentum_alone() -> None:
    p = torch.nn.Parameter(torch.zeros(2))
    for opt in (torch.optim.Adam([p], lr=LR), torch.optim.SGD([p], lr=LR)):
        qg = QuasiGlobalMomentum(opt)
        assert not qg.enabled
        qg()
        p.grad = torch.ones_like(p)
        opt.step()
        qg()
        assert "momentum_buffer" not in opt.state[p] or opt.state[p]["momentum_buffer"] is None


def test_auto_gives_it_to_no_algorithm_and_quasi_global_to_any() -> None:
    """Not a default since issue 46 (a user's MLP went to NaN with it): asked for, any algorithm runs it."""
    assert not any(wants_quasi_global(GossipConfig(algorithm=a)) for a in ("pairwise", "push-sum", "neighbor", "local-sgd"))
    assert all(wants_quasi_global(GossipConfig(algorithm=a, momentum_mode="quasi-global")) for a in ("pairwise", "push-sum"))
    assert not wants_quasi_global(GossipConfig(momentum_mode="local"))
    assert wants_quasi_global(GossipConfig(algorithm="neighbor", momentum_mode="quasi-global"))
    with pytest.raises(ConfigError, match="gossip.momentum_mode"):
        GossipConfig(momentum_mode="global")


def skewed_run(mode: str) -> float:
    """Mean test accuracy after 1.5 virtual s: 4 peers, digits-small, 3 classes each, 100 Mbit/s links, no drift
    correction (seed 0: 0.962 with quasi-global momentum, 0.851 with local)."""
    final = skewed_sim_final(1.5, 1.25e7, 0.5, **{"gossip.momentum_mode": mode, "gossip.drift_gain": 0.0})
    return statistics.mean(r["test_acc"] for r in final)


def test_on_label_skewed_shards_it_learns_faster_than_local_momentum() -> None:
    """Measured in the simulator (2 seeds): pairwise at 0.95 by 1.25 s with it, by 4.0 s without (no drift correction)."""
    assert skewed_run("quasi-global") > skewed_run("local") + 0.03
