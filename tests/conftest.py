from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Iterator

import pytest
import torch

from gossiptrain.config import RunConfig
from gossiptrain.runtime.coordinator_process import BackgroundCoordinator

from .swarm import Procs, next_host

# One torch thread per test process (each xdist worker; peer processes already default to --threads 1).
# With two workers on two cores, torch's default of one intra-op thread per core oversubscribes the machine,
# and its threads spin-wait on the tiny tensors of these tests: an in-process simulation that calls Cluster
# directly (simulate() already sets one thread) or a Lockstep run took 5-15x the CPU time of one thread.
# No test depends on the count; the few that need one thread for bit-identical results still set it themselves.
torch.set_num_threads(1)

# The modules whose tests take longest (whole experiments, chaos, simulated training, real swarms), longest first.
# With two workers the run ends when its last long test does, so those start first; the rest keep their order.
LONGEST_FIRST = (
    "test_chaos.py", "test_algorithms_sim.py", "test_swarm.py", "test_experiments_sweeps_smoke.py",
    "test_sim.py", "test_security.py", "test_cli.py", "test_checkpoint.py", "test_robust.py",
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # a stable sort


_TMP = Path(tempfile.gettempdir())
_BEFORE: set[Path] = set()


def pytest_sessionstart(session: pytest.Session) -> None:
    _BEFORE.update(_TMP.glob("gossiptrain*"))


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """The test run leaves no gossiptrain files in the temporary directory (demos, --quick runs, checkpoints).

    Checked once, where the whole run ends (with pytest-xdist: in the controller, after every worker)."""
    if hasattr(session.config, "workerinput"):  # an xdist worker: the others may still be running
        return
    left = sorted(str(p) for p in set(_TMP.glob("gossiptrain*")) - _BEFORE)
    if left:
        writer = session.config.get_terminal_writer()
        writer.line()
        writer.line(f"the tests left these behind in {_TMP}: {left}", red=True)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


@pytest.fixture
def procs(tmp_path: Path) -> Iterator[Procs]:
    """Processes started by a test; all of them are killed at teardown."""
    p = Procs(tmp_path)
    try:
        yield p
    finally:
        p.close()


def fast_config(**overrides: object) -> RunConfig:
    """Digits with a short protocol period, so that failure detection takes seconds in tests.

    The model is ``digits-small``: the same data, learned in as many steps, at
    a tenth of the compute (tests check the runtime, not the model's size; a
    test that needs a large state sets ``train.workload`` to ``digits``).

    The protocol period is not shorter: on a loaded 2-core machine a peer may
    answer a probe a second late, and a suspicion timeout near that would make
    members flap.
    """
    base = {
        "membership.heartbeat_interval": 0.25,
        "membership.suspicion_mult": 8.0,
        "membership.report_interval": 0.5,
        "train.eval_every_seconds": 0.3,
        "train.workload": "digits-small",
    }
    return RunConfig().with_overrides({**base, **overrides})


@pytest.fixture
def coordinator_factory() -> Iterator[object]:
    """Start in-process coordinators on their own loopback address (or at ``bind``); closed at teardown."""
    started: list[BackgroundCoordinator] = []

    def start(config: RunConfig, bind: str | None = None) -> BackgroundCoordinator:
        c = BackgroundCoordinator(config, bind=bind or f"{next_host()}:0")
        started.append(c)
        return c

    try:
        yield start
    finally:
        for c in started:
            c.close()
