"""`gossiptrain topology` as a user runs it: text, JSON, PNG and one-line errors."""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import topologies
from gossiptrain.cli.topology import add_parser, cmd_topology

from .swarm import run_in_session


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


def _cli_with_address_space(limit: int, *argv: str) -> "subprocess.CompletedProcess[str]":
    """`gossiptrain ARGV` in a child whose address space is capped: a dense n x n matrix there fails at once
    (MemoryError) instead of taking the machine down."""
    code = (
        "import resource, runpy, sys; "
        f"resource.setrlimit(resource.RLIMIT_AS, ({limit}, {limit})); "
        f"sys.argv = ['gossiptrain', *{list(argv)!r}]; "
        "runpy.run_module('gossiptrain', run_name='__main__')"
    )
    env = {**os.environ, "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"}  # no per-thread arenas in the cap
    return run_in_session([sys.executable, "-c", code], 120, f"gossiptrain {' '.join(argv)}", env=env)


@pytest.mark.parametrize(
    ("spec", "n", "gap", "hops"),
    [
        # Metropolis-Hastings on a ring: 1/3 on self and both neighbours, lambda_2 = (1 + 2 cos(2 pi/n))/3.
        ("ring", 100_000, 4 / 3 * math.sin(math.pi / 100_000) ** 2, 50_000),
        # A 316 x 316 torus: 1/5 on self and four neighbours, lambda_2 = (3 + 2 cos(2 pi/316))/5; diameter 158 + 158.
        ("torus", 316 * 316, 4 / 5 * math.sin(math.pi / 316) ** 2, 316),
    ],
)
def test_a_sparse_topology_of_100000_peers_is_described_at_once(spec: str, n: int, gap: float, hops: int) -> None:
    # The dense computation needed 10 GB of booleans and 80 GB of floats for this; 2 GB of address space is plenty now.
    done = _cli_with_address_space(2 << 30, "topology", spec, "--peers", str(n), "--json")
    assert done.returncode == 0, done.stderr[-2000:]
    data = json.loads(done.stdout)
    assert data["spectral_gap"] == pytest.approx(gap, rel=1e-6)
    assert (data["peers"], data["degree"], data["max_degree"], data["diameter"]) == (n, 2.0 if spec == "ring" else 4.0,
                                                                                    2 if spec == "ring" else 4, hops)


@pytest.mark.parametrize("spec", ["ring", "torus"])
def test_the_closed_form_agrees_with_the_dense_matrices_at_64_peers(spec: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert run(spec, "--peers", "64", "--json") == 0
    data = json.loads(capsys.readouterr().out)
    a = topologies.get(spec).adjacency(64)  # (64, 64), symmetric, regular
    w = (np.eye(64) + a) / (1 + a.sum(axis=1, keepdims=True))  # Metropolis-Hastings on a regular graph
    assert data["spectral_gap"] == pytest.approx(1 - np.linalg.norm(w - 1 / 64, ord=2), rel=1e-9)


def test_a_dense_graph_that_would_not_fit_is_refused_with_its_estimate(capsys: pytest.CaptureFixture[str]) -> None:
    # --max-memory pretends the machine has 1 GB: the estimate (tens of GB at 100,000 peers) is refused before
    # anything is drawn, and the message names the flag that goes ahead anyway.
    assert run("erdos-renyi", "--peers", "100000", "--max-memory", "1G") == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert "erdos-renyi on 100000 peers" in err and "needs about 430 GB" in err and "--max-memory 1 GB" in err
    assert "--max-memory SIZE (or none)" in err
    # Under the limit it runs, and says what it estimated when that is large.
    assert run("star", "--peers", "40", "--max-memory", "1G", "--json") == 0
    assert json.loads(capsys.readouterr().out)["max_degree"] == 39


def test_the_default_limit_is_the_memory_available_now() -> None:
    from gossiptrain.cli import memory

    with open("/proc/meminfo", encoding="ascii") as fh:
        kb = next(int(line.split()[1]) for line in fh if line.startswith("MemAvailable:"))
    assert abs(memory.available_memory() - kb * 1024) < 256 << 20  # the same reading, give or take what moved since
    assert memory.max_memory("64G") == 64e9 and memory.max_memory("none") == math.inf
    with pytest.raises(argparse.ArgumentTypeError):
        memory.max_memory("lots")
