"""Compression of what peers send: codecs, error feedback, and per-edge references.

Parameter exchanges dominate a peer's traffic, so averaging may send them
compressed. A codec turns dense float tensors into wire tensors (fewer bytes)
and back. Decoding happens on untrusted input, so ``decode`` checks every
part against the receiver's own parameters and raises ``ProtocolError`` for
anything else: a receiver never crashes and never gets a tensor of the wrong
name, shape, dtype or a non-finite value from a hostile or buggy peer.

Lossy codecs alone bias gossip (what top-k drops is lost for good). Two
standard remedies are here, both pure state, no networking:

- ``ErrorFeedback`` (EF-SGD): carry what compression dropped into the next
  message, so that nothing is lost in the sum over a stream of sends.
- ``EdgeReference`` (CHOCO-SGD, Koloskova et al. 2019): sender and receiver
  of a directed edge keep an identical estimate ``r`` of the sender's
  parameters and send only ``C(x - r)``; the estimate converges to ``x``.

Wire names are the parameter names plus a suffix after ``#`` ("w",
"w#scale", "w#idx", "w#val"); ``#`` never occurs in torch parameter names,
and names containing it are refused so that wire names cannot collide.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from fractions import Fraction
from typing import ClassVar, Protocol

import torch
from torch import Tensor

from gossiptrain.codec_spec import parse_codec_spec
from gossiptrain.errors import ConfigError, ProtocolError
from gossiptrain.state.host_buffers import BufferPool

#: Codec names ``get_codec`` knows.

SEP = "#"  # between a parameter name and a part suffix in wire names
_INT32_MAX = (1 << 31) - 1
_INT8_SATURATE = torch.finfo(torch.float32).max / 2  # int8 magnitudes beyond this are clamped


class Codec(Protocol):
    """Turns dense float tensors into wire tensors and back."""

    @property
    def name(self) -> str: ...

    def encode(self, values: Mapping[str, Tensor], *, pool: BufferPool | None = None) -> dict[str, Tensor]:
        """Wire tensors for ``values`` (dtypes from wire.DTYPES); ProtocolError if decode would refuse them.

        ``pool``: where new tensors come from (reused once dropped); None: fresh ones.
        """
        ...

    def decode(
        self, wire: Mapping[str, Tensor], like: Mapping[str, Tensor], *, pool: BufferPool | None = None
    ) -> dict[str, Tensor]:
        """Dense tensors with exactly the names, shapes, dtypes and devices of ``like``; else ProtocolError."""
        ...


# ---------------------------------------------------------------- per-tensor codecs


class _PerTensorCodec:
    """Shared checking and naming for codecs that compress each tensor on its own."""

    name: ClassVar[str]
    suffixes: ClassVar[tuple[str, ...]]  # wire name of part i is name + suffixes[i]

    def encode(self, values: Mapping[str, Tensor], *, pool: BufferPool | None = None) -> dict[str, Tensor]:
        out: dict[str, Tensor] = {}
        with torch.no_grad():
            for name, value in values.items():
                _check_local(name, value, "values")
            # Checked here so that a sender learns what receivers would refuse, and so that
            # error feedback and references never absorb a NaN.
            bad = first_non_finite(values)
            if bad is not None:
                raise ProtocolError(f"{_show(bad)} has non-finite values, which receivers refuse")
            for name, value in values.items():
                for suffix, part in zip(self.suffixes, self._encode_one(value.detach(), pool), strict=True):
                    out[name + suffix] = part
        return out

    def decode(
        self, wire: Mapping[str, Tensor], like: Mapping[str, Tensor], *, pool: BufferPool | None = None
    ) -> dict[str, Tensor]:
        if not isinstance(wire, Mapping):
            raise ProtocolError(f"wire tensors must be a mapping, got {type(wire).__name__}")
        expected: list[str] = []
        for name, ref in like.items():
            _check_local(name, ref, "like")
            expected.extend(name + s for s in self.suffixes)
        _check_names(wire, expected)
        out: dict[str, Tensor] = {}
        with torch.no_grad():
            for name, ref in like.items():
                parts = [_tensor(wire, name + s) for s in self.suffixes]
                out[name] = self._decode_one(name, parts, ref, pool)
            _all_finite(out)  # what came, decoded: a finite int8 scale can still overflow like's dtype
        return out

    def _encode_one(self, x: Tensor, pool: BufferPool | None) -> Sequence[Tensor]:
        raise NotImplementedError

    def _decode_one(self, name: str, parts: Sequence[Tensor], like: Tensor, pool: BufferPool | None) -> Tensor:
        """Part ``name`` decoded (its finiteness is checked by ``decode``, for all tensors at once)."""
        raise NotImplementedError


@dataclass(frozen=True)
class NoneCodec(_PerTensorCodec):
    """Identity: tensors travel as they are. No copies: encode returns detached views, decode the wire tensors."""

    name: ClassVar[str] = "none"
    suffixes: ClassVar[tuple[str, ...]] = ("",)

    def _encode_one(self, x: Tensor, pool: BufferPool | None) -> Sequence[Tensor]:
        return (x,)

    def _decode_one(self, name: str, parts: Sequence[Tensor], like: Tensor, pool: BufferPool | None) -> Tensor:
        (t,) = parts
        _expect(name, t, like.dtype, tuple(like.shape))
        return t.to(like.device)


class _CastCodec(_PerTensorCodec):
    """Sends each tensor cast to a narrower float dtype; decode casts back to ``like``'s."""

    dtype: ClassVar[torch.dtype]
    suffixes: ClassVar[tuple[str, ...]] = ("",)

    def _encode_one(self, x: Tensor, pool: BufferPool | None) -> Sequence[Tensor]:
        # Saturate rather than overflow: an inf would be refused by every receiver.
        top = torch.finfo(self.dtype).max
        out = _empty(pool, x.shape, self.dtype, x.device)  # (*shape)
        if x.dtype == self.dtype:
            return (torch.clamp(x, -top, top, out=out),)
        return (out.copy_(torch.clamp(x, -top, top, out=_empty(pool, x.shape, x.dtype, x.device))),)

    def _decode_one(self, name: str, parts: Sequence[Tensor], like: Tensor, pool: BufferPool | None) -> Tensor:
        (t,) = parts
        _expect(name, t, self.dtype, tuple(like.shape))
        return _empty(pool, like.shape, like.dtype, like.device).copy_(t)


