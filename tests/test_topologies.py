"""Tests for the topologies package: graph contracts, known graphs, mixing weights."""

from __future__ import annotations

import math
import struct
import subprocess
import sys
import zlib
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import topologies
from topologies import (
    Topology,
    diameter,
    drawing,
    metropolis_hastings,
    mixing_matrix,
    spectral_gap,
    uniform_weights,
)

# No deadline: a slow shared CI core must not turn into a flaky failure.
PROPERTY = settings(deadline=None, max_examples=60)
NAMES = topologies.names()
# Everything get(name) can build without parameters (a file topology needs a path).
DEFAULTS = tuple(name for name in NAMES if name != "file")
TIME_VARYING = ("one-peer-exponential", "random-regular", "base-k")
STATIC = tuple(name for name in DEFAULTS if name not in TIME_VARYING)
UNDIRECTED = ("ring", "torus", "hypercube", "complete", "star", "erdos-renyi", "small-world", "base-k")

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
    assert set(TIME_VARYING) | set(STATIC) | {"file"} == set(NAMES)
    assert {"one-peer-exponential", "erdos-renyi", "random-regular", "star", "small-world", "base-k"} <= set(NAMES)
    assert len(set(NAMES)) == len(NAMES)


@pytest.mark.parametrize("name", DEFAULTS)
def test_get_returns_topology_with_that_name(name: str) -> None:
    t = topologies.get(name)
    assert isinstance(t, Topology)
    assert t.name == name
    assert t.time_varying is (name in TIME_VARYING)


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


@pytest.mark.parametrize("name", STATIC)
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


@pytest.mark.parametrize("name", DEFAULTS)
@PROPERTY
@given(n=sizes)
def test_adjacency_matches_neighbours(name: str, n: int) -> None:
    t = topologies.get(name)
    a = t.adjacency(n)
    assert a.shape == (n, n) and a.dtype == np.bool_
    for i in range(n):
        assert np.flatnonzero(a[i]).tolist() == t.neighbours(n, i)


@pytest.mark.parametrize("name", STATIC)
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


@pytest.mark.parametrize("name", DEFAULTS)
def test_tiny_member_counts(name: str) -> None:
    t = topologies.get(name)
    assert t.neighbours(1, 0) == []
    assert t.neighbours(2, 0) == [1]
    assert t.neighbours(2, 1) == [0]
    assert not t.adjacency(1).any()


@pytest.mark.parametrize("name", DEFAULTS)
@pytest.mark.parametrize(
    ("n", "i", "round"), [(0, 0, 0), (-3, 0, 0), (4, 4, 0), (4, -1, 0), (4, 0, -1)]
)
def test_bad_arguments_raise_value_error(name: str, n: int, i: int, round: int) -> None:
    with pytest.raises(ValueError):
        topologies.get(name).neighbours(n, i, round)


@pytest.mark.parametrize("name", STATIC)
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


@pytest.mark.parametrize("name", STATIC)
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


# --- every topology, every n in 1..40, every round ------------------------------

small = st.integers(min_value=1, max_value=40)
rounds = st.integers(min_value=0, max_value=1000)


def _union_over_period(t: Topology, n: int, start: int) -> np.ndarray:
    union: np.ndarray = np.logical_or.reduce([t.adjacency(n, r) for r in range(start, start + t.period(n))])
    return union  # (n, n)


@pytest.mark.parametrize("name", DEFAULTS)
@PROPERTY
@given(n=small, round=rounds, data=st.data())
def test_neighbours_contract_in_any_round(name: str, n: int, round: int, data: st.DataObject) -> None:
    t = topologies.get(name)
    i = data.draw(st.integers(min_value=0, max_value=n - 1))
    out = t.neighbours(n, i, round)
    assert all(type(j) is int and 0 <= j < n for j in out)
    assert i not in out and out == sorted(set(out))
    assert np.flatnonzero(t.adjacency(n, round)[i]).tolist() == out


