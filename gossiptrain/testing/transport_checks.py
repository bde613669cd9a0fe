"""A conformance suite for ``Transport`` backends: the contract tcp:// and sim:// are held to.

Someone writing a new backend describes it as a ``Backend`` (how to make an
unstarted transport at a fresh address, and an address where nothing
listens) and runs every check in ``CHECKS`` against it, e.g.::

    @pytest.mark.parametrize("check", CHECKS, ids=lambda c: c.__name__)
    def test_my_backend(check):
        check(my_backend(), asyncio.run)

or all at once with ``check_transport(my_backend)``. Each check is a plain
function ``check(backend, run)`` that starts its own transports, drives them
with ``run`` (``asyncio.run``, ``uvloop.run``, ...) and closes them again; a
broken contract raises ``AssertionError``. No pytest here: the library may be
installed without it.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import socket
import time
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable, Coroutine, Iterator

from gossiptrain.config import Limits
from gossiptrain.errors import TransportClosed
from gossiptrain.net.addressing import client_address
from gossiptrain.net.transport import Transport
from gossiptrain.net.transport.sim import SimNetwork, SimTransport
from gossiptrain.net.transport.tcp import TcpTransport

#: A bound on ``close`` (a hang, not a speed: it takes milliseconds), so that a check fails instead of hanging.
CLOSE_BOUND = 10.0

__all__ = [
    "CHECKS",
    "Backend",
    "Check",
    "Runner",
    "check_transport",
    "loopback",
    "receive",
    "sim_backend",
    "started",
    "tcp_backend",
    "until",
]

Runner = Callable[[Coroutine[Any, Any, Any]], Any]
"""Runs one coroutine to completion on a fresh event loop (``asyncio.run``, ``uvloop.run``)."""

MiB = 1 << 20


@dataclass
class Backend:
    """What the checks need to know about a backend, and nothing else."""

    name: str
    make: Callable[..., Transport]  # make(limits=None): an unstarted transport at a fresh address
    unreachable: Callable[[], str]  # an address where nothing listens


_hosts = itertools.count(2)


def loopback() -> str:
    """A fresh 127.0.x.y per call, so that an addressing bug cannot hide behind one shared host (Linux routes all of 127/8)."""
    n = next(_hosts)
    return f"127.0.{n // 250}.{n % 250 + 2}"


def tcp_backend() -> Backend:
    """tcp:// transports, each on its own loopback address with port 0 (the OS picks a free port)."""

    def make(limits: Limits | None = None) -> Transport:
        # A short connect grace keeps the unreachable-peer check fast.
        return TcpTransport(f"tcp://{loopback()}:0", limits or Limits(), connect_timeout=0.3)

    def unreachable() -> str:
        host = loopback()
        with socket.socket() as s:  # a port that was free a moment ago, with nothing listening
            s.bind((host, 0))
            port = s.getsockname()[1]
        return f"tcp://{host}:{port}"

    return Backend("tcp", make, unreachable)


def sim_backend() -> Backend:
    """sim:// transports on a fresh ``SimNetwork`` of their own, passed explicitly: nothing is shared between backends."""
    network = SimNetwork()
    names = itertools.count()

    def make(limits: Limits | None = None) -> Transport:
        return SimTransport(f"sim://node{next(names)}:0", limits or Limits(), network=network)

    def unreachable() -> str:
        return f"sim://nobody{next(names)}"

    return Backend("sim", make, unreachable)


# -- helpers ---------------------------------------------------------------------------------


@contextlib.asynccontextmanager
async def started(*transports: Transport) -> AsyncIterator[tuple[Transport, ...]]:
    """Start all of ``transports``; close all of them on the way out, even after a failure."""
    async with contextlib.AsyncExitStack() as stack:
        for t in transports:
            await stack.enter_async_context(t)
        yield transports


async def receive(t: Transport, timeout: float = 5.0) -> list[bytes]:
    """The next message's frames as bytes; a deadline, so that a lost message fails instead of hanging."""
    return [bytes(f) for f in await asyncio.wait_for(t.recv(), timeout)]


