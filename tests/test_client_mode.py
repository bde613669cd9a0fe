"""Client-mode members: peers nobody can dial (behind NAT) train in the swarm over connections they open.

In the simulator (``SimConfig.behind_nat``) a client is reached only from
addresses it has sent to, as over a real NAT; the real thing, on network
namespaces with a masquerading router, is in test_netns_nat.py, and the
transport's side (routes, CURVE keys) in the transport conformance suite
and test_security.py.
"""

from __future__ import annotations

import random
from collections import Counter
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gossiptrain.config import MembershipConfig, RunConfig
from gossiptrain.errors import ProtocolError
from gossiptrain.net.addressing import client_address, is_client_address, plain_address
from gossiptrain.net.kinds import FIN, PING, PING_REQ
from gossiptrain.net.transport.base import RelayBudget
from gossiptrain.protocol.finish import DONE, Announce, FinishEndpoint, FinNotice
from gossiptrain.protocol.member import Member
from gossiptrain.protocol.membership import Membership
from gossiptrain.protocol.reachability import Verdict
from gossiptrain.protocol.swim.events import Ack, Digest, Send, Tick
from gossiptrain.runtime.peer_network import relay_rank
from gossiptrain.sim.cluster import COORDINATOR, Cluster, SimConfig, simulate
from gossiptrain.sim.faults import ChurnEvent
from gossiptrain.sim.vtime import run_virtual

BEHIND_NAT = (0, 3, 5)


def members_only() -> RunConfig:
    return RunConfig().with_overrides({"train.workload": "external", "membership.heartbeat_interval": 0.5})


def test_client_addresses_keep_their_key_and_read_plainly() -> None:
    assert client_address("tcp://10.0.0.2:7070") == "tcp://10.0.0.2:7070/client"
    key = "?curve=" + "ab" * 32
    assert client_address("tcp://10.0.0.2:7070" + key) == "tcp://10.0.0.2:7070/client" + key
    assert client_address(client_address("tcp://h:1")) == "tcp://h:1/client"  # once is enough
    assert is_client_address("tcp://h:1/client" + key) and not is_client_address("tcp://h:1" + key)
    assert not is_client_address("tcp://client:1") and plain_address("tcp://h:1/client" + key) == "tcp://h:1/client"
    line = Verdict(False, "tcp://h:1", "--reachable no").line("p1")
    assert "client-mode member (its address now ends in /client)" in line


def test_a_candidate_nobody_can_dial_is_verified_through_a_member_that_can() -> None:
    """Membership's side: a member we can send to is probed directly, as ever; a client it introduces, which
    we cannot send to, through that member (a ping-req), whose relayed ack verifies it. Nobody probes it
    directly, so nothing is sent that could only fail."""
    me = Member("pa", "sim://a", 0, incarnation=1)
    relay = Member("pr", "sim://r", 1, incarnation=1)
    client = Member("pc", "sim://c/client", 2, incarnation=1)
    m = Membership(me, MembershipConfig(), random.Random(0), can_reach=lambda addr: not is_client_address(addr))
    [ping] = [a for a in m.handle(Digest([relay], sender="pr", reply_to=relay.addr), 0.0) if isinstance(a, Send)]
    assert (ping.addr, ping.kind) == (relay.addr, PING)
    m.handle(Ack("pr", ping.seq), 0.01)
    assert "pr" in m.alive_ids()
    sent = [a for a in m.handle(Digest([relay, client], sender="pr", reply_to=relay.addr), 0.02) if isinstance(a, Send)]
    [ask] = [a for a in sent if a.kind == PING_REQ]
    assert (ask.addr, ask.target, ask.target_addr) == (relay.addr, "pc", client.addr)
    assert not [a for a in sent if a.addr == client.addr], "a client we cannot reach was sent to"
    m.handle(Ack("px", ask.seq), 0.03)  # an ack relayed by someone we did not ask proves nothing
    assert "pc" not in m.alive_ids()
    m.handle(Ack("pr", ask.seq), 0.03)
    assert "pc" in m.alive_ids()
    for now in (0.5 * i for i in range(1, 40)):  # periods pass: probes go to the relay only, never the client
        assert all(a.addr != client.addr for a in m.handle(Tick(), now) if isinstance(a, Send))


def test_clients_see_everyone_and_nobody_is_declared_dead() -> None:
    """8 members, 3 of them behind NAT: within 5 virtual seconds every view holds all 8, clients included,
    and it stays so (a client is never probed by a member it could not answer, so never suspected in vain)."""
    result = simulate(SimConfig(peers=8, run=members_only(), duration=30, membership_only=True, sample_every=1,
                                behind_nat=BEHIND_NAT))
    later = [r for r in result.rows if r["time"] >= 5]
    assert later and all(r["members"] == 8 for r in later), sorted({(r["time"], r["members"]) for r in later})[:10]


