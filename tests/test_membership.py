"""The SWIM membership state machine, driven in virtual time with no sockets.

``Cluster`` (from ``gossiptrain.testing.membership_cluster``) is a small
discrete-event network: every message takes ``delay`` seconds and is lost
with probability ``loss``; each member is ticked at the time its machine
asks for (``next_timer``), as the asyncio driver does.
"""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gossiptrain.config import MembershipConfig
from gossiptrain.errors import ProtocolError
from gossiptrain.net.kinds import ACK, GOSSIP, PING
from gossiptrain.protocol.member import ALIVE, DEAD, LEFT, SUSPECT, Member, least_loaded_shard, members_from_wire
from gossiptrain.protocol.membership import DEAD_VIEW_SENDERS, Membership
from gossiptrain.protocol.swim.events import Ack, Digest, Leave, MemberDown, MemberUp, Ping, Send, Suspected, Tick, Welcomed
from gossiptrain.testing.matchers import match, only
from gossiptrain.testing.membership_cluster import DEFAULT_CONFIG, Cluster, admit

CONFIG = DEFAULT_CONFIG  # the cluster's config: the bounds below are computed from it


def periods(n: int) -> float:
    """Enough virtual seconds for news to reach n members: a sync, then log-many rounds of piggybacking."""
    return CONFIG.heartbeat_interval * (4 * n.bit_length() + 8)


@settings(max_examples=25, deadline=None)
@given(n=st.integers(2, 24), seed=st.integers(0, 2**16))
def test_views_converge_to_every_member(n: int, seed: int) -> None:
    c = Cluster(n, seed)
    c.run(periods(n))
    everyone = set(c.nodes)
    assert all(view == everyone for view in c.views().values())
    assert not c.deaths()


@settings(max_examples=15, deadline=None)
@given(n=st.integers(3, 16), seed=st.integers(0, 2**16))
def test_a_crashed_member_is_dropped_everywhere_within_the_bound_then_readmitted(n: int, seed: int) -> None:
    c = Cluster(n, seed)
    c.run(periods(n))
    victim = "m001"
    c.crash(victim)
    crashed_at = c.now
    c.run(CONFIG.dead_within(n))
    assert all(victim not in view for view in c.views().values())
    verdicts = [(t, who) for t, who, m in c.deaths() if m == victim]
    assert {who for _, who in verdicts} == set(c.nodes) - {victim}  # each decided for itself
    assert max(t for t, _ in verdicts) - crashed_at <= CONFIG.dead_within(n)
    assert all(m == victim for _, _, m in c.deaths())  # and nobody else was declared dead
    # It comes back (a restart: a new incarnation) and everyone re-admits it.
    c.add(victim, incarnation=2)
    c.run(periods(n))
    assert all(view == set(c.nodes) for view in c.views().values())


@settings(max_examples=5, deadline=None)
@given(seed=st.integers(0, 2**16))
def test_one_percent_loss_never_kills_a_live_member(seed: int) -> None:
    """Indirect probes and refutation absorb a lossy network: suspicions happen, deaths do not."""
    c = Cluster(32, seed, loss=0.01)
    c.run(120.0)
    assert not c.deaths()
    assert all(view == set(c.nodes) for view in c.views().values())


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**16), settle=st.floats(3.0, 8.0))
def test_in_a_swarm_of_three_both_survivors_declare_a_crash_dead_within_5_s_with_the_defaults(seed: int, settle: float) -> None:
    """Lifeguard wants 3 independent suspicions before its shortest timeout; 3 members have only 2 to give.

    The cap (K at most the members that could confirm) and the suspicion pushed to the members asked
    for help make the one other survivor's confirmation enough, and arrive within a period.
    """
    config = MembershipConfig()  # the defaults a new user runs with (0.5 s periods), not the cluster's round numbers
    c = Cluster(3, seed, config=config)
    c.run(settle)
    assert all(view == set(c.nodes) for view in c.views().values())
    c.crash("m001")
    crashed_at = c.now
    c.run(5.0)
    verdicts = {who: (t, a) for t, who, a in c.events if match(a, MemberDown, reason="dead") and a.member.id == "m001"}
    assert set(verdicts) == {"m000", "m002"}
    assert all(t - crashed_at <= 5.0 for t, _ in verdicts.values())
    assert all(set(a.suspectors) <= {"m000", "m002"} and a.suspectors for _, a in verdicts.values())  # for the terminal
    assert all(m == "m001" for _, _, m in c.deaths())


