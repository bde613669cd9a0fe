"""Helpers for tests that run real peer processes on loopback.

Every peer gets its own 127.0.0.x address and port 0; every process started
here is killed at teardown; conditions are polled with a deadline, never
waited for with a fixed sleep.
"""

from __future__ import annotations

import itertools
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Iterator, TypeVar

from gossiptrain.train.metrics import read_metrics

from . import zygote

T = TypeVar("T")
ROOT = Path(__file__).resolve().parent.parent
_hosts = itertools.count(10)


def next_host() -> str:
    """A fresh loopback address per peer (127.0.0.10, .11, ...), to catch addressing bugs."""
    n = next(_hosts)
    return f"127.0.{n // 250}.{n % 250 + 2}"


def wait_for(
    condition: Callable[[], T], timeout: float, what: str, interval: float = 0.1, state: Callable[[], str] | None = None
) -> T:
    """Poll ``condition`` until it returns something truthy; fail naming ``what`` (and ``state()``) after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            detail = f"\n{state()}" if state else ""
            raise AssertionError(f"timed out after {timeout} s waiting for {what}{detail}")
        time.sleep(interval)


def describe(procs: "list[Proc]") -> str:
    """Each process's latest metrics record and the end of its output, for failure messages."""
    parts = []
    for p in procs:
        status = "running" if p.alive() else f"exited {p.popen.returncode}"
        parts.append(f"--- {p.name} ({status}) latest: {p.latest()}\n{p.output()[-1500:]}")
    return "\n".join(parts)


class Proc:
    """A gossiptrain CLI process (``python -m module args``; ``python module args`` for a path ending in .py) with
    its output captured to a file."""

    def __init__(self, args: list[str], workdir: Path, name: str, module: str = "gossiptrain") -> None:
        self.name = name
        self.log = workdir / f"{name}.log"
        self.metrics = workdir / f"{name}.jsonl"
        self._fh = open(self.log, "wb")
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(ROOT)}
        self.popen: subprocess.Popen[bytes] | zygote.ForkedProcess
        if zygote.enabled():  # forked from a process that has imported torch already (tests/zygote.py)
            self.popen = zygote.ForkedProcess(module, args, self.log, env, ROOT)
        else:
            command = [module] if module.endswith(".py") else ["-m", module]
            self.popen = subprocess.Popen(
                [sys.executable, *command, *args], stdout=self._fh, stderr=subprocess.STDOUT, env=env, cwd=ROOT
            )

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def records(self, event: str | None = None) -> list[dict[str, Any]]:
        return [r for r in read_metrics(self.metrics) if event is None or r.get("event") == event]

    def latest(self) -> dict[str, Any] | None:
        recs = [r for r in self.records() if r.get("event") in ("eval", "done")]
        return recs[-1] if recs else None

    def alive(self) -> bool:
        return self.popen.poll() is None

    def signal(self, sig: int) -> None:
        if self.alive():
            self.popen.send_signal(sig)

    def wait(self, timeout: float) -> int:
        try:
            return self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"{self.name} did not exit within {timeout} s; output:\n{self.output()[-3000:]}")

    def kill(self) -> None:
        if self.alive():
            self.popen.kill()
            self.popen.wait()
        self._fh.close()