@dataclass(frozen=True)
class Fp16Codec(_CastCodec):
    """IEEE half: 11 significant bits, saturates at +-65504."""

    name: ClassVar[str] = "fp16"
    dtype: ClassVar[torch.dtype] = torch.float16


@dataclass(frozen=True)
class Bf16Codec(_CastCodec):
    """bfloat16: float32's range with 8 significant bits."""

    name: ClassVar[str] = "bf16"
    dtype: ClassVar[torch.dtype] = torch.bfloat16


@dataclass(frozen=True)
class Int8Codec(_PerTensorCodec):
    """Symmetric per-tensor int8: values ``round(x / scale)`` with ``scale = absmax / 127`` (float32, 0-d).

    Round-to-nearest errs by at most ``scale / 2`` per element. Stochastic
    rounding (``floor(x / scale + u)``) errs by less than ``scale`` but is
    unbiased, which matters when the same small values are sent many times.
    """

    stochastic: bool = False
    seed: int = 0  # stochastic rounding draws from a generator seeded with this
    _generators: dict[torch.device, torch.Generator] = field(
        default_factory=dict, init=False, repr=False, compare=False
    )

    name: ClassVar[str] = "int8"
    suffixes: ClassVar[tuple[str, ...]] = ("", SEP + "scale")

    def _encode_one(self, x: Tensor, pool: BufferPool | None) -> Sequence[Tensor]:
        # Temporaries come from the pool too; each line computes what ``round(x.float() / scale)`` would, bit for bit.
        if x.numel():
            low, high = torch.aminmax(x)  # no |x| tensor; encode checked x finite, so max(-low, high) is |x|'s max
            absmax = max(-float(low), float(high))  # in x's dtype: float64 may exceed float32
        else:
            absmax = 0.0
        if absmax > _INT8_SATURATE:
            # Saturate absurd magnitudes so that scale * 127 stays finite in float32 at the receiver.
            x, absmax = x.clamp(-_INT8_SATURATE, _INT8_SATURATE), _INT8_SATURATE
        scale = torch.tensor(absmax, dtype=torch.float32, device=x.device) / 127  # 0-d
        q = _empty(pool, x.shape, torch.int8, x.device)  # (*shape)
        if float(scale) == 0.0:  # all zeros, or an absmax so tiny that scale underflows
            return q.zero_(), torch.zeros((), dtype=torch.float32, device=x.device)
        y = _empty(pool, x.shape, torch.float32, x.device)  # (*shape), in [-127, 127] up to rounding
        if x.dtype == torch.float32:
            torch.div(x, scale, out=y)
        else:
            y.copy_(x).div_(scale)
        if self.stochastic:
            u = torch.rand(y.shape, generator=self._generator(y.device), out=_empty(pool, y.shape, torch.float32, y.device))
            y.add_(u).floor_()
        else:
            y.round_()
        return q.copy_(y.clamp_(-127, 127)), scale

    def _decode_one(self, name: str, parts: Sequence[Tensor], like: Tensor, pool: BufferPool | None) -> Tensor:
        q, scale_t = parts
        _expect(name + SEP + "scale", scale_t, torch.float32, ())
        _expect(name, q, torch.int8, tuple(like.shape))
        scale = float(scale_t)
        if not math.isfinite(scale) or scale < 0:
            raise ProtocolError(f"{_show(name)}: scale {scale} is not a finite number >= 0")
        if q.numel() and int(q.min()) == -128:
            raise ProtocolError(f"{_show(name)}: -128 is outside the symmetric int8 range")
        out = _empty(pool, like.shape, torch.float32, like.device)  # (*shape)
        torch.mul(q.to(like.device), scale_t.to(like.device), out=out)  # q as float32, times scale
        if like.dtype != torch.float32:
            out = _empty(pool, like.shape, like.dtype, like.device).copy_(out)
        return out

    def _generator(self, device: torch.device) -> torch.Generator:
        gen = self._generators.get(device)
        if gen is None:
            gen = self._generators[device] = torch.Generator(device=device)
            gen.manual_seed(self.seed)
        return gen


