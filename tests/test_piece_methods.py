"""A split peer's methods beyond plain averaging, per piece (``gossiptrain.runtime.piece_methods``, issue 48).

What must hold: a model's pieces corrected one by one are the whole model
corrected, bit for bit (the drift correction acts element by element, so
this holds as long as every rank runs by the same numbers); every rank
runs by the numbers its group agreed (the gain, from running statistics on
any rank; the leader's round trip; the leader's members); Adam's step is
scaled by the square-root rule, SGD's is not.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch

from gossiptrain.config import GossipConfig
from gossiptrain.net.addressing import free_loopback_port
from gossiptrain.protocol.drift import DriftCorrection
from gossiptrain.runtime.piece_methods import PieceMethods

from .swarm import Procs

RANKS = 2


def run_ranks(procs: Procs, tmp_path: Path, *mode: str) -> list[dict[str, Any]]:
    """One peer of 2 ranks (``tests/piece_methods_ranks.py``, ``mode`` its last argument) to its end; each rank's report."""
    port = str(free_loopback_port())
    outs = [tmp_path / f"rank{r}.json" for r in range(RANKS)]
    ranks = [procs.start(str(r), port, str(outs[r]), *mode, name=f"methods{r}", module="tests.piece_methods_ranks")
             for r in range(RANKS)]
    assert [p.wait(120) for p in ranks] == [0, 0], [p.output()[-3000:] for p in ranks]
    return [json.loads(o.read_text()) for o in outs]


def test_the_drift_correction_piece_by_piece_is_the_whole_models_bit_for_bit() -> None:
    """Two ranks' pieces (FSDP2's cut: halves along dimension 0) and the whole model take the same local steps and
    merges; the round trip changes mid-run and the rate falls, as the leader's news and a scheduler would: the
    gathered pieces are the whole model, bit for bit, and the correction moved them (not plain averaging)."""
    g = torch.Generator().manual_seed(0)
    whole = [torch.randn(6, 3, generator=g), torch.randn(4, generator=g)]
    plain = [t.clone() for t in whole]
    pieces = [[t.chunk(RANKS, 0)[r].clone() for t in whole] for r in range(RANKS)]
    lr = [0.1]
    reference = DriftCorrection(whole, 4.0)
    reference.rate = lambda: lr[0]
    methods = [PieceMethods(p, GossipConfig(), running_stats=False) for p in pieces]
    for m in methods:
        assert m.drift is not None
        m.drift.rate = lambda: lr[0]
    for step in range(300):
        local = [torch.randn(t.shape, generator=g) * 0.01 for t in whole]  # the local step, then the safe point
        merge = [torch.randn(t.shape, generator=g) * 0.05 if step % 3 == 0 else torch.zeros(t.shape) for t in whole]
        round_trip = None if step < 50 else 20.0 if step < 150 else 3.0  # unknown, a far link, a near one
        if step == 200:
            lr[0] = 0.01
        for t, d, m in zip(whole + plain, local + local, merge + merge):
            t.add_(d)
        reference.before()
        for t, m in zip(whole + plain, merge + merge):
            t.add_(m)
        reference.after(round_trip_steps=round_trip)
        for r, (piece, ours) in enumerate(zip(pieces, methods)):
            for t, d in zip(piece, local):
                t.add_(d.chunk(RANKS, 0)[r])
            ours.before()
            for t, m in zip(piece, merge):
                t.add_(m.chunk(RANKS, 0)[r])
            ours.after(round_trip)
    assert methods[0].drift.memory == methods[1].drift.memory == reference.memory == 100  # type: ignore[union-attr]
    for i, t in enumerate(whole):
        assert torch.equal(torch.cat([p[i] for p in pieces]), t)
        assert not torch.allclose(t, plain[i])