def test_a_welcome_placeholder_of_a_member_that_died_starting_is_dropped_everywhere_on_time() -> None:
    """The welcomer adds the newcomer at incarnation 0; if it dies building its model it never speaks for itself."""
    config = MembershipConfig()
    c = Cluster(3, seed=7, config=config)
    c.run(5.0)
    welcomed_at = c.now
    c.carry("m000", c.nodes["m000"].handle(Welcomed(Member("p9a1", "sim://p9a1", 0, 0)), c.now))  # nobody runs p9a1
    c.run(2.0)
    # The welcomer holds its placeholder; the others heard of it, but it has not answered them: a candidate.
    views = c.views()
    assert "p9a1" in views["m000"] and not any("p9a1" in views[m] for m in ("m001", "m002"))
    assert all("p9a1" in c.nodes[m].candidates for m in ("m001", "m002"))
    assert not c.deaths()
    c.run(20.0 - 2.0)
    drops = {who: t for t, who, m in c.deaths() if m == "p9a1"}
    assert set(drops) == {"m000"}  # dropped by its timer, not a minute later
    assert all(t - welcomed_at <= config.newcomer_grace + 0.5 for t in drops.values())
    assert all("p9a1" not in view for view in c.views().values())
    assert not any("p9a1" in n.candidates for n in c.nodes.values())
    assert all(m == "p9a1" for _, _, m in c.deaths())


def test_an_indirect_probe_saves_a_member_behind_one_broken_link() -> None:
    c = Cluster(6, seed=3)
    c.run(periods(6))
    cut = {("m000", "m001"), ("m001", "m000")}
    c.blocked = lambda src, dst: (src, dst) in cut
    c.run(60.0)
    prober = c.nodes["m000"]
    assert prober.stats.indirect_probes > 0
    assert not c.deaths()
    assert "m001" in c.views()["m000"]


def test_a_falsely_suspected_member_refutes_with_a_higher_incarnation() -> None:
    c = Cluster(5, seed=2)
    c.run(periods(5))
    victim = c.nodes["m003"]
    before = victim.me.incarnation
    claim = Member("m003", "sim://m003", 0, before, SUSPECT, by="m000")
    c.carry("m000", c.nodes["m000"].handle(Digest([claim], "m004", "sim://m004"), c.now))
    assert c.nodes["m000"].get("m003").state == SUSPECT
    c.run(CONFIG.suspicion_timeout_max(5))
    assert victim.me.incarnation > before and victim.stats.refutations >= 1
    assert all(n.get("m003").state == ALIVE for mid, n in c.nodes.items() if mid != "m003")
    assert not c.deaths()


def test_independent_suspicions_shorten_the_timeout_lifeguard() -> None:
    def suspected_by(suspectors: str) -> Membership:
        node = Membership(Member("a", "sim://a", 0, 1), CONFIG, random.Random(0))
        admit(node, [Member(x, f"sim://{x}", 0, 1) for x in "bcdefg"], now=0.0)
        for by in suspectors:
            actions = node.handle(Digest([Member("b", "sim://b", 0, 1, SUSPECT, by=by)], by), now=0.0)
            assert by != suspectors[0] or only(actions, Suspected)
        return node

    lo, hi = CONFIG.suspicion_timeout(7), CONFIG.suspicion_timeout_max(7)
    assert lo < hi
    lone, confirmed = suspected_by("c"), suspected_by("cdef")
    for node in (lone, confirmed):
        node.handle(Tick(), now=lo + 0.01)
    assert lone.get("b").state == SUSPECT  # a lone suspector may be the one in trouble: wait longer
    assert confirmed.get("b").state == DEAD
    lone.handle(Tick(), now=hi + 0.01)
    assert lone.get("b").state == DEAD


