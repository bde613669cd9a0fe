"""Rank-matched, all-or-none piece exchanges (``gossiptrain.protocol.piece_exchange``), with no network.

Two peers of 2 ranks each hold a model split as FSDP2 splits it (every
tensor cut in two along dimension 0). The driver's part (sending, the
group's gather of statuses and broadcast of outcomes) is played here by
plain calls. What must hold: averaging piece by piece is averaging of the
whole, bit for bit against unsplit peers running today's pairwise
averaging, with a refused and a timed-out exchange among the others, and
an exchange is applied on every rank of both peers or on none.
"""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gossiptrain.config import GossipConfig
from gossiptrain.net.kinds import XREP, XREQ
from gossiptrain.protocol.averaging_events import AtSafePoint, Received
from gossiptrain.protocol.compression import get_codec
from gossiptrain.protocol.pairwise import PairwiseAveraging
from gossiptrain.protocol.piece_exchange import (
    HOLD_TIMEOUTS,
    XPNAK,
    XPREP,
    XPREQ,
    Outcome,
    RankExchanges,
    Status,
    decide,
)
from gossiptrain.protocol.pieces import PieceEntry, PieceLayout, gather
from gossiptrain.protocol.staleness import StalenessPolicy

CONFIG = GossipConfig(compression="none", exchange_timeout_min=0.5, exchange_timeout_max=4.0)
RANKS = 2
TIMEOUT = 1.0


def whole_model(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(6, 3, generator=g), "b": torch.randn(4, generator=g)}


def split(model: dict[str, torch.Tensor]) -> list[dict[str, torch.Tensor]]:
    """FSDP2's cut: every tensor in RANKS equal shards along dimension 0, each rank's its own memory."""
    return [{k: v.chunk(RANKS, 0)[r].clone() for k, v in model.items()} for r in range(RANKS)]


def layout_of(pieces: list[dict[str, torch.Tensor]]) -> PieceLayout:
    return PieceLayout("fsdp", tuple(
        tuple(PieceEntry(k, "float32", tuple(t.shape), 0) for k, t in piece.items()) for piece in pieces
    ))


class SplitPeer:
    """A peer of RANKS ranks: its pieces, one RankExchanges per rank, and the leader's bookkeeping."""

    def __init__(self, name: str, seed: int, staleness: StalenessPolicy | None = None) -> None:
        self.name = name
        self.pieces = split(whole_model(seed))
        self.layout = layout_of(self.pieces)
        self.ranks = [RankExchanges(p, self.layout.pieces[r], timeout=TIMEOUT, staleness=staleness)
                      for r, p in enumerate(self.pieces)]
        self.outcomes: dict[int, tuple[str, Outcome]] = {}  # leader: partners' word, handed out at our safe point

    def gathered(self) -> dict[str, torch.Tensor]:
        return gather(self.layout, self.pieces)

    def local_step(self, step: dict[str, torch.Tensor]) -> None:
        for r, piece in enumerate(self.pieces):
            for k, t in piece.items():
                t.add_(step[k].chunk(RANKS, 0)[r])

    def safe_point(self, now: float, partner: SplitPeer | None = None) -> None:
        """Decide our exchanges in flight over the ranks' statuses, hand out partners' outcomes, apply."""
        for xid in self.ranks[0].in_flight:
            outcome = decide([rank.status(xid, now) for rank in self.ranks])  # the group's gather
            if outcome == Outcome.WAIT:
                continue
            for rank in self.ranks:
                rank.commit(xid) if outcome == Outcome.COMMIT else rank.abort(xid)
            assert partner is not None
            partner.outcomes[xid] = (self.name, outcome)  # XPEND, leader to leader
        for xid, (requester, outcome) in self.outcomes.items():  # the group's broadcast
            for rank in self.ranks:
                rank.settle(xid, outcome, requester)
        self.outcomes.clear()
        for rank in self.ranks:
            rank.apply()


def make_pairwise(model: dict[str, torch.Tensor], seed: int) -> PairwiseAveraging:
    machine = PairwiseAveraging(model, CONFIG, random.Random(seed))
    machine.handle(AtSafePoint(step=0, partners=[]), 0.0)
    return machine


