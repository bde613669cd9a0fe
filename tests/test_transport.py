"""Transport conformance suite: each check written once, run for every backend and event loop.

The checks live in ``gossiptrain.testing.transport_checks`` so that other
backends can run them too; here each one is a test per backend and loop. A
backend is added by putting a ``Backend`` builder in ``BACKENDS``. Checks that
need a real socket (garbage bytes, IPv6, bind errors) and the registry's are
below them; the sim:// network model has its own tests in test_sim_network.py.
"""

from __future__ import annotations

import asyncio
import os
import re
import socket
import time
from typing import Any, Callable

import pytest

import gossiptrain.net.transport as transport
from gossiptrain.config import Limits
from gossiptrain.errors import ConfigError, TransportClosed
from gossiptrain.net.transport import Transport, listen
from gossiptrain.net.transport.sim import SimNetwork, SimTransport
from gossiptrain.net.transport.tcp import TcpTransport
from gossiptrain.testing.transport_checks import (
    CHECKS,
    Backend,
    Check,
    Runner,
    receive,
    sim_backend,
    started,
    tcp_backend,
    until,
)
from tests.swarm import Procs

try:
    import uvloop
except ImportError:  # optional: the default loop is always tested
    uvloop = None

BACKENDS: dict[str, Callable[[], Backend]] = {"tcp": tcp_backend, "sim": sim_backend}
LOOPS: dict[str, Runner] = {"asyncio": asyncio.run}
if uvloop is not None:
    LOOPS["uvloop"] = uvloop.run


@pytest.fixture(params=sorted(BACKENDS))
def backend(request: pytest.FixtureRequest) -> Backend:
    """A fresh backend per test (sim: its own network), so that nothing is shared between tests."""
    return BACKENDS[request.param]()


@pytest.fixture(params=sorted(LOOPS))
def run(request: pytest.FixtureRequest) -> Runner:
    return LOOPS[request.param]


# -- conformance: the kit's checks, each one a test per backend and loop -----------------------


@pytest.mark.parametrize("check", CHECKS, ids=lambda c: c.__name__)
def test_conformance(check: Check, backend: Backend, run: Runner) -> None:
    check(backend, run)


# -- the registry ----------------------------------------------------------------------------


def test_listen_picks_backend_by_scheme() -> None:
    assert {"tcp", "sim"} <= set(transport.schemes())
    t = listen("tcp://127.0.0.2:0", Limits())
    assert isinstance(t, TcpTransport) and t.address == "tcp://127.0.0.2:0"
    network = SimNetwork()
    with network.activate():
        s = listen("sim://p1:0", Limits())
    assert isinstance(s, SimTransport) and s.network is network and s.address == "sim://p1:0"


@pytest.mark.parametrize(
    "url",
    [
        "udp://127.0.0.2:0",
        "127.0.0.2:0",
        "tcp://127.0.0.2",
        "tcp://127.0.0.2:port",
        "tcp://127.0.0.2:70000",
        "tcp://:0",
        "tcp://127.0.0.2:0/path",
        "sim://",
        "sim://:0",
        "sim://a/b",
        "sim://a b",
    ],
)
def test_listen_rejects_bad_urls_naming_them(url: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(repr(url))):
        listen(url, Limits())


def test_register_adds_a_scheme_and_value_errors_become_config_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(transport, "_factories", dict(transport._factories))

    def refuse(url: str, limits: Limits) -> Transport:
        raise ValueError("no such node")

    transport.register("fake", refuse)
    assert transport.schemes() == ("fake", "sim", "tcp")
    with pytest.raises(ConfigError, match="fake://x.*no such node"):
        listen("fake://x", Limits())
    with pytest.raises(ValueError):
        transport.register("Bad Scheme", refuse)


# -- tcp only --------------------------------------------------------------------------------


def test_garbage_bytes_count_a_handshake_failure_and_the_port_keeps_working(run: Runner) -> None:
    async def main() -> None:
        async with started(tcp_backend().make(), tcp_backend().make()) as (a, b):
            host, port = b.address.removeprefix("tcp://").rsplit(":", 1)
            with socket.create_connection((host, int(port)), timeout=2.0) as raw:
                raw.sendall(b"\xff" * 64 + b"GET / HTTP/1.1\r\n\r\n")
            await until(lambda: b.stats.handshake_failures >= 1, "a handshake failure counted")
            assert a.send(b.address, [b"valid"])
            assert await receive(b) == [b"valid"]

    run(main())


def _has_ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


@pytest.mark.skipif(not _has_ipv6_loopback(), reason="no IPv6 loopback (::1) here")
def test_ipv6_round_trip(run: Runner) -> None:
    async def main() -> None:
        async with started(TcpTransport("tcp://[::1]:0", Limits()), TcpTransport("tcp://[::1]:0", Limits())) as (a, b):
            assert b.address.startswith("tcp://[::1]:") and not b.address.endswith(":0")
            assert a.send(b.address, [b"v6", bytes(70_000)])
            assert await receive(b) == [b"v6", bytes(70_000)]

    run(main())


def test_ipv4_address_is_reported_plainly(run: Runner) -> None:
    async def main() -> None:
        async with TcpTransport("tcp://127.0.0.2:0", Limits()) as t:
            host, _, port = t.address.removeprefix("tcp://").rpartition(":")
            assert host == "127.0.0.2" and int(port) > 0

    run(main())