@pytest.mark.parametrize("name", DEFAULTS)
@PROPERTY
@given(n=small, start=rounds)
def test_union_over_a_period_is_connected_and_everyone_sends(name: str, n: int, start: int) -> None:
    union = _union_over_period(topologies.get(name), n, start)
    assert 0 <= diameter(union) <= n - 1
    if n >= 2:
        assert union.any(axis=1).all(), "some member never sends during a whole period"


@pytest.mark.parametrize("name", DEFAULTS)
@PROPERTY
@given(n=small, round=rounds)
def test_weights_in_any_round(name: str, n: int, round: int) -> None:
    t = topologies.get(name)
    _assert_doubly_stochastic_symmetric(mixing_matrix(t, n, round))
    w = uniform_weights(t.adjacency(n, round))
    np.testing.assert_allclose(w.sum(axis=1), 1.0, rtol=0, atol=1e-12)
    assert (w >= 0).all()


@pytest.mark.parametrize("name", [u for u in UNDIRECTED if u in DEFAULTS])
@PROPERTY
@given(n=small, round=rounds)
def test_undirected_in_every_round(name: str, n: int, round: int) -> None:
    a = topologies.get(name).adjacency(n, round)
    assert np.array_equal(a, a.T)


@pytest.mark.parametrize("name", DEFAULTS)
@PROPERTY
@given(n=small)
def test_gap_over_period_is_positive_unless_weights_are_only_row_stochastic(name: str, n: int) -> None:
    gap = topologies.spectral_gap_over_period(topologies.get(name), n)
    assert gap <= 1.0 + 1e-12
    if name != "random-regular":  # random in-degrees: not doubly stochastic, see its docstring
        assert gap > 0.0


@pytest.mark.parametrize("name", STATIC)
@PROPERTY
@given(n=small)
def test_static_period_is_one_and_gap_over_period_is_the_one_round_gap(name: str, n: int) -> None:
    t = topologies.get(name)
    assert t.period(n) == 1
    if not t.directed:
        assert topologies.spectral_gap_over_period(t, n) == pytest.approx(
            spectral_gap(mixing_matrix(t, n)), abs=1e-12
        )


@pytest.mark.parametrize("name", ["one-peer-exponential", "base-k"])
@PROPERTY
@given(n=small, round=rounds)
def test_periodic_topologies_repeat_after_their_period(name: str, n: int, round: int) -> None:
    t = topologies.get(name)
    assert np.array_equal(t.adjacency(n, round), t.adjacency(n, round + t.period(n)))


# --- one-peer exponential -------------------------------------------------------


def test_one_peer_exponential_known_neighbours_and_period() -> None:
    t = topologies.get("one-peer-exponential")
    assert t.directed and t.time_varying
    assert [t.neighbours(8, 5, r) for r in range(4)] == [[6], [7], [1], [6]]
    assert [t.period(n) for n in (1, 2, 3, 4, 5, 8, 9, 40)] == [1, 1, 2, 2, 3, 3, 4, 6]


@pytest.mark.parametrize("tau", range(7))
def test_one_peer_exponential_averages_exactly_over_log2_n_rounds(tau: int) -> None:
    n = 1 << tau
    t = topologies.get("one-peer-exponential")
    product = np.eye(n)  # (n, n)
    for r in range(max(tau, 1)):
        w = uniform_weights(t.adjacency(n, r))  # (n, n): 1/2 self, 1/2 the one neighbour
        if n > 1:
            assert ((w == 0.0) | (w == 0.5)).all() and (np.count_nonzero(w, axis=1) == 2).all()
        product = product @ w
    np.testing.assert_allclose(product, np.full((n, n), 1.0 / n), rtol=0, atol=1e-12)
    assert topologies.spectral_gap_over_period(t, n) == pytest.approx(1.0, abs=1e-12)


def test_one_peer_exponential_is_not_exact_for_other_n() -> None:
    assert topologies.spectral_gap_over_period(topologies.get("one-peer-exponential"), 6) < 0.99


