"""`gossiptrain launch` as a user meets it, on this machine: errors, --dry-run, the agent, a failing peer, an unreachable host.

The remote hosts here are loopback addresses reached through a template that
runs the command locally (``env GOSSIPTRAIN_TEST_HOST={host}``): the same code
path as ``ssh {host}``. Where an sshd is installed (and as root), one test
starts its own on 127.0.0.1 and launches through real ssh. The launch
through ``ip netns exec``, across network namespaces as separate machines,
is tests/test_launch_netns.py.
"""

from __future__ import annotations

import argparse
import getpass
import os
import re
import select
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator

import pytest

from gossiptrain.cli.main import build_parser, main
from gossiptrain.net.addressing import free_loopback_port
from gossiptrain.runtime.launch_plan import AgentRequest, control_line, parse_report
from gossiptrain.train.metrics import read_metrics

from .swarm import ROOT, next_host, run_in_session, wait_for

LOCAL = "env GOSSIPTRAIN_TEST_HOST={host}"  # a "remote" command prefix that runs it here
REMOTE = f"{sys.executable} -m gossiptrain"


def run_main(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    try:
        rc = main(argv)
    except SystemExit as e:
        rc = int(e.code or 0)
    captured = capsys.readouterr()
    return rc, captured.out, captured.err


def hostfile(tmp_path: Path, text: str) -> str:
    path = tmp_path / "hosts.txt"
    path.write_text(text)
    return str(path)


# ---------------------------------------------------------------- before anything starts


def test_dry_run_shows_what_runs_where_and_starts_nothing(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    hosts = hostfile(tmp_path, "head slots=0 address=10.1.0.1\nalice@node1 slots=2\n")
    rc, out, _ = run_main(["launch", "--hosts", hosts, "--dry-run", "--workdir", "/scratch/run",
                           "--coordinator-args", "--workload digits --steps 3000", "--", "--metrics", "peer-{index}.jsonl"], capsys)
    assert rc == 0
    lines = out.splitlines()
    assert lines[0] == "coordinator at 10.1.0.1:29400; 2 peers; working directory: /scratch/run"
    assert lines[1] == ("coordinator on head: ssh head gossiptrain launch-agent  <<< "
                        "gossiptrain coordinator --bind 10.1.0.1:29400 --workload digits --steps 3000")
    assert lines[3] == ("peer 1 on alice@node1: ssh alice@node1 gossiptrain launch-agent  <<< "
                        "gossiptrain peer --join 10.1.0.1:29400 --metrics peer-1.jsonl")
    assert len(lines) == 4


def test_dry_run_needs_no_name_service(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    hosts = hostfile(tmp_path, "head.invalid slots=0\nnode.invalid address=10.0.0.3\n")  # .invalid never resolves
    rc, out, _ = run_main(["launch", "--hosts", hosts, "--dry-run"], capsys)
    assert rc == 0, out
    assert out.startswith("coordinator at head.invalid:29400; 1 peers")
    assert "gossiptrain peer --join head.invalid:29400 --advertise 10.0.0.3" in out


def test_the_coordinator_address_flag_wins_over_the_hostfile(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    hosts = hostfile(tmp_path, "head address=10.1.0.1\n")
    rc, out, _ = run_main(["launch", "--hosts", hosts, "--dry-run", "--coordinator-address", "fd00::1", "--port", "7070"], capsys)
    assert rc == 0 and out.startswith("coordinator at [fd00::1]:7070; 1 peers")


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--ssh", "ssh somewhere"], "--ssh 'ssh somewhere' must contain {host}"),
        (["--ssh", "ssh {hots}"], "unknown placeholder {hots}"),
        (["--port", "70000"], "--port must be in 0-65535, got 70000"),
        (["--grace", "0"], "--grace must be > 0 seconds, got 0.0"),
        (["--env", "1X=2"], "--env '1X=2' must look like NAME=VALUE"),
        (["--remote-command", ""], "--remote-command must not be empty"),
        (["--coordinator-args", "--stepz 3"], "--coordinator-args: `gossiptrain coordinator` does not take --stepz 3"),
        (["--", "--shard", "{index}x"], "the peer arguments after --: argument --shard: must be a shard index, got '0x'"),
        (["--", "--metrics", "{rank}"], "peer arguments: unknown placeholder {rank}"),
        (["--coordinator-host", "no-such-host.invalid"], "cannot resolve the coordinator's host 'no-such-host.invalid' here"),
        (["--coordinator-args", "--bind 0.0.0.0:1"], "--coordinator-args: --bind is the launcher's to set (it follows from "
                                                     "--coordinator-address and --port)"),
        (["--", "--join", "elsewhere:1"], "the peer arguments after --: --join is the launcher's to set"),
        (["--coordinator-address", "no-such-host.invalid"], "cannot resolve the coordinator's host 'no-such-host.invalid'"),
    ],
)
def test_bad_input_exits_2_naming_it_before_any_host_is_reached(
    argv: list[str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    hosts = hostfile(tmp_path, "127.0.0.1\n")
    rc, out, err = run_main(["launch", "--hosts", hosts, "--ssh", "false {host}", *argv], capsys)  # a later --ssh wins
    assert rc == 2, err
    assert message in err, err
    assert "started" not in out


def test_a_malformed_hostfile_line_is_named_by_file_and_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    hosts = hostfile(tmp_path, "# cluster\nnode1\nnode2 slots=four\n")
    rc, _, err = run_main(["launch", "--hosts", hosts], capsys)
    assert rc == 2
    assert f"gossiptrain launch: error: {hosts}:3: 'slots=four': slots must be a whole number >= 0" in err


def test_every_launch_flag_that_takes_a_value_shows_its_default() -> None:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    launch = sub.choices["launch"]
    missing = [a.option_strings[0] for a in launch._actions
               if a.option_strings and a.nargs != 0 and not re.search(r"\bdefault\b|\brequired\b", a.help or "")]
    assert not missing
    assert "launch-agent" not in build_parser().format_help()  # the agent is the launcher's own business


def test_a_peer_joins_gossiptrain_join_when_no_flag_is_given(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GOSSIPTRAIN_JOIN", "10.0.0.1:29400")
    assert build_parser().parse_args(["peer"]).join == "10.0.0.1:29400"
    assert build_parser().parse_args(["peer", "--join", "h:1"]).join == "h:1"  # the flag wins
    monkeypatch.delenv("GOSSIPTRAIN_JOIN")
    with pytest.raises(SystemExit):
        build_parser().parse_args(["peer"])  # required without it


# ---------------------------------------------------------------- the agent


class Agent:
    """`gossiptrain launch-agent` with a pipe on its input, as the launcher runs it."""

    def __init__(self, request: AgentRequest) -> None:
        self.popen = subprocess.Popen([sys.executable, "-m", "gossiptrain", "launch-agent"], stdin=subprocess.PIPE,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=ROOT)
        assert self.popen.stdin is not None
        self.popen.stdin.write(request.encode())
        self.popen.stdin.flush()

    def lines_until(self, *wanted: str, timeout: float = 30) -> list[str]:
        """Its output lines, up to where each of ``wanted`` has been in one (in any order)."""
        assert self.popen.stdout is not None
        seen: list[str] = []
        deadline = time.monotonic() + timeout
        while not all(any(w in s for s in seen) for w in wanted):
            left = deadline - time.monotonic()
            assert left > 0 and select.select([self.popen.stdout], [], [], left)[0], f"no {wanted!r} in {seen}"
            line = self.popen.stdout.readline()
            assert line, f"the agent ended first: {seen} {self.popen.stderr.read() if self.popen.stderr else ''}"
            seen.append(line.decode().rstrip("\n"))
        return seen

    def child_pid(self) -> int:
        """The command's pid, as the agent reports it, once the command says it is ready."""
        return next(p for p in map(parse_report, self.lines_until("started pid", "ready")) if p is not None)

    def send(self, data: bytes) -> None:
        assert self.popen.stdin is not None
        self.popen.stdin.write(data)
        self.popen.stdin.flush()

    def close(self) -> None:
        if self.popen.poll() is None:
            self.popen.kill()
        self.popen.wait()
        for stream in (self.popen.stdin, self.popen.stdout, self.popen.stderr):
            if stream is not None:
                stream.close()


def sleeper(on_int: int | None = None, ignore_term: bool = False) -> list[str]:
    code = ["import signal, sys, time"]
    if on_int is not None:
        code.append(f"signal.signal(signal.SIGINT, lambda *a: sys.exit({on_int}))")
    if ignore_term:
        code.append("signal.signal(signal.SIGTERM, signal.SIG_IGN)")
    code += ["print('ready', flush=True)", "time.sleep(120)"]
    return [sys.executable, "-c", "; ".join(code)]


def gone(pid: int, timeout: float) -> bool:
    """Whether ``pid`` ends (or is a zombie nobody reaped yet) within ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (FileNotFoundError, ProcessLookupError):
            return True
        if state == "Z":
            return True
        time.sleep(0.05)
    return False


def test_the_agent_passes_a_signal_line_on_and_exits_with_the_commands_status() -> None:
    agent = Agent(AgentRequest(sleeper(on_int=7)))
    try:
        agent.child_pid()
        agent.send(control_line("INT"))
        assert agent.popen.wait(30) == 7
    finally:
        agent.close()


def test_the_end_of_its_input_terminates_the_command_then_kills_it_after_the_grace() -> None:
    agent = Agent(AgentRequest(sleeper()))
    try:
        agent.child_pid()
        agent.popen.stdin.close()  # type: ignore[union-attr]  # the launcher (or its ssh) is gone
        assert agent.popen.wait(30) == 128 + signal.SIGTERM
    finally:
        agent.close()
    stubborn = Agent(AgentRequest(sleeper(ignore_term=True), grace=0.5))
    try:
        stubborn.child_pid()
        stubborn.popen.stdin.close()  # type: ignore[union-attr]
        assert stubborn.popen.wait(30) == 128 + signal.SIGKILL
    finally:
        stubborn.close()


@pytest.mark.skipif(sys.platform != "linux", reason="PR_SET_PDEATHSIG is Linux's")
def test_a_killed_agent_takes_its_command_with_it() -> None:
    agent = Agent(AgentRequest(sleeper()))
    try:
        pid = agent.child_pid()
        agent.popen.send_signal(signal.SIGKILL)
        assert gone(pid, 30), f"the command {pid} outlived its agent"
    finally:
        agent.close()


def test_the_agent_runs_gossiptrain_with_its_own_interpreter() -> None:
    # The launcher's requests are gossiptrain's arguments: the agent runs them with the python the remote command
    # found (a ~/venv path the remote shell expanded would mean nothing to a plain exec).
    # (Its input stays open: its end would stop the command.)
    agent = Agent(AgentRequest(["topology", "ring", "--peers", "4"], gossiptrain=True))
    try:
        assert any(line.startswith("spectral gap") for line in agent.lines_until("started pid", "spectral gap"))
        assert agent.popen.wait(30) == 0
    finally:
        agent.close()


def test_the_agent_names_what_it_cannot_start(tmp_path: Path) -> None:
    for request, code, message in [
        (AgentRequest(["no-such-command-here"]), 127, "cannot start 'no-such-command-here'"),
        (AgentRequest(["true"], cwd=str(tmp_path / "missing")), 127, f"in {tmp_path / 'missing'}"),
    ]:
        done = subprocess.run([sys.executable, "-m", "gossiptrain", "launch-agent"], input=request.encode(),
                              capture_output=True, timeout=60, cwd=ROOT)
        assert done.returncode == code and message in done.stderr.decode(), done
    done = subprocess.run([sys.executable, "-m", "gossiptrain", "launch-agent"], input=b"hello\n", capture_output=True,
                          timeout=60, cwd=ROOT)
    assert done.returncode == 2 and b"not JSON" in done.stderr and b"gossiptrain launch" in done.stderr


# ---------------------------------------------------------------- real launches on loopback


@pytest.mark.slow  # 5 s: `make test-slow`; the launcher's reports are unit-tested in test_launch_plan.py
def test_a_failing_peer_is_named_and_the_launch_exits_1(tmp_path: Path) -> None:
    hosts = [next_host() for _ in range(3)]
    path = hostfile(tmp_path, f"{hosts[0]} slots=0\n{hosts[1]}\n{hosts[2]}\n")
    started = time.monotonic()
    done = run_in_session(
        [sys.executable, "-m", "gossiptrain", "launch", "--hosts", path, "--ssh", LOCAL, "--remote-command", REMOTE,
         "--port", "0", "--workdir", str(tmp_path), "--coordinator-args", "--workload digits-small --shards 1 --steps 30",
         "--", "--bind", "{host}:0", "--quiet", "--shard", "{index}", "--metrics", "peer-{index}.jsonl"],
        120, "gossiptrain launch",
    )
    took = time.monotonic() - started
    assert done.returncode == 1, done.stdout + done.stderr
    assert re.search(rf"^launch: started coordinator on {hosts[0]}: pid \d+ there$", done.stdout, re.M), done.stdout
    assert re.search(rf"^launch: started peer 0 on {hosts[1]}: pid \d+ there$", done.stdout, re.M), done.stdout
    assert re.search(rf"^{re.escape(hosts[0])}: join with: gossiptrain peer --join {re.escape(hosts[0])}:\d+$", done.stdout, re.M)
    # shard 1 does not exist in a 1-shard swarm: peer 1 is refused, named with the reason, the other one trains on
    assert re.search(rf"^launch: peer 1 on {re.escape(hosts[2])} failed with exit status 2: .*shard 1 does not exist",
                     done.stderr, re.M), done.stderr
    assert re.search(rf"^launch: failed: peer 1 on {re.escape(hosts[2])}$", done.stderr, re.M), done.stderr  # and only it
    assert read_metrics(tmp_path / "peer-0.jsonl")[-1]["event"] == "done"
    assert took < 100


@pytest.mark.skipif(shutil.which("ssh") is None, reason="needs the ssh client")
def test_an_unreachable_host_is_named_with_the_ssh_error(tmp_path: Path) -> None:
    path = hostfile(tmp_path, "127.0.0.1\n")
    done = run_in_session(
        [sys.executable, "-m", "gossiptrain", "launch", "--hosts", path,
         "--ssh", "ssh -o BatchMode=yes -o ConnectTimeout=5 -p 1 {host}"],  # nothing listens on port 1
        60, "gossiptrain launch",
    )
    assert done.returncode == 1, done.stdout + done.stderr
    assert re.search(r"^launch: coordinator on 127\.0\.0\.1 did not start \(exit status 255\): ssh: connect to host "
                     r"127\.0\.0\.1 port 1: Connection refused$", done.stderr, re.M), done.stderr
    assert "launch: no peer started: coordinator on 127.0.0.1 ended first" in done.stderr
    assert done.stderr.strip().splitlines()[-1] == "launch: failed: coordinator on 127.0.0.1"
    # its own words, prefixed with the host (and which process, since the host runs a peer too) as they came
    assert "127.0.0.1/coordinator: ssh: connect to host" in done.stderr
    assert "Traceback" not in done.stderr


# ---------------------------------------------------------------- real ssh, where an sshd is installed


@pytest.fixture
def sshd(tmp_path: Path) -> Iterator[str]:
    """An sshd of this test's own on 127.0.0.1 (its own keys and config; root only): the ``--ssh`` template to reach it."""
    if os.geteuid() != 0 or not Path("/usr/sbin/sshd").exists() or shutil.which("ssh") is None or not shutil.which("ssh-keygen"):
        pytest.skip("needs root, the ssh client and an installed sshd (Debian: openssh-server)")
    keys = tmp_path / "ssh"
    keys.mkdir()
    for name in ("host", "user"):
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(keys / name)], check=True, timeout=30)
    (keys / "authorized_keys").write_text((keys / "user.pub").read_text())
    port = free_loopback_port()  # released for sshd (sshd cannot listen on port 0 and say which it got)
    (keys / "sshd_config").write_text(
        f"Port {port}\nListenAddress 127.0.0.1\nHostKey {keys / 'host'}\nAuthorizedKeysFile {keys / 'authorized_keys'}\n"
        f"PermitRootLogin prohibit-password\nPasswordAuthentication no\nStrictModes no\nUsePAM no\nPidFile {keys / 'pid'}\n"
    )
    Path("/run/sshd").mkdir(exist_ok=True)  # its privilege separation directory
    daemon = subprocess.Popen(["/usr/sbin/sshd", "-D", "-f", str(keys / "sshd_config"), "-E", str(keys / "log")])
    try:
        def listening() -> bool:
            with socket.socket() as c:
                return c.connect_ex(("127.0.0.1", port)) == 0

        wait_for(listening, 15, "sshd to listen", state=lambda: (keys / "log").read_text() if (keys / "log").exists() else "")
        yield (f"ssh -o BatchMode=yes -o StrictHostKeyChecking=no -o UserKnownHostsFile=/dev/null -o LogLevel=ERROR "
               f"-i {keys / 'user'} -p {port} {{host}}")
    finally:
        daemon.terminate()
        daemon.wait(10)


@pytest.mark.slow  # the same launch path runs in the default run across namespaces (test_launch_netns.py); 8 s
def test_over_real_ssh_a_peer_trains_and_a_killed_launcher_leaves_nothing_running(sshd: str, tmp_path: Path) -> None:
    path = hostfile(tmp_path, f"127.0.0.1 slots=0\n{getpass.getuser()}@127.0.0.1\n")
    argv = [sys.executable, "-m", "gossiptrain", "launch", "--hosts", path, "--ssh", sshd, "--remote-command", REMOTE,
            "--port", "0", "--workdir", str(tmp_path)]
    done = run_in_session([*argv, "--coordinator-args", "--workload digits-small --steps 30", "--", "--quiet",
                           "--metrics", "peer.jsonl"], 120, "gossiptrain launch over ssh")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "launch: the one peer finished" in done.stdout
    assert read_metrics(tmp_path / "peer.jsonl")[-1]["step"] == 30
    # SIGKILL: nothing is passed on. The ssh client sees its input end and closes the session; the agent on the
    # other side sees its own input end and ends its peer.
    with open(tmp_path / "launch.out", "w") as out:
        launcher = subprocess.Popen([*argv, "--coordinator-args", "--workload digits-small --steps 0 --seconds 120"],
                                    stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            started = wait_for(lambda: re.findall(r"started peer 0 on \S+: pid (\d+) there", (tmp_path / "launch.out").read_text()),
                               60, "the peer to start", state=lambda: (tmp_path / "launch.out").read_text()[-2000:])
            os.kill(launcher.pid, signal.SIGKILL)
            launcher.wait(10)
            assert gone(int(started[0]), 30), "the remote peer outlived its launcher"
        finally:
            if launcher.poll() is None:
                os.killpg(launcher.pid, signal.SIGKILL)
                launcher.wait()
