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
