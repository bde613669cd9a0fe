"""A member that joins like any peer, never trains, and every 0.5 s gossips lies (experiments/hostile.py and its test; issue 17).

Run as ``python -m experiments.lying_member --join HOST:PORT --bind HOST:0 --lies LIES --seconds S``,
with LIES a comma-separated choice of:

- ``made-up``: N made-up members at closed loopback ports (``--made-up N``, default 2,000), rising incarnations;
- ``hijack``: each member's id at the liar's own address, incarnation + 10^12;
- ``deaths``: each member declared dead at its incarnation and at + 10^12.

It uses the project's own message format through a real ``Peer`` (it is a
verified member: it answers probes), so what it sends is exactly what a
modified peer could send. Exchange requests it refuses at once (a member
that never trains has nothing to give; answering them from its initial
model would drag its partners back, the same with or without lies). It
prints ``lying`` once it has sent its first lies.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time

from gossiptrain.net import kinds
from gossiptrain.protocol.membership import DEAD, Member
from gossiptrain.runtime.peer import Peer
from gossiptrain.train.workload import load_workload


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--join", required=True)
    ap.add_argument("--bind", required=True)
    ap.add_argument("--lies", default="made-up,hijack,deaths")
    ap.add_argument("--made-up", type=int, default=2000)
    ap.add_argument("--seconds", type=float, default=30.0)
    args = ap.parse_args(argv)
    lies = set(args.lies.split(","))
    peer = Peer(lambda config, seed: load_workload(config.train.workload).build_model(seed), join=args.join, bind=args.bind)
    node = peer._node
    assert node is not None

    def refuse(msg, frames):  # type: ignore[no-untyped-def]
        if msg.kind in (kinds.XREQ, kinds.XPUSH) and type(msg.body.get("xid")) is int:
            node.send(msg.addr, kinds.XNAK, {"xid": msg.body["xid"]})

    for kind in kinds.EXCHANGE:
        node.handlers[kind] = refuse
    made_up = [Member(f"fake{i:05d}", f"tcp://127.0.0.1:{1 + i % 1000}", 0, 1) for i in range(args.made_up)]
    end = time.monotonic() + args.seconds
    rounds = 0
    while time.monotonic() < end:
        rounds += 1
        members = [m for m in node.membership.alive() if m.id != node.me.id]
        out: list[Member] = []
        if "made-up" in lies:
            out += [dataclasses.replace(m, incarnation=m.incarnation + rounds) for m in made_up]
        if "hijack" in lies:
            out += [dataclasses.replace(m, addr=node.me.addr, incarnation=m.incarnation + 10**12) for m in members]
        if "deaths" in lies:
            out += [dataclasses.replace(m, state=DEAD) for m in members]
            out += [dataclasses.replace(m, state=DEAD, incarnation=m.incarnation + 10**12) for m in members]
        body = {"members": [m.to_wire() for m in (node.me, *out)]}
        for m in members:
            peer._loop.call_soon(node.send, m.addr, kinds.GOSSIP, body)
        if rounds == 1:
            print("lying", flush=True)
        time.sleep(0.5)
    peer.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
