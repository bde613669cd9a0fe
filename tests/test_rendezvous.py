"""The rendezvous (``gossiptrain.protocol.rendezvous``): nobody starts before the count is ready, all start together.

The sans-IO core is driven by a small message scheduler with random delays
and arrival times (hypothesis); the simulator then checks the same through
real nodes (``tests/test_sim.py``): no peer's first step comes before the
last peer is ready.
"""

from __future__ import annotations

import heapq
import itertools
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gossiptrain.errors import ProtocolError
from gossiptrain.protocol.rendezvous import Rendezvous, SendReady, ready_from_wire

INTERVAL = 0.25


def members(n: int, seed: int = 0) -> dict[str, Rendezvous]:
    rng = random.Random(seed)
    return {f"m{i}": Rendezvous(f"m{i}", interval=INTERVAL, max_ids=64, rng=rng) for i in range(n)}


def test_a_waiting_member_asks_until_a_member_that_became_ready_answers() -> None:
    view = ["a", "b"]
    rng = random.Random(0)
    a, b = (Rendezvous(name, interval=INTERVAL, max_ids=64, rng=rng) for name in view)
    a.wait(2, 0.0, view)
    asked = a.arrive(0.0, view)
    assert asked == [SendReady("b", ("a",))]  # b is not known ready: ask it
    assert b.handle("a", ("a",), False, 0.0, view) == []  # b is not ready yet: it only remembers a
    assert not a.released and a.next_timer() == INTERVAL
    assert b.arrive(0.1, view) == []  # b does not wait: it tells nobody unasked
    assert a.tick(0.2, view) == []  # not due yet
    again = a.tick(INTERVAL, view)
    assert again == [SendReady("b", ("a",))]
    answer = b.handle("a", ("a",), False, INTERVAL, view)
    assert answer == [SendReady("a", ("a", "b"))]  # a lacked b, and b is ready: b answers
    assert a.handle("b", answer[0].ready, False, INTERVAL, view) == [SendReady("b", ("a", "b"), go=True)]
    assert a.released and a.next_timer() == float("inf")


def test_the_first_member_to_count_tells_everyone_and_those_it_told_tell_nobody() -> None:
    view = ["m0", "m1", "m2"]
    m = members(3)
    for name in ("m1", "m2"):
        m[name].wait(3, 0.0, view)
        m[name].arrive(0.0, view)
    m["m1"].handle("m2", ("m2",), False, 0.0, view)
    m["m2"].handle("m1", ("m1",), False, 0.0, view)
    m["m0"].wait(3, 0.0, view)
    # m0 arrives last and learns the others from their earlier asks: it counts 3 and tells both at once.
    m["m0"].handle("m1", ("m1", "m2"), False, 0.0, view)
    go = m["m0"].arrive(0.1, view)
    assert sorted(a.to for a in go) == ["m1", "m2"] and all(a.go and a.ready == ("m0", "m1", "m2") for a in go)
    for name in ("m1", "m2"):
        assert m[name].handle("m0", go[0].ready, True, 0.1, view) == []  # released, and nothing repeated
        assert m[name].released


def test_a_ready_member_known_gone_is_not_counted_one_not_heard_of_yet_is_and_the_set_is_bounded() -> None:
    dead: set[str] = set()
    r = Rendezvous("a", interval=INTERVAL, max_ids=3, rng=random.Random(0), gone=dead.__contains__)
    r.wait(3, 0.0, ["a", "b"])
    r.arrive(0.0, ["a", "b"])
    dead.add("c")
    r.handle("b", ("b", "c", "d", "e"), False, 0.0, ["a", "b"])  # c is ready but known dead; d, e past the bound
    assert not r.released and r.count() == 2
    assert r.ready == {"a", "b", "c"}
    dead.clear()  # c came back (or was never dead: a view that lags); counted at the next tick
    r.tick(0.01, ["a", "b"])
    assert r.released


