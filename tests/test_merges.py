"""``PendingMerges`` (``gossiptrain.protocol.merges``): the sum of merges a safe point adds, in few passes.

Whatever the order of merges, undos and safe points, what the sum adds is
``sum_i a_i * delta_i`` (hypothesis, float64 against a reference); a
difference it holds is never written; and what a safe point hands on
(``moved``) keeps its values while the next merges are made.
"""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gossiptrain.protocol.merges import PendingMerges
from gossiptrain.state.host_buffers import BufferPool

OPS = st.lists(
    st.one_of(
        st.tuples(st.just("add"), st.floats(-1, 1), st.floats(-10, 10)),  # a held difference, its weight
        st.tuples(st.just("difference"), st.floats(-1, 1), st.floats(-10, 10)),  # remote - own, computed here
        st.tuples(st.just("safe point"), st.just(0.0), st.just(0.0)),
    ),
    min_size=1,
    max_size=40,
)


def shaped(v: float) -> list[torch.Tensor]:
    return [torch.tensor([v, -2 * v], dtype=torch.float64), torch.tensor([[0.5 * v]], dtype=torch.float64)]


@settings(max_examples=80, deadline=None)
@given(ops=OPS)
def test_a_safe_point_adds_the_weighted_sum_of_its_merges_and_held_differences_stay_as_they_were(
    ops: list[tuple[str, float, float]],
) -> None:
    params = shaped(0.0)
    pending = PendingMerges(params, BufferPool())
    expected = shaped(0.0)  # the reference: every merge added at once, in float64
    held: list[tuple[list[torch.Tensor], list[torch.Tensor]]] = []  # (a difference handed to add, a copy of it)
    handed: list[tuple[list[torch.Tensor], float, list[torch.Tensor]]] = []  # what safe points handed on, and its values then
    for op, a, v in ops:
        if op == "add":
            delta = shaped(v)
            pending.add(delta, a)
            held.append((delta, [t.clone() for t in delta]))
            expected = [e + a * d for e, d in zip(expected, shaped(v))]
        elif op == "difference":
            remote, own = shaped(v), shaped(0.25 * v)
            pending.add_difference(remote, own, a)
            expected = [e + a * (r - o) for e, r, o in zip(expected, remote, own)]
        else:
            assert all(torch.allclose(p + x, e) for p, x, e in zip(params, pending.values(), expected))
            pending.add_to(params)
            terms, scale = pending.moved()
            if terms:
                handed.append((terms, scale, [scale * t for t in terms]))
            pending.clear()
            assert pending.empty and all(float(x.abs().max()) == 0.0 for x in pending.values())
            assert all(torch.allclose(p, e) for p, e in zip(params, expected))
    for delta, copy in held:
        assert all(torch.equal(d, c) for d, c in zip(delta, copy))
    # Everything handed on is still held here: so nothing merged since wrote to it (the pool hands out only what
    # nobody holds), and the sum of now is elsewhere.
    now = {x.data_ptr() for x in pending.moved()[0]}
    for terms, scale, values in handed:
        assert all(torch.equal(scale * t, v) for t, v in zip(terms, values))
        assert all(t.data_ptr() not in now for t in terms)


def test_one_merge_between_safe_points_is_one_pass_and_what_was_handed_on_is_not_written_by_the_next() -> None:
    params = [torch.zeros(4)]
    pool = BufferPool()
    pending = PendingMerges(params, pool)
    pending.add_difference([torch.full((4,), 3.0)], [torch.ones(4)], 0.5)  # sum = 0.5 * 2
    terms, scale = pending.moved()
    assert scale == 0.5 and torch.equal(terms[0], torch.full((4,), 2.0))  # the difference itself, not scaled yet
    pending.add_to(params)
    handed = pending.moved()
    pending.clear()
    assert torch.equal(params[0], torch.ones(4))
    pending.add_difference([torch.full((4,), 9.0)], [torch.ones(4)], 0.5)  # the network side merges again at once
    assert torch.equal(handed[0][0], torch.full((4,), 2.0))  # the drift correction reads it after the lock is let go
    assert pending.moved()[0][0].data_ptr() != handed[0][0].data_ptr()
    del handed, terms
    pending.add_to(params)
    pending.clear()
    pending.add_difference([torch.full((4,), 1.0)], [torch.ones(4)], 0.5)
    assert pool.made == 2  # two accumulators in turn, made once: nothing more allocated
