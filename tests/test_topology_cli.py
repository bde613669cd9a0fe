"""`gossiptrain topology` as a user runs it: text, JSON, PNG and one-line errors."""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import pytest

import topologies
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


def test_json_output_has_describe_keys(capsys: pytest.CaptureFixture[str]) -> None:
    assert run("erdos-renyi:p=0.3,seed=1", "--peers", "16", "--json") == 0
    data = json.loads(capsys.readouterr().out)
    expected = topologies.describe(topologies.get("erdos-renyi", p=0.3, seed=1), 16)
    assert data == expected
    assert {"degree", "diameter", "spectral_gap", "max_degree", "period"} <= set(data)


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
