"""The wire codec: round trips, hostile bytes, and every limit at its boundary.

decode is the trust boundary of the whole runtime, so besides round trips
these tests throw random and mutated bytes at it and require that nothing but
ProtocolError ever comes out.
"""

from __future__ import annotations

import math
from typing import Any

import msgpack
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gossiptrain.config import Limits
from gossiptrain.errors import ProtocolError
from gossiptrain.net.wire import (
    DTYPES,
    KINDS,
    MAX_BODY_DEPTH,
    MAX_NAME_LEN,
    PROTOCOL_VERSION,
    Message,
    decode,
    encode,
    message_nbytes,
)

LIMITS = Limits()
SMALL = Limits(max_frame_bytes=4096, max_message_bytes=1 << 16, max_frames=9)

# ---------------------------------------------------------------- helpers


def tensor_bytes(t: torch.Tensor) -> bytes:
    """Raw bytes of a tensor, so NaNs and -0.0 compare exactly."""
    t = t.detach().cpu().contiguous()
    return t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""


def assert_same(a: Message, b: Message) -> None:
    assert (a.kind, a.sender, a.addr, a.fingerprint, a.step) == (b.kind, b.sender, b.addr, b.fingerprint, b.step)
    assert dict(a.body) == dict(b.body)
    assert list(a.tensors) == list(b.tensors)
    for name, t in a.tensors.items():
        u = b.tensors[name]
        assert (u.dtype, tuple(u.shape)) == (t.dtype, tuple(t.shape))
        assert tensor_bytes(u) == tensor_bytes(t)


def as_bytes(frames: list[Any]) -> list[bytes]:
    return [bytes(f) for f in frames]


def msg(**kw: Any) -> Message:
    base: dict[str, Any] = dict(kind="gossip", sender="p1", addr="tcp://127.0.0.2:4000", fingerprint="abc", step=3)
    base.update(kw)
    return Message(**base)


def header_of(m: Message) -> dict[str, Any]:
    return msgpack.unpackb(bytes(encode(m, LIMITS)[0]), raw=False)


def frames_with_header(header: Any, tensor_frames: list[bytes]) -> list[bytes]:
    return [msgpack.packb(header, use_bin_type=True), *tensor_frames]


def decode_never_leaks(frames: list[Any], limits: Limits = SMALL) -> Message | None:
    """decode returns a message or raises ProtocolError; anything else fails the test.

    A message it accepts must also be one encode accepts: both sides apply one schema.
    """
    try:
        out = decode(frames, limits)
    except ProtocolError:
        return None
    encode(out, limits)
    return out


# ---------------------------------------------------------------- strategies

shapes = st.lists(st.integers(0, 4), max_size=4)


@st.composite
def tensors(draw: st.DrawFn) -> torch.Tensor:
    name = draw(st.sampled_from(sorted(DTYPES)))
    dtype = DTYPES[name]
    shape = draw(shapes)
    n = math.prod(shape) * dtype.itemsize
    if n == 0:
        return torch.empty(shape, dtype=dtype)
    raw = bytearray(draw(st.binary(min_size=n, max_size=n)))
    if dtype is torch.bool:
        raw = bytearray(b & 1 for b in raw)
    return torch.frombuffer(raw, dtype=dtype).reshape(shape)


scalars = (
    st.none()
    | st.booleans()
    | st.integers(-(1 << 63), (1 << 64) - 1)
    | st.floats(allow_nan=False)
    | st.text(max_size=20)
)
values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=20,
)
bodies = st.dictionaries(st.text(max_size=8), values, max_size=5)
tensor_maps = st.dictionaries(st.text(max_size=12), tensors(), max_size=4)
messages = st.builds(
    Message,
    kind=st.sampled_from(sorted(KINDS)),
    sender=st.text(max_size=16),
    addr=st.text(max_size=32),
    fingerprint=st.text(max_size=16),
    step=st.integers(0, (1 << 64) - 1),
    body=bodies,
    tensors=tensor_maps,
)

# ---------------------------------------------------------------- round trips


