"""IPv6: `--bind [::]:PORT`, advertised IPv6 addresses, and dual-stack swarms, on ::1 and across namespaces.

A listener bound to ``[::]`` takes IPv4 too (ZeroMQ's IPV6 option clears
IPV6_V6ONLY: IPv4 peers arrive as ``::ffff:a.b.c.d``), so one coordinator
serves both families; members name each other by whatever address they
advertise, and every member dials both. Skipped, saying why, where the
machine has no IPv6 loopback; the namespace test also needs root.
"""

from __future__ import annotations

import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import pytest
import torch

from gossiptrain.errors import ConfigError
from gossiptrain.net.addressing import is_wildcard, parse_host, tcp_url, with_host_if_wildcard
from gossiptrain.protocol.admission import join_source
from gossiptrain.runtime.peer import Peer
from gossiptrain.testing import netns
from gossiptrain.train.metrics import read_metrics

from .conftest import fast_config
from .swarm import ROOT, Proc, Procs, next_host, wait_for


def why_no_ipv6_loopback() -> str | None:
    """Why ::1 cannot be used here (None: it can)."""
    if not socket.has_ipv6:
        return "this Python has no IPv6 support"
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
    except OSError as e:
        return f"cannot bind ::1 here: {e}"
    return None


needs_ipv6 = pytest.mark.skipif(why_no_ipv6_loopback() is not None, reason=f"IPv6 loopback: {why_no_ipv6_loopback()}")


def test_an_advertised_host_may_be_ipv6_in_brackets_or_not_and_never_a_wildcard_or_a_port() -> None:
    assert parse_host("fd00::5") == parse_host("[fd00::5]") == "fd00::5"
    assert parse_host("::ffff:127.0.0.9") == "::ffff:127.0.0.9" and parse_host("10.0.0.5") == "10.0.0.5"
    assert parse_host("host.example") == "host.example"
    assert tcp_url(parse_host("[::1]"), 7070) == "tcp://[::1]:7070"
    for wildcard in ("::", "[::]", "0.0.0.0"):
        assert is_wildcard(wildcard)
        with pytest.raises(ConfigError, match="is a wildcard, nobody's address"):
            parse_host(wildcard, "--advertise")
    with pytest.raises(ConfigError, match="not HOST:PORT: the port is the bound one"):
        parse_host("10.0.0.5:7070", "--advertise")
    assert with_host_if_wildcard("tcp://[::]:7070", "::1") == "tcp://[::1]:7070"
    assert join_source("::ffff:127.0.0.9", "") == join_source("127.0.0.9", "") == "127.0.0.9"  # one source, either way


def test_the_cli_refuses_a_wildcard_advertise_address_before_joining(capsys: pytest.CaptureFixture[str]) -> None:
    from gossiptrain.cli.main import main

    assert main(["peer", "--join", "127.0.0.1:1", "--advertise", "[::]"]) == 2
    assert "--advertise '[::]' is a wildcard, nobody's address" in capsys.readouterr().err


@needs_ipv6
@pytest.mark.timeout(60)
def test_a_peer_bound_to_every_interface_advertises_the_ipv6_address_it_joined_by(coordinator_factory: Any) -> None:
    coord = coordinator_factory(fast_config(**{"train.workload": "external", "state.enabled": False}), bind="[::]:0")
    assert coord.address.startswith("tcp://[::]:")  # how it knows itself; peers that dial it replace the wildcard
    port = coord.address.rsplit(":", 1)[1]
    with Peer(torch.nn.Linear(4, 2), join=f"[::1]:{port}", bind="[::]:0", transfer_state=False) as p:
        assert p.address.startswith("tcp://[::1]:"), p.address  # a real address, not ::
        assert p._node is not None and p._node.coordinator == f"tcp://[::1]:{port}"
        assert p.reachability is not None and p.reachability.reachable, p.reachability
        assert p.reachability.answerer == f"tcp://[::1]:{port}"  # who dialled it back, by the address we dialled


def members_seen(p: Proc, n: int) -> bool:
    """Whether ``p`` has written an evaluation with ``n`` members in view and at least one exchange."""
    return any(r.get("members") == n and r.get("exchanges", 0) > 0 for r in p.records("eval"))


def train_together(procs: Procs, peers: list[Proc]) -> None:
    """Every peer sees them all and exchanges, then finishes its budget."""
    n = len(peers)
    procs.wait_for(lambda: all(members_seen(p, n) for p in peers) or any(not p.alive() for p in peers), 120,
                   f"every peer to see {n} members and exchange")
    procs.wait_for(lambda: all(p.records("done") for p in peers) or any(not p.alive() for p in peers), 120,
                   "the peers to finish")
    for p in peers:
        assert p.wait(30) == 0, p.output()[-3000:]
        assert members_seen(p, n), (p.name, p.records("eval")[-3:])


@needs_ipv6
@pytest.mark.timeout(240)
def test_a_coordinator_and_three_peers_on_ipv6_loopback_train_and_see_each_other(
    procs: Procs, coordinator_factory: Any
) -> None:
    coord = coordinator_factory(fast_config(**{"train.shards": 3, "train.max_steps": 400}), bind="[::1]:0")
    join = coord.address.removeprefix("tcp://")
    assert join.startswith("[::1]:")
    peers = [procs.peer(join, "--wait-for", "3", host="[::1]") for _ in range(3)]
    train_together(procs, peers)
    for p in peers:
        assert p.records("start")[0]["address"].startswith("tcp://[::1]:")