@dataclass(frozen=True)
class TopKCodec(_PerTensorCodec):
    """Keeps the ``k = max(1, ceil(ratio * numel))`` largest-magnitude entries of each tensor.

    Wire: "name#idx" (flat indices, strictly increasing, int32 or int64 when
    numel needs it) and "name#val" (float32). Decode scatters into zeros.
    Increasing indices make the duplicate check one comparison per entry.
    """

    ratio: float = 0.01

    name: ClassVar[str] = "topk"
    suffixes: ClassVar[tuple[str, ...]] = (SEP + "idx", SEP + "val")

    def __post_init__(self) -> None:
        if not (isinstance(self.ratio, (int, float)) and 0 < self.ratio <= 1):
            raise ConfigError(f"topk ratio must be in (0, 1], got {self.ratio!r}")

    def k(self, numel: int) -> int:
        """Entries kept of a tensor with ``numel`` entries."""
        if numel == 0:
            return 0
        # The ratio as the decimal the user wrote (0.07, not 0.0700000000000000067), so 0.07 of 100 is 7.
        return min(numel, max(1, math.ceil(Fraction(repr(float(self.ratio))) * numel)))

    @staticmethod
    def index_dtype(numel: int) -> torch.dtype:
        """int32 indices where they suffice (half the bytes), int64 beyond."""
        return torch.int32 if numel <= _INT32_MAX else torch.int64

    def _encode_one(self, x: Tensor, pool: BufferPool | None) -> Sequence[Tensor]:
        flat = x.reshape(-1)  # (N,)
        k = self.k(flat.numel())
        if k == flat.numel():
            idx = torch.arange(k, device=x.device)  # (k,)
        else:
            idx = torch.topk(flat.abs(), k, sorted=False).indices.sort().values  # (k,)
        return idx.to(self.index_dtype(flat.numel())), flat[idx].to(torch.float32)

    def _decode_one(self, name: str, parts: Sequence[Tensor], like: Tensor, pool: BufferPool | None) -> Tensor:
        idx, val = parts
        n = like.numel()
        k = self.k(n)
        _expect(name + SEP + "idx", idx, self.index_dtype(n), (k,))
        _expect(name + SEP + "val", val, torch.float32, (k,))
        out = torch.zeros(n, dtype=like.dtype, device=like.device)  # (N,)
        if k == 0:
            return out.reshape(like.shape)
        i = idx.to(like.device, torch.int64)  # (k,)
        # First in range, last in range and strictly increasing: all in range, none twice.
        if int(i[0]) < 0 or int(i[-1]) >= n or (k > 1 and not bool((i[1:] > i[:-1]).all())):
            raise ProtocolError(f"{_show(name)}: indices must be strictly increasing within [0, {n})")
        out[i] = val.to(like.device, like.dtype)
        return out.reshape(like.shape)


