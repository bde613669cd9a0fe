"""What `gossiptrain launch` runs where: the hostfile, the command lines, and what the launcher tells each agent.

Pure: no process is started and no name is resolved here, so the whole plan
is checked in unit tests without ssh (``gossiptrain.cli.launch`` carries it
out).

Hostfile, as MPI and DeepSpeed users know it: one host per line,
``[user@]host [slots=N] [address=ADDR]``; ``#`` starts a comment; blank
lines are skipped. ``slots`` is how many peers run there (0: none, e.g. a
host for the coordinator alone); ``address`` is where the other hosts
reach it, when that is not its name (a name that is only an ssh alias, a
network namespace).

Every remote process runs under ``gossiptrain launch-agent``
(``gossiptrain.cli.launch_agent``), whose standard input is the launcher's
line to it: the first line a JSON request (the command, its directory and
environment), then control lines (``signal INT``, ``signal TERM``), and
end-of-file means "stop now". So the command never passes through a remote
shell's quoting, and the remote process ends when the launcher or its ssh
connection does, however they end.
"""

from __future__ import annotations

import json
import re
import shlex
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping, Sequence

from gossiptrain.errors import ConfigError

#: The coordinator's port when none is given (as torchrun's rendezvous): fixed, so firewalls can be opened for it.
DEFAULT_PORT = 29400
#: How the launcher reaches a host: ``{host}`` is the hostfile's ``[user@]host``.
DEFAULT_SSH = "ssh {host}"
#: The gossiptrain command on the remote hosts (words; ``python -m gossiptrain`` works too).
DEFAULT_REMOTE_COMMAND = "gossiptrain"
#: The hidden subcommand every remote process runs under.
AGENT_SUBCOMMAND = "launch-agent"
#: The agent's report lines on its standard output start with this (the launcher reads and hides them).
AGENT_MARK = "gossiptrain-launch-agent:"
#: Bounds on what an agent reads from its standard input.
MAX_REQUEST_BYTES = 1 << 20
MAX_CONTROL_BYTES = 64
#: The control lines an agent obeys, and the signals they forward.
CONTROL_SIGNALS = ("INT", "TERM")

_PLACEHOLDER = re.compile(r"\{(\w+)\}")
_SSH_FIELDS = ("host", "hostname", "user")
_PEER_FIELDS = ("index", "host")
_HOST_NAME = re.compile(r"[A-Za-z0-9_.:\[\]%-]+")
_USER = re.compile(r"[A-Za-z0-9_.-]+")


@dataclass(frozen=True)
class Host:
    """One line of a hostfile."""

    target: str  # as written, [user@]host: what {host} becomes in the ssh template
    slots: int | None = None  # peers to run there (None: the launcher's --peers-per-host)
    address: str | None = None  # where the other hosts reach it (None: its name)
    where: str = ""  # FILE:LINE, for messages

    @property
    def name(self) -> str:
        """The host without ``user@`` (nor an IPv6 address's brackets)."""
        return self.target.rpartition("@")[2].strip("[]")

    @property
    def user(self) -> str:
        """The ``user@`` part, or ""."""
        return self.target.rpartition("@")[0]


def _parse_line(words: Sequence[str], where: str) -> Host:
    target, options = words[0], words[1:]
    user, at, name = target.rpartition("@")
    if not _HOST_NAME.fullmatch(name) or (at and not _USER.fullmatch(user)):
        raise ConfigError(f"{where}: {target!r} is not a host: write [user@]host, then slots=N or address=ADDR")
    slots: int | None = None
    address: str | None = None
    for option in options:
        key, sep, value = option.partition("=")
        if key == "slots" and sep:
            if not (value.isascii() and value.isdigit()):
                raise ConfigError(f"{where}: {option!r}: slots must be a whole number >= 0")
            slots = int(value)
        elif key == "address" and sep and _HOST_NAME.fullmatch(value):
            address = value.strip("[]")
        else:
            raise ConfigError(f"{where}: {option!r} is not understood (slots=N or address=ADDR)")
    return Host(target, slots, address, where)


def parse_hostfile(text: str, source: str) -> list[Host]:
    """The hosts of a hostfile's ``text``; a malformed line is a ConfigError naming ``source`` and the line."""
    hosts: list[Host] = []
    for number, raw in enumerate(text.splitlines(), start=1):
        words = raw.split("#", 1)[0].split()
        if words:
            hosts.append(_parse_line(words, f"{source}:{number}"))
    seen: dict[str, str] = {}
    for h in hosts:
        if h.target in seen:
            raise ConfigError(f"{h.where}: {h.target} is listed twice (first at {seen[h.target]}; give it slots=N instead)")
        seen[h.target] = h.where
    if not hosts:
        raise ConfigError(f"{source}: no hosts (one per line: [user@]host [slots=N] [address=ADDR])")
    return hosts


