"""A member that joins like any peer, never trains, and every 0.5 s gossips lies (experiments/hostile.py and its test; issue 17).

Run as ``python -m experiments.lying_member --join HOST:PORT --bind HOST:0 --lies LIES --seconds S``
(in a secure swarm also ``--key NAME.key_secret --allow DIR``: an admitted member gone rogue), with
LIES a comma-separated choice of:

- ``made-up``: N made-up members at closed loopback ports (``--made-up N``, default 2,000), rising incarnations;
- ``hijack``: each member's id at the liar's own address, incarnation + 10^12;
- ``deaths``: each member declared dead at its incarnation and at + 10^12;
- ``conn-flood``: up to ``--connections N`` (default 1,000) idle TCP connections held open to each member
  (and the coordinator), those the far end closes opened again every round;
- ``join-flood``: 500 joins a round to the coordinator and to each member, each claiming another made-up address;
- ``report-flood``: 500 reports a round to the coordinator under made-up ids, each claiming an honest member's
  address (the coordinator would answer each with gossip there: reflection);
- ``poison``: it takes part in averaging (requests and answers exchanges, never trains) with every model it
  sends scaled by ``--scale`` (default 100): valid tensors, a poisoned model (robust mode is the defence).

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
import socket
import sys
import time
from pathlib import Path

from gossiptrain.config import SecurityConfig
from gossiptrain.net import kinds
from gossiptrain.net.addressing import plain_address
from gossiptrain.net.wire import Message, encode
from gossiptrain.protocol.joining import JoinRequest
from gossiptrain.protocol.member import DEAD, Member
from gossiptrain.runtime.peer import Peer
from gossiptrain.train.workload import load_workload


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--join", required=True)
    ap.add_argument("--bind", required=True)
    ap.add_argument("--lies", default="made-up,hijack,deaths")
    ap.add_argument("--made-up", type=int, default=2000)
    ap.add_argument("--seconds", type=float, default=30.0)
    ap.add_argument("--connections", type=int, default=1000)
    ap.add_argument("--scale", type=float, default=100.0)
    ap.add_argument("--key", type=Path, help="secure swarm: our NAME.key_secret (an admitted member's)")
    ap.add_argument("--allow", type=Path, help="secure swarm: the allowed public keys")
    args = ap.parse_args(argv)
    lies = set(args.lies.split(","))
    security = SecurityConfig(args.key, args.allow) if args.key is not None else None
    peer = Peer(lambda config, seed: load_workload(config.train.workload).build_model(seed), join=args.join, bind=args.bind,
                security=security)
    node = peer._node
    assert node is not None

    def refuse(msg, frames):  # type: ignore[no-untyped-def]
        if msg.kind in (kinds.XREQ, kinds.XPUSH) and type(msg.body.get("xid")) is int:
            node.send(msg.addr, kinds.XNAK, {"xid": msg.body["xid"]})

    if "poison" in lies:
        peer._averaging.poison = args.scale  # what it sends; its own model stays as averaging leaves it
    else:
        for kind in kinds.EXCHANGE:
            node.handlers[kind] = refuse
    made_up = [Member(f"fake{i:05d}", f"tcp://127.0.0.1:{1 + i % 1000}", 0, 1) for i in range(args.made_up)]
    end = time.monotonic() + args.seconds
    limits = peer.config.limits
    held: dict[str, list[socket.socket]] = {}  # address -> the idle connections we hold to it
    source = args.bind.rpartition(":")[0].strip("[]")
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
        targets = [node.coordinator, *(m.addr for m in members)] if node.coordinator else [m.addr for m in members]
        if "conn-flood" in lies:
            for addr in targets:
                _hold_connections(held.setdefault(addr, []), addr, args.connections, source)
        if "join-flood" in lies:
            for addr in targets:
                for i in range(FLOOD):
                    claimed = f"tcp://127.0.{rounds % 250}.{i % 250 + 1}:{1 + i}"
                    frames = encode(Message(kinds.JOIN, "", claimed, "", 0, JoinRequest().to_body()), limits)
                    peer._loop.call_soon(node.transport.send, addr, frames)
        if "report-flood" in lies and node.coordinator and members:
            for i in range(FLOOD):
                fake = Member(f"frep{rounds:04d}{i:04d}", members[i % len(members)].addr, 0, 1)
                body = {"member": fake.to_wire(), "spec": None}
                frames = encode(Message(kinds.REPORT, fake.id, fake.addr, node.fingerprint, 0, body), limits)
                peer._loop.call_soon(node.transport.send, node.coordinator, frames)
        if rounds == 1:
            print("lying", flush=True)
        if "poison" in lies:  # safe points without training for half a second: it averages (and poisons) as a peer
            until = time.monotonic() + 0.5
            while time.monotonic() < until:
                peer.step()
                time.sleep(0.005)
        else:
            time.sleep(0.5)
    for socks in held.values():
        for sock in socks:
            sock.close()
    peer.close()
    return 0


#: Joins or reports sent a round in a flood.
FLOOD = 500


def _hold_connections(socks: list[socket.socket], addr: str, count: int, source: str) -> None:
    """Keep ``count`` idle TCP connections from ``source`` (our IP) open to ``addr``: drop those closed, dial more."""
    alive = []
    for sock in socks:
        try:
            if sock.recv(4096, socket.MSG_DONTWAIT | socket.MSG_PEEK) == b"":
                sock.close()  # closed by the far end
                continue
        except BlockingIOError:
            pass  # open and quiet
        except OSError:
            sock.close()
            continue
        alive.append(sock)
    socks[:] = alive
    host, _, port = plain_address(addr).removeprefix("tcp://").rpartition(":")
    while len(socks) < count:
        sock = socket.socket()
        sock.setblocking(False)
        try:
            sock.bind((source, 0))  # from our own address, as an attacker on its own host (loopback: 127.0.0.x)
            sock.connect((host.strip("[]"), int(port)))
        except BlockingIOError:
            pass
        except OSError:
            sock.close()
            return  # out of descriptors or ports ourselves: hold what we have
        socks.append(sock)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