@given(messages)
def test_round_trip_any_message(m: Message) -> None:
    frames = encode(m, SMALL)
    assert len(frames) == len(m.tensors) + 1
    assert message_nbytes(frames) == sum(len(bytes(f)) for f in frames)
    assert_same(m, decode(frames, SMALL))
    assert_same(m, decode(as_bytes(frames), SMALL))  # read-only frames take the copying path


@pytest.mark.parametrize("name", sorted(DTYPES))
@pytest.mark.parametrize("shape", [(), (0,), (3, 0, 2), (5,), (2, 3, 4)])
def test_every_dtype_and_shape(name: str, shape: tuple[int, ...]) -> None:
    t = (torch.arange(math.prod(shape)) % 2).reshape(shape).to(DTYPES[name])
    out = decode(encode(msg(tensors={"t": t}), LIMITS), LIMITS).tensors["t"]
    assert out.dtype is DTYPES[name] and tuple(out.shape) == shape
    assert torch.equal(out, t)


def test_bfloat16_values_survive() -> None:
    t = torch.tensor([1.5, -2.25, float("inf"), 3e38], dtype=torch.bfloat16)
    out = decode(encode(msg(tensors={"w": t}), LIMITS), LIMITS).tensors["w"]
    assert out.dtype is torch.bfloat16 and torch.equal(out, t)


def test_noncontiguous_and_grad_tensors_encode() -> None:
    base = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    p = torch.nn.Parameter(torch.ones(2, 2))
    m = msg(tensors={"t": base.t(), "p": p, "slice": base[1:, ::2]})
    out = decode(encode(m, LIMITS), LIMITS)
    assert torch.equal(out.tensors["t"], base.t())
    assert torch.equal(out.tensors["p"], p.detach())
    assert torch.equal(out.tensors["slice"], base[1:, ::2])
    assert list(out.tensors) == ["t", "p", "slice"]


def test_encode_is_zero_copy_for_contiguous_cpu_tensors() -> None:
    t = torch.zeros(4, dtype=torch.float32)
    frame = encode(msg(tensors={"t": t}), LIMITS)[1]
    t[0] = 1.0  # the frame is a view of the tensor's storage
    assert bytes(frame)[:4] == torch.tensor([1.0]).numpy().tobytes()


def test_decode_wraps_writable_frames_and_copies_read_only_ones() -> None:
    frames = encode(msg(tensors={"t": torch.zeros(4, dtype=torch.int32)}), LIMITS)
    writable = [bytes(frames[0]), bytearray(bytes(frames[1]))]
    shared = decode(writable, LIMITS).tensors["t"]
    writable[1][0] = 7
    assert int(shared[0]) == 7
    read_only = as_bytes(frames)
    copied = decode(read_only, LIMITS).tensors["t"]
    copied.add_(1)  # must not write into an immutable bytes object
    assert read_only[1] == bytes(16)


def test_decode_refuses_strided_tensor_frames() -> None:
    header, frame = as_bytes(encode(msg(tensors={"t": torch.zeros(2, dtype=torch.int16)}), LIMITS))
    for buf in (bytearray(frame * 2), frame * 2):  # writable and read-only
        with pytest.raises(ProtocolError, match="contiguous"):
            decode([header, memoryview(buf)[::2]], LIMITS)


def test_decode_realigns_unaligned_frames() -> None:
    t = torch.arange(3, dtype=torch.float64)
    header, frame = as_bytes(encode(msg(tensors={"t": t}), LIMITS))
    shifted = memoryview(bytearray(b"\0" + frame))[1:]
    out = decode([header, shifted], LIMITS).tensors["t"]
    assert out.data_ptr() % 8 == 0 and torch.equal(out, t)


def test_defaults_and_nested_body() -> None:
    body = {"view": [{"id": "p2", "addr": "tcp://h:1", "hb": 12, "alive": True}], "x": None, "f": 0.5}
    out = decode(encode(Message("join", "", "tcp://a:1", "", body=body), LIMITS), LIMITS)
    assert (out.kind, out.sender, out.fingerprint, out.step, out.tensors) == ("join", "", "", 0, {})
    assert out.body == body


