"""The coordinator's bootstrap duties that no swarm test pins down on its own."""

from __future__ import annotations

import asyncio

from gossiptrain.config import RunConfig
from gossiptrain.net.kinds import GOSSIP, REPORT
from gossiptrain.net.transport.sim import LinkProfile, SimNetwork, SimTransport
from gossiptrain.net.wire import Message, decode, encode
from gossiptrain.protocol.membership import Member
from gossiptrain.runtime.coordinator import Coordinator
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
