"""`gossiptrain plot`: real peers' metrics and a real simulator run in, a PNG out; one-line errors otherwise."""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import pytest

from gossiptrain.cli.plot import add_parser, cmd_plot, default_title, figure
from gossiptrain.cli.simulate import write_rows
from gossiptrain.config import RunConfig
from gossiptrain.errors import ConfigError
from gossiptrain.sim.cluster import SimConfig, simulate
from gossiptrain.sim.faults import ChurnEvent
from gossiptrain.train.metrics import MetricsLog
from gossiptrain.train.series import load, mean_over_peers

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def run(*argv: str) -> int:
    parser = argparse.ArgumentParser(prog="gossiptrain")
    add_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["plot", *argv])
    assert args.func is cmd_plot
    return int(args.func(args))


def peer_file(path: Path, peer: str, start: float, accs: list[float]) -> None:
    """A peer's metrics as the peer loop writes them: a start record, then evaluations every 0.25 s."""
    with MetricsLog(path) as log:
        log.write({"event": "start", "time": start, "peer": peer, "step": 0, "test_acc": 0.1})
        for i, acc in enumerate(accs, start=1):
            log.write({"event": "eval", "time": start + 0.25 * i, "peer": peer, "step": 10 * i, "loss": 1.0 / i,
                       "test_acc": acc, "members": 2, "exchanges": 4 * i, "bytes_sent": 1_000_000 * i,
                       "bytes_received": 900_000 * i, "staleness_mean": 1.5, "staleness_hist": {"0": 3 * i, "2-3": i}})


def test_two_peers_metrics_files_give_series_from_the_first_start_and_a_picture(tmp_path: Path,
                                                                                capsys: pytest.CaptureFixture[str]) -> None:
    peer_file(tmp_path / "peer-0.jsonl", "a", 1000.0, [0.5, 0.7, 0.9])
    peer_file(tmp_path / "peer-1.jsonl", "b", 1000.5, [0.6, 0.8])  # started half a second later
    series, clock = load([tmp_path / "peer-0.jsonl", tmp_path / "peer-1.jsonl"])
    assert clock == "wall" and [s.name for s in series] == ["a", "b"]
    assert series[0].time == [0.25, 0.5, 0.75] and series[1].time == [0.75, 1.0]  # both from a's start
    t, rate = series[0].rate("exchanges")
    assert t == [0.5, 0.75] and rate == pytest.approx([16.0, 16.0])  # 4 exchanges per 0.25 s
    assert series[0].staleness_hist == {"0": 9, "2-3": 3}  # the last record's
    t, mean = mean_over_peers(series, "test_acc", grid=4)  # at 0.25, 0.5, 0.75, 1.0; b reports from 0.75 on
    assert t == pytest.approx([0.75, 1.0]) and mean == pytest.approx([(0.9 + 0.6) / 2, (0.9 + 0.8) / 2])
    out = tmp_path / "run.png"
    assert run(str(tmp_path / "peer-0.jsonl"), str(tmp_path / "peer-1.jsonl"), "--out", str(out)) == 0
    assert out.read_bytes().startswith(PNG_MAGIC) and out.stat().st_size > 10_000
    assert "2 peers, wall time" in capsys.readouterr().out


def test_a_simulator_run_plots_in_virtual_time(tmp_path: Path) -> None:
    run_config = RunConfig().with_overrides({"train.workload": "logreg", "train.shards": 3, "train.max_steps": 0})
    result = simulate(SimConfig(peers=3, run=run_config, duration=3.0, step_time=0.05, sample_every=0.5))
    csv_path = tmp_path / "series.csv"
    write_rows(result, csv_path)
    series, clock = load([csv_path])
    assert clock == "virtual" and len(series) == 3
    assert all(s.time == sorted(s.time) and s.time[-1] == pytest.approx(3.0) for s in series)
    assert max(v for s in series for v in s.values["test_acc"] if math.isfinite(v)) > 0.5  # it trained
    out = tmp_path / "sim.png"
    assert run(str(csv_path), "--out", str(out), "--title", "logreg") == 0
    assert out.read_bytes().startswith(PNG_MAGIC)