def test_the_probe_timeout_follows_measured_round_trips() -> None:
    fast, slow = Cluster(4, seed=1, delay=0.002), Cluster(4, seed=1, delay=0.08)
    for c in (fast, slow):
        c.run(30.0)
    t_fast = fast.nodes["m000"].probe_timeout()
    t_slow = slow.nodes["m000"].probe_timeout()
    assert CONFIG.min_probe_timeout <= t_fast < 2 * 0.004 * 4
    assert 2 * 0.08 <= t_slow <= CONFIG.heartbeat_interval / 2
    assert not fast.deaths() and not slow.deaths()


@pytest.mark.parametrize("delay", [0.15, 0.35])
def test_on_links_slower_than_half_a_period_members_join_and_no_one_is_suspected(delay: float) -> None:
    """Round trips of 0.3 and 0.7 s against periods of 1 s, 1% of messages lost: the timeouts follow the links.

    Before, the direct timeout stopped at half a period and the indirect
    probes had the rest: at 0.3 s every lost message made a suspicion, and
    at 0.7 s no answer came in time, so no round trip was ever measured and
    no candidate verified: every member stayed alone.
    """
    c = Cluster(8, seed=2, delay=delay, loss=0.01)
    c.run(120.0)
    assert all(view == set(c.nodes) for view in c.views().values())
    assert [(t, who, a.member.id) for t, who, a in c.events if isinstance(a, Suspected)] == []
    node = c.nodes["m000"]
    assert node.probe_timeout() >= 0.99 * 2 * (2 * delay)  # at least twice the round trip, as TCP's
    assert node.period() >= 3 * node.probe_timeout()  # room for the direct probe and the indirect one's two legs


def test_a_member_that_cannot_hear_raises_its_health_multiplier_and_kills_no_one() -> None:
    """Lifeguard's local health: the deaf member's own probes fail; its lone suspicions are refuted."""
    c = Cluster(8, seed=5)
    c.run(periods(8))
    c.blocked = lambda src, dst: dst == "m000"
    c.run(20.0)
    deaf = c.nodes["m000"]
    assert deaf.health > 0 and deaf.period() > CONFIG.heartbeat_interval
    assert all(who == "m000" or m == "m000" for _, who, m in c.deaths())  # only the deaf one and its own verdicts


def test_a_partition_splits_the_views_and_they_merge_after_the_heal() -> None:
    c = Cluster(8, seed=4)
    c.run(periods(8))
    side_a = {f"m{i:03d}" for i in range(4)}
    side_b = set(c.nodes) - side_a
    c.blocked = lambda src, dst: (src in side_a) != (dst in side_a)
    c.run(CONFIG.dead_within(8))
    views = c.views()
    assert all(views[m] == side_a for m in side_a) and all(views[m] == side_b for m in side_b)
    c.blocked = lambda src, dst: False
    c.run(CONFIG.heartbeat_interval * (4 * CONFIG.probe_dead_every + 16))
    assert all(view == set(c.nodes) for view in c.views().values())


def test_clean_leave_is_immediate_and_final() -> None:
    c = Cluster(6, seed=1)
    c.run(periods(6))
    leaver = c.nodes["m002"]
    c.carry("m002", leaver.handle(Leave(), c.now))
    c.crash("m002")
    c.run(0.1)
    assert all("m002" not in view for view in c.views().values())
    downs = [a for _, _, a in c.events if isinstance(a, MemberDown) and a.member.id == "m002"]
    assert downs and all(a.reason == "left" for a in downs)
    c.run(20.0)  # stale gossip never brings it back
    assert all("m002" not in view for view in c.views().values())
    assert not c.deaths()


def test_stale_news_does_not_resurrect_a_dead_member() -> None:
    node = Membership(Member("a", "sim://a", 0, 1), CONFIG, random.Random(0))
    old = Member("b", "sim://b", 0, 1)
    admit(node, [old, Member("c", "sim://c", 0, 1)], now=0.0)
    node.handle(Digest([Member("b", "sim://b", 0, 1, SUSPECT, by="c")], "c"), now=0.0)
    node.handle(Tick(), now=CONFIG.suspicion_timeout_max(3) + 1)
    assert not node.is_alive("b")
    assert node.handle(Digest([old], "c"), now=100.0) == []
    assert not node.is_alive("b")
    newer = Member("b", "sim://b", 0, 2)  # it refuted, or restarted
    probe = only(node.handle(Digest([newer], "c"), now=101.0), Send, kind=PING, addr="sim://b")
    assert not node.is_alive("b")  # told by c: b must answer for itself first
    actions = node.handle(Ack("b", probe[0].seq, (newer,)), now=101.01)
    assert node.is_alive("b") and only(actions, MemberUp, rejoined=True)


