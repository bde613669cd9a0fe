"""What a first-time user hits on the command line: help that shows defaults, bad values, joins that cannot work, Ctrl+C.

In-process (``main([...])``, ``build_parser()``) and bounded: nothing here
trains, and a join is at most a few seconds against a loopback address.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest

import gossiptrain.train.peer_loop as peer_loop
from gossiptrain.cli.common import EXIT_INTERRUPTED, EXIT_USAGE
from gossiptrain.cli.main import build_parser, main
from gossiptrain.config import Limits
from gossiptrain.errors import ConfigError, JoinError, MismatchError
from gossiptrain.net.kinds import REFUSE
from gossiptrain.net.transport import Transport, listen
from gossiptrain.net.wire import Message, decode, encode
from gossiptrain.protocol.joining import JoinRequest
from gossiptrain.runtime.clock import REAL_CLOCK
from gossiptrain.runtime.join_client import join_swarm
from gossiptrain.train.metrics import MetricsLog

from .swarm import ROOT, next_host, run_forked, run_in_session


def run_main(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    """main's exit status (argparse's own errors included) and what it wrote to stderr."""
    try:
        rc = main(argv)
    except SystemExit as e:
        rc = int(e.code or 0)
    return rc, capsys.readouterr().err


def subcommand(parser: argparse.ArgumentParser, *names: str) -> argparse.ArgumentParser:
    for name in names:
        sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        parser = sub.choices[name]
    return parser


def closed_port(host: str) -> int:
    """A port nothing listens on (bound once, then released)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


@pytest.fixture(autouse=True)
def restore_signal_handlers() -> Iterator[None]:
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)


# ---------------------------------------------------------------- --help shows every default


@pytest.mark.parametrize("command", [("coordinator",), ("peer",), ("demo",), ("topology",), ("keys", "new"), ("simulate",)])
def test_every_flag_that_takes_a_value_shows_its_default(command: tuple[str, ...]) -> None:
    from gossiptrain.cli.main import _RUN_FLAGS

    parser = subcommand(build_parser(), *command)
    missing = []
    for action in parser._actions:
        if not action.option_strings or isinstance(action, argparse._HelpAction):
            continue
        if command == ("simulate",) and action.option_strings[0] not in _RUN_FLAGS:
            continue  # simulate's own flags are its module's; the run flags come from the shared helper
        text = action.help or ""
        if not text:
            missing.append(f"{action.option_strings[0]}: no description")
        elif action.nargs != 0 and not action.required and not re.search(r"\bdefault\b|\brequired\b", text):
            missing.append(f"{action.option_strings[0]}: {text!r}")
    assert not missing, "\n".join(missing)


def test_budget_flags_say_what_a_budget_given_alone_means() -> None:
    text = subcommand(build_parser(), "coordinator").format_help()
    steps = re.search(r"--steps INT\s+(.*?)\n  --", text, re.S)
    assert steps and "default 2000, or 0 when only a time budget is given" in " ".join(steps.group(1).split())


def test_topology_usage_says_peers_is_required() -> None:
    parser = subcommand(build_parser(), "topology")
    usage = " ".join(parser.format_usage().split())
    assert "NAME[:PARAMS] --peers N" in usage, usage  # not [--peers N]: `topology ring` needs it
    assert "file:path=FILE [--peers N]" in usage, usage
    peers = next(a for a in parser._actions if "--peers" in a.option_strings)
    assert "required" in (peers.help or "")