def test_body_at_max_depth_accepted_one_deeper_refused() -> None:
    deep: Any = 1
    for _ in range(MAX_BODY_DEPTH - 1):
        deep = [deep]
    assert decode(encode(msg(body={"d": deep}), LIMITS), LIMITS).body == {"d": deep}
    with pytest.raises(ProtocolError, match="deeper"):
        encode(msg(body={"d": [deep]}), LIMITS)
    header = header_of(msg())
    header["body"] = {"d": [deep]}
    with pytest.raises(ProtocolError, match="deeper"):
        decode(frames_with_header(header, []), LIMITS)


# ---------------------------------------------------------------- encode refuses


@pytest.mark.parametrize(
    "bad",
    [
        dict(tensors={"c": torch.zeros(2, dtype=torch.complex64)}),
        dict(tensors={"u": torch.zeros(2, dtype=torch.uint16)}),
        dict(tensors={"s": torch.zeros(3).to_sparse()}),
        dict(tensors={"n": [1.0]}),
        dict(tensors={"x" * (MAX_NAME_LEN + 1): torch.zeros(1)}),
        dict(kind="hello"),
        dict(step=-1),
        dict(step=True),
        dict(step=1 << 64),
        dict(sender=None),
        dict(body={"b": b"bytes"}),
        dict(body={"t": (1, 2)}),
        dict(body={1: "int key"}),
        dict(body={"big": 1 << 64}),
        dict(body={"s": "\ud800"}),
        dict(body=[1]),
    ],
)
def test_encode_refuses_invalid_messages(bad: dict[str, Any]) -> None:
    with pytest.raises(ProtocolError):
        encode(msg(**bad), LIMITS)


# ---------------------------------------------------------------- hand-made invalid headers


def _bad_headers() -> list[tuple[str, Any, list[bytes]]]:
    good = header_of(msg(tensors={"a": torch.zeros(2, dtype=torch.int16), "b": torch.ones(1)}))
    frames = [bytes(4), torch.ones(1).numpy().tobytes()]
    cases: list[tuple[str, Any, list[bytes]]] = [("not a map", [1, 2], frames)]

    def with_(key: str, value: Any) -> dict[str, Any]:
        return {**good, key: value}

    def entry(i: int, j: int, value: Any) -> dict[str, Any]:
        table = [list(e) for e in good["tensors"]]
        table[i][j] = value
        return {**good, "tensors": table}

    cases += [
        ("missing key", {k: v for k, v in good.items() if k != "step"}, frames),
        ("extra key", {**good, "x": 1}, frames),
        ("version", with_("v", PROTOCOL_VERSION + 1), frames),
        ("bool version", with_("v", True), frames),
        ("kind", with_("kind", "hello"), frames),
        ("kind type", with_("kind", 3), frames),
        ("sender type", with_("sender", 3), frames),
        ("fp type", with_("fp", None), frames),
        ("negative step", with_("step", -1), frames),
        ("float step", with_("step", 1.0), frames),
        ("body list", with_("body", []), frames),
        ("body int key", with_("body", {1: 2}), frames),
        ("body bytes", with_("body", {"b": b""}), frames),
        ("body ext", with_("body", {"e": msgpack.ExtType(1, b"")}), frames),
        ("tensors map", with_("tensors", {}), frames),
        ("short entry", with_("tensors", [["a", "int16", [2]], good["tensors"][1]]), frames),
        ("name type", entry(0, 0, 5), frames),
        ("long name", entry(0, 0, "x" * (MAX_NAME_LEN + 1)), frames),
        ("duplicate names", entry(1, 0, "a"), frames),
        ("dtype", entry(0, 1, "complex64"), frames),
        ("dtype type", entry(0, 1, 1), frames),
        ("shape type", entry(0, 2, 2), frames),
        ("negative dims", entry(0, 2, [-2, -1]), frames),  # their product would fit
        ("huge zero-size dim", entry(0, 2, [0, 1 << 40]), frames),
        ("too many dims", entry(0, 2, [1] * 32 + [2]), frames),
        ("shape vs nbytes", entry(0, 2, [3]), frames),
        ("nbytes vs shape", entry(0, 3, 6), frames),
        ("bool nbytes", entry(1, 3, True), frames),
        ("too few frames", good, frames[:1]),
        ("too many frames", good, frames + [b""]),
        ("frame length", good, [bytes(5), frames[1]]),
    ]
    return cases


