"""Transport conformance suite: each check written once, run for every backend and event loop.

A backend is added by putting a ``Backend`` builder in ``BACKENDS``; the
checks below then hold it to the same contract as tcp://. Checks that need a
real socket (garbage bytes, IPv6, bind errors) are at the end, tcp only; the
sim:// network model has its own tests in test_sim_network.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import re
import socket
import time
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable, Coroutine

import pytest

import gossiptrain.net.transport as transport
from gossiptrain.config import Limits
from gossiptrain.errors import ConfigError, TransportClosed
from gossiptrain.net.transport import TcpTransport, Transport, listen
from gossiptrain.net.transport.sim import SimNetwork, SimTransport

try:
    import uvloop
except ImportError:  # optional: the default loop is always tested
    uvloop = None

Runner = Callable[[Coroutine[Any, Any, Any]], Any]
MiB = 1 << 20


@dataclass
class Backend:
    name: str
    make: Callable[..., Transport]  # make(limits=None): an unstarted transport at a fresh address
    unreachable: Callable[[], str]  # an address where nothing listens


_hosts = itertools.count(2)


def _loopback() -> str:
    """A fresh 127.0.x.y per transport, so that an addressing bug cannot hide behind one shared host."""
    n = next(_hosts)
    return f"127.0.{n // 250}.{n % 250 + 2}"


def _tcp_backend() -> Backend:
    def make(limits: Limits | None = None) -> Transport:
        # A short connect grace keeps the unreachable-peer check fast.
        return TcpTransport(f"tcp://{_loopback()}:0", limits or Limits(), connect_timeout=0.3)

    def unreachable() -> str:
        host = _loopback()
        with socket.socket() as s:  # a port that was free a moment ago, with nothing listening
            s.bind((host, 0))
            port = s.getsockname()[1]
        return f"tcp://{host}:{port}"

    return Backend("tcp", make, unreachable)


def _sim_backend() -> Backend:
    # A fresh network per test, passed explicitly: nothing is shared between tests.
    network = SimNetwork()
    names = itertools.count()

    def make(limits: Limits | None = None) -> Transport:
        return SimTransport(f"sim://node{next(names)}:0", limits or Limits(), network=network)

    def unreachable() -> str:
        return f"sim://nobody{next(names)}"

    return Backend("sim", make, unreachable)


BACKENDS: dict[str, Callable[[], Backend]] = {"tcp": _tcp_backend, "sim": _sim_backend}
LOOPS: dict[str, Runner] = {"asyncio": asyncio.run}
if uvloop is not None:
    LOOPS["uvloop"] = uvloop.run


@pytest.fixture(params=sorted(BACKENDS))
def backend(request: pytest.FixtureRequest) -> Backend:
    return BACKENDS[request.param]()


@pytest.fixture(params=sorted(LOOPS))
def run(request: pytest.FixtureRequest) -> Runner:
    return LOOPS[request.param]


# -- helpers ---------------------------------------------------------------------------------


@contextlib.asynccontextmanager
async def started(*transports: Transport) -> AsyncIterator[tuple[Transport, ...]]:
    async with contextlib.AsyncExitStack() as stack:
        for t in transports:
            await stack.enter_async_context(t)
        yield transports


async def receive(t: Transport, timeout: float = 5.0) -> list[bytes]:
    return [bytes(f) for f in await asyncio.wait_for(t.recv(), timeout)]


async def until(condition: Callable[[], object], what: str, timeout: float = 5.0) -> None:
    """Poll ``condition`` with a deadline (never a fixed sleep)."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        await asyncio.sleep(0.005)