async def until(condition: Callable[[], object], what: str, timeout: float = 5.0) -> None:
    """Poll ``condition`` with a deadline (never a fixed sleep)."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        await asyncio.sleep(0.005)


@contextlib.contextmanager
def _raises(kind: type[BaseException]) -> Iterator[None]:
    """``pytest.raises`` without pytest: the block must raise ``kind``; anything else propagates."""
    try:
        yield
    except kind:
        return
    raise AssertionError(f"did not raise {kind.__name__}")


def _pattern(n: int) -> bytes:
    return bytes(range(256)) * (n // 256) + bytes(n % 256)


# -- checks ----------------------------------------------------------------------------------


def round_trip_keeps_frames_and_order(backend: Backend, run: Runner = asyncio.run) -> None:
    """Frames (empty ones, memoryviews, a 4 MiB one) arrive whole and in order, and are counted both ways."""
    big = bytearray(_pattern(4 * MiB))
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


def all_senders_arrive_in_order_per_sender(backend: Backend, run: Runner = asyncio.run) -> None:
    """Many senders to one receiver: nothing lost, each sender's messages in its order."""
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


def frame_over_limit_dropped_and_receiver_keeps_working(backend: Backend, run: Runner = asyncio.run) -> None:
    """The receiver enforces its own frame and message limits, exactly at the boundary, and carries on."""
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


def too_many_frames_dropped_and_counted(backend: Backend, run: Runner = asyncio.run) -> None:
    """A message with more frames than the receiver allows is dropped and counted, not delivered."""

    async def main() -> None:
        async with started(backend.make(), backend.make(Limits(max_frames=4))) as (a, b):
            assert a.send(b.address, [b"f"] * 5)
            assert a.send(b.address, [b"g"] * 4)
            assert await receive(b) == [b"g"] * 4
            assert b.stats.oversize_dropped == 1

    run(main())


def sender_refuses_a_message_over_its_own_limits(backend: Backend, run: Runner = asyncio.run) -> None:
    """``send`` returns False (counted) for a message over the sender's limits; an empty message is a ValueError."""

    async def main() -> None:
        async with started(backend.make(Limits(max_frames=2, max_frame_bytes=8, max_message_bytes=12)), backend.make()) as (a, b):
            assert not a.send(b.address, [b"1", b"2", b"3"])
            assert not a.send(b.address, [b"123456789"])
            assert not a.send(b.address, [b"1234567", b"1234567"])
            assert a.stats.oversize_dropped == 3 and a.stats.messages_sent == 0
            assert a.send(b.address, [b"12345678", b"1234"])
            assert await receive(b) == [b"12345678", b"1234"]
            with _raises(ValueError):
                a.send(b.address, [])

    run(main())


def send_to_nowhere_never_blocks_and_every_message_is_accounted(backend: Backend, run: Runner = asyncio.run) -> None:
    """Contract: a send to a dead address returns False at once, or True and is counted dropped later."""

    async def main() -> None:
        async with started(backend.make(), backend.make()) as (a, b):
            nowhere = backend.unreachable()
            refused_at_once = [not a.send(nowhere, [b"lost", str(i).encode()]) for i in range(3)]
            assert a.send(b.address, [b"alive"])  # other destinations are unaffected
            assert await receive(b) == [b"alive"]
            # Each lost message is counted once: refused at once (False), or accepted and dropped later.
            assert a.stats.send_dropped >= sum(refused_at_once)
            await until(lambda: a.stats.send_dropped == 3, "all three lost messages counted")
            a.send(nowhere, [b"again"])
            await until(lambda: a.stats.send_dropped == 4, "the fourth lost message counted")
            assert not a.send("not an address", [b"x"])  # malformed: dropped, not raised
            assert a.stats.send_dropped == 5
            assert a.send(b.address, [b"still alive"])
            assert await receive(b) == [b"still alive"]
            assert a.stats.send_dropped == 5  # and nothing else was counted lost

    run(main())


