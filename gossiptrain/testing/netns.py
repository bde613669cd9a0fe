"""Linux network namespaces as stand-in hosts, for tests and experiments that need real addresses and links.

A ``Namespace`` is one "host" with its own loopback (``experiments/wan.py``
shapes that loopback into one slow link). A ``Lan`` is several namespaces
joined by a bridge, each with its own address (and an IPv6 one, given
``subnet6``), so that processes started in them (``ip netns exec NAME ...``)
talk over a network exactly as separate machines would, with no sshd:
`gossiptrain launch --ssh 'ip netns exec {host}'` runs its real code path
across them. The bridge lives in a namespace of its own, so the machine's
own interfaces and firewall rules are never touched.

The internet's conditions, on those links: ``Namespace.shape_link`` gives
one interface's outgoing traffic a ``LinkShape`` (``tc netem`` delay,
jitter and loss, a ``tbf`` rate), and a ``NatRouter`` is a home router: a
namespace on the Lan (its public side) with hosts behind it on a private
bridge, whose default route goes through it, masqueraded by ``iptables``
(MASQUERADE) as they go out, and unreachable from the Lan, as behind any NAT.

Needs root and iproute2 (``why_not`` says which is missing; NAT also
``iptables``, delay and loss a kernel with netem: ``why_no_netem``; without
netem, ``Namespace.drop_at_random`` loses packets with ``iptables``).
Addresses come from the benchmarking ranges (198.18.0.0/15, 2001:2::/48),
never anyone's real network, and exist only inside the namespaces. Names
carry the process id and a counter, so parallel test workers never clash;
leaving the ``with`` block kills whatever still runs inside and deletes
every namespace, whatever happened in it.
"""

from __future__ import annotations

import ipaddress
import itertools
import os
import shutil
import signal
import subprocess
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

#: Addresses of a Lan: the benchmarking range (RFC 2544), never routed, so never anyone's real network.
DEFAULT_SUBNET = "198.18.0.0/24"
#: IPv6 addresses of a Lan that asks for them: the IPv6 benchmarking range (RFC 5180).
DEFAULT_SUBNET6 = "2001:2::/64"
#: Private networks behind NAT routers: the rest of the benchmarking range (198.19.N.0/24, N = 1, 2, ...).
PRIVATE_SUBNETS = "198.19.0.0/16"

_names = itertools.count()
_PACKAGES = {"ip": "iproute2", "tc": "iproute2", "iptables": "the iptables package"}  # where a missing tool comes from


def why_not(*tools: str, need: str = "a network namespace") -> str | None:
    """Why this machine cannot make namespaces here (None: it can): not root, or a tool missing."""
    if os.geteuid() != 0:
        return f"needs root for {need}"
    for tool in ("ip", *tools):
        if shutil.which(tool) is None:
            return f"needs {tool} ({_PACKAGES.get(tool, tool)})"
    return None


def unique_name(prefix: str) -> str:
    """``prefix-PID-N``: unique on this machine while this process lives."""
    return f"{prefix}-{os.getpid()}-{next(_names)}"


class NetnsError(RuntimeError):
    """An ``ip`` (or ``tc``, ``iptables``) command failed; the message names it and gives the tool's own words."""


def _checked(cmd: Sequence[str], shown: Sequence[str] | None = None) -> subprocess.CompletedProcess[str]:
    """``cmd``; a failure raises NetnsError naming ``shown`` (default: ``cmd``)."""
    done = subprocess.run(list(cmd), capture_output=True, text=True, timeout=30)
    if done.returncode != 0:
        said = done.stderr.strip() or f"exit status {done.returncode}"
        raise NetnsError(f"`{' '.join(shown if shown is not None else cmd)}` failed: {said}")
    return done


def ip(*args: str) -> subprocess.CompletedProcess[str]:
    """``ip ARGS``; a failure raises NetnsError."""
    return _checked(["ip", *args])


