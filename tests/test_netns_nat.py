"""The WAN harness on real network stacks, and peers behind NAT training in a swarm as client-mode members.

The world of these tests (``gossiptrain.testing.netns``): two public hosts
on a Lan (198.18.0.1, .2) and a home router on it (198.18.0.3) with one host
behind it (198.19.N.2), masqueraded by ``iptables``. The first tests check
the harness itself, as properties of the setup (a connection out works and
arrives from the router's address; nothing gets in; a netem delay shows in a
round trip; a tbf rate bounds a transfer); the last runs a swarm of two
public peers and two behind their own routers (``two_homes``): those behind
NAT are told nobody can dial them, join as client-mode members, and train
with the others over connections they open.

Needs root, iproute2 and iptables; delay needs a kernel with netem. Each
missing piece skips the tests that need it, saying which. Names carry the
test process's pid, and the namespaces are deleted (whatever still runs in
them killed) at teardown, pass or fail.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import pytest

from gossiptrain.testing import netns

from . import zygote
from .swarm import ROOT, wait_for

# A TCP server for one test: it tells each client the address it came from, then reads until the client is done.
SERVER = """
import socket, sys
s = socket.socket()
s.bind((sys.argv[1], int(sys.argv[2])))
s.listen()
print("ready", flush=True)
while True:
    c, a = s.accept()
    c.sendall(a[0].encode() + b"\\n")
    while c.recv(1 << 16):
        pass
    c.close()
