"""Compression codecs, error feedback and edge references: accuracy, bytes, and hostile input.

decode runs on what peers send, so besides round trips these tests mutate
valid messages and throw random wire tensors at it, and require that nothing
but ProtocolError ever comes out and that whatever comes out has the
receiver's names, shapes and dtypes.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Mapping

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gossiptrain.codec_spec import CODECS
from gossiptrain.config import Limits
from gossiptrain.errors import ConfigError, ProtocolError
from gossiptrain.net import wire
from gossiptrain.protocol.compression import (
    AutoCodec,
    Bf16Codec,
    Codec,
    EdgeReference,
    ErrorFeedback,
    Fp16Codec,
    Int8Codec,
    NoneCodec,
    TopKCodec,
    all_finite,
    first_non_finite,
    get_codec,
)

Params = dict[str, torch.Tensor]
SPECS = ("none", "fp16", "bf16", "int8", "int8:stochastic=1,seed=3", "topk", "topk:ratio=0.3")
FAST = settings(max_examples=40, deadline=None)

# ---------------------------------------------------------------- strategies and helpers


@st.composite
def tensors(draw: st.DrawFn, bound: float = 1e4, shape: tuple[int, ...] | None = None) -> torch.Tensor:
    """A float32 tensor (by default of 0-3 dims, zero-size ones included) with finite values within +-bound."""
    if shape is None:
        shape = tuple(draw(st.lists(st.integers(0, 4), max_size=3)))
    numel = math.prod(shape)
    elem = st.floats(-bound, bound, width=32, allow_nan=False, allow_subnormal=False)
    return torch.tensor(draw(st.lists(elem, min_size=numel, max_size=numel)), dtype=torch.float32).reshape(shape)


@st.composite
def params(draw: st.DrawFn, bound: float = 1e4) -> Params:
    """One to three named parameters, like a small model's."""
    pool = st.sampled_from(["w", "b", "layer.0.weight", "layer.0.bias"])
    names = draw(st.lists(pool, min_size=1, max_size=3, unique=True))
    return {n: draw(tensors(bound)) for n in names}


