"""The member table's indexes never drift from its records, whatever sequence of changes it takes.

``View`` keeps indexes beside its records so that a swarm's hot paths ask
them instead of passing over every member (who is live, sorted; who is held
dead; the tombstones a sweep forgets; how many live members are behind NAT).
Each is checked here against the same answer computed from the records.
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from gossiptrain.net.address_forms import client_address, is_client_address
from gossiptrain.protocol.member import ALIVE, DEAD, LEFT, SUSPECT, Member
from gossiptrain.protocol.swim.view import View

IDS = [f"m{i}" for i in range(6)]
STATES = [ALIVE, SUSPECT, DEAD, LEFT]

change = st.tuples(
    st.sampled_from(["set", "amend", "forget"]),
    st.sampled_from(IDS),
    st.sampled_from(STATES),
    st.booleans(),  # at a client-mode address (behind NAT)
    st.integers(min_value=0, max_value=3),  # incarnation
)


def _member(mid: str, state: str, client: bool, incarnation: int) -> Member:
    addr = f"tcp://127.0.0.{IDS.index(mid) + 2}:5000"
    return Member(mid, client_address(addr) if client else addr, 0, incarnation, state)


@settings(max_examples=200, deadline=None)
@given(st.lists(change, max_size=40))
def test_the_indexes_follow_the_records(changes: list[tuple[str, str, str, bool, int]]) -> None:
    view = View(Member("me", "tcp://127.0.0.1:5000", 0, 1))
    now = 0.0
    for op, mid, state, client, inc in changes:
        now += 1.0
        rec = view.record(mid)
        member = _member(mid, state, client, inc)
        if op == "forget":
            forgotten = view.forget_tombstones(now, forget_after=2.5)
            assert all(view.record(f) is None for f in forgotten)
        elif rec is None:
            view.add(member, now)
        elif op == "amend" and (state == rec.member.state or (rec.member.state, state) == (DEAD, LEFT)):
            view.amend(rec, member)  # the merge amends a claim without a change of state, or a death it learns was a leave
        else:
            view.set(rec, member, now)
        records = list(view.records())
        live = [r.member for r in records if r.member.state in (ALIVE, SUSPECT)]
        assert view.live_clients() == sum(is_client_address(m.addr) for m in live)
        assert view.has_suspects() == bool(view.suspected())
        assert view.alive_ids() == tuple(sorted([m.id for m in live] + ["me"]))
        assert sorted(m.id for m in view.known_dead()) == sorted(r.member.id for r in records if r.member.state == DEAD)
        for addr in {r.member.addr for r in records}:
            assert {r.member.id for r in view.at_addr(addr)} == {r.member.id for r in records if r.member.addr == addr}


def test_a_sweep_forgets_exactly_the_tombstones_older_than_the_bound() -> None:
    view = View(Member("me", "tcp://127.0.0.1:5000", 0, 1))
    for i, (state, at) in enumerate([(DEAD, 0.0), (LEFT, 1.0), (DEAD, 5.0), (ALIVE, 0.0), (SUSPECT, 0.0)]):
        view.add(_member(IDS[i], state, False, 1), at)
    assert sorted(view.forget_tombstones(6.0, forget_after=2.0)) == ["m0", "m1"]
    assert sorted(r.member.id for r in view.records()) == ["m2", "m3", "m4"]
    assert view.forget_tombstones(6.5, forget_after=2.0) == []
    assert view.forget_tombstones(7.5, forget_after=2.0) == ["m2"]