def pattern(n: int) -> bytes:
    return bytes(range(256)) * (n // 256) + bytes(n % 256)


# -- conformance -----------------------------------------------------------------------------


def test_round_trip_keeps_frames_and_order(backend: Backend, run: Runner) -> None:
    big = bytearray(pattern(4 * MiB))
    messages: list[list[bytes | memoryview]] = [
        [b"first"],
        [b""],
        [b"", b"", b"x"],
        [b"head", memoryview(big), b"tail"],
        [memoryview(b"view")],
        [b"last", b""],
    ]

    async def main() -> None:
        async with started(backend.make(), backend.make()) as (a, b):
            assert a.address != b.address and not b.address.endswith(":0")
            for m in messages:
                assert a.send(b.address, m)
            for m in messages:
                assert await receive(b) == [bytes(f) for f in m]
            total = sum(len(bytes(f)) for m in messages for f in m)
            assert a.stats.messages_sent == b.stats.messages_received == len(messages)
            assert a.stats.bytes_sent == b.stats.bytes_received == total
            assert a.stats.send_dropped == b.stats.oversize_dropped == 0
            # and back the other way
            assert b.send(a.address, [b"reply"])
            assert await receive(a) == [b"reply"]

    run(main())


def test_all_senders_arrive_in_order_per_sender(backend: Backend, run: Runner) -> None:
    n = 20
    queue = Limits(send_queue_messages=n)  # all n are sent before anything is received

    async def main() -> None:
        async with started(backend.make(), *(backend.make(queue) for _ in range(3))) as (rx, *senders):
            for i in range(n):
                for s, sender in enumerate(senders):
                    assert sender.send(rx.address, [str(s).encode(), str(i).encode()])
            seen: dict[bytes, list[int]] = {}
            for _ in range(n * len(senders)):
                who, i = await receive(rx)
                seen.setdefault(who, []).append(int(i))
            assert seen == {str(s).encode(): list(range(n)) for s in range(len(senders))}

    run(main())


def test_frame_over_limit_dropped_and_receiver_keeps_working(backend: Backend, run: Runner) -> None:
    small = Limits(max_frame_bytes=1024, max_message_bytes=4096)

    async def main() -> None:
        async with started(backend.make(), backend.make(small)) as (a, b):
            assert a.send(b.address, [b"h", b"x" * 1025])  # one byte over: dropped by b
            assert a.send(b.address, [b"h", b"y" * 1024])  # exactly at the limit: delivered
            assert a.send(b.address, [b"z" * 1000] * 5)  # frames fine, message over 4096 bytes
            assert a.send(b.address, [b"after"])
            assert await receive(b) == [b"h", b"y" * 1024]
            assert await receive(b) == [b"after"]
            assert b.stats.oversize_dropped == 2
            assert b.stats.messages_received == 2

    run(main())


def test_too_many_frames_dropped_and_counted(backend: Backend, run: Runner) -> None:
    async def main() -> None:
        async with started(backend.make(), backend.make(Limits(max_frames=4))) as (a, b):
            assert a.send(b.address, [b"f"] * 5)
            assert a.send(b.address, [b"g"] * 4)
            assert await receive(b) == [b"g"] * 4
            assert b.stats.oversize_dropped == 1

    run(main())


def test_sender_refuses_a_message_over_its_own_limits(backend: Backend, run: Runner) -> None:
    async def main() -> None:
        async with started(backend.make(Limits(max_frames=2, max_frame_bytes=8, max_message_bytes=12)), backend.make()) as (a, b):
            assert not a.send(b.address, [b"1", b"2", b"3"])
            assert not a.send(b.address, [b"123456789"])
            assert not a.send(b.address, [b"1234567", b"1234567"])
            assert a.stats.oversize_dropped == 3 and a.stats.messages_sent == 0
            assert a.send(b.address, [b"12345678", b"1234"])
            assert await receive(b) == [b"12345678", b"1234"]
            with pytest.raises(ValueError):
                a.send(b.address, [])

    run(main())


def test_send_to_nowhere_never_blocks_and_every_message_is_accounted(backend: Backend, run: Runner) -> None:
    """Contract: a send to a dead address returns False at once, or True and is counted dropped later."""

    async def main() -> None:
        async with started(backend.make(), backend.make()) as (a, b):
            nowhere = backend.unreachable()
            began = time.monotonic()
            results = [a.send(nowhere, [b"lost", str(i).encode()]) for i in range(3)]
            assert a.send(b.address, [b"alive"])  # other destinations are unaffected
            assert time.monotonic() - began < 0.5
            assert await receive(b) == [b"alive"]
            await until(lambda: a.stats.send_dropped == 3, "all three lost messages counted")
            assert a.send(nowhere, [b"again"]) in (True, False)
            await until(lambda: a.stats.send_dropped == 4, "the fourth lost message counted")
            assert not a.send("not an address", [b"x"])  # malformed: dropped, not raised
            assert a.stats.send_dropped == 5
            assert a.send(b.address, [b"still alive"])
            assert await receive(b) == [b"still alive"]
            assert results.count(True) + results.count(False) == 3

    run(main())


def test_close_while_recv_waits_raises_transport_closed(backend: Backend, run: Runner) -> None:
    async def main() -> None:
        t = await backend.make().start()
        other = await backend.make().start()
        try:
            waiter = asyncio.create_task(t.recv())
            await asyncio.sleep(0)  # let it start waiting
            assert not waiter.done()
            await t.close()
            with pytest.raises(TransportClosed):
                await asyncio.wait_for(waiter, 1.0)
            with pytest.raises(TransportClosed):
                await t.recv()
            with pytest.raises(TransportClosed):
                t.send(other.address, [b"x"])
        finally:
            await t.close()
            await other.close()

    run(main())


def test_recv_is_cancel_safe(backend: Backend, run: Runner) -> None:
    """A timed-out recv loses nothing: the next message is whole and in order."""

    async def main() -> None:
        async with started(backend.make(), backend.make()) as (a, b):
            with pytest.raises(TimeoutError):
                await asyncio.wait_for(b.recv(), 0.01)
            assert a.send(b.address, [b"1", b"one"])
            assert a.send(b.address, [b"2", b"two"])
            assert await receive(b) == [b"1", b"one"]
            assert await receive(b) == [b"2", b"two"]

    run(main())


def test_forget_then_send_reconnects(backend: Backend, run: Runner) -> None:
    async def main() -> None:
        async with started(backend.make(), backend.make()) as (a, b):
            assert a.send(b.address, [b"before"])
            assert await receive(b) == [b"before"]
            a.forget(b.address)
            a.forget(b.address)  # idempotent
            a.forget("tcp://127.0.0.1:1")  # never used: a no-op
            assert a.send(b.address, [b"after"])
            assert await receive(b) == [b"after"]

    run(main())


def test_close_is_prompt_with_messages_queued_to_dead_and_slow_peers(backend: Backend, run: Runner) -> None:
    async def main() -> None:
        a = await backend.make().start()
        b = await backend.make(Limits(inbox_messages=1)).start()
        try:
            assert a.send(b.address, [b"hello"])
            assert await receive(b) == [b"hello"]  # connected; b now stops reading
            frame = bytes(MiB)
            for _ in range(200):
                if not a.send(b.address, [frame]):
                    break
            else:
                raise AssertionError("a slow receiver never pushed back")
            assert a.stats.send_dropped >= 1
            a.send(backend.unreachable(), [b"pending"])
            began = time.monotonic()
            await a.close()
            assert time.monotonic() - began < 1.0
        finally:
            await a.close()
            await b.close()

    run(main())


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
        async with started(_tcp_backend().make(), _tcp_backend().make()) as (a, b):
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