def test_a_crashed_client_leaves_every_view_judged_by_those_it_talked_to() -> None:
    run = members_only()
    trace = (ChurnEvent(8.0, 3, "crash"),)
    cluster = Cluster(SimConfig(peers=6, run=run, duration=30, membership_only=True, churn_trace=trace, behind_nat=(2, 3)))
    seen: dict[float, dict[int, tuple[str, ...]]] = {}
    crashed: list[str] = []

    def on_sample(now: float, rows: list[dict[str, Any]]) -> None:
        seen[now] = {s: p.node.view() for s, p in cluster.peers.items() if p.node is not None}
        if now == 7.0:
            crashed.append(cluster.peers[3].node.me.id)
            assert is_client_address(cluster.peers[3].node.me.addr)

    cluster.on_sample = on_sample
    run_virtual(cluster.run())
    assert all(len(v) == 6 for v in seen[7.0].values()), seen[7.0]
    bound = 8.0 + run.membership.dead_within(6)
    for now, views in seen.items():
        if now >= bound:
            assert all(crashed[0] not in v and len(v) == 5 for s, v in views.items() if s != 3), (now, views)


def test_a_swarm_mostly_behind_nat_learns_from_skewed_shards() -> None:
    """4 peers on label-skewed shards, 2 behind NAT, starting together (``--wait-for 4``: the two behind NAT
    learn that each other is ready through the others): the two clients average with each other through the
    coordinator's relay, and the swarm reaches a mean test accuracy of 0.9, as a fully reachable one does."""
    run = RunConfig().with_overrides({"train.workload": "digits-small", "train.partition": "classes-per-peer",
                                      "train.partition_classes": 3, "train.shards": 4})
    cluster = Cluster(SimConfig(peers=4, run=run, duration=6, step_time=0.01, behind_nat=(1, 2), target_accuracy=0.9,
                                wait_for=4))
    result = run_virtual(cluster.run())
    assert result.summary["mean_test_acc"] >= 0.9, result.summary
    relayed = {slot: p.transport.stats.received_relayed for slot, p in cluster.peers.items() if p.transport is not None}
    assert relayed[1] > 0 and relayed[2] > 0 and relayed[0] == relayed[3] == 0, relayed


def skewed_digits() -> RunConfig:
    return RunConfig().with_overrides({"train.workload": "digits-small", "train.partition": "classes-per-peer",
                                       "train.partition_classes": 3, "train.shards": 4})


def test_clients_average_through_a_peer_that_relays() -> None:
    """``gossiptrain peer --relay``: with the coordinator relaying nothing (``--no-relay``), the two clients
    average with each other through the one peer that relays (its membership entry says so), and the swarm
    learns as with the coordinator's relay."""
    cluster = Cluster(SimConfig(peers=4, run=skewed_digits(), duration=6, step_time=0.01, behind_nat=(1, 2),
                                relays=(0,), coordinator_relay=False, target_accuracy=0.9, wait_for=4))
    result = run_virtual(cluster.run())
    assert result.summary["mean_test_acc"] >= 0.9, result.summary
    relay = cluster.peers[0]
    assert relay.node is not None and relay.node.me.relay and relay.transport is not None
    for slot in (1, 2):
        client = cluster.peers[slot]
        assert client.transport is not None and client.transport.relay == relay.node.me.addr
        assert client.transport.stats.received_relayed > 0, slot
    assert relay.transport.stats.relayed > 0
    assert not any(p.node.me.relay for s, p in cluster.peers.items() if s != 0 and p.node is not None)


def test_clients_of_a_relay_that_dies_go_on_through_the_coordinator() -> None:
    """The relaying peer crashes mid-run, exchanges through it in flight: within one exchange timeout both
    clients complete exchanges with other partners; once they suspect it they take the coordinator's relay
    (the next one they have), and go on averaging with each other through it."""
    run = skewed_digits()
    crash_at = 3.0
    trace = (ChurnEvent(crash_at, 0, "crash"),)
    cluster = Cluster(SimConfig(peers=4, run=run, duration=crash_at + 3, sample_every=0.25,
                                step_time=0.01, behind_nat=(1, 2), relays=(0,), churn_trace=trace, wait_for=4))
    relayed_at: dict[float, dict[int, int]] = {}
    relays_at: dict[float, dict[int, str | None]] = {}
    completed_at: dict[float, dict[int, int]] = {}

    def on_sample(now: float, rows: list[dict[str, Any]]) -> None:
        clients = {s: cluster.peers[s].transport for s in (1, 2)}
        relayed_at[now] = {s: t.stats.received_relayed for s, t in clients.items() if t is not None}
        relays_at[now] = {s: t.relay for s, t in clients.items() if t is not None}
        completed_at[now] = {s: a.stats.completed for s in (1, 2) if (a := cluster.peers[s].averaging) is not None}

    cluster.on_sample = on_sample
    run_virtual(cluster.run())
    timeout = run.gossip.exchange_timeout_min  # the exchanges' timeout here (their round trips are far shorter)
    at_crash = max(t for t in completed_at if t <= crash_at)
    one_timeout_on = min(t for t in completed_at if t >= crash_at + timeout)
    assert all(completed_at[one_timeout_on][s] > completed_at[at_crash][s] for s in (1, 2)), str(completed_at)
    before = max(t for t in relays_at if t < crash_at)
    assert all(r is not None and r.startswith("sim://peer0") for r in relays_at[before].values()), relays_at[before]
    end = max(relays_at)
    assert relays_at[end] == {1: COORDINATOR, 2: COORDINATOR}, relays_at[end]
    switched = min(t for t in relays_at if relays_at[t] == relays_at[end])
    assert all(relayed_at[end][s] > relayed_at[switched][s] for s in (1, 2)), (relayed_at[switched], relayed_at[end])
    for s in (1, 2):  # the coordinator's at first where the relay's entry came after the welcome, never back
        seen = [relays_at[t][s] for t in sorted(relays_at)]
        steps = [r for i, r in enumerate(seen) if i == 0 or r != seen[i - 1]]
        assert steps[-2:] == [relays_at[before][s], COORDINATOR] and len(steps) <= 3, steps
        assert len(steps) <= cluster.peers[s].node.stats.relay_changes <= 3, s  # some may come between samples


