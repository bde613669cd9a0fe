"""Linux network namespaces as stand-in hosts, for tests and experiments that need real addresses and links.

A ``Namespace`` is one "host" with its own loopback (``experiments/wan.py``
shapes that loopback into one slow link). A ``Lan`` is several namespaces
joined by a bridge, each with its own address, so that processes started in
them (``ip netns exec NAME ...``) talk over a network exactly as separate
machines would, with no sshd: `gossiptrain launch --ssh 'ip netns exec {host}'`
runs its real code path across them. The bridge lives in a namespace of its
own, so the machine's own interfaces and firewall rules are never touched.

Needs root and iproute2 (``why_not`` says which is missing). Names carry the
process id and a counter, so parallel test workers never clash; leaving the
``with`` block kills whatever still runs inside and deletes every namespace,
whatever happened in it.
"""

from __future__ import annotations

import ipaddress
import itertools
import os
import shutil
import signal
import subprocess
from typing import Any, Sequence

#: Addresses of a Lan: the benchmarking range (RFC 2544), never routed, so never anyone's real network.
DEFAULT_SUBNET = "198.18.0.0/24"

_names = itertools.count()


def why_not(*tools: str, need: str = "a network namespace") -> str | None:
    """Why this machine cannot make namespaces here (None: it can): not root, or a tool missing."""
    if os.geteuid() != 0:
        return f"needs root for {need}"
    for tool in ("ip", *tools):
        if shutil.which(tool) is None:
            return f"needs {tool} (iproute2)"
    return None


def unique_name(prefix: str) -> str:
    """``prefix-PID-N``: unique on this machine while this process lives."""
    return f"{prefix}-{os.getpid()}-{next(_names)}"


class NetnsError(RuntimeError):
    """An ``ip`` command failed; the message names it and gives ip's own words."""


def ip(*args: str) -> subprocess.CompletedProcess[str]:
    """``ip ARGS``; a failure raises NetnsError."""
    done = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if done.returncode != 0:
        raise NetnsError(f"`ip {' '.join(args)}` failed: {done.stderr.strip() or f'exit status {done.returncode}'}")
    return done


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
    """``count`` namespaces on one bridge, with addresses from ``subnet`` (.1, .2, ...).

    ``hosts`` are the namespaces, ``addresses`` theirs, in the same order.
    Each has ``eth0`` into the bridge; the bridge is in a namespace of its own.
    """

    def __init__(self, count: int, prefix: str = "gt", subnet: str = DEFAULT_SUBNET) -> None:
        net = ipaddress.ip_network(subnet)
        if count < 1 or count > net.num_addresses - 2:
            raise ValueError(f"{subnet} holds at most {net.num_addresses - 2} hosts, asked for {count}")
        base = unique_name(prefix)
        self.bridge = Namespace(f"{base}-br")
        self.hosts = [Namespace(f"{base}-{i}") for i in range(count)]
        self.addresses = [str(a) for a in itertools.islice(net.hosts(), count)]
        self.prefixlen = net.prefixlen

    def __enter__(self) -> Lan:
        try:
            self.bridge.__enter__()
            ip("-n", self.bridge.name, "link", "add", "br0", "type", "bridge")
            ip("-n", self.bridge.name, "link", "set", "br0", "up")
            for i, (host, address) in enumerate(zip(self.hosts, self.addresses)):
                host.__enter__()
                port = f"p{i}"  # interface names are per namespace: nothing here can clash with another Lan's
                ip("-n", host.name, "link", "add", "eth0", "type", "veth", "peer", "name", port, "netns", self.bridge.name)
                ip("-n", self.bridge.name, "link", "set", port, "master", "br0", "up")
                ip("-n", host.name, "addr", "add", f"{address}/{self.prefixlen}", "dev", "eth0")
                ip("-n", host.name, "link", "set", "eth0", "up")
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        for ns in [*self.hosts, self.bridge]:
            ns.delete()

    def pids(self) -> dict[str, list[int]]:
        """Every host namespace's processes, by name (all empty once everything started in them has ended)."""
        return {ns.name: ns.pids() for ns in self.hosts}