# ---------------------------------------------------------------- auto: the level the link calls for

#: What ``compression = "auto"`` chooses from, the most faithful first (``gossiptrain.protocol.auto_compression``).
AUTO_LEVELS: tuple[str, ...] = ("none", "fp16", "int8")


class AutoCodec:
    """``auto``: encodes at the level its policy chose (``level``), decodes what a peer sent at any level.

    Each peer changes level as its own links change, so a receiver cannot know
    the sender's: it reads it off the wire (int8 parts carry a ``#scale``, fp16
    tensors are half precision; anything else must be the plain tensors), and
    that level's decode checks everything else as always.
    """

    def __init__(self) -> None:
        self.codecs: tuple[Codec, ...] = (NoneCodec(), Fp16Codec(), Int8Codec())
        assert tuple(c.name for c in self.codecs) == AUTO_LEVELS
        self.level = 0

    @property
    def name(self) -> str:
        return self.codecs[self.level].name

    def encode(self, values: Mapping[str, Tensor], *, pool: BufferPool | None = None) -> dict[str, Tensor]:
        return self.codecs[self.level].encode(values, pool=pool)

    def decode(
        self, wire: Mapping[str, Tensor], like: Mapping[str, Tensor], *, pool: BufferPool | None = None
    ) -> dict[str, Tensor]:
        return self.codecs[self.level_of(wire)].decode(wire, like, pool=pool)

    @staticmethod
    def level_of(wire: Mapping[str, Tensor]) -> int:
        """The level a message was encoded at, read off its tensors (unchecked: decode checks the rest)."""
        if any(isinstance(k, str) and k.endswith(SEP + "scale") for k in wire):
            return 2
        if any(isinstance(t, Tensor) and t.dtype == torch.float16 for t in wire.values()):
            return 1
        return 0

    @staticmethod
    def element_bytes(level: int, dtype: torch.dtype) -> int:
        """Bytes one parameter element of ``dtype`` takes on the wire at ``level`` (int8's scales aside)."""
        return (torch.empty((), dtype=dtype).element_size(), 2, 1)[level]


# ---------------------------------------------------------------- choosing a codec


def get_codec(spec: str, field: str = "compression") -> Codec:
    """The codec a spec names: "auto", "none", "fp16", "bf16", "int8[:stochastic=1,seed=N]", "topk[:ratio=R]".

    ``field`` is the config field the spec came from; ConfigError messages name it.
    The spec is parsed and checked by ``gossiptrain.codec_spec`` (which the config uses too).
    """
    parsed = parse_codec_spec(spec, field)
    if parsed.name == "auto":
        return AutoCodec()
    if parsed.name == "none":
        return NoneCodec()
    if parsed.name in ("fp16", "bf16"):
        return Fp16Codec() if parsed.name == "fp16" else Bf16Codec()
    if parsed.name == "int8":
        return Int8Codec(stochastic=bool(parsed.params["stochastic"]), seed=int(parsed.params["seed"]))
    return TopKCodec(float(parsed.params["ratio"]))


# ---------------------------------------------------------------- error feedback


class ErrorFeedback:
    """EF-SGD on a stream of sends: what compression drops now is added to the next send.

    Invariant (up to float rounding): the sum of everything receivers decoded
    plus ``residual`` equals the sum of everything fed to ``encode``. It
    assumes every returned message is delivered; call ``reset`` otherwise.
    """

    def __init__(self, codec: Codec) -> None:
        self.codec = codec
        self.residual: dict[str, Tensor] = {}  # empty: zero for every name

    def encode(self, values: Mapping[str, Tensor]) -> dict[str, Tensor]:
        """Wire tensors for ``values`` plus the residual; the residual becomes what this send dropped."""
        for name, value in values.items():
            _check_local(name, value, "values")
        if self.residual:
            _check_same_layout(values, self.residual, "values", "the residual (call reset() to change them)")
        with torch.no_grad():
            corrected = {
                n: v.detach() + self.residual[n] if self.residual else v.detach().clone() for n, v in values.items()
            }
            wire = self.codec.encode(corrected)  # raises before any state changes
            sent = self.codec.decode(wire, like=corrected)
            self.residual = {n: corrected[n] - sent[n] for n in corrected}
        return wire

    def reset(self) -> None:
        """Forget the residual (after a lost message, or when the parameter set changes)."""
        self.residual = {}


