"""The sim:// network model: latency, bandwidth, loss, partitions, crashes and accounting.

The transport contract itself is checked by the shared suite in
test_transport.py; these tests check what only a simulated network has. They
run on a plain asyncio loop with latencies of milliseconds; timing is read
from ``loop.time()`` and only lower bounds (what the model guarantees) are
asserted.
"""

from __future__ import annotations

import asyncio
import re
from typing import Callable

import pytest

from gossiptrain.config import Limits
from gossiptrain.errors import ConfigError, TransportClosed
from gossiptrain.net.transport import listen
from gossiptrain.net.transport.sim import LinkProfile, SimNetwork, SimTransport

# loop.call_at may run a timer up to the clock's resolution early.
EPS = 1e-6
FAST = LinkProfile(latency=0.0, bandwidth=float("inf"))


def node(network: SimNetwork, name: str, limits: Limits | None = None) -> SimTransport:
    return SimTransport(f"sim://{name}", limits or Limits(), network=network)


async def until(condition: Callable[[], object], what: str, timeout: float = 5.0) -> None:
    """Poll ``condition`` with a deadline on the loop's clock (never a fixed sleep)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not condition():
        if loop.time() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        await asyncio.sleep(0.001)


async def receive(t: SimTransport) -> list[bytes]:
    return [bytes(f) for f in await asyncio.wait_for(t.recv(), 5.0)]


# -- timing ----------------------------------------------------------------------------------


def test_a_message_arrives_no_earlier_than_the_latency() -> None:
    latency = 0.005

    async def main() -> None:
        network = SimNetwork(LinkProfile(latency=latency, bandwidth=float("inf")))
        async with node(network, "a") as a, node(network, "b") as b:
            loop = asyncio.get_running_loop()
            for i in range(3):
                sent_at = loop.time()
                assert a.send(b.address, [str(i).encode()])
                assert await receive(b) == [str(i).encode()]
                assert loop.time() - sent_at >= latency - EPS

    asyncio.run(main())


def test_back_to_back_messages_queue_behind_each_other_on_a_slow_link() -> None:
    mb = 1_000_000  # at 10 MB/s each takes 0.1 s to send

    async def main() -> None:
        network = SimNetwork(LinkProfile(latency=0.001, bandwidth=10e6))
        async with node(network, "a") as a, node(network, "b") as b:
            loop = asyncio.get_running_loop()
            sent_at = loop.time()
            assert a.send(b.address, [b"1", bytes(mb)])
            assert a.send(b.address, [b"2", bytes(mb)])
            first = await receive(b)
            first_at = loop.time() - sent_at
            second = await receive(b)
            second_at = loop.time() - sent_at
            assert (first[0], second[0]) == (b"1", b"2")
            assert first_at >= 0.1 + 0.001 - EPS
            # Without queueing it would arrive with the first, 0.1 s after sending.
            assert second_at >= 0.2 + 0.001 - EPS

    asyncio.run(main())


def test_a_slow_link_pushes_back_on_the_sender() -> None:
    async def main() -> None:
        network = SimNetwork(LinkProfile(bandwidth=10_000.0))  # 100 bytes: 0.01 s each
        async with node(network, "a", Limits(send_queue_messages=2)) as a, node(network, "b") as b:
            assert a.send(b.address, [bytes(100)])
            assert a.send(b.address, [bytes(100)])
            assert not a.send(b.address, [bytes(100)])
            assert a.stats.send_dropped == 1 and a.stats.messages_sent == 2
            assert network.stats.refused == 1 and network.stats.sent == 2
            await until(lambda: network.in_flight == 0, "both messages arrived")
            assert a.send(b.address, [b"room again"])  # the queue drained

    asyncio.run(main())


def test_jitter_delays_but_never_reorders_a_link() -> None:
    async def main() -> None:
        # Jitter far above the spacing of the sends: without FIFO they would shuffle.
        network = SimNetwork(LinkProfile(latency=0.001, jitter=0.01), seed=3)
        async with node(network, "a", Limits(send_queue_messages=20)) as a, node(network, "b") as b:
            loop = asyncio.get_running_loop()
            sent_at = loop.time()
            for i in range(20):
                assert a.send(b.address, [str(i).encode()])
            order = [int((await receive(b))[0]) for _ in range(20)]
            assert order == list(range(20))
            assert loop.time() - sent_at >= 0.001 - EPS

    asyncio.run(main())


# -- loss ------------------------------------------------------------------------------------


def test_total_loss_drops_everything_and_counts_it() -> None:
    async def main() -> None:
        network = SimNetwork(FAST)
        async with node(network, "a") as a, node(network, "b") as b, node(network, "c") as c:
            network.set_link(a.address, b.address, LinkProfile(loss=1.0), both_ways=False)
            for i in range(10):
                assert a.send(b.address, [str(i).encode()])  # the sender cannot tell
            assert network.stats.lost == 10 and network.in_flight == 0
            assert b.send(a.address, [b"the other way works"])  # one direction only
            assert await receive(a) == [b"the other way works"]
            assert c.send(b.address, [b"marker"])
            assert await receive(b) == [b"marker"]
            assert b.stats.messages_received == 1 and a.stats.messages_sent == 10

    asyncio.run(main())


def _delivered_under_loss(seed: int, n: int = 60) -> list[int]:
    async def main() -> list[int]:
        network = SimNetwork(LinkProfile(latency=0.0, loss=0.3), seed=seed)
        async with node(network, "a", Limits(send_queue_messages=n)) as a, node(network, "b") as b:
            for i in range(n):
                assert a.send(b.address, [str(i).encode()])
            lost = network.stats.lost
            got = [int((await receive(b))[0]) for _ in range(n - lost)]
            await until(lambda: network.in_flight == 0, "nothing left in flight")
            assert network.stats.delivered == len(got) == n - lost
            assert 0 < lost < n
            return got

    return asyncio.run(main())


def test_partial_loss_is_reproducible_from_the_seed() -> None:
    first = _delivered_under_loss(seed=7)
    assert first == sorted(first)  # survivors keep their order
    assert _delivered_under_loss(seed=7) == first
    assert _delivered_under_loss(seed=8) != first


# -- partitions ------------------------------------------------------------------------------


def test_partition_blocks_across_groups_and_heal_restores() -> None:
    async def main() -> None:
        network = SimNetwork(FAST)
        async with node(network, "a") as a, node(network, "b") as b, node(network, "c") as c:
            network.partition([{a.address}, {b.address}])
            assert a.send(b.address, [b"blocked"])
            assert b.send(a.address, [b"blocked"])
            assert network.stats.partitioned == 2
            assert c.send(b.address, [b"c is in no group"])
            assert c.send(a.address, [b"c is in no group"])
            assert await receive(b) == [b"c is in no group"]
            assert await receive(a) == [b"c is in no group"]
            network.heal()
            assert a.send(b.address, [b"healed"])
            assert await receive(b) == [b"healed"]
            assert network.stats.delivered == 3 and network.stats.partitioned == 2

    asyncio.run(main())


def test_overlapping_partition_groups_are_refused() -> None:
    with pytest.raises(ConfigError, match="sim://a"):
        SimNetwork().partition([{"sim://a", "sim://b"}, {"sim://a"}])


# -- crashes and accounting ------------------------------------------------------------------


def test_messages_in_flight_to_a_crashed_peer_are_unreachable_even_if_it_restarts() -> None:
    async def main() -> None:
        network = SimNetwork(LinkProfile(latency=0.02))
        async with node(network, "a") as a:
            b = await node(network, "b").start()
            for i in range(3):
                assert a.send(b.address, [str(i).encode()])
            await b.close()  # crashed with three messages on the wire
            async with node(network, "b") as reborn:  # same address, new process
                await until(lambda: network.in_flight == 0, "the messages to arrive")
                assert network.stats.unreachable == 3 and a.stats.send_dropped == 3
                assert len(reborn.inbox) == 0 and b.stats.messages_received == 0
                assert a.send(reborn.address, [b"hello again"])
                assert await receive(reborn) == [b"hello again"]
            assert not a.send(reborn.address, [b"to nobody"])  # gone at send time: refused
            assert network.stats.refused == 1 and a.stats.send_dropped == 4

    asyncio.run(main())


def test_a_closed_transports_links_are_forgotten_and_what_was_on_them_still_counted() -> None:
    """Simulated churn opens new addresses for ever: the network keeps state only for links of open transports."""

    async def main() -> None:
        network = SimNetwork(LinkProfile(latency=0.5))  # (real time: long enough for b to close first, even loaded)
        async with node(network, "a") as a, node(network, "c") as c:
            for generation in range(5):  # b crashes and comes back under a new address, as a rejoin does
                b = await node(network, f"b{generation}").start()
                assert a.send(b.address, [b"x"]) and b.send(a.address, [b"y"]) and b.send(c.address, [b"z"])
                await b.close()  # with its messages on the wire
                assert network.links_held == 0  # a -> b, b -> a, b -> c: all gone with it
            assert a.send(c.address, [b"still"]) and network.links_held == 1
            await until(lambda: network.in_flight == 0, "the messages to arrive")
            assert network.stats.unreachable == 5 and a.stats.send_dropped == 5  # a's to each b, counted
            assert len(c.inbox) + len(a.inbox) == 11  # the b's 10 to a and c, and a's to c, arrived
            assert network.links_held == 0  # idle links are not kept: the next message starts a fresh one

    asyncio.run(main())


def test_a_full_inbox_and_oversize_messages_are_dropped_on_arrival_and_counted() -> None:
    async def main() -> None:
        network = SimNetwork(FAST)
        small = Limits(inbox_messages=2, max_frame_bytes=100, max_message_bytes=100)
        async with node(network, "a") as a, node(network, "b", small) as b:
            for i in range(5):
                assert a.send(b.address, [str(i).encode()])
            assert a.send(b.address, [bytes(101)])  # fine for a, too big for b
            await until(lambda: network.in_flight == 0, "all six to arrive")
            stats = network.stats
            assert (stats.delivered, stats.inbox_full, stats.oversize) == (2, 3, 1)
            assert stats.sent == stats.settled() == 6 and stats.to_dict()["inbox_full"] == 3
            assert a.stats.send_dropped == 3 and b.stats.oversize_dropped == 1
            assert b.stats.messages_received == 2
            assert [await receive(b), await receive(b)] == [[b"0"], [b"1"]]

    asyncio.run(main())


def test_receivers_never_alias_the_senders_buffers() -> None:
    async def main() -> None:
        network = SimNetwork(LinkProfile(latency=0.001))
        async with node(network, "a") as a, node(network, "b") as b:
            buffer = bytearray(b"original")
            assert a.send(b.address, [memoryview(buffer)])
            buffer[:] = b"modified"
            assert await receive(b) == [b"original"]

    asyncio.run(main())


# -- addresses and setup ---------------------------------------------------------------------


def test_port_zero_gives_unique_addresses_around_taken_ones() -> None:
    async def main() -> None:
        network = SimNetwork()
        async with node(network, "p:40000") as taken:
            nodes = [await node(network, "p:0").start() for _ in range(5)]
            try:
                addresses = [t.address for t in nodes]
                assert len(set(addresses) | {taken.address}) == 6
                assert all(re.fullmatch(r"sim://p:\d+", x) and not x.endswith(":0") for x in addresses)
                assert set(network.transports) == {*addresses, taken.address}
            finally:
                for t in nodes:
                    await t.close()
        assert not network.transports

    asyncio.run(main())


def test_an_address_in_use_is_a_config_error_and_frees_on_close() -> None:
    async def main() -> None:
        network = SimNetwork()
        async with node(network, "x") as first:
            second = node(network, "x")
            with pytest.raises(ConfigError, match="cannot listen on sim://x: address in use"):
                await second.start()
            with pytest.raises(TransportClosed):
                await second.recv()
            assert network.transports["sim://x"] is first
        async with node(network, "x") as again:
            assert network.transports["sim://x"] is again

    asyncio.run(main())


def test_listen_needs_an_active_network_and_tasks_inherit_it() -> None:
    with pytest.raises(ConfigError, match="sim:// needs a simulated network"):
        listen("sim://p0", Limits())
    network = SimNetwork()

    async def main() -> str:
        async def peer() -> str:  # a task started inside the block sees the network
            async with listen("sim://p0:0", Limits()) as t:
                assert isinstance(t, SimTransport) and t.network is network
                return t.address

        return await asyncio.create_task(peer())

    with network.activate():
        address = asyncio.run(main())
    assert address.startswith("sim://p0:")
    with pytest.raises(ConfigError):
        listen("sim://p0", Limits())


def test_a_network_can_serve_a_second_loop_once_the_first_is_done() -> None:
    network = SimNetwork(LinkProfile(latency=0.001))

    async def main() -> None:
        async with node(network, "a") as a, node(network, "b") as b:
            assert a.send(b.address, [b"hi"])
            assert await receive(b) == [b"hi"]

    asyncio.run(main())
    asyncio.run(main())
    assert network.stats.delivered == 2


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("latency", -0.001),
        ("latency", float("inf")),
        ("bandwidth", 0.0),
        ("bandwidth", float("nan")),
        ("loss", 1.5),
        ("loss", -0.1),
        ("jitter", -1.0),
    ],
)
def test_link_profile_validation_names_the_field(field: str, value: float) -> None:
    with pytest.raises(ConfigError, match=rf"link\.{field}"):
        LinkProfile(**{field: value})