class Procs:
    """Owns the processes of one test; ``close`` kills whatever is left."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.all: list[Proc] = []

    def peer(
        self, join: str, *extra: str, name: str | None = None, host: str | None = None, module: str = "gossiptrain"
    ) -> Proc:
        """A `gossiptrain peer` (or the same CLI from ``module``, e.g. a rogue peer's wrapper)."""
        name = name or f"peer{len(self.all)}"
        args = ["peer", "--join", join, "--bind", f"{host or next_host()}:0", "--quiet"]
        proc = Proc([*args, "--metrics", str(self.workdir / f"{name}.jsonl"), *extra], self.workdir, name, module)
        self.all.append(proc)
        return proc

    def start(self, *args: str, name: str, module: str = "gossiptrain") -> Proc:
        proc = Proc(list(args), self.workdir, name, module)
        self.all.append(proc)
        return proc

    def wait_for(self, condition: Callable[[], T], timeout: float, what: str) -> T:
        """``wait_for`` that shows every process's state if it times out."""
        return wait_for(condition, timeout, what, state=lambda: describe(self.all))

    def close(self) -> None:
        for p in self.all:
            p.signal(signal.SIGKILL)
        for p in self.all:
            p.kill()

    def __iter__(self) -> Iterator[Proc]:
        return iter(self.all)


def run_in_session(
    cmd: list[str], timeout: float, what: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """``cmd`` in its own session (whatever it starts dies with it): killed as a group on an overrun (the test
    fails with the output's tail) and if the test itself is killed (pytest-timeout). ``env``: instead of ours."""
    import pytest

    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT, start_new_session=True,
        env={**(os.environ if env is None else env), "PYTHONPATH": str(ROOT)},
    )
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        pytest.fail(f"{what} ran over {timeout} s:\n{stdout[-3000:]}{stderr[-3000:]}")
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)


_forked_runs = itertools.count()


def run_forked(
    args: list[str], timeout: float, what: str, workdir: Path, module: str = "gossiptrain"
) -> subprocess.CompletedProcess[str]:
    """``python -m MODULE ARGS`` (``python MODULE ARGS`` for a path ending in .py) as ``run_in_session`` runs it
    (its exit status, stdout and stderr apart, failing
    the test on an overrun), forked from the test fork server that imported torch already (tests/zygote.py):
    for a CLI process whose own behaviour is under test, not its interpreter's start. Its output goes to files in
    ``workdir``. With GOSSIPTRAIN_TEST_EXEC=1, ``run_in_session`` itself."""
    import pytest

    if not zygote.enabled():
        command = [module] if module.endswith(".py") else ["-m", module]
        return run_in_session([sys.executable, *command, *args], timeout, what)
    n = next(_forked_runs)
    out, err = workdir / f"run{n}.out", workdir / f"run{n}.err"
    out.touch()
    err.touch()
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = zygote.ForkedProcess(module, args, out, env, ROOT, err_log=err)
    try:
        code = proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(30)
        pytest.fail(f"{what} ran over {timeout} s:\n{out.read_text()[-3000:]}{err.read_text()[-3000:]}")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
    return subprocess.CompletedProcess([module, *args], code, out.read_text(), err.read_text())


def run_quick_experiment(name: str, out: Path, timeout: float, *flags: str) -> tuple[dict[str, Any], str]:
    """Run experiments/NAME.py --quick --out OUT (and ``flags``); its last line as JSON, and its output.

    The script runs in its own session, so an overrun kills its peers and
    coordinator too; a non-zero exit or an overrun fails the test with the
    output's tail.
    """
    import json

    cmd = [sys.executable, str(ROOT / "experiments" / f"{name}.py"), *flags, "--quick", "--out", str(out)]
    done = run_in_session(cmd, timeout, " ".join([f"{name}.py", *flags, "--quick"]))
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1]), output


def skewed_sim_final(duration: float, bandwidth: float, sample_every: float, **overrides: object) -> list[dict[str, Any]]:
    """The last sample's rows of a simulated swarm on label-skewed shards (4 peers, digits-small, 3 classes each,
    2 ms steps, links of ``bandwidth`` bytes/s): where flow control, compression and momentum show."""
    from gossiptrain.config import RunConfig
    from gossiptrain.net.transport.sim import LinkProfile
    from gossiptrain.sim.cluster import SimConfig, simulate

    run = RunConfig().with_overrides({
        "train.workload": "digits-small", "train.shards": 4, "train.partition": "classes-per-peer",
        "train.partition_classes": 3, "train.max_steps": 0, "train.max_seconds": 0,
        "train.eval_every_seconds": sample_every, **overrides,
    })
    result = simulate(SimConfig(peers=4, run=run, duration=duration, seed=0, step_time=0.002, sample_every=sample_every,
                                link=LinkProfile(latency=0.0005, bandwidth=bandwidth)))
    last = max(r["time"] for r in result.rows)
    return [r for r in result.rows if r["time"] == last]
