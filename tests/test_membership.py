"""The membership state machine, driven in virtual time with no sockets."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gossiptrain.config import MembershipConfig
from gossiptrain.errors import ProtocolError
from gossiptrain.membership import (
    ALIVE,
    DEAD,
    LEFT,
    Digest,
    Leave,
    Member,
    MemberDown,
    Membership,
    MemberUp,
    Send,
    Tick,
    least_loaded_shard,
    members_from_wire,
)

CONFIG = MembershipConfig(heartbeat_interval=1.0, fanout=2)


class Cluster:
    """n members gossiping through a perfect in-memory network, one round per virtual second."""

    def __init__(self, n: int, seed: int) -> None:
        self.rng = random.Random(seed)
        self.now = 0.0
        self.nodes: dict[str, Membership] = {}
        self.crashed: set[str] = set()
        self.events: list[tuple[str, object]] = []
        for i in range(n):
            self.add(f"m{i:03d}", incarnation=1)

    def add(self, mid: str, incarnation: int) -> Membership:
        me = Member(mid, f"sim://{mid}", 0, incarnation, 0)
        node = Membership(me, CONFIG, random.Random(self.rng.random()))
        self.nodes[mid] = node
        self.crashed.discard(mid)
        seed = next((n for k, n in self.nodes.items() if k != mid and k not in self.crashed), None)
        if seed is not None:  # joined through one live member, as a welcome does
            self.deliver(mid, node.handle(Digest([seed.me]), self.now))
            self.deliver(seed.me.id, seed.handle(Digest([me]), self.now))
        return node

    def deliver(self, src: str, actions: list) -> None:
        for a in actions:
            if isinstance(a, Send):
                dst = a.addr.removeprefix("sim://")
                if dst in self.nodes and dst not in self.crashed:
                    self.deliver(dst, self.nodes[dst].handle(Digest(a.entries), self.now))
            else:
                self.events.append((src, a))

    def rounds(self, k: int) -> None:
        for _ in range(k):
            self.now += CONFIG.heartbeat_interval
            for mid, node in list(self.nodes.items()):
                if mid not in self.crashed:
                    self.deliver(mid, node.handle(Tick(), self.now))

    def views(self) -> dict[str, set[str]]:
        return {mid: {m.id for m in n.alive()} for mid, n in self.nodes.items() if mid not in self.crashed}


@settings(max_examples=25, deadline=None)
@given(n=st.integers(2, 24), seed=st.integers(0, 2**16))
def test_views_converge_to_every_member(n: int, seed: int) -> None:
    c = Cluster(n, seed)
    c.rounds(4 * n.bit_length() + 4)
    everyone = set(c.nodes)
    assert all(view == everyone for view in c.views().values())


@settings(max_examples=15, deadline=None)
@given(n=st.integers(3, 16), seed=st.integers(0, 2**16))
def test_crashed_member_is_dropped_everywhere_then_readmitted(n: int, seed: int) -> None:
    c = Cluster(n, seed)
    c.rounds(4 * n.bit_length() + 4)
    victim = "m001"
    c.crashed.add(victim)
    bound = CONFIG.fail_timeout(n) / CONFIG.heartbeat_interval
    c.rounds(int(bound) + 2 * n.bit_length() + 4)
    assert all(victim not in view for view in c.views().values())
    assert any(isinstance(a, MemberDown) and a.member.id == victim and a.reason == "dead" for _, a in c.events)
    # It comes back (a restart: new incarnation) and everyone re-admits it.
    c.add(victim, incarnation=2)
    c.rounds(4 * n.bit_length() + 4)
    assert all(view == set(c.nodes) for view in c.views().values())


def test_a_partition_splits_the_views_and_they_merge_after_the_heal() -> None:
    c = Cluster(8, seed=4)
    c.rounds(16)
    side_a = {f"m{i:03d}" for i in range(4)}
    side_b = set(c.nodes) - side_a
    deliver = c.deliver

    def partitioned(src: str, actions: list) -> None:
        crossing = lambda a: isinstance(a, Send) and (src in side_a) != (a.addr.removeprefix("sim://") in side_a)
        deliver(src, [a for a in actions if not crossing(a)])

    c.deliver = partitioned  # type: ignore[method-assign]
    c.rounds(int(CONFIG.fail_timeout(8)) + 10)
    views = c.views()
    assert all(views[m] == side_a for m in side_a) and all(views[m] == side_b for m in side_b)
    c.deliver = deliver  # type: ignore[method-assign]
    c.rounds(4 * CONFIG.probe_dead_every + 10)
    assert all(view == set(c.nodes) for view in c.views().values())


def test_clean_leave_is_immediate_and_final() -> None:
    c = Cluster(6, seed=1)
    c.rounds(12)
    leaver = c.nodes["m002"]
    c.deliver("m002", leaver.handle(Leave(), c.now))
    c.crashed.add("m002")
    assert all("m002" not in view for view in c.views().values())
    downs = [a for _, a in c.events if isinstance(a, MemberDown) and a.member.id == "m002"]
    assert downs and all(a.reason == "left" for a in downs)
    c.rounds(20)  # stale gossip never brings it back
    assert all("m002" not in view for view in c.views().values())


def test_stale_gossip_does_not_resurrect_a_dead_member() -> None:
    node = Membership(Member("a", "sim://a", 0, 1, 0), CONFIG, random.Random(0))
    old = Member("b", "sim://b", 0, 1, 5)
    node.handle(Digest([old]), now=0.0)
    node.handle(Tick(), now=CONFIG.fail_timeout(2) + 1)
    assert not node.is_alive("b")
    assert node.handle(Digest([old]), now=100.0) == []
    assert not node.is_alive("b")
    newer = Member("b", "sim://b", 0, 1, 6)
    actions = node.handle(Digest([newer]), now=101.0)
    assert node.is_alive("b") and any(isinstance(a, MemberUp) for a in actions)


def test_gossip_never_spreads_a_local_death_verdict() -> None:
    node = Membership(Member("a", "sim://a", 0, 1, 0), CONFIG, random.Random(0))
    node.handle(Digest([Member("b", "sim://b", 0, 1, 1), Member("c", "sim://c", 0, 1, 1)]), now=0.0)
    node.handle(Digest([Member("c", "sim://c", 0, 1, 50)]), now=CONFIG.fail_timeout(3))
    actions = node.handle(Tick(), now=CONFIG.fail_timeout(3) + 0.5)
    assert node.get("b").state == DEAD
    sent = [a for a in actions if isinstance(a, Send)]
    assert sent and all(m.id != "b" for a in sent for m in a.entries)


def test_a_member_refutes_a_newer_claim_about_itself() -> None:
    node = Membership(Member("a", "sim://a", 0, 1, 3), CONFIG, random.Random(0))
    node.handle(Digest([Member("a", "sim://a", 0, 1, 9, LEFT)]), now=0.0)
    assert node.me.state == ALIVE and node.me.version > (1, 9)


@settings(max_examples=200, deadline=None)
@given(st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=10), lambda x: st.lists(x, max_size=7)))
def test_malformed_member_entries_raise_protocol_error_only(raw: object) -> None:
    try:
        members_from_wire([raw], limit=10)
    except ProtocolError:
        pass


def test_member_wire_round_trip_and_limit() -> None:
    m = Member("p0a1", "tcp://127.0.0.2:4000", 3, 17, 99, LEFT)
    assert members_from_wire([m.to_wire()], limit=1) == [m]
    with pytest.raises(ProtocolError):
        members_from_wire([m.to_wire()] * 2, limit=1)


def test_newcomer_gets_the_least_loaded_shard() -> None:
    assert least_loaded_shard([], 4) == 0
    assert least_loaded_shard([0, 1, 3], 4) == 2
    assert least_loaded_shard([0, 1, 2, 3, 0], 4) == 1
    assert least_loaded_shard([7, 9], 2) == 0  # out-of-range shards from another run are ignored
