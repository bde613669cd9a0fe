"""The coordinator's bootstrap duties that no swarm test pins down on its own."""

from __future__ import annotations

import asyncio
import random

import pytest

from gossiptrain.config import RunConfig
from gossiptrain.errors import ProtocolError
from gossiptrain.net.kinds import GOSSIP, REPORT
from gossiptrain.net.transport.sim import LinkProfile, SimNetwork, SimTransport
from gossiptrain.net.wire import Message, decode, encode
from gossiptrain.protocol.member import Member
from gossiptrain.runtime.coordinator import Coordinator
from gossiptrain.sim.cluster import Cluster, SimConfig
from gossiptrain.sim.vtime import LoopClock, run_virtual


def test_a_report_is_answered_with_other_live_members_so_lonely_peers_meet() -> None:
    """Two peers welcomed while the registry was empty learn of each other at their next report."""
    run = RunConfig()
    limits = run.limits

    async def main() -> list[str]:
        network = SimNetwork(LinkProfile(latency=0.001, bandwidth=float("inf")))
        with network.activate():
            c_t = SimTransport("sim://coordinator", limits, network=network)
            a_t = SimTransport("sim://a:1", limits, network=network)
            b_t = SimTransport("sim://b:1", limits, network=network)
            async with c_t, a_t, b_t, Coordinator(run, c_t, clock=LoopClock(), seed=1):
                for t, mid in ((a_t, "pa"), (b_t, "pb")):
                    me = Member(mid, t.address, 0, 1)
                    body = {"member": me.to_wire(), "spec": None}
                    t.send(c_t.address, encode(Message(REPORT, mid, t.address, run.fingerprint(), 0, body), limits))
                    await asyncio.sleep(0.01)
                answer = decode(await asyncio.wait_for(b_t.recv(), 5), limits)
                assert answer.kind == GOSSIP and answer.fingerprint == run.fingerprint()
                return [Member.from_wire(e).id for e in answer.body["members"]]

    assert run_virtual(main()) == ["pa"]


def _flood(run: RunConfig, reports: list[tuple[str, str]]) -> tuple[Coordinator, list[str], int]:
    """An honest member reports, then ``reports`` (id, claimed address) arrive from one attacker's transport.

    Returns the coordinator, the ids it then holds, and how many messages reached the claimed addresses.
    """
    limits = run.limits

    async def main() -> tuple[Coordinator, list[str], int]:
        network = SimNetwork(LinkProfile(latency=0.001, bandwidth=float("inf")))
        with network.activate():
            c_t = SimTransport("sim://coordinator", limits, network=network)
            honest_t = SimTransport("sim://honest:1", limits, network=network)
            rogue_t = SimTransport("sim://rogue:1", limits, network=network)
            victim_t = SimTransport("sim://victim:1", limits, network=network)
            coordinator = Coordinator(run, c_t, clock=LoopClock(), seed=1)
            async with c_t, honest_t, rogue_t, victim_t, coordinator:
                me = Member("phonest", honest_t.address, 0, 1)
                body = {"member": me.to_wire(), "spec": None}
                honest_t.send(c_t.address, encode(Message(REPORT, me.id, me.addr, run.fingerprint(), 0, body), limits))
                await asyncio.sleep(0.01)
                for mid, addr in reports:
                    fake = Member(mid, addr, 0, 1)
                    body = {"member": fake.to_wire(), "spec": None}
                    rogue_t.send(c_t.address, encode(Message(REPORT, mid, addr, run.fingerprint(), 0, body), limits))
                    await asyncio.sleep(0.0001)
                await asyncio.sleep(0.05)
                return coordinator, [m.id for m in coordinator.members()], victim_t.stats.messages_received

    return run_virtual(main())


def test_a_report_flood_from_one_source_is_dropped_and_reflects_little() -> None:
    """1,000 forged reports naming a victim's address: past the burst they are dropped unanswered."""
    run = RunConfig().with_overrides({"limits.report_burst": 10, "limits.report_rate_per_source": 1.0})
    coordinator, ids, reflected = _flood(run, [(f"pfake{i}", "sim://victim:1") for i in range(1000)])
    assert "phonest" in ids
    assert len(ids) <= 1 + 10 + 1  # the honest member, the burst, what the rate refilled in ~0.15 virtual s
    assert coordinator.stats.reports_throttled >= 1000 - 11
    assert reflected <= 11  # gossip the coordinator sent to the address the forged reports claimed


