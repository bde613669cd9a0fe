"""What mutation testing found untested in pairwise averaging and push-sum, pinned.

Each test kills mutants that survived a mutmut run over
``protocol/averaging.py`` (its pairwise part now ``protocol/pairwise.py``)
and ``protocol/push_sum.py`` (a changed operator, constant, argument or
counter that no test noticed). They drive the real
sans-IO machines by hand, as ``test_averaging.py`` does: a safe point is
``AtSafePoint``, a message is ``Received``, and what a machine answers is the
list of actions it returns.
"""

from __future__ import annotations

import dataclasses
import logging
import random
from collections import Counter

import pytest
import torch

from gossiptrain.config import GossipConfig
from gossiptrain.errors import ProtocolError
from gossiptrain.net.kinds import XNAK, XPUSH, XREP, XREQ
from gossiptrain.protocol import push_sum
from gossiptrain.protocol.averaging_events import (
    AtSafePoint,
    AveragingStats,
    Received,
    Rejected,
    SendExchange,
    Undelivered,
    mean_staleness,
)
from gossiptrain.protocol.pairwise import OVERDUE_KEPT, OVERDUE_SECONDS, PairwiseAveraging
from gossiptrain.protocol.param_spec import ParamSpec
from gossiptrain.protocol.push_sum import MIN_PUSH_WEIGHT, UNACKED_PUSHES, PushSum
from gossiptrain.protocol.rtt import RttEstimator

# compression none: exact arithmetic (auto starts at fp16)
CONFIG = GossipConfig(exchange_timeout_min=0.5, exchange_timeout_max=4.0, compression="none")
PUSH_SUM = GossipConfig(algorithm="push-sum", compression="none")


def pairwise(values: list[float], me: str = "", seed: int = 0, config: GossipConfig = CONFIG,
             ready: bool = True) -> tuple[PairwiseAveraging, dict[str, torch.Tensor]]:
    params = {"w": torch.tensor(values)}
    machine = PairwiseAveraging(params, config, random.Random(seed), me=me)
    if ready:
        settle(machine)
    return machine, params


def settle(machine: PairwiseAveraging, step: int = 0, now: float = 0.0) -> None:
    """A safe point that starts nothing: the merges made since the last one reach the live parameters."""
    assert machine.handle(AtSafePoint(step=step, partners=[]), now) == []


def w(*values: float) -> dict[str, torch.Tensor]:
    return {"w": torch.tensor(list(values))}


def nak(to: str, xid: int) -> SendExchange:
    return SendExchange(to, XNAK, xid, {})


def x64(*values: float) -> dict[str, torch.Tensor]:
    return {"x": torch.tensor(list(values), dtype=torch.float64)}


# -- pairwise: counters, versions and the metadata of every message ----------------------------


def test_every_exchange_is_counted_once_on_each_side_with_versions_staleness_and_round_trips() -> None:
    """Three exchanges: started/completed/served are 3, version counts merges, each message carries
    its sender's version, the staleness histogram counts each applied update once, and the RTT is
    the time from request to reply."""
    a, pa = pairwise([0.0], me="A")
    b, pb = pairwise([8.0], me="B", seed=1)
    settle(b, step=5)
    for k in range(3):
        start = 10.0 * (k + 1)
        (req,) = a.handle(AtSafePoint(step=k + 1, partners=["B"]), start)
        assert (req.to, req.kind, req.meta) == ("B", XREQ, {"ver": k})
        (rep,) = b.handle(Received("A", XREQ, req.xid, req.tensors, step=k + 1, meta=dict(req.meta)), start)
        assert (rep.to, rep.kind, rep.xid, rep.meta) == ("A", XREP, req.xid, {"a": 0.5, "ver": k + 1})
        assert a.handle(Received("B", XREP, rep.xid, rep.tensors, step=5, meta=dict(rep.meta)), start + 0.25) == []
        if k == 0:
            assert a.rtt.srtt == 0.25 and a.stats.rtt_ms == 250.0
        settle(b, step=5, now=start)
    settle(a, step=4, now=40.0)
    assert float(pa["w"]) == float(pb["w"]) == 4.0
    assert (a.stats.started, a.stats.completed, a.stats.served) == (3, 3, 0)
    assert (b.stats.started, b.stats.completed, b.stats.served) == (0, 0, 3)
    assert a.version == 3 and b.version == 3
    assert a.stats.late == a.stats.timeouts == a.stats.refused == 0
    # B (at step 5) served requests sent at steps 1, 2, 3; A applied replies sent at B's step 5.
    assert b.stats.staleness == Counter({4: 1, 3: 1, 2: 1})
    assert a.stats.staleness == Counter({0: 3})
    summary = b.stats.to_dict()
    assert summary["staleness_mean"] == 3.0 and summary["staleness_hist"] == {"2-3": 2, "4-7": 1}