# --- base-(k+1) -------------------------------------------------------------------


@pytest.mark.parametrize(("k", "levels"), [(1, 1), (1, 3), (1, 5), (2, 2), (2, 3), (3, 2), (4, 2)])
def test_base_k_averages_exactly_for_n_a_power_of_k_plus_one(k: int, levels: int) -> None:
    n = (k + 1) ** levels
    t = topologies.get("base-k", k=k)
    assert t.period(n) == levels
    product = np.eye(n)  # (n, n)
    for r in range(levels):
        a = t.adjacency(n, r)
        assert (a.sum(axis=1) == k).all()  # cliques of k + 1
        product = product @ mixing_matrix(t, n, r)
    np.testing.assert_allclose(product, np.full((n, n), 1.0 / n), rtol=0, atol=1e-12)


def test_base_k_known_neighbours() -> None:
    two = topologies.get("base-k")  # k = 1: pairs, like a one-peer hypercube
    assert [two.neighbours(8, 5, r) for r in range(3)] == [[4], [7], [1]]
    three = topologies.get("base-k", k=2)
    assert [three.neighbours(9, 4, r) for r in range(2)] == [[3, 5], [1, 7]]
    assert three.neighbours(5, 4, 0) == [3]  # 5 is not a member: fewer than k neighbours
    assert two.neighbours(3, 2, 0) == []  # and sometimes none in a round
    with pytest.raises(ValueError, match="k must be at least 1"):
        topologies.get("base-k", k=0)


# --- star ------------------------------------------------------------------------------


def test_star_known_neighbours() -> None:
    star = topologies.get("star")
    assert star.neighbours(5, 0) == [1, 2, 3, 4]
    assert star.neighbours(5, 3) == [0]
    assert diameter(star.adjacency(9)) == 2


# --- Erdős–Rényi --------------------------------------------------------------------


@settings(deadline=None, max_examples=40)
@given(n=small, p=st.floats(min_value=0.0, max_value=1.0), seed=st.integers(0, 2**32))
def test_erdos_renyi_is_connected_symmetric_and_reproducible(n: int, p: float, seed: int) -> None:
    a = topologies.get("erdos-renyi", p=p, seed=seed).adjacency(n)
    assert np.array_equal(a, a.T)
    assert diameter(a) <= n - 1
    assert np.array_equal(a, topologies.get("erdos-renyi", p=p, seed=seed).adjacency(n))


def test_erdos_renyi_extremes_and_density() -> None:
    path = topologies.get("erdos-renyi", p=0.0).adjacency(6)
    # Nothing sampled: the bridging rule joins 0-1, 1-2, ... into a path.
    assert [np.flatnonzero(r).tolist() for r in path] == [[1], [0, 2], [1, 3], [2, 4], [3, 5], [4]]
    assert topologies.get("erdos-renyi", p=1).adjacency(7).sum() == 7 * 6
    a = topologies.get("erdos-renyi", p=0.3, seed=5).adjacency(200)
    assert 0.27 < a.sum() / (200 * 199) < 0.33
    other = topologies.get("erdos-renyi", p=0.3, seed=6).adjacency(200)
    assert not np.array_equal(a, other)


def test_erdos_renyi_default_probability() -> None:
    er = topologies.ErdosRenyi()
    assert topologies.get("erdos-renyi") == er
    assert er.edge_probability(1) == 0.0
    assert er.edge_probability(100) == pytest.approx(2 * math.log(100) / 100)
    assert er.edge_probability(2) == pytest.approx(math.log(2))
    with pytest.raises(ValueError, match="p must be in"):
        topologies.get("erdos-renyi", p=1.5)
    with pytest.raises(ValueError, match="seed must be non-negative"):
        topologies.get("erdos-renyi", seed=-1)


# --- random regular (Epidemic Learning) -----------------------------------------------


