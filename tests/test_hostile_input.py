"""Hostile input, from the decoder out to a real training Peer over tcp://.

The decoder half crafts and generates headers an attacker would send (deep
nesting, lengths declared far past the end of a tiny blob, non-string keys,
msgpack extension types, trailing bytes) and requires a ProtocolError, never
another exception, with the decoder's peak Python allocations under
``PEAK_BOUND`` (tracemalloc). The network half sends a sample of them, and
hostile tensors, to a real Peer on loopback: it counts them, answers the
exchange requests with a refusal, keeps its weights bit-identical, and keeps
stepping. test_wire.py holds the codec's schema and limit checks; this file
holds what an attacker gets out of them.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
import tracemalloc
from dataclasses import replace
from typing import Any, Callable, Iterator

import msgpack
import pytest
import torch
import zmq
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from gossiptrain.config import Limits
from gossiptrain.errors import ProtocolError
from gossiptrain.net.transport.tcp import TcpTransport
from gossiptrain.net.wire import KINDS, MAX_BODY_DEPTH, Message, decode, encode
from gossiptrain.runtime.peer import Peer

from .conftest import fast_config
from .swarm import next_host, wait_for

LIMITS = Limits()  # the defaults people run with: the bounds below hold there
#: Python allocations one decode of a hostile header (at most a few KiB here) may peak at.
PEAK_BOUND = 1 << 20
MARK = "\x00hostile\x00"  # a body value whose packed bytes are swapped for hostile msgpack


# ---------------------------------------------------------------- helpers


def decode_peak(frames: list[Any], limits: Limits = LIMITS) -> tuple[Message | ProtocolError, int]:
    """decode's result (or its ProtocolError) and the peak bytes it allocated; any other exception escapes."""
    started = not tracemalloc.is_tracing()
    if started:
        tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        base = tracemalloc.get_traced_memory()[0]
        try:
            result: Message | ProtocolError = decode(frames, limits)
        except ProtocolError as e:
            result = e
        return result, tracemalloc.get_traced_memory()[1] - base
    finally:
        if started:
            tracemalloc.stop()


def assert_rejected_cheaply(frames: list[Any]) -> ProtocolError:
    result, peak = decode_peak(frames)
    assert isinstance(result, ProtocolError), f"accepted a hostile message: {result}"
    assert peak < PEAK_BOUND, f"decoding {sum(len(f) for f in frames)} hostile bytes peaked at {peak} bytes: {result}"
    return result


def base_message(**kw: Any) -> Message:
    fields: dict[str, Any] = dict(
        kind="gossip", sender="p00000000ab", addr="tcp://127.0.0.9:4000", fingerprint="0123456789abcdef", step=7,
        body={"members": [["p1", "tcp://127.0.0.3:1", 0, 1, 2, "alive"]]},
    )
    fields.update(kw)
    return Message(**fields)


def splice(base: Message, hostile: bytes) -> list[bytes]:
    """``base`` encoded, with one body value's packed bytes replaced by raw ``hostile`` msgpack."""
    frames = [bytes(f) for f in encode(replace(base, body={**base.body, "x": MARK}), LIMITS)]
    packed = msgpack.packb(MARK)
    assert frames[0].count(packed) == 1
    return [frames[0].replace(packed, hostile), *frames[1:]]


def repacked(base: Message, edit: Callable[[dict[Any, Any]], None]) -> list[bytes]:
    """``base`` encoded, its header unpacked, edited as a plain object and packed again (any msgpack)."""
    frames = [bytes(f) for f in encode(base, LIMITS)]
    header = msgpack.unpackb(frames[0], raw=False)
    edit(header)
    return [msgpack.packb(header, use_bin_type=True), *frames[1:]]


_CONTAINERS = {"array16": (b"\xdc", 2, 0xFFFF), "array32": (b"\xdd", 4, 0xFFFFFFFF),
               "map16": (b"\xde", 2, 0xFFFF), "map32": (b"\xdf", 4, 0xFFFFFFFF)}


