"""The stability guard (``gossiptrain.protocol.stability``): back off in order at a blow-up, restore a non-finite model.

Unit tests drive the guard with a parameter whose norm the test sets; the
methods' own ``suspend``/``resume`` are checked on the real objects
(quasi-global momentum, drift correction, the rate scaling, local SGD's
outer step).
"""

from __future__ import annotations

import logging
import math
import random
import statistics

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from gossiptrain.config import GossipConfig, RunConfig
from gossiptrain.protocol.drift import DriftCorrection
from gossiptrain.protocol.local_sgd import LocalSGD
from gossiptrain.protocol.lr_scaling import SwarmLrScaling
from gossiptrain.protocol.momentum import WARMUP_SAFE_POINTS, QuasiGlobalMomentum
from gossiptrain.protocol.stability import (
    BACKOFF_ORDER,
    DRIFT_CORRECTION,
    LR_SCALING,
    OUTER_STEP,
    QUASI_GLOBAL_MOMENTUM,
    StabilityGuard,
    forget_state,
)
from gossiptrain.sim.cluster import Cluster, SimConfig
from gossiptrain.sim.vtime import run_virtual
from peers.logreg import LogRegWorkload


class Recorder:
    """A switch that remembers what it was told."""

    def __init__(self) -> None:
        self.on = True
        self.calls: list[str] = []

    def suspend(self) -> None:
        self.on = False
        self.calls.append("suspend")

    def resume(self) -> None:
        self.on = True
        self.calls.append("resume")


def guard_over(value: float = 1.0, **kwargs: int | float) -> tuple[StabilityGuard, torch.Tensor, dict[str, Recorder]]:
    param = torch.full((4,), value)  # norm = 2 * value
    guard = StabilityGuard([param], **kwargs)  # type: ignore[arg-type]
    switches = {m: Recorder() for m in BACKOFF_ORDER}
    for method, switch in switches.items():
        guard.add(method, switch)
    return guard, param, switches


def test_steady_training_backs_nothing_off() -> None:
    guard, param, switches = guard_over()
    rng = random.Random(0)
    for step in range(1, 2000):
        param.mul_(1 + rng.uniform(-0.01, 0.011))  # a norm that wanders and slowly grows, as training's does
        guard(step)
    assert guard.stats.backoffs == 0 and guard.backed_off == ()
    assert all(s.on for s in switches.values())


def test_a_growing_norm_backs_the_methods_off_in_order_one_window_apart() -> None:
    guard, param, switches = guard_over(window=8, warmup=0)
    for step in range(1, 200):
        param.mul_(1.1)  # exponential: 2.1x in 8 safe points
        guard(step)
        if len(guard.backed_off) == len(BACKOFF_ORDER):
            break
    assert guard.backed_off == BACKOFF_ORDER
    assert [s.calls for s in switches.values()] == [["suspend"]] * len(BACKOFF_ORDER)
    assert guard.stats.backoffs == len(BACKOFF_ORDER) and guard.stats.backed_off == len(BACKOFF_ORDER)


def test_with_every_method_off_a_sign_is_counted_and_said_once(caplog: pytest.LogCaptureFixture) -> None:
    param = torch.ones(4)
    guard = StabilityGuard([param], window=4, warmup=0)  # nothing registered: plain averaging
    with caplog.at_level(logging.WARNING, logger="gossiptrain.protocol.stability"):
        for step in range(1, 100):
            param.mul_(1.5)
            guard(step)
    assert guard.stats.signs > 1 and guard.stats.backoffs == 0
    assert sum("every added method already off" in r.message for r in caplog.records) == 1


def test_a_non_finite_model_is_restored_to_the_last_state_kept_and_every_method_is_off() -> None:
    guard, param, switches = guard_over(keep_every=5, window=4, warmup=0)
    restored = []
    guard.on_restore(lambda: restored.append(True))
    for step in range(1, 21):
        param.add_(0.001)
        guard(step)
    kept = param.clone()  # kept at step 20 (every 5 safe points, quiet for a window)
    param.add_(0.5)
    assert guard(21) is False  # not kept: not a multiple of 5; nothing put back
    param[1] = math.nan
    assert guard(22) is True  # put back: the caller's averaging forgets what it computed from the NaN model
    assert torch.equal(param, kept)
    assert restored == [True]
    assert guard.stats.restores == 1 and guard.backed_off == BACKOFF_ORDER
    assert not any(s.on for s in switches.values())
    assert guard.settling  # averaging keeps out for a grace of safe points...
    for step in range(23, 23 + guard.grace):
        guard(step)
    assert not guard.settling  # ...and no longer


