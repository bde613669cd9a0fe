from __future__ import annotations

from pathlib import Path
from typing import Iterator

import pytest

from gossiptrain.config import RunConfig
from gossiptrain.runtime.coordinator_process import BackgroundCoordinator

from .swarm import Procs, next_host


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

    Not shorter: on a loaded 2-core machine a peer may answer a probe a second
    late, and a suspicion timeout near that would make members flap.
    """
    base = {
        "membership.heartbeat_interval": 0.25,
        "membership.suspicion_mult": 8.0,
        "membership.report_interval": 0.5,
        "train.eval_every_seconds": 0.3,
    }
    return RunConfig().with_overrides({**base, **overrides})


@pytest.fixture
def coordinator_factory() -> Iterator[object]:
    """Start in-process coordinators on their own loopback address; closed at teardown."""
    started: list[BackgroundCoordinator] = []

    def start(config: RunConfig) -> BackgroundCoordinator:
        c = BackgroundCoordinator(config, bind=f"{next_host()}:0")
        started.append(c)
        return c

    try:
        yield start
    finally:
        for c in started:
            c.close()