def test_a_rendezvous_waits_for_at_least_one_member_and_malformed_ready_messages_are_refused() -> None:
    with pytest.raises(ValueError, match="at least 1"):
        Rendezvous("a", interval=INTERVAL, max_ids=4, rng=random.Random(0)).wait(0, 0.0, ["a"])
    assert ready_from_wire({"ready": ["a", "b"], "go": True}, 4) == (("a", "b"), True)
    assert ready_from_wire({"ready": []}, 4) == ((), False)
    for body in ({"ready": "a"}, {"ready": ["a"] * 5}, {"ready": [""]}, {"ready": [1]}, {"ready": ["x" * 65]},
                 {"ready": ["a"], "go": 1}):
        with pytest.raises(ProtocolError):
            ready_from_wire(body, 4)


@settings(max_examples=150, deadline=None)
@given(
    n=st.integers(2, 9),
    arrivals=st.lists(st.floats(0, 3), min_size=9, max_size=9),
    waiting=st.lists(st.booleans(), min_size=9, max_size=9),
    delay=st.floats(0.0005, 0.2),
    seed=st.integers(0, 2**16),
)
def test_nobody_is_released_before_the_count_is_ready_and_every_waiting_member_is_released(
    n: int, arrivals: list[float], waiting: list[bool], delay: float, seed: int,
) -> None:
    """Safety and liveness under random arrival times, message delays and order (every member in every view).

    Members that do not wait (they train at once) are ready at their arrival
    too. Once the last member is ready, the waiting ones are released within
    a few asking intervals.
    """
    rng = random.Random(seed)
    m = members(n, seed)
    view = sorted(m)
    ready_at = {name: arrivals[i] for i, name in enumerate(view)}
    waits = {name: waiting[i] or i == 0 for i, name in enumerate(view)}  # at least one waits
    released_at: dict[str, float] = {}
    queue: list[tuple[float, int, str, str, SendReady | None]] = []
    order = itertools.count()

    def send(sender: str, actions: list[SendReady], now: float) -> None:
        for a in actions:
            heapq.heappush(queue, (now + delay * rng.uniform(0.5, 2.0), next(order), sender, a.to, a))

    for name in view:
        if waits[name]:
            send(name, m[name].wait(n, 0.0, view), 0.0)
        heapq.heappush(queue, (ready_at[name], next(order), name, name, None))  # its arrival
    ticks = [t * 0.05 for t in range(1, 200)]
    for t in ticks:
        for name in view:
            heapq.heappush(queue, (t, next(order), name, name, SendReady(name, ())))  # a tick (empty, to itself)
    while queue:
        now, _, sender, to, action = heapq.heappop(queue)
        r = m[to]
        if action is None:
            send(to, r.arrive(now, view), now)
        elif sender == to:
            send(to, r.tick(now, view), now)
        else:
            send(to, r.handle(sender, action.ready, action.go, now, view), now)
        if r.released and to not in released_at:
            released_at[to] = now
    last_ready = max(ready_at.values())
    assert set(released_at) == {name for name in view if waits[name]}  # liveness
    assert all(t >= last_ready for t in released_at.values())  # safety: nobody before the last is ready
    assert max(released_at.values()) <= last_ready + 4 * (INTERVAL + 0.05 + 2 * delay)



def test_the_go_reaches_a_member_counted_before_our_membership_verified_it() -> None:
    # m2's ready set reached m0 before m2 was in m0's view (a candidate yet): counted, so it is told too.
    m = members(3)
    m["m0"].wait(3, 0.0, ["m0", "m1"])
    m["m0"].arrive(0.0, ["m0", "m1"])
    m["m0"].handle("m1", ("m1",), False, 0.0, ["m0", "m1"])
    go = m["m0"].handle("m2", ("m2",), False, 0.01, ["m0", "m1"])
    assert m["m0"].released
    assert sorted(a.to for a in go if a.go) == ["m1", "m2"]
