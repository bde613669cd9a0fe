"""Pairwise averaging as a state machine: the math, timeouts and validation, with no network.

Requests and replies are handled as they arrive (on a real peer's network
side) and merged into the machine's ``view``; the live parameters move at
the next safe point (``settle`` here).
"""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gossiptrain.config import GossipConfig
from gossiptrain.net.kinds import XNAK, XREP, XREQ
from gossiptrain.protocol.averaging_events import AtSafePoint, MemberGone, Received, Rejected, SendExchange, Undelivered
from gossiptrain.protocol.pairwise import OVERDUE_SECONDS, PairwiseAveraging
from gossiptrain.protocol.param_spec import ParamSpec
from gossiptrain.protocol.rtt import RttEstimator

# compression none: exact arithmetic (auto starts at fp16)
CONFIG = GossipConfig(exchange_timeout_min=0.5, exchange_timeout_max=4.0, compression="none")


def make(values: list[float], seed: int = 0, ready: bool = True) -> tuple[PairwiseAveraging, dict[str, torch.Tensor]]:
    params = {"w": torch.tensor(values[:-1] or [0.0]), "b": torch.tensor([values[-1]])}
    machine = PairwiseAveraging(params, CONFIG, random.Random(seed))
    if ready:
        settle(machine)  # a first safe point: before it, a machine serves no one
    return machine, params


def settle(machine: PairwiseAveraging, step: int = 0, now: float = 0.0) -> None:
    """A safe point that starts nothing: what was merged since the last one reaches the live parameters."""
    assert machine.handle(AtSafePoint(step=step, partners=[]), now) == []


finite = st.floats(-1e3, 1e3, allow_nan=False, width=32)


@settings(max_examples=60, deadline=None)
@given(st.lists(finite, min_size=2, max_size=6), st.lists(finite, min_size=2, max_size=6), st.lists(finite, min_size=2, max_size=6))
def test_an_exchange_averages_and_keeps_progress_made_in_flight(xa: list[float], xb: list[float], drift: list[float]) -> None:
    n = min(len(xa), len(xb), len(drift))
    a, pa = make(xa[:n])
    b, pb = make(xb[:n], seed=1)
    start_a = {k: v.clone() for k, v in pa.items()}
    start_b = {k: v.clone() for k, v in pb.items()}
    (req,) = a.handle(AtSafePoint(step=1, partners=["B"]), 0.0)
    # A keeps training while its request is in flight.
    step = {"w": torch.tensor(drift[: n - 1] or [0.0]), "b": torch.tensor([drift[n - 1]])}
    for k in pa:
        pa[k].add_(step[k])
    (rep,) = b.handle(Received("A", XREQ, req.xid, req.tensors), 0.0)
    a.handle(Received("B", XREP, rep.xid, rep.tensors), 0.1)
    settle(a, 2)
    settle(b, 2)
    close = {"rtol": 1e-5, "atol": 1e-3}  # float32 rounding at magnitudes up to 1e3
    for k in pa:
        mean = (start_a[k] + start_b[k]) / 2
        torch.testing.assert_close(pb[k], mean, **close)
        torch.testing.assert_close(pa[k], mean + step[k], **close)  # the in-flight step survives
        # mass: the sum of the two models moved only by A's own local step
        torch.testing.assert_close(pa[k] + pb[k], start_a[k] + start_b[k] + step[k], **close)
    assert a.stats.completed == 1 and b.stats.served == 1


def test_many_exchanges_reach_consensus_and_conserve_the_mean() -> None:
    rng = random.Random(3)
    peers = {f"P{i}": make([rng.uniform(-5, 5) for _ in range(4)], seed=i) for i in range(6)}
    mean0 = torch.stack([p["w"] for _, p in peers.values()]).mean(0)
    names = list(peers)
    for t in range(300):
        i, j = rng.sample(names, 2)
        (req,) = peers[i][0].handle(AtSafePoint(step=t, partners=[j]), float(t))
        (rep,) = peers[j][0].handle(Received(i, XREQ, req.xid, req.tensors), float(t))
        peers[i][0].handle(Received(j, XREP, rep.xid, rep.tensors), float(t))
        settle(peers[i][0], t, float(t))
        settle(peers[j][0], t, float(t))
    ws = torch.stack([p["w"] for _, p in peers.values()])
    torch.testing.assert_close(ws.mean(0), mean0, rtol=1e-5, atol=1e-5)
    assert float((ws - ws.mean(0)).abs().max()) < 1e-3


