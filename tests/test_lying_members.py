"""One member that lies in its gossip, against SWIM membership machines in virtual time (issue 17).

The liar is a real member of the cluster (it joined and answers probes like
anyone), so it is believed as a member; what it says about others is not.
Every half period it sends each honest member one of the attacks seen on
loopback: thousands of made-up members, the honest members' ids at its own
address far above their incarnations, and the honest members declared
dead. The honest views must stay exactly the real members, with nobody lost.
"""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from gossiptrain.net.kinds import ACK, GOSSIP, PING, SYNC
from gossiptrain.protocol.member import ALIVE, DEAD, LEFT, SUSPECT, Member
from gossiptrain.protocol.membership import Membership
from gossiptrain.protocol.swim.events import Ack, Digest, MemberDown, Ping, Send, Tick
from gossiptrain.testing.membership_cluster import DEFAULT_CONFIG, Cluster, admit

CONFIG = DEFAULT_CONFIG
HONEST = [f"m{i:03d}" for i in range(4)]
LIMIT = 128  # Membership's default candidates (limits.candidates)


def _attacked(lies, seconds: float = 30.0, seed: int = 1) -> Cluster:
    """Four honest members and the liar; ``lies(cluster, victim)`` is what it tells ``victim`` every half period.

    Asserts at every half period that each honest view is exactly the real members.
    """
    c = Cluster(4, seed=seed)
    c.add("rogue", incarnation=1)
    c.run(10.0)
    real = set(HONEST) | {"rogue"}
    assert all(view == real for view in c.views().values())
    for _ in range(int(seconds / 0.5)):
        for victim in HONEST:
            c.carry("rogue", [Send(f"sim://{victim}", GOSSIP, (c.nodes["rogue"].me, *lies(c, victim)))])
        c.run(0.5)
        for mid in HONEST:
            assert c.views()[mid] == real, (c.now, mid)  # never a made-up member, never one lost
            assert len(c.nodes[mid].candidates) <= LIMIT
    return c


def test_made_up_members_never_enter_a_view_and_their_introducer_is_quarantined() -> None:
    made_up = [Member(f"fake{i:04d}", f"sim://fake{i:04d}", 0, 1 + i) for i in range(2000)]
    c = _attacked(lambda c, victim: made_up)
    for mid in HONEST:
        node = c.nodes[mid]
        assert node.candidates.stats.introducers_quarantined >= 1  # the liar's introductions are ignored for a while
        assert node.candidates.stats.candidates_unanswered >= 1
        assert node.candidates.stats.candidates_verified >= 1  # the honest members it verified on joining
    assert not c.deaths()


def test_an_honest_newcomer_joins_while_the_table_is_flooded() -> None:
    def flood(c: Cluster, victim: str) -> list[Member]:
        base = int(c.now * 1000)
        return [Member(f"f{base}x{i}", f"sim://f{base}x{i}", 0, 1) for i in range(400)]

    c = Cluster(4, seed=2)
    c.add("rogue", incarnation=1)
    c.run(10.0)
    for step in range(40):
        for victim in HONEST:
            c.carry("rogue", [Send(f"sim://{victim}", GOSSIP, (c.nodes["rogue"].me, *flood(c, victim)))])
        if step == 4:
            c.add("late", incarnation=1)
        c.run(0.5)
    assert all("late" in c.views()[mid] for mid in HONEST)
    assert not c.deaths()


def test_nobody_takes_over_a_live_members_id() -> None:
    def hijack(c: Cluster, victim: str) -> list[Member]:
        return [
            Member(h, "sim://rogue", 0, c.nodes[h].me.incarnation + bump)
            for h in HONEST
            if h != victim
            for bump in (1, 10**12)
        ]

    c = _attacked(hijack)
    for mid in HONEST:
        node = c.nodes[mid]
        assert all(node.get(h).addr == f"sim://{h}" for h in HONEST)
        assert node.stats.redirects_refused > 0
    assert not c.deaths()


def test_false_deaths_remove_nobody() -> None:
    def deaths(c: Cluster, victim: str) -> list[Member]:
        out = []
        for h in HONEST:
            inc = c.nodes[h].me.incarnation  # the liar knows the truth and lies about it at once
            out += [Member(h, f"sim://{h}", 0, inc, DEAD), Member(h, f"sim://{h}", 0, inc + 10**12, DEAD)]
            out.append(Member(h, f"sim://{h}", 0, inc, SUSPECT, by="nobody"))
        return out

    c = _attacked(deaths)
    assert not [d for d in c.deaths() if d[2] in HONEST]
    for mid in HONEST:
        node = c.nodes[mid]
        assert node.stats.verdicts_doubted > 0 and node.stats.jumps_refused > 0
        assert node.me.incarnation < 10**6  # it refuted by small steps, never up to the value a liar chose


def test_a_restart_under_a_new_id_at_the_same_address_replaces_the_old_id() -> None:
    c = Cluster(4, seed=5)
    c.run(10.0)
    old = c.nodes["m002"]
    c.crash("m002")
    del c.nodes["m002"]
    newcomer = Membership(Member("m002b", "sim://m002", 0, 5), CONFIG, random.Random(9))
    c.nodes["m002"] = newcomer  # the cluster routes by address: the new process answers at the old one's
    c.crashed.discard("m002")
    c.carry("m002", newcomer.handle(Digest([c.nodes["m000"].me]), c.now))
    c._push(c.now, "tick", ("m002", c._generation["m002"]))
    c.run(20.0)
    for mid in ("m000", "m001", "m003"):
        node = c.nodes[mid]
        assert node.is_alive("m002b") and not node.is_alive(old.me.id)


