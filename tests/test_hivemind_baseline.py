"""The optional hivemind baseline (experiments/baselines/hivemind_opt.py).

The smoke test needs hivemind (the `hivemind` extra): it is marked slow, so
`make test` does not count a skip as coverage, and skips (naming the extra)
under `make test-slow` without it; the skip path itself is checked everywhere.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from experiments.baselines import hivemind_opt


def _processes_mentioning(text: str) -> list[int]:
    """Live processes whose command line contains ``text`` (this test's own folder: only its workers)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if text.encode() in (entry / "cmdline").read_bytes():
                    pids.append(int(entry.name))
            except OSError:
                continue
    return pids


def test_unavailable_says_why_and_how(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "hivemind", None)  # import hivemind now raises ImportError
    reason = hivemind_opt.unavailable()
    assert reason is not None and "pip install -e '.[hivemind]'" in reason


@pytest.mark.slow  # needs the optional hivemind extra: out of `make test`, where it could only ever skip
@pytest.mark.timeout(240)
def test_two_workers_train_and_are_cleaned_up(tmp_path: Path) -> None:
    """Two hivemind workers train and leave no process or p2pd socket behind.

    Not part of `make test` (marked slow): without hivemind it can only skip, and a skip is no coverage. To
    run it: `pip install -e '.[hivemind]'`, then `make test-slow` or
    `python -m pytest -m slow tests/test_hivemind_baseline.py`. Without hivemind it still skips, saying so.
    """
    pytest.importorskip("hivemind", reason="the hivemind baseline needs the optional extra: pip install -e '.[hivemind]'")
    assert hivemind_opt.unavailable() is None
    sockets_before = set(Path("/tmp").glob("hivemind-p2pd-*.sock"))
    # An unreachable target: the run trains for `timeout` seconds after the rendezvous, then stops.
    run = hivemind_opt.run_hivemind(2, seed=0, slowdown=1.0, target=1.01, timeout=3.0, workdir=tmp_path)
    assert run.system == "hivemind" and run.time_to_target is None
    assert len(run.points) >= 2, run.points
    assert all(0.0 <= p.acc <= 1.0 for p in run.points)
    assert run.points[-1].samples > run.points[0].samples > 0
    assert run.points[-1].acc > 0.3  # better than chance (0.1) after a few seconds of training
    assert all(steps > 0 for steps in run.extra["steps"])
    assert _processes_mentioning(str(tmp_path)) == []  # workers and their hivemind processes are gone
    assert set(Path("/tmp").glob("hivemind-p2pd-*.sock")) <= sockets_before  # the p2pd daemons' sockets are removed