def test_one_exchange_in_flight_then_timeout_moves_on_and_a_late_reply_is_still_applied() -> None:
    a, pa = make([1.0, 2.0])
    (req,) = a.handle(AtSafePoint(step=1, partners=["B", "C"]), 0.0)
    assert a.busy
    assert a.handle(AtSafePoint(step=2, partners=["B", "C"]), 0.1) == []  # still waiting
    timeout = a.rtt.timeout()
    actions = a.handle(AtSafePoint(step=3, partners=["B", "C"]), timeout + 0.01)
    assert a.stats.timeouts == 1
    (req2,) = actions
    assert req2.to != req.to  # the silent partner is avoided for a while
    # The partner served the request (it moved by half the difference); its reply, late, is applied all the
    # same, so the pair's sum stays what it was. Dropping it (as before) lost half the difference.
    partner, pp = make([5.0, 6.0], seed=2)
    (rep,) = partner.handle(Received("A", XREQ, req.xid, req.tensors), timeout)
    settle(partner)
    a.handle(Received(req.to, XREP, rep.xid, rep.tensors, meta=dict(rep.meta)), timeout + 0.2)
    settle(a, 4, timeout + 0.2)
    assert a.stats.late == 1 and a.stats.completed == 1 and a.stats.abandoned == 0
    torch.testing.assert_close(pa["w"] + pp["w"], torch.tensor([6.0]))
    torch.testing.assert_close(pa["b"] + pp["b"], torch.tensor([8.0]))
    torch.testing.assert_close(pa["w"], torch.tensor([3.0]))  # and both are at the pair's mean
    assert a.busy  # the second exchange is still in flight, untouched


def test_a_reply_later_than_the_horizon_is_abandoned_and_counted() -> None:

    a, pa = make([1.0, 2.0])
    (req,) = a.handle(AtSafePoint(step=1, partners=["B"]), 0.0)
    a.handle(AtSafePoint(step=2, partners=[]), a.rtt.timeout() + 0.01)  # timed out: overdue
    settle(a, 3, OVERDUE_SECONDS + 1.0)
    assert a.stats.abandoned == 1
    before = [p.clone() for p in a.params]
    a.handle(Received("B", XREP, req.xid, {"w": torch.tensor([9.0]), "b": torch.tensor([9.0])}), OVERDUE_SECONDS + 2)
    settle(a, 4, OVERDUE_SECONDS + 2)
    assert a.stats.late == 1 and all(torch.equal(x, y) for x, y in zip(before, a.params))


def test_overdue_exchanges_with_a_member_that_died_take_a_reply_it_sent_before_and_are_given_up_quietly() -> None:
    a, _ = make([1.0, 2.0])
    (req,) = a.handle(AtSafePoint(step=1, partners=["B"]), 0.0)
    a.handle(AtSafePoint(step=2, partners=[]), a.rtt.timeout() + 0.01)
    a.handle(MemberGone("B"), 1.0)
    # Its reply was on the wire when it died: the other half of its merge, applied (the averaging nemesis found it lost)
    a.handle(Received("B", XREP, req.xid, {"w": torch.tensor([9.0]), "b": torch.tensor([9.0])}), 1.1)
    assert a.stats.completed == 1 and not a._overdue
    a.handle(AtSafePoint(step=3, partners=["B"]), 1.2)
    a.handle(AtSafePoint(step=4, partners=[]), 1.2 + a.rtt.timeout() + 0.01)  # another one to B, never answered
    a.handle(MemberGone("B"), 2.0)
    settle(a, 5, OVERDUE_SECONDS + 3.0)
    assert not a._overdue and a.stats.abandoned == 0  # its model left the swarm with it: nothing to warn about


def test_a_paused_training_loop_still_answers_and_applies_the_merges_at_its_next_safe_point() -> None:
    """The server's loop reaches no safe point while three requests come: each is answered at once."""
    b, pb = make([8.0, 8.0])
    requesters = [make([float(v), float(v)], seed=i)[0:2] for i, v in enumerate([0.0, 4.0, 6.0])]
    for i, (r, pr) in enumerate(requesters):
        (req,) = r.handle(AtSafePoint(step=1, partners=["B"]), 0.0)
        (rep,) = b.handle(Received(f"R{i}", XREQ, req.xid, req.tensors), 0.1)
        assert rep.kind == XREP
        r.handle(Received("B", XREP, rep.xid, rep.tensors, meta=dict(rep.meta)), 0.2)
        settle(r, 2)
    assert float(pb["w"]) == 8.0  # untouched while the loop is paused
    b.params[0].add_(-1.0)  # the loop resumes: the step it was in the middle of lands first
    settle(b, 1)
    total = float(pb["w"]) + sum(float(pr["w"]) for _, pr in requesters)
    assert total == pytest.approx(8.0 + 0.0 + 4.0 + 6.0 - 1.0)  # nothing created or lost
    # Served in turn from the merged view (8 -> 4 -> 4 -> 5), each answer inside the hull of the models:
    assert [float(pr["w"]) for _, pr in requesters] == pytest.approx([4.0, 4.0, 5.0])
    assert float(pb["w"]) == pytest.approx(5.0 - 1.0)  # the paused step is kept