def unsplit_exchange(a: PairwiseAveraging, b: PairwiseAveraging, step: int, now: float) -> None:
    """Today's pairwise exchange, a asking b, both applying at their next safe point."""
    (req,) = a.handle(AtSafePoint(step=step, partners=["B"]), now)
    (rep,) = b.handle(Received("A", XREQ, req.xid, req.tensors, step=step), now)
    assert rep.kind == XREP
    a.handle(Received("B", XREP, rep.xid, rep.tensors, meta=dict(rep.meta), step=step), now)


def split_exchange(
    a: SplitPeer, b: SplitPeer, xid: int, now: float, *, refuse_rank: int | None = None, lose_reply_rank: int | None = None
) -> None:
    """The same exchange between split peers: every rank of a asks the same rank of b."""
    for r in range(RANKS):
        req = a.ranks[r].start(xid, b.name, 0.5, now)
        assert req.kind == XPREQ
        if r == refuse_rank:
            a.ranks[r].refused(b.name, xid)  # b's rank r answered XPNAK (busy, say): it holds nothing
            continue
        rep = b.ranks[r].serve(a.name, xid, req.tensors, req.meta, now)
        assert rep.kind == XPREP
        if r != lose_reply_rank:
            a.ranks[r].reply(b.name, xid, rep.tensors)


def test_averaging_piece_by_piece_is_averaging_of_the_whole_bit_for_bit_with_a_refused_and_a_timed_out_exchange() -> None:
    sa, sb = SplitPeer("A", 1), SplitPeer("B", 2)
    ua, ub = whole_model(1), whole_model(2)
    pa, pb = make_pairwise(ua, 1), make_pairwise(ub, 2)
    g = torch.Generator().manual_seed(9)
    now = 0.0
    for round_ in range(8):
        now += 0.1
        if round_ in (2, 5):  # refused by one rank of the server, then one rank's reply lost (it times out)
            kwargs = {"refuse_rank": 1} if round_ == 2 else {"lose_reply_rank": 0}
            split_exchange(sa, sb, 100 + round_, now, **kwargs)
            sa.safe_point(now, sb)
            if round_ == 5:
                assert [r.status(105, now) for r in sa.ranks] == [Status.WAITING, Status.READY]
                now += TIMEOUT  # rank 0's deadline passes: the group aborts
                sa.safe_point(now, sb)
            sb.safe_point(now)
            assert not any(r.held for r in sb.ranks) and not any(r.in_flight for r in sa.ranks)
        else:
            requester_split, server_split = (sa, sb) if round_ % 2 == 0 else (sb, sa)
            split_exchange(requester_split, server_split, 100 + round_, now)
            requester_split.safe_point(now, server_split)
            server_split.safe_point(now)
            requester, server = (pa, pb) if round_ % 2 == 0 else (pb, pa)
            unsplit_exchange(requester, server, round_ + 1, now)
            for m in (pa, pb):
                m.handle(AtSafePoint(step=round_ + 1, partners=[]), now)
        step_a = {k: torch.randn(v.shape, generator=g) * 0.1 for k, v in ua.items()}
        step_b = {k: torch.randn(v.shape, generator=g) * 0.1 for k, v in ub.items()}
        sa.local_step(step_a), sb.local_step(step_b)
        for k in ua:
            ua[k].add_(step_a[k]), ub[k].add_(step_b[k])
        sa.safe_point(now), sb.safe_point(now)
        pa.handle(AtSafePoint(step=100 + round_, partners=[]), now)
        pb.handle(AtSafePoint(step=100 + round_, partners=[]), now)
    for split_peer, whole in ((sa, ua), (sb, ub)):
        got = split_peer.gathered()
        for k in whole:
            assert torch.equal(got[k], whole[k]), k  # bit for bit
    committed = sum(r.stats.committed for r in sa.ranks + sb.ranks)
    aborted = sum(r.stats.aborted for r in sa.ranks)
    dropped = sum(r.stats.dropped for r in sb.ranks)
    assert committed == 6 * RANKS and aborted == 2 * RANKS and dropped == RANKS + 1  # round 2: rank 1 held nothing


