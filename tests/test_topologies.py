"""Tests for the topologies package: graph contracts, known graphs, mixing weights."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import topologies
from topologies import (
    Topology,
    diameter,
    metropolis_hastings,
    mixing_matrix,
    spectral_gap,
    uniform_weights,
)

# No deadline: a slow shared CI core must not turn into a flaky failure.
PROPERTY = settings(deadline=None, max_examples=60)
NAMES = topologies.names()
UNDIRECTED = ("ring", "torus", "hypercube", "complete")

sizes = st.integers(min_value=1, max_value=64)


@st.composite
def member(draw: st.DrawFn) -> tuple[int, int]:
    n = draw(sizes)
    return n, draw(st.integers(min_value=0, max_value=n - 1))


@st.composite
def graphs(draw: st.DrawFn) -> np.ndarray:
    """Arbitrary directed graphs, self-loops and disconnection included."""
    n = draw(st.integers(min_value=1, max_value=24))
    bits = draw(st.lists(st.booleans(), min_size=n * n, max_size=n * n))
    return np.array(bits, dtype=bool).reshape(n, n)  # (n, n)


# --- registry ---------------------------------------------------------------


def test_required_names_are_registered() -> None:
    assert {"ring", "exponential", "complete", "torus", "hypercube"} <= set(NAMES)
    assert len(set(NAMES)) == len(NAMES)


@pytest.mark.parametrize("name", NAMES)
def test_get_returns_topology_with_that_name(name: str) -> None:
    t = topologies.get(name)
    assert isinstance(t, Topology)
    assert t.name == name
    assert t.time_varying is False


def test_get_unknown_names_it_and_lists_known() -> None:
    with pytest.raises(ValueError) as info:
        topologies.get("moebius")
    message = str(info.value)
    assert "'moebius'" in message
    for name in NAMES:
        assert name in message


def test_package_does_not_import_gossiptrain_or_torch() -> None:
    # A fresh interpreter: this test process may already hold torch from other tests.
    code = (
        "import sys, topologies; "
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'gossiptrain')); "
        "sys.exit(','.join(bad) or 0)"
    )
    root = Path(__file__).resolve().parents[1]
    done = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


# --- the neighbours contract, for every topology -----------------------------


@pytest.mark.parametrize("name", NAMES)
@PROPERTY
@given(case=member())
def test_neighbours_are_sorted_unique_valid_and_exclude_self(
    name: str, case: tuple[int, int]
) -> None:
    n, i = case
    out = topologies.get(name).neighbours(n, i)
    assert all(type(j) is int for j in out)
    assert all(0 <= j < n for j in out)
    assert i not in out
    assert out == sorted(set(out))
    if n >= 2:
        assert out, "every member of a connected graph sends somewhere"


@pytest.mark.parametrize("name", NAMES)
@PROPERTY
@given(n=sizes)
def test_adjacency_matches_neighbours(name: str, n: int) -> None:
    t = topologies.get(name)
    a = t.adjacency(n)
    assert a.shape == (n, n) and a.dtype == np.bool_
    for i in range(n):
        assert np.flatnonzero(a[i]).tolist() == t.neighbours(n, i)


@pytest.mark.parametrize("name", NAMES)
@PROPERTY
@given(n=sizes)
def test_symmetrized_graph_is_connected(name: str, n: int) -> None:
    # diameter raises on a disconnected graph; it can never exceed n - 1.
    assert 0 <= diameter(topologies.get(name).adjacency(n)) <= n - 1


@pytest.mark.parametrize("name", UNDIRECTED)
@PROPERTY
@given(n=sizes)
def test_undirected_topologies_are_symmetric(name: str, n: int) -> None:
    t = topologies.get(name)
    assert not t.directed
    a = t.adjacency(n)
    assert np.array_equal(a, a.T)


@pytest.mark.parametrize("name", NAMES)
def test_tiny_member_counts(name: str) -> None:
    t = topologies.get(name)
    assert t.neighbours(1, 0) == []
    assert t.neighbours(2, 0) == [1]
    assert t.neighbours(2, 1) == [0]
    assert not t.adjacency(1).any()


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize(
    ("n", "i", "round"), [(0, 0, 0), (-3, 0, 0), (4, 4, 0), (4, -1, 0), (4, 0, -1)]
)
def test_bad_arguments_raise_value_error(name: str, n: int, i: int, round: int) -> None:
    with pytest.raises(ValueError):
        topologies.get(name).neighbours(n, i, round)


@pytest.mark.parametrize("name", NAMES)
def test_static_topologies_ignore_round(name: str) -> None:
    t = topologies.get(name)
    assert np.array_equal(t.adjacency(12, round=0), t.adjacency(12, round=7))


# --- known graphs -------------------------------------------------------------


def test_ring_known_neighbours() -> None:
    ring = topologies.get("ring")
    assert [ring.neighbours(4, i) for i in range(4)] == [[1, 3], [0, 2], [1, 3], [0, 2]]
    assert ring.neighbours(3, 0) == [1, 2]


def test_exponential_known_neighbours_and_direction() -> None:
    exp = topologies.get("exponential")
    assert exp.directed
    assert exp.neighbours(8, 0) == [1, 2, 4]
    assert exp.neighbours(8, 5) == [1, 6, 7]  # 6, 7, 9 mod 8
    assert exp.neighbours(6, 3) == [1, 4, 5]  # 4, 5, 7 mod 6
    a = exp.adjacency(8)
    assert a[0, 1] and not a[1, 0]


@PROPERTY
@given(n=sizes)
def test_exponential_out_degree_is_ceil_log2_for_powers_of_two(n: int) -> None:
    p = 1 << (n.bit_length() - 1)  # largest power of two <= n
    a = topologies.get("exponential").adjacency(p)
    assert (a.sum(axis=1) == int(math.log2(p))).all()


def test_complete_known_neighbours() -> None:
    assert topologies.get("complete").neighbours(5, 2) == [0, 1, 3, 4]


def test_torus_is_the_usual_torus_when_columns_divide_n() -> None:
    torus = topologies.get("torus")
    assert torus.neighbours(16, 0) == [1, 3, 4, 12]  # 4 x 4
    assert torus.neighbours(16, 5) == [1, 4, 6, 9]
    assert torus.neighbours(12, 0) == [1, 3, 4, 8]  # 3 rows x 4 columns
    assert (torus.adjacency(9).sum(axis=1) == 4).all()  # 3 x 3 is 4-regular
    assert diameter(torus.adjacency(16)) == 4


@PROPERTY
@given(n=sizes)
def test_torus_degree_at_most_four(n: int) -> None:
    assert topologies.get("torus").adjacency(n).sum(axis=1).max(initial=0) <= 4


def test_hypercube_known_neighbours() -> None:
    cube = topologies.get("hypercube")
    assert cube.neighbours(8, 0) == [1, 2, 4]
    assert cube.neighbours(8, 5) == [1, 4, 7]
    assert cube.neighbours(6, 5) == [1, 4]  # 5 ^ 2 = 7 is not a member
    assert diameter(cube.adjacency(16)) == 4


@PROPERTY
@given(case=member())
def test_hypercube_neighbours_differ_in_one_bit(case: tuple[int, int]) -> None:
    n, i = case
    for j in topologies.get("hypercube").neighbours(n, i):
        assert (i ^ j).bit_count() == 1


@pytest.mark.parametrize(
    ("name", "n", "expected"),
    [("ring", 9, 4), ("ring", 10, 5), ("complete", 7, 1), ("exponential", 8, 2)],
)
def test_known_diameters(name: str, n: int, expected: int) -> None:
    assert diameter(topologies.get(name).adjacency(n)) == expected


def test_diameter_rejects_disconnected_and_malformed() -> None:
    two_pairs = np.zeros((4, 4), dtype=bool)
    two_pairs[0, 1] = two_pairs[2, 3] = True
    with pytest.raises(ValueError, match="disconnected"):
        diameter(two_pairs)
    with pytest.raises(ValueError):
        diameter(np.zeros((2, 3), dtype=bool))
    assert diameter(np.zeros((1, 1), dtype=bool)) == 0


# --- mixing weights -----------------------------------------------------------


def _assert_doubly_stochastic_symmetric(w: np.ndarray) -> None:
    assert np.array_equal(w, w.T)
    assert (w >= 0).all()
    np.testing.assert_allclose(w.sum(axis=1), 1.0, rtol=0, atol=1e-12)
    np.testing.assert_allclose(w.sum(axis=0), 1.0, rtol=0, atol=1e-12)


@PROPERTY
@given(a=graphs())
def test_metropolis_hastings_on_any_graph(a: np.ndarray) -> None:
    w = metropolis_hastings(a)
    _assert_doubly_stochastic_symmetric(w)
    s = (a | a.T) & ~np.eye(len(a), dtype=bool)  # (n, n)
    off = ~np.eye(len(a), dtype=bool)
    # Weight exactly on the symmetrized edges, and every member keeps some of its own value.
    assert np.array_equal(w[off] > 0, s[off])
    assert (np.diag(w) > 0).all()


@pytest.mark.parametrize("name", NAMES)
@PROPERTY
@given(n=st.integers(min_value=2, max_value=64))
def test_mixing_matrix_properties_and_gap(name: str, n: int) -> None:
    w = mixing_matrix(topologies.get(name), n)
    _assert_doubly_stochastic_symmetric(w)
    gap = spectral_gap(w)
    assert 0.0 < gap <= 1.0 + 1e-12


def test_metropolis_hastings_known_values() -> None:
    # Path 0 - 1 - 2: degrees 1, 2, 1.
    path = np.array([[0, 1, 0], [0, 0, 1], [0, 0, 0]], dtype=bool)
    expected = np.array([[2 / 3, 1 / 3, 0], [1 / 3, 1 / 3, 1 / 3], [0, 1 / 3, 2 / 3]])
    np.testing.assert_allclose(metropolis_hastings(path), expected, atol=1e-15)


@pytest.mark.parametrize("n", [2, 5, 16, 64])
def test_complete_graph_averages_exactly_in_one_round(n: int) -> None:
    w = mixing_matrix(topologies.get("complete"), n)
    np.testing.assert_allclose(w, np.full((n, n), 1.0 / n), atol=1e-15)
    assert spectral_gap(w) == pytest.approx(1.0, abs=1e-12)


@pytest.mark.parametrize("n", [2, 4, 8, 16, 32, 64])
def test_exponential_gap_matches_ying_formula_with_uniform_weights(n: int) -> None:
    w = uniform_weights(topologies.get("exponential").adjacency(n))
    np.testing.assert_allclose(w.sum(axis=0), 1.0, atol=1e-12)  # circulant: doubly stochastic
    assert spectral_gap(w) == pytest.approx(2.0 / (1.0 + math.log2(n)), abs=1e-9)


@PROPERTY
@given(a=graphs())
def test_uniform_weights_are_row_stochastic_on_out_edges(a: np.ndarray) -> None:
    w = uniform_weights(a)
    np.testing.assert_allclose(w.sum(axis=1), 1.0, atol=1e-12)
    off = ~np.eye(len(a), dtype=bool)
    assert np.array_equal(w[off] > 0, a[off])
    # Row i is uniform over i and its out-neighbours.
    degree = (a & off).sum(axis=1)  # (n,)
    np.testing.assert_allclose(np.diag(w), 1.0 / (1.0 + degree), atol=1e-12)


def test_spectral_gap_edge_cases() -> None:
    assert spectral_gap(np.ones((1, 1))) == 1.0
    assert spectral_gap(np.eye(3)) == pytest.approx(0.0, abs=1e-12)  # nobody talks
    two_pairs = np.zeros((4, 4), dtype=bool)
    two_pairs[0, 1] = two_pairs[2, 3] = True
    assert spectral_gap(metropolis_hastings(two_pairs)) == pytest.approx(0.0, abs=1e-12)
    with pytest.raises(ValueError):
        spectral_gap(np.ones((2, 3)))


def test_ring_gap_shrinks_with_n_and_exponential_beats_ring() -> None:
    ring, exp = topologies.get("ring"), topologies.get("exponential")
    gaps = [spectral_gap(mixing_matrix(ring, n)) for n in (8, 16, 32)]
    assert gaps[0] > gaps[1] > gaps[2] > 0
    assert spectral_gap(mixing_matrix(exp, 32)) > 5 * gaps[2]