def test_a_death_verdict_spreads_and_blocks_resurrection_even_where_it_was_never_known() -> None:
    node = Membership(Member("a", "sim://a", 0, 1), CONFIG, random.Random(0))
    admit(node, [Member("b", "sim://b", 0, 1), Member("c", "sim://c", 0, 1)], now=0.0)
    node.handle(Digest([Member("b", "sim://b", 0, 1, SUSPECT, by="c")], "c"), now=0.0)
    node.handle(Tick(), now=0.0)
    now = CONFIG.suspicion_timeout_max(3) + 0.5
    sent = only(node.handle(Tick(), now=now), Send)
    assert node.get("b").state == DEAD
    told = [m for a in sent for m in a.entries if m.id == "b"]
    assert told and all(m.state == DEAD for m in told)  # the verdict rides on our messages
    # A member that never knew b takes the verdict as a tombstone: stale news of b cannot bring it in.
    stranger = Membership(Member("d", "sim://d", 0, 1), CONFIG, random.Random(1))
    admit(stranger, [Member("c", "sim://c", 0, 1)], now=0.0)
    assert not only(stranger.handle(Digest([Member("b", "sim://b", 0, 1, DEAD)], "c"), now=0.0), MemberUp)
    assert stranger.handle(Digest([Member("b", "sim://b", 0, 1)], "c"), now=1.0) == []
    assert not stranger.is_alive("b")
    # A message from the dead member is answered with its verdict, so that it can refute if alive after all.
    hint = node.handle(Digest([Member("b", "sim://b", 0, 1)], "b", "sim://b"), now=now + 50)
    assert any(any(m.id == "b" and m.state == DEAD for m in a.entries) for a in only(hint, Send, addr="sim://b"))


def test_a_member_we_hold_dead_hears_only_its_own_verdict_not_its_sides() -> None:
    """After a partition heals, our probe of a 'dead' member must not condemn the members of its side."""
    node = Membership(Member("a", "sim://a", 0, 1), CONFIG, random.Random(0))
    admit(node, [Member(x, f"sim://{x}", 0, 1) for x in "bc"], now=0.0)
    for x, teller in ("bc", "cb"):
        node.handle(Digest([Member(x, f"sim://{x}", 0, 1, SUSPECT, by=teller)], teller), now=0.0)
    node.handle(Tick(), now=0.0)
    start = CONFIG.suspicion_timeout_max(3) + 0.5
    sent: list[Send] = []
    for k in range(3 * CONFIG.probe_dead_every):
        sent += only(node.handle(Tick(), now=start + k), Send)
    probes = [a for a in sent if a.addr in ("sim://b", "sim://c")]
    assert probes
    for a in probes:
        dead = {m.id for m in a.entries if m.state == DEAD}
        assert dead == {a.addr.removeprefix("sim://")}


def test_a_welcomed_member_is_not_probed_until_it_starts_and_dropped_if_it_never_does() -> None:
    """A welcome adds the newcomer at incarnation 0; it may take a while to build its model and download state."""
    node = Membership(Member("a", "sim://a", 0, 1), CONFIG, random.Random(0))
    for newcomer in (Member("late", "sim://late", 0, 0), Member("never", "sim://never", 0, 0)):
        node.handle(Welcomed(newcomer), now=0.0)
    sent: list[Send] = []
    t = 0.0
    while t < CONFIG.newcomer_grace / 2:
        sent += only(node.handle(Tick(), now=t), Send)
        t += CONFIG.heartbeat_interval
    assert not only(sent, Send, kind=PING)
    assert node.is_alive("late") and node.is_alive("never") and not node.suspects()
    node.handle(Digest([Member("late", "sim://late", 0, 12345)]), now=t)  # it started: its own entry
    pinged: set[str] = set()
    downs = []
    while t < 2 * CONFIG.newcomer_grace:
        for a in node.handle(Tick(), now=t):
            if match(a, Send, kind=PING):
                pinged.add(a.addr)
            elif match(a, MemberDown):
                downs.append(a.member.id)
        t += CONFIG.heartbeat_interval
    assert "sim://late" in pinged and "sim://never" not in pinged
    assert "never" in downs and not node.is_alive("never")


