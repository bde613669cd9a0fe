"""The simulator's synchronous baselines (gossiptrain.sim.synchronous): DDP and a parameter server.

The simulated DDP must be DDP: the same parameters as a real gloo run given
the same batches, and every step as slow as the slowest worker plus the
closed-form all-reduce. The servers must take DDP's update (sync) and SGD's
(async, one worker), and crashes must cost a synchronous job its restart.
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gossiptrain.config import RunConfig
from gossiptrain.errors import ConfigError
from gossiptrain.net.transport.sim import LinkProfile
from gossiptrain.sim import ChurnEvent, SimConfig, simulate
from gossiptrain.sim.collectives import SharedLink, allreduce_seconds, ring_allreduce_seconds
from gossiptrain.sim.compute import shared_finish_times, step_factor
from gossiptrain.sim.synchronous import SynchronousJob

from .swarm import run_forked

FREE = LinkProfile(latency=0.0, bandwidth=math.inf)


def config(system: str, peers: int = 2, *, steps: int = 0, **kw: object) -> SimConfig:
    run = RunConfig().with_overrides({
        "train.workload": "logreg", "train.shards": peers, "train.seed": 3, "train.max_steps": steps,
    })
    fields = {"peers": peers, "run": run, "duration": 30.0, "step_time": 0.01, "system": system, "link": FREE,
              "join_spread": 0.0, **kw}
    return SimConfig(**fields)  # type: ignore[arg-type]


def params_of(job: SynchronousJob) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in job.model.state_dict().items()}


# -- the cost models ---------------------------------------------------------------------


def test_ring_allreduce_matches_the_closed_form() -> None:
    link = LinkProfile(latency=0.001, bandwidth=1e8)
    assert ring_allreduce_seconds(4, 1e6, link) == pytest.approx(2 * 3 / 4 * 1e6 / 1e8 + 2 * 3 * 0.001)
    assert ring_allreduce_seconds(1, 1e6, link) == 0.0  # nothing to reduce with
    slow = LinkProfile(latency=0.03, bandwidth=1.25e7)
    # The ring runs at its slowest link: the bandwidth of one, the latency of another.
    mixed = ring_allreduce_seconds(8, 4e6, [link, slow, LinkProfile(latency=0.0001, bandwidth=1e9)])
    assert mixed == pytest.approx(2 * 7 / 8 * 4e6 / 1.25e7 + 2 * 7 * 0.03)
    # Halving-doubling: the same bytes in 2 log2(n) phases; "best" is the faster of the two.
    assert allreduce_seconds("halving-doubling", 1024, 264, link) == pytest.approx(2 * 1023 / 1024 * 264 / 1e8 + 20 * 0.001)
    assert allreduce_seconds("best", 1024, 264, link) == allreduce_seconds("halving-doubling", 1024, 264, link)
    assert allreduce_seconds("best", 3, 1e9, link) == ring_allreduce_seconds(3, 1e9, link)  # 4 phases either way
    with pytest.raises(ValueError, match="tree"):
        allreduce_seconds("tree", 4, 1.0, link)


@settings(max_examples=50, deadline=None)
@given(st.lists(st.tuples(st.floats(0, 10), st.floats(1, 1e6)), min_size=1, max_size=20))
def test_a_shared_link_sends_one_transfer_at_a_time(transfers: list[tuple[float, float]]) -> None:
    link = SharedLink(LinkProfile(latency=0.002, bandwidth=1e6))
    busy_until = 0.0
    for ready, nbytes in sorted(transfers):
        arrived = link.send(ready, nbytes)
        start = max(ready, busy_until)
        assert arrived == pytest.approx(start + nbytes / 1e6 + 0.002)
        busy_until = start + nbytes / 1e6


def test_step_noise_has_mean_one() -> None:
    rng = random.Random(0)
    for jitter, sigma in [(0.5, 0.0), (0.0, 0.5)]:
        draws = [step_factor(rng, jitter, sigma) for _ in range(40_000)]
        assert min(draws) > 0
        assert sum(draws) / len(draws) == pytest.approx(1.0, abs=0.02)
    assert step_factor(rng) == 1.0


# -- DDP ---------------------------------------------------------------------------------


def test_a_straggler_makes_every_synchronous_step_as_slow_as_itself() -> None:
    link = LinkProfile(latency=0.001, bandwidth=1e7)
    for system in ("ddp", "ps-sync"):
        job = SynchronousJob(config(system, 4, steps=10, speeds=(1.0, 1.0, 1.0, 4.0), link=link))
        job.run()
        if system == "ddp":
            expected = 0.04 + ring_allreduce_seconds(4, job.nbytes, link)
        else:  # parameters out to 4 workers one after another (the straggler last), its gradient back last
            expected = 4 * job.nbytes / 1e7 + 0.001 + 0.04 + job.nbytes / 1e7 + 0.001
        assert len(job.step_seconds) == 10
        assert job.step_seconds == pytest.approx([expected] * 10), system


def test_shared_cores_are_shared_among_whoever_computes() -> None:
    # 4 jobs of 1 s on 2 cores: each at half speed, all done at 2 s.
    assert shared_finish_times([0, 0, 0, 0], [1, 1, 1, 1], 2) == pytest.approx([2, 2, 2, 2])
    # One job starts late, when the others are done: alone, at full speed (one core).
    assert shared_finish_times([0, 0, 0, 3], [1, 1, 1, 1], 2) == pytest.approx([1.5, 1.5, 1.5, 4])
    # Arriving midway: 3 jobs share at 2/3 of a core each from 0.5 s on, then the last runs alone.
    assert shared_finish_times([0, 0, 0.5], [1, 1, 1], 2) == pytest.approx([1.25, 1.25, 1.75])
    assert shared_finish_times([0, 1], [1, 1], 0) == [1, 2]  # a core each


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.floats(0, 5), st.floats(0, 2)), min_size=1, max_size=12), st.floats(0.5, 8))
def test_shared_cores_conserve_work(jobs: list[tuple[float, float]], cores: float) -> None:
    starts, works = [s for s, _ in jobs], [w for _, w in jobs]
    finish = shared_finish_times(starts, works, cores)
    for s, w, f in zip(starts, works, finish):
        assert f >= s + w - 1e-9  # never faster than a core of its own
    # The cores do at most `cores` seconds of work per second, and while any job is left they do at least
    # min(1, cores): the last job ends no sooner than all the work over the cores, and no later than the
    # last start plus all the work at that slowest rate.
    assert max(finish) - min(starts) >= sum(works) / cores - 1e-9
    assert max(finish) <= max(starts) + sum(works) / min(1.0, cores) + 1e-9


def test_on_shared_cores_a_ddp_straggler_idles_and_frees_the_cores() -> None:
    # 8 workers on 2 cores, no straggler: 8 steps of work over 2 cores, 4 step times a step.
    alike = SynchronousJob(config("ddp", 8, steps=5, cores=2.0))
    alike.run()
    assert alike.step_seconds == pytest.approx([0.04] * 5)
    # A 4x straggler idles 3x its last compute, then computes while the others wait: slower, not 4x.
    job = SynchronousJob(config("ddp", 8, steps=6, cores=2.0, speeds=(4.0,) + (1.0,) * 7))
    job.run()
    assert job.step_seconds[0] == pytest.approx(0.04)  # nothing to idle for yet
    assert all(0.04 < t < 4 * 0.04 for t in job.step_seconds[1:])


def test_the_server_takes_ddps_update_and_one_async_worker_takes_sgds() -> None:
    ddp, sync = SynchronousJob(config("ddp", 3, steps=15)), SynchronousJob(config("ps-sync", 3, steps=15))
    ddp.run()
    sync.run()
    for k, v in params_of(ddp).items():
        assert torch.equal(v, params_of(sync)[k]), k
    one_ddp, one_async = SynchronousJob(config("ddp", 1, steps=15)), SynchronousJob(config("ps-async", 1, steps=15))
    one_ddp.run()
    one_async.run()
    for k, v in params_of(one_ddp).items():
        assert torch.equal(v, params_of(one_async)[k]), k
    assert one_async.state.steps == 15


def test_async_gradients_are_stale_and_the_server_applies_every_one() -> None:
    job = SynchronousJob(config("ps-async", 4, steps=20, link=LinkProfile(latency=0.001, bandwidth=1e6)))
    result = job.run()
    assert job._updates == 4 * 20  # every worker's gradients, each one update
    assert result.summary["mean_step"] == 20
    assert result.summary["samples"] == 4 * 20 * job.config.run.train.batch_size
    assert result.summary["staleness_mean"] > 1  # each gradient missed the others' updates in flight


def test_a_crash_costs_a_synchronous_job_its_restart() -> None:
    base = config("ddp", 4, duration=5.0, sample_every=0.5)
    clean = simulate(base).summary
    crashed = simulate(replace(base, churn_trace=(ChurnEvent(1.0, 2, "crash"), ChurnEvent(1.5, 2, "join")), restart_cost=2.0))
    assert crashed.summary["restarts"] == 1
    step = 1 / clean["steps_per_second"]
    # About 2 s of steps fewer: the step the crash cut short, then the restart (checkpoints after every step).
    assert clean["mean_step"] - crashed.summary["mean_step"] == pytest.approx(2.0 / step, abs=2)
    times = [r["time"] for r in crashed.rows]
    steps = [r["step"] for r in crashed.rows]
    assert steps[times.index(1.5)] == steps[times.index(2.5)]  # nothing moves while the job restarts


def test_a_rare_checkpoint_loses_the_steps_since() -> None:
    base = config("ddp", 2, duration=4.0, sample_every=0.5, restart_cost=0.5, checkpoint_every=1.0)
    job = SynchronousJob(replace(base, churn_trace=(ChurnEvent(1.9, 1, "crash"),)))
    job.run()
    assert job.restarts == 1 and job.lost_steps > 0


def test_an_async_straggler_holds_nobody_else_on_the_servers_link() -> None:
    """One worker 10x slower: the other three's gradients go on arriving at their own pace (about 3/4 of the
    updates of 4 equal workers), not queued behind the straggler's next one."""
    link = LinkProfile(latency=0.001, bandwidth=1e6)
    alike = SynchronousJob(config("ps-async", 4, duration=2.0, sample_every=0.5, link=link))
    alike.run()
    slowed = SynchronousJob(config("ps-async", 4, duration=2.0, sample_every=0.5, link=link, speeds=(10.0, 1.0, 1.0, 1.0)))
    slowed.run()
    assert slowed._updates >= 0.9 * (3 / 4 + 1 / 40) * alike._updates


