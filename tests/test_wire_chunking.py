"""Chunked tensors on the wire: a tensor over ``limits.chunk_bytes`` travels as several frames.

ZeroMQ moves one 64 MiB frame at about half the rate of 16 MiB ones, so big
tensors are sliced (zero-copy) on the sender and joined on the receiver.
Decoding stays the trust boundary: these tests check that chunked messages
round-trip, that the same bounds hold (frames, frame bytes, message bytes,
tensor bytes), and that hostile splits only ever raise ProtocolError.
"""

from __future__ import annotations

import asyncio
import math
from typing import Any

import msgpack
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gossiptrain.config import Limits
from gossiptrain.errors import ProtocolError
from gossiptrain.net.transport import listen
from gossiptrain.net.wire import DTYPES, Message, decode, encode, message_nbytes

MiB = 1 << 20


def msg(tensors: dict[str, torch.Tensor]) -> Message:
    return Message("xreq", "p1", "tcp://127.0.0.2:4000", "fp", 7, {"xid": 1}, tensors)


def raw(t: torch.Tensor) -> bytes:
    """A tensor's bytes, so NaNs and -0.0 compare exactly."""
    t = t.detach().contiguous()
    return t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""


def assert_same_tensors(sent: Message, got: Message) -> None:
    assert list(got.tensors) == list(sent.tensors)
    for name, t in sent.tensors.items():
        u = got.tensors[name]
        assert (u.dtype, tuple(u.shape)) == (t.dtype, tuple(t.shape))
        assert raw(u) == raw(t)


def expected_frames(tensors: dict[str, torch.Tensor], chunk: int) -> int:
    return 1 + sum(max(1, math.ceil(t.numel() * t.element_size() / chunk)) for t in tensors.values())


# ---------------------------------------------------------------- strategies


@st.composite
def tensors(draw: st.DrawFn) -> torch.Tensor:
    dtype = DTYPES[draw(st.sampled_from(sorted(DTYPES)))]
    shape = draw(st.lists(st.integers(0, 6), max_size=3))
    n = math.prod(shape) * dtype.itemsize
    if n == 0:
        return torch.empty(shape, dtype=dtype)
    data = bytearray(draw(st.binary(min_size=n, max_size=n)))
    if dtype is torch.bool:
        data = bytearray(b & 1 for b in data)
    return torch.frombuffer(data, dtype=dtype).reshape(shape)


tensor_maps = st.dictionaries(st.text(max_size=6), tensors(), max_size=4)
chunk_sizes = st.integers(1, 64)


def limits_for(chunk: int) -> Limits:
    # Room for the largest drawn message (4 tensors of 6x6x6 float64) in 1-byte chunks.
    return Limits(max_frame_bytes=4096, max_message_bytes=1 << 16, max_frames=8000, chunk_bytes=chunk)


# ---------------------------------------------------------------- round trips


@given(tensor_maps, chunk_sizes)
def test_round_trip_with_any_chunk_size(ts: dict[str, torch.Tensor], chunk: int) -> None:
    limits = limits_for(chunk)
    m = msg(ts)
    frames = encode(m, limits)
    assert len(frames) == expected_frames(ts, chunk)
    assert all(memoryview(f).nbytes <= chunk for f in frames[1:])
    assert message_nbytes(frames) == len(bytes(frames[0])) + sum(t.numel() * t.element_size() for t in ts.values())
    assert_same_tensors(m, decode(frames, limits))
    assert_same_tensors(m, decode([bytes(f) for f in frames], limits))  # read-only frames
    assert_same_tensors(m, decode([bytearray(bytes(f)) for f in frames], limits))  # writable frames


@given(tensor_maps, chunk_sizes, chunk_sizes)
def test_decode_does_not_need_the_senders_chunk_size(ts: dict[str, torch.Tensor], sent: int, mine: int) -> None:
    # Frame sizes alone say where each tensor ends; peers may chunk differently.
    assert_same_tensors(msg(ts), decode(encode(msg(ts), limits_for(sent)), limits_for(mine)))


def test_tensors_under_the_chunk_size_keep_one_frame() -> None:
    ts = {"w": torch.ones(8, 4), "b": torch.zeros(0), "s": torch.tensor(3.0)}
    assert len(encode(msg(ts), Limits())) == 4
    assert len(encode(msg({"w": torch.ones(4)}), Limits(chunk_bytes=16))) == 2  # exactly one chunk