def test_a_model_put_back_by_the_guard_is_what_partners_get_and_nothing_computed_from_the_old_one_lands() -> None:
    """The stability guard put the live parameters back after a safe point took their snapshot (a blow-up): a reply
    to a request that carried the blown-up model, or a merge served from it, would add ``a (s_b - s_blown)`` to the
    model put back, which is the blow-up again."""
    a, pa = make([1.0, 1.0])
    pa["w"].fill_(1e6)  # blows up in a local step...
    pa["b"].fill_(1e6)
    settle(a, 1)  # ...and the safe point takes it as the model partners see
    (req,) = a.handle(AtSafePoint(step=2, partners=["B"]), 0.0)
    assert float(req.tensors["w"]) == 1e6
    served = a.handle(Received("C", XREQ, 7, {"w": torch.tensor([3.0]), "b": torch.tensor([3.0])}), 0.0)
    assert served[0].kind == XREP
    pa["w"].fill_(1.0)  # the guard puts the model back
    pa["b"].fill_(1.0)
    a.model_put_back()
    assert a.stats.put_back == 1 and not a.busy
    assert [float(v) for v in a.view] == [1.0, 1.0]  # partners are served the model put back
    a.handle(Received("B", XREP, req.xid, {"w": torch.tensor([2.0]), "b": torch.tensor([2.0])}, meta={"a": 0.5}), 0.1)
    settle(a, 3)
    assert [float(pa["w"]), float(pa["b"])] == [1.0, 1.0]  # neither the reply nor the served merge landed
    assert a.stats.late == 1
    (rep,) = a.handle(Received("C", XREQ, 8, {"w": torch.tensor([3.0]), "b": torch.tensor([3.0])}), 0.2)
    assert float(rep.tensors["w"]) == 1.0
    settle(a, 4)
    assert float(pa["w"]) == 2.0  # averaging goes on from the model put back


def test_a_peer_settling_after_a_blow_up_neither_starts_exchanges_nor_serves_them() -> None:
    a, pa = make([1.0, 1.0])
    a.settling = True  # the guard saw a sign within its grace
    assert a.handle(AtSafePoint(step=1, partners=["B"]), 0.0) == []
    (nak,) = a.handle(Received("C", XREQ, 7, {"w": torch.tensor([3.0]), "b": torch.tensor([3.0])}), 0.0)
    assert nak.kind == XNAK and a.stats.settling == 1
    settle(a, 2)
    assert [float(pa["w"]), float(pa["b"])] == [1.0, 1.0]
    a.settling = False  # settled: averaging as before
    (req,) = a.handle(AtSafePoint(step=3, partners=["B"]), 0.0)
    assert req.kind == XREQ


def test_a_request_from_a_model_whose_norm_is_a_hundred_times_apart_from_ours_is_refused_either_way() -> None:
    """One of the two blew up (a model that blew up and stayed huge is steady: its own guard sees no growth)."""
    a, _ = make([1.0, 1.0])
    b, pb = make([1.0, 1.0], seed=1)
    a.norm = 1.0
    for i, (theirs, refused) in enumerate(((50.0, False), (101.0, True), (0.02, False), (0.009, True))):
        b.norm = theirs
        (req,) = b.handle(AtSafePoint(step=10 * i + 1, partners=["A"]), float(i))
        assert req.meta["norm"] == theirs
        (answer,) = a.handle(Received("B", XREQ, req.xid, req.tensors, meta=dict(req.meta)), 0.0)
        assert (answer.kind == XNAK) == refused
        b.handle(Received("A", answer.kind, answer.xid, answer.tensors, meta=dict(answer.meta)), float(i))
        settle(a, 10 * i + 2, float(i)), settle(b, 10 * i + 2, float(i))
    assert a.stats.norm_apart == 2
    b.norm = None  # no guard, or still in its warmup: nothing to compare
    (req,) = b.handle(AtSafePoint(step=100, partners=["A"]), 9.0)
    assert "norm" not in req.meta
    assert a.handle(Received("B", XREQ, req.xid, req.tensors, meta=dict(req.meta)), 9.0)[0].kind == XREP


