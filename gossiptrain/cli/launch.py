"""`gossiptrain launch`: a coordinator and peers on several hosts over ssh, from one terminal, as pdsh or torchrun users expect.

    gossiptrain launch --hosts hosts.txt --coordinator-args '--workload digits --steps 3000' -- --metrics peer-{index}.jsonl

The coordinator starts on the first host (or ``--coordinator-host``) and
listens on ``--port`` (29400); once it does, ``slots`` peers start on every
host (``--peers-per-host`` where a line gives none) and join it. Each
process is reached through the ``--ssh`` template (``ssh {host}``; any
command prefix works, e.g. ``ip netns exec {host}``) and runs under
``gossiptrain launch-agent`` (``gossiptrain.cli.launch_agent``), which ends it
when the launcher's pipe closes: killing the launcher, or losing the
connection, leaves nothing running. The launcher prints each process as it
starts (host, role, pid there), every output line prefixed with its host
(``host: line``, as pdsh), passes Ctrl+C and SIGTERM on to every process and
waits for them (``--grace`` seconds, then they are terminated, then killed).
It exits 0 when every peer finished, 1 naming each peer (or the coordinator)
that failed or did not start, 130 after Ctrl+C.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import IO, Any, Callable, Sequence

from gossiptrain.cli import launch_agent
from gossiptrain.cli.common import EXIT_FAILED, EXIT_INTERRUPTED, EXIT_OK, setup_logging
from gossiptrain.errors import ConfigError
from gossiptrain.net.addressing import parse_hostport
from gossiptrain.runtime.launch_plan import (
    AGENT_MARK,
    DEFAULT_PORT,
    DEFAULT_REMOTE_COMMAND,
    DEFAULT_SSH,
    AgentRequest,
    LaunchPlan,
    Process,
    check_ssh_template,
    control_line,
    host_port,
    parse_report,
    plan_launch,
    read_hostfile,
    split_words,
)

#: The coordinator's line that says it listens, and where (``gossiptrain coordinator`` prints it).
_READY = re.compile(r"join with: \S+ peer --join (\S+)")
#: Exit statuses of a process stopped on purpose: done, after SIGINT (130), killed by SIGTERM before it could leave (143).
_STOPPED = (0, 130, 143)
#: The address the launcher's own flags stand in with, while the user's arguments are checked.
_PROBE = "127.0.0.1:0"
#: Seconds between looks at the processes.
_POLL = 0.1
#: Seconds past an agent's own grace before its local command is killed (ssh has to carry its last words).
_SLACK = 5.0
#: Lines of each process's output kept to explain its failure.
_TAIL = 6


def add_parsers(subparsers: Any) -> None:
    """Add `launch` and the hidden `launch-agent` it runs on every host."""
    p = subparsers.add_parser(
        "launch", help="start a coordinator and peers on several hosts over ssh (hostfile; output prefixed by host)",
        description=__doc__.split("\n\n")[0] if __doc__ else None,
    )
    p.add_argument("--hosts", required=True, metavar="FILE",
                   help="hostfile: one [user@]host per line, optional slots=N (peers there) and address=ADDR "
                   "(where the others reach it), # comments (required)")
    p.add_argument("--peers-per-host", type=int, default=1, metavar="N",
                   help="peers on a host whose line gives no slots= (default 1)")
    p.add_argument("--coordinator-host", metavar="HOST",
                   help="where the coordinator runs, in the hostfile or not (default: the hostfile's first host)")
    p.add_argument("--coordinator-address", metavar="ADDR",
                   help="where the peers reach the coordinator; it listens there (default: its host's address=, "
                   "else its name as resolved on this machine)")
    p.add_argument("--port", type=int, default=DEFAULT_PORT, metavar="PORT",
                   help=f"the coordinator's port, reachable from every host (default {DEFAULT_PORT}; "
                   "0: any free one, read from its output)")
    p.add_argument("--coordinator-args", default="", metavar="ARGS",
                   help="the coordinator's run flags, one string, e.g. '--workload digits --steps 3000' (default: none, "
                   "the defaults of `gossiptrain coordinator`)")
    p.add_argument("--ssh", default=DEFAULT_SSH, metavar="TEMPLATE",
                   help=f"the command prefix that runs a command on a host; {{host}} is the hostfile's [user@]host, "
                   f"{{hostname}} and {{user}} its parts (default {DEFAULT_SSH!r}; e.g. 'ssh -o BatchMode=yes {{host}}', "
                   "'ip netns exec {host}'; never -tt: the agent needs its input's end)")
    p.add_argument("--remote-command", default=DEFAULT_REMOTE_COMMAND, metavar="WORDS",
                   help=f"gossiptrain on the hosts (default {DEFAULT_REMOTE_COMMAND!r}; e.g. '/opt/venv/bin/gossiptrain', "
                   "'python3 -m gossiptrain')")
    p.add_argument("--workdir", metavar="DIR",
                   help="directory the processes run in, for relative paths in their arguments (default: where the "
                   "--ssh command starts them: the home directory over ssh)")
    p.add_argument("--env", action="append", default=[], metavar="NAME=VALUE",
                   help="set in every process's environment (repeatable; default: none)")
    p.add_argument("--start-timeout", type=float, default=60.0, metavar="SECONDS",
                   help="for the coordinator to listen (default 60)")
    p.add_argument("--grace", type=float, default=20.0, metavar="SECONDS",
                   help="after Ctrl+C, SIGTERM or the last peer's end: how long the processes get to leave before they "
                   "are terminated, and as long again before they are killed (default 20)")
    p.add_argument("--dry-run", action="store_true", help="print what would run where, and start nothing")
    p.add_argument("peer_args", nargs="*", metavar="-- PEER ARGS",
                   help="after --: every peer's flags; {index} (the peer's number) and {host} are filled in, e.g. "
                   "--metrics run/peer-{index}.jsonl (default: none)")
    p.set_defaults(func=lambda args: cmd_launch(args, subparsers.choices))
    launch_agent.add_parser(subparsers)


# -- the command -----------------------------------------------------------------------------


@dataclass(frozen=True)
class LaunchOptions:
    address: str  # where the peers reach the coordinator, and where it listens (an IP: a listener binds to one)
    ssh: str = DEFAULT_SSH
    port: int = DEFAULT_PORT
    workdir: str | None = None
    env: dict[str, str] = field(default_factory=dict)
    start_timeout: float = 60.0
    grace: float = 20.0


def cmd_launch(args: argparse.Namespace, commands: dict[str, argparse.ArgumentParser]) -> int:
    setup_logging(args.verbose)
    hosts = read_hostfile(args.hosts)
    check_ssh_template(args.ssh)
    if not 0 <= args.port <= 65535:
        raise ConfigError(f"--port must be in 0-65535, got {args.port}")
    for flag in ("start_timeout", "grace"):
        if not getattr(args, flag) > 0:
            raise ConfigError(f"--{flag.replace('_', '-')} must be > 0 seconds, got {getattr(args, flag)}")
    plan = plan_launch(
        hosts,
        peers_per_host=args.peers_per_host,
        coordinator_host=args.coordinator_host,
        remote_command=split_words(args.remote_command, "--remote-command", required=True),
        coordinator_args=split_words(args.coordinator_args, "--coordinator-args"),
        peer_args=args.peer_args,
    )
    # Flags the remote commands would refuse are refused here, once, before any host is reached.
    _check_args(commands["coordinator"], plan.coordinator_command(_PROBE), "--coordinator-args",
                ("bind", "--coordinator-address and --port"))
    _check_args(commands["peer"], plan.peer_command(plan.peers[0], _PROBE), "the peer arguments after --",
                ("join", "the coordinator's address"))
    home = plan.coordinator.host
    named = args.coordinator_address or home.address or home.name
    options = LaunchOptions(
        # --dry-run starts nothing, so it needs no name service: it shows the name (resolved at launch)
        address=named if args.dry_run else _resolve(named, args.hosts),
        ssh=args.ssh,
        port=args.port,
        workdir=args.workdir,
        env=_env(args.env),
        start_timeout=args.start_timeout,
        grace=args.grace,
    )
    if args.dry_run:
        print(describe(plan, options), flush=True)
        return EXIT_OK
    return Launcher(plan, options).run()


def _check_args(parser: argparse.ArgumentParser, argv: list[str], what: str, owned: tuple[str, str]) -> None:
    """``argv`` (a subcommand and its arguments) as the subcommand's own parser reads it; an error names ``what``.

    ``owned`` is the flag the launcher sets (its dest) and what sets it instead: the user's arguments may not.
    """
    command, args = argv[0], argv[1:]
    parser.exit_on_error = False
    try:
        parsed, unknown = parser.parse_known_args(args)
    except argparse.ArgumentError as e:
        raise ConfigError(f"{what}: {e}") from None
    finally:
        parser.exit_on_error = True
    if unknown:
        raise ConfigError(f"{what}: `gossiptrain {command}` does not take {' '.join(unknown)}")
    dest, instead = owned
    if getattr(parsed, dest) != _PROBE:
        raise ConfigError(f"{what}: --{dest} is the launcher's to set (it follows from {instead})")


def _resolve(name: str, hostfile: str) -> str:
    """The coordinator's address, a name resolved as this machine resolves it (IPv4 first): it listens there, the
    peers join there."""
    try:
        infos = socket.getaddrinfo(name, None, type=socket.SOCK_STREAM)
    except socket.gaierror as e:
        raise ConfigError(
            f"cannot resolve the coordinator's host {name!r} here ({e.strerror}): give its address with "
            f"address=ADDR on its line of {hostfile}, or --coordinator-address ADDR"
        ) from None
    infos.sort(key=lambda info: info[0] != socket.AF_INET)
    return str(infos[0][4][0])


def _env(items: Sequence[str]) -> dict[str, str]:
    env = {}
    for item in items:
        name, sep, value = item.partition("=")
        if not sep or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name):
            raise ConfigError(f"--env {item!r} must look like NAME=VALUE")
        env[name] = value
    return env


def describe(plan: LaunchPlan, options: LaunchOptions) -> str:
    """What would run where (``--dry-run``): one line per process, its local command, then what its agent runs."""
    bind = host_port(options.address, options.port)
    lines = [f"coordinator at {bind}; {len(plan.peers)} peers; working directory: {options.workdir or '(the default)'}"]
    todo = [(plan.coordinator, plan.coordinator_command(bind)), *((p, plan.peer_command(p, bind)) for p in plan.peers)]
    for process, argv in todo:
        lines.append(f"{process.name}: {_quote(plan.agent_command(options.ssh, process))}  <<< gossiptrain {_quote(argv)}")
    return "\n".join(lines)


def _quote(words: Sequence[str]) -> str:
    return " ".join(shlex.quote(w) for w in words)


# -- carrying the plan out ---------------------------------------------------------------------


class Output:
    """The launcher's stdout and stderr, shared by every process's reader thread: whole lines, never interleaved."""

    def __init__(self, stdout: IO[str] | None = None, stderr: IO[str] | None = None) -> None:
        self.stdout = stdout or sys.stdout
        self.stderr = stderr or sys.stderr
        self._lock = threading.Lock()

    def line(self, text: str, error: bool = False) -> None:
        stream = self.stderr if error else self.stdout
        with self._lock:
            try:
                stream.write(text + "\n")
                stream.flush()
            except (BrokenPipeError, ValueError):
                pass  # nobody reads us any more (`| head`): the hosts' output is still drained, or they would block

    def say(self, text: str, error: bool = False) -> None:
        self.line(f"launch: {text}", error)


class Remote:
    """One process on a host: the local ``--ssh`` command running its agent, its output, its stop."""

    def __init__(
        self, process: Process, command: list[str], request: AgentRequest, out: Output,
        on_line: Callable[[Remote, str], None] | None = None,
    ) -> None:
        self.process = process
        self.out = out
        self.remote_pid: int | None = None
        self.tail: deque[str] = deque(maxlen=_TAIL)
        self.stop_sent = False  # a stop was asked of it: 0, 130 and 143 then mean it obeyed
        self.killed = False
        self._on_line = on_line
        try:
            # A session of its own: the terminal's Ctrl+C reaches only the launcher, which passes it on in order.
            self.popen = subprocess.Popen(
                command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True
            )
        except OSError as e:
            raise ConfigError(f"--ssh: cannot run {command[0]!r} for {process.name}: {e.strerror or e}") from None
        self._readers = [
            threading.Thread(target=self._read, args=(stream, error), name=f"launch-{process.label}", daemon=True)
            for stream, error in ((self.popen.stdout, False), (self.popen.stderr, True))
        ]
        for t in self._readers:
            t.start()
        self._write(request.encode())

    def _read(self, stream: IO[bytes], error: bool) -> None:
        for raw in iter(lambda: stream.readline(1 << 16), b""):
            text = raw.decode("utf-8", "replace").rstrip("\r\n")
            if not error and text.startswith(AGENT_MARK):
                pid = parse_report(text)
                if pid is not None and self.remote_pid is None:
                    self.remote_pid = pid
                    self.out.say(f"started {self.process.name}: pid {pid} there")
                continue
            self.tail.append(text)
            self.out.line(f"{self.process.label}: {text}", error)
            if self._on_line is not None:
                self._on_line(self, text)

    def _write(self, data: bytes) -> None:
        stdin = self.popen.stdin
        try:
            if stdin is not None and not stdin.closed:
                stdin.write(data)
                stdin.flush()
        except (BrokenPipeError, ValueError):
            pass  # it has gone: its exit status says why

    def signal(self, name: str) -> None:
        """Ask the agent to send its process SIGINT or SIGTERM."""
        self.stop_sent = True
        self._write(control_line(name))

    def close_input(self) -> None:
        """End the agent's input: it terminates its process, and kills it after the request's grace."""
        self.stop_sent = True
        try:
            if self.popen.stdin is not None:
                self.popen.stdin.close()
        except BrokenPipeError:
            pass

    def kill(self) -> None:
        """Kill the local command's whole session (over ssh the agent then sees its input end)."""
        self.killed = True
        try:
            os.killpg(self.popen.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    @property
    def running(self) -> bool:
        return self.popen.poll() is None

    def finish(self, timeout: float = 2.0) -> None:
        """Once it has exited: wait for its output to be read to the end (bounded), and close its input."""
        for t in self._readers:
            t.join(timeout)
        try:
            if self.popen.stdin is not None:
                self.popen.stdin.close()
        except BrokenPipeError:
            pass

    def failure(self) -> str | None:
        """Why it failed, or None if it ended as it should."""
        code = self.popen.returncode
        last = next((line for line in reversed(self.tail) if line.strip()), "")
        detail = f": {last.strip()}" if last else ""
        obeyed = self.stop_sent and code in _STOPPED
        if self.killed:
            late = "did not start" if self.remote_pid is None else "did not stop within the grace period"
            return f"{self.process.name} {late} and was killed"
        status = f"exit status {code}" if code >= 0 else f"its local command killed by signal {-code}"
        if self.remote_pid is None and not obeyed:
            return f"{self.process.name} did not start ({status}){detail}"
        if code == 0 or obeyed:
            return None
        return f"{self.process.name} failed with {status}{detail}"


class StopSignals:
    """SIGINT and SIGTERM while the launch runs: the first asks everyone to stop, a second to hurry."""

    def __init__(self) -> None:
        self.requested: str | None = None  # "INT" or "TERM"
        self.hurry = threading.Event()
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():
            self._previous = {sig: signal.signal(sig, self._on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, old in self._previous.items():
            signal.signal(sig, old)

    def _on_signal(self, signum: int, frame: object) -> None:
        if self.requested is None:
            self.requested = "INT" if signum == signal.SIGINT else "TERM"
        else:
            self.hurry.set()


class Launcher:
    """Carries a plan out: the coordinator, once it listens the peers, then everyone's end."""

    def __init__(self, plan: LaunchPlan, options: LaunchOptions, out: Output | None = None) -> None:
        self.plan = plan
        self.options = options
        self.out = out or Output()
        self.remotes: list[Remote] = []
        self.join: str | None = None
        self.problems: list[str] = []  # failures of the launch itself (each process's own are its Remote's)
        self._ready = threading.Event()

    def run(self) -> int:
        with StopSignals() as stop:
            try:
                peers = self._start_all(stop)
                if peers is not None:
                    self._wait(lambda: not any(r.running for r in peers), None, stop)
                self._stop_everyone(stop)
            finally:
                for r in self.remotes:  # whatever happened above, nothing is left behind
                    if r.running:
                        r.kill()
                for r in self.remotes:
                    r.popen.wait()
                    r.finish()
        return self._report(stop)

    def _start(self, process: Process, argv: list[str], on_line: Callable[[Remote, str], None] | None = None) -> Remote:
        request = AgentRequest(argv, self.options.workdir, self.options.env, self.options.grace, gossiptrain=True)
        remote = Remote(process, self.plan.agent_command(self.options.ssh, process), request, self.out, on_line)
        self.remotes.append(remote)
        return remote

    def _start_all(self, stop: StopSignals) -> list[Remote] | None:
        """The coordinator, then (once it listens) every peer; None if it never listened."""
        bind = host_port(self.options.address, self.options.port)
        coordinator = self._start(self.plan.coordinator, self.plan.coordinator_command(bind), self._watch_coordinator)
        self._wait(lambda: self._ready.is_set() or not coordinator.running, self.options.start_timeout, stop)
        if not self._ready.is_set():
            if stop.requested is None:
                why = f"did not listen within {self.options.start_timeout:g} s" if coordinator.running else "ended first"
                self.problems.append(f"no peer started: {self.plan.coordinator.name} {why}")
            return None
        self.out.say(f"coordinator listening at {self.join}; starting {len(self.plan.peers)} peers")
        return [self._start(p, self.plan.peer_command(p, self.join or bind)) for p in self.plan.peers]

    def _watch_coordinator(self, remote: Remote, line: str) -> None:
        match = _READY.search(line)
        if match and not self._ready.is_set():
            _, port = parse_hostport(match.group(1), "the coordinator's address")
            self.join = host_port(self.options.address, port)
            self._ready.set()

    def _wait(self, done: Callable[[], bool], timeout: float | None, stop: StopSignals) -> bool:
        """Until ``done()``, ``timeout`` seconds, or a stop signal; whether ``done()``."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not done():
            if stop.requested is not None or (deadline is not None and time.monotonic() > deadline):
                return False
            time.sleep(_POLL)
        return True

    def _stop_everyone(self, stop: StopSignals) -> None:
        """Pass the stop on (or SIGTERM the coordinator after the last peer), then terminate, then kill (each bounded)."""
        running = [r for r in self.remotes if r.running]
        if not running:
            return
        if stop.requested is not None:
            self.out.say(f"SIG{stop.requested}: passing it on to {len(running)} processes", True)
        for r in running:
            r.signal(stop.requested or "TERM")
        # Wait as asked; then end the agents' input: they terminate, and kill after the same grace; then (in run) kill.
        for step, seconds in ((lambda r: None, self.options.grace), (Remote.close_input, self.options.grace + _SLACK)):
            step_deadline = time.monotonic() + seconds
            for r in running:
                step(r)
            while any(r.running for r in running) and time.monotonic() < step_deadline and not stop.hurry.is_set():
                time.sleep(_POLL)
            if stop.hurry.is_set():
                break

    def _report(self, stop: StopSignals) -> int:
        failed = [(r.process.name, f) for r in self.remotes if (f := r.failure()) is not None]
        for _, why in failed:
            self.out.say(why, error=True)
        for problem in self.problems:
            self.out.say(problem, error=True)
        started = [r for r in self.remotes if r.process.role == "peer"]
        if failed or self.problems:
            self.out.say(f"failed: {', '.join(name for name, _ in failed) or 'no peer started'}", error=True)
            return EXIT_FAILED
        if stop.requested is not None:
            self.out.say(f"stopped: {len(started)} of {len(self.plan.peers)} peers had started", error=True)
            return EXIT_INTERRUPTED if stop.requested == "INT" else EXIT_OK
        self.out.say("the one peer finished" if len(started) == 1 else f"all {len(started)} peers finished")
        return EXIT_OK