@dataclass(frozen=True)
class LinkShape:
    """What one interface does to its outgoing packets: ``tc netem`` delay, jitter and loss, then a ``tbf`` rate.

    Only the sending side is shaped: give both ends of a link a shape for a
    round trip of twice the delay. Values are ``tc``'s own (``"50ms"``,
    ``"10ms"``, ``"1%"``, ``"100mbit"``); None leaves that part out.
    """

    delay: str | None = None
    jitter: str | None = None  # with a delay only: each packet's delay varies by up to this much
    loss: str | None = None  # e.g. "1%": dropped at random
    rate: str | None = None  # a token bucket: at most this many bits a second leave
    burst: str = "32kb"  # the bucket's size (above the interface's MTU)
    latency: str = "400ms"  # how long a packet may wait in the bucket before it is dropped

    def __post_init__(self) -> None:
        if self.jitter is not None and self.delay is None:
            raise ValueError("a jitter needs a delay (tc netem delay DELAY JITTER)")

    @property
    def netem(self) -> list[str]:
        """netem's arguments, or [] when there is no delay or loss."""
        args = ["delay", self.delay, *([self.jitter] if self.jitter else [])] if self.delay else []
        return args + (["loss", self.loss] if self.loss else [])

    @property
    def tbf(self) -> list[str]:
        """tbf's arguments, or [] when there is no rate."""
        return ["rate", self.rate, "burst", self.burst, "latency", self.latency] if self.rate else []


class Namespace:
    """One network namespace with its loopback up; deleted on exit, with anything still running in it killed."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.created = False

    def __enter__(self) -> Namespace:
        ip("netns", "add", self.name)
        self.created = True
        ip("-n", self.name, "link", "set", "lo", "up")
        return self

    def __exit__(self, *exc: object) -> None:
        self.delete()

    def run(self, cmd: Sequence[str], **kw: Any) -> subprocess.CompletedProcess[str]:
        """``cmd`` inside the namespace (``check=True`` unless told otherwise)."""
        return subprocess.run(["ip", "netns", "exec", self.name, *cmd], text=True, **{"check": True, **kw})

    def popen(self, cmd: Sequence[str], **kw: Any) -> subprocess.Popen[str]:
        """``cmd`` started inside the namespace (it ends with the namespace, if not before)."""
        return subprocess.Popen(["ip", "netns", "exec", self.name, *cmd], text=True, **kw)

    def checked(self, *cmd: str) -> subprocess.CompletedProcess[str]:
        """``cmd`` inside the namespace, its output captured; a failure raises NetnsError naming it."""
        return _checked(["ip", "netns", "exec", self.name, *cmd], cmd)

    def shape_link(self, dev: str, shape: LinkShape) -> None:
        """Give ``dev``'s outgoing traffic ``shape`` (replacing any earlier one): netem at the root, tbf under it.

        A kernel without netem (``why_no_netem``) fails here for a delay or a
        loss, with tc's "Specified qdisc kind is unknown"; a rate alone needs
        only tbf.
        """
        tc = ("tc", "qdisc", "replace", "dev", dev)
        if shape.netem and shape.tbf:
            self.checked(*tc, "root", "handle", "1:", "netem", *shape.netem)
            self.checked(*tc, "parent", "1:1", "handle", "10:", "tbf", *shape.tbf)
        elif shape.netem:
            self.checked(*tc, "root", "netem", *shape.netem)
        elif shape.tbf:
            self.checked(*tc, "root", "tbf", *shape.tbf)
        else:
            self.unshape_link(dev)

    def drop_at_random(self, probability: float, *match: str) -> None:
        """Drop ``probability`` of the packets leaving that match ``match`` (``iptables`` arguments, e.g. ``-d
        127.0.4.0/24``), in this namespace only: loss on a kernel without netem (``random_drop``).

        A packet is what the kernel hands iptables: with segmentation offload
        up to 64 KB of a stream at once (1 MB over loopback: 18 packets).
        ``wire_sized`` makes them what a wire carries (694 packets).
        """
        self.checked("iptables", "-A", *random_drop(probability, *match))

    def wire_sized(self, dev: str, mtu: int = 1500) -> None:
        """Packets on ``dev`` as an Ethernet link carries them: an MTU of ``mtu`` and no segmentation offload, so
        that a packet dropped (``drop_at_random``) is one wire packet, as netem's loss drops one."""
        self.checked("ip", "link", "set", "dev", dev, "mtu", str(mtu), "gso_max_size", str(mtu), "gso_max_segs", "1")

    def unshape_link(self, dev: str) -> None:
        """Back to the interface's default queue (nothing to remove is not an error)."""
        self.run(["tc", "qdisc", "del", "dev", dev, "root"], check=False, capture_output=True, timeout=30)

    def pids(self) -> list[int]:
        """The processes running inside (``ip netns pids``)."""
        if not self.created:
            return []
        out = subprocess.run(["ip", "netns", "pids", self.name], capture_output=True, text=True, timeout=30).stdout
        return [int(p) for p in out.split()]

    def kill_all(self) -> None:
        for pid in self.pids():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def delete(self) -> None:
        """Kill what runs inside (a namespace outlives its name while a process holds it), then delete it."""
        if self.created:
            self.kill_all()
            subprocess.run(["ip", "netns", "delete", self.name], check=False, capture_output=True, timeout=30)
            self.created = False


