"""``gossip.compression = "auto"``: the level follows the measured link, and nothing is lost when it changes.

The codec reads each message's level off the wire; the policy moves to int8
when an exchange takes longer than flow control's bound and back when the
link allows, and takes a level back that made exchanges no shorter; pairwise and push-sum conserve the swarm's sum through every
change; in the simulator the swarm switches as the link's bandwidth changes.
"""

from __future__ import annotations

import heapq
import random
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gossiptrain.config import GossipConfig, RunConfig
from gossiptrain.errors import ProtocolError
from gossiptrain.net.kinds import XACK, XPUSH
from gossiptrain.net.transport.sim import LinkProfile
from gossiptrain.protocol.algorithms import make_averaging
from gossiptrain.protocol.auto_compression import BLOCK_EXCHANGES, SETTLE_EXCHANGES, START_LEVEL, AutoCompression
from gossiptrain.protocol.averaging_events import AtSafePoint, Received, SendExchange, wire_bytes
from gossiptrain.protocol.compression import AUTO_LEVELS, AutoCodec
from gossiptrain.sim.cluster import Cluster, SimConfig
from gossiptrain.sim.vtime import run_virtual
from gossiptrain.testing.averaging_nemesis import mass_of

# -- the codec ---------------------------------------------------------------------------------