@settings(deadline=None, max_examples=40)
@given(n=st.integers(8, 40), round=rounds, seed=st.integers(0, 2**32), degree=st.integers(1, 5))
def test_random_regular_resamples_each_round_reproducibly(n: int, round: int, seed: int, degree: int) -> None:
    # degree <= n - 3: a complete (degree n - 1) graph has only one sample to draw.
    t = topologies.get("random-regular", degree=degree, seed=seed)
    a = t.adjacency(n, round)
    assert (a.sum(axis=1) == degree).all()
    assert np.array_equal(a, topologies.get("random-regular", degree=degree, seed=seed).adjacency(n, round))
    assert not np.array_equal(a, t.adjacency(n, round + 1))
    assert not np.array_equal(a, topologies.get("random-regular", degree=degree, seed=seed + 1).adjacency(n, round))


def test_random_regular_default_degree_and_too_large_degree() -> None:
    t = topologies.RandomRegular()
    assert t == topologies.get("random-regular")
    assert t.directed and t.time_varying and t.period(10) == 1
    assert [t.out_degree(n) for n in (1, 2, 3, 4, 40)] == [0, 1, 2, 3, 3]
    five = topologies.get("random-regular", degree=5)
    assert len(five.neighbours(6, 0)) == 5
    with pytest.raises(ValueError, match="degree=5 needs at least 6 peers, have 4"):
        five.neighbours(4, 0)
    with pytest.raises(ValueError, match="needs at least 6 peers"):
        five.adjacency(5, round=3)
    with pytest.raises(ValueError, match="degree must be at least 1"):
        topologies.get("random-regular", degree=0)


# --- small world ----------------------------------------------------------------------------


def test_small_world_without_rewiring_is_the_ring_lattice() -> None:
    t = topologies.get("small-world", k=4, beta=0.0)
    assert t.neighbours(10, 0) == [1, 2, 8, 9]
    assert (t.adjacency(10).sum(axis=1) == 4).all()
    assert topologies.get("small-world", k=2, beta=0).adjacency(9).tolist() == topologies.get("ring").adjacency(9).tolist()


@settings(deadline=None, max_examples=40)
@given(n=small, beta=st.floats(min_value=0.0, max_value=1.0), seed=st.integers(0, 2**32))
def test_small_world_is_connected_symmetric_and_keeps_its_edges(n: int, beta: float, seed: int) -> None:
    t = topologies.get("small-world", beta=beta, seed=seed)
    a = t.adjacency(n)
    assert np.array_equal(a, a.T) and diameter(a) <= n - 1
    lattice = topologies.get("small-world", beta=0.0).adjacency(n)
    # Rewiring moves edges; only the bridging repair may add a few.
    assert lattice.sum() <= a.sum() <= lattice.sum() + 2 * (n - 1)
    assert np.array_equal(a, topologies.get("small-world", beta=beta, seed=seed).adjacency(n))


def test_small_world_rewires_and_rejects_bad_parameters() -> None:
    lattice = topologies.get("small-world", beta=0.0).adjacency(30)
    assert not np.array_equal(topologies.get("small-world", beta=0.5).adjacency(30), lattice)
    with pytest.raises(ValueError, match="k=6 needs at least 7 peers, have 5"):
        topologies.get("small-world", k=6).neighbours(5, 0)
    with pytest.raises(ValueError, match="even"):
        topologies.get("small-world", k=3)
    with pytest.raises(ValueError, match="beta must be in"):
        topologies.get("small-world", beta=-0.1)


# --- edge-list files -----------------------------------------------------------------------


def test_text_edge_list(tmp_path: Path) -> None:
    path = tmp_path / "g.txt"
    path.write_text("# a path with a chord\n0 1\n1 2   # middle\n\n2 3\n3 0\n0 2\n")
    t = topologies.get("file", path=str(path))
    assert t.fixed_n == 4 and not t.directed and not t.time_varying
    assert [t.neighbours(4, i) for i in range(4)] == [[1, 2, 3], [0, 2], [0, 1, 3], [0, 2]]
    assert t == topologies.parse(f"file:path={path}")
    assert topologies.parse(t.spec) == t


