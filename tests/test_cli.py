"""The command line as a user meets it: bad input, the demo, and the README's API example."""

from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import gossiptrain
from gossiptrain.errors import MismatchError
from gossiptrain.net.addressing import free_loopback_port
from peers.digits import DigitsWorkload

from .conftest import fast_config
from .swarm import ROOT, Procs, next_host, run_forked, run_in_session, wait_for


def run_cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    """``gossiptrain ARGS`` in its own session: whatever it started (the demo's peers) dies with it."""
    return run_in_session([sys.executable, "-m", "gossiptrain", *args], timeout, f"gossiptrain {' '.join(args)}")


@pytest.mark.parametrize(
    "args, field",
    [
        (["--topology", "moebius"], "gossip.topology"),
        (["--lr", "-1"], "train.lr"),
        (["--batch-size", "0"], "train.batch_size"),
        (["--set", "train.lrr=0.1"], "train.lrr"),
        (["--set", "membership.indirect_probes=many"], "membership.indirect_probes"),
        (["--algorithm", "allreduce"], "gossip.algorithm"),
        (["--workload", "no_such_module:Workload"], "train.workload"),
    ],
)
def test_invalid_configuration_fails_at_start_naming_the_field(args: list[str], field: str, tmp_path: Path) -> None:
    # Forked from the process that imported torch already (tests/zygote.py): the checks, not the imports.
    result = run_forked(["coordinator", "--bind", f"{next_host()}:0", *args], 60, "gossiptrain coordinator", tmp_path)
    assert result.returncode == 2, result
    assert field in result.stderr, result.stderr
    assert "Traceback" not in result.stderr


def test_invalid_toml_file_is_named(tmp_path: Path) -> None:
    bad = tmp_path / "run.toml"
    bad.write_text("[train]\nlr = -0.5\n")
    result = run_cli("coordinator", "--bind", f"{next_host()}:0", "--config", str(bad))
    assert result.returncode == 2 and "train.lr" in result.stderr, result.stderr