def test_async_workers_crash_alone() -> None:
    base = config("ps-async", 3, duration=3.0, sample_every=0.5)
    job = SynchronousJob(replace(base, churn_trace=(ChurnEvent(0.5, 1, "crash"), ChurnEvent(2.0, 1, "join"))))
    job.run()
    assert job.crashes == 1 and job.restarts == 0
    assert job.rows[-1]["step"] > 0


def test_bad_systems_are_config_errors() -> None:
    with pytest.raises(ConfigError, match="sim.system"):
        config("allreduce")
    with pytest.raises(ConfigError, match="step_sigma"):
        config("ddp", step_jitter=0.2, step_sigma=0.5)
    with pytest.raises(ConfigError, match="membership_only"):
        config("ddp", membership_only=True)


def test_a_synchronous_run_stops_at_its_target_and_says_when() -> None:
    result = simulate(config("ddp", 4, duration=20.0, sample_every=0.1, target_accuracy=0.8, target_hold=2))
    t = result.summary["time_to_target"]
    assert t is not None and result.summary["virtual_seconds"] < 20.0
    accs = [r["test_acc"] for r in result.rows]
    assert accs[-1] >= 0.8 and accs[-2] >= 0.8


# -- against a real DistributedDataParallel run ----------------------------------------


@pytest.mark.timeout(180)
def test_simulated_ddp_equals_a_real_gloo_run(tmp_path: Path) -> None:
    """Two gloo ranks (experiments/baselines/ddp.py) and the simulated DDP, same batches: the same parameters."""
    from safetensors.torch import load_file

    from experiments import harness

    steps, overrides = 12, {"train.workload": "digits-small", "train.partition": "classes-per-peer", "train.partition_classes": 5}
    saved = tmp_path / "ddp.safetensors"
    # In a process of its own: the rendezvous store it hosts, and its sockets, stay out of this test process
    # (another test here counts this process's descriptors). Forked from the test fork server (tests/zygote.py);
    # its two ranks are interpreters of their own, as always.
    script = tmp_path / "ddp_run.py"
    script.write_text(
        "import json, sys; from pathlib import Path; from experiments import harness; "
        "harness.run_ddp(2, 0, 1.0, None, 150, Path(sys.argv[1]), max_steps=int(sys.argv[2]), save=Path(sys.argv[3]), "
        "eval_every=0, overrides=json.loads(sys.argv[4]))\n"
    )
    done = run_forked([str(tmp_path / "ddp"), str(steps), str(saved), json.dumps(overrides)], 170, "the DDP run", tmp_path,
                      module=str(script))
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    real = load_file(str(saved))
    run = harness.run_config(2, 0, max_steps=steps).with_overrides(overrides)
    job = SynchronousJob(SimConfig(peers=2, run=run, duration=60.0, step_time=0.01, system="ddp", join_spread=0.0))
    job.run()
    assert job.state.steps == steps
    simulated = params_of(job)
    assert set(real) == set(simulated)
    for k in real:
        torch.testing.assert_close(simulated[k], real[k], rtol=1e-5, atol=1e-6)
    moved = sum(float((simulated[k] - v).abs().sum()) for k, v in SynchronousJob(replace(job.config)).model.state_dict().items())
    assert moved > 0  # the runs trained: equal parameters are not two untouched models