def test_toml_edge_list_directed_and_undirected(tmp_path: Path) -> None:
    directed = tmp_path / "d.toml"
    directed.write_text("directed = true\nedges = [[0, 1], [1, 2], [2, 0]]\n")
    t = topologies.get("file", path=directed)
    assert t.directed
    assert [t.neighbours(3, i) for i in range(3)] == [[1], [2], [0]]
    assert topologies.get("ring").directed is False  # the instance flag did not leak to the class
    undirected = tmp_path / "u.toml"
    undirected.write_text("peers = 3\nedges = [[0, 1], [1, 2]]\n")
    u = topologies.get("file", path=str(undirected))
    assert not u.directed and u.neighbours(3, 1) == [0, 2] and u.neighbours(3, 2) == [1]
    single = tmp_path / "one.toml"
    single.write_text("peers = 1\nedges = []\n")
    assert topologies.get("file", path=str(single)).neighbours(1, 0) == []


@pytest.mark.parametrize(
    ("name", "text", "problem"),
    [
        ("bad.txt", "0 1\n1 2 3\n", "line 2: expected 'i j'"),
        ("word.txt", "0 one\n", "line 1"),
        ("loop.txt", "0 1\n1 1\n", "self-loop 1 1"),
        ("neg.txt", "0 1\n-1 0\n", "names peer -1, outside"),
        ("split.txt", "0 1\n2 3\n", "disconnected (2 components): peer 2 cannot reach peer 0"),
        ("empty.txt", "# nothing\n", "no edges"),
        ("outside.toml", "peers = 3\nedges = [[0, 1], [1, 5]]\n", "names peer 5, outside [0, 3)"),
        ("key.toml", "edge = [[0, 1]]\n", "unknown key(s) edge"),
        ("missing.toml", "directed = true\n", "missing 'edges"),
        ("pair.toml", "edges = [[0, 1, 2]]\n", "edges[0] must be a pair"),
        ("flag.toml", "directed = 1\nedges = [[0, 1]]\n", "'directed' must be true or false"),
        ("syntax.toml", "edges = [[0, 1]\n", "invalid TOML"),
        ("gap.toml", "peers = 3\nedges = [[0, 1]]\n", "peer 2 cannot reach peer 0"),
    ],
)
def test_edge_list_errors_name_the_problem(tmp_path: Path, name: str, text: str, problem: str) -> None:
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(ValueError) as info:
        topologies.get("file", path=str(path))
    assert problem in str(info.value) and str(path) in str(info.value)


def test_edge_list_has_a_fixed_size_and_needs_a_readable_path(tmp_path: Path) -> None:
    path = tmp_path / "g.txt"
    path.write_text("0 1\n1 2\n")
    t = topologies.get("file", path=str(path))
    with pytest.raises(ValueError, match=r"graph on 3 peers \(0..2\); asked for 5 peers"):
        t.neighbours(5, 0)
    with pytest.raises(ValueError, match="asked for 2 peers"):
        t.adjacency(2)
    with pytest.raises(ValueError, match="cannot read"):
        topologies.get("file", path=str(tmp_path / "nope.txt"))
    with pytest.raises(ValueError, match="needs parameter path"):
        topologies.get("file")


# --- parameters and specs ----------------------------------------------------------------


PARAMS: dict[str, st.SearchStrategy[dict[str, object]]] = {
    "erdos-renyi": st.fixed_dictionaries(
        {}, optional={"p": st.floats(0.0, 1.0), "seed": st.integers(0, 2**40)}
    ),
    "random-regular": st.fixed_dictionaries(
        {}, optional={"degree": st.integers(1, 50), "seed": st.integers(0, 2**40)}
    ),
    "small-world": st.fixed_dictionaries(
        {},
        optional={
            "k": st.integers(1, 10).map(lambda h: 2 * h),
            "beta": st.floats(0.0, 1.0),
            "seed": st.integers(0, 2**40),
        },
    ),
    "base-k": st.fixed_dictionaries({}, optional={"k": st.integers(1, 9)}),
}