def through_wire(parts: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """What a receiver gets: the parts encoded to frames, copied to bytes and decoded by the real wire codec."""
    msg = wire.Message(kind="gossip", sender="p1", addr="tcp://127.0.0.2:4000", fingerprint="fp", tensors=parts)
    frames = [bytes(f) for f in wire.encode(msg, Limits())]
    return dict(wire.decode(frames, Limits()).tensors)


def wire_bytes(parts: Mapping[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in parts.values())


def assert_like(out: Mapping[str, torch.Tensor], like: Mapping[str, torch.Tensor]) -> None:
    assert list(out) == list(like)
    for n, t in like.items():
        assert (out[n].dtype, tuple(out[n].shape)) == (t.dtype, tuple(t.shape))
        assert bool(torch.isfinite(out[n]).all())


# ---------------------------------------------------------------- round trips


@FAST
@given(params(bound=torch.finfo(torch.float32).max))
def test_none_is_exact_and_keeps_float32(x: Params) -> None:
    codec = get_codec("none")
    parts = codec.encode(x)
    assert all(t.dtype is torch.float32 for t in parts.values())
    out = codec.decode(through_wire(parts), like=x)
    assert_like(out, x)
    for n in x:
        assert torch.equal(out[n], x[n])


@FAST
@given(params(bound=65504.0))
def test_fp16_round_trip_within_half_precision(x: Params) -> None:
    codec = get_codec("fp16")
    out = codec.decode(through_wire(codec.encode(x)), like=x)
    assert_like(out, x)
    for n, t in x.items():
        # 11 significant bits: relative error 2^-11 for normals, half a subnormal step below them.
        assert bool(((out[n] - t).abs() <= torch.clamp(t.abs() * 2**-11, min=2**-25)).all())


@FAST
@given(params(bound=2.0**126))
def test_bf16_round_trip_within_bfloat16_precision(x: Params) -> None:
    codec = get_codec("bf16")
    out = codec.decode(through_wire(codec.encode(x)), like=x)
    assert_like(out, x)
    for n, t in x.items():
        assert bool(((out[n] - t).abs() <= t.abs() * 2**-8).all())


def test_casts_saturate_instead_of_overflowing() -> None:
    x = {"w": torch.tensor([1e5, -1e6, 3.4e38, 1.0])}  # (4,)
    half = Fp16Codec().decode(Fp16Codec().encode(x), like=x)["w"]
    assert half.tolist() == [65504.0, -65504.0, 65504.0, 1.0]
    brain = Bf16Codec().decode(Bf16Codec().encode(x), like=x)["w"]
    assert bool(torch.isfinite(brain).all()) and float(brain[2]) == torch.finfo(torch.bfloat16).max


def test_cast_decodes_into_the_receivers_dtype() -> None:
    x = {"w": torch.linspace(-2, 2, 9, dtype=torch.float64)}  # (9,)
    for codec in (Fp16Codec(), Bf16Codec(), Int8Codec(), TopKCodec(0.5), NoneCodec()):
        out = codec.decode(through_wire(codec.encode(x)), like=x)
        assert out["w"].dtype is torch.float64, codec.name


@FAST
@given(params())
def test_int8_error_is_at_most_half_a_step(x: Params) -> None:
    codec = Int8Codec()
    parts = codec.encode(x)
    out = codec.decode(through_wire(parts), like=x)
    assert_like(out, x)
    for n, t in x.items():
        scale = float(parts[n + "#scale"])
        absmax = float(t.abs().max()) if t.numel() else 0.0
        assert scale == pytest.approx(absmax / 127, rel=1e-6)
        assert parts[n].dtype is torch.int8 and bool((parts[n].abs() <= 127).all())
        assert bool(((out[n] - t).abs() <= scale / 2 + 1e-6 * absmax + 1e-44).all())


def test_int8_zero_tensor_has_scale_zero() -> None:
    x = {"w": torch.zeros(3, 4), "tiny": torch.tensor([1e-44, -1e-45])}  # scale of "tiny" underflows
    parts = Int8Codec().encode(x)
    assert float(parts["w#scale"]) == 0.0 and float(parts["tiny#scale"]) == 0.0
    out = Int8Codec().decode(parts, like=x)
    assert torch.equal(out["w"], x["w"]) and bool((out["tiny"] == 0).all())


def test_int8_stochastic_rounding_is_unbiased_and_seeded() -> None:
    x = {"w": torch.cat([torch.tensor([127.0]), torch.full((20_000,), 0.3)])}  # scale 1: 0.3 rounds to 0 or 1
    nearest = Int8Codec().decode(Int8Codec().encode(x), like=x)["w"]
    assert float(nearest[1:].mean()) == 0.0  # round-to-nearest loses the 0.3 every time
    codec = get_codec("int8:stochastic=true,seed=7")
    out = codec.decode(codec.encode(x), like=x)["w"]
    assert float(out[1:].mean()) == pytest.approx(0.3, abs=0.02)
    assert bool(((out - x["w"]).abs() < 1).all())
    again = get_codec("int8:stochastic=1,seed=7")
    assert torch.equal(again.decode(again.encode(x), like=x)["w"], out)


@FAST
@given(params(), st.sampled_from([0.01, 0.07, 0.25, 0.5, 1.0]))
def test_topk_keeps_exactly_the_largest_magnitudes(x: Params, ratio: float) -> None:
    codec = TopKCodec(ratio)
    parts = codec.encode(x)
    out = codec.decode(through_wire(parts), like=x)
    assert_like(out, x)
    for n, t in x.items():
        numel = t.numel()
        k = 0 if numel == 0 else min(numel, max(1, math.ceil(round(ratio * numel, 9))))
        idx, val = parts[n + "#idx"], parts[n + "#val"]
        assert (idx.dtype, val.dtype, idx.numel(), val.numel()) == (torch.int32, torch.float32, k, k)
        flat, dense = t.reshape(-1), out[n].reshape(-1)
        kept = torch.zeros(numel, dtype=torch.bool)
        kept[idx.long()] = True
        assert int(kept.sum()) == k  # no index twice
        assert torch.equal(dense[kept], flat[kept])  # kept values are exact
        assert bool((dense[~kept] == 0).all())  # zeros elsewhere
        top = torch.sort(flat.abs(), descending=True).values[:k]
        assert torch.equal(torch.sort(flat[kept].abs(), descending=True).values, top)


def test_topk_count_and_index_width() -> None:
    assert [TopKCodec(0.07).k(100), TopKCodec(0.01).k(1), TopKCodec(0.01).k(0), TopKCodec(1.0).k(5)] == [7, 1, 0, 5]
    assert TopKCodec(0.01).k(1_000_000) == 10_000 and TopKCodec(0.5).k(3) == 2
    assert TopKCodec.index_dtype(2**31 - 1) is torch.int32
    assert TopKCodec.index_dtype(2**31) is torch.int64


@pytest.mark.parametrize("spec", SPECS)
def test_every_codec_speaks_wire_dtypes_and_survives_the_wire(spec: str) -> None:
    gen = torch.Generator().manual_seed(1)
    x = {
        "conv.weight": torch.randn(4, 3, 3, generator=gen),  # (4, 3, 3)
        "conv.bias": torch.randn(4, generator=gen),  # (4,)
        "scalar": torch.tensor(2.5),  # ()
    }
    codec = get_codec(spec)
    parts = codec.encode(x)
    assert {t.dtype for t in parts.values()} <= set(wire.DTYPES.values())
    assert all("#" in n or n in x for n in parts)
    direct = codec.decode(parts, like=x)
    received = codec.decode(through_wire(parts), like=x)
    assert_like(received, x)
    for n in x:
        assert torch.equal(received[n], direct[n])


def test_bytes_saved_on_a_million_parameters() -> None:
    x = {"w": torch.randn(1000, 1000, generator=torch.Generator().manual_seed(0))}  # (1000, 1000) float32
    dense = wire_bytes(get_codec("none").encode(x))
    assert dense == 4_000_000
    ratios = {spec: wire_bytes(get_codec(spec).encode(x)) / dense for spec in ("int8", "fp16", "bf16", "topk")}
    assert ratios["int8"] == pytest.approx(0.25, abs=1e-5)  # 1 byte a value plus a 4-byte scale
    assert ratios["fp16"] == ratios["bf16"] == 0.5
    assert ratios["topk"] == pytest.approx(0.02, abs=1e-9)  # 10_000 int32 indices + 10_000 float32 values


# ---------------------------------------------------------------- hostile input


def valid(spec: str) -> tuple[Codec, Params, dict[str, torch.Tensor]]:
    x = {"w": torch.linspace(-3, 3, 12).reshape(3, 4), "b": torch.tensor([0.5, -2.0, 1.0])}
    codec = get_codec(spec)
    return codec, x, through_wire(codec.encode(x))


def _set(key: str, value: torch.Tensor) -> Callable[[dict[str, torch.Tensor]], None]:
    def apply(parts: dict[str, torch.Tensor]) -> None:
        parts[key] = value

    return apply


MUTATIONS: dict[str, list[Callable[[dict[str, torch.Tensor]], None]]] = {
    "none": [
        _set("w", torch.zeros(3, 4, dtype=torch.float64)),
        _set("w", torch.zeros(4, 3)),
        _set("w", torch.zeros(12)),
        _set("b", torch.tensor([0.0, math.nan, 1.0])),
        _set("b", torch.tensor([0.0, math.inf, 1.0])),
    ],
    "fp16": [
        _set("w", torch.zeros(3, 4)),
        _set("w", torch.zeros(3, 4, dtype=torch.bfloat16)),
        _set("b", torch.tensor([0.0, math.inf, 1.0], dtype=torch.float16)),
        _set("b", torch.zeros(1, 3, dtype=torch.float16)),
    ],
    "bf16": [
        _set("b", torch.tensor([0.0, math.nan, 1.0], dtype=torch.bfloat16)),
        _set("b", torch.zeros(3, dtype=torch.float16)),
    ],
    "int8": [
        _set("w#scale", torch.tensor(math.nan)),
        _set("w#scale", torch.tensor(math.inf)),
        _set("w#scale", torch.tensor(-1.0)),
        _set("w#scale", torch.tensor(3e38)),  # 127 * scale overflows float32
        _set("w#scale", torch.tensor([0.1])),
        _set("w#scale", torch.tensor(0.1, dtype=torch.float64)),
        _set("w", torch.zeros(3, 4, dtype=torch.uint8)),
        _set("w", torch.zeros(12, dtype=torch.int8)),
        _set("b", torch.tensor([-128, 0, 1], dtype=torch.int8)),
    ],
    "topk:ratio=0.3": [
        _set("w#idx", torch.tensor([0, 1, 12, 2], dtype=torch.int32)),  # unsorted and out of range
        _set("w#idx", torch.tensor([0, 1, 2, 12], dtype=torch.int32)),  # out of range
        _set("w#idx", torch.tensor([-1, 1, 2, 3], dtype=torch.int32)),
        _set("w#idx", torch.tensor([0, 1, 1, 3], dtype=torch.int32)),  # duplicate
        _set("w#idx", torch.tensor([3, 2, 1, 0], dtype=torch.int32)),  # unsorted
        _set("w#idx", torch.tensor([0, 1, 2, 3], dtype=torch.int64)),
        _set("w#idx", torch.tensor([0, 1, 2], dtype=torch.int32)),  # fewer than k
        _set("w#val", torch.tensor([1.0, 2.0, math.nan, 0.0])),
        _set("w#val", torch.tensor([1.0, 2.0, 3.0, 4.0], dtype=torch.float16)),
        _set("w#val", torch.zeros(2, 2)),
        _set("b#idx", torch.tensor([3], dtype=torch.int32)),
    ],
}


def _pop(key: str) -> Callable[[dict[str, torch.Tensor]], None]:
    def apply(parts: dict[str, torch.Tensor]) -> None:
        del parts[key]

    return apply


def _missing_and_extra(spec: str) -> list[Callable[[dict[str, torch.Tensor]], None]]:
    _, _, parts = valid(spec)
    out: list[Callable[[dict[str, torch.Tensor]], None]] = [_set("w#extra", torch.zeros(1)), _set("x", torch.zeros(3))]
    out.extend(_pop(key) for key in parts)
    out.append(_set("b", "not a tensor"))  # type: ignore[arg-type]
    return out


@pytest.mark.parametrize(
    "spec,mutate",
    [(spec, m) for spec, ms in MUTATIONS.items() for m in ms]
    + [(spec, m) for spec in MUTATIONS for m in _missing_and_extra(spec)],
)
def test_malformed_parts_raise_protocol_error(spec: str, mutate: Callable[[dict[str, torch.Tensor]], None]) -> None:
    codec, x, parts = valid(spec)
    codec.decode(parts, like=x)  # the unmutated message is fine
    mutate(parts)
    with pytest.raises(ProtocolError):
        codec.decode(parts, like=x)


def test_decode_refuses_values_that_overflow_the_receivers_dtype() -> None:
    like = {"w": torch.zeros(2, dtype=torch.float16)}
    with pytest.raises(ProtocolError):
        Int8Codec().decode({"w": torch.tensor([127, 1], dtype=torch.int8), "w#scale": torch.tensor(1000.0)}, like)
    with pytest.raises(ProtocolError):
        NoneCodec().decode({"w": torch.tensor([1e5, 0.0], dtype=torch.float16)}, like)  # inf in float16 already
    with pytest.raises(ProtocolError):
        TopKCodec(0.5).decode({"w#idx": torch.tensor([1], dtype=torch.int32), "w#val": torch.tensor([1e6])}, like)
    wide = {"w": torch.zeros(2, dtype=torch.float64)}  # float64 holds it, but int8 decodes through float32
    with pytest.raises(ProtocolError):
        Int8Codec().decode({"w": torch.tensor([127, 1], dtype=torch.int8), "w#scale": torch.tensor(1e37)}, wide)


def test_int8_saturates_magnitudes_float32_cannot_carry() -> None:
    x = {"w": torch.tensor([1e300, -1.0, 0.0], dtype=torch.float64), "v": torch.tensor([3.4e38, -3.4e38])}
    out = Int8Codec().decode(through_wire(Int8Codec().encode(x)), like=x)
    assert out["w"][0] == pytest.approx(torch.finfo(torch.float32).max / 2, rel=1e-6)
    assert out["v"].tolist() == pytest.approx([1.7e38, -1.7e38], rel=1e-2)


_DTYPE = st.sampled_from(sorted(wire.DTYPES.values(), key=str))


@st.composite
def random_part(draw: st.DrawFn) -> torch.Tensor:
    """Any tensor the wire codec could deliver: any allowed dtype, small shape, arbitrary bytes."""
    dtype = draw(_DTYPE)
    shape = draw(st.lists(st.integers(0, 5), max_size=2))
    raw = draw(st.binary(min_size=math.prod(shape) * dtype.itemsize, max_size=math.prod(shape) * dtype.itemsize))
    t = torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(dtype) if raw else torch.empty(0, dtype=dtype)
    if dtype is torch.bool:
        t = t.view(torch.uint8) & 1 == 1  # the wire codec refuses other bool bytes
    return t.reshape(shape)


@settings(max_examples=150, deadline=None)
@given(st.sampled_from(SPECS), st.data())
def test_random_parts_give_protocol_error_or_the_right_shapes(spec: str, data: st.DataObject) -> None:
    codec, x, parts = valid(spec)
    keys = data.draw(st.lists(st.sampled_from([*parts, "w#idx", "w#val", "w#scale", "b"]), max_size=6, unique=True))
    for key in keys:
        parts[key] = data.draw(random_part())
    try:
        out = codec.decode(parts, like=x)
    except ProtocolError:
        return
    assert_like(out, x)


def test_encode_refuses_what_receivers_would_and_bad_local_input() -> None:
    for spec in SPECS:
        with pytest.raises(ProtocolError):
            get_codec(spec).encode({"w": torch.tensor([1.0, math.nan])})
        with pytest.raises(ConfigError):
            get_codec(spec).encode({"a#b": torch.zeros(2)})
        with pytest.raises(ConfigError):
            get_codec(spec).encode({"w": torch.zeros(2, dtype=torch.int64)})


# ---------------------------------------------------------------- choosing a codec


def test_get_codec_builds_each_named_codec() -> None:
    fixed = set(CODECS) - {"auto"}
    assert {get_codec(name).name for name in fixed} == fixed
    assert isinstance(get_codec("auto"), AutoCodec) and get_codec("auto").name == "none"  # its level at the start
    assert get_codec("topk") == TopKCodec(0.01)
    assert get_codec(" topk: ratio = 0.05 ") == TopKCodec(0.05)
    assert get_codec("int8:stochastic=1,seed=4") == Int8Codec(stochastic=True, seed=4)


@pytest.mark.parametrize(
    "spec,words",
    [
        ("zstd", "unknown codec 'zstd'"),
        ("", "unknown codec ''"),
        ("topk:ratio=0", "ratio must be in (0, 1]"),
        ("topk:ratio=1.5", "ratio must be in (0, 1]"),
        ("topk:ratio=-0.1", "ratio must be in (0, 1]"),
        ("topk:ratio=nan", "must be finite"),
        ("topk:ratio=lots", "must be a number"),
        ("topk:k=5", "takes ratio, not k"),
        ("topk:ratio=0.1,ratio=0.2", "given twice"),
        ("topk:", "not key=value"),
        ("fp16:ratio=0.1", "takes no parameters"),
        ("int8:stochastic=maybe", "must be a boolean"),
        ("int8:seed=x", "must be an integer"),
    ],
)
def test_get_codec_names_the_problem(spec: str, words: str) -> None:
    with pytest.raises(ConfigError, match="gossip.compression") as info:
        get_codec(spec, field="gossip.compression")
    assert words in str(info.value)


def test_topk_codec_checks_its_ratio() -> None:
    with pytest.raises(ConfigError, match="ratio"):
        TopKCodec(0.0)


# ---------------------------------------------------------------- error feedback


@st.composite
def streams(draw: st.DrawFn, bound: float = 100) -> list[Params]:
    """One to six parameter sets with one model's names and shapes: what a peer sends over time."""
    layout = draw(params())
    n = draw(st.integers(1, 6))
    return [{name: draw(tensors(bound, tuple(t.shape))) for name, t in layout.items()} for _ in range(n)]


@FAST
@given(streams(), st.sampled_from(["int8", "int8:stochastic=1", "topk:ratio=0.1", "fp16", "none"]))
def test_error_feedback_loses_nothing_in_the_sum(stream: list[Params], spec: str) -> None:
    layout = stream[0]
    codec, ef = get_codec(spec), ErrorFeedback(get_codec(spec))
    fed = {n: torch.zeros_like(t, dtype=torch.float64) for n, t in layout.items()}
    received = {n: torch.zeros_like(t, dtype=torch.float64) for n, t in layout.items()}
    for values in stream:
        decoded = codec.decode(through_wire(ef.encode(values)), like=values)
        for n in layout:
            fed[n] += values[n].double()
            received[n] += decoded[n].double()
    for n in layout:
        residual = ef.residual.get(n, torch.zeros_like(layout[n])).double()
        assert torch.allclose(received[n] + residual, fed[n], atol=1e-3 * len(stream), rtol=0)


def test_error_feedback_carries_what_topk_dropped() -> None:
    x = {"w": torch.tensor([4.0, -3.0, 2.0, 1.0])}  # (4,)
    ef = ErrorFeedback(TopKCodec(0.25))
    codec = TopKCodec(0.25)
    first = codec.decode(ef.encode(x), like=x)["w"]
    assert first.tolist() == [4.0, 0.0, 0.0, 0.0] and ef.residual["w"].tolist() == [0.0, -3.0, 2.0, 1.0]
    second = codec.decode(ef.encode(x), like=x)["w"]  # corrected = [4, -6, 4, 2]
    assert second.tolist() == [0.0, -6.0, 0.0, 0.0]
    with pytest.raises(ConfigError):
        ef.encode({"v": torch.zeros(4)})
    ef.reset()
    assert ef.residual == {} and codec.decode(ef.encode(x), like=x)["w"].tolist() == first.tolist()


def test_error_feedback_keeps_its_residual_when_encode_refuses() -> None:
    ef = ErrorFeedback(Int8Codec())
    ef.encode({"w": torch.tensor([1.0, 0.3])})
    before = ef.residual["w"].clone()
    with pytest.raises(ProtocolError):
        ef.encode({"w": torch.tensor([math.inf, 0.0])})
    assert torch.equal(ef.residual["w"], before)


# ---------------------------------------------------------------- edge references


@FAST
@given(streams(bound=10), st.sampled_from(SPECS))
def test_sender_and_receiver_references_stay_bit_identical(stream: list[Params], spec: str) -> None:
    start = {n: torch.ones_like(t) for n, t in stream[0].items()}
    sender, receiver = EdgeReference(start), EdgeReference(start)
    codec = get_codec(spec)
    for x in stream:
        estimate = receiver.receiver_apply(through_wire(sender.sender_encode(x, codec)), codec)
        for n in x:
            assert estimate[n] is receiver.reference[n]
            # Compared as bits: torch.equal would call -0.0 and 0.0 the same.
            assert torch.equal(receiver.reference[n].view(torch.int32), sender.reference[n].view(torch.int32))
    assert sender.updates == receiver.updates == len(stream)


def test_topk_estimate_converges_to_a_fixed_x() -> None:
    x = {"w": torch.randn(200, generator=torch.Generator().manual_seed(2))}  # (200,)
    codec = TopKCodec(0.05)  # 10 entries a send: 20 sends cover all 200
    sender, receiver = EdgeReference.zeros_like(x), EdgeReference.zeros_like(x)
    errors = []
    for _ in range(20):
        estimate = receiver.receiver_apply(sender.sender_encode(x, codec), codec)
        errors.append(float((estimate["w"] - x["w"]).norm()))
    assert all(b < a for a, b in itertools.pairwise(errors))
    assert errors[-1] == 0.0  # float32 values travel exactly


def test_topk_estimate_tracks_a_slowly_changing_x() -> None:
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(500, generator=gen)  # (500,)
    codec = TopKCodec(0.1)
    sender, receiver = EdgeReference.zeros_like({"w": x}), EdgeReference.zeros_like({"w": x})
    errors = []
    for _ in range(60):
        x = x + 0.001 * torch.randn(500, generator=gen)  # a small training step between sends
        estimate = receiver.receiver_apply(sender.sender_encode({"w": x}, codec), codec)
        errors.append(float((estimate["w"] - x).norm() / x.norm()))
    assert errors[0] > 0.5 and max(errors[-10:]) < 0.01


def test_receiver_reference_is_unchanged_by_a_refused_message() -> None:
    start = {"w": torch.full((3,), 3e38)}  # near float32's max: a large update overflows
    receiver = EdgeReference(start)
    codec = NoneCodec()
    with pytest.raises(ProtocolError):
        receiver.receiver_apply({"w": torch.full((3,), 3e38)}, codec)  # r + q = inf
    with pytest.raises(ProtocolError):
        receiver.receiver_apply({"w": torch.zeros(4)}, codec)
    assert torch.equal(receiver.reference["w"], start["w"]) and receiver.updates == 0
    with pytest.raises(ConfigError):
        receiver.sender_encode({"w": torch.zeros(4)}, codec)
    receiver.reset({"w": torch.zeros(3)})
    assert receiver.receiver_apply({"w": torch.ones(3)}, codec)["w"].tolist() == [1.0, 1.0, 1.0]


@settings(max_examples=200, deadline=None)
@given(
    dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.bool]),
    shape=st.sampled_from([(), (0,), (1,), (7,), (3, 5)]),
    poison=st.sampled_from([None, math.nan, math.inf, -math.inf]),
    where=st.integers(0, 100),
    seed=st.integers(0, 1000),
    extreme=st.booleans(),
)
def test_the_fast_finiteness_check_agrees_with_torch(
    dtype: torch.dtype, shape: tuple[int, ...], poison: float | None, where: int, seed: int, extreme: bool
) -> None:
    g = torch.Generator().manual_seed(seed)
    t = (torch.randn(shape, generator=g, dtype=torch.float64) * 1e4).to(dtype)
    if extreme and t.is_floating_point():  # the largest finite values, all one sign: a float32 sum would overflow
        t = torch.full(shape, torch.finfo(dtype).max, dtype=dtype)
    if poison is not None and t.numel() and t.is_floating_point():
        t.view(-1)[where % t.numel()] = poison
    assert all_finite(t) == bool(torch.isfinite(t).all())