@pytest.mark.parametrize("why,header,tensor_frames", _bad_headers(), ids=[c[0] for c in _bad_headers()])
def test_decode_refuses_invalid_headers(why: str, header: Any, tensor_frames: list[bytes]) -> None:
    with pytest.raises(ProtocolError):
        decode(frames_with_header(header, tensor_frames), LIMITS)


def test_decode_refuses_trailing_bytes_and_bad_bool_bytes() -> None:
    header, frame = as_bytes(encode(msg(tensors={"b": torch.tensor([True, False])}), LIMITS))
    assert decode([header, frame], LIMITS).tensors["b"].tolist() == [True, False]
    with pytest.raises(ProtocolError, match="msgpack"):
        decode([header + b"\xc0", frame], LIMITS)
    with pytest.raises(ProtocolError, match="bool"):
        decode([header, b"\x02\x00"], LIMITS)


@pytest.mark.parametrize(
    "frames",
    [[], None, [1], ["header"], [memoryview(bytes(8))[::2]]],
    ids=["empty", "none", "int", "str", "strided"],
)
def test_decode_refuses_non_frames(frames: Any) -> None:
    with pytest.raises(ProtocolError):
        decode(frames, LIMITS)


# ---------------------------------------------------------------- hostile bytes


@given(st.lists(st.binary(max_size=64), min_size=1, max_size=4))
def test_random_frames_only_raise_protocol_error(frames: list[bytes]) -> None:
    decode_never_leaks(frames)


@given(st.binary(max_size=64))
def test_random_header_bytes_only_raise_protocol_error(raw: bytes) -> None:
    decode_never_leaks([raw])


@st.composite
def mutated(draw: st.DrawFn) -> list[Any]:
    frames: list[Any] = as_bytes(encode(draw(messages), SMALL))
    op = draw(st.sampled_from(["flip", "insert", "delete", "truncate", "extend", "drop", "add", "writable"]))
    header = bytearray(frames[0])
    i = draw(st.integers(0, len(header) - 1))
    if op == "flip":
        header[i] ^= draw(st.integers(1, 255))
    elif op == "insert":
        header.insert(i, draw(st.integers(0, 255)))
    elif op == "delete":
        del header[i]
    frames[0] = bytes(header)
    if op in ("truncate", "extend", "drop") and len(frames) > 1:
        j = draw(st.integers(1, len(frames) - 1))
        if op == "truncate":
            frames[j] = frames[j][: draw(st.integers(0, max(0, len(frames[j]) - 1)))]
        elif op == "extend":
            frames[j] = frames[j] + draw(st.binary(min_size=1, max_size=8))
        else:
            del frames[j]
    elif op == "add":
        frames.append(draw(st.binary(max_size=16)))
    elif op == "writable":
        frames = [bytearray(f) for f in frames]
    return frames


@settings(suppress_health_check=[HealthCheck.too_slow])
@given(mutated())
def test_mutated_encodings_only_raise_protocol_error(frames: list[Any]) -> None:
    decode_never_leaks(frames)


@given(
    st.recursive(
        scalars | st.binary(max_size=4),
        lambda inner: st.lists(inner, max_size=3) | st.dictionaries(scalars, inner, max_size=3),
        max_leaves=10,
    )
)
def test_arbitrary_msgpack_headers_only_raise_protocol_error(header: Any) -> None:
    # Schema-level fuzzing: well-formed msgpack of the wrong shape.
    try:
        packed = msgpack.packb(header, use_bin_type=True)
    except (TypeError, ValueError, OverflowError):
        return  # e.g. unhashable keys; not bytes a peer could send through packb
    decode_never_leaks([packed])


def test_deeply_nested_header_is_a_protocol_error() -> None:
    with pytest.raises(ProtocolError):
        decode([b"\x91" * 5000 + b"\xc0"], LIMITS)


# ---------------------------------------------------------------- limits at the boundary