def test_methods_are_tried_again_after_the_run_settled_last_first_and_a_relapse_doubles_the_wait() -> None:
    guard, param, switches = guard_over(window=4, warmup=0, settle=50)
    step = 0

    def run(n: int, factor: float) -> None:
        nonlocal step
        for _ in range(n):
            step += 1
            param.mul_(factor)
            guard(step)

    run(3, 1.5)  # one sign: the outer step goes
    assert guard.backed_off == (OUTER_STEP,)
    run(49, 1.0)
    assert guard.backed_off == (OUTER_STEP,)
    run(1, 1.0)  # 50 quiet safe points
    assert guard.backed_off == () and switches[OUTER_STEP].calls == ["suspend", "resume"]
    run(3, 1.5)  # it trips the guard again: off, and the next try waits twice as long
    assert guard.backed_off == (OUTER_STEP,)
    run(95, 1.0)
    assert guard.backed_off == (OUTER_STEP,)
    run(5, 1.0)
    assert guard.backed_off == () and guard.stats.retries == 2


def test_a_method_added_while_its_kind_is_off_starts_suspended() -> None:
    param = torch.ones(4)
    guard = StabilityGuard([param], window=4, warmup=0)
    guard.add(QUASI_GLOBAL_MOMENTUM, Recorder())
    for step in range(1, 8):
        param.mul_(1.5)
        guard(step)
    assert guard.backed_off == (QUASI_GLOBAL_MOMENTUM,)
    late = Recorder()  # a second optimizer found later
    guard.add(QUASI_GLOBAL_MOMENTUM, late)
    assert not late.on


@settings(max_examples=60, deadline=None)
@given(st.lists(st.floats(min_value=0.5, max_value=3.0), min_size=1, max_size=200))
def test_whatever_the_norms_the_counts_agree_and_the_order_holds(factors: list[float]) -> None:
    guard, param, switches = guard_over(window=4, warmup=2, settle=20, keep_every=3)
    for step, f in enumerate(factors, 1):
        param.mul_(f)
        guard(step)
        off = guard.backed_off
        assert off == BACKOFF_ORDER[: len(off)]  # always a prefix of the order: retries give back the last first
        assert guard.stats.backed_off == len(off)
        assert guard.stats.backoffs - guard.stats.retries == len(off)
        assert all(s.on == (m not in off) for m, s in switches.items())
        assert torch.isfinite(param).all()


def test_a_forgotten_optimizer_state_starts_afresh_at_the_next_step() -> None:
    a, b = torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.Adam([a, b], lr=0.1)
    (a.sum() + b.sum()).backward()
    opt.step()
    opt.state[a]["exp_avg"][0] = math.inf
    assert forget_state(opt) == 2
    assert not opt.state
    opt.step()
    assert torch.isfinite(a).all() and int(opt.state[a]["step"]) == 1


# -- the methods' switches ----------------------------------------------------------------------


def sgd_model() -> tuple[torch.nn.Linear, torch.optim.SGD]:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    return model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def sgd_step(model: torch.nn.Linear, opt: torch.optim.SGD) -> None:
    opt.zero_grad()
    model(torch.randn(8, 4)).square().sum().backward()
    opt.step()


def test_suspended_quasi_global_momentum_restarts_the_optimizers_buffer_and_leaves_it_alone() -> None:
    model, opt = sgd_model()
    qgm = QuasiGlobalMomentum(opt)
    for _ in range(WARMUP_SAFE_POINTS + 5):
        sgd_step(model, opt)
        qgm()
    qgm.suspend()
    assert all("momentum_buffer" not in opt.state[p] for p in model.parameters())
    sgd_step(model, opt)
    own = {p: opt.state[p]["momentum_buffer"].clone() for p in model.parameters()}
    qgm()
    assert all(torch.equal(opt.state[p]["momentum_buffer"], own[p]) for p in model.parameters())
    qgm.resume()
    assert qgm.safe_points == 0  # a warm start again


def test_suspended_drift_correction_adds_nothing_and_owes_nothing() -> None:
    param = torch.zeros(3)
    drift = DriftCorrection([param], gain=4.0, reported=True)
    drift.after(moved=([torch.ones(3)], 1.0))
    assert param.abs().sum() > 0 and any(o.abs().sum() > 0 for o in drift.owed())
    drift.suspend()
    assert all(o.abs().sum() == 0 for o in drift.owed())
    before = param.clone()
    drift.after(moved=([torch.ones(3)], 1.0))
    assert torch.equal(param, before)
    drift.resume()
    drift.after(moved=([torch.ones(3)], 1.0))
    assert not torch.equal(param, before)