def test_quasi_global_momentum_piece_by_piece_is_the_whole_models_bit_for_bit() -> None:
    """Two ranks' pieces, each with its own SGD (momentum 0.9) and ``PieceMethods`` asking for quasi-global momentum,
    and the whole model with one SGD and ``QuasiGlobalMomentum``, through the same gradients and merges past the
    warmup: each step the ranks agree it runs (every rank ready), measure their pieces' changes, and apply with the
    sum of their squares, as ``SplitGroup`` gathers it. The gathered pieces and their momentum buffers are the whole
    model's, bit for bit, and differ from the optimizer's own momentum's."""
    from gossiptrain.protocol.momentum import WARMUP_SAFE_POINTS, QuasiGlobalMomentum

    g = torch.Generator().manual_seed(3)
    whole = [torch.randn(6, 3, generator=g).requires_grad_(), torch.randn(4, generator=g).requires_grad_()]
    own = [t.detach().clone().requires_grad_() for t in whole]  # the optimizer's own momentum, for contrast
    pieces = [[t.detach().chunk(RANKS, 0)[r].clone().requires_grad_() for t in whole] for r in range(RANKS)]
    opt, own_opt = torch.optim.SGD(whole, lr=0.1, momentum=0.9), torch.optim.SGD(own, lr=0.1, momentum=0.9)
    reference = QuasiGlobalMomentum(opt)
    optimizers = [torch.optim.SGD(p, lr=0.1, momentum=0.9) for p in pieces]
    methods = [PieceMethods(p, GossipConfig(momentum_mode="quasi-global", drift_gain=0.0), running_stats=False)
               for p in pieces]
    for m, o in zip(methods, optimizers):
        assert m.bind(o) == ["quasi-global momentum"]
    ran = 0
    for step in range(WARMUP_SAFE_POINTS + 40):
        grads = [torch.randn(t.shape, generator=g) for t in whole]
        merge = [torch.randn(t.shape, generator=g) * 0.05 if step % 3 == 0 else torch.zeros(t.shape) for t in whole]
        for params, o, chunk in [(whole, opt, None), (own, own_opt, None)] + [
            (p, o, r) for r, (p, o) in enumerate(zip(pieces, optimizers))
        ]:
            for t, d in zip(params, grads):
                t.grad = d.clone() if chunk is None else d.chunk(RANKS, 0)[chunk].clone()
            o.step()
            with torch.no_grad():
                for t, m in zip(params, merge):
                    t.add_(m if chunk is None else m.chunk(RANKS, 0)[chunk])
        reference()
        runs = all(m.momentum_ready() for m in methods)  # the group's word (every rank's, and the link keeps up)
        squares = [m.momentum_measure(runs) for m in methods]
        if squares[0] is not None:
            ran += 1
            for m in methods:
                m.momentum_apply(math.sqrt(sum(squares)))  # type: ignore[arg-type]
        else:
            assert squares == [None] * RANKS
    assert ran == 40 and reference.clipped == methods[0].momenta[0].clipped == 0
    for i, t in enumerate(whole):
        assert torch.equal(torch.cat([p[i] for p in pieces]), t)
        buffers = [optimizers[r].state[pieces[r][i]]["momentum_buffer"] for r in range(RANKS)]
        assert torch.equal(torch.cat(buffers), opt.state[t]["momentum_buffer"])
        assert not torch.allclose(t, own[i])


def test_the_guard_on_pieces_decides_and_puts_back_as_the_guard_of_the_whole_model() -> None:
    """Pieces judged by the sum of their squared norms (what ``SplitGroup`` gathers), against the whole model's guard
    judging its own norm, through a slow growth past the warmup and a NaN: the same verdict at every safe point, the
    same counts, and the pieces are the whole model bit for bit after every put-back."""
    from gossiptrain.protocol.stability import DRIFT_CORRECTION, WARMUP, StabilityGuard

    g = torch.Generator().manual_seed(1)
    whole = [torch.randn(6, 3, generator=g), torch.randn(4, generator=g)]
    pieces = [[t.chunk(RANKS, 0)[r].clone() for t in whole] for r in range(RANKS)]
    reference = StabilityGuard(whole)
    drift = DriftCorrection(whole, 4.0)
    reference.add(DRIFT_CORRECTION, drift)
    methods = [PieceMethods(p, GossipConfig(), running_stats=False) for p in pieces]
    verdicts = []
    for step in range(1, WARMUP + 200):
        local = [torch.randn(t.shape, generator=g) * 0.01 for t in whole]
        if WARMUP + 20 <= step < WARMUP + 30:  # a blow-up under way: the model grows 1.5x a step
            local = [t * 0.5 for t in whole]
        for t, d in zip(whole, local):
            t.add_(d)
        for r, piece in enumerate(pieces):
            for t, d in zip(piece, local):
                t.add_(d.chunk(RANKS, 0)[r])
        if step == WARMUP + 120:
            whole[1][0] = pieces[0][1][0] = float("nan")  # (rank 0 holds the first half of every tensor)
        squares = [m.piece_square() for m in methods]  # the safe point's gather: taken before anyone judges
        ours = [m.judge(squares) for m in methods]  # type: ignore[arg-type]
        theirs = reference.judge(step, math.sqrt(reference.squared_norm()))
        verdicts.append(theirs)
        assert ours == [theirs, theirs], step
        for i, t in enumerate(whole):
            assert torch.equal(torch.cat([p[i] for p in pieces]), t), (step, i)
    stats = reference.stats.to_dict()
    assert all(m.guard is not None and m.guard.stats.to_dict() == stats for m in methods), stats
    assert stats["guard_backoffs"] >= 1 and stats["guard_restores"] == 1 and any(verdicts)


def test_a_model_with_running_statistics_on_any_rank_is_not_corrected_on_any() -> None:
    piece = [torch.zeros(3)]
    assert PieceMethods(piece, GossipConfig(), running_stats=True).drift is None
    assert PieceMethods(piece, GossipConfig(drift_gain=2.0), running_stats=True).gain == 2.0  # asked for: given
    assert PieceMethods(piece, GossipConfig(drift_gain=0.0), running_stats=False).drift is None