def read_hostfile(path: str | Path) -> list[Host]:
    """``parse_hostfile`` of a file; an unreadable file is a ConfigError naming it."""
    try:
        text = Path(path).read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"--hosts {path}: cannot read it: {e}") from None
    return parse_hostfile(text, str(path))


def _fill(word: str, values: Mapping[str, str], allowed: Sequence[str], what: str) -> str:
    def one(m: re.Match[str]) -> str:
        if m.group(1) not in allowed:
            raise ConfigError(f"{what}: unknown placeholder {m.group(0)} (known: {', '.join('{%s}' % a for a in allowed)})")
        return values[m.group(1)]

    return _PLACEHOLDER.sub(one, word)


def check_ssh_template(template: str) -> list[str]:
    """The template's words; it must name ``{host}`` (or ``{hostname}``), else every process would go to one place."""
    try:
        words = shlex.split(template)
    except ValueError as e:
        raise ConfigError(f"--ssh {template!r}: {e}") from None
    if not words:
        raise ConfigError("--ssh must not be empty (default: 'ssh {host}')")
    for w in words:
        _fill(w, dict.fromkeys(_SSH_FIELDS, ""), _SSH_FIELDS, f"--ssh {template!r}")
    if not any("{host}" in w or "{hostname}" in w for w in words):
        raise ConfigError(f"--ssh {template!r} must contain {{host}}, where each host's name goes (e.g. 'ssh {{host}}')")
    return words


def ssh_prefix(template: str, host: Host) -> list[str]:
    """The local command that runs what follows it on ``host``: the template with ``{host}``, ``{hostname}``, ``{user}``."""
    values = {"host": host.target, "hostname": host.name, "user": host.user}
    return [_fill(w, values, _SSH_FIELDS, "--ssh") for w in check_ssh_template(template)]


def split_words(text: str, flag: str, *, required: bool = False) -> list[str]:
    """A flag's value split as a shell would (``--remote-command 'python -m gossiptrain'``); ``required``: not empty."""
    try:
        words = shlex.split(text)
    except ValueError as e:
        raise ConfigError(f"{flag} {text!r}: {e}") from None
    if required and not words:
        raise ConfigError(f"{flag} must not be empty")
    return words