@pytest.mark.parametrize("state", [SUSPECT, DEAD, LEFT])
def test_a_member_refutes_any_claim_against_its_incarnation(state: str) -> None:
    node = Membership(Member("a", "sim://a", 0, 7), CONFIG, random.Random(0))
    node.handle(Digest([Member("a", "sim://a", 0, 7, state)]), now=0.0)
    assert node.me.state == ALIVE and node.me.incarnation == 8
    node.handle(Digest([Member("a", "sim://a", 0, 5, SUSPECT)]), now=0.0)  # an older claim changes nothing
    assert node.me.incarnation == 8


def test_every_message_is_bounded() -> None:
    c = Cluster(40, seed=9)
    c.run(periods(40))
    node = c.nodes["m000"]
    sends = only(node.handle(Ping("m001", "sim://m001", 1, ()), c.now), Send)
    assert sends and all(len(a.entries) <= 2 + CONFIG.max_piggyback for a in sends)


@settings(max_examples=200, deadline=None)
@given(st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=10), lambda x: st.lists(x, max_size=7)))
def test_malformed_member_entries_raise_protocol_error_only(raw: object) -> None:
    try:
        got = members_from_wire([raw], limit=10)
    except ProtocolError:
        return  # refused: the only exception allowed (any other one fails the test)
    # Accepted: it is a well-formed member, the same one again when sent on.
    assert len(got) == 1 and isinstance(got[0], Member), got
    assert members_from_wire([got[0].to_wire()], limit=10) == got


@settings(max_examples=100, deadline=None)
@given(
    mid=st.from_regex(r"[A-Za-z0-9_.:-]{1,64}", fullmatch=True),
    shard=st.integers(0, 2**63 - 1),
    inc=st.integers(0, 2**63 - 1),
    state=st.sampled_from([ALIVE, SUSPECT, DEAD, LEFT]),
    by=st.sampled_from(["", "p0001"]),
    relay=st.booleans(),
)
def test_member_wire_round_trip(mid: str, shard: int, inc: int, state: str, by: str, relay: bool) -> None:
    m = Member(mid, "tcp://127.0.0.2:4000", shard, inc, state, by, relay)
    wire = m.to_wire()
    assert len(wire) == (7 if relay else 6)  # an entry that does not relay is as it always was
    assert members_from_wire([wire], limit=1) == [m]


def test_only_a_dialable_member_can_claim_to_relay() -> None:
    good = ["p00001", "tcp://127.0.0.2:4000", 1, 1, "alive", ""]
    assert Member.from_wire([*good, True]).relay and not Member.from_wire(good).relay
    for bad in (
        [*good, False],  # a member that does not relay sends six fields, never a seventh saying so
        [*good, 1],
        [*good, True, True],
        ["p00001", "tcp://127.0.0.2:4000/client", 1, 1, "alive", "", True],  # nobody can dial it to relay through
    ):
        with pytest.raises(ProtocolError):
            Member.from_wire(bad)


def test_member_limit_per_message() -> None:
    m = Member("p0a1", "tcp://127.0.0.2:4000", 3, 17, LEFT)
    with pytest.raises(ProtocolError):
        members_from_wire([m.to_wire()] * 2, limit=1)


def test_newcomer_gets_the_least_loaded_shard() -> None:
    assert least_loaded_shard([], 4) == 0
    assert least_loaded_shard([0, 1, 3], 4) == 2
    assert least_loaded_shard([0, 1, 2, 3, 0], 4) == 1
    assert least_loaded_shard([7, 9], 2) == 0  # out-of-range shards from another run are ignored