def test_no_request_is_served_before_the_first_safe_point() -> None:
    b, pb = make([8.0, 8.0], ready=False)
    (nak,) = b.handle(Received("A", XREQ, 1, {"w": torch.tensor([0.0]), "b": torch.tensor([0.0])}), 0.0)
    assert nak.kind == XNAK and float(pb["w"]) == 8.0


def test_a_reply_leaves_before_the_server_moves_and_the_move_is_never_lost() -> None:
    """The server's own merge waits until its reply is sent (``after_send``), or until its next event at the latest."""
    b, pb = make([8.0, 8.0])
    (rep,) = b.handle(Received("A", XREQ, 1, {"w": torch.tensor([0.0]), "b": torch.tensor([0.0])}), 0.0)
    assert rep.kind == XREP and float(rep.tensors["w"]) == 8.0 and rep.meta["a"] == 0.5
    assert b._pending.empty  # not computed yet: the reply is on its way first
    b.after_send()
    assert [float(p) for p in b.pending] == [-4.0, -4.0]
    # A driver that never calls after_send loses nothing: the next event computes the merge first.
    c, pc = make([8.0, 8.0])
    c.handle(Received("A", XREQ, 1, {"w": torch.tensor([0.0]), "b": torch.tensor([0.0])}), 0.0)
    settle(c)
    assert float(pc["w"]) == 4.0 and float(pc["b"]) == 4.0


class CountingCodec:
    """The machine's codec, counting encodes."""

    def __init__(self, codec: object) -> None:
        self.codec, self.encodes = codec, 0

    def __getattr__(self, name: str) -> object:
        return getattr(self.codec, name)

    def encode(self, *args: object, **kwargs: object) -> object:
        self.encodes += 1
        return self.codec.encode(*args, **kwargs)  # type: ignore[attr-defined]


def test_a_model_sent_again_is_not_encoded_again() -> None:
    a, _ = make([1.0, 2.0])
    counting = CountingCodec(a.codec)
    a.codec = counting  # type: ignore[assignment]
    (req,) = a.handle(AtSafePoint(step=1, partners=["B"]), 0.0)
    (rep,) = a.handle(Received("C", XREQ, 5, {"w": torch.tensor([3.0]), "b": torch.tensor([4.0])}), 0.0)
    # Nothing merged between the two: the reply is the request's model, the very same tensors, encoded once.
    assert counting.encodes == 1 and rep.tensors["w"] is req.tensors["w"]
    b, _ = make([1.0, 2.0])
    counting = CountingCodec(b.codec)
    b.codec = counting  # type: ignore[assignment]
    b.handle(Received("C", XREQ, 5, {"w": torch.tensor([3.0]), "b": torch.tensor([4.0])}), 0.0)
    (rep,) = b.handle(Received("D", XREQ, 6, {"w": torch.tensor([5.0]), "b": torch.tensor([6.0])}), 0.0)
    # Served C in between: the model moved (1/2 of the way to C's, w from 1 to 2), so it is encoded anew.
    assert counting.encodes == 2 and float(rep.tensors["w"]) == 2.0


def test_a_reply_that_could_not_be_sent_is_taken_back() -> None:
    b, pb = make([8.0, 8.0])
    (rep,) = b.handle(Received("A", XREQ, 7, {"w": torch.tensor([0.0]), "b": torch.tensor([0.0])}), 0.0)
    b.handle(Undelivered("A", XREP, 7), 0.0)
    settle(b)
    assert float(pb["w"]) == 8.0 and b.stats.undelivered == 1 and b.stats.served == 0
    assert float(b.view[0]) == 8.0


def test_a_request_that_could_not_be_sent_frees_the_exchange() -> None:
    a, _ = make([1.0, 2.0])
    (req,) = a.handle(AtSafePoint(step=1, partners=["B"]), 0.0)
    a.handle(Undelivered("B", XREQ, req.xid), 0.0)
    assert not a.busy and a.stats.refused == 1