def test_a_large_tensor_goes_in_chunks_of_at_most_chunk_bytes() -> None:
    t = torch.arange(10 * MiB // 4, dtype=torch.float32)  # 10 MiB
    limits = Limits(chunk_bytes=4 * MiB)
    frames = encode(msg({"big": t, "small": torch.ones(3)}), limits)
    assert [memoryview(f).nbytes for f in frames[1:]] == [4 * MiB, 4 * MiB, 2 * MiB, 12]
    out = decode(frames, limits).tensors
    assert torch.equal(out["big"], t) and torch.equal(out["small"], torch.ones(3))


def test_the_default_chunk_is_16_mib_and_a_max_size_tensor_round_trips() -> None:
    limits = Limits()
    assert limits.chunk_bytes == 16 * MiB
    t = torch.randn(limits.max_frame_bytes // 4)  # 64 MiB, at the per-tensor bound
    frames = encode(msg({"t": t}), limits)
    assert [memoryview(f).nbytes for f in frames[1:]] == [16 * MiB] * 4
    assert torch.equal(decode(frames, limits).tensors["t"], t)


def test_chunks_are_views_of_the_tensor_and_the_decoded_tensor_is_its_own() -> None:
    t = torch.zeros(8, dtype=torch.int32)  # 32 bytes in chunks of 12
    limits = Limits(chunk_bytes=12)
    frames = encode(msg({"t": t}), limits)
    t[4] = 5  # the second chunk is a view of the tensor's storage
    assert bytes(frames[2])[4:8] == torch.tensor([5], dtype=torch.int32).numpy().tobytes()
    writable = [bytes(frames[0])] + [bytearray(bytes(f)) for f in frames[1:]]
    out = decode(writable, limits).tensors["t"]
    writable[1][0] = 9  # joined chunks are a copy: changing a frame leaves the tensor alone
    assert int(out[0]) == 0 and int(out[4]) == 5
    out.add_(1)  # and the tensor is writable
    assert out.data_ptr() % 4 == 0


# ---------------------------------------------------------------- the bounds still hold


def test_frame_count_limit_counts_chunks() -> None:
    m = msg({"t": torch.zeros(40, dtype=torch.uint8)})  # 4 chunks of 10 + header = 5 frames
    at, under = Limits(max_frames=5, chunk_bytes=10), Limits(max_frames=4, chunk_bytes=10)
    assert_same_tensors(m, decode(encode(m, at), at))
    with pytest.raises(ProtocolError, match="max_frames"):
        encode(m, under)
    with pytest.raises(ProtocolError, match="max_frames"):
        decode(encode(m, at), under)


def test_a_tensor_is_still_bounded_by_max_frame_bytes_even_in_chunks() -> None:
    m = msg({"t": torch.zeros(8, 8, dtype=torch.uint8)})  # 64 bytes, each dimension under any limit here
    with pytest.raises(ProtocolError, match="max_frame_bytes"):
        encode(m, Limits(max_frame_bytes=63, chunk_bytes=16))
    # Hand-made: 64 bytes declared, in four 16-byte chunks, each under the frame limit.
    frames = encode(m, Limits(chunk_bytes=16))
    with pytest.raises(ProtocolError, match="max_frame_bytes"):
        decode(frames, Limits(max_frame_bytes=63))


def test_message_bytes_limit_counts_every_chunk() -> None:
    m = msg({"t": torch.zeros(100, dtype=torch.uint8)})
    frames = encode(m, Limits(chunk_bytes=30))
    total = message_nbytes(frames)
    at = Limits(max_frame_bytes=100, max_message_bytes=total, chunk_bytes=30)
    under = Limits(max_frame_bytes=100, max_message_bytes=total - 1, chunk_bytes=30)
    assert_same_tensors(m, decode(frames, at))
    with pytest.raises(ProtocolError, match="max_message_bytes"):
        encode(m, under)
    with pytest.raises(ProtocolError, match="max_message_bytes"):
        decode(frames, under)


def test_chunk_bytes_must_be_positive() -> None:
    from gossiptrain.errors import ConfigError

    with pytest.raises(ConfigError, match="limits.chunk_bytes"):
        Limits(chunk_bytes=0)


# ---------------------------------------------------------------- hostile splits


def _two_tensors() -> tuple[list[bytes], Limits]:
    limits = Limits(chunk_bytes=8)
    m = msg({"a": torch.arange(5, dtype=torch.int32), "e": torch.zeros(0), "b": torch.tensor([True, False])})
    return [bytes(f) for f in encode(m, limits)], limits  # header, a: 8 + 8 + 4, e: 0, b: 2


@pytest.mark.parametrize(
    "why,mangle",
    [
        ("an empty chunk inside a tensor", lambda f: [f[0], f[1], b"", f[2], f[3], f[4], f[5]]),
        ("a chunk running past its tensor", lambda f: [f[0], f[1], f[2], f[3] + b"\0", f[4], f[5]]),
        ("a chunk missing", lambda f: [f[0], f[1], f[3], f[4], f[5]]),
        ("the last frames missing", lambda f: f[:3]),
        ("a frame too many", lambda f: f + [b""]),
        ("an empty tensor with bytes", lambda f: [*f[:4], b"\0", f[5]]),
        ("an empty tensor's frame missing", lambda f: [*f[:4], f[5]]),
        ("bad bool bytes in a chunk", lambda f: [*f[:5], b"\x01\x02"]),
        ("bool split with a bad byte", lambda f: [*f[:5], b"\x01", b"\x03"]),
    ],
)
def test_decode_refuses_bad_splits(why: str, mangle: Any) -> None:
    frames, limits = _two_tensors()
    assert len(frames) == 6
    decode(frames, limits)  # the unmangled message is fine
    with pytest.raises(ProtocolError):
        decode(mangle(frames), limits)


def test_a_resplit_message_is_accepted() -> None:
    # Any split into non-empty frames is valid: here the bool tensor in single bytes.
    frames, limits = _two_tensors()
    out = decode([*frames[:5], frames[5][:1], frames[5][1:]], limits)
    assert out.tensors["b"].tolist() == [True, False]


@st.composite
def mangled(draw: st.DrawFn) -> tuple[list[bytes], Limits]:
    chunk = draw(st.integers(8, 64))
    limits = Limits(max_frame_bytes=2048, max_message_bytes=1 << 14, max_frames=1025, chunk_bytes=chunk)
    frames = [bytes(f) for f in encode(msg(draw(tensor_maps)), limits)]
    ops = draw(st.lists(st.sampled_from(["split", "merge", "drop", "empty", "grow", "header"]), max_size=3))
    for op in ops:
        if len(frames) < 2:
            break
        j = draw(st.integers(1, len(frames) - 1))
        if op == "split" and len(frames[j]) > 1:
            k = draw(st.integers(1, len(frames[j]) - 1))
            frames[j : j + 1] = [frames[j][:k], frames[j][k:]]
        elif op == "merge" and j + 1 < len(frames):
            frames[j : j + 2] = [frames[j] + frames[j + 1]]
        elif op == "drop":
            del frames[j]
        elif op == "empty":
            frames.insert(j, b"")
        elif op == "grow":
            frames[j] += b"\0"
        elif op == "header":
            header = msgpack.unpackb(frames[0], raw=False)
            if header["tensors"]:
                header["tensors"][0][3] = draw(st.integers(-1, 3000))
            frames[0] = msgpack.packb(header, use_bin_type=True)
    return frames, limits


@settings(suppress_health_check=[HealthCheck.too_slow])
@given(mangled())
def test_mangled_chunked_messages_only_raise_protocol_error(case: tuple[list[bytes], Limits]) -> None:
    frames, limits = case
    try:
        out = decode(frames, limits)
    except ProtocolError:
        return
    # Whatever decode accepts re-encodes under the same limits: one schema on both sides.
    assert_same_tensors(out, decode(encode(out, limits), limits))


# ---------------------------------------------------------------- through a real transport


def test_chunked_message_crosses_tcp_transport() -> None:
    limits = Limits(chunk_bytes=64 * 1024)
    t = torch.randn(300_000)  # 1.2 MB in 19 chunks

    async def main() -> Message:
        async with listen("tcp://127.0.0.1:0", limits) as a, listen("tcp://127.0.0.1:0", limits) as b:
            frames = encode(msg({"w": t}), limits)
            assert len(frames) == 20
            assert a.send(b.address, frames)
            return decode(await asyncio.wait_for(b.recv(), 30), limits)

    assert torch.equal(asyncio.run(main()).tensors["w"], t)