"""

# A client: connect (timed), read what the server says, send N bytes, wait until the server has read them all.
CLIENT = """
import socket, sys, time
began = time.perf_counter()
c = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=float(sys.argv[4]))
connected = time.perf_counter()
seen = c.makefile().readline().strip()
c.sendall(bytes(int(sys.argv[3])))
c.shutdown(socket.SHUT_WR)
c.recv(1)  # the server's close: every byte was read
print(seen, connected - began, time.perf_counter() - connected)
"""

PORT = 9000


@dataclass
class World:
    lan: netns.Lan
    nat: netns.NatRouter
    started: list[subprocess.Popen[str] | zygote.ForkedProcess]  # killed, and their pipes closed, at teardown
    homes: list[netns.NatRouter] = field(default_factory=list)  # every router, one host behind each (nat: the first)

    @property
    def behind(self) -> netns.Namespace:
        return self.nat.hosts[0]

    def close(self) -> None:
        for proc in self.started:
            proc.kill()
            proc.wait(10)
            if proc.stdout is not None:
                proc.stdout.close()


def entered(stack: contextlib.ExitStack, network: netns.Lan | netns.NatRouter) -> None:
    """Enter ``network`` on ``stack``; a machine where namespaces cannot be made skips, saying why."""
    try:
        stack.enter_context(network)
    except netns.NetnsError as e:
        if "netns add" in str(e):  # no namespaces here (a container without CAP_SYS_ADMIN, say)
            pytest.skip(f"network namespaces are unavailable: {e}")
        raise


@contextlib.contextmanager
def nat_world(public: int, homes: int, prefix: str) -> Iterator[World]:
    """``public`` hosts on a Lan and ``homes`` routers on it, one host behind each; all gone on the way out."""
    if (why := netns.why_not("iptables", need="network namespaces and a NAT router")) is not None:
        pytest.skip(f"the NAT harness {why}")
    with contextlib.ExitStack() as stack:
        lan = netns.Lan(public, prefix=prefix)
        entered(stack, lan)
        routers = [netns.NatRouter(lan) for _ in range(homes)]
        for router in routers:
            entered(stack, router)
        world = World(lan, routers[0], [], routers)
        stack.callback(world.close)  # first, while the namespaces still exist
        yield world


@pytest.fixture
def world() -> Iterator[World]:
    with nat_world(2, 1, "gt-wan") as w:
        yield w


def serve(world: World, ns: netns.Namespace, host: str, port: int = PORT) -> None:
    """The TCP server in ``ns`` at host:port, once it listens."""
    proc = ns.popen([sys.executable, "-c", SERVER, host, str(port)], stdout=subprocess.PIPE)
    world.started.append(proc)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"


def connect(ns: netns.Namespace, host: str, nbytes: int = 0, timeout: float = 3.0) -> tuple[str, float, float]:
    """From ``ns``: (the address the server saw us come from, seconds to connect, seconds to send ``nbytes``)."""
    done = ns.run([sys.executable, "-c", CLIENT, host, str(PORT), str(nbytes), str(timeout)],
                  capture_output=True, timeout=60)
    seen, connect_s, send_s = done.stdout.split()
    return seen, float(connect_s), float(send_s)


def test_a_host_behind_nat_reaches_a_public_host_which_sees_the_routers_address(world: World) -> None:
    serve(world, world.lan.hosts[0], world.lan.addresses[0])
    seen, _, _ = connect(world.behind, world.lan.addresses[0])
    assert seen == world.nat.public_address, "the connection did not arrive masqueraded as the router"
    assert seen != world.nat.addresses[0]


def test_nobody_on_the_lan_can_connect_to_a_host_behind_nat_even_with_a_route_to_it(world: World) -> None:
    behind = world.nat.addresses[0]
    serve(world, world.behind, behind)
    public = world.lan.hosts[1]
    failed = public.run([sys.executable, "-c", CLIENT, behind, str(PORT), "0", "1.0"], check=False, capture_output=True,
                        timeout=30)
    assert failed.returncode != 0 and "unreachable" in failed.stderr, failed.stderr[-500:]
    # A host that knows the way (as a neighbour's machine might): the router drops what nobody inside asked for.
    netns.ip("-n", public.name, "route", "add", world.nat.subnet, "via", world.nat.public_address)
    failed = public.run([sys.executable, "-c", CLIENT, behind, str(PORT), "0", "1.0"], check=False, capture_output=True,
                        timeout=30)
    assert failed.returncode != 0 and "timed out" in failed.stderr, failed.stderr[-500:]


def test_a_netem_delay_shows_in_a_measured_round_trip(world: World) -> None:
    if (why := netns.why_no_netem()) is not None:
        pytest.skip(f"link delay {why}")
    server, client = world.lan.hosts
    serve(world, server, world.lan.addresses[0])
    client.shape_link("eth0", netns.LinkShape(delay="60ms", jitter="5ms"))
    server.shape_link("eth0", netns.LinkShape(delay="40ms"))
    _, rtt, _ = connect(client, world.lan.addresses[0])
    # A TCP connect takes one round trip: our SYN out (60 +- 5 ms), its SYN-ACK back (40 ms).
    assert rtt >= 0.095, rtt


def test_a_tbf_rate_bounds_a_transfer(world: World) -> None:
    server, client = world.lan.hosts
    serve(world, server, world.lan.addresses[0])
    client.shape_link("eth0", netns.LinkShape(rate="8mbit"))
    nbytes = 1_000_000
    _, _, took = connect(client, world.lan.addresses[0], nbytes)
    assert took >= 0.8 * nbytes * 8 / 8e6, took  # 1 s at 8 Mbit/s; a slower machine only makes it slower


def test_packets_dropped_at_random_are_sent_again_by_tcp(world: World) -> None:
    """Loss where the kernel has no netem (experiments/real_delay.py --loss): every byte still arrives."""
    server, client = world.lan.hosts
    serve(world, server, world.lan.addresses[0])
    client.wire_sized("eth0")  # 1,500-byte packets, as on a wire: 200 KB is some 140 of them
    client.drop_at_random(0.05, "-o", "eth0", "-p", "tcp", "!", "--syn")  # not the SYN: the connect's timeout stays

    # Transfers go on until one lost some (at most 40: none lost in some 5,600 packets would be a chance of
    # 0.95^5600); each returns only once the server has read every byte.
    for _ in range(40):
        connect(client, world.lan.addresses[0], 200_000, timeout=30)
        if netns.random_drops(client.run):
            break
    assert netns.random_drops(client.run) > 0


def test_link_shapes_say_what_they_ask_of_tc() -> None:
    shape = netns.LinkShape(delay="50ms", jitter="10ms", loss="1%", rate="100mbit")
    assert shape.netem == ["delay", "50ms", "10ms", "loss", "1%"]
    assert shape.tbf == ["rate", "100mbit", "burst", "32kb", "latency", "400ms"]
    assert netns.LinkShape(loss="1%").netem == ["loss", "1%"] and netns.LinkShape().tbf == []
    with pytest.raises(ValueError, match="a jitter needs a delay"):
        netns.LinkShape(jitter="5ms")


# -- peers behind NAT: gossiptrain.protocol.reachability, client-mode members ---------------------------------


def gossiptrain(world: World, ns: netns.Namespace, log: Path, *args: str) -> None:
    """`gossiptrain ARGS` inside ``ns``, its output to ``log``: forked from the test fork server, which imported
    torch once (tests/zygote.py), and moved into the namespace as `ip netns exec` would."""
    env = {"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", "PYTHONUNBUFFERED": "1"}
    if zygote.enabled():
        log.touch()
        world.started.append(zygote.ForkedProcess("gossiptrain", list(args), log, env, ROOT, netns=ns.name))
        return
    with open(log, "w") as out:
        world.started.append(ns.popen([sys.executable, "-m", "gossiptrain", *args], stdout=out, stderr=subprocess.STDOUT,
                                      cwd=ROOT, env=env))


@pytest.fixture
def two_homes() -> Iterator[World]:
    """Three public hosts (a coordinator and two peers) and two home routers, one host behind each."""
    with nat_world(3, 2, "gt-home") as w:
        yield w


@pytest.mark.timeout(180)
def test_two_peers_behind_their_own_nat_train_with_two_public_ones_over_connections_they_open(
    two_homes: World, tmp_path: Path
) -> None:
    """The issue's swarm: a coordinator and 2 peers on public hosts, 2 peers each behind its own NAT router,
    label-skewed shards. The two behind NAT find out they cannot be dialled and join as client-mode members;
    every member's view holds all 4 (the clients each other's too, verified through public members), nobody is
    declared dead, and the swarm learns. Everything a client receives comes back over connections it opened
    (counted by its transport), and the public peers send to the clients over those routes. One public peer
    relays (``--relay``): the clients average with each other through it rather than the coordinator, until
    it is killed mid-run; once they suspect it they take the coordinator's relay and go on, with each other and
    the other public peer, and only the killed one is declared dead."""
    world = two_homes
    coordinator, *public = world.lan.hosts
    behind = [home.hosts[0] for home in world.homes]
    run = ["--workload", "digits-small", "--shards", "4", "--partition", "classes-per-peer", "--partition-classes", "3",
           "--seconds", "8"]
    gossiptrain(world, coordinator, tmp_path / "coordinator.log", "coordinator", "--bind",
                f"{world.lan.addresses[0]}:{PORT}", *run)
    join = f"{world.lan.addresses[0]}:{PORT}"
    wait_for(lambda: "join with:" in (tmp_path / "coordinator.log").read_text(), 60, "the coordinator to listen",
             state=lambda: (tmp_path / "coordinator.log").read_text()[-2000:])
    names = ["public0", "public1", "home0", "home1"]
    for name, ns in zip(names, [*public, *behind]):
        relay = ["--relay"] if name == "public0" else []
        gossiptrain(world, ns, tmp_path / f"{name}.log", "peer", "--join", join, "--quiet", "-v", "--wait-for", "4",
                    "--metrics", str(tmp_path / f"{name}.jsonl"), *relay)
    relay_proc, *procs = world.started[1:]
    survivors = names[1:]
    state = lambda: "\n".join(f"--- {n}\n{(tmp_path / f'{n}.log').read_text()[-1500:]}" for n in names)  # noqa: E731

    def records(name: str) -> list[dict[str, Any]]:
        path = tmp_path / f"{name}.jsonl"
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []

    def latest(name: str, key: str) -> int:
        return max((r.get(key, 0) for r in records(name) if r.get("event") == "eval"), default=0)

    # The two clients average with each other through public0's relay; then the relay dies (killed mid-run):
    # both take the coordinator's, and nobody waits on the dead one.
    def learned(name: str) -> float:
        return max((r["test_acc"] for r in records(name) if r.get("event") == "eval"), default=0.0)

    wait_for(lambda: latest("home0", "received_relayed") > 0 and latest("home1", "received_relayed") > 0
             and latest("public0", "relayed") > 0 and min(learned(n) for n in names) >= 0.8, 60,
             "the clients to exchange through public0's relay and the swarm to learn", state=state)
    relay_proc.kill()
    killed_at = time.time()
    relayed_at_kill = {n: latest(n, "received_relayed") for n in names[2:]}
    wait_for(lambda: all(p.poll() is not None for p in procs), 150, "the other three peers to finish", state=state)
    assert [p.returncode for p in procs] == [0, 0, 0], state()

    done = {n: next(r for r in records(n) if r.get("event") == "done") for n in survivors}
    for n in names[2:]:
        assert done[n]["address"].endswith("/client"), done[n]["address"]
        # One line, naming it, its address, who dialled it, what follows and what to do.
        lines = [line for line in (tmp_path / f"{n}.log").read_text().splitlines() if "is not reachable" in line]
        assert len(lines) == 1, lines
        assert f"at tcp://{world.homes[names.index(n) - 2].addresses[0]}:" in lines[0], lines[0]
        assert f"tcp://{join} dialled it back" in lines[0] and "it trains as a client-mode member" in lines[0], lines[0]
        assert "set --advertise" in lines[0], lines[0]
        # Probes, exchange requests and replies, gossip: all of it came over connections the client opened.
        assert done[n]["messages_received"] == done[n]["received_over_own"] > 0, done[n]
        # The relays it took, in order: public0's (its entry says it relays), then the coordinator's.
        taken = [line for line in (tmp_path / f"{n}.log").read_text().splitlines() if "'s relay at" in line]
        assert f"relay at tcp://{world.lan.addresses[1]}:" in taken[-2] and f"relay at tcp://{join}" in taken[-1], taken
        # Exchanges with the other client went on once the relay was gone, through the coordinator.
        assert done[n]["received_relayed"] > relayed_at_kill[n], (n, relayed_at_kill[n], done[n]["received_relayed"])
        at_kill = max((r["exchanges"] for r in records(n) if r.get("event") == "eval" and r["time"] <= killed_at), default=0)
        assert done[n]["exchanges"] > at_kill, (n, at_kill, done[n]["exchanges"])
    for n in names[:2]:
        log = (tmp_path / f"{n}.log").read_text()
        assert "is reachable" in log and "is not reachable" not in log, log[-1500:]
    assert not done["public1"]["address"].endswith("/client") and done["public1"]["sent_over_routes"] > 0, done["public1"]
    for n in survivors:
        evals = [r for r in records(n) if r.get("event") == "eval"]
        assert evals and all(r["members"] == 4 for r in evals if r["time"] <= killed_at), (n, [r["members"] for r in evals])
        assert done[n]["members_dead"] == 1 and done[n]["exchanges"] > 0, done[n]  # public0, and nobody else
        assert done[n]["final_all_done"], done[n]  # the clients heard of each other's end through the public peer
    # public0's shard left with it (3 of the 10 classes, some of them its alone): what the swarm keeps of them
    # may fade as the others train on (one run in nine ended at 0.75, before clients left a suspected relay),
    # but nothing collapses.
    mean = sum(done[n]["test_acc"] for n in survivors) / 3
    assert mean >= 0.6, {n: done[n]["test_acc"] for n in survivors}