# ---------------------------------------------------------------- per-edge references


class EdgeReference:
    """One directed edge's shared estimate ``r`` of the sender's parameters (CHOCO-SGD).

    The sender sends ``q = C(x - r)`` and both ends add ``decode(q)`` to their
    copy of ``r``; fed the same messages from the same start, the two copies
    stay bit-identical. Nothing here notices a lost or refused message, which
    would leave the copies apart: the driver numbers messages (``updates``)
    and on a gap resets both ends to a state both know (e.g. a full send).
    """

    def __init__(self, start: Mapping[str, Tensor]) -> None:
        """Start from ``start`` (copied): both ends must pass the same, e.g. the shared initial model."""
        for name, t in start.items():
            _check_local(name, t, "start")
        self.reference: dict[str, Tensor] = {n: t.detach().clone() for n, t in start.items()}
        self.updates = 0  # messages applied; equal at both ends while they are in sync

    @classmethod
    def zeros_like(cls, params: Mapping[str, Tensor]) -> EdgeReference:
        """A reference starting at zero with the names, shapes and dtypes of ``params``."""
        return cls({n: torch.zeros_like(t) for n, t in params.items()})

    def sender_encode(self, x: Mapping[str, Tensor], codec: Codec) -> dict[str, Tensor]:
        """Wire tensors of ``C(x - r)``; ``r`` moves by what the receiver will decode."""
        _check_same_layout(x, self.reference, "x", "the reference")
        with torch.no_grad():
            diff = {n: x[n].detach() - r for n, r in self.reference.items()}
            wire = codec.encode(diff)
            self._commit(codec.decode(wire, like=self.reference))
        return wire

    def receiver_apply(self, wire: Mapping[str, Tensor], codec: Codec) -> dict[str, Tensor]:
        """Apply a received message; returns ``r``, the estimate of the sender's parameters.

        A malformed message raises ProtocolError and changes nothing. The
        returned tensors are never modified afterwards (each update makes new
        ones), but the caller must not modify them either.
        """
        with torch.no_grad():
            self._commit(codec.decode(wire, like=self.reference))
        return dict(self.reference)

    def reset(self, start: Mapping[str, Tensor]) -> None:
        """Start over from ``start`` (copied) at both ends, e.g. after a lost message."""
        _check_same_layout(start, self.reference, "start", "the reference")
        self.reference = {n: t.detach().clone() for n, t in start.items()}
        self.updates = 0

    def _commit(self, delta: Mapping[str, Tensor]) -> None:
        # New tensors, swapped in only when all are finite: a refused message leaves r as it was.
        new = {n: r + delta[n] for n, r in self.reference.items()}
        _all_finite(new)
        self.reference = new
        self.updates += 1


# ---------------------------------------------------------------- checks


def _empty(pool: BufferPool | None, shape: Sequence[int], dtype: torch.dtype, device: torch.device) -> Tensor:
    """An uninitialised tensor: from ``pool`` (reused once dropped), or a fresh one."""
    if pool is None:
        return torch.empty(tuple(shape), dtype=dtype, device=device)
    return pool.empty(shape, dtype, device)


def _check_local(name: object, t: object, what: str) -> None:
    """Refuse local inputs a codec cannot carry: a caller's bug, not a peer's, hence ConfigError."""
    if not isinstance(name, str) or SEP in name:
        raise ConfigError(f"{what}: parameter name {_show(name)} must be a str without {SEP!r}")
    if not isinstance(t, Tensor) or not t.is_floating_point():
        kind = t.dtype if isinstance(t, Tensor) else type(t).__name__
        raise ConfigError(f"{what}: {_show(name)} must be a floating-point tensor, got {kind}")


def _check_same_layout(values: Mapping[str, Tensor], ref: Mapping[str, Tensor], what: str, against: str) -> None:
    if list(values) != list(ref):
        raise ConfigError(f"{what} must have the same parameter names, in order, as {against}")
    for n, r in ref.items():
        v = values[n]
        if not isinstance(v, Tensor) or v.shape != r.shape or v.dtype != r.dtype:
            raise ConfigError(f"{what}: {_show(n)} must be a {r.dtype} tensor of shape {list(r.shape)} like {against}")