# ---------------------------------------------------------------- bad values: exit 2, the value named


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["peer", "--join", "127.0.0.1:1", "--shard", "-1"], "argument --shard: must be a shard index (>= 0), got -1"),
        (["peer", "--join", "127.0.0.1:1", "--shard", "two"], "argument --shard: must be a shard index, got 'two'"),
        (["peer", "--join", "127.0.0.1:1", "--join-attempts", "0"], "argument --join-attempts: must be a number of attempts (>= 1), got 0"),
        (["demo", "--peers", "0"], "argument --peers: must be a number of peers (>= 1), got 0"),
        (["simulate", "--peers", "0"], "argument --peers: must be a number of peers (>= 1), got 0"),  # was train.shards
        (["demo", "--target", "1.5"], "argument --target: must be an accuracy in (0, 1], got 1.5"),
        (["demo", "--timeout", "-5"], "argument --timeout: must be a positive number of seconds, got -5"),
        (["peer", "--join", "127.0.0.1:99999"], "--join '127.0.0.1:99999': port 99999 is out of range (0-65535)"),
        (["peer", "--join", "127.0.0.1:1", "--bind", "127.0.0.1:70000"], "--bind '127.0.0.1:70000': port 70000 is out of range"),
        (["coordinator", "--bind", "127.0.0.1:65536"], "--bind '127.0.0.1:65536': port 65536 is out of range (0-65535)"),
        (["peer", "--join", "nowhere"], "--join 'nowhere' must look like HOST:PORT"),
    ],
)
def test_bad_values_exit_2_naming_the_value(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    rc, err = run_main(argv, capsys)
    assert rc == EXIT_USAGE, err
    assert message in err and "Traceback" not in err, err


def test_a_config_file_that_is_not_utf8_is_one_line_and_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "run.toml"
    bad.write_bytes(b"[train]\nworkload = \"d\xefgits\"\n")  # Latin-1, as an editor may save it
    rc, err = run_main(["coordinator", "--bind", f"{next_host()}:0", "--config", str(bad)], capsys)
    assert rc == EXIT_USAGE, err  # was a UnicodeDecodeError traceback, exit 1
    assert err.splitlines() == [f"gossiptrain coordinator: error: configuration file {bad} is not UTF-8 text (byte 21: b'\\xef')"]


def test_a_checkpoint_dir_that_is_a_file_is_one_clear_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    afile = tmp_path / "afile"
    afile.write_text("not a directory")
    for given, message in [
        (afile, f"--checkpoint-dir '{afile}' is a file, not a directory: name a directory (created if missing)"),
        (afile / "sub", f"--checkpoint-dir '{afile / 'sub'}' cannot be created: {afile} is a file, not a directory"),
    ]:  # was "cannot use checkpoint directory ...: File exists" (or "Not a directory")
        host = next_host()
        rc, err = run_main(["peer", "--join", f"{host}:{closed_port(host)}", "--checkpoint-dir", str(given)], capsys)
        assert rc == EXIT_USAGE and err.splitlines() == [f"gossiptrain peer: error: {message}"], err
    assert afile.read_text() == "not a directory"


def test_export_to_a_folder_is_refused_before_anything_is_asked(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    host = next_host()
    join = f"{host}:{closed_port(host)}"  # nothing listens: a check that came after asking the swarm would say so instead
    rc, err = run_main(["export", "--join", join, "--out", str(tmp_path)], capsys)
    assert rc == EXIT_USAGE and err.splitlines() == [
        f"gossiptrain export: error: --out '{tmp_path}' is a directory: name a file, e.g. {tmp_path / 'model.safetensors'}"
    ], err  # was: every member's state downloaded, then "could not write the merged model"
    (tmp_path / "afile").write_text("")
    rc, err = run_main(["export", "--join", join, "--out", str(tmp_path / "m.safetensors"), "--members-dir",
                        str(tmp_path / "afile")], capsys)
    assert rc == EXIT_USAGE and "--members-dir" in err and "is a file, not a directory" in err, err


def test_version_is_the_package_version(capsys: pytest.CaptureFixture[str]) -> None:
    import tomllib

    import gossiptrain

    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert capsys.readouterr().out == f"gossiptrain {gossiptrain.__version__}\n" and gossiptrain.__version__ == version


def test_what_the_flags_show_wrong_is_refused_before_torch_is_imported(tmp_path: Path) -> None:
    calls = [
        ["peer", "--join", "nowhere"],
        ["peer", "--join", "127.0.0.1:99999"],
        ["peer", "--join", "127.0.0.1:1", "--metrics", str(tmp_path)],
        ["peer", "--join", "127.0.0.1:1", "--lr", "-1"],
        ["coordinator", "--bind", "127.0.0.1:99999"],
    ]
    code = (
        "import sys, time; from gossiptrain.cli.main import main; t = time.monotonic(); "
        f"rcs = [main(a) for a in {calls!r}]; print(rcs, 'torch' in sys.modules)"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env, cwd=tmp_path)
    assert result.stdout.strip() == "[2, 2, 2, 2, 2] False", result.stdout + result.stderr


# ---------------------------------------------------------------- --metrics that cannot be written


def test_metrics_given_a_directory_exits_2_naming_it(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc, err = run_main(["peer", "--join", "127.0.0.1:1", "--quiet", "--metrics", str(tmp_path)], capsys)
    assert rc == EXIT_USAGE, err
    assert f"--metrics {str(tmp_path)!r} is a directory: name a file, e.g. {tmp_path / 'peer.jsonl'}" in err, err
    assert "Traceback" not in err and err.count("\n") == 1, err


def test_metrics_under_a_file_exits_2_naming_it(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "notes.txt").write_text("a file, not a directory\n")
    target = tmp_path / "notes.txt" / "peer.jsonl"
    rc, err = run_main(["peer", "--join", "127.0.0.1:1", "--quiet", "--metrics", str(target)], capsys)
    assert rc == EXIT_USAGE, err
    assert f"--metrics {str(target)!r} cannot be written: {tmp_path / 'notes.txt'} is a file" in err, err


def test_metrics_log_creates_missing_directories_and_names_a_path_it_cannot_write(tmp_path: Path) -> None:
    nested = tmp_path / "new" / "runs" / "peer.jsonl"
    with MetricsLog(nested) as metrics:  # what the CLI has always promised: missing directories are created
        metrics.write({"event": "start"})
    assert nested.read_text() == '{"event":"start"}\n'
    with pytest.raises(ConfigError, match=re.escape(f"metrics file {str(tmp_path)!r} is a directory")):
        MetricsLog(tmp_path)


# ---------------------------------------------------------------- joining: refused fast, starting and slow members kept


async def started(host: str, port: int = 0) -> Transport:
    transport = listen(f"tcp://{host}:{port}", Limits())
    await transport.start()
    return transport


async def answer_join(member: Transport, after: float, reason: str) -> None:
    """Receive one join and refuse it after ``after`` seconds: the simplest answer a member can give."""
    msg = decode(await member.recv(), member.limits)
    await asyncio.sleep(after)
    member.send(msg.addr, encode(Message(REFUSE, sender="m", addr=member.address, fingerprint="", body={"reason": reason}), member.limits))


async def join(newcomer: Transport, target: str, attempts: int, attempt_timeout: float = 2.0) -> None:
    await join_swarm(
        newcomer, target, JoinRequest(config=None, spec=None, shard=-1), advertise=newcomer.address, limits=newcomer.limits,
        clock=REAL_CLOCK, attempts=attempts, attempt_timeout=attempt_timeout, rng=random.Random(0),
    )


def run_join(scenario: Callable[[Transport], Any]) -> None:
    async def main() -> None:
        newcomer = await started(next_host())
        try:
            await asyncio.wait_for(scenario(newcomer), 8)  # bounded: an answer that never comes fails the test
        finally:
            await newcomer.close()

    asyncio.run(main())


JOIN_COMMANDS = {  # every subcommand that takes --join, with what else it needs to start
    "peer": [], "status": [], "export": ["--out", "OUT/m.safetensors"], "stop": [], "dashboard": ["--listen", "127.0.0.1:0"],
}


@pytest.mark.parametrize("command", sorted(JOIN_COMMANDS))
def test_a_join_host_that_cannot_be_resolved_is_one_line_and_exit_2(command: str, tmp_path: Path) -> None:
    extra = [a.replace("OUT", str(tmp_path)) for a in JOIN_COMMANDS[command]]
    argv = [sys.executable, "-m", "gossiptrain", command, "--join", "nosuchhost.invalid:7070", *extra]
    done = run_in_session(argv, 30, f"gossiptrain {command}")  # the dashboard served a dead page until killed
    assert done.returncode == EXIT_USAGE, done.stderr
    assert done.stderr.splitlines() == [
        f"gossiptrain {command}: error: cannot resolve join host 'nosuchhost.invalid': {done.stderr.split(': ')[-1].strip()}"
    ], done.stderr
    assert not list(tmp_path.iterdir())


def test_a_dashboard_that_cannot_poll_at_all_exits_2_with_one_line(tmp_path: Path) -> None:
    host = next_host()
    argv = ["dashboard", "--join", f"{host}:{closed_port(host)}",
            "--advertise", "192.0.2.1", "--listen", f"{host}:0"]  # TEST-NET-1: no address of this machine
    # Forked from the test fork server (tests/zygote.py): the command's failure, not its interpreter's start.
    done = run_forked(argv, 30, "gossiptrain dashboard", tmp_path)  # a traceback, then a dead page until killed
    assert done.returncode == EXIT_USAGE, done.stderr
    lines = done.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("gossiptrain dashboard: error: cannot listen on tcp://192.0.2.1:0"), lines


def test_a_join_where_nothing_listens_fails_fast() -> None:
    host = next_host()
    port = closed_port(host)

    async def scenario(newcomer: Transport) -> None:
        began = time.monotonic()
        with pytest.raises(JoinError) as failed:
            await join(newcomer, f"tcp://{host}:{port}", attempts=5)
        took = time.monotonic() - began
        assert f"cannot join tcp://{host}:{port}: connection refused, nothing listens there (5 attempts over" in str(failed.value)
        assert took < 4.0, took  # 5 attempts of 2+ s each took 12-15 s

    run_join(scenario)


def test_a_member_still_starting_up_is_joined() -> None:
    host = next_host()
    port = closed_port(host)

    async def scenario(newcomer: Transport) -> None:
        async def start_late() -> Transport:
            await asyncio.sleep(1.0)
            return await started(host, port)

        late = asyncio.create_task(start_late())
        try:
            with pytest.raises(MismatchError, match="refused us: hello from a late starter"):
                joining = asyncio.create_task(join(newcomer, f"tcp://{host}:{port}", attempts=5))
                member = await late
                await answer_join(member, 0.0, "hello from a late starter")
                await joining
        finally:
            if late.done() and not late.cancelled():
                await late.result().close()

    run_join(scenario)


def test_a_reachable_but_slow_member_gets_the_whole_attempt() -> None:
    async def scenario(newcomer: Transport) -> None:
        member = await started(next_host())
        try:
            answering = asyncio.create_task(answer_join(member, 1.0, "slow, but here"))  # well after a look at its port
            with pytest.raises(MismatchError, match="refused us: slow, but here"):
                await join(newcomer, member.address, attempts=1)
            await answering
        finally:
            await member.close()

    run_join(scenario)


def test_one_attempt_is_one_attempt_in_the_message() -> None:
    async def scenario(newcomer: Transport) -> None:
        silent = await started(next_host())  # listens, never answers
        try:
            with pytest.raises(JoinError, match=re.escape(f"no answer from {silent.address} after 1 attempt of 0.5+ s each.")):
                await join(newcomer, silent.address, attempts=1, attempt_timeout=0.5)
        finally:
            await silent.close()

    run_join(scenario)


# ---------------------------------------------------------------- Ctrl+C: 130, as everywhere; SIGTERM: 0


def fake_peer(monkeypatch: pytest.MonkeyPatch, sig: signal.Signals, joined: bool = True) -> list[bool]:
    """run_peer without a swarm: join (or not), get ``sig`` while training, stop when told; whether it was told."""
    stopped: list[bool] = []

    def run_peer(options: Any, stop: threading.Event, on_training: Callable[[], None]) -> dict[str, Any]:
        if joined:
            on_training()
        signal.raise_signal(sig)
        stopped.append(stop.wait(5))
        return {"event": "done", "finish": "signal"}

    monkeypatch.setattr(peer_loop, "run_peer", run_peer)
    return stopped


def test_ctrl_c_stops_a_training_peer_gracefully_with_status_130(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    stopped = fake_peer(monkeypatch, signal.SIGINT)
    rc, err = run_main(["peer", "--join", "127.0.0.1:1", "--quiet", "--json"], capsys)
    assert stopped == [True], "Ctrl+C must stop training gracefully (leave, write the summary), not abort it"
    assert rc == EXIT_INTERRUPTED, err


def test_sigterm_stops_a_training_peer_with_status_0(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    stopped = fake_peer(monkeypatch, signal.SIGTERM)
    rc, err = run_main(["peer", "--join", "127.0.0.1:1", "--quiet"], capsys)
    assert stopped == [True] and rc == 0, err


def test_ctrl_c_during_the_join_aborts_with_130(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    fake_peer(monkeypatch, signal.SIGINT, joined=False)
    rc, err = run_main(["peer", "--join", "127.0.0.1:1", "--quiet"], capsys)
    assert rc == EXIT_INTERRUPTED and "interrupted" in err, err


def test_the_peer_command_puts_the_signal_handlers_back(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    before = signal.getsignal(signal.SIGINT)
    fake_peer(monkeypatch, signal.SIGTERM)
    run_main(["peer", "--join", "127.0.0.1:1", "--quiet"], capsys)
    assert signal.getsignal(signal.SIGINT) is before
