"""`gossiptrain simulate` as a first-time user meets it: time left, a usable default speed, Ctrl+C, honest views."""

from __future__ import annotations

import csv
import json
import logging
import os
import pty
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from gossiptrain.cli.main import build_parser
from gossiptrain.cli.simulate import DEFAULT_STEP_TIME, LiveLine, format_summary, sim_config
from gossiptrain.config import RunConfig
from gossiptrain.sim.cluster import SimConfig, SimInterrupted, simulate
from gossiptrain.sim.faults import ChurnEvent, PartitionSpec

from .swarm import ROOT


def logreg(**overrides: Any) -> RunConfig:
    return RunConfig().with_overrides({"train.workload": "logreg", "train.max_steps": 0, **overrides})


def test_the_live_line_estimates_the_time_left_from_the_rate_so_far() -> None:
    line = LiveLine(duration=50, peers=64)
    rows = [{"members": 66, "members_live": 63, "members_stale": 3, "test_acc": 0.9}] * 60
    line.render(1.0, rows, elapsed=8.25)  # the first sample: start-up is behind us
    text = line.render(4.0, rows, elapsed=33.0)  # 3 virtual s in 24.75 wall s: 8.25 s each, 46 to go
    assert "virtual     4.0/50 s" in text and "wall   33.0 s" in text
    assert "~6 min left" in text, text
    assert "view 63.0 live + 3.0 stale" in text  # never more live members than peers
    assert "~0 s left" in line.render(50.0, rows, elapsed=400.0)


def test_the_default_step_time_is_fixed_and_measuring_is_asked_for() -> None:
    parser = build_parser()
    default = sim_config(parser.parse_args(["simulate", "--peers", "2"]), RunConfig())
    assert default.step_time == DEFAULT_STEP_TIME == 0.05
    assert default.batch_steps and not sim_config(parser.parse_args(["simulate", "--one-by-one-steps"]), RunConfig()).batch_steps
    measured = sim_config(parser.parse_args(["simulate", "--peers", "2", "--step-time", "measured"]), RunConfig())
    assert measured.step_time is None  # the cluster times a real step here
    assert sim_config(parser.parse_args(["simulate", "--step-time", "0.2"]), RunConfig()).step_time == 0.2
    simulate_parser = parser._subparsers._group_actions[0].choices["simulate"]  # type: ignore[union-attr]
    help_text = " ".join(simulate_parser.format_help().split())
    assert "measured" in help_text and "fixed" in help_text and "wall time" in help_text
    with pytest.raises(SystemExit):
        parser.parse_args(["simulate", "--step-time", "fast"])