def test_crossing_requests_average_once_instead_of_swapping() -> None:
    pa = {"w": torch.tensor([0.0, 0.0])}
    pb = {"w": torch.tensor([4.0, 8.0])}
    a = PairwiseAveraging(pa, CONFIG, random.Random(0), me="A")
    b = PairwiseAveraging(pb, CONFIG, random.Random(1), me="B")
    settle(a)
    settle(b)
    (req_a,) = a.handle(AtSafePoint(step=1, partners=["B"]), 0.0)
    (req_b,) = b.handle(AtSafePoint(step=1, partners=["A"]), 0.0)
    # Both requests are in flight at once; each side now receives the other's.
    (from_a,) = a.handle(Received("B", XREQ, req_b.xid, req_b.tensors), 0.01)
    (from_b,) = b.handle(Received("A", XREQ, req_a.xid, req_a.tensors), 0.01)
    assert from_a.kind == XREP and from_b.kind == XNAK  # the smaller id serves, the larger refuses
    a.handle(Received("B", XNAK, from_b.xid), 0.02)
    b.handle(Received("A", XREP, from_a.xid, from_a.tensors), 0.02)
    settle(a, 2)
    settle(b, 2)
    torch.testing.assert_close(pa["w"], torch.tensor([2.0, 4.0]))
    torch.testing.assert_close(pb["w"], torch.tensor([2.0, 4.0]))  # averaged, not swapped
    assert b.stats.crossed == 1 and not a.busy and not b.busy


def test_a_refusal_frees_the_exchange_at_once() -> None:
    a, _ = make([1.0, 2.0])
    (req,) = a.handle(AtSafePoint(step=1, partners=["B"]), 0.0)
    a.handle(Received("B", XNAK, req.xid), 0.01)
    assert not a.busy and a.stats.refused == 1


def test_exchange_every_steps_spaces_out_exchanges() -> None:
    params = {"w": torch.zeros(2)}
    cfg = GossipConfig(exchange_every_steps=3)
    a = PairwiseAveraging(params, cfg, random.Random(0))
    started = []
    for step in range(1, 10):
        for act in a.handle(AtSafePoint(step=step, partners=["B"]), float(step)):
            started.append(step)
            a.handle(Received("B", XNAK, act.xid), float(step))
    assert started == [1, 4, 7]


def test_bad_updates_are_rejected_and_leave_the_model_bit_identical() -> None:
    b, pb = make([1.0, 2.0, 3.0])
    before = {k: v.clone() for k, v in pb.items()}
    bad = [
        {"w": torch.tensor([1.0, float("nan")]), "b": torch.tensor([0.0])},
        {"w": torch.tensor([1.0, float("inf")]), "b": torch.tensor([0.0])},
        {"w": torch.tensor([1.0, 2.0, 3.0]), "b": torch.tensor([0.0])},  # shape
        {"w": torch.tensor([1, 2]), "b": torch.tensor([0])},  # dtype
        {"v": torch.tensor([1.0, 2.0]), "b": torch.tensor([0.0])},  # names
        {"w": torch.tensor([1.0, 2.0])},  # missing
        {"w": torch.tensor([1.0, 2.0]), "b": torch.tensor([0.0]), "c": torch.tensor([0.0])},  # extra
    ]
    for i, tensors in enumerate(bad):
        actions = b.handle(Received("A", XREQ, i, tensors), 0.0)
        assert isinstance(actions[0], Rejected)
        assert isinstance(actions[1], SendExchange) and actions[1].kind == XNAK
    assert b.stats.rejected == len(bad)
    assert all(torch.equal(pb[k], before[k]) for k in pb)


def test_no_partner_no_exchange() -> None:
    a, _ = make([1.0, 2.0])
    assert a.handle(AtSafePoint(step=1, partners=[]), 0.0) == []
    assert not a.busy


def test_rtt_estimator_adapts_within_bounds() -> None:
    est = RttEstimator(floor=0.2, ceiling=5.0)
    assert 0.2 <= est.timeout() <= 5.0
    for _ in range(50):
        est.observe(0.01)
    assert est.timeout() == 0.2  # fast links hit the floor, not a guess
    for _ in range(50):
        est.observe(3.0)
    assert 3.0 <= est.timeout() <= 5.0


def test_param_spec_names_the_first_difference() -> None:
    a = ParamSpec.of({"w": torch.zeros(3, 4), "b": torch.zeros(4)})
    assert a.mismatch(a) is None
    assert "shape [3, 4] here but [3, 5]" in (a.mismatch(ParamSpec.of({"w": torch.zeros(3, 5), "b": torch.zeros(4)})) or "")
    assert "'b' exists here" in (a.mismatch(ParamSpec.of({"w": torch.zeros(3, 4)})) or "")
    assert ParamSpec.from_wire(a.to_wire()) == a
