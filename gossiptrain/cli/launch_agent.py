"""`gossiptrain launch-agent`: the small wrapper each process of `gossiptrain launch` runs under, on its host.

Why a wrapper: ssh without a terminal neither forwards signals nor ends the
remote command when the local ssh dies, and a terminal (``ssh -tt``) would
mangle the output and lose stdin's end-of-file. The agent instead reads its
standard input, which is the launcher's pipe carried by ssh (or by any other
``--ssh`` prefix, such as ``ip netns exec``):

- the first line is the request (``gossiptrain.runtime.launch_plan.AgentRequest``):
  the command (from the launcher: gossiptrain's arguments, run by this
  agent's own interpreter), its directory, extra environment; it never
  passes through a shell, so no quoting survives or breaks on the way;
- ``signal INT`` / ``signal TERM`` lines send that signal to the command;
- end-of-file (the launcher closed it, exited, or was killed; the ssh
  connection dropped) sends SIGTERM, then SIGKILL after the request's grace.

It reports the command's pid on its standard output (one line starting with
``AGENT_MARK``, which the launcher hides), then exits with the command's
status (128 + N for a command killed by signal N). A SIGINT, SIGTERM or SIGHUP
sent to the agent itself is passed on to the command. On Linux the command
also gets SIGTERM if the agent dies without a chance to pass anything on.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import threading
from typing import Any, BinaryIO

from gossiptrain.cli.common import EXIT_USAGE
from gossiptrain.errors import ConfigError
from gossiptrain.runtime.launch_plan import (
    AGENT_SUBCOMMAND,
    MAX_CONTROL_BYTES,
    MAX_REQUEST_BYTES,
    AgentRequest,
    parse_control,
    started_report,
)

#: The exit status when the command cannot be started (as a shell's "command not found").
EXIT_NOT_STARTED = 127
#: Signals sent to the agent itself that it passes on to its command.
_PASSED_ON = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def add_parser(subparsers: Any) -> None:
    """Add the hidden `launch-agent` subcommand (no help=: argparse then leaves it out of the command list)."""
    p = subparsers.add_parser(AGENT_SUBCOMMAND, description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.set_defaults(func=cmd_launch_agent)


def cmd_launch_agent(args: argparse.Namespace) -> int:
    return run_agent(sys.stdin.buffer)


def run_agent(control: BinaryIO) -> int:
    """Read the request from ``control``, run it, obey the control lines; the command's exit status."""
    try:
        request = AgentRequest.decode(control.readline(MAX_REQUEST_BYTES + 1))
    except ConfigError as e:
        print(f"gossiptrain {AGENT_SUBCOMMAND}: {e} (it is started by `gossiptrain launch`)", file=sys.stderr, flush=True)
        return EXIT_USAGE
    argv = [sys.executable, "-m", "gossiptrain", *request.argv] if request.gossiptrain else request.argv
    try:
        child = subprocess.Popen(
            argv,
            cwd=request.cwd,
            env={**os.environ, "PYTHONUNBUFFERED": "1", **request.env},
            stdin=subprocess.DEVNULL,
            preexec_fn=_die_with_parent if sys.platform == "linux" else None,  # no thread runs yet: fork is safe
        )
    except OSError as e:
        where = f" in {request.cwd}" if request.cwd else ""
        print(f"gossiptrain {AGENT_SUBCOMMAND}: cannot start {argv[0]!r}{where}: {e.strerror or e}", file=sys.stderr, flush=True)
        return EXIT_NOT_STARTED
    print(started_report(child.pid), flush=True)
    previous = {sig: signal.signal(sig, lambda signum, frame: _send(child, signum)) for sig in _PASSED_ON}
    try:
        threading.Thread(target=_obey, args=(control, child, request.grace), name="launch-agent-control", daemon=True).start()
        status = child.wait()
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)
    return 128 - status if status < 0 else status


def _obey(control: BinaryIO, child: subprocess.Popen[bytes], grace: float) -> None:
    """Forward the control lines' signals; at end-of-file, SIGTERM, then SIGKILL after ``grace`` seconds."""
    try:
        while line := control.readline(MAX_CONTROL_BYTES):
            name = parse_control(line)
            if name is not None:
                _send(child, getattr(signal, f"SIG{name}"))
            else:
                print(f"gossiptrain {AGENT_SUBCOMMAND}: ignored control line {line[:40]!r}", file=sys.stderr, flush=True)
    except (OSError, ValueError):
        pass  # a broken input is an end of input
    _send(child, signal.SIGTERM)
    try:
        child.wait(grace)
    except subprocess.TimeoutExpired:
        child.kill()


def _send(child: subprocess.Popen[bytes], signum: int) -> None:
    if child.poll() is None:
        try:
            child.send_signal(signum)
        except ProcessLookupError:
            pass  # it has just exited


def _die_with_parent() -> None:
    """In the child, before exec: SIGTERM when the agent dies (Linux's PR_SET_PDEATHSIG), however it dies."""
    import ctypes

    pr_set_pdeathsig = 1
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, int(signal.SIGTERM), 0, 0, 0)