def test_suspended_rate_scaling_steps_at_the_users_rate() -> None:
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    scaling = SwarmLrScaling(opt, lambda: 4)
    scaling.suspend()
    model(torch.ones(1, 2)).sum().backward()
    opt.step()
    assert scaling.last_factor == 1.0
    scaling.resume()
    opt.step()
    assert scaling.last_factor == 2.0
    scaling.close()


def test_local_sgds_outer_step_can_be_suspended_and_resumed() -> None:
    param = torch.nn.Parameter(torch.zeros(3))
    config = GossipConfig(algorithm="local-sgd", outer_lr=1.0, outer_momentum=0.5)
    machine = LocalSGD({"w": param}, config, random.Random(0))
    assert machine.has_outer_step and machine.outer
    machine.suspend()
    assert not machine.outer
    with torch.no_grad():
        param.add_(1.0)
    machine.resume()
    assert machine.outer and torch.equal(machine._anchor[0], param.detach())


def test_a_sign_puts_the_model_back_to_the_last_calm_state_and_restarts_the_optimizer() -> None:
    guard, param, _ = guard_over(window=4, warmup=0, keep_every=5)
    restarts = []
    guard.on_restore(lambda: restarts.append(True))
    for step in range(1, 11):
        param.add_(0.001)  # calm
        guard(step)
    kept = param.clone()  # step 10
    for step in range(11, 30):
        param.mul_(1.3)
        put_back = guard(step)
        if guard.backed_off:
            assert put_back is True
            break
        assert put_back is False
    assert guard.backed_off == (OUTER_STEP,) and torch.equal(param, kept) and restarts == [True]


# -- a run made to diverge, in the simulator ------------------------------------------------------------


class SquaredLoss(LogRegWorkload):
    """logreg's data with a squared loss: a quadratic, so a rate past 2 / curvature diverges, as theory says.

    At SGD lr 0.5 (no momentum) one peer trains; at sqrt(4) = 2 times that
    (the square-root rule asked for with SGD, ``gossip.lr_scaling = "sqrt"``)
    every peer went non-finite within 100 steps.
    """

    name = "logreg-squared"

    def loss(self, model: torch.nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(model(inputs), 3.0 * F.one_hot(targets, self.classes).float())


def squared_loss() -> SquaredLoss:
    return SquaredLoss()


def diverging_swarm(guard: bool) -> tuple[list[dict[str, float]], Cluster]:
    run = RunConfig().with_overrides({
        "train.workload": "tests.test_stability:squared_loss", "train.shards": 4, "train.max_steps": 0,
        "train.lr": 0.5, "train.momentum": 0.0, "gossip.lr_scaling": "sqrt", "gossip.guard": guard,
    })
    cluster = Cluster(SimConfig(peers=4, run=run, duration=1.0, step_time=0.002, seed=0, sample_every=0.5, join_spread=0.0))
    rows = run_virtual(cluster.run()).rows
    return [r for r in rows if r["time"] == max(r["time"] for r in rows)], cluster


def test_the_guard_turns_a_swarm_that_diverges_into_one_that_trains_and_sends_nothing_non_finite() -> None:
    """Measured (seed 0, 1 virtual s): unguarded every peer non-finite, accuracy 0.5 (chance); guarded 0.79-0.83,
    as one at the rate unscaled (0.79-0.81), the rate scaling backed off on every peer."""
    unguarded, lost = diverging_swarm(False)
    assert any(not all(bool(torch.isfinite(p).all()) for p in peer.model.parameters()) for peer in lost.peers.values())
    guarded, cluster = diverging_swarm(True)
    assert len(guarded) == 4
    for peer in cluster.peers.values():
        assert all(bool(torch.isfinite(p).all()) for p in peer.model.parameters())
        assert peer.safepoint.guard is not None and LR_SCALING in peer.safepoint.guard.backed_off
        assert peer.averaging.stats.rejected == 0  # nobody received a non-finite model (receivers refuse them)
    assert all(r["guard_restores"] > 0 for r in guarded)
    assert statistics.mean(r["test_acc"] for r in guarded) > 0.7 > statistics.mean(r["test_acc"] for r in unguarded)


def test_a_collapsed_model_steady_far_above_the_state_kept_is_not_kept() -> None:
    guard, param, _ = guard_over(window=4, warmup=0, keep_every=5, settle=1000, growth=1e6)  # no sign: keeping alone
    for step in range(1, 11):
        guard(step)
    kept = param.clone()
    param.mul_(1000.0)  # a collapse: huge, then steady
    for step in range(11, 200):
        guard(step)
    param[0] = math.nan
    guard(200)
    assert torch.equal(param, kept)  # back to the sane state, not the collapsed one