class Lan:
    """``count`` namespaces on one bridge, with addresses from ``subnet`` (.1, .2, ...) and, given ``subnet6``, IPv6 ones.

    ``hosts`` are the namespaces, ``addresses`` (``addresses6``) theirs, in the
    same order. Each has ``eth0`` into the bridge; the bridge is in a namespace
    of its own. ``attach`` plugs in another namespace (a ``NatRouter``'s public
    side) with the next address.
    """

    def __init__(self, count: int, prefix: str = "gt", subnet: str = DEFAULT_SUBNET, subnet6: str | None = None) -> None:
        net = ipaddress.ip_network(subnet)
        if count < 1 or count > net.num_addresses - 2:
            raise ValueError(f"{subnet} holds at most {net.num_addresses - 2} hosts, asked for {count}")
        base = unique_name(prefix)
        self.bridge = Namespace(f"{base}-br")
        self.hosts = [Namespace(f"{base}-{i}") for i in range(count)]
        self._free = net.hosts()
        self.addresses = [str(a) for a in itertools.islice(self._free, count)]
        self.prefixlen = net.prefixlen
        net6 = ipaddress.ip_network(subnet6) if subnet6 is not None else None
        self._free6: Iterator[ipaddress.IPv4Address | ipaddress.IPv6Address] | None = net6.hosts() if net6 else None
        self.addresses6 = [str(next(self._free6)) for _ in range(count)] if self._free6 is not None else []
        self.prefixlen6 = net6.prefixlen if net6 is not None else 0
        self._ports = itertools.count()

    def __enter__(self) -> Lan:
        try:
            self.bridge.__enter__()
            ip("-n", self.bridge.name, "link", "add", "br0", "type", "bridge")
            ip("-n", self.bridge.name, "link", "set", "br0", "up")
            for i, (host, address) in enumerate(zip(self.hosts, self.addresses)):
                host.__enter__()
                self._plug(host, address, self.addresses6[i] if self.addresses6 else None)
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        for ns in [*self.hosts, self.bridge]:
            ns.delete()

    def attach(self, ns: Namespace) -> str:
        """Plug ``ns`` (entered already, its owner deletes it) into the bridge as ``eth0``, with the next address."""
        try:
            address = str(next(self._free))
        except StopIteration:
            raise ValueError("this Lan's subnet has no address left") from None
        self._plug(ns, address, str(next(self._free6)) if self._free6 is not None else None)
        return address

    def _plug(self, host: Namespace, address: str, address6: str | None) -> None:
        port = f"p{next(self._ports)}"  # interface names are per namespace: nothing here can clash with another Lan's
        ip("-n", host.name, "link", "add", "eth0", "type", "veth", "peer", "name", port, "netns", self.bridge.name)
        ip("-n", self.bridge.name, "link", "set", port, "master", "br0", "up")
        ip("-n", host.name, "addr", "add", f"{address}/{self.prefixlen}", "dev", "eth0")
        if address6 is not None:  # nodad: usable at once, not after a second of duplicate detection
            ip("-n", host.name, "addr", "add", f"{address6}/{self.prefixlen6}", "dev", "eth0", "nodad")
        ip("-n", host.name, "link", "set", "eth0", "up")

    def pids(self) -> dict[str, list[int]]:
        """Every host namespace's processes, by name (all empty once everything started in them has ended)."""
        return {ns.name: ns.pids() for ns in self.hosts}


_private_nets = itertools.count(1)