def test_staleness_weights_per_piece_are_the_whole_models_bit_for_bit_and_past_the_bound_every_rank_refuses() -> None:
    """A at step 2 asks B at step 10, polynomial weights (exponent 1/2), bound 10: every rank of B serves at 1/2 times
    1/3 and says so, every rank of A applies that, and the models are what unsplit pairwise peers with the same policy
    hold, bit for bit. Then B at step 20: past the bound, every rank of B refuses and nothing moves."""
    config = replace(CONFIG, staleness_weighting="polynomial", staleness_exponent=0.5, staleness_bound=10)
    policy = StalenessPolicy("polynomial", 0.5, 10)
    sa, sb = SplitPeer("A", 1, policy), SplitPeer("B", 2, policy)
    ua, ub = whole_model(1), whole_model(2)
    pa, pb = PairwiseAveraging(ua, config, random.Random(1)), PairwiseAveraging(ub, config, random.Random(2))
    pb.handle(AtSafePoint(step=10, partners=[]), 0.0)
    (req,) = pa.handle(AtSafePoint(step=2, partners=["B"]), 0.0)
    (rep,) = pb.handle(Received("A", XREQ, req.xid, req.tensors, meta=dict(req.meta), step=2), 0.0)
    assert rep.kind == XREP and rep.meta["a"] == 0.5 * (1 + 8) ** -0.5
    pa.handle(Received("B", XREP, rep.xid, rep.tensors, meta=dict(rep.meta), step=10), 0.0)
    pa.handle(AtSafePoint(step=3, partners=[]), 0.1), pb.handle(AtSafePoint(step=11, partners=[]), 0.1)
    for rank in sa.ranks:
        rank.step = 2
    for rank in sb.ranks:
        rank.step = 10
    for r in range(RANKS):
        sent = sa.ranks[r].start(7, "B", 0.5, 0.0)
        assert sent is not None and sent.meta["step"] == 2
        answer = sb.ranks[r].serve("A", 7, sent.tensors, sent.meta, 0.0)
        assert answer.kind == XPREP and answer.meta["a"] == rep.meta["a"]
        sa.ranks[r].reply("B", 7, answer.tensors, answer.meta["a"])
    sa.safe_point(0.1, sb), sb.safe_point(0.1)
    for split_peer, whole in ((sa, ua), (sb, ub)):
        got = split_peer.gathered()
        assert all(torch.equal(got[k], whole[k]) for k in whole)  # bit for bit
    before = sa.gathered(), sb.gathered()
    for rank in sb.ranks:
        rank.step = 20  # 18 steps apart: past the bound
    for r in range(RANKS):
        sent = sa.ranks[r].start(8, "B", 0.5, 0.2)
        assert sent is not None
        assert sb.ranks[r].serve("A", 8, sent.tensors, sent.meta, 0.2).kind == XPNAK
        sa.ranks[r].refused("B", 8)
    sa.safe_point(0.3, sb), sb.safe_point(0.3)
    assert all(torch.equal(x[k], y[k]) for x, y in zip(before, (sa.gathered(), sb.gathered())) for k in x)
    assert [rank.stats.stale_dropped for rank in sb.ranks] == [1] * RANKS
    assert all(rank.stats.aborted == 1 and rank.stats.committed == 1 for rank in sa.ranks)


def test_a_requester_whose_models_norm_is_far_from_ours_is_refused_on_every_rank() -> None:
    """The guard's rule for partners, per piece: every rank carries the whole model's norm (the group's guard's), and
    a server NORM_RATIO times from it refuses on every rank, where 50 times is served."""
    from gossiptrain.protocol.stability import NORM_RATIO

    sa, sb = SplitPeer("A", 1), SplitPeer("B", 2)
    for xid, theirs in ((1, 1.5 * NORM_RATIO), (2, 0.5 * NORM_RATIO)):
        for rank in sa.ranks:
            rank.norm = theirs
        for rank in sb.ranks:
            rank.norm = 1.0
        kinds = []
        for r in range(RANKS):
            sent = sa.ranks[r].start(xid, "B", 0.5, 0.0)
            assert sent is not None and sent.meta["norm"] == theirs
            kinds.append(sb.ranks[r].serve("A", xid, sent.tensors, sent.meta, 0.0).kind)
        assert kinds == ([XPNAK] * RANKS if xid == 1 else [XPREP] * RANKS)
        for r in range(RANKS):
            sa.ranks[r].abort(xid)
            sb.ranks[r].settle(xid, Outcome.ABORT, "A")
    assert [rank.stats.norms_apart for rank in sb.ranks] == [1] * RANKS