@pytest.mark.parametrize("name", DEFAULTS)
@settings(deadline=None, max_examples=30)
@given(data=st.data())
def test_parse_round_trips_the_spec(name: str, data: st.DataObject) -> None:
    params = data.draw(PARAMS.get(name, st.just({})))
    t = topologies.get(name, **params)
    assert topologies.parse(t.spec) == t
    assert topologies.get(name, **t.params) == t
    assert t.spec.startswith(name)


def test_parse_examples() -> None:
    assert topologies.parse("ring") == topologies.get("ring")
    assert topologies.parse(" erdos-renyi : p=0.3 , seed=1 ") == topologies.get("erdos-renyi", p=0.3, seed=1)
    assert topologies.parse("random-regular:degree=4").params == {"degree": 4, "seed": 0}
    assert topologies.parse("random-regular:degree=none") == topologies.get("random-regular")
    assert topologies.parse("small-world:k=4,beta=0.2").spec == "small-world:k=4,beta=0.2"
    assert topologies.parse("erdos-renyi:p=1").spec == "erdos-renyi:p=1.0"
    assert topologies.parse("ring:") == topologies.get("ring")
    assert topologies.parameters("small-world") == {"k": int, "beta": float, "seed": int}


@pytest.mark.parametrize(
    ("spec", "problem"),
    [
        ("moebius", "unknown topology 'moebius'; known topologies: ring"),
        ("erdos-renyi:q=1", "has no parameter q; its parameters are p, seed"),
        ("ring:k=2", "'ring' has no parameter k; it takes no parameters"),
        ("erdos-renyi:p", "'p' must look like param=value"),
        ("erdos-renyi:p=0.1,p=0.2", "parameter p given twice"),
        ("erdos-renyi:p=abc", "p must be a number, got 'abc'"),
        ("random-regular:degree=2.5", "degree must be an integer, got '2.5'"),
        ("random-regular:degree=5", None),
        ("small-world:beta=2", "beta must be in [0, 1]"),
    ],
)
def test_parse_errors_name_the_problem(spec: str, problem: str | None) -> None:
    if problem is None:  # a valid spec whose degree only fails for too few peers
        with pytest.raises(ValueError, match="needs at least 6 peers, have 4"):
            topologies.parse(spec).adjacency(4)
        return
    with pytest.raises(ValueError) as info:
        topologies.parse(spec)
    assert problem in str(info.value)


@pytest.mark.parametrize(
    ("params", "problem"),
    [
        ({"degree": 2.5}, "degree must be an integer"),
        ({"degree": True}, "degree must be an integer"),
        ({"seed": "3"}, "seed must be an integer"),
    ],
)
def test_get_checks_python_values(params: dict[str, object], problem: str) -> None:
    with pytest.raises(ValueError, match=problem):
        topologies.get("random-regular", **params)


def test_get_accepts_numpy_and_int_values() -> None:
    t = topologies.get("erdos-renyi", p=1, seed=np.int64(3))
    assert isinstance(t, topologies.ErdosRenyi)
    assert t.p == 1.0 and type(t.p) is float and type(t.seed) is int


# --- describe -------------------------------------------------------------------------------


def test_describe_ring_of_eight() -> None:
    ring = topologies.get("ring")
    d = topologies.describe(ring, 8)
    assert d["degree"] == 2.0 and d["max_degree"] == 2 and d["diameter"] == 4
    assert d["spectral_gap"] == pytest.approx(spectral_gap(mixing_matrix(ring, 8)), abs=1e-12)
    assert d["spectral_gap"] == pytest.approx(1 - (1 + 2 * math.cos(2 * math.pi / 8)) / 3, abs=1e-12)
    assert {k: d[k] for k in ("name", "spec", "peers", "directed", "time_varying", "period", "weights")} == {
        "name": "ring",
        "spec": "ring",
        "peers": 8,
        "directed": False,
        "time_varying": False,
        "period": 1,
        "weights": "metropolis-hastings",
    }