def nesting_bomb(container: str, depth: int, declared: int) -> bytes:
    """``depth`` nested containers each declaring ``declared`` items, and nothing in them."""
    tag, width, _ = _CONTAINERS[container]
    return (tag + declared.to_bytes(width, "big")) * depth


def huge_str(declared: int) -> bytes:
    return b"\xdb" + declared.to_bytes(4, "big") + b"only a few bytes follow"


# The hostile transformations, as plain functions of their parameters: hypothesis draws the
# parameters for the decoder tests, a seeded Random draws them for the sample sent over tcp.

def hostile(base: Message, how: str, r: Callable[[int, int], int]) -> list[bytes]:
    if how == "nesting":
        container = sorted(_CONTAINERS)[r(0, 3)]
        return splice(base, nesting_bomb(container, depth=r(1, 2000), declared=r(16_384, _CONTAINERS[container][2])))
    if how == "huge-length":
        return splice(base, huge_str(r(1 << 16, (1 << 32) - 1)))
    if how == "non-string-key":
        key = [7, -1, 2.5, None, True, (1, 2)][r(0, 5)]
        where = r(0, 1)
        return repacked(base, lambda h: (h["body"] if where else h).__setitem__(key, 1))
    if how == "extension":
        code = r(-128, 127)
        data = bytes(r(0, 255) for _ in range(r(0, 20)))
        # ext 8 by hand: msgpack.ExtType refuses the reserved negative codes (-1 is its Timestamp).
        return splice(base, b"\xc7" + bytes([len(data)]) + code.to_bytes(1, "big", signed=True) + data)
    if how == "trailing":
        frames = [bytes(f) for f in encode(base, LIMITS)]
        return [frames[0] + bytes(r(0, 255) for _ in range(r(1, 32))), *frames[1:]]
    if how == "short-tensor":
        declared = r(8, LIMITS.max_frame_bytes // 4) * 4
        frames = repacked(base, lambda h: h.__setitem__("tensors", [["w", "float32", [declared // 4], declared]]))
        return [frames[0], b"\x00" * 4]
    raise AssertionError(how)


HOW = ["nesting", "huge-length", "non-string-key", "extension", "trailing", "short-tensor"]

# ---------------------------------------------------------------- the decoder


CRAFTED: dict[str, list[bytes]] = {
    "array32 nesting, 65536 declared per level": [nesting_bomb("array32", 1000, 1 << 16)],
    "map32 nesting, 65536 declared per level": [nesting_bomb("map32", 1000, 1 << 16)],
    "array16 nesting inside a valid body": splice(base_message(), nesting_bomb("array16", 1500, 0xFFFF)),
    "fixarray nesting 100k deep": [b"\x91" * 100_000 + b"\xc0"],
    "str declaring 4 GiB": [huge_str((1 << 32) - 1)],
    "array declaring 4G items": [b"\xdd\xff\xff\xff\xff"],
    "bin declaring 4 GiB": [b"\xc6\xff\xff\xff\xff" + b"x"],
    "ext declaring 4 GiB": [b"\xc9\xff\xff\xff\xff\x01"],
    "ext type 42 in the body": splice(base_message(), msgpack.packb(msgpack.ExtType(42, b"payload"))),
    "empty ext in the body": splice(base_message(), msgpack.packb(msgpack.ExtType(5, b""))),
    "timestamp ext in the body": splice(base_message(), msgpack.packb(msgpack.Timestamp(1, 2))),
    "int key at the top": repacked(base_message(), lambda h: h.__setitem__(3, "x")),
    "float key in the body": repacked(base_message(), lambda h: h["body"].__setitem__(1.5, "x")),
    "array key in the body": repacked(base_message(), lambda h: h["body"].__setitem__((1, 2), "x")),
    "trailing byte": [bytes(encode(base_message(), LIMITS)[0]) + b"\x00"],
    "two headers in one frame": [bytes(encode(base_message(), LIMITS)[0]) * 2],
    "body nested past MAX_BODY_DEPTH": [
        bytes(encode(base_message(), LIMITS)[0]).replace(
            msgpack.packb(base_message().body), msgpack.packb({"a": [[[[[[[[[1]]]]]]]]]})
        )
    ],
    "64 MiB tensor declared over a 4-byte frame": hostile(base_message(), "short-tensor", lambda a, b: b),
    "header over max_header_bytes": [b"\x80" + b"\x00" * LIMITS.max_header_bytes],
}


def test_crafted_body_depth_case_is_really_too_deep() -> None:
    depth = 0
    value: Any = {"a": [[[[[[[[[1]]]]]]]]]}
    while isinstance(value, (list, dict)):
        value = next(iter(value.values())) if isinstance(value, dict) else value[0]
        depth += 1
    assert depth > MAX_BODY_DEPTH


@pytest.mark.parametrize("frames", CRAFTED.values(), ids=CRAFTED.keys())
def test_crafted_hostile_headers_are_refused_cheaply(frames: list[bytes]) -> None:
    assert_rejected_cheaply(frames)


def test_nesting_bomb_would_cost_megabytes_without_the_bound() -> None:
    """The case above is a real attack: msgpack preallocates each container it opens.

    Built directly with msgpack, a 5 KB blob of nested arrays each declaring
    65,536 items peaks at tens of MB; decode must not (it checks the bytes are
    complete, allocation-free, before building anything).
    """
    blob = nesting_bomb("array32", 1000, 1 << 16)
    tracemalloc.start()
    try:
        with contextlib.suppress(Exception):
            msgpack.unpackb(blob, max_array_len=LIMITS.max_container_len, max_map_len=LIMITS.max_container_len)
        raw_peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert raw_peak > 10 * PEAK_BOUND  # the amplification the decoder must defend against
    assert_rejected_cheaply([blob])


base_messages = st.builds(
    base_message,
    kind=st.sampled_from(sorted(KINDS)),
    sender=st.text(max_size=12),
    step=st.integers(0, (1 << 64) - 1),
    body=st.dictionaries(st.text(max_size=6), st.integers(-(1 << 63), (1 << 64) - 1) | st.text(max_size=8) | st.none(), max_size=4),
    tensors=st.dictionaries(st.text(max_size=6), st.just(torch.arange(6, dtype=torch.float32)), max_size=2),
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(base_messages, st.sampled_from(HOW), st.data())
def test_generated_hostile_messages_are_refused_cheaply(base: Message, how: str, data: st.DataObject) -> None:
    assume(MARK not in base.sender and "x" not in base.body)
    frames = hostile(base, how, lambda lo, hi: data.draw(st.integers(lo, hi)))
    assert_rejected_cheaply(frames)


@st.composite
def mutations(draw: st.DrawFn) -> list[bytes]:
    frames = [bytes(f) for f in encode(draw(base_messages), LIMITS)]
    header = bytearray(frames[0])
    for _ in range(draw(st.integers(1, 4))):
        i = draw(st.integers(0, len(header) - 1))
        op = draw(st.sampled_from(["flip", "insert", "delete", "container"]))
        if op == "flip":
            header[i] ^= draw(st.integers(1, 255))
        elif op == "insert":
            header.insert(i, draw(st.integers(0, 255)))
        elif op == "delete" and len(header) > 1:
            del header[i]
        elif op == "container":  # a big container header dropped in anywhere
            header[i:i] = draw(st.sampled_from([b"\xdd\x00\x01\x00\x00", b"\xdc\xff\xff", b"\xdf\x00\x00\xff\xff"]))
    return [bytes(header), *frames[1:]]


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(mutations())
def test_mutated_messages_decode_or_raise_protocol_error_within_the_bound(frames: list[bytes]) -> None:
    result, peak = decode_peak(frames)
    assert peak < PEAK_BOUND, f"peak {peak} bytes: {result}"
    if isinstance(result, ProtocolError):  # refused: with a bounded message, not an echo of the hostile bytes
        assert len(str(result)) <= 2 * LIMITS.max_str_len, f"a {len(str(result))}-character error"
        return
    # Accepted: a message within the limits, which the sender side encodes and decodes to the same message again.
    assert result.kind in KINDS, result
    again = encode(result, LIMITS)
    assert len(again) <= LIMITS.max_frames and len(again[0]) <= LIMITS.max_header_bytes
    back = decode(again, LIMITS)
    fields = ("kind", "sender", "addr", "fingerprint", "step")  # == on tensors is elementwise: compare them apart
    assert [getattr(back, f) for f in fields] == [getattr(result, f) for f in fields]
    assert msgpack.packb(dict(back.body)) == msgpack.packb(dict(result.body))  # as bytes: a NaN equals itself
    assert list(back.tensors) == list(result.tensors)
    assert all(torch.equal(back.tensors[k], result.tensors[k]) for k in result.tensors)


# ---------------------------------------------------------------- the transport


def test_tensor_frame_exactly_at_max_frame_bytes_passes_one_byte_over_is_dropped() -> None:
    small = Limits(max_frame_bytes=4096, max_message_bytes=1 << 16)

    async def main() -> None:
        sender = TcpTransport(f"tcp://{next_host()}:0", Limits())  # a sender that does not share our limits
        receiver = TcpTransport(f"tcp://{next_host()}:0", small)
        async with sender, receiver:
            at = torch.arange(4096, dtype=torch.int64).to(torch.uint8)  # exactly max_frame_bytes
            over = torch.zeros(4097, dtype=torch.uint8)
            for tensor in (over, at):  # the one over first: its drop is counted before `at` arrives
                assert sender.send(receiver.address, encode(base_message(kind="xreq", tensors={"w": tensor}), Limits()))
            got = decode(await asyncio.wait_for(receiver.recv(), 10), small)
            assert torch.equal(got.tensors["w"], at)
            assert receiver.stats.oversize_dropped == 1 and receiver.stats.messages_received == 1

    asyncio.run(main())
    # The codec agrees with the transport on the same boundary.
    frames = encode(base_message(tensors={"w": torch.zeros(4097, dtype=torch.uint8)}), Limits())
    with pytest.raises(ProtocolError, match="max_frame_bytes"):
        decode(frames, small)


# ---------------------------------------------------------------- a real peer


class Raw:
    """A bare ZeroMQ client: a DEALER to the target, and a ROUTER where the target's answers come back."""

    def __init__(self, target: str) -> None:
        self.ctx = zmq.Context()
        self.inbox = self.ctx.socket(zmq.ROUTER)
        self.inbox.linger = 0
        host = next_host()
        self.addr = f"tcp://{host}:{self.inbox.bind_to_random_port(f'tcp://{host}')}"
        self.out = self.ctx.socket(zmq.DEALER)
        self.out.linger = 1000
        self.out.sndtimeo = 10_000
        self.out.connect(target)

    def send(self, frames: list[Any]) -> None:
        self.out.send_multipart(frames)

    def answers(self, count: int, timeout: float) -> list[Message]:
        """The next ``count`` messages the target sends back (fewer if ``timeout`` passes first)."""
        out: list[Message] = []
        deadline = time.monotonic() + timeout
        while len(out) < count and self.inbox.poll(max(0.0, deadline - time.monotonic()) * 1000):
            out.append(decode(self.inbox.recv_multipart()[1:], LIMITS))
        return out

    def close(self) -> None:
        self.out.close()
        self.inbox.close()
        self.ctx.term()


@pytest.fixture
def target(coordinator_factory: Any) -> Iterator[Peer]:
    """A real Peer alone in its swarm (so it starts no exchange of its own), on its own 127.0.0.x."""
    # No drift correction: the tests read the merge itself, exactly (it would replay it over the next safe points).
    coord = coordinator_factory(fast_config(**{"train.workload": "external", "gossip.drift_gain": 0.0,
                                                "gossip.compression": "none"}))
    torch.manual_seed(0)
    peer = Peer(torch.nn.Linear(8, 4), coord.address.removeprefix("tcp://"), bind=f"{next_host()}:0")
    try:
        yield peer
    finally:
        peer.close()


def stepping_until(peer: Peer, condition: Callable[[], bool], what: str, timeout: float = 20) -> None:
    """Run the peer's safe point (where it takes exchange requests) until ``condition``."""

    def check() -> bool:
        peer.step()
        return condition()

    wait_for(check, timeout, what, interval=0.01, state=lambda: str(peer.stats()))


def train(peer: Peer, steps: int) -> None:
    opt = torch.optim.SGD(peer.model.parameters(), lr=0.1)
    for _ in range(steps):
        x = torch.randn(16, 8)
        loss = peer.model(x).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        peer.step()


def test_a_real_peer_counts_hostile_bytes_and_keeps_training(target: Peer) -> None:
    rng = random.Random(1234)
    sample = list(CRAFTED.values())
    base = base_message(fingerprint=target.fingerprint, sender="pbad0000001")
    sample += [hostile(base, how, rng.randint) for how in HOW for _ in range(3)]
    raw = Raw(target.address)
    try:
        for frames in sample:
            raw.send(frames)
        stepping_until(target, lambda: target.stats()["bad_messages"] >= len(sample), f"{len(sample)} bad messages counted")
    finally:
        raw.close()
    before = {k: v.clone() for k, v in target.model.state_dict().items()}
    steps = target.steps
    train(target, 50)
    assert target.steps == steps + 50
    assert any(not torch.equal(before[k], v) for k, v in target.model.state_dict().items())  # it really trains
    stats = target.stats()
    assert stats["bad_messages"] == len(sample)
    assert stats["messages_received"] >= len(sample)


def test_hostile_tensors_are_refused_and_leave_the_weights_bit_identical(target: Peer) -> None:
    params = dict(target.model.named_parameters())
    good = {n: torch.zeros_like(p) for n, p in params.items()}
    nan = {n: t.clone() for n, t in good.items()}
    nan["weight"][1, 2] = float("nan")
    inf = {n: t.clone() for n, t in good.items()}
    inf["bias"][0] = float("-inf")
    hostile_requests = {
        "wrong dtype": {n: t.double() for n, t in good.items()},
        "wrong shape": {n: t.reshape(-1) for n, t in good.items()},
        "NaN": nan,
        "Inf": inf,
        "missing tensor": {"weight": good["weight"]},
        "extra tensor": {**good, "extra": torch.zeros(3)},
    }
    raw = Raw(target.address)

    def xreq(xid: int, tensors: dict[str, torch.Tensor], fingerprint: str = target.fingerprint) -> list[Any]:
        # One sender per request: each is judged on its own, not on a sender's record (quarantine).
        msg = Message("xreq", f"p{xid:010x}", raw.addr, fingerprint, target.steps, {"xid": xid}, tensors)
        return encode(msg, LIMITS)

    try:
        target.step()  # a first safe point: before it, a peer refuses every request unread (its model may still change)
        before = {n: p.detach().clone() for n, p in params.items()}
        for xid, tensors in enumerate(hostile_requests.values()):
            raw.send(xreq(xid, tensors))
        raw.send(xreq(99, good, fingerprint="0" * 16))  # another run's fingerprint
        n = len(hostile_requests)
        stepping_until(
            target,
            lambda: target.stats()["rejected"] >= n and target.stats()["wrong_run"] >= 1,
            "the hostile exchange requests to be refused",
        )
        for name, p in params.items():
            assert torch.equal(p.detach(), before[name]), f"{name} changed"
        answers = raw.answers(n, timeout=10)
        assert [m.kind for m in answers] == ["xnak"] * n  # each refusal is answered, so its sender moves on
        assert sorted(m.body["xid"] for m in answers) == list(range(n))
        assert target.stats()["served"] == 0

        # The same path with a valid request does move the model: the refusals above were not luck.
        raw.send(xreq(100, good))
        stepping_until(target, lambda: target.stats()["served"] >= 1, "the valid request to be served")
        # Served on the network side, possibly after the last safe point took its merges: the next one applies it.
        target.step()
        for name, p in params.items():
            torch.testing.assert_close(p.detach(), before[name] / 2)
        (reply,) = raw.answers(1, timeout=10)
        assert reply.kind == "xrep" and reply.body["xid"] == 100
    finally:
        raw.close()