def test_a_reply_at_a_weight_above_the_one_asked_for_fails_the_exchange() -> None:
    sa, sb = SplitPeer("A", 1), SplitPeer("B", 2)
    sent = sa.ranks[0].start(3, "B", 0.25, 0.0)
    assert sent is not None
    answer = sb.ranks[0].serve("A", 3, sent.tensors, sent.meta, 0.0)
    sa.ranks[0].reply("B", 3, answer.tensors, 0.5)  # more than asked: a partner that got it wrong
    assert sa.ranks[0].status(3, 0.0) == Status.FAILED


def test_the_sum_of_the_two_models_moves_only_by_local_steps_whatever_fails() -> None:
    sa, sb = SplitPeer("A", 3), SplitPeer("B", 4)
    total0 = {k: sa.gathered()[k] + sb.gathered()[k] for k in ("w", "b")}
    now = 0.0
    for xid, kwargs in enumerate([{}, {"refuse_rank": 0}, {"lose_reply_rank": 1}, {}, {"refuse_rank": 1}]):
        now += TIMEOUT + 0.1
        split_exchange(sa, sb, xid, now, **kwargs)  # type: ignore[arg-type]
        sa.safe_point(now + TIMEOUT, sb)
        sb.safe_point(now + TIMEOUT)
        total = {k: sa.gathered()[k] + sb.gathered()[k] for k in ("w", "b")}
        for k in total:
            torch.testing.assert_close(total[k], total0[k])
    assert sum(r.stats.committed for r in sa.ranks) == 2 * RANKS


def test_an_outcome_that_never_comes_leaves_the_server_as_it_was() -> None:
    sa, sb = SplitPeer("A", 5), SplitPeer("B", 6)
    before = sb.gathered()
    split_exchange(sa, sb, 1, 0.0)  # the requester dies before deciding: no XPEND ever
    assert all(r.held == (1,) for r in sb.ranks)
    late = HOLD_TIMEOUTS * TIMEOUT
    assert all(r.expired(late - 0.01) == [] for r in sb.ranks)
    expired = {e for r in sb.ranks for e in r.expired(late)}  # the union over the group's ranks
    assert expired == {(1, "A")}
    sb.outcomes.update({xid: (requester, Outcome.ABORT) for xid, requester in expired})
    sb.safe_point(late)
    after = sb.gathered()
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_a_piece_that_does_not_match_the_layout_or_is_not_finite_is_refused_and_nothing_is_held() -> None:
    sa, sb = SplitPeer("A", 7), SplitPeer("B", 8)
    req = sa.ranks[0].start(1, "B", 0.5, 0.0)
    wrong = dict(req.tensors)
    wrong["w"] = wrong["w"][:2]  # another shard shape: another layout
    assert sb.ranks[0].serve("A", 1, wrong, req.meta, 0.0).kind == XPNAK
    nan = {k: v.clone() for k, v in req.tensors.items()}
    nan["b"][0] = float("nan")
    assert sb.ranks[0].serve("A", 2, nan, req.meta, 0.0).kind == XPNAK
    assert sb.ranks[0].held == () and sb.ranks[0].stats.refused == 2
    rep = sb.ranks[0].serve("A", 1, req.tensors, req.meta, 0.0)
    bad_reply = {k: v.clone() for k, v in rep.tensors.items()}
    bad_reply["w"][0, 0] = float("inf")
    sa.ranks[0].reply("B", 1, bad_reply)
    assert sa.ranks[0].status(1, 0.0) == Status.FAILED


def test_a_server_takes_back_at_most_its_whole_piece() -> None:
    """Held merges and our own exchanges in flight together move at most the whole piece (the convex hull)."""
    sa, sb, sc = SplitPeer("A", 1), SplitPeer("B", 2), SplitPeer("C", 3)
    sb.ranks[0].start(9, "C", 0.5, 0.0)  # B's own exchange in flight takes 1/2
    req = sa.ranks[0].start(1, "B", 0.5, 0.0)
    assert sb.ranks[0].serve("A", 1, req.tensors, req.meta, 0.0).kind == XPREP
    req2 = sc.ranks[0].start(2, "B", 0.5, 0.0)
    assert sb.ranks[0].serve("C", 2, req2.tensors, req2.meta, 0.0).kind == XPNAK