def close_while_recv_waits_raises_transport_closed(backend: Backend, run: Runner = asyncio.run) -> None:
    """Closing wakes a waiting ``recv`` with TransportClosed; later recv and send raise it too."""

    async def main() -> None:
        t = await backend.make().start()
        other = await backend.make().start()
        try:
            waiter = asyncio.create_task(t.recv())
            await asyncio.sleep(0)  # let it start waiting
            assert not waiter.done()
            await t.close()
            with _raises(TransportClosed):
                await asyncio.wait_for(waiter, 1.0)
            with _raises(TransportClosed):
                await t.recv()
            with _raises(TransportClosed):
                t.send(other.address, [b"x"])
        finally:
            await t.close()
            await other.close()

    run(main())


def recv_is_cancel_safe(backend: Backend, run: Runner = asyncio.run) -> None:
    """A timed-out recv loses nothing: the next message is whole and in order."""

    async def main() -> None:
        async with started(backend.make(), backend.make()) as (a, b):
            with _raises(TimeoutError):
                await asyncio.wait_for(b.recv(), 0.01)
            assert a.send(b.address, [b"1", b"one"])
            assert a.send(b.address, [b"2", b"two"])
            assert await receive(b) == [b"1", b"one"]
            assert await receive(b) == [b"2", b"two"]

    run(main())


def forget_then_send_reconnects(backend: Backend, run: Runner = asyncio.run) -> None:
    """``forget`` is idempotent, a no-op for unknown addresses, and the next send reaches the peer again."""

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


def close_is_prompt_with_messages_queued_to_dead_and_slow_peers(backend: Backend, run: Runner = asyncio.run) -> None:
    """A slow receiver pushes back (sends fail, counted), and close does not wait for queued messages."""

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
            # Prompt: close returns although a receiver is stuck and a message is pending (a hang fails here).
            await asyncio.wait_for(a.close(), CLOSE_BOUND)
            try:  # and nothing more goes out
                sent = a.send(b.address, [b"after close"])
            except TransportClosed:
                sent = False
            assert not sent
        finally:
            await a.close()
            await b.close()

    run(main())


def reply_goes_back_over_the_connection_a_message_came_on(backend: Backend, run: Runner = asyncio.run) -> None:
    """``reply`` answers the sender of a received message; one whose sender is gone is dropped and counted.

    Over tcp:// the answer travels the sender's own connection (``send(replies=True)``):
    the replier opens none, so it reaches a sender nobody can dial.
    """

    async def main() -> None:
        async with started(backend.make(), backend.make()) as (a, b):
            assert a.send(b.address, [b"join?"], replies=True)
            received = await asyncio.wait_for(b.recv(), 5.0)
            assert [bytes(f) for f in received] == [b"join?"]
            assert b.reply(received, [b"welcome", b""])
            assert await receive(a) == [b"welcome", b""]
            assert b.reply(received, [b"twice"])  # the connection stays for as long as its sender keeps it
            assert await receive(a) == [b"twice"]
            if isinstance(b, TcpTransport):
                assert b.open_connections == 0, "the reply opened a connection of its own"
            assert a.stats.messages_received == 2 and b.stats.messages_sent == 2
            dropped = b.stats.send_dropped
            await a.close()  # the sender gone: its connection with it
            await until(lambda: not b.reply(received, [b"late"]), "a reply to a closed sender to fail")
            assert b.stats.send_dropped > dropped

    run(main())


def a_client_is_reached_only_over_connections_it_opened(backend: Backend, run: Runner = asyncio.run) -> None:
    """A client-mode transport (a peer behind NAT) hears from those it sent to, over its own connections, only.

    Nobody can dial it: a member it never sent to cannot reach it
    (``can_reach`` is False, ``send`` refuses); one it sent to can, as long
    as it lives, and each such message is counted at both ends.
    """

    async def main() -> None:
        async with started(backend.make(), backend.make(), backend.make()) as (client, a, b):
            me = client_address(client.address)
            client.become_client(me)
            assert client.address == me or backend.name == "tcp"  # tcp keeps its bound address; others see ``me``
            assert not a.can_reach(me) and not a.send(me, [b"unasked"]), "a client was reached before it sent"
            assert client.can_reach(a.address)
            assert client.send(a.address, [b"hello", b"1"])
            assert await receive(a) == [b"hello", b"1"], "the route frame was not stripped"
            assert a.can_reach(me) and not b.can_reach(me)
            assert a.send(me, [b"probe"]) and a.send(me, [b"exchange", b"x" * 70_000])
            assert await receive(client) == [b"probe"]
            assert await receive(client) == [b"exchange", b"x" * 70_000]
            assert not b.send(me, [b"stranger"])
            assert a.stats.sent_over_routes == 2 and client.stats.received_over_own == 2
            await client.close()
            await until(lambda: not a.send(me, [b"late"]), "a send to a closed client to fail")

    run(main())