@settings(max_examples=200, deadline=None)
@given(
    dtypes=st.lists(st.sampled_from([torch.float32, torch.float16, torch.bfloat16, torch.float64]), min_size=0, max_size=6),
    poisons=st.lists(st.sampled_from([None, None, math.nan, math.inf, -math.inf]), min_size=6, max_size=6),
    extreme=st.lists(st.booleans(), min_size=6, max_size=6),
    seed=st.integers(0, 1000),
)
def test_the_check_of_many_tensors_at_once_names_the_first_non_finite_one(
    dtypes: list[torch.dtype], poisons: list[float | None], extreme: list[bool], seed: int
) -> None:
    """Exactly as one by one: a NaN or infinity anywhere is found, and the largest finite values (whose norms
    overflow) are not mistaken for one."""
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for i, dtype in enumerate(dtypes):
        t = torch.randn(3, 7, generator=g, dtype=torch.float64).to(dtype)
        if extreme[i]:
            t = torch.full((3, 7), torch.finfo(dtype).max, dtype=dtype)
        if poisons[i] is not None:
            t.view(-1)[seed % t.numel()] = poisons[i]
        tensors[f"t{i}"] = t
    want = next((n for n, t in tensors.items() if not bool(torch.isfinite(t).all())), None)
    assert first_non_finite(tensors) == want
