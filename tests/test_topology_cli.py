"""`gossiptrain topology` as a user runs it: text, JSON, PNG and one-line errors."""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import pytest

from gossiptrain.cli.topology import add_parser, cmd_topology


def run(*argv: str) -> int:
    parser = argparse.ArgumentParser(prog="gossiptrain")
    add_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["topology", *argv])
    assert args.func is cmd_topology
    return int(args.func(args))


def test_text_output_for_ring(capsys: pytest.CaptureFixture[str]) -> None:
    assert run("ring", "--peers", "8") == 0
    gap = 1 - (1 + 2 * math.cos(2 * math.pi / 8)) / 3  # MH weights 1/3 on a ring: closed form
    assert capsys.readouterr().out.splitlines() == [
        "topology      ring",
        "peers         8",
        "degree        2 mean, 2 max (out-degree per round)",
        "diameter      4",
        f"spectral gap  {gap:.6f} (metropolis-hastings weights)",
        "directed      no",
        "time-varying  no",
    ]


def test_json_output_has_the_known_values_of_a_ring_and_a_complete_graph(capsys: pytest.CaptureFixture[str]) -> None:
    # Values known without the code under test: a ring of 8 has degree 2 and diameter 8/2, and its
    # Metropolis-Hastings matrix (1/3 on self and both neighbours) has second eigenvalue (1 + 2 cos(2 pi/8))/3;
    # a complete graph of 5 has degree 4, diameter 1 and weights 1/5 everywhere (the averaging matrix: gap 1).
    assert run("ring", "--peers", "8", "--json") == 0
    ring = json.loads(capsys.readouterr().out)
    gap = 1 - (1 + 2 * math.cos(2 * math.pi / 8)) / 3
    assert ring.pop("spectral_gap") == pytest.approx(gap, rel=1e-9)
    assert ring == {
        "name": "ring", "spec": "ring", "peers": 8, "round": 0, "degree": 2.0, "max_degree": 2, "diameter": 4,
        "weights": "metropolis-hastings", "directed": False, "time_varying": False, "period": 1,
    }
    assert run("complete", "--peers", "5", "--json") == 0
    complete = json.loads(capsys.readouterr().out)
    assert complete.pop("spectral_gap") == pytest.approx(1.0, abs=1e-9)
    assert complete == {
        "name": "complete", "spec": "complete", "peers": 5, "round": 0, "degree": 4.0, "max_degree": 4, "diameter": 1,
        "weights": "metropolis-hastings", "directed": False, "time_varying": False, "period": 1,
    }


def test_json_output_of_a_random_graph_is_consistent_with_its_edges(capsys: pytest.CaptureFixture[str]) -> None:
    assert run("erdos-renyi:p=0.3,seed=1", "--peers", "16", "--json") == 0
    data = json.loads(capsys.readouterr().out)
    assert {"degree", "diameter", "spectral_gap", "max_degree", "period"} <= set(data)
    assert data["spec"] == "erdos-renyi:p=0.3,seed=1" and data["peers"] == 16
    assert 1 <= data["diameter"] <= 15 and data["degree"] <= data["max_degree"] <= 15
    assert 0 < data["spectral_gap"] <= 1 and not data["directed"]


def test_round_selects_the_sample(capsys: pytest.CaptureFixture[str]) -> None:
    gaps = []
    for r in ("0", "1"):
        assert run("random-regular:degree=2", "--peers", "12", "--round", r, "--json") == 0
        gaps.append(json.loads(capsys.readouterr().out)["spectral_gap"])
    assert gaps[0] != gaps[1]


def test_time_varying_text_mentions_the_period(capsys: pytest.CaptureFixture[str]) -> None:
    assert run("one-peer-exponential", "--peers", "16") == 0
    out = capsys.readouterr().out
    assert "1.000000 (uniform weights, product over 4 rounds)" in out
    assert "yes, period 4" in out


def test_file_topology_defaults_to_its_size(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    graph = tmp_path / "g.txt"
    graph.write_text("0 1\n1 2\n2 3\n")
    assert run(f"file:path={graph}", "--json") == 0
    data = json.loads(capsys.readouterr().out)
    assert data["peers"] == 4 and data["diameter"] == 3


def test_png_is_written(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    png = tmp_path / "torus.png"
    assert run("torus", "--peers", "9", "--png", str(png)) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert f"drawn to      {png}" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("argv", "problem"),
    [
        (["moebius", "--peers", "4"], "unknown topology 'moebius'"),
        (["random-regular:degree=5", "--peers", "4"], "degree=5 needs at least 6 peers, have 4"),
        (["erdos-renyi:q=1", "--peers", "4"], "has no parameter q"),
        (["ring", "--peers", "0"], "must be at least 1"),
        (["ring"], "--peers is required for 'ring'"),
        (["ring", "--peers", "4", "--round", "-1"], "round=-1"),
        (["file:path=/nonexistent/g.txt"], "cannot read"),
        (["ring", "--peers", "4", "--png", "/nonexistent/dir/g.png"], "No such file"),
    ],
)
def test_errors_exit_2_with_one_line(argv: list[str], problem: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert run(*argv) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith("gossiptrain topology: error: ")
    assert problem in captured.err and captured.err.count("\n") == 1