def test_an_id_claimed_at_an_address_that_answers_as_another_member_is_never_taken() -> None:
    # A second id for a live process (its welcome was lost and it joined again), a restart under a new id, or a
    # lie: whoever answers at that address answers as m001, so "ghost" never becomes a member, and nobody dies.
    cluster = Cluster(3, seed=4)
    cluster.run(5.0)
    ghost = Member("ghost", "sim://m001", 0, incarnation=1)
    for mid in ("m000", "m002"):
        cluster.carry(mid, cluster.nodes[mid].handle(Digest([ghost], "m001"), cluster.now))
    assert not any("ghost" in view for view in cluster.views().values())
    cluster.run(CONFIG.dead_within(4))
    assert not any("ghost" in view for view in cluster.views().values()), cluster.views()
    assert not cluster.deaths()
    assert all(cluster.nodes[m].candidates.stats.candidates_unanswered == 1 for m in ("m000", "m002"))


@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 10_000), crashes=st.lists(st.integers(0, 11), max_size=4), loss=st.sampled_from([0.0, 0.05]))
def test_the_kept_sorted_view_is_the_alive_members(seed: int, crashes: list[int], loss: float) -> None:
    """alive_ids() (kept sorted as members come and go) always equals the ids of alive(), through joins,
    crashes, suspicions, deaths and restarts."""
    c = Cluster(12, seed, loss=loss)
    for step, victim in enumerate([*crashes, None, None]):
        c.run(1.5)
        for node in c.nodes.values():
            assert node.alive_ids() == tuple(m.id for m in node.alive())
        if victim is not None:
            mid = f"m{victim:03d}"
            if mid in c.crashed:
                c.add(mid, incarnation=step + 2)  # back, as a new incarnation
            else:
                c.crash(mid)
    c.run(20)  # long enough for suspicions to become deaths
    for node in c.nodes.values():
        assert node.alive_ids() == tuple(m.id for m in node.alive())


def test_a_remembered_entry_never_lets_a_lookalike_through() -> None:
    """Valid entries are remembered by their fields; values equal to them but of another type are still refused."""
    good = ["p00001", "tcp://127.0.0.2:4000", 1, 1, "alive", ""]
    assert Member.from_wire(list(good)) == Member.from_wire(list(good))
    for bad in (
        ["p00001", "tcp://127.0.0.2:4000", True, 1, "alive", ""],
        ["p00001", "tcp://127.0.0.2:4000", 1, 1.0, "alive", ""],
        ["p00001", "tcp://127.0.0.2:4000", 1, True, "alive", ""],
    ):
        with pytest.raises(ProtocolError):
            Member.from_wire(bad)


def _deliver(to: Membership, send: Send, sender: Membership, now: float) -> list:
    """Hand ``send`` from ``sender`` to ``to`` as the network side would (kinds PING and ACK only)."""
    if send.kind == PING:
        return to.handle(Ping(sender.me.id, sender.me.addr, send.seq, send.entries), now)
    return to.handle(Ack(sender.me.id, send.seq, send.entries, challenge=send.challenge), now)


def test_a_candidate_that_probes_us_is_verified_by_echoing_the_challenge_on_our_ack() -> None:
    a = Membership(Member("a", "sim://a", 0, 1), CONFIG, random.Random(0))
    b = Membership(Member("b", "sim://b", 0, 1), CONFIG, random.Random(1))
    [ping] = [x for x in a.handle(Digest((b.me,)), 0.0) if isinstance(x, Send)]  # b heard of: a probes it
    assert ping.kind == PING and ping.addr == "sim://b"
    [ack] = [x for x in _deliver(b, ping, a, 0.01) if isinstance(x, Send)]
    assert ack.challenge and ack.addr == "sim://a"  # a is b's candidate now: the ack to its address asks for proof
    assert "a" in b.candidates and not b.is_alive("a")
    [echo] = [x for x in _deliver(a, ack, b, 0.02) if isinstance(x, Send) and x.kind == ACK]
    assert a.is_alive("b") and echo.seq == ack.challenge and echo.addr == "sim://b" and not echo.challenge
    ups = [x for x in _deliver(b, echo, a, 0.03) if isinstance(x, MemberUp)]
    assert [u.member.id for u in ups] == ["a"] and b.is_alive("a")  # 3 messages, where two probes take 4


