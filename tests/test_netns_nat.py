"""The WAN harness on real network stacks: a NAT router, shaped links, and a peer behind NAT told it is unreachable.

The world of these tests (``gossiptrain.testing.netns``): two public hosts
on a Lan (198.18.0.1, .2) and a home router on it (198.18.0.3) with one host
behind it (198.19.N.2), masqueraded by ``iptables``. The first tests check
the harness itself, as properties of the setup (a connection out works and
arrives from the router's address; nothing gets in; a netem delay shows in a
round trip; a tbf rate bounds a transfer), the last that a `gossiptrain
peer` behind the router is told, when it joins a public coordinator, that
nobody can dial it, and a public one that it is reachable.

Needs root, iproute2 and iptables; delay needs a kernel with netem. Each
missing piece skips the tests that need it, saying which. Names carry the
test process's pid, and the namespaces are deleted (whatever still runs in
them killed) at teardown, pass or fail.
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import pytest

from gossiptrain.testing import netns

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
    started: list[subprocess.Popen[str]]  # killed, and their pipes closed, at teardown

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


@pytest.fixture
def world() -> Iterator[World]:
    if (why := netns.why_not("iptables", need="network namespaces and a NAT router")) is not None:
        pytest.skip(f"the NAT harness {why}")
    with contextlib.ExitStack() as stack:
        lan = netns.Lan(2, prefix="gt-wan")
        entered(stack, lan)
        nat = netns.NatRouter(lan)
        entered(stack, nat)
        world = World(lan, nat, [])
        stack.callback(world.close)  # first, while the namespaces still exist
        yield world


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


def test_link_shapes_say_what_they_ask_of_tc() -> None:
    shape = netns.LinkShape(delay="50ms", jitter="10ms", loss="1%", rate="100mbit")
    assert shape.netem == ["delay", "50ms", "10ms", "loss", "1%"]
    assert shape.tbf == ["rate", "100mbit", "burst", "32kb", "latency", "400ms"]
    assert netns.LinkShape(loss="1%").netem == ["loss", "1%"] and netns.LinkShape().tbf == []
    with pytest.raises(ValueError, match="a jitter needs a delay"):
        netns.LinkShape(jitter="5ms")


# -- reachability, measured: gossiptrain.protocol.reachability ----------------------------------------------


def gossiptrain(world: World, ns: netns.Namespace, log: Path, *args: str) -> None:
    """`gossiptrain ARGS` inside ``ns``, its output to ``log``."""
    with open(log, "w") as out:
        world.started.append(ns.popen(
            [sys.executable, "-m", "gossiptrain", *args], stdout=out, stderr=subprocess.STDOUT, cwd=ROOT,
            env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", "PYTHONUNBUFFERED": "1"},
        ))


@pytest.mark.timeout(120)
def test_a_peer_behind_nat_is_told_nobody_can_dial_it_and_a_public_peer_that_it_is_reachable(
    world: World, tmp_path: Path
) -> None:
    head, public = world.lan.hosts
    gossiptrain(world, head, tmp_path / "coordinator.log", "coordinator", "--bind", f"{world.lan.addresses[0]}:{PORT}",
                              "--workload", "digits-small", "--shards", "2", "--seconds", "60")
    join = f"{world.lan.addresses[0]}:{PORT}"
    wait_for(lambda: "join with:" in (tmp_path / "coordinator.log").read_text(), 60, "the coordinator to listen",
             state=lambda: (tmp_path / "coordinator.log").read_text()[-2000:])
    gossiptrain(world, public, tmp_path / "public.log", "peer", "--join", join, "--quiet", "-v")
    gossiptrain(world, world.behind, tmp_path / "behind.log", "peer", "--join", join, "--quiet", "-v")
    logs = {name: tmp_path / f"{name}.log" for name in ("public", "behind")}

    def said(name: str, text: str) -> bool:
        return text in logs[name].read_text()

    state = lambda: "\n".join(f"--- {n}\n{p.read_text()[-2000:]}" for n, p in logs.items())  # noqa: E731
    behind = f"tcp://{world.nat.addresses[0]}:"
    wait_for(lambda: said("behind", "is not reachable from the member that answered its join"), 60,
             "the peer behind NAT to be told it is not reachable", state=state)
    wait_for(lambda: said("public", "is reachable"), 60, "the public peer to be told it is reachable", state=state)
    lines = [line for line in logs["behind"].read_text().splitlines() if "is not reachable" in line]
    assert len(lines) == 1, lines  # one line, naming it, its address, who dialled it, and what to do
    assert behind in lines[0] and f"tcp://{join} dialled it back" in lines[0] and "set --advertise" in lines[0], lines[0]
    assert f"at tcp://{world.lan.addresses[1]}:" in logs["public"].read_text()
    assert not said("public", "is not reachable")