def test_bind_failure_is_a_config_error_and_leaks_nothing(run: Runner) -> None:
    async def main() -> None:
        async with TcpTransport("tcp://127.0.0.2:0", Limits()) as a:
            taken = TcpTransport(a.address, Limits())
            with pytest.raises(ConfigError, match="cannot listen on"):
                await taken.start()
            with pytest.raises(TransportClosed):
                await taken.recv()

    run(main())


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="counts file descriptors in /proc/self/fd")
def test_sending_to_thousands_of_made_up_addresses_keeps_connections_and_descriptors_bounded(procs: Procs) -> None:
    """As a member gossiped 5,000 made-up members would: the least recently used connections are closed, while
    the one partner sent to all along keeps its connection and gets every message. Counted in a process of its
    own (tests/descriptor_bound.py), where no other test's threads open descriptors meanwhile."""
    check = procs.start(name="descriptors", module="tests.descriptor_bound")
    assert check.wait(120) == 0, check.output()[-3000:]


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="counts file descriptors in /proc/self/fd")
def test_a_flood_of_incoming_connections_from_one_host_is_cut_at_its_bound_and_others_still_get_through() -> None:
    """600 idle TCP connections from 127.0.0.9, bound 20 per source: the rest are shut down as accepted."""
    limits = Limits(incoming_per_source=20, handshake_seconds=60.0)
    flood = 600

    async def main() -> None:
        async with started(TcpTransport("tcp://127.0.0.2:0", limits), tcp_backend().make()) as (victim, honest):
            before = _open_fds()
            attackers = []
            for _ in range(flood):
                s = socket.socket()
                s.setblocking(False)
                s.bind(("127.0.0.9", 0))
                try:
                    s.connect(("127.0.0.2", victim.port))
                except BlockingIOError:
                    pass
                attackers.append(s)
            try:
                deadline = time.monotonic() + 30
                # The victim's own descriptors (our 600 sockets aside): the 20 kept, and what shut-down ones hold
                # until libzmq closes them (polled), never one per attacking connection.
                while (victim.stats.incoming_refused < flood // 4 or _open_fds() - before - flood > 40) \
                        and time.monotonic() < deadline:
                    await asyncio.sleep(0.01)
                assert _open_fds() - before - flood <= 40, _open_fds() - before - flood
                # Most are refused as their events arrive; an event read after its descriptor was reused for a
                # later connection counts that one instead, so "all but 20" is not exact, and on a loaded machine
                # far from it (usually about 580 here; 296 once with 3 test workers on 2 cores). The descriptor
                # bound above is the guarantee; this says that the bound was enforced by refusing, many times.
                assert victim.stats.incoming_refused >= flood // 4, victim.stats
                assert victim.incoming.count("127.0.0.9") <= 20
                assert honest.send(victim.address, [b"still here"])  # another source is not refused
                assert await receive(victim) == [b"still here"]
            finally:
                for s in attackers:
                    s.close()

    asyncio.run(main())


def test_connections_that_never_handshake_are_closed_after_handshake_seconds() -> None:
    limits = Limits(handshake_seconds=0.3)

    async def main() -> None:
        async with started(TcpTransport("tcp://127.0.0.2:0", limits)) as (victim,):
            idle = [socket.create_connection(("127.0.0.2", victim.port)) for _ in range(5)]
            try:
                deadline = time.monotonic() + 30
                while len(victim.incoming) < 5 and time.monotonic() < deadline:
                    await asyncio.sleep(0.01)
                assert len(victim.incoming) == 5
                while len(victim.incoming) and time.monotonic() < deadline:  # libzmq gives up on each, we count it
                    await asyncio.sleep(0.01)
                assert len(victim.incoming) == 0
                for s in idle:  # the far end closed each: after ZeroMQ's greeting, reading ends (EOF or reset)
                    s.settimeout(10)
                    try:
                        while s.recv(1024):
                            pass
                    except ConnectionResetError:
                        pass
            finally:
                for s in idle:
                    s.close()

    asyncio.run(main())


def test_the_incoming_guard_bounds_sources_and_heals_a_missed_disconnect() -> None:
    from gossiptrain.net.transport.incoming import HEAL_EVERY, IncomingGuard

    gone: set[int] = set()
    guard = IncomingGuard(per_source=3, total=5, still_from=lambda fd, source: fd not in gone)
    assert [guard.accepted(fd, "a") for fd in (1, 2, 3, 4)] == [True, True, True, False]
    assert guard.accepted(3, "a")  # a number seen again replaces the connection counted under it
    assert guard.count("a") == 3
    gone.add(1)  # its disconnect event was missed: a later refusal (every HEAL_EVERY) checks and finds it gone
    tries = 1
    while not guard.accepted(100 + tries, "a"):
        tries += 1
    assert tries <= HEAL_EVERY + 1 and guard.count("a") == 3
    assert [guard.accepted(fd, "b") for fd in (6, 7, 8)] == [True, True, False]  # 5 in all
    guard.disconnected(6)
    assert guard.accepted(8, "b") and len(guard) == 5


def test_a_small_descriptor_limit_still_leaves_a_swarms_worth_of_incoming_connections_and_says_so(caplog: Any) -> None:
    import resource

    from gossiptrain.net.transport.incoming import MIN_INCOMING, descriptor_budget

    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    assert descriptor_budget(64, 16) == 64  # room to spare: the configured bound
    with caplog.at_level("WARNING", logger="gossiptrain.net.transport.incoming"):
        assert descriptor_budget(10**9, soft) == MIN_INCOMING  # 3 x soft outgoing: nothing left, the floor
    assert "raise it (ulimit -n)" in caplog.text