def test_unreadable_input_exits_2_with_one_line_and_writes_nothing(tmp_path: Path,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "x.png"
    (tmp_path / "notes.jsonl").write_text(json.dumps({"event": "start", "time": 1.0}) + "\n")
    (tmp_path / "broken.jsonl").write_text("{not json\n")
    peer_file(tmp_path / "peer.jsonl", "a", 1.0, [0.5])
    write_rows(simulate(SimConfig(peers=2, run=RunConfig().with_overrides({"train.workload": "logreg", "train.shards": 2,
                                                                             "train.max_steps": 0}),
                                  duration=2.0, step_time=0.05, sample_every=0.5)), tmp_path / "sim.csv")
    cases = {
        (str(tmp_path / "missing.jsonl"),): "cannot be read",
        (str(tmp_path / "notes.jsonl"),): "no eval records",
        (str(tmp_path / "broken.jsonl"),): "broken.jsonl:1: not a JSON line",
        (str(tmp_path / "peer.jsonl"), str(tmp_path / "sim.csv")): "not both",
    }
    for files, message in cases.items():
        assert run(*files, "--out", str(out)) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and message in err, err
    assert run(str(tmp_path / "peer.jsonl"), "--out", str(tmp_path / "x.svg")) == 2
    assert run(str(tmp_path / "peer.jsonl"), "--out", str(tmp_path / "nowhere" / "x.png")) == 2
    assert not out.exists() and not (tmp_path / "x.svg").exists()
    with pytest.raises(ConfigError, match="neither"):
        load([tmp_path / "notes.jsonl"])


def _no_rate_below_zero_and_no_line_across(fig: object, gap: tuple[float, float]) -> None:
    """Every line of the figure: no negative value on the rate panels, and no segment spanning ``gap``."""
    axes = fig.axes  # type: ignore[attr-defined]
    for ax in axes:
        for line in ax.get_lines():
            if line.get_linewidth() >= 2.0:  # the mean over peers: a swarm-wide curve, not one peer's series
                continue
            xs, ys = map(list, line.get_data())
            if ax.get_ylabel() in ("exchanges / s", "MB sent / s"):
                assert all(y >= 0 for y in ys if math.isfinite(y)), (ax.get_ylabel(), ys)
            for (x0, y0), (x1, y1) in zip(zip(xs, ys), zip(xs[1:], ys[1:])):
                drawn = math.isfinite(y0) and math.isfinite(y1)
                assert not (drawn and x0 <= gap[0] and x1 >= gap[1]), (ax.get_ylabel(), x0, x1)


def test_a_peer_resumed_into_the_same_metrics_file_starts_a_new_segment(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "peer-0.jsonl"
    peer_file(path, "a", 1000.0, [0.5, 0.7, 0.9])  # 12 exchanges, 3 MB by 1000.75; then stopped
    peer_file(path, "a2", 1010.0, [0.8, 0.9])  # --resume --metrics appends: counters from 0 again at 1010
    peer_file(tmp_path / "peer-1.jsonl", "b", 1000.0, [0.6, 0.8, 0.9])
    series, clock = load([path, tmp_path / "peer-1.jsonl"])
    a = series[0]
    assert a.time == [0.25, 0.5, 0.75, 10.25, 10.5] and a.breaks == [3]
    t, rate = a.rate("exchanges")
    assert t[:2] == [0.5, 0.75] and rate[:2] == pytest.approx([16.0, 16.0])
    assert t[2] == 10.25 and math.isnan(rate[2]) and (t[3], rate[3]) == (10.5, pytest.approx(16.0))
    fig = figure(series, clock, default_title(series, [str(path)]))
    _no_rate_below_zero_and_no_line_across(fig, (0.75, 10.25))
    assert [ax.get_xlabel() for ax in fig.axes][:2] == ["time (s)", "time (s)"]
    monkeypatch.chdir(tmp_path)  # files named bare: the title names the folder, not "."
    assert default_title(series, ["peer-0.jsonl"]) == f"2 peers, {tmp_path.name}"
    assert default_title(series, [str(path)]) == f"2 peers, {tmp_path}"
    assert run("peer-0.jsonl", "peer-1.jsonl", "--out", "run.png") == 0


def test_a_simulated_peer_back_from_a_crash_starts_a_new_segment_in_virtual_time(tmp_path: Path) -> None:
    run_config = RunConfig().with_overrides({"train.workload": "logreg", "train.shards": 2, "train.max_steps": 0})
    trace = (ChurnEvent(2.2, 0, "crash"), ChurnEvent(4.2, 0, "join"))
    result = simulate(SimConfig(peers=2, run=run_config, duration=7.0, step_time=0.05, sample_every=1.0,
                                churn_trace=trace))
    csv_path = tmp_path / "series.csv"
    write_rows(result, csv_path)
    series, clock = load([csv_path])
    crashed = next(s for s in series if s.name == "peer 0")
    assert clock == "virtual" and len(crashed.breaks) == 1
    back = crashed.breaks[0]
    assert crashed.time[back - 1] <= 2.2 and crashed.time[back] >= 4.2
    fig = figure(series, clock, "sim")
    _no_rate_below_zero_and_no_line_across(fig, (2.2, 4.2))
    assert {ax.get_xlabel() for ax in fig.axes} == {"virtual time (s)"}