def test_a_requester_is_served_again_only_once_its_word_on_the_last_exchange_came() -> None:
    """Its next request carries what our answer to the last one did to it; our piece would not yet."""
    sa, sb = SplitPeer("A", 1), SplitPeer("B", 2)
    split_exchange(sa, sb, 1, 0.0)
    sa.safe_point(0.0, sb)  # A commits and tells B; B has not reached its safe point yet
    req = sa.ranks[0].start(2, "B", 0.5, 0.0)
    assert sb.ranks[0].serve("A", 2, req.tensors, req.meta, 0.0).kind == XPNAK
    sb.safe_point(0.0)  # A's word settles exchange 1
    assert sb.ranks[0].serve("A", 3, sa.ranks[0].start(3, "B", 0.5, 0.0).tensors, req.meta, 0.0).kind == XPREP


def test_only_the_requester_settles_a_held_merge() -> None:
    sa, sb = SplitPeer("A", 1), SplitPeer("B", 2)
    split_exchange(sa, sb, 1, 0.0)
    for rank in sb.ranks:
        rank.settle(1, Outcome.COMMIT, "C")  # another member's word about A's exchange
    assert all(r.held == (1,) for r in sb.ranks) and sum(r.stats.applied for r in sb.ranks) == 0


@settings(max_examples=200, deadline=None)
@given(st.lists(st.sampled_from(list(Status)), min_size=1, max_size=16))
def test_decide_commits_only_when_every_rank_is_ready_and_aborts_when_any_failed(statuses: list[Status]) -> None:
    outcome = decide(statuses)
    assert (outcome == Outcome.COMMIT) == all(s == Status.READY for s in statuses)
    assert (outcome == Outcome.ABORT) == any(s == Status.FAILED for s in statuses)


def test_decide_needs_a_status() -> None:
    with pytest.raises(ValueError):
        decide([])


def test_a_request_waits_for_the_groups_safe_point_and_is_answered_from_the_piece_it_took() -> None:
    """``receive`` keeps a request (refusing a malformed one, or one past the bound, at once); ``serve_waiting``
    answers it from the piece as the safe point left it, not as it was when the request came."""
    sa, sb = SplitPeer("A", 1), SplitPeer("B", 2)
    req = sa.ranks[0].start(1, "B", 0.5, 0.0)
    rank = sb.ranks[0]
    assert rank.receive("A", 1, req.tensors, req.meta, 0.0, "tcp://a0") is None and rank.waiting(0.0) == [(1, "A")]
    wrong = {k: torch.zeros(1) for k in req.tensors}
    assert rank.receive("A", 2, wrong, req.meta, 0.0, "tcp://a0").kind == XPNAK and rank.waiting(0.0) == [(1, "A")]
    with torch.no_grad():
        for t in sb.pieces[0].values():
            t.add_(1.0)  # a local step before the safe point
    rank.apply()  # the safe point: the piece answered with is this one
    answer, addr = rank.serve_waiting(1, 0.0)
    assert answer.kind == XPREP and addr == "tcp://a0" and rank.held == (1,)
    assert all(torch.equal(answer.tensors[k], sb.pieces[0][k]) for k in answer.tensors)
    assert rank.receive("A", 3, req.tensors, req.meta, 0.0, "tcp://a0") is None
    assert rank.waiting(TIMEOUT + 1.0) == []  # past the requester's deadline: it gave up, so do we