def test_an_instant_round_trip_is_reported_as_zero_milliseconds() -> None:
    """A reply at the very time of its request (virtual time) is a 0 ms round trip, not a made-up one."""
    a, _ = pairwise([0.0], me="A")
    b, _ = pairwise([2.0], me="B", seed=1)
    (req,) = a.handle(AtSafePoint(step=1, partners=["B"]), 3.0)
    (rep,) = b.handle(Received("A", XREQ, req.xid, req.tensors), 3.0)
    a.handle(Received("B", XREP, rep.xid, rep.tensors, meta=dict(rep.meta)), 3.0)
    assert a.stats.completed == 1 and a.rtt.srtt == 0.0 and a.stats.rtt_ms == 0.0


# -- pairwise: every refusal goes back to the requester, with its xid --------------------------


def test_every_refused_request_is_answered_to_its_sender_with_its_xid_and_no_tensors() -> None:
    """Whatever the reason (not ready, crossed, busy, unreadable, stale, unsendable), the requester gets
    an xnak for its own xid (so it moves on at once), the model does not move, and each refusal is counted."""
    fresh, pf = pairwise([8.0], me="B", ready=False)
    assert fresh.handle(Received("A", XREQ, 1, w(0.0)), 0.0) == [nak("A", 1)]
    assert fresh.handle(Received("C", XREQ, 2, w(0.0)), 0.0) == [nak("C", 2)]
    assert fresh.stats.busy == 2 and float(pf["w"]) == 8.0

    # Crossed: B asked A while A asks B; the smaller id (A) serves, so B refuses, each time.
    b, pb = pairwise([8.0], me="B")
    (req,) = b.handle(AtSafePoint(step=1, partners=["A"]), 0.0)
    assert b.handle(Received("A", XREQ, 11, w(0.0)), 0.0) == [nak("A", 11)]
    assert b.handle(Received("A", XREQ, 12, w(0.0)), 0.0) == [nak("A", 12)]
    assert b.stats.crossed == 2 and b.stats.served == 0

    # Busy: with its own request in flight, B serves one request, then refuses the others.
    (served,) = b.handle(Received("C", XREQ, 13, w(0.0)), 0.0)
    assert served.kind == XREP and served.to == "C"
    assert b.handle(Received("D", XREQ, 14, w(0.0)), 0.0) == [nak("D", 14)]
    assert b.handle(Received("E", XREQ, 15, w(0.0)), 0.0) == [nak("E", 15)]
    assert b.stats.busy == 2 and b.stats.served == 1

    # Unreadable: the update is rejected in the sender's name (quarantine counts it against the sender).
    c, pc = pairwise([8.0], me="C")
    rejected, refusal = c.handle(Received("A", XREQ, 16, {"w": torch.tensor([1.0, 2.0])}), 0.0)
    assert isinstance(rejected, Rejected) and rejected.sender == "A" and isinstance(rejected.reason, str)
    assert refusal == nak("A", 16) and c.stats.rejected == 1 and float(pc["w"]) == 8.0


def test_a_peer_waiting_at_a_rendezvous_serves_the_model_it_holds_now_and_its_first_safe_point_keeps_the_merge() -> None:
    """Before its first safe point a pairwise peer refuses (its model may still be replaced); at a rendezvous
    (``serve_as_is``) it answers from the parameters as they are then, a downloaded state included, and the
    merge reaches its live parameters at its first safe point, the sum of the two models kept."""
    b, pb = pairwise([8.0], me="B", ready=False)
    pb["w"].copy_(torch.tensor([6.0]))  # a state download replaced the parameters in place
    assert b.handle(Received("A", XREQ, 1, w(0.0)), 0.0) == [nak("A", 1)]
    b.serve_as_is()
    (rep,) = b.handle(Received("A", XREQ, 2, w(2.0)), 0.0)
    assert rep.kind == XREP and rep.to == "A" and float(rep.tensors["w"]) == 6.0  # what it holds now, not 8
    assert b.stats.served == 1
    settle(b, step=0)
    assert float(pb["w"]) == 4.0  # 6 + 1/2 (2 - 6): with A's 2 + 1/2 (6 - 2) = 4 the sum 8 is kept
    b.serve_as_is()  # once training has begun, a no-op
    assert float(pb["w"]) == 4.0 and float(b.view[0]) == 4.0


