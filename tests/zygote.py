"""Start CLI processes by forking a process that has already imported torch and gossiptrain.

A fresh `python -m gossiptrain peer` spends about 4 s of CPU importing torch
and the runtime before it does anything; the default test run starts some
sixty of them on a 2-core machine, so about a third of its CPU went to
imports. Here each test worker keeps one multiprocessing fork server that
imported those modules once, and every CLI process is a fork of it that runs
``python -m MODULE ARGS`` in itself (``runpy``, as the interpreter does):
still a separate OS process with its own sockets, signals and exit status,
its output in a file, its environment and working directory as given.

What this skips is only the interpreter's start and the imports, which the
tests that run the real command line (`gossiptrain demo`, `config`,
`simulate`, the experiments' scripts) still exercise. Set
``GOSSIPTRAIN_TEST_EXEC=1`` to start every process with exec instead.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import subprocess
from pathlib import Path
from typing import Mapping

#: What a peer or coordinator imports before it can start: loaded once, in the fork server.
PRELOAD = [
    "torch",
    # torch imports it lazily, at the first optimizer a process makes (torch.optim.Optimizer.__init__), with some
    # 800 modules more (sympy, torch.fx's symbolic shapes, ...): about 1 s of CPU in every peer forked without it.
    "torch._dynamo",
    "gossiptrain.cli.main",
    "gossiptrain.runtime.peer",
    "gossiptrain.runtime.coordinator_process",
    "gossiptrain.train.peer_loop",
    "gossiptrain.train.workload",
]

_context: multiprocessing.context.ForkServerContext | None = None


def enabled() -> bool:
    return os.environ.get("GOSSIPTRAIN_TEST_EXEC", "") in ("", "0")


def _forkserver() -> multiprocessing.context.ForkServerContext:
    global _context
    if _context is None:
        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload(PRELOAD)
        _context = ctx
    return _context


def _enter_netns(name: str) -> None:
    """Move this (forked, single-threaded) process into the network namespace ``ip netns`` calls ``name``."""
    import ctypes

    clone_newnet = 0x40000000
    fd = os.open(f"/run/netns/{name}", os.O_RDONLY)
    try:
        if ctypes.CDLL(None, use_errno=True).setns(fd, clone_newnet) != 0:
            raise OSError(ctypes.get_errno(), f"setns into network namespace {name}")
    finally:
        os.close(fd)


def _run_module(
    module: str, args: list[str], log: str, env: dict[str, str], cwd: str, netns: str | None = None, err_log: str | None = None
) -> None:
    """In the forked child: become ``python -m module args`` (``python module args`` where ``module`` is a path
    ending in .py) writing to ``log`` (its stderr to ``err_log``, if named; inside ``netns``, if named)."""
    import runpy
    import sys

    if netns is not None:  # as `ip netns exec NAME`, without an interpreter's start and torch's import
        _enter_netns(netns)

    fd = os.open(log, os.O_WRONLY | os.O_APPEND)
    os.dup2(fd, 1)
    os.close(fd)
    fd = os.open(err_log or log, os.O_WRONLY | os.O_APPEND)
    os.dup2(fd, 2)
    os.close(fd)
    for stream in (sys.stdout, sys.stderr):
        stream.reconfigure(write_through=True)  # as PYTHONUNBUFFERED: a killed process's output is in the file
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    sys.argv = [module, *args]
    try:
        if module.endswith(".py"):  # a script: its folder first on sys.path, as the interpreter puts it
            sys.path.insert(0, os.path.dirname(os.path.abspath(module)))
            runpy.run_path(module, run_name="__main__")
        else:
            runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit as e:  # sys.exit(n) in the module: n is the exit status, as for a real interpreter
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


class ForkedProcess:
    """The part of ``subprocess.Popen`` the tests use, for a process forked from the fork server."""

    def __init__(
        self, module: str, args: list[str], log: Path, env: Mapping[str, str], cwd: Path, netns: str | None = None,
        err_log: Path | None = None,
    ) -> None:
        self.args = [module, *args]
        self.stdout = None  # as a Popen whose output went to a file
        self._process = _forkserver().Process(
            target=_run_module, args=(module, list(args), str(log), dict(env), str(cwd), netns,
                                      None if err_log is None else str(err_log)), daemon=False,
        )
        self._process.start()
        self.pid: int = self._process.pid  # type: ignore[assignment]

    @property
    def returncode(self) -> int | None:
        return self._process.exitcode  # -N for a signal, as Popen's

    def poll(self) -> int | None:
        return self._process.exitcode

    def wait(self, timeout: float | None = None) -> int:
        self._process.join(timeout)
        if self._process.exitcode is None:
            raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
        return self._process.exitcode

    def send_signal(self, sig: int) -> None:
        if self._process.exitcode is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)