def test_header_bytes_limit() -> None:
    m = msg(body={"pad": "x" * 100})
    n = len(encode(m, LIMITS)[0])
    at, under = Limits(max_header_bytes=n), Limits(max_header_bytes=n - 1)
    assert_same(m, decode(encode(m, at), at))
    with pytest.raises(ProtocolError, match="max_header_bytes"):
        encode(m, under)
    with pytest.raises(ProtocolError, match="max_header_bytes"):
        decode(encode(m, at), under)


def test_frame_bytes_limit() -> None:
    m = msg(tensors={"t": torch.zeros(16, dtype=torch.uint8)})
    at, under = Limits(max_frame_bytes=16), Limits(max_frame_bytes=15)
    assert_same(m, decode(encode(m, at), at))
    with pytest.raises(ProtocolError, match="max_frame_bytes"):
        encode(m, under)
    with pytest.raises(ProtocolError, match="max_frame_bytes"):
        decode(encode(m, at), under)


def test_frame_count_limit() -> None:
    m = msg(tensors={str(i): torch.zeros(1) for i in range(4)})
    at, under = Limits(max_frames=5), Limits(max_frames=4)
    assert_same(m, decode(encode(m, at), at))
    with pytest.raises(ProtocolError, match="max_frames"):
        encode(m, under)
    with pytest.raises(ProtocolError, match="max_frames"):
        decode(encode(m, at), under)


def test_message_bytes_limit() -> None:
    m = msg(tensors={"a": torch.zeros(64, dtype=torch.uint8), "b": torch.zeros(64, dtype=torch.uint8)})
    frames = encode(m, LIMITS)
    total = message_nbytes(frames)
    assert total == len(frames[0]) + 128
    at = Limits(max_frame_bytes=64, max_message_bytes=total)
    under = Limits(max_frame_bytes=64, max_message_bytes=total - 1)
    assert_same(m, decode(encode(m, at), at))
    with pytest.raises(ProtocolError, match="max_message_bytes"):
        encode(m, under)
    with pytest.raises(ProtocolError, match="max_message_bytes"):
        decode(encode(m, at), under)


@pytest.mark.parametrize(
    "make",
    [
        lambda n: {"xs": [0] * n},
        lambda n: {f"k{i}": i for i in range(n)},
        lambda n: {"m": {str(i): 0 for i in range(n)}},
    ],
    ids=["list", "body map", "nested map"],
)
def test_container_length_limit(make: Any) -> None:
    m = msg(body=make(20))
    at, under = Limits(max_container_len=20), Limits(max_container_len=19)
    assert_same(m, decode(encode(m, at), at))
    with pytest.raises(ProtocolError, match="max_container_len"):
        encode(m, under)
    with pytest.raises(ProtocolError, match="exceeds max_"):
        decode(encode(m, at), under)


@pytest.mark.parametrize(
    "make",
    [
        lambda s: msg(body={"s": s}),
        lambda s: msg(body={s: 1}),
        lambda s: msg(addr=s),
        lambda s: msg(tensors={s: torch.zeros(1)}),
    ],
    ids=["body value", "body key", "addr", "tensor name"],
)
@pytest.mark.parametrize("char", ["x", "é"], ids=["ascii", "two-byte"])
def test_string_length_limit_counts_utf8_bytes(make: Any, char: str) -> None:
    m = make(char * (40 // len(char.encode())))
    at, under = Limits(max_str_len=40), Limits(max_str_len=39)
    assert_same(m, decode(encode(m, at), at))
    with pytest.raises(ProtocolError, match="max_str_len"):
        encode(m, under)
    with pytest.raises(ProtocolError, match="max_str_len"):
        decode(encode(m, at), under)


def test_tensor_table_length_limit() -> None:
    m = msg(tensors={str(i): torch.zeros(1) for i in range(12)})
    at, under = Limits(max_container_len=12), Limits(max_container_len=11)
    assert_same(m, decode(encode(m, at), at))
    with pytest.raises(ProtocolError, match="max_container_len"):
        encode(m, under)
    with pytest.raises(ProtocolError):
        decode(encode(m, at), under)


def test_encode_refuses_limits_no_header_fits() -> None:
    with pytest.raises(ProtocolError, match="too small"):
        encode(msg(), Limits(max_str_len=6))