@settings(max_examples=40, deadline=None)
@given(level=st.integers(0, len(AUTO_LEVELS) - 1), seed=st.integers(0, 2**31), n=st.integers(0, 50))
def test_a_receiver_decodes_every_level_as_that_levels_codec_would(level: int, seed: int, n: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    values = {"w": torch.randn(n, 3, generator=gen), "b": torch.randn(3, generator=gen) * 100}
    sender, receiver = AutoCodec(), AutoCodec()  # the receiver is at another level
    sender.level, receiver.level = level, (level + 1) % len(AUTO_LEVELS)
    wire = sender.encode(values)
    got = receiver.decode(wire, like=values)
    expected = sender.codecs[level].decode(wire, like=values)
    assert all(torch.equal(got[k], expected[k]) for k in values)
    assert sender.name == AUTO_LEVELS[level]


def test_a_message_that_is_no_level_is_refused() -> None:
    like = {"w": torch.zeros(4)}
    with pytest.raises(ProtocolError):
        AutoCodec().decode({"w": torch.zeros(4, dtype=torch.float64)}, like)  # wrong dtype for "none"
    with pytest.raises(ProtocolError):
        AutoCodec().decode({"w": torch.zeros(4, dtype=torch.int8), "w#scale": torch.zeros(2)}, like)  # scale not 0-d
    with pytest.raises(ProtocolError):
        AutoCodec().decode({"w": torch.zeros(4, dtype=torch.float16), "v": torch.zeros(4, dtype=torch.float16)}, like)


# -- the policy --------------------------------------------------------------------------------

MODEL = [torch.zeros(19_210)]  # digits-small: 76,840 bytes in float32
STEP = 0.002


def policy_after_steps(level: int = 0) -> AutoCompression:
    auto = AutoCompression(AutoCodec(), MODEL)
    auto.codec.level = level  # the scenarios below begin at none (a policy starts at START_LEVEL)
    for step in range(10):
        auto.at_step(step, step * STEP, 0.0)
    return auto


def test_a_slow_link_moves_to_the_first_level_that_fits_and_a_fast_one_back_one_level_at_a_time() -> None:
    auto = policy_after_steps()
    assert auto.level_bytes == [76_840, 38_420, 19_210]
    assert auto.step_time == pytest.approx(STEP)
    bound = 8  # 16 ms of steps
    auto.exchanged(0.001, 19_210, bound)  # a first exchange (sent small): 1 ms is what fewer bytes never shorten
    for _ in range(8):
        auto.exchanged(0.025, 76_840, bound)  # 25 ms at none (smoothed in): fp16 would take 13 ms, which fits
    assert auto.codec.level == 1
    for _ in range(2):
        auto.exchanged(0.74, 38_420, bound)  # the link slowed down (1.7 Mbit/s): nothing fits; int8 is the last
    assert auto.codec.level == 2
    levels = []
    for _ in range(10 * SETTLE_EXCHANGES):  # a fast link again: 1 ms per exchange
        auto.exchanged(0.001, 19_210, bound)
        levels.append(auto.codec.level)
    assert levels[0] == 2 and levels[-1] == 0  # back to none...
    assert all(b - a in (0, -1) for a, b in zip(levels, levels[1:]))  # ...a level at a time
    assert auto.switches == 4


def test_fewer_bytes_that_do_not_shorten_exchanges_are_taken_back_and_tried_again_ever_later() -> None:
    """Exchanges slow for another reason (peers waiting for a shared CPU): int8 is tried, found no faster, undone."""
    auto = policy_after_steps()
    bound = 4  # 8 ms of steps; every exchange takes 12 ms whatever its size
    levels = [auto.codec.level]
    for _ in range(3 * BLOCK_EXCHANGES + 20):
        auto.exchanged(0.012, auto.level_bytes[auto.codec.level], bound)
        levels.append(auto.codec.level)
    tried = [i for i, (a, b) in enumerate(zip(levels, levels[1:])) if b > a]
    assert levels[1] == 2 and levels[1 + SETTLE_EXCHANGES] == 0  # tried at once, judged, taken back
    assert tried[1] - tried[0] >= BLOCK_EXCHANGES  # not tried again for a while...
    assert tried[2] - tried[1] >= 2 * BLOCK_EXCHANGES  # ...and twice as long after the next failure
    assert levels[-1] == 0


def test_fewer_bytes_that_do_shorten_exchanges_are_kept() -> None:
    auto = policy_after_steps()
    bound = 4
    levels = []
    for _ in range(4 * SETTLE_EXCHANGES):  # 1 ms of latency plus the model both ways at 100 Mbit/s: 13 ms at none
        levels.append(auto.codec.level)
        auto.exchanged(0.001 + 16 * auto.level_bytes[auto.codec.level] / 1e8, auto.level_bytes[auto.codec.level], bound)
    assert levels[1:] == [2] * 8 + [1] * 7
    assert auto.codec.level == 1  # int8 kept after its trial, then fp16, which fits this link too: never none again


def test_it_starts_at_fp16_and_a_fast_link_takes_it_to_none_with_no_trial_to_fail() -> None:
    auto = policy_after_steps(START_LEVEL)
    assert AUTO_LEVELS[auto.codec.level] == "fp16"
    levels = []
    for _ in range(2 * SETTLE_EXCHANGES):  # 1 ms per exchange against 16 ms of steps
        auto.exchanged(0.001, auto.level_bytes[auto.codec.level], 8)
        levels.append(auto.codec.level)
    assert levels == [1] * (SETTLE_EXCHANGES - 1) + [0] * (SETTLE_EXCHANGES + 1)
    assert auto._trial is None and auto._blocked == 0


def test_from_fp16_a_slow_link_tries_int8_and_keeps_it() -> None:
    auto = policy_after_steps(START_LEVEL)
    for _ in range(3 * SETTLE_EXCHANGES):  # 1 ms of latency plus the model both ways at 10 Mbit/s: fp16 does not fit
        auto.exchanged(0.001 + 16 * auto.level_bytes[auto.codec.level] / 1e7, auto.level_bytes[auto.codec.level], 8)
    assert AUTO_LEVELS[auto.codec.level] == "int8" and auto._blocked == 0


def test_steps_spent_waiting_for_the_link_do_not_count_as_step_time() -> None:
    auto = AutoCompression(AutoCodec(), MODEL)
    auto.at_step(1, 0.0, 0.0)
    auto.at_step(2, 1.002, 1.0)  # a step of 2 ms, then flow control waited 1 s
    assert auto.step_time == pytest.approx(STEP)


def test_without_time_between_steps_nothing_changes() -> None:
    """A machine driven by hand (lockstep tests, the same ``now`` every step) stays where it started."""
    auto = AutoCompression(AutoCodec(), MODEL)
    for step in range(5):
        auto.at_step(step, 0.0, 0.0)
        auto.exchanged(1.0, 76_840, 8)
    assert auto.codec.level == START_LEVEL


# -- nothing lost through changes ------------------------------------------------------------


def run_pair(algorithm: str, slow_until: float, end: float) -> tuple[list[Any], list[int], torch.Tensor]:
    """Two machines on float64 models, no local steps; each message takes bytes/bandwidth to arrive.

    The link is slow (1.7 Mbit/s) until ``slow_until``, then fast (1 Gbit/s). Pushes
    are acknowledged as a node does. Returns the machines, the levels seen, the initial mass.
    """
    # Here a receipt is read at a safe point, so a push's round trip counts 2 steps even on the fast link:
    # push-sum, whose budget is 2 x exchange_every_steps steps (PushSum.compression_bound), pushes every 2.
    every = 2 if algorithm == "push-sum" else 1
    gossip = GossipConfig(algorithm=algorithm, compression="auto", topology="complete", exchange_every_steps=every)
    params = [{"x": torch.linspace(-5, 5, 4096, dtype=torch.float64) * (i + 1)} for i in range(2)]
    ids = ["a", "b"]
    machines = [make_averaging(params[i], gossip, random.Random(i), me=ids[i]) for i in range(2)]
    for m in machines:
        m.receipts.enabled = True
    start = sum((mass_of(m) for m in machines), torch.zeros(1))
    wire: list[tuple[float, int, int, SendExchange]] = []  # (arrival, seq, destination, message)
    seq = 0
    now, levels = 0.0, []

    def send(src: int, action: SendExchange) -> None:
        nonlocal seq
        bandwidth = 2.1e5 if now < slow_until else 1.25e8
        arrival = now + 0.0005 + wire_bytes(action.tensors) / bandwidth
        seq += 1
        on_wire = SendExchange(ids[src], action.kind, action.xid, {k: t.clone() for k, t in action.tensors.items()},
                               dict(action.meta))
        heapq.heappush(wire, (arrival, seq, ids.index(action.to), on_wire))

    def handle(i: int, event: Any) -> None:
        for a in machines[i].handle(event, now):
            if isinstance(a, SendExchange):
                send(i, a)

    step = 0
    while now < end or wire:
        while wire and wire[0][0] <= now:
            _, _, dst, msg = heapq.heappop(wire)
            handle(dst, Received(msg.to, msg.kind, msg.xid, msg.tensors, step, msg.meta))  # .to holds the sender
            if msg.kind == XPUSH:
                send(dst, SendExchange(msg.to, XACK, msg.xid, {}))
        step += 1
        for i in range(2):
            handle(i, AtSafePoint(step, [ids[1 - i]] if now < end else []))
        levels.append(max(m.codec.level for m in machines))
        now += 0.002
    return machines, levels, start


@pytest.mark.parametrize("algorithm", ["pairwise", "push-sum"])
def test_the_sum_is_conserved_exactly_while_the_level_changes(algorithm: str) -> None:
    machines, levels, start = run_pair(algorithm, slow_until=6.0, end=12.0)
    assert max(levels[: len(levels) // 2]) == 2  # int8 on the slow link
    assert [m.codec.level for m in machines] == [0, 0]  # none again on the fast one
    total = sum((mass_of(m) for m in machines), torch.zeros(1))
    assert torch.allclose(total, start, rtol=0, atol=1e-9 * float(start.abs().max()))
    assert max(m.stats.compression_switches for m in machines) >= 2  # (with two pairwise peers one asks, one serves)


@pytest.mark.parametrize(("asker", "server", "reply"), [(2, 0, 2), (0, 2, 2), (1, 0, 1), (0, 0, 0)])
def test_a_reply_is_at_least_as_lossy_as_the_request_and_the_sum_is_kept(asker: int, server: int, reply: int) -> None:
    gossip = GossipConfig(algorithm="pairwise", compression="auto", topology="complete")
    params = [{"x": torch.linspace(-3, 3, 1000, dtype=torch.float64) * (i + 2)} for i in range(2)]
    a, b = (make_averaging(params[i], gossip, random.Random(i), me=name) for i, name in enumerate("ab"))
    a.codec.level, b.codec.level = asker, server
    start = mass_of(a) + mass_of(b)
    for m in (a, b):
        m.handle(AtSafePoint(1, []), 0.0)  # ready: nothing merged yet, the model is the one to serve
    (request,) = [x for x in a.handle(AtSafePoint(2, ["b"]), 0.0) if isinstance(x, SendExchange)]
    assert AutoCodec.level_of(request.tensors) == asker
    (answer,) = [x for x in b.handle(Received("a", request.kind, request.xid, request.tensors, 2, request.meta), 0.0)
                 if isinstance(x, SendExchange)]
    assert AutoCodec.level_of(answer.tensors) == reply
    assert b.codec.level == server  # its own level is unchanged: only this reply followed the request
    a.handle(Received("b", answer.kind, answer.xid, answer.tensors, 2, answer.meta), 0.0)
    for m in (a, b):
        m.handle(AtSafePoint(3, []), 0.0)  # the merges reach the models
    assert a.stats.completed == 1 and b.stats.served == 1
    assert torch.allclose(mass_of(a) + mass_of(b), start, rtol=0, atol=1e-9 * float(start.abs().max()))


# -- in the simulator ------------------------------------------------------------------------


def test_a_simulated_swarm_compresses_while_the_link_is_slow_and_stops_when_it_is_fast() -> None:
    run = RunConfig().with_overrides({"train.workload": "digits-small", "train.shards": 3, "train.max_steps": 0,
                                      "train.max_seconds": 0, "train.eval_every_seconds": 100})
    fast, slow = LinkProfile(latency=0.0005, bandwidth=1.25e9), LinkProfile(latency=0.0005, bandwidth=2.1e5)
    samples: list[list[int]] = []  # every peer's level, every 0.25 virtual s once all have joined
    cluster: Cluster  # (bound below; the callback runs inside its run)

    def on_sample(now: float, rows: list[dict[str, Any]]) -> None:
        samples.append([int(r["compression_level"]) for r in rows if "compression_level" in r])
        if len(samples) == 1:
            cluster.network.default = slow  # from the first sample on: 1.7 Mbit/s for 1.5 s
        if len(samples) == 7:
            cluster.network.default = fast

    cluster = Cluster(SimConfig(peers=3, run=run, duration=3.5, seed=0, step_time=STEP, link=fast, sample_every=0.25),
                      on_sample=on_sample)
    run_virtual(cluster.run())
    assert len(samples) >= 10
    assert samples[0] == [0, 0, 0]  # fast: full precision
    assert samples[6] == [2, 2, 2]  # after 1.5 s at 1.7 Mbit/s: int8
    assert samples[9] == [0, 0, 0]  # after 0.75 s fast again: full precision again