def test_unreachable_join_address_gives_up_with_a_clear_message(tmp_path: Path) -> None:
    host = next_host()
    with socket.socket() as s:  # bound but not listening: connections are refused, and nobody can take the port
        s.bind((host, 0))
        port = s.getsockname()[1]
        result = run_forked(["peer", "--join", f"{host}:{port}", "--join-attempts", "2", "--bind", f"{next_host()}:0"], 60,
                            "gossiptrain peer", tmp_path)
    assert result.returncode == 2, result
    assert f"cannot join tcp://{host}:{port}: connection refused, nothing listens there (2 attempts over" in result.stderr, result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize(
    ("flags", "budget"),
    [
        (["--seconds", "150"], (0, 150.0)),  # a time budget alone: no step budget cuts it short
        (["--set", "train.max_seconds=150"], (0, 150.0)),
        (["--steps", "300"], (300, 0.0)),
        (["--seconds", "150", "--steps", "300"], (300, 150.0)),  # both given: whichever comes first
        ([], (2000, 0.0)),  # neither: the defaults
    ],
)
def test_the_coordinator_runs_exactly_the_budget_given(
    flags: list[str], budget: tuple[int, float], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    import gossiptrain.runtime.coordinator_process as coordinator_process
    from gossiptrain.cli.main import main

    served: list[gossiptrain.RunConfig] = []
    monkeypatch.setattr(coordinator_process, "run_coordinator_forever", lambda config, *rest, **options: served.append(config))
    assert main(["coordinator", "--bind", "127.0.0.1:0", *flags]) == 0
    expected = [budget]
    if not flags:  # and a file that gives only a time budget
        toml = tmp_path / "run.toml"
        toml.write_text("[train]\nmax_seconds = 150.0\n")
        assert main(["coordinator", "--bind", "127.0.0.1:0", "--config", str(toml)]) == 0
        expected.append((0, 150.0))
    assert [(c.train.max_steps, c.train.max_seconds) for c in served] == expected


NO_BUDGET = "no budget (train.max_steps and train.max_seconds are 0): the peers train until `gossiptrain stop`"
PYTHON_HINT = ('join with: gossiptrain.Peer(model, join="{join}") in your own training loop '
               "(--workload external: peers bring their own model, `gossiptrain peer` has none)")


@pytest.mark.parametrize(
    ("flags", "says"),
    [
        (["--seconds", "0"], [NO_BUDGET, "join with: gossiptrain peer --join {join}"]),  # was silent, unbounded
        (["--workload", "external", "--shards", "2"], [PYTHON_HINT]),  # was a `gossiptrain peer` hint that then failed
    ],
)
def test_the_coordinator_says_what_a_run_without_budget_or_model_means(flags: list[str], says: list[str],
                                                                      procs: Procs) -> None:
    host = next_host()
    coordinator = procs.start("coordinator", "--bind", f"{host}:0", *flags, name="coord")
    out = procs.wait_for(lambda: "join with:" in coordinator.output() and coordinator.output(), 30, "the coordinator")
    join = re.search(rf"listening on tcp://({re.escape(host)}:\d+) ", out).group(1)  # type: ignore[union-attr]
    lines = out.splitlines()
    assert lines[-len(says):] == [line.format(join=join) for line in says], out


def test_malformed_join_address_is_rejected() -> None:
    result = run_cli("peer", "--join", "nowhere")
    assert result.returncode == 2 and "HOST:PORT" in result.stderr, result.stderr


def test_a_different_run_or_model_is_refused_with_the_difference_named(coordinator_factory: Any, procs: Procs) -> None:
    coord = coordinator_factory(fast_config(**{"train.shards": 2, "train.max_steps": 0, "train.max_seconds": 60}))
    join = coord.address.removeprefix("tcp://")
    other_run = fast_config(**{"train.shards": 2, "train.lr": 0.2})
    with pytest.raises(MismatchError, match=r"train\.lr: 0\.2 vs 0\.05"):
        gossiptrain.Peer(torch.nn.Linear(64, 10), join=join, bind=f"{next_host()}:0", config=other_run)
    # The coordinator learns the swarm's model from the first peer's report, then refuses other shapes.
    first = procs.peer(join)
    wait_for(lambda: coord.coordinator.spec is not None, 60, "the coordinator to learn the model")
    narrower = DigitsWorkload(hidden=128, depth=1).build_model(seed=0)  # the swarm's is digits-small: 256 wide
    with pytest.raises(MismatchError, match=r"has shape \[128, 64\] here but \[256, 64\] in the swarm"):
        gossiptrain.Peer(narrower, join=join, bind=f"{next_host()}:0")
    with pytest.raises(MismatchError, match=r"parameter 'weight' exists here but not in the swarm's model"):
        gossiptrain.Peer(torch.nn.Linear(64, 10), join=join, bind=f"{next_host()}:0")
    assert first.alive()


@pytest.mark.timeout(460)  # above the demo's own 400 s, so that an overrun fails with its output, its peers killed
def test_demo_json_reaches_095() -> None:
    result = run_cli("demo", "--json", timeout=400)
    assert result.returncode == 0, result.stdout + result.stderr
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    assert summary["mean_test_acc"] >= 0.95 and summary["reached"]
    assert summary["workdir"] is None  # its temporary folder is gone after a run that reached its target
    assert summary["seconds"] > 0 and len(summary["peers"]) == 4
    assert all(p["exchanges"] > 0 for p in summary["peers"])


def test_readme_python_api_example_runs(tmp_path: Path, procs: Procs) -> None:
    readme = (ROOT / "README.md").read_text()
    match = re.search(r"<!-- example: python-api -->\n```python\n(.*?)```", readme, re.S)
    assert match, "the README lost its Python API example"
    example = tmp_path / "example.py"
    example.write_text(match.group(1))
    host = next_host()
    coordinator = procs.start("coordinator", "--bind", f"{host}:0", "--workload", "external", "--shards", "2", name="coord")
    out = wait_for(lambda: "join with:" in coordinator.output() and coordinator.output(), 30, "the coordinator")
    join = re.search(r'join with: gossiptrain\.Peer\(model, join="([^"]+)"\)', out).group(1)  # type: ignore[union-attr]
    assert "gossiptrain peer" not in out.replace("`gossiptrain peer` has none", "")  # no CLI peer can train it
    # `python example.py JOIN`, forked from the process that imported torch already (tests/zygote.py): the example's
    # code runs whole in a process of its own; the interpreter's start is the demo test's to exercise.
    runs = [procs.start(join, name=f"example{i}", module=str(example)) for i in range(2)]
    codes = [r.wait(120) for r in runs]
    for r, code in zip(runs, codes):
        out = r.output()
        assert code == 0, out
        found = re.search(r"accuracy ([0-9.]+), (\d+) exchanges", out)
        assert found, out
        assert float(found.group(1)) > 0.8 and int(found.group(2)) > 0, out


def test_config_command_lists_every_field() -> None:
    result = run_cli("config")
    assert result.returncode == 0
    for field in ("[train]", "lr = 0.05", "[gossip]", "topology = \"auto\"", "[membership]", "[limits]"):
        assert field in result.stdout


@pytest.mark.parametrize(
    ("flag", "value", "message"),
    [("--slowdown", "0.5", "--slowdown"), ("--threads", "0", "--threads"), ("--wait-for", "-1", "--wait-for")],
)
def test_bad_local_peer_flags_name_the_flag_before_joining(flag: str, value: str, message: str, tmp_path: Path) -> None:
    # Nothing listens at the join address (a port 0 socket, closed): the flag must be refused before any join.
    # Forked from the process that imported torch already (tests/zygote.py): the peer's checks, not its imports.
    result = run_forked(["peer", "--join", f"127.0.0.1:{free_loopback_port()}", flag, value, "--quiet"], 60,
                        "gossiptrain peer", tmp_path)
    assert result.returncode == 2, result.stderr
    assert message in result.stderr and "Traceback" not in result.stderr