# -- one machine against arbitrary lies ---------------------------------------------------


_ids = st.sampled_from([f"x{i}" for i in range(12)] + ["b", "c", "liar"])
_addrs = st.sampled_from(["sim://b", "sim://c", "sim://liar", "sim://x", "sim://nowhere"])
_states = st.sampled_from([ALIVE, SUSPECT, DEAD, LEFT])
_lie = st.builds(
    Member,
    id=_ids,
    addr=_addrs,
    shard=st.just(0),
    incarnation=st.one_of(st.integers(0, 5), st.integers(2**40, 2**62)),
    state=_states,
    by=st.sampled_from(["", "b", "c", "liar", "ghost"]),
)
_event = st.one_of(
    st.tuples(st.just("gossip"), st.lists(_lie, max_size=6), st.sampled_from(["liar", "", "b", "ghost"])),
    st.tuples(st.just("ping"), st.lists(_lie, max_size=6), st.sampled_from(["liar", "x1", "b"])),
    st.tuples(st.just("ack"), st.lists(_lie, max_size=3), _ids),
    st.tuples(st.just("tick"), st.floats(0.01, 3.0), st.just("")),
)


@settings(max_examples=200, deadline=None)
@given(events=st.lists(_event, max_size=40), seed=st.integers(0, 2**16))
def test_lying_gossip_never_makes_an_unverified_member_a_partner(events: list, seed: int) -> None:
    """Whatever arrives, a live member is one that answered our probe at its address, and it stays where it was.

    The liar sees none of our probes (it is not at the addresses it names),
    so its acks carry sequence numbers it had to guess.
    """
    node = Membership(Member("a", "sim://a", 0, 1), CONFIG, random.Random(seed))
    honest = {"b": Member("b", "sim://b", 0, 7), "c": Member("c", "sim://c", 0, 7), "liar": Member("liar", "sim://liar", 0, 7)}
    admit(node, list(honest.values()), now=0.0)
    now = 0.0
    rng = random.Random(f"liar-{seed}")  # not the machine's own stream: the liar cannot see our nonces
    for kind, payload, who in events:
        if kind == "tick":
            now += payload
            actions = node.handle(Tick(), now)
        elif kind == "gossip":
            actions = node.handle(Digest(payload, who, f"sim://{who or 'liar'}", reply=rng.random() < 0.3), now)
        elif kind == "ping":
            actions = node.handle(Ping(who, f"sim://{who}", rng.getrandbits(62), payload), now)
        else:
            actions = node.handle(Ack(who, rng.getrandbits(62), payload), now)
        alive = {m.id: m for m in node.alive()}
        assert set(alive) <= {"a", *honest}, alive  # nobody else ever answered a probe
        for mid, m in alive.items():
            if mid != "a":
                assert m.addr == honest[mid].addr  # and nobody moved
                assert m.incarnation <= honest[mid].incarnation + (1 << 16)
        assert len(node.candidates) <= LIMIT
        for a in actions:
            if isinstance(a, MemberDown):
                assert a.member.id in honest
            if isinstance(a, Send) and a.kind in (GOSSIP, SYNC):
                # We pass on only members: never a candidate, whatever we were told.
                assert {m.id for m in a.entries if m.state == ALIVE} <= {"a", *honest}
            if isinstance(a, Send) and a.kind not in (PING, ACK):
                assert a.addr in {m.addr for m in honest.values()} | {"sim://a"}  # no reflection to named addresses


def test_in_a_secure_swarm_an_id_is_taken_only_at_an_address_whose_key_derives_it() -> None:
    def id_of(addr: str) -> str:  # stands in for key_id: here the "key" is the address's last part
        return "k" + addr.rsplit("/", 1)[-1]

    node = Membership(Member("ka", "sim://a", 0, 1), CONFIG, random.Random(0), id_of=id_of)
    admit(node, [Member("kb", "sim://b", 0, 1)], now=0.0)
    assert node.is_alive("kb")
    actions = node.handle(Digest([Member("kc", "sim://b", 0, 1), Member("kb", "sim://b", 0, 9, DEAD)], "kx"), now=0.1)
    assert not any(isinstance(a, Send) and a.kind == PING for a in actions)  # "kc" at b's address: not even probed
    assert node.stats.forged_ids_refused == 1 and node.is_alive("kb")


def test_a_flood_of_joins_claiming_made_up_addresses_fills_no_view() -> None:
    """A member answering joins adds at most MAX_PLACEHOLDERS unstarted newcomers; the rest wait as candidates."""
    from gossiptrain.protocol.membership import MAX_PLACEHOLDERS
    from gossiptrain.protocol.swim.events import Welcomed

    c = Cluster(4, seed=3)
    c.run(10.0)
    answerer = c.nodes["m000"]
    for i in range(300):
        c.carry("m000", answerer.handle(Welcomed(Member(f"joiner{i:03d}", f"sim://nobody{i}:1", 0, 0)), c.now))
        assert len(answerer.alive()) <= 4 + MAX_PLACEHOLDERS
        assert len(answerer.candidates) <= LIMIT
    c.run(CONFIG.newcomer_grace + 2.0)  # none of them ever starts
    assert all(view == set(HONEST) for view in c.views().values())
    assert answerer.stats.placeholders_deferred >= 300 - MAX_PLACEHOLDERS