def test_a_server_whose_own_model_cannot_be_sent_refuses_and_logs_on_the_1st_2nd_and_4th_time(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A diverged (non-finite) server answers each request with an xnak to its sender, keeps its model,
    counts every time, and logs only on powers of two."""
    b, pb = pairwise([float("nan")], me="B")
    with caplog.at_level(logging.ERROR, logger="gossiptrain.protocol.averaging"):
        for i in range(1, 5):
            assert b.handle(Received(f"P{i}", XREQ, 100 + i, w(1.0)), 0.0) == [nak(f"P{i}", 100 + i)]
            assert b.stats.unsendable == i
            logged = [r.getMessage() for r in caplog.records]
            assert len(logged) == {1: 1, 2: 2, 3: 2, 4: 3}[i]
    assert "not sending our model (4 times so far)" in logged[-1] and "non-finite" in logged[-1]
    assert b.stats.served == 0 and b.version == 0 and bool(torch.isnan(pb["w"]).all())


def test_staleness_is_symmetric_for_pairwise_a_requester_far_ahead_is_refused_and_one_ahead_weighted() -> None:
    """Both ends must use |step difference|: a requester *ahead* by more than the bound is refused like one
    behind, and polynomial weighting scales the mixing weight by the absolute difference."""
    bounded = GossipConfig(exchange_timeout_min=0.5, exchange_timeout_max=4.0, staleness_bound=3)
    b, pb = pairwise([8.0], me="B", config=bounded)
    settle(b, step=10)
    assert b.handle(Received("A", XREQ, 1, w(0.0), step=20), 0.0) == [nak("A", 1)]  # 10 steps ahead
    assert b.handle(Received("A", XREQ, 2, w(0.0), step=2), 0.0) == [nak("A", 2)]  # 8 behind
    assert b.stats.stale_dropped == 2 and float(pb["w"]) == 8.0
    (rep,) = b.handle(Received("A", XREQ, 3, w(0.0), step=13), 0.0)  # 3 ahead: within the bound
    assert rep.kind == XREP and rep.meta["a"] == 0.5

    weighted = GossipConfig(exchange_timeout_min=0.5, exchange_timeout_max=4.0, staleness_weighting="polynomial")
    c, pc = pairwise([8.0], me="C", config=weighted)
    settle(c, step=10)
    (rep,) = c.handle(Received("A", XREQ, 4, w(0.0), step=13), 0.0)  # |10 - 13| = 3: weight (1 + 3) ** -0.5
    assert rep.meta["a"] == 0.25
    settle(c, step=11)
    assert float(pc["w"]) == 8.0 - 0.25 * 8.0


# -- pairwise: robust mode on both ends --------------------------------------------------------


ROBUST = GossipConfig(exchange_timeout_min=0.5, exchange_timeout_max=4.0, robust=True, robust_clip=3.0)


def test_robust_server_clips_a_large_difference_to_robust_clip_times_the_median_and_refuses_an_outlier() -> None:
    """After 4 honest differences of norm 1, a difference of 8 is scaled to robust_clip * 1 = 3: the reply's
    mixing weight is 0.5 * 3/8 and the server moves by exactly that; only clipped merges count as clipped;
    a model 10x our norm is refused in its sender's name and answered with an xnak."""
    b, pb = pairwise([10.0], me="B", config=ROBUST)
    for xid in range(4):  # honest: remote = our model + 1 (clip limit: 0.1 x the norms, > 1)
        (rep,) = b.handle(Received("A", XREQ, xid, w(float(pb["w"]) + 1.0)), 0.0)
        assert rep.meta["a"] == 0.5
        settle(b)
    assert float(pb["w"]) == 12.0 and b.stats.clipped == 0
    for xid, before in ((10, 12.0), (11, 13.5)):
        (rep,) = b.handle(Received("A", XREQ, xid, w(before + 8.0)), 0.0)
        assert rep.kind == XREP and rep.meta["a"] == 0.5 * 3.0 / 8.0
        settle(b)
        assert float(pb["w"]) == before + 0.1875 * 8.0
    assert b.stats.clipped == 2 and b.stats.served == 6
    for xid in (20, 21):
        assert b.handle(Received("M", XREQ, xid, w(1000.0)), 0.0) == [
            Rejected("M", "difference far beyond recent ones (robust)"), nak("M", xid)]
    settle(b)
    assert float(pb["w"]) == 15.0 and b.stats.rejected == 2 and b.stats.served == 6


def test_robust_requester_clips_the_reply_it_applies_and_refuses_an_outlier_reply() -> None:
    """The requester judges the reply against what it sent: clipped by the same rule (its own
    history), and an outlier reply is rejected in the server's name and never applied."""
    a, pa = pairwise([10.0], me="A", config=ROBUST)
    step = 0
    for _ in range(4):
        step += 1
        (req,) = a.handle(AtSafePoint(step=step, partners=["B"]), 0.0)
        sent = float(req.tensors["w"])
        a.handle(Received("B", XREP, req.xid, w(sent + 1.0), meta={"a": 0.5}), 0.0)
    settle(a, step=step + 1)
    assert float(pa["w"]) == 12.0
    (req,) = a.handle(AtSafePoint(step=step + 2, partners=["B"]), 0.0)
    assert a.handle(Received("B", XREP, req.xid, w(20.0), meta={"a": 0.5}), 0.0) == []
    settle(a, step=step + 3)
    assert float(pa["w"]) == 12.0 + 0.5 * (3.0 / 8.0) * 8.0 and a.stats.clipped == 1
    (req,) = a.handle(AtSafePoint(step=step + 4, partners=["B"]), 0.0)
    assert a.handle(Received("B", XREP, req.xid, w(1000.0), meta={"a": 0.5}), 0.0) == [
        Rejected("B", "difference far beyond recent ones (robust)")]
    settle(a, step=step + 5)
    assert float(pa["w"]) == 13.5 and not a.busy and a.stats.completed == 5


def test_a_poisoning_peer_sends_its_scaled_model_but_moves_from_its_honest_one() -> None:
    """Fault injection (``poison``): the wire carries poison x the model, while the sender's own merge
    uses its honest model, so it stays sane itself."""
    a, pa = pairwise([1.0, 2.0], me="A")
    a.poison = 3.0
    b, pb = pairwise([5.0, 6.0], me="B", seed=1)
    (req,) = a.handle(AtSafePoint(step=1, partners=["B"]), 0.0)
    torch.testing.assert_close(req.tensors["w"], torch.tensor([3.0, 6.0]))
    (rep,) = b.handle(Received("A", XREQ, req.xid, req.tensors), 0.0)
    a.handle(Received("B", XREP, rep.xid, rep.tensors, meta=dict(rep.meta)), 0.0)
    settle(a, 2)
    settle(b, 2)
    torch.testing.assert_close(pa["w"], torch.tensor([3.0, 4.0]))  # 1 + (5 - 1) / 2, 2 + (6 - 2) / 2: honest
    torch.testing.assert_close(pb["w"], torch.tensor([4.0, 6.0]))  # toward the poisoned [3, 6]


# -- pairwise: undelivered replies, refusals, timeouts and overdue exchanges ---------------------


def test_an_undelivered_report_undoes_only_the_reply_it_names_and_only_once() -> None:
    """Only the last served reply, to that member and xid, is taken back, once; a report for any other
    (another xid, another member, a second report, one after the safe point) changes nothing."""
    b, pb = pairwise([8.0], me="B")
    b.handle(Received("A", XREQ, 7, w(0.0)), 0.0)
    assert b.handle(Undelivered("A", XREP, 8), 0.0) == []  # another xid
    assert b.handle(Undelivered("C", XREP, 7), 0.0) == []  # another member
    settle(b)
    assert float(pb["w"]) == 4.0 and b.stats.undelivered == 0 and b.stats.served == 1
    assert b.handle(Undelivered("A", XREP, 99), 0.0) == []  # after the safe point: nothing to undo
    assert float(b.view[0]) == 4.0

    c, pc = pairwise([8.0], me="C")
    c.handle(Received("A", XREQ, 7, w(0.0)), 0.0)
    c.handle(Undelivered("A", XREP, 7), 0.0)
    c.handle(Undelivered("A", XREP, 7), 0.0)  # reported twice: undone once
    assert float(c.view[0]) == 8.0
    c.handle(Received("D", XREQ, 9, w(4.0)), 0.0)
    c.handle(Undelivered("D", XREP, 9), 0.0)
    settle(c)
    assert float(pc["w"]) == 8.0 and c.stats.undelivered == 2 and c.stats.served == 0


def test_a_reply_that_could_not_be_sent_is_taken_back_even_after_a_safe_point_applied_it() -> None:
    """Found by this mutation run: the network side releases the lock between serving and its failed send, so
    the training side's safe point may apply the merge first; the undo must still happen (through pending)."""
    b, pb = pairwise([8.0], me="B")
    b.handle(Received("A", XREQ, 7, w(0.0)), 0.0)
    settle(b, step=1)  # the training thread got the lock first: the merge is in the model
    assert float(pb["w"]) == 4.0
    b.handle(Undelivered("A", XREP, 7), 0.0)  # then the reply's send failed: A never applies its half
    settle(b, step=2)
    assert float(pb["w"]) == 8.0 and b.stats.undelivered == 1 and b.stats.served == 0  # the pair's sum is 8 again


def test_refusals_free_only_their_own_exchange_and_each_is_counted() -> None:
    """An xnak nobody asked for is ignored; one for an overdue exchange from its partner forgets it (its
    reply is then no longer applied); from anyone else it does not (the reply still is)."""
    a, pa = pairwise([0.0], me="A")
    assert a.handle(Received("Z", XNAK, 12345), 0.0) == []  # nothing in flight, nothing overdue
    assert a.stats.refused == 0
    for step in (1, 2):
        (req,) = a.handle(AtSafePoint(step=step, partners=["B"]), 0.0)
        a.handle(Received("B", XNAK, req.xid), 0.0)
    assert a.stats.refused == 2 and not a.busy

    # Two overdue exchanges (B and C stay silent past the timeout), refused late: both forgotten.
    overdue = []
    for step, now in ((3, 10.0), (4, 20.0)):
        (req,) = a.handle(AtSafePoint(step=step, partners=["B"]), now)
        overdue.append(req)
    settle(a, step=5, now=30.0)
    assert a.stats.timeouts == 2 and not a.busy
    for req in overdue:
        a.handle(Received("C", XNAK, req.xid), 30.0)  # not their partner: ignored
    assert a.stats.refused == 2
    a.handle(Received("B", XNAK, overdue[0].xid), 30.0)
    assert a.stats.refused == 3
    a.handle(Received("B", XREP, overdue[0].xid, w(8.0), meta={"a": 0.5}), 30.0)  # forgotten: not applied
    a.handle(Received("B", XREP, overdue[1].xid, w(8.0), meta={"a": 0.5}), 30.0)  # still overdue: applied
    settle(a, step=6, now=30.0)
    assert float(pa["w"]) == 4.0 and a.stats.completed == 1 and a.stats.late == 2


def test_past_overdue_kept_timed_out_exchanges_the_oldest_is_given_up_and_the_peer_asks_on() -> None:
    """At most OVERDUE_KEPT timed-out exchanges (each holding a model copy) are remembered: a further timeout
    gives up the oldest (counted, its reply no longer applied) and the peer goes on asking others, never
    stopping its averaging for lost messages. Every timeout is counted; the remembered ones still apply."""
    a, pa = pairwise([0.0], me="A")
    partners = ["B", "C", "D", "E", "F", "G"]
    sent = []
    for k in range(OVERDUE_KEPT + 1):
        actions = a.handle(AtSafePoint(step=k + 1, partners=partners), 5.0 * k)
        sent += actions
        assert len(actions) == 1 and actions[0].kind == XREQ
    (req,) = a.handle(AtSafePoint(step=OVERDUE_KEPT + 2, partners=partners), 5.0 * (OVERDUE_KEPT + 1))
    assert req.kind == XREQ and a.stats.timeouts == OVERDUE_KEPT + 1 and a.stats.abandoned == 2
    now = 5.0 * (OVERDUE_KEPT + 1) + 0.5
    a.handle(Received(sent[0].to, XREP, sent[0].xid, {"w": torch.tensor([8.0])}, meta={"a": 0.5}), now)  # given up
    a.handle(Received(sent[-1].to, XREP, sent[-1].xid, {"w": torch.tensor([8.0])}, meta={"a": 0.5}), now)  # kept
    settle(a, step=OVERDUE_KEPT + 3, now=now)
    assert float(pa["w"]) == 4.0 and a.stats.completed == 1  # the kept one applied, the given-up one not


def test_an_exchange_times_out_at_its_deadline_exactly() -> None:
    """A safe point at the deadline itself times the exchange out (where hold_until stops waiting)."""
    a, _ = pairwise([0.0], me="A")
    deadline = 1.0 + a.rtt.timeout()
    a.handle(AtSafePoint(step=1, partners=["B"]), 1.0)
    assert a.hold_until(deadline) is None
    settle(a, step=2, now=deadline)
    assert a.stats.timeouts == 1 and not a.busy


def test_a_partner_that_timed_out_is_avoided_for_four_timeouts_then_trusted_again() -> None:
    """After a timeout the partner is avoided until now + 4 x the (backed-off) timeout: an exchange with it
    inside that window does not hold the training loop, one after it does."""
    config = GossipConfig(exchange_timeout_min=0.5, exchange_timeout_max=4.0, max_steps_ahead=1)
    a, _ = pairwise([0.0], me="A", config=config)
    a.handle(AtSafePoint(step=1, partners=["B"]), 0.0)
    timed_out_at = a.rtt.timeout() + 0.01
    step = 2
    (req,) = a.handle(AtSafePoint(step=step, partners=["B"]), timed_out_at)  # times out, asks B again
    until = timed_out_at + 4 * a.rtt.timeout()
    assert a.stats.timeouts == 1
    for now, holds in ((timed_out_at, False), (until - 0.01, False), (until + 0.01, True)):
        if req is None:
            step += 1
            (req,) = a.handle(AtSafePoint(step=step, partners=["B"]), now)
        step += 5
        assert a.handle(AtSafePoint(step=step, partners=["B"]), now) == []  # past the bound, still in flight
        assert (a.hold_until(now) is not None) == holds, now
        a.handle(Received("B", XNAK, req.xid), now)
        req = None
    assert a.stats.timeouts == 1 and a.stats.refused == 3


def test_an_overdue_exchange_is_abandoned_overdue_seconds_after_it_was_sent_not_earlier() -> None:
    """The horizon counts from the request's own send time, and is inclusive: sent at 50 s, still kept at
    50 + OVERDUE_SECONDS, abandoned after; each abandonment is counted."""
    a, _ = pairwise([0.0], me="A")
    a.handle(AtSafePoint(step=1, partners=["B"]), 50.0)
    settle(a, step=2, now=60.0)  # timed out: overdue
    settle(a, step=3, now=50.0 + OVERDUE_SECONDS - 1.0)
    settle(a, step=4, now=50.0 + OVERDUE_SECONDS)
    assert a.stats.abandoned == 0
    settle(a, step=5, now=50.0 + OVERDUE_SECONDS + 0.5)
    assert a.stats.abandoned == 1
    a.handle(AtSafePoint(step=6, partners=["B"]), 200.0)
    settle(a, step=7, now=210.0)
    settle(a, step=8, now=200.0 + OVERDUE_SECONDS + 0.5)
    assert a.stats.abandoned == 2 and a.stats.timeouts == 2


def test_every_late_or_unknown_reply_is_counted() -> None:
    """Replies to exchanges we do not know, and overdue replies applied late, each count once in ``late``."""
    a, pa = pairwise([0.0], me="A")
    a.handle(Received("B", XREP, 1, w(8.0), meta={"a": 0.5}), 0.0)
    a.handle(Received("B", XREP, 2, w(8.0), meta={"a": 0.5}), 0.0)
    assert a.stats.late == 2 and a.stats.completed == 0
    reqs = [a.handle(AtSafePoint(step=s, partners=["B"]), t)[0] for s, t in ((1, 0.0), (2, 10.0))]
    settle(a, step=3, now=20.0)
    for req in reqs:
        a.handle(Received("B", XREP, req.xid, w(8.0), meta={"a": 0.5}), 20.0)
    settle(a, step=4, now=20.0)
    assert a.stats.late == 4 and a.stats.completed == 2 and float(pa["w"]) == 8.0  # 0 + 4 + 4: both applied


def test_the_first_safe_point_may_start_an_exchange_whatever_exchange_every_steps() -> None:
    """exchange_every_steps spaces exchanges out; it never delays the first one (pairwise and push-sum)."""
    a, _ = pairwise([0.0], config=GossipConfig(exchange_every_steps=200))
    (req,) = a.handle(AtSafePoint(step=0, partners=["B"]), 0.0)
    a.handle(Received("B", XNAK, req.xid), 0.0)
    assert a.handle(AtSafePoint(step=199, partners=["B"]), 1.0) == []
    assert len(a.handle(AtSafePoint(step=200, partners=["B"]), 2.0)) == 1
    ps = PushSum(x64(1.0), GossipConfig(algorithm="push-sum", exchange_every_steps=200), random.Random(0))
    assert len(ps.handle(AtSafePoint(step=0, partners=["B"]), 0.0)) == 1
    assert ps.handle(AtSafePoint(step=199, partners=["B"]), 0.0) == []


# -- the RTT estimator, the parameter spec and the statistics ---------------------------------


def test_rtt_estimator_follows_rfc_6298_exactly() -> None:
    """srtt and rttvar after each sample, the timeout srtt + 4 rttvar, the 2 s guess, and backoff doubling."""
    e = RttEstimator(0.5, 10.0)
    assert e.timeout() == 2.0
    e.observe(1.0)
    assert (e.srtt, e.rttvar, e.timeout()) == (1.0, 0.5, 3.0)
    e.observe(2.0)
    assert (e.srtt, e.rttvar, e.timeout()) == (1.125, 0.625, 3.625)
    e.backoff()
    assert e.srtt == 2.25 and e.timeout() == 4.75
    for _ in range(5):
        e.backoff()
    assert e.srtt == 10.0 and e.timeout() == 10.0  # capped at the ceiling
    fresh = RttEstimator(0.5, 10.0)
    fresh.backoff()
    assert fresh.timeout() == 4.0  # twice the guess it timed out with


def test_param_spec_names_dtypes_without_the_torch_prefix_and_catches_a_dtype_difference() -> None:
    """The spec a joiner is checked against: names, plain dtype names and shapes; a dtype difference is named."""
    spec = ParamSpec.of({"w": torch.zeros(3, 4), "b": torch.zeros(4, dtype=torch.float64)})
    assert spec.entries == (("w", "float32", (3, 4)), ("b", "float64", (4,)))
    other = ParamSpec.of({"w": torch.zeros(3, 4), "b": torch.zeros(4)})
    assert spec.mismatch(other) == "parameter 'b' has dtype float64 here but float32 in the swarm"


@pytest.mark.parametrize("raw", [
    "w", [5], ["w"], [["w", "float32"]], [[1, "float32", [3]]], [["w", 1, [3]]], [["w", "float32", "3"]],
    [["w", "float32", [-1]]], [["w", "float32", [3.0]]], [["w", "float32", [True]]],
])
def test_a_malformed_parameter_spec_from_the_wire_is_a_protocol_error(raw: object) -> None:
    """Every malformed entry is refused as a ProtocolError (never an IndexError or TypeError, never accepted)."""
    with pytest.raises(ProtocolError, match="parameter spec"):
        ParamSpec.from_wire(raw)


def test_a_parameter_spec_with_an_empty_dimension_is_well_formed() -> None:
    """A zero-length dimension is a valid shape (dimensions must be ints >= 0, not > 0)."""
    assert ParamSpec.from_wire([["w", "float32", [0, 3]]]).entries == (("w", "float32", (0, 3)),)


def test_stats_summary_has_every_counter_and_the_staleness_as_mean_and_buckets() -> None:
    """The metrics line: every counter, and the staleness histogram only as its mean and power-of-two buckets."""
    stats = AveragingStats(served=2)
    stats.staleness.update({0: 1, 2: 3})
    summary = stats.to_dict()
    counters = {f.name for f in dataclasses.fields(AveragingStats)} - {"staleness"}
    assert set(summary) == counters | {"staleness_mean", "staleness_hist"}
    assert summary["served"] == 2 and summary["staleness_mean"] == 1.5
    assert summary["staleness_hist"] == {"0": 1, "2-3": 3}
    assert mean_staleness(Counter()) == 0.0 and mean_staleness(Counter({3: 2})) == 3.0


def test_round_trips_are_kept_smoothed_and_by_bucket() -> None:
    stats = AveragingStats()
    for seconds in (0.0015, 0.002, 0.3, 20.0):
        stats.round_trip(seconds, srtt=0.004)
    assert stats.rtt_ms == 4.0
    assert stats.to_dict()["rtt_hist"] == {"0.002": 2, "0.5": 1, "inf": 1}  # bound in seconds -> round trips


# -- push-sum ----------------------------------------------------------------------------------


def test_push_sum_pushes_while_its_weight_is_at_least_min_push_weight_and_conserves_its_mass() -> None:
    """With nothing coming in, a peer pushes exactly 61 times (weights 1 ... 2**-60 = MIN_PUSH_WEIGHT), then
    stops; what it keeps plus what it pushed is its initial mass. Each push is counted and carries our version."""
    ps = PushSum(x64(3.0), PUSH_SUM, random.Random(0), me="A")
    pushes = [a for step in range(1, 70) for a in ps.handle(AtSafePoint(step, ["B"]), 0.0)]
    assert MIN_PUSH_WEIGHT == 2.0**-60 and len(pushes) == 61 and ps.weight == 2.0**-61
    assert ps.stats.started == 61 and [p.meta for p in pushes] == [{"w": 2.0 ** -(k + 1), "ver": 0} for k in range(61)]
    x, weight = ps.mass()
    assert weight + sum(p.meta["w"] for p in pushes) == 1.0
    torch.testing.assert_close(x[0] + sum(p.tensors["x"] for p in pushes), torch.tensor([3.0], dtype=torch.float64),
                               rtol=1e-15, atol=0.0)


def test_push_sum_remembers_its_last_unacked_pushes_and_takes_back_the_newest_refusal() -> None:
    """UNACKED_PUSHES are remembered, oldest forgotten first: after UNACKED_PUSHES + 1 pushes the refusal of
    the first is ignored, while those of the second and of the newest give their mass back."""
    ps = PushSum(x64(1.0), PUSH_SUM, random.Random(0), me="A")
    # Only the pushes refused below are held: a held push holds its pool buffer, and with all 4,097 held the
    # pool grew to 4,097 buffers, each push searching them all (3-11 s; the pushes between are not looked at).
    pushes = []
    for step in range(UNACKED_PUSHES + 1):
        (push,) = ps.handle(AtSafePoint(step, ["B"]), 0.0)
        pushes = [*pushes[:2], push]  # the first two, and the newest
        ps.handle(Received("C", XPUSH, step, x64(ps.weight), meta={"w": ps.weight}), 0.0)  # weight back to 1
    assert ps.weight == 1.0 and ps.stats.started == UNACKED_PUSHES + 1
    for push, gives_back in ((pushes[0], 0.0), (pushes[1], 0.5), (pushes[-1], 0.5)):
        before = ps.weight
        r = push_sum.refusal(Received("A", XPUSH, push.xid, push.tensors, meta=dict(push.meta)))
        ps.handle(Received("B", XNAK, r.xid, r.tensors, meta=dict(r.meta)), 0.0)
        assert ps.weight == before + gives_back
    assert ps.stats.refused == 2


def test_push_sum_counts_absorbed_pushes_and_versions_its_model() -> None:
    """Each absorbed push is served once and bumps the version, which the next push carries."""
    ps = PushSum(x64(0.0), PUSH_SUM, random.Random(0), me="B")
    for xid in (1, 2):
        assert ps.handle(Received("A", XPUSH, xid, x64(1.0), meta={"w": 0.5}), 0.0) == []
    assert ps.stats.served == 2 and ps.version == 2 and ps.weight == 2.0
    (push,) = ps.handle(AtSafePoint(1, ["A"]), 0.0)
    assert push.meta == {"w": 1.0, "ver": 2} and push.to == "A" and push.kind == XPUSH


def test_push_sum_rejects_a_push_without_a_float_weight_in_its_senders_name_and_keeps_its_mass() -> None:
    """A push whose weight is missing or not a float touches nothing and is rejected in its sender's name, each time."""
    ps = PushSum(x64(2.0), PUSH_SUM, random.Random(0), me="B")
    for meta in ({}, {"w": 1}):
        assert ps.handle(Received("A", XPUSH, 5, x64(9.0), meta=meta), 0.0) == [Rejected("A", "push without a weight")]
    assert ps.stats.rejected == 2 and ps.weight == 1.0 and ps.stats.served == 0
    assert float(ps.params[0]) == 2.0


def test_an_unreadable_push_is_rejected_and_refused_bare_and_the_pusher_counts_its_mass_lost() -> None:
    """An unreadable push has no mass to give back: the receiver rejects it (sender's name) and answers a bare
    xnak for its xid; the pusher, handed that, counts the push lost once and forgets it."""
    receiver = PushSum(x64(2.0), PUSH_SUM, random.Random(0), me="B")
    pusher = PushSum(x64(4.0), PUSH_SUM, random.Random(1), me="A")
    for step in (1, 2):
        (push,) = pusher.handle(AtSafePoint(step, ["B"]), 0.0)
        broken = {"x": torch.tensor([1.0, 2.0], dtype=torch.float64)}  # wrong shape
        rejected, refusal = receiver.handle(Received("A", XPUSH, push.xid, broken, meta=dict(push.meta)), 0.0)
        assert isinstance(rejected, Rejected) and rejected.sender == "A"
        assert refusal == SendExchange("A", XNAK, push.xid, {})
        pusher.handle(Received("B", XNAK, refusal.xid, dict(refusal.tensors), meta=dict(refusal.meta)), 0.0)
        pusher.handle(Received("B", XNAK, refusal.xid, {}), 0.0)  # a duplicate: already forgotten
        assert pusher.stats.lost == step
    assert receiver.weight == 1.0 and receiver.stats.rejected == 2 and float(receiver.params[0]) == 2.0
    assert pusher.weight == 0.25 and pusher.stats.refused == 0


def test_push_sum_staleness_is_one_sided_a_sender_ahead_of_us_is_never_stale() -> None:
    """For push-sum the staleness of a push is our step minus its step: with a bound of 3 at step 10, pushes
    from steps 8, 12 and 15 are taken (mass absorbed), one from step 6 is refused with its mass."""
    ps = PushSum(x64(0.0), GossipConfig(algorithm="push-sum", staleness_bound=3), random.Random(0), me="B")
    ps.handle(AtSafePoint(10, []), 0.0)
    for xid, step in ((1, 8), (2, 12), (3, 15)):
        assert ps.handle(Received("A", XPUSH, xid, x64(0.5), step=step, meta={"w": 0.5}), 0.0) == []
    assert ps.weight == 2.5 and ps.stats.served == 3 and ps.stats.stale_dropped == 0
    (refused,) = ps.handle(Received("A", XPUSH, 4, x64(0.5), step=6, meta={"w": 0.5}), 0.0)
    assert (refused.to, refused.kind, refused.xid, refused.meta) == ("A", XNAK, 4, {"w": 0.5})
    assert ps.stats.stale_dropped == 1 and ps.weight == 2.5


def test_the_refusal_of_an_unsent_push_goes_back_to_us_as_from_its_receiver() -> None:
    """``refusal`` of our own push (one the driver could not send) is addressed as from its receiver, so our
    own machine takes it back; a refusal of a push without a weight carries none."""
    ps = PushSum(x64(4.0), PUSH_SUM, random.Random(0), me="A")
    (push,) = ps.handle(AtSafePoint(1, ["B"]), 0.0)
    r = push_sum.refusal(push)
    assert (r.to, r.kind, r.xid, r.meta) == ("B", XNAK, push.xid, {"w": 0.5})
    ps.handle(Received(r.to, XNAK, r.xid, r.tensors, meta=dict(r.meta)), 0.0)
    assert ps.weight == 1.0 and ps.stats.refused == 1 and float(ps.params[0]) == 4.0
    assert push_sum.refusal(Received("C", XPUSH, 3, x64(1.0))).meta == {}