def _default_sigint() -> None:
    """In the child, before exec: Ctrl+C as a terminal delivers it (an ignored SIGINT would be inherited)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_ctrl_c_writes_the_series_so_far_and_a_summary_marked_interrupted(tmp_path: Path) -> None:
    out = tmp_path / "series.csv"
    cmd = [
        sys.executable, "-m", "gossiptrain", "simulate", "--peers", "3", "--workload", "logreg",
        "--duration", "100000", "--sample-every", "0.5", "--out", str(out), "--json",
    ]
    # Its stderr is a terminal, as where Ctrl+C is typed: the live line shows every sample as it comes. (On a pipe
    # it would print at most every 10 s, and a loaded machine's slow start takes that print for "starting peers".)
    terminal, child_end = pty.openpty()
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=child_end, text=True, cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)}, preexec_fn=_default_sigint,
    )
    os.close(child_end)
    stderr: queue.Queue[str] = queue.Queue()

    def read_terminal() -> None:
        pending = ""
        while True:
            try:
                chunk = os.read(terminal, 4096)
            except OSError:  # EIO: the simulation's end of the terminal is closed
                break
            if not chunk:
                break
            *lines, pending = re.split(r"[\r\n]", pending + chunk.decode(errors="replace"))
            for line in lines:
                if line.strip():
                    stderr.put(line)

    reader = threading.Thread(target=read_terminal, daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + 60
        progress = ""
        while "virtual" not in progress:  # the first sample is on the live line: the cluster is running
            assert proc.poll() is None, f"simulate exited with {proc.returncode} before showing progress"
            assert time.monotonic() < deadline, "no progress line within 60 s"
            try:
                progress = stderr.get(timeout=0.5)
            except queue.Empty:
                pass
        assert "left" in progress, progress
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=30) == 130
        stdout = proc.stdout.read() if proc.stdout else ""
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
        if proc.stdout:
            proc.stdout.close()
        reader.join(timeout=10)  # it ends at the EIO of a terminal whose other end has closed
        os.close(terminal)
    summary = json.loads(stdout.strip().splitlines()[-1])
    assert summary["interrupted"] is True
    assert 0 < summary["virtual_seconds"] < 100000 and summary["duration"] == 100000
    assert "interrupted at virtual" in stdout
    with open(out, newline="", encoding="utf-8") as fh:
        rows = list(csv.DictReader(fh))
    assert rows and {r["peer"] for r in rows} <= {"0", "1", "2"}
    assert max(float(r["time"]) for r in rows) <= summary["virtual_seconds"]


def test_an_interrupt_inside_simulate_carries_the_rows_so_far() -> None:
    def on_sample(now: float, rows: list[dict[str, Any]]) -> None:
        if now >= 2.0:
            raise KeyboardInterrupt

    config = SimConfig(peers=2, run=logreg(**{"train.shards": 2}), duration=50, step_time=0.05)
    with pytest.raises(SimInterrupted) as caught:
        simulate(config, on_sample)
    assert isinstance(caught.value, KeyboardInterrupt)  # a script's Ctrl+C handling still applies
    result = caught.value.result
    assert result.rows and max(r["time"] for r in result.rows) == pytest.approx(2.0)
    assert result.summary["interrupted"] is True and result.summary["virtual_seconds"] == pytest.approx(2.0, abs=0.5)
    assert result.summary["mean_test_acc"] is not None


def test_a_view_counts_live_peers_apart_from_stale_entries() -> None:
    # Peer 1 crashes and rejoins (under a new id) before the others declare its old incarnation dead:
    # for a while their views hold 5 entries for 4 peers.
    run = RunConfig().with_overrides({"train.workload": "external", "membership.heartbeat_interval": 0.5})
    trace = (ChurnEvent(3.0, 1, "crash"), ChurnEvent(3.5, 1, "join"))
    config = SimConfig(peers=4, run=run, duration=7, membership_only=True, churn_trace=trace, sample_every=0.5)
    result = simulate(config)
    by_time: dict[float, list[dict[str, Any]]] = {}
    for r in result.rows:
        by_time.setdefault(r["time"], []).append(r)
    assert any(r["members"] > len(rows) for rows in by_time.values() for r in rows)  # the stale entry is there
    for rows in by_time.values():
        for r in rows:
            assert r["members_live"] <= len(rows) <= config.peers
            assert r["members_live"] + r["members_stale"] == r["members"]
    stale = [r for rows in by_time.values() for r in rows if r["members"] > len(rows)]
    assert all(r["members_stale"] >= 1 for r in stale)
    assert result.summary["mean_members_live"] <= config.peers
    text = format_summary(result)
    assert "live peers (itself included)" in text and "stale entries" in text
    assert "mean view size" not in text


def test_the_summary_says_what_staleness_means_and_what_is_typical() -> None:
    config = SimConfig(peers=3, run=logreg(**{"train.shards": 3}), duration=4, step_time=0.05, speeds=(4.0, 1.0, 1.0))
    result = simulate(config)
    text = format_summary(result)
    line = next(ln for ln in text.splitlines() if "mean staleness" in ln)
    assert "steps" in line and "ahead of the sender" in line and "round trip" in line
    assert "typical" in text and "stragglers" in text
    assert not any("typical" in str(v) for v in result.summary.values())  # the JSON keeps numbers only


def test_a_scheduled_partition_counts_its_given_up_exchanges_in_the_summary_instead_of_a_warning_each(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # No one is declared dead during the split (a long suspicion): the exchanges across it time out and are given up.
    run = logreg(**{"train.shards": 4, "membership.suspicion_mult": 50.0})
    config = SimConfig(peers=4, run=run, duration=4, step_time=0.05, partitions=(PartitionSpec(1, 4),))
    with caplog.at_level(logging.WARNING):  # the default verbosity
        result = simulate(config)
    counted = result.summary["log_warnings"].get("gave up on the exchange with", 0)
    assert counted > 0
    assert not [r for r in caplog.records if r.name.startswith("gossiptrain.")]  # not one line each
    assert f'{counted} x "gave up on the exchange with ..."' in format_summary(result)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="gossiptrain"):  # -v: each one, stamped with the virtual time
        again = simulate(config)
    gave_up = [r.getMessage() for r in caplog.records if "gave up on the exchange with" in r.getMessage()]
    assert len(gave_up) == again.summary["log_warnings"]["gave up on the exchange with"] == counted  # the same run
    assert all(re.match(r"virtual \d+\.\d{3} s: gave up", m) for m in gave_up), gave_up


def test_a_swarm_too_big_for_memory_is_refused_up_front_with_the_estimate(capsys: pytest.CaptureFixture[str]) -> None:
    from gossiptrain.cli.main import main

    # --max-memory pretends the machine has 2 GB. 5,000 peers' views alone (every view ends up holding every member)
    # are some 77 GB: refused before a peer, or even the workload, is built.
    assert main(["simulate", "--peers", "5000", "--max-memory", "2G"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert "simulating 5000 peers of digits needs about 25.9 GB" in err and "above --max-memory 2 GB" in err, err
    assert "use fewer --peers" in err and "--max-memory SIZE (or none)" in err, err


def test_the_estimate_is_printed_before_the_peers_start(capsys: pytest.CaptureFixture[str]) -> None:
    from gossiptrain.cli.main import main

    rc = main(["simulate", "--peers", "2", "--workload", "logreg", "--duration", "0.5", "--sample-every", "0.5",
               "--max-memory", "1G"])
    assert rc == 0
    first = capsys.readouterr().err.splitlines()[0]
    # 2 peers: 2 x (64 KB + 16 model copies) + 4 views entries of 1 KB + 4 model copies, the model 264 bytes
    assert first == "simulating 2 peers of logreg (264 B model): about 145 KB of memory at most, estimated (1 GB --max-memory); starting"