def test_the_registry_is_bounded_and_the_members_it_knows_keep_their_places() -> None:
    """Reports from 500 claimed sources (sim:// has no source IP), into a registry of 50."""
    run = RunConfig().with_overrides({"limits.registry_members": 50})
    coordinator, ids, _ = _flood(run, [(f"pfake{i}", f"sim://fake{i}:1") for i in range(500)])
    assert len(ids) == 50 and "phonest" in ids
    assert coordinator.stats.registry_full == 500 - 49


def test_forged_reports_from_everywhere_make_the_coordinator_gossip_to_their_address_once() -> None:
    """No rate limit to hide behind: 1,000 reports under 1,000 ids, all claiming the victim's address."""
    run = RunConfig().with_overrides({"limits.report_burst": 100_000, "limits.report_rate_per_source": 1e6})
    coordinator, ids, reflected = _flood(run, [(f"pfake{i}", "sim://victim:1") for i in range(1000)])
    assert coordinator.stats.reports_throttled == 0 and coordinator.stats.reports >= 1000
    assert reflected == 1  # the first forged report's introduction; every later one within the interval is skipped
    assert coordinator.stats.introductions_skipped >= 999 - 1


def test_a_member_reported_dead_is_not_handed_out_until_it_reports_again() -> None:
    run = RunConfig()
    limits, interval = run.limits, run.membership.report_interval

    async def main() -> list[list[str]]:
        network = SimNetwork(LinkProfile(latency=0.001, bandwidth=float("inf")))
        with network.activate():
            c_t = SimTransport("sim://coordinator", limits, network=network)
            a_t, b_t, z_t = (SimTransport(f"sim://{n}:1", limits, network=network) for n in "abz")
            coordinator = Coordinator(run, c_t, clock=LoopClock(), seed=1)
            seen = []

            def report(t: SimTransport, mid: str, dead: list[str]) -> None:
                body = {"member": Member(mid, t.address, 0, 1).to_wire(), "spec": None, "dead": dead}
                t.send(c_t.address, encode(Message(REPORT, mid, t.address, run.fingerprint(), 0, body), limits))

            async with c_t, a_t, b_t, z_t, coordinator:
                for t, mid in ((a_t, "pa"), (b_t, "pb"), (z_t, "pz")):
                    report(t, mid, [])
                await asyncio.sleep(0.01)
                report(a_t, "pa", ["pz"])  # pz reported a moment ago: its own word is newer, it stays
                await asyncio.sleep(0.01)
                seen.append(sorted(m.id for m in coordinator.members()))
                await asyncio.sleep(interval)  # pz falls silent (it crashed); a finds it dead
                report(a_t, "pa", ["pz", "pa", "pnobody"])  # itself and unknown ids: ignored
                await asyncio.sleep(0.01)
                seen.append(sorted(m.id for m in coordinator.members()))
                report(z_t, "pz", [])  # it was alive after all: its own report brings it back
                await asyncio.sleep(0.01)
                seen.append(sorted(m.id for m in coordinator.members()))
                assert coordinator.stats.reported_dead == 1
            return seen

    assert run_virtual(main()) == [["pa", "pb", "pz"], ["pa", "pb"], ["pa", "pb", "pz"]]


def test_a_report_with_malformed_deaths_is_refused() -> None:
    run = RunConfig()
    coordinator = Coordinator(run, SimTransport("sim://c", run.limits, network=SimNetwork()), clock=LoopClock(), seed=1)
    with pytest.raises(ProtocolError, match="dead must be a list of member ids"):
        coordinator._forget_dead(["ok", 7], "pa", 0.0)