def _check_names(wire: Mapping[str, Tensor], expected: list[str]) -> None:
    got, want = set(wire), set(expected)
    if got != want:
        missing = sorted(want - got)[:3]
        extra = sorted(_show(k) for k in got - want)[:3]
        raise ProtocolError(f"wire tensor names wrong: missing {missing}, unexpected {extra}")


def _tensor(wire: Mapping[str, object], key: str) -> Tensor:
    t = wire[key]
    if not isinstance(t, Tensor) or t.layout is not torch.strided or t.device.type == "meta":
        raise ProtocolError(f"wire part {_show(key)} is not a dense tensor")
    return t


def _expect(key: str, t: Tensor, dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    if t.dtype != dtype or tuple(t.shape) != shape:
        raise ProtocolError(f"wire part {_show(key)} is {t.dtype} {list(t.shape)}, want {dtype} {list(shape)}")


#: Up to this many elements ``all_finite`` sums in float64 instead of taking extremes (see there).
SMALL_SUM = 1 << 16


def all_finite(t: Tensor) -> bool:
    """No NaN or infinity in ``t``, exactly, in one reduction.

    ``torch.isfinite(t).all()`` makes several passes and a bool tensor: on a
    1M-element float32 tensor it takes ~4.6 ms against ~0.4 ms here, and every
    exchange checks every tensor twice (sent and received). ``aminmax``
    propagates NaN, and a tensor is finite exactly when its extremes are.
    """
    if not t.is_floating_point() or t.numel() == 0:
        return True  # integers and booleans are always finite
    if t.numel() <= SMALL_SUM and t.dtype in (torch.float32, torch.float16, torch.bfloat16):
        # One reduction and one read: a float64 sum of up to SMALL_SUM values each below 3.4e38 cannot
        # overflow, and NaN or infinity anywhere makes it non-finite. About 4x faster on small tensors,
        # slower than aminmax on large ones (it converts as it sums).
        return math.isfinite(t.sum(dtype=torch.float64).item())
    low, high = torch.aminmax(t)
    return bool(torch.isfinite(low)) and bool(torch.isfinite(high))


#: From this many tensors ``first_non_finite`` checks them all at once (below, one by one is as fast: 2 us more
#: for a 2-tensor model, in the simulator's million exchanges).
FOREACH_FROM = 4


def first_non_finite(tensors: Mapping[str, Tensor]) -> str | None:
    """The name of the first tensor holding a NaN or an infinity; None if there is none. Exact.

    Checking tensor by tensor costs a few torch calls each: for a
    transformer's 114 tensors, 1.3 ms per check and four checks per
    exchange. One norm per tensor in a single foreach call, summed, is
    finite only if every value is (NaN and infinity carry through squares
    and sums), so that answers for all at once; only where it is not
    (a NaN, or a finite model so large that its norm overflows) are the
    tensors checked one by one, to tell which.
    """
    floats = {name: t for name, t in tensors.items() if t.is_floating_point() and t.numel()}
    if len(floats) >= FOREACH_FROM and _norms_finite(list(floats.values())):
        return None
    return next((name for name, t in floats.items() if not all_finite(t)), None)


def _norms_finite(tensors: Sequence[Tensor]) -> bool:
    """True only if all ``tensors`` are finite (False also where a finite tensor's norm overflows)."""
    groups: dict[tuple[torch.dtype, torch.device], list[Tensor]] = {}
    for t in tensors:
        groups.setdefault((t.dtype, t.device), []).append(t.detach())
    for group in groups.values():
        norms = torch._foreach_norm(group, 2)  # one 0-d tensor per tensor of the group
        if not math.isfinite(torch.stack(norms).sum().item()):
            return False
    return True


def _all_finite(tensors: Mapping[str, Tensor]) -> None:
    """ProtocolError naming the first of ``tensors`` that holds a NaN or an infinity."""
    bad = first_non_finite(tensors)
    if bad is not None:
        raise ProtocolError(f"{_show(bad)}: non-finite values")


def _show(x: object) -> str:
    """A short rendering of a possibly hostile name for error messages."""
    text = repr(x) if isinstance(x, str) else f"<{type(x).__name__}>"
    return text if len(text) <= 80 else text[:77] + "..."