def test_a_candidate_answering_its_first_probe_after_the_second_went_is_verified_and_its_round_trip_measured() -> None:
    """A link slower than the first deadline (a period: nothing is measured yet) must still let members in."""
    a = Membership(Member("a", "sim://a", 0, 1), CONFIG, random.Random(0))
    [first] = [x for x in a.handle(Digest((Member("b", "sim://b", 0, 1),)), 0.0) if isinstance(x, Send)]
    now, again = 0.0, []
    while not again:
        now += 0.05
        again = [x for x in a.handle(Tick(), now) if isinstance(x, Send) and x.kind == PING and x.addr == "sim://b"]
    assert again[0].seq != first.seq and "b" in a.candidates
    a.handle(Ack("b", first.seq, (Member("b", "sim://b", 0, 1),)), 1.4)  # the first probe's answer, 1.4 s on
    assert a.is_alive("b")
    assert a.probe_timeout() >= 2 * 1.4 and a.period() > CONFIG.heartbeat_interval  # the timeouts follow that link


def test_a_burst_of_candidates_answering_late_stretches_no_period_once_members_are_measured() -> None:
    a = Membership(Member("a", "sim://a", 0, 1), CONFIG, random.Random(0))
    admit(a, [Member(f"m{i}", f"sim://m{i}", 0, 1) for i in range(16)], 0.0)  # answered at once: 16 round trips of 0
    assert a.period() == CONFIG.heartbeat_interval
    a.handle(Tick(), 0.05)  # a new period: a new budget of candidate probes
    late = []
    for sender in ("x", "y"):  # made-up members that answer, each 0.9 s after it is asked
        flood = {f"sim://{sender}{i}": Member(f"{sender}{i}", f"sim://{sender}{i}", 0, 1) for i in range(8)}
        late += [(s, flood[s.addr]) for s in a.handle(Digest(list(flood.values()), sender), 0.1)
                 if isinstance(s, Send) and s.kind == PING and s.addr in flood]
    for send, m in late:
        a.handle(Ack(m.id, send.seq, (m,)), 1.0)
    assert sum(a.is_alive(m.id) for _, m in late) == len(late) > 8  # members now, as any that answers
    assert a.period() == CONFIG.heartbeat_interval  # but their answers did not set everyone's timeouts


def test_a_challenge_is_echoed_only_on_an_ack_to_our_own_probe_and_only_to_the_address_probed() -> None:
    a = Membership(Member("a", "sim://a", 0, 1), CONFIG, random.Random(0))
    # an ack nobody asked for, with a challenge: no echo (no reflection off us), nothing learned
    assert not [x for x in a.handle(Ack("x", 12345, (Member("x", "sim://victim", 0, 1),), challenge=777), 0.0)
                if isinstance(x, Send) and x.seq == 777]
    [ping] = [x for x in a.handle(Digest((Member("b", "sim://b", 0, 1),)), 0.1) if isinstance(x, Send)]
    # b answers as itself but claims another address in its entry: the echo still goes where a probed
    out = a.handle(Ack("b", ping.seq, (Member("b", "sim://elsewhere", 0, 1),), challenge=99), 0.2)
    assert [x.addr for x in out if isinstance(x, Send) and x.seq == 99] == ["sim://b"]


def test_a_wrong_echo_verifies_nobody_and_an_unechoed_challenge_is_probed_again() -> None:
    b = Membership(Member("b", "sim://b", 0, 1), CONFIG, random.Random(1))
    [ack] = [x for x in b.handle(Ping("a", "sim://a", 5, (Member("a", "sim://a", 0, 1),)), 0.0) if isinstance(x, Send)]
    assert ack.challenge
    b.handle(Ack("a", ack.challenge ^ 2, ()), 0.01)  # not the nonce sent
    assert not b.is_alive("a")
    now, probes = 0.0, []
    while now < 3 * b.period() and not probes:
        now += 0.05
        probes = [x for x in b.handle(Tick(), now) if isinstance(x, Send) and x.kind == PING and x.addr == "sim://a"]
    assert probes and probes[0].seq != ack.challenge  # a plain nonce probe once the challenge's period is over
    b.handle(Ack("a", probes[0].seq, ()), now + 0.01)
    assert b.is_alive("a")