def two_clients_talk_through_a_relay_within_its_budget(backend: Backend, run: Runner = asyncio.run) -> None:
    """Two client-mode transports (each behind its own NAT) reach each other only through a relay both sent to:
    the relay passes the message on, the receiver reads it as sent (the relay's frames gone) and answers the
    same way; a relay that does not serve, or is past its byte budget, drops and counts."""

    async def main() -> None:
        async with started(backend.make(), backend.make(), backend.make()) as (relay, a, b):
            a_at, b_at = client_address(a.address), client_address(b.address)
            a.become_client(a_at)
            b.become_client(b_at)
            a.use_relay(relay.address)
            b.use_relay(relay.address)
            assert a.can_relay(b_at) and not a.can_reach(b_at)
            for client in (a, b):  # each opens its connection to the relay (a report to the coordinator, say)
                assert client.send(relay.address, [b"report"])
                assert await receive(relay) == [b"report"]
            assert a.send(b_at, [b"not served", b""])  # accepted by the relay, which does not relay yet
            await until(lambda: relay.stats.relay_dropped == 1, "the relay to drop what it does not serve")
            relay.serve_as_relay(asyncio.get_running_loop().time())
            assert a.send(b_at, [b"xreq", b"x" * 50_000])
            assert await receive(b) == [b"xreq", b"x" * 50_000]
            assert b.send(a_at, [b"xrep"])
            assert await receive(a) == [b"xrep"]
            assert relay.stats.relayed == 2 and a.stats.received_relayed == 1 and b.stats.received_relayed == 1
            assert relay.relaying is not None
            relay.relaying.tokens = -1e12  # its budget spent, for longer than this check runs
            assert a.send(b_at, [b"over budget"])
            await until(lambda: relay.stats.relay_dropped == 2, "the relay to drop what is over its budget")
            assert relay.stats.relayed == 2

    run(main())


Check = Callable[[Backend, Runner], None]

CHECKS: tuple[Check, ...] = (
    round_trip_keeps_frames_and_order,
    all_senders_arrive_in_order_per_sender,
    frame_over_limit_dropped_and_receiver_keeps_working,
    too_many_frames_dropped_and_counted,
    sender_refuses_a_message_over_its_own_limits,
    send_to_nowhere_never_blocks_and_every_message_is_accounted,
    close_while_recv_waits_raises_transport_closed,
    recv_is_cancel_safe,
    forget_then_send_reconnects,
    close_is_prompt_with_messages_queued_to_dead_and_slow_peers,
    reply_goes_back_over_the_connection_a_message_came_on,
    a_client_is_reached_only_over_connections_it_opened,
    two_clients_talk_through_a_relay_within_its_budget,
)
"""Every check, in a stable order (parametrise over it with ``ids=lambda c: c.__name__``)."""


def check_transport(backend: Backend | Callable[[], Backend], run: Runner = asyncio.run) -> None:
    """Run every check in ``CHECKS``, stopping at the first failure, which gets a note naming the check.

    Pass a factory (``sim_backend``) for a fresh backend per check, as the
    project's own tests do, or one ``Backend`` to share it between checks.
    """
    for check in CHECKS:
        b = backend if isinstance(backend, Backend) else backend()
        try:
            check(b, run)
        except Exception as e:  # a timeout or an unexpected error fails a check as surely as an assert
            e.add_note(f"transport check {check.__name__} failed for backend {b.name!r}")
            raise