class NatRouter:
    """A home router on ``lan``: ``count`` hosts behind it on a private bridge, masqueraded as they go out.

    The router is a namespace with ``eth0`` on the Lan (``public_address``)
    and a bridge ``br1`` holding the private network's gateway address; each
    host behind it (``hosts``, ``addresses``) has ``eth0`` on that bridge and
    its default route through the gateway. Going out, their packets take the
    router's public address (``iptables -t nat ... -o eth0 -j MASQUERADE``,
    with IP forwarding on); coming in, only the answers to connections they
    opened are forwarded, and the Lan has no route to the private network at
    all: nobody there can dial a host behind it, as with any NAT.

    ``subnet``: the private network (default: the next 198.19.N.0/24 in this
    process). Two routers may be given the same one, as two homes often
    use the same private range. Needs ``iptables`` (``why_not("iptables")``).
    """

    def __init__(self, lan: Lan, count: int = 1, *, prefix: str = "gt-nat", subnet: str | None = None) -> None:
        if subnet is None:
            subnet = str(list(ipaddress.ip_network(PRIVATE_SUBNETS).subnets(new_prefix=24))[next(_private_nets) % 256])
        net = ipaddress.ip_network(subnet)
        if count < 1 or count > net.num_addresses - 3:
            raise ValueError(f"{subnet} holds at most {net.num_addresses - 3} hosts behind a router, asked for {count}")
        base = unique_name(prefix)
        self.lan = lan
        self.router = Namespace(f"{base}-r")
        self.hosts = [Namespace(f"{base}-{i}") for i in range(count)]
        free = net.hosts()
        self.gateway = str(next(free))
        self.addresses = [str(a) for a in itertools.islice(free, count)]
        self.prefixlen = net.prefixlen
        self.subnet = str(net)
        self.public_address = ""

    def __enter__(self) -> NatRouter:
        try:
            r = self.router
            r.__enter__()
            self.public_address = self.lan.attach(r)
            ip("-n", r.name, "link", "add", "br1", "type", "bridge")
            ip("-n", r.name, "addr", "add", f"{self.gateway}/{self.prefixlen}", "dev", "br1")
            ip("-n", r.name, "link", "set", "br1", "up")
            for i, (host, address) in enumerate(zip(self.hosts, self.addresses)):
                host.__enter__()
                ip("-n", host.name, "link", "add", "eth0", "type", "veth", "peer", "name", f"h{i}", "netns", r.name)
                ip("-n", r.name, "link", "set", f"h{i}", "master", "br1", "up")
                ip("-n", host.name, "addr", "add", f"{address}/{self.prefixlen}", "dev", "eth0")
                ip("-n", host.name, "link", "set", "eth0", "up")
                ip("-n", host.name, "route", "add", "default", "via", self.gateway)
            r.checked("sh", "-c", "echo 1 > /proc/sys/net/ipv4/ip_forward")  # this namespace's own setting
            r.checked("iptables", "-t", "nat", "-A", "POSTROUTING", "-s", self.subnet, "-o", "eth0", "-j", "MASQUERADE")
            # In from the Lan: only what answers a connection made from inside (a Lan host with a route here gets nothing).
            r.checked("iptables", "-A", "FORWARD", "-i", "eth0", "-o", "br1", "-m", "conntrack",
                      "--ctstate", "ESTABLISHED,RELATED", "-j", "ACCEPT")
            r.checked("iptables", "-A", "FORWARD", "-i", "eth0", "-o", "br1", "-j", "DROP")
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        for ns in [*self.hosts, self.router]:
            ns.delete()  # the router's own rules and bridge go with its namespace


def random_drop(probability: float, *match: str) -> list[str]:
    """``iptables`` arguments after ``-A`` (or ``-D``): drop ``probability`` of the outgoing packets that match
    ``match``, at random (the statistic match). TCP sends a dropped packet again, as it would one lost on the way."""
    if not 0.0 <= probability <= 1.0:
        raise ValueError(f"a probability is in [0, 1], got {probability}")
    return ["OUTPUT", *match, "-m", "statistic", "--mode", "random", "--probability", f"{probability:g}", "-j", "DROP"]


def random_drops(run: Callable[..., subprocess.CompletedProcess[str]] = subprocess.run) -> int:
    """Packets the ``random_drop`` rules have dropped so far, from iptables' own counters: in this process's
    network namespace, or with ``run=ns.run`` in ``ns``."""
    out = run(["iptables", "-L", "OUTPUT", "-v", "-x", "-n"], capture_output=True, check=True).stdout
    listed = out if isinstance(out, str) else out.decode()  # Namespace.run reads text already
    return sum(int(line.split()[0]) for line in listed.splitlines() if "statistic" in line)


def why_no_netem() -> str | None:
    """Why ``tc netem`` (delay, jitter, loss) cannot be used here (None: it can), found by trying it once.

    Some kernels are built without it (``CONFIG_NET_SCH_NETEM``); tbf, for a
    rate, is another module and may still be there.
    """
    if (why := why_not("tc", need="tc netem")) is not None:
        return why
    with Namespace(unique_name("gt-netem-probe")) as ns:
        done = ns.run(["tc", "qdisc", "add", "dev", "lo", "root", "netem", "delay", "1ms"],
                      check=False, capture_output=True, timeout=30)
    if done.returncode != 0:
        return f"needs tc netem, which this kernel lacks (CONFIG_NET_SCH_NETEM): {done.stderr.strip()}"
    return None