def test_peers_report_a_crashed_member_and_the_coordinator_stops_handing_it_out_before_it_would_expire() -> None:
    from gossiptrain.runtime.peer_network import PeerNode

    run = RunConfig()
    m = run.membership
    expiry = 3 * m.report_interval + m.suspicion_timeout_max(1)  # what the registry alone would take

    async def main() -> tuple[float, float]:
        network = SimNetwork(LinkProfile(latency=0.001))
        loop = asyncio.get_running_loop()
        with network.activate():
            c_t = SimTransport("sim://coordinator", run.limits, network=network)
            async with c_t, Coordinator(run, c_t, clock=LoopClock(), seed=1) as coordinator:
                nodes, transports = [], []
                for i in range(3):
                    t = await SimTransport(f"sim://p{i}", run.limits, network=network).start()
                    n = PeerNode(me=Member(f"p{i}", t.address, 0, 10 + i), config=run, transport=t, clock=LoopClock(),
                                 rng=random.Random(i), spec=None, seeds=[x.me for x in nodes], coordinator=c_t.address)
                    nodes.append(await n.start())
                    transports.append(t)
                while not (all(len(n.view()) == 3 for n in nodes) and len(coordinator.members()) == 3):
                    await asyncio.sleep(0.05)
                await nodes[2].close("killed")  # no leave: a crash
                await transports[2].close("killed")
                crashed = loop.time()
                while "p2" in nodes[0].view():
                    await asyncio.sleep(0.05)
                declared = loop.time()
                while "p2" in [x.id for x in coordinator.members()]:
                    await asyncio.sleep(0.05)
                gone = loop.time()
                for n, t in zip(nodes[:2], transports[:2]):
                    await n.close("test over")
                    await t.close("test over")
                return declared - crashed, gone - crashed

    declared, gone = run_virtual(main())
    assert gone <= declared + m.report_interval + 0.2  # at the next report after the verdict
    assert gone < expiry  # ...not after the registry's expiry


def test_a_member_that_reports_itself_unreachable_is_handed_to_nobody() -> None:
    """Behind NAT its address cannot be dialled: newcomers and lonely reporters would only probe it in vain."""
    run = RunConfig()
    limits = run.limits

    async def main() -> tuple[list[str], list[str], list[str], int]:
        network = SimNetwork(LinkProfile(latency=0.001, bandwidth=float("inf")))
        with network.activate():
            c_t = SimTransport("sim://coordinator", limits, network=network)
            a_t, n_t, x_t = (SimTransport(f"sim://{n}:1", limits, network=network) for n in "anx")
            coordinator = Coordinator(run, c_t, clock=LoopClock(), seed=1)

            def report(t: SimTransport, mid: str, **extra: object) -> None:
                body = {"member": Member(mid, t.address, 0, 1).to_wire(), "spec": None, **extra}
                t.send(c_t.address, encode(Message(REPORT, mid, t.address, run.fingerprint(), 0, body), limits))

            async with c_t, a_t, n_t, x_t, coordinator:
                report(n_t, "pn", unreachable=True)
                await asyncio.sleep(0.01)
                report(a_t, "pa")
                await asyncio.sleep(0.01)
                assert a_t.stats.messages_received == 0  # pn is not introduced to it: nobody dialable to introduce
                sample, _ = coordinator._join_sample()
                bad = coordinator.stats.bad_messages
                report(x_t, "px", unreachable="yes")  # not a bool: refused
                await asyncio.sleep(0.01)
                reported = [m.id for m in coordinator.registry.reported(coordinator.clock.now())]
                members = sorted(m.id for m in coordinator.members())
                return [m.id for m in sample], members, reported, coordinator.stats.bad_messages - bad

    sample, members, reported, refused = run_virtual(main())
    assert sample == ["pa"] and reported == ["pa"]  # newcomers are handed the dialable member only
    assert members == ["pa", "pn"]  # still a member: a roster (status, export) lists it
    assert refused == 1


@pytest.mark.parametrize("coordinator_inbox, all_in", [(4096, True), (16, False)])
def test_peers_started_in_one_instant_all_join_at_once(coordinator_inbox: int, all_in: bool) -> None:
    """A scheduler starts every member together: their joins reach the coordinator in one instant. Its inbox
    (``limits.coordinator_inbox_messages``) takes them all, where one the size of a member's (16 here) drops
    most, and those come back only after a join timeout (2-3 s)."""
    run = RunConfig().with_overrides({"limits.inbox_messages": 16, "limits.coordinator_inbox_messages": coordinator_inbox})
    cluster = Cluster(SimConfig(peers=64, run=run, membership_only=True, duration=0.5, join_spread=0.0, sample_every=0.5))
    run_virtual(cluster.run())
    joined = sum(1 for p in cluster.peers.values() if p.node is not None)
    assert (joined == 64) == all_in, joined