def test_describe_time_varying_and_disconnected() -> None:
    d = topologies.describe(topologies.get("one-peer-exponential"), 8)
    assert d["degree"] == 1.0 and d["period"] == 3 and d["diameter"] == 2
    assert d["spectral_gap"] == pytest.approx(1.0, abs=1e-12) and d["weights"] == "uniform"
    # One random out-neighbour per member: some rounds split into islands.
    single = topologies.get("random-regular", degree=1)
    diameters = [topologies.describe(single, 20, r)["diameter"] for r in range(20)]
    assert None in diameters and any(isinstance(x, int) for x in diameters)
    alone = topologies.describe(topologies.get("complete"), 1)
    assert (alone["degree"], alone["max_degree"], alone["diameter"], alone["spectral_gap"]) == (0.0, 0, 0, 1.0)


# --- drawing --------------------------------------------------------------------------------


def _decode_png(data: bytes) -> np.ndarray:
    """The (H, W, 3) pixels of an unfiltered 8-bit RGB PNG, checking every chunk's CRC."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    pos, chunks = 8, {}
    while pos < len(data):
        (length,) = struct.unpack(">I", data[pos : pos + 4])
        tag, body = data[pos + 4 : pos + 8], data[pos + 8 : pos + 8 + length]
        (crc,) = struct.unpack(">I", data[pos + 8 + length : pos + 12 + length])
        assert crc == zlib.crc32(tag + body)
        chunks[tag] = body
        pos += 12 + length
    w, h, depth, colour, _, _, _ = struct.unpack(">IIBBBBB", chunks[b"IHDR"])
    assert (depth, colour) == (8, 2) and b"IEND" in chunks
    rows = np.frombuffer(zlib.decompress(chunks[b"IDAT"]), np.uint8).reshape(h, 1 + 3 * w)  # (H, 1 + 3W)
    assert (rows[:, 0] == 0).all()
    return rows[:, 1:].reshape(h, w, 3)


def _pixel(image: np.ndarray, xy: np.ndarray) -> tuple[int, ...]:
    return tuple(int(c) for c in image[int(round(xy[1])), int(round(xy[0]))])


def test_builtin_drawing_shows_members_and_edges() -> None:
    size = 200
    xy = drawing.circle_layout(8, size)  # (8, 2)
    assert xy[0].tolist() == pytest.approx([100, 16])  # member 0 on top, 8% margin
    ring = drawing.render(topologies.get("ring").adjacency(8), size)
    assert ring.shape == (size, size, 3) and ring.dtype == np.uint8
    assert _decode_png(drawing.encode_png(ring)).tolist() == ring.tolist()
    assert all(_pixel(ring, p) == drawing.NODE for p in xy)
    assert _pixel(ring, (xy[0] + xy[1]) / 2) == drawing.EDGE
    assert _pixel(ring, (xy[0] + xy[4]) / 2) == drawing.BACKGROUND  # no chord on a ring
    assert tuple(ring[0, 0]) == drawing.BACKGROUND
    full = drawing.render(topologies.get("complete").adjacency(8), size)
    assert _pixel(full, (xy[0] + xy[4]) / 2) == drawing.EDGE
    one_way = np.zeros((8, 8), dtype=bool)
    one_way[0, 4] = True
    arrow = drawing.render(one_way, size, directed=True)
    assert _pixel(arrow, xy[0] + 0.3 * (xy[4] - xy[0])) == drawing.EDGE
    assert _pixel(arrow, xy[0] + 0.85 * (xy[4] - xy[0])) == drawing.ARROW  # the head end


def test_save_png_writes_a_png(tmp_path: Path) -> None:
    path = tmp_path / "g.png"
    used = drawing.save_png(topologies.get("star").adjacency(5), str(path), title="star")
    data = path.read_bytes()
    assert used in ("matplotlib", "builtin") and data[:8] == b"\x89PNG\r\n\x1a\n"
    if used == "builtin":
        assert _decode_png(data).shape == (480, 480, 3)
    with pytest.raises(ValueError, match="uint8"):
        drawing.encode_png(np.zeros((4, 4, 3)))


# -- closed forms (topologies.cayley): graphs that look the same from every member ------------------------------


def _dense_describe(topology: Topology, n: int, r: int) -> dict[str, object]:
    """describe()'s numbers the slow way: the period's n x n matrices, BFS from every member, an SVD."""
    graphs = [topology.adjacency(n, x) for x in range(r, r + topology.period(n))]
    out = np.array([a.sum(axis=1) for a in graphs])  # (period, n)
    try:
        hops: int | None = diameter(np.logical_or.reduce(graphs))
    except ValueError:
        hops = None
    product = np.eye(n)
    for x in range(r, r + topology.period(n)):
        a = topology.adjacency(n, x)
        product = product @ (uniform_weights(a) if topology.directed else metropolis_hastings(a))
    return {"degree": float(out.mean()), "max_degree": int(out.max()), "diameter": hops, "spectral_gap": spectral_gap(product)}


CLOSED_FORM = [
    ("ring", [1, 2, 3, 5, 8, 64]),
    ("exponential", [2, 5, 12, 64]),
    ("complete", [1, 2, 7]),
    ("one-peer-exponential", [5, 12, 64]),
    ("torus", [4, 6, 9, 12, 64]),  # ceil(sqrt(n)) divides n: full rows
    ("hypercube", [1, 2, 16, 64]),
    ("base-k:k=2", [9, 27]),
]


@pytest.mark.parametrize(("spec", "sizes"), CLOSED_FORM, ids=[s for s, _ in CLOSED_FORM])
def test_closed_form_description_equals_the_dense_computation(spec: str, sizes: list[int]) -> None:
    t = topologies.parse(spec)
    for n in sizes:
        for r in (0, 1):
            assert t.cayley(n, r) is not None, (spec, n)
            graph = t.cayley(n, r)
            assert graph is not None
            assert [graph.neighbours(i) for i in range(n)] == [t.neighbours(n, i, r) for i in range(n)]
            fast, slow = topologies.describe(t, n, r), _dense_describe(t, n, r)
            assert fast["spectral_gap"] == pytest.approx(slow.pop("spectral_gap"), rel=1e-9, abs=1e-12), (spec, n, r)
            assert {k: fast[k] for k in slow} == slow, (spec, n, r)


def test_graphs_that_differ_from_member_to_member_have_no_closed_form() -> None:
    assert topologies.get("torus").cayley(10) is None  # 4 columns, a short last row
    assert topologies.get("hypercube").cayley(12) is None
    assert topologies.get("base-k", k=2).cayley(10) is None
    assert topologies.get("star").cayley(5) is None
    assert topologies.get("erdos-renyi").cayley(5) is None


def test_describe_cost_is_small_for_closed_forms_and_n_squared_for_the_rest() -> None:
    ring_bytes, ring_seconds = topologies.describe_cost(topologies.get("ring"), 100_000)
    assert ring_bytes < 100e6 and ring_seconds < 10
    # An Erdos-Renyi graph is sampled as a whole: its cost is estimated without drawing it.
    er_bytes, er_seconds = topologies.describe_cost(topologies.get("erdos-renyi"), 100_000)
    assert er_bytes >= 8 * 100_000**2 and er_seconds > 3600
    star_bytes, _ = topologies.describe_cost(topologies.get("star"), 2000)
    assert 8 * 2000**2 <= star_bytes <= 100 * 2000**2