@pytest.mark.parametrize("spec", ["fp16", "bf16", "int8"])
def test_compressed_pieces_are_averaged_as_they_travelled_and_nothing_is_made_or_lost(spec: str) -> None:
    """The pieces travel encoded (``gossip.compression``: half precision, int8); both sides average the values that
    travelled, decoded, so the two pieces end at the mean of what travelled, and what one side's merge adds the
    other's removes. A non-finite piece does not encode: its exchange fails on that rank, and nothing is sent."""
    g = torch.Generator().manual_seed(3)
    pa, pb = {"w": torch.randn(5, 3, generator=g)}, {"w": torch.randn(5, 3, generator=g)}
    entries = (PieceEntry("w", "float32", (5, 3), 0),)
    codec = get_codec(spec)
    a, b = (RankExchanges(p, entries, timeout=TIMEOUT, codec=codec) for p in (pa, pb))
    a0, b0 = pa["w"].clone(), pb["w"].clone()
    req = a.start(1, "B", 0.5, 0.0)
    assert req is not None
    rep = b.serve("A", 1, req.tensors, req.meta, 0.0)
    assert rep.kind == XPREP
    wire = {"fp16": torch.float16, "bf16": torch.bfloat16, "int8": torch.int8}[spec]
    assert req.tensors["w"].dtype == wire and rep.tensors["w"].dtype == wire
    a.reply("B", 1, rep.tensors)
    a.commit(1)
    b.settle(1, Outcome.COMMIT, "A")
    a.apply(), b.apply()
    like = {"w": a0}
    p_, q_ = (codec.decode(codec.encode({"w": x}), like)["w"] for x in (a0, b0))  # what travelled, read back
    torch.testing.assert_close(pa["w"], a0 + 0.5 * (q_ - p_), rtol=0, atol=1e-6)  # averaged as it travelled
    torch.testing.assert_close(pb["w"], b0 + 0.5 * (p_ - q_), rtol=0, atol=1e-6)
    torch.testing.assert_close(pa["w"] + pb["w"], a0 + b0, rtol=0, atol=1e-6)  # nothing made or lost
    bad = RankExchanges({"w": torch.full((5, 3), float("nan"))}, entries, timeout=TIMEOUT, codec=codec)
    assert bad.start(3, "B", 0.5, 0.0) is None and bad.status(3, 0.0) == Status.FAILED


def test_auto_pieces_travel_at_the_level_the_leader_set_and_replies_at_least_as_lossy() -> None:
    """``auto``: every rank encodes at the level its group's leader set (``level``); a server at a more faithful
    level answers at the request's, as a whole-model peer does; the sum is kept at every level."""
    from gossiptrain.protocol.compression import AutoCodec

    g = torch.Generator().manual_seed(4)
    pa, pb = {"w": torch.randn(5, 3, generator=g)}, {"w": torch.randn(5, 3, generator=g)}
    entries = (PieceEntry("w", "float32", (5, 3), 0),)
    a, b = (RankExchanges(p, entries, timeout=TIMEOUT, codec=AutoCodec()) for p in (pa, pb))
    total = pa["w"] + pb["w"]
    for xid, (level_a, level_b, travelled) in enumerate([(2, 0, torch.int8), (1, 2, torch.int8), (0, 1, torch.float16)]):
        a.level, b.level = level_a, level_b
        req = a.start(xid, "B", 0.5, 0.0)
        assert req is not None
        rep = b.serve("A", xid, req.tensors, req.meta, 0.0)
        assert rep.kind == XPREP and rep.tensors["w"].dtype == travelled, (level_a, level_b)
        a.reply("B", xid, rep.tensors)
        a.commit(xid)
        b.settle(xid, Outcome.COMMIT, "A")
        a.apply(), b.apply()
        torch.testing.assert_close(pa["w"] + pb["w"], total, rtol=0, atol=1e-5)


def test_a_piece_put_back_forgets_every_merge_computed_from_the_one_it_replaced() -> None:
    """The group's stability guard put B's pieces back: B's exchange in flight is aborted (its xid returned, for the
    leader to tell the partner), the merge it holds for A is dropped, a waiting request is refused, and nothing
    computed from the replaced pieces lands at B's next safe point."""
    sa, sb = SplitPeer("A", 1), SplitPeer("B", 2)
    now = 0.0
    split_exchange(sa, sb, 1, now)  # A asked, B answered and holds the merge
    for r in range(RANKS):
        sb.ranks[r].start(2, "A", 0.5, now)  # B asks A
        assert sb.ranks[r].receive("C", 3, sa.pieces[r], {"a": 0.5}, now, "tcp://127.0.0.9:1") is None  # kept
    kept = [{k: t.clone() for k, t in piece.items()} for piece in sb.pieces]
    for rank in sb.ranks:
        aborted, refusals = rank.put_back()
        assert aborted == [2] and [(s.kind, s.xid, addr) for s, addr in refusals] == [(XPNAK, 3, "tcp://127.0.0.9:1")]
        assert not rank.held and not rank.in_flight and rank.waiting(now) == []
        assert (rank.stats.aborted, rank.stats.dropped, rank.stats.refused) == (1, 1, 1)
    sb.outcomes[1] = ("A", Outcome.COMMIT)  # A's word on the held one comes later: nothing to apply any more
    sb.safe_point(now)
    for piece, before in zip(sb.pieces, kept):
        assert all(torch.equal(piece[k], before[k]) for k in piece)