@needs_ipv6
@pytest.mark.timeout(240)
def test_a_dual_stack_swarm_ipv6_and_ipv4_peers_on_one_coordinator_bound_to_every_interface(
    procs: Procs, coordinator_factory: Any
) -> None:
    coord = coordinator_factory(fast_config(**{"train.shards": 3, "train.max_steps": 400}), bind="[::]:0")
    port = coord.address.rsplit(":", 1)[1]
    v4 = next_host()
    peers = [
        procs.peer(f"[::1]:{port}", "--wait-for", "3", host="[::1]", name="v6"),
        procs.peer(f"[::1]:{port}", "--wait-for", "3", host="[::]", name="v6-any"),  # advertises ::1, the route back
        procs.peer(f"127.0.0.1:{port}", "--wait-for", "3", host=v4, name="v4"),
    ]
    train_together(procs, peers)
    addresses = {p.name: p.records("start")[0]["address"] for p in peers}
    assert addresses["v6"].startswith("tcp://[::1]:") and addresses["v6-any"].startswith("tcp://[::1]:"), addresses
    assert addresses["v4"].startswith(f"tcp://{v4}:"), addresses
    # The IPv4 peer's join came in as ::ffff:127.0.0.1 and was charged to 127.0.0.1, its IPv4 address.
    sources = coord.coordinator.join_limiter.sources()
    assert "127.0.0.1" in sources and not any("ffff" in s for s in sources), sources


# -- across namespaces: IPv6 and IPv4 hosts on one Lan ---------------------------------------------------------------


@dataclass
class Hosts:
    """A Lan with IPv4 and IPv6 addresses, and the gossiptrain processes started in it (killed at teardown)."""

    lan: netns.Lan
    started: list[subprocess.Popen[str]]

    def gossiptrain(self, ns: netns.Namespace, log: Path, *args: str) -> None:
        """`gossiptrain ARGS` inside ``ns``, its output to ``log``."""
        with open(log, "w") as out:
            self.started.append(ns.popen(
                [sys.executable, "-m", "gossiptrain", *args], stdout=out, stderr=subprocess.STDOUT, cwd=ROOT,
                env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", "PYTHONUNBUFFERED": "1"},
            ))


@pytest.fixture
def hosts() -> Iterator[Hosts]:
    if (why := netns.why_not()) is not None:
        pytest.skip(f"a dual-stack Lan {why}")
    lan = netns.Lan(3, prefix="gt-v6", subnet6=netns.DEFAULT_SUBNET6)
    try:
        lan.__enter__()
    except netns.NetnsError as e:
        if "netns add" in str(e):
            pytest.skip(f"network namespaces are unavailable: {e}")
        raise
    world = Hosts(lan, [])
    try:
        yield world
    finally:
        for proc in world.started:
            proc.kill()
            proc.wait(10)
        lan.__exit__()


@pytest.mark.slow  # 7 s: `make test-slow`; the dual-stack swarm on loopback stays in the default run
@pytest.mark.timeout(180)
def test_on_namespace_addresses_an_ipv6_and_an_ipv4_peer_meet_through_a_dual_stack_coordinator(
    hosts: Hosts, tmp_path: Path
) -> None:
    lan = hosts.lan
    head, six, four = lan.hosts
    port = 7070
    hosts.gossiptrain(head, tmp_path / "coordinator.log", "coordinator", "--bind", f"[::]:{port}",
                "--workload", "digits-small", "--shards", "2", "--steps", "400", "--set", "train.eval_every_seconds=0.3")
    log = tmp_path / "coordinator.log"
    wait_for(lambda: "join with:" in log.read_text(), 60, "the coordinator to listen", state=lambda: log.read_text()[-2000:])
    metrics = {name: tmp_path / f"{name}.jsonl" for name in ("six", "four")}
    hosts.gossiptrain(six, tmp_path / "six.log", "peer", "--join", f"[{lan.addresses6[0]}]:{port}", "--quiet",
                "--wait-for", "2", "--metrics", str(metrics["six"]))
    hosts.gossiptrain(four, tmp_path / "four.log", "peer", "--join", f"{lan.addresses[0]}:{port}", "--quiet",
                "--wait-for", "2", "--metrics", str(metrics["four"]))

    def records(name: str) -> list[dict[str, Any]]:
        return read_metrics(metrics[name]) if metrics[name].exists() else []

    def state() -> str:
        return "\n".join(f"--- {n}\n{(tmp_path / f'{n}.log').read_text()[-1500:]}" for n in ("coordinator", "six", "four"))

    wait_for(lambda: all(any(r.get("event") == "done" for r in records(n)) for n in metrics), 150,
             "both peers to finish", state=state)
    starts = {n: next(r for r in records(n) if r.get("event") == "start") for n in metrics}
    assert starts["six"]["address"].startswith(f"tcp://[{lan.addresses6[1]}]:"), starts  # its own IPv6 address
    assert starts["four"]["address"].startswith(f"tcp://{lan.addresses[2]}:"), starts
    for n in metrics:
        assert any(r.get("members") == 2 and r.get("exchanges", 0) > 0 for r in records(n)), (n, records(n)[-2:])