@given(
    clients=st.lists(st.text("abcdef0123456789", min_size=1, max_size=12), min_size=1, max_size=40, unique=True),
    relays=st.lists(st.text("ghijk0123456789", min_size=1, max_size=12), min_size=2, max_size=8, unique=True),
    gone=st.integers(0, 7),
)
def test_a_relay_that_goes_moves_only_its_own_clients(clients: list[str], relays: list[str], gone: int) -> None:
    """Rendezvous hashing (``relay_rank``): every client picks on its own, and when a relay goes only the
    clients that had picked it pick again; the others keep theirs."""
    def pick(client: str, among: list[str]) -> str:
        return max(among, key=lambda r: relay_rank(client, r))

    lost = relays[gone % len(relays)]
    rest = [r for r in relays if r != lost]
    for c in clients:
        before, after = pick(c, relays), pick(c, rest)
        assert after == before or before == lost


def test_clients_spread_over_the_relays() -> None:
    relays = ["pa", "pb", "pc"]
    counts = Counter(max(relays, key=lambda r: relay_rank(f"p{i:04x}", r)) for i in range(300))
    assert set(counts) == set(relays) and min(counts.values()) >= 60, counts


@given(st.lists(st.tuples(st.floats(0, 2), st.integers(1, 10_000_000)), max_size=60))
def test_a_relay_passes_no_more_than_its_rate_allows_and_one_message_more(sends: list[tuple[float, int]]) -> None:
    rate, burst = 1e6, 4e6
    budget = RelayBudget(rate, burst, 0.0)
    now, passed = 0.0, 0
    for gap, nbytes in sends:
        now += gap
        if budget.take(nbytes, now):
            passed += nbytes
            assert passed <= burst + rate * now + nbytes  # in debt by the message just passed, at most
    if sends:
        assert budget.take(1, now + (max(0.0, -budget.tokens) + 1) / rate + 1e-6)  # debts are paid off at the rate


def test_a_done_member_tells_clients_who_else_is_done_as_they_cannot_hear_each_other() -> None:
    """The final phase: two clients cannot send each other their ``fin``. A done member that hears one is
    done passes it on to the other clients (once), and every fin carries the sender's done list, so a client
    waits for no one who has finished."""
    run = RunConfig()
    fp = run.fingerprint()
    members = [Member("pub", "sim://pub", 0, 1), Member("ca", "sim://a/client", 1, 1), Member("cb", "sim://b/client", 2, 1),
               Member("pub2", "sim://pub2", 3, 1)]
    public = FinishEndpoint(run, me="pub", members=lambda: members)
    assert public.handle(FinNotice("ca", "sim://a/client", fp, {"phase": DONE, "writer": False}), 0.0) == []  # we train on
    announced = public.handle(Announce(DONE, False), 1.0)
    assert {a.addr for a in announced} == {"sim://a/client", "sim://b/client", "sim://pub2"}
    assert all(a.body["done"] == ["ca"] for a in announced)  # who else is done, with our own notice
    [to_a] = public.handle(FinNotice("cb", "sim://b/client", fp, {"phase": DONE, "writer": False}), 2.0)
    assert (to_a.addr, to_a.body["done"]) == ("sim://a/client", ["cb"])  # done itself, it waits for the others
    relayed = FinishEndpoint(run, me="pub2", members=lambda: members)
    relayed.handle(Announce(DONE, False), 0.0)
    [to_b] = relayed.handle(FinNotice("ca", "sim://a/client", fp, {"phase": DONE, "writer": False}), 1.0)
    assert (to_b.addr, to_b.kind, to_b.body["done"]) == ("sim://b/client", FIN, ["ca"])
    assert relayed.handle(FinNotice("ca", "sim://a/client", fp, {"phase": DONE, "writer": False}), 1.5) == []  # once
    client_b = FinishEndpoint(run, me="cb", members=lambda: members)
    client_b.handle(FinNotice("pub2", "sim://pub2", fp, to_b.body), 2.0)
    assert set(client_b.done) == {"pub2", "ca"}
    for bad in ("ca", ["x" * 65], [1], ["ok"] * 257):
        with pytest.raises(ProtocolError, match="done lists"):
            client_b.handle(FinNotice("pub", "sim://pub", fp, {"phase": DONE, "writer": False, "done": bad}), 3.0)