@pytest.mark.parametrize(("mode", "optimizer", "scaled"), [
    ("auto", "adam", True), ("auto", "sgd", False), ("sqrt", "sgd", True), ("none", "adam", False),
])
def test_an_optimizer_steps_at_the_square_root_rule_for_the_members_the_group_agreed(
    mode: str, optimizer: str, scaled: bool
) -> None:
    w = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.Adam([w], lr=0.01) if optimizer == "adam" else torch.optim.SGD([w], lr=0.01)
    methods = PieceMethods([w.data], GossipConfig(lr_scaling=mode), running_stats=False)
    got = methods.bind(opt)
    assert ("square-root lr scaling" in got) == scaled
    methods.members = 4  # as the leader's news named them at the last safe point
    seen: list[float] = []
    opt.register_step_pre_hook(lambda o, *_: seen.append(o.param_groups[0]["lr"]))
    w.grad = torch.ones(3)
    opt.step()
    assert seen == [pytest.approx(0.02 if scaled else 0.01)] and opt.param_groups[0]["lr"] == 0.01
    assert methods.lr_scale == (2.0 if scaled else 1.0)
    methods.close()
    opt.step()
    assert seen[-1] == 0.01  # closed: the user's rate


def test_every_rank_runs_by_the_numbers_its_group_agreed(procs: Procs, tmp_path: Path) -> None:
    """One peer of 2 ranks (``tests/piece_methods_ranks.py``): FSDP2 without running statistics gets the gain on
    both ranks; pipeline stages with a BatchNorm in the second only get none on either; the leader's round trip
    (20 steps: a memory of 300) and members (5) are every rank's, and both ranks' Adam steps are scaled alike."""
    got = run_ranks(procs, tmp_path)
    for rank in got:
        assert rank["fsdp"]["gain"] == 4.0 and rank["fsdp"]["memory"] == 300
        assert rank["pipeline"]["gain"] == 0.0 and rank["pipeline"]["memory"] is None
        for kind in ("fsdp", "pipeline"):
            assert rank[kind]["members"] == 5 and rank[kind]["told"] == {"members": 5.0}
            assert rank[kind]["lr_in_step"] == pytest.approx(0.01 * math.sqrt(5)) and rank[kind]["lr_after"] == 0.01


def test_quasi_global_momentum_runs_on_every_rank_at_the_same_steps_once_every_rank_is_ready(
    procs: Procs, tmp_path: Path
) -> None:
    """One FSDP2 peer of 2 ranks (``tests/piece_methods_ranks.py qgm``), rank 1's optimizer bound 3 steps after rank
    0's: quasi-global momentum runs at the same steps on both (the second gather taken by both or neither), first
    where rank 1 is past its warmup, and SGD's buffers stay the DTensors it made (written through their shards)."""
    from gossiptrain.protocol.momentum import WARMUP_SAFE_POINTS

    from .piece_methods_ranks import LATE_BIND

    got = run_ranks(procs, tmp_path, "qgm")
    assert got[0]["ran"] == got[1]["ran"] and got[0]["ran"], got
    assert got[0]["ran"][0] == LATE_BIND + WARMUP_SAFE_POINTS  # rank 1's 21st safe point with its optimizer
    assert all(rank["dtensor_buffers"] for rank in got), got


def test_the_final_phase_corrects_nothing_more() -> None:
    """Safe points without local steps (the final phase): what is owed is not added, so the models only meet."""
    piece = [torch.zeros(3)]
    methods = PieceMethods(piece, GossipConfig(), running_stats=False)
    methods.before()
    piece[0].add_(1.0)  # a merge
    methods.after(None)
    moved = piece[0].clone()
    assert not torch.equal(moved, torch.ones(3))  # corrected: more than the merge
    methods.no_more_steps()
    for _ in range(3):
        methods.before()
        methods.after(None)
    assert torch.equal(piece[0], moved)


def test_one_ranks_blow_up_backs_off_and_puts_back_every_ranks_piece_at_the_same_safe_point(
    procs: Procs, tmp_path: Path
) -> None:
    """One peer of 2 FSDP2 ranks, safe points without local steps (``tests/piece_methods_ranks.py guard``): rank
    1's piece grows 10x, then rank 0's gets a NaN. Each time both ranks' guards see it at the same safe point (the
    whole model's norm, summed from the pieces): the drift correction backed off on both, every piece put back to
    what it was, every rank's optimizer restarted; the NaN restores both ranks, not only the one that had it."""
    got = run_ranks(procs, tmp_path, "guard")
    assert got[0] == got[1], got  # every rank decided alike
    grew, nan = got[0]["after_10"], got[0]["after_60"]
    assert grew == {"backoffs": 1, "restores": 0, "off": "drift correction", "back": True, "momentum": 0}, grew
    assert nan["restores"] == 1 and nan["back"] and nan["momentum"] == 0, nan