def host_port(host: str, port: int) -> str:
    """HOST:PORT, with an IPv6 host in brackets (as ``--join`` and ``--bind`` read it)."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


@dataclass(frozen=True)
class Process:
    """One process of the launch: the coordinator or a peer, on one host."""

    role: str  # "coordinator" or "peer"
    host: Host
    index: int = 0  # the peer's number in the launch (0, 1, ...); 0 for the coordinator
    label: str = ""  # what its output lines start with (the host, and which process there if it runs several)

    @property
    def name(self) -> str:
        """How messages name it: "coordinator on HOST", "peer 3 on HOST"."""
        who = "coordinator" if self.role == "coordinator" else f"peer {self.index}"
        return f"{who} on {self.host.target}"


@dataclass(frozen=True)
class LaunchPlan:
    """Where the coordinator and each peer run, and what they run (given the coordinator's address).

    The commands are gossiptrain's arguments: each host's agent runs them
    with its own interpreter, the one ``remote_command`` found there.
    """

    coordinator: Process
    peers: list[Process]
    remote_command: list[str]
    coordinator_args: list[str] = field(default_factory=list)
    peer_args: list[str] = field(default_factory=list)

    def agent_command(self, ssh_template: str, process: Process) -> list[str]:
        """The local command that starts ``process``'s agent on its host."""
        return [*ssh_prefix(ssh_template, process.host), *self.remote_command, AGENT_SUBCOMMAND]

    def coordinator_command(self, bind: str) -> list[str]:
        return ["coordinator", "--bind", bind, *self.coordinator_args]

    def peer_command(self, peer: Process, join: str) -> list[str]:
        """``--join`` first, then ``--advertise`` the host's ``address=`` (where the others reach it: a peer left
        to find its own address advertises the interface that routes to the coordinator, which need not be it),
        then the user's arguments with ``{index}`` and ``{host}`` filled in. The user's own ``--advertise`` wins."""
        values = {"index": str(peer.index), "host": peer.host.name}
        extra = [_fill(a, values, _PEER_FIELDS, "peer arguments") for a in self.peer_args]
        advertised = any(a == "--advertise" or a.startswith("--advertise=") for a in extra)
        advertise = ["--advertise", peer.host.address] if peer.host.address and not advertised else []
        return ["peer", "--join", join, *advertise, *extra]


def plan_launch(
    hosts: Sequence[Host],
    *,
    peers_per_host: int = 1,
    coordinator_host: str | None = None,
    remote_command: Sequence[str] = (DEFAULT_REMOTE_COMMAND,),
    coordinator_args: Sequence[str] = (),
    peer_args: Sequence[str] = (),
) -> LaunchPlan:
    """The coordinator on ``coordinator_host`` (default: the first host), then ``slots`` peers on each host.

    A host without ``slots=`` runs ``peers_per_host``. A ``coordinator_host``
    that is not in the hostfile runs the coordinator alone. Peers are
    numbered host by host, in the hostfile's order.
    """
    if peers_per_host < 0:
        raise ConfigError(f"--peers-per-host must be >= 0, got {peers_per_host}")
    if coordinator_host is None:
        home = hosts[0]
    else:
        listed = [h for h in hosts if coordinator_host in (h.target, h.name)]
        home = listed[0] if listed else _parse_line([coordinator_host], "--coordinator-host")
    slots = [(h, peers_per_host if h.slots is None else h.slots) for h in hosts]
    if sum(n for _, n in slots) == 0:
        raise ConfigError("no peers to start: every host has slots=0 (or --peers-per-host 0)")
    runs = Counter({home.target: 1})  # processes per host: a host that runs several labels each one's output
    for h, n in slots:
        runs[h.target] += n
    peers: list[Process] = []
    for host, count in slots:
        for _ in range(count):
            index = len(peers)
            peers.append(Process("peer", host, index, host.target if runs[host.target] == 1 else f"{host.target}/peer{index}"))
    coordinator = Process("coordinator", home, 0, home.target if runs[home.target] == 1 else f"{home.target}/coordinator")
    return LaunchPlan(coordinator, peers, list(remote_command), list(coordinator_args), list(peer_args))


# -- the agent's protocol: what the launcher writes to its standard input, what it reports ---------------------


@dataclass(frozen=True)
class AgentRequest:
    """What an agent runs: ``argv`` in ``cwd`` (None: where it started) with ``env`` added to its environment.

    With ``gossiptrain``, ``argv`` are gossiptrain's arguments (``peer --join ...``), run as
    ``python -m gossiptrain`` by the agent's own interpreter: the one the remote command found, whatever
    the shell there expanded to find it (``~/venv/bin/gossiptrain``), which the agent's own exec would not.
    """

    argv: list[str]
    cwd: str | None = None
    env: dict[str, str] = field(default_factory=dict)
    grace: float = 10.0  # seconds between SIGTERM and SIGKILL once its input closes
    gossiptrain: bool = False

    def encode(self) -> bytes:
        body = {"argv": self.argv, "cwd": self.cwd, "env": self.env, "grace": self.grace, "gossiptrain": self.gossiptrain}
        return json.dumps(body).encode() + b"\n"

    @classmethod
    def decode(cls, line: bytes) -> AgentRequest:
        """The request of a first line; a ConfigError says what is wrong with it."""
        if not line.endswith(b"\n"):
            raise ConfigError(f"the request line is missing or longer than {MAX_REQUEST_BYTES} bytes")
        try:
            body = json.loads(line)
        except ValueError as e:
            raise ConfigError(f"the request line is not JSON: {e}") from None
        if not isinstance(body, dict):
            raise ConfigError("the request line is not a JSON object")
        argv, cwd, env, grace = body.get("argv"), body.get("cwd"), body.get("env", {}), body.get("grace", 10.0)
        if not (isinstance(argv, list) and argv and all(isinstance(a, str) for a in argv)):
            raise ConfigError("the request's argv must be a non-empty list of strings")
        if cwd is not None and not isinstance(cwd, str):
            raise ConfigError("the request's cwd must be a string or null")
        if not (isinstance(env, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in env.items())):
            raise ConfigError("the request's env must map strings to strings")
        if not (isinstance(grace, (int, float)) and not isinstance(grace, bool) and 0 <= grace <= 3600):
            raise ConfigError("the request's grace must be a number of seconds in [0, 3600]")
        if not isinstance(body.get("gossiptrain", False), bool):
            raise ConfigError("the request's gossiptrain must be true or false")
        return cls(argv, cwd, env, float(grace), body.get("gossiptrain", False))


def control_line(signal_name: str) -> bytes:
    """The line that makes an agent send its process ``signal_name`` (INT or TERM)."""
    if signal_name not in CONTROL_SIGNALS:
        raise ValueError(f"an agent forwards only {CONTROL_SIGNALS}, not {signal_name!r}")
    return f"signal {signal_name}\n".encode()


def parse_control(line: bytes) -> str | None:
    """The signal name a control line asks for, or None for a line that is not one."""
    words = line.decode("ascii", "replace").split()
    return words[1] if len(words) == 2 and words[0] == "signal" and words[1] in CONTROL_SIGNALS else None


def started_report(pid: int) -> str:
    return f"{AGENT_MARK} started pid {pid}"


def parse_report(line: str) -> int | None:
    """The remote pid an agent's "started" line reports, or None for any other line."""
    if not line.startswith(AGENT_MARK):
        return None
    words = line[len(AGENT_MARK):].split()
    return int(words[2]) if len(words) == 3 and words[:2] == ["started", "pid"] and words[2].isdigit() else None