def test_a_ping_whose_sender_claims_another_address_than_its_reply_address_gets_no_challenge() -> None:
    b = Membership(Member("b", "sim://b", 0, 1), CONFIG, random.Random(1))
    out = b.handle(Ping("a", "sim://somewhere-else", 5, (Member("a", "sim://a", 0, 1),)), 0.0)
    [ack] = [x for x in out if isinstance(x, Send) and x.kind == ACK]
    assert ack.addr == "sim://somewhere-else" and not ack.challenge


@pytest.mark.parametrize("challenge", [-1, 1 << 63, 1.5, "7", True, None])
def test_an_ack_with_a_malformed_challenge_is_refused_and_a_good_one_read(challenge: object) -> None:
    from gossiptrain.net.wire import Message
    from gossiptrain.runtime.peer_network import membership_event

    entry = Member("b", "sim://b", 0, 1).to_wire()
    good = Message(ACK, "b", "sim://b", "", 0, {"members": [entry], "seq": 3, "challenge": 41})
    assert membership_event(good, 16).challenge == 41
    assert membership_event(Message(ACK, "b", "sim://b", "", 0, {"members": [entry], "seq": 3}), 16).challenge == 0
    with pytest.raises(ProtocolError):
        membership_event(Message(ACK, "b", "sim://b", "", 0, {"members": [entry], "seq": 3, "challenge": challenge}), 16)


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 10**6), crashes=st.lists(st.integers(0, 7), max_size=3, unique=True))
def test_the_dead_index_is_the_records_held_dead(seed: int, crashes: list[int]) -> None:
    c = Cluster(8, seed=seed)
    c.run(5.0)
    for i in crashes:
        c.crash(f"m{i:03d}")
    for _ in range(8):
        c.run(periods(6))
        for node in c.nodes.values():
            view = node._view
            assert set(view._dead_ids) == {mid for mid, r in view._records.items() if r.member.state == DEAD}


def test_a_pinger_is_challenged_even_when_hearsay_fills_the_candidate_table() -> None:
    from gossiptrain.protocol.candidates import DIRECT_RESERVE

    b = Membership(Member("b", "sim://b", 0, 1), CONFIG, random.Random(1))
    for src in range(16):  # more hearsay than the table holds, from many sources, in one period
        b.handle(Digest(tuple(Member(f"h{src}x{i}", f"sim://h{src}x{i}", 0, 1) for i in range(16)), source=f"10.0.0.{src}"), 0.0)
    full = len(b.candidates)
    assert full == b.candidates.capacity
    for i in range(DIRECT_RESERVE + 1):
        me = Member(f"a{i}", f"sim://a{i}", 0, 1)
        [ack] = [x for x in b.handle(Ping(me.id, me.addr, 5, (me,), source=f"10.1.0.{i}"), 0.01) if isinstance(x, Send)]
        assert bool(ack.challenge) == (i < DIRECT_RESERVE)  # past the reserve, the table is full for pingers too
    assert len(b.candidates) == full + DIRECT_RESERVE


def test_a_crashed_member_gets_a_few_whole_views_per_round_not_one_from_everyone() -> None:
    c = Cluster(40, seed=2)
    c.run(periods(40))
    assert all(len(v) == 40 for v in c.views().values())
    c.crash("m007")
    c.run(CONFIG.dead_within(40))
    sizes: list[int] = []
    sent = c.carry

    def counting(src: str, actions: list) -> None:
        sizes.extend(len(a.entries) for a in actions if isinstance(a, Send) and a.kind == GOSSIP and a.addr == "sim://m007")
        sent(src, actions)

    c.carry = counting  # type: ignore[method-assign]
    rounds = 20
    c.run(periods(CONFIG.probe_dead_every * rounds))
    views = [n for n in sizes if n > 2]
    assert len(sizes) >= 39 * rounds // 4  # the survivors still tell it of its verdict, round after round
    assert 0 < len(views) <= 3 * DEAD_VIEW_SENDERS * rounds  # but only a few send their whole view
