"""How a member's state travels: its bytes, their tensor table, and the manifest of a snapshot.

A state is tensors (the model's ``state_dict``, then any optimizer tensors)
flattened into one byte string, in order; its *table* lists each tensor's
name, dtype and shape, and its *layout* is a short hash of the table, which
donor and newcomer must agree on. A ``Snapshot`` is such bytes frozen at a
safe point with their ``Manifest``: size, chunking, the SHA-256 of every
chunk and of their list, the donor's step and samples seen, and the table.
Everything read from a peer is checked here (``Manifest.from_body``) before
it is used; tensor bytes are only ever viewed as one of the wire's plain
dtypes (``gossiptrain.net.dtypes.DTYPES``). See ``gossiptrain.protocol.state_transfer`` for
the protocol that moves them.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Sequence

import torch

from gossiptrain.errors import ProtocolError
from gossiptrain.net.dtypes import DTYPES, MAX_NAME_LEN, MAX_NDIM

_HEX64 = re.compile(r"[0-9a-f]{64}")
_MANIFEST_KEYS = ("size", "chunk_bytes", "layout", "step", "hashes", "digest")
_HASH_WIRE_BYTES = 67  # one hex SHA-256 in a msgpack header (str8 marker, length, 64 characters), rounded up
OPTIMIZER_PREFIX = "optimizer/"  # names of optimizer tensors in a stream; model state names never hold a "/"
_SCALAR_LIMIT = 1 << 63

#: One tensor of a stream: name, dtype (a wire name, e.g. "float32") and shape.
Entry = tuple[str, str, tuple[int, ...]]


# -- the state as bytes ------------------------------------------------------------------


def state_tensors(model: torch.nn.Module) -> list[torch.Tensor]:
    """What a newcomer downloads: the model's parameters and persistent buffers, in ``state_dict`` order.

    Buffers too (e.g. batch-norm statistics): a model with a trained body but
    initial statistics evaluates badly.
    """
    return list(model.state_dict(keep_vars=True).values())


def layout_of(model: torch.nn.Module) -> str:
    """A short hash of the state's names, dtypes and shapes: donor and newcomer must agree on it."""
    return table_layout(entries_of(model.state_dict(keep_vars=True).items()))


def entries_of(named: Iterable[tuple[str, torch.Tensor]]) -> tuple[Entry, ...]:
    """The (name, dtype, shape) table of named tensors, as a manifest lists them."""
    return tuple((n, str(t.dtype).removeprefix("torch."), tuple(t.shape)) for n, t in named)


def table_layout(entries: Sequence[Entry]) -> str:
    """A short hash of a tensor table (``layout_of`` for a model's state)."""
    rows = [[n, d, list(shape)] for n, d, shape in entries]
    return hashlib.sha256(json.dumps(rows, separators=(",", ":")).encode()).hexdigest()[:16]


def entry_nbytes(entry: Entry) -> int:
    _, dtype, shape = entry
    return math.prod(shape) * DTYPES[dtype].itemsize


def wire_table(entries: Sequence[Entry]) -> tuple[Entry, ...] | None:
    """``entries`` if every dtype can be named on the wire (else None: the manifest then lists no table)."""
    return tuple(entries) if all(d in DTYPES and len(n) <= MAX_NAME_LEN for n, d, _ in entries) else None


def first_difference(ours: Sequence[Entry], theirs: Sequence[Entry]) -> str:
    """The first entry in which two tensor tables differ, as a sentence."""
    mine, other = {e[0]: e for e in ours}, {e[0]: e for e in theirs}
    for name, (_, dtype, shape) in mine.items():
        if name not in other:
            return f"{name!r} is missing"
        _, their_dtype, their_shape = other[name]
        if (their_dtype, their_shape) != (dtype, shape):
            return f"{name!r} is {their_dtype}{list(their_shape)}, we expect {dtype}{list(shape)}"
    extra = [n for n in other if n not in mine]
    if extra:
        return f"{extra[0]!r} is not expected"
    return "the tensors come in another order"


def meta_like(entries: Sequence[Entry]) -> list[torch.Tensor]:
    """Meta tensors of the dtypes and shapes ``entries`` list: what ``decode_state`` needs of a table."""
    return [torch.empty(shape, dtype=DTYPES[dtype], device="meta") for _, dtype, shape in entries]


def tensors_from(entries: Sequence[Entry], data: torch.Tensor) -> dict[str, torch.Tensor] | str:
    """``data`` cut into the named tensors ``entries`` describe (copies), or why not (see ``decode_state``)."""
    values = decode_state(meta_like(entries), data)
    if isinstance(values, str):
        return values
    return {name: v for (name, _, _), v in zip(entries, values, strict=True)}


def state_nbytes(tensors: Sequence[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def flatten(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """One contiguous copy of ``tensors``' bytes, (total bytes,) uint8: the snapshot a donor serves."""
    parts = [t.detach().reshape(-1).view(torch.uint8).cpu() for t in tensors if t.numel()]
    return torch.cat(parts) if parts else torch.empty(0, dtype=torch.uint8)


def decode_state(like: Sequence[torch.Tensor], data: torch.Tensor) -> list[torch.Tensor] | str:
    """``data`` cut into tensors shaped as ``like``, or why it cannot be used (wrong size, non-finite values).

    ``like`` only gives dtypes and shapes (meta tensors will do).
    """
    if data.numel() != state_nbytes(like):
        return f"the state has {data.numel()} bytes, the model {state_nbytes(like)}"
    out: list[torch.Tensor] = []
    offset = 0
    for t in like:
        n = t.numel() * t.element_size()
        value = data[offset : offset + n].clone().view(t.dtype).reshape(t.shape)  # clone: aligned for the dtype
        if (value.is_floating_point() or value.is_complex()) and not bool(torch.isfinite(value).all()):
            return "the state holds non-finite values"
        if value.dtype == torch.bool and bool((value.view(torch.uint8) > 1).any()):
            return "the state holds bool bytes other than 0 and 1"  # undefined behaviour in torch kernels
        out.append(value)
        offset += n
    return out


def install(live: Sequence[torch.Tensor], values: Sequence[torch.Tensor]) -> None:
    """Write decoded values into the live tensors in place (an optimizer keeps its references)."""
    with torch.no_grad():
        for t, v in zip(live, values, strict=True):
            t.copy_(v)


def chunk_count(size: int, chunk_bytes: int) -> int:
    return max(1, -(-size // chunk_bytes))


def sha256_hex(data: torch.Tensor) -> str:
    return hashlib.sha256(memoryview(data.numpy())).hexdigest()


def hash_list_digest(hashes: Sequence[str]) -> str:
    """The SHA-256 over the chunk hashes in order: identifies the whole snapshot."""
    return hashlib.sha256("".join(hashes).encode("ascii")).hexdigest()


# -- manifest and snapshot ---------------------------------------------------------------


@dataclass(frozen=True)
class Manifest:
    """What a donor says about the snapshot a session is served from."""

    size: int  # bytes
    chunk_bytes: int
    layout: str  # table_layout(tensors): layout_of(model) when the stream is the model's state alone
    step: int  # the donor's step when it took the snapshot
    hashes: tuple[str, ...]  # SHA-256 of each chunk, hex
    digest: str  # hash_list_digest(hashes)
    tensors: tuple[Entry, ...] | None = None  # what the bytes hold, in order (None: a dtype the wire cannot name)
    samples: int = 0  # training samples the donor had seen (the weight of its state in a merged model)
    scalars: tuple[tuple[str, int | float], ...] = ()  # non-tensor optimizer state, "optimizer/<param>/<key>"

    def to_body(self) -> dict[str, Any]:
        body: dict[str, Any] = {
            "size": self.size, "chunk_bytes": self.chunk_bytes, "layout": self.layout, "step": self.step,
            "hashes": list(self.hashes), "digest": self.digest, "samples": self.samples,
        }
        if self.tensors is not None:
            body["tensors"] = [[n, d, list(shape)] for n, d, shape in self.tensors]
        if self.scalars:
            body["scalars"] = [[n, v] for n, v in self.scalars]
        return body

    def header_bytes(self) -> int:
        """A generous bound on the header bytes this manifest takes in a message."""
        table = sum(len(n) + len(d) + 9 * len(shape) + 8 for n, d, shape in self.tensors or ())
        return len(self.hashes) * _HASH_WIRE_BYTES + table + sum(len(n) + 16 for n, _ in self.scalars) + 4096

    def entries(self) -> int:
        """Containers' longest length in the manifest (the hashes, the table or the scalars)."""
        return max(len(self.hashes), len(self.tensors or ()), len(self.scalars))

    @classmethod
    def from_body(cls, body: Mapping[str, Any]) -> "Manifest":
        """The manifest in an srep body; ProtocolError if any field is malformed."""
        size, chunk, layout, step, hashes, digest = (body.get(k) for k in _MANIFEST_KEYS)
        if type(size) is not int or size < 0 or type(chunk) is not int or chunk < 1:
            raise ProtocolError("state manifest size and chunk_bytes must be ints >= 0 and >= 1")
        if not isinstance(layout, str) or len(layout) > 64 or type(step) is not int or step < 0:
            raise ProtocolError("state manifest layout must be a short str and step an int >= 0")
        if not isinstance(hashes, list) or len(hashes) != chunk_count(size, chunk):
            raise ProtocolError("state manifest must list one hash per chunk")
        if not all(isinstance(h, str) and _HEX64.fullmatch(h) for h in hashes):
            raise ProtocolError("state manifest hashes must be hex SHA-256 digests")
        if not isinstance(digest, str) or not _HEX64.fullmatch(digest):
            raise ProtocolError("state manifest digest must be a hex SHA-256 digest")
        samples = body.get("samples", 0)
        if type(samples) is not int or not 0 <= samples < _SCALAR_LIMIT:
            raise ProtocolError("state manifest samples must be an int >= 0")
        tensors = _table_from_body(body["tensors"], size, layout) if "tensors" in body else None
        scalars = _scalars_from_body(body.get("scalars", []))
        return cls(size, chunk, layout, step, tuple(hashes), digest, tensors, samples, scalars)


def _table_from_body(raw: Any, size: int, layout: str) -> tuple[Entry, ...]:
    """A manifest's tensor table, checked: well formed, unique names, adding up to ``size``, hashing to ``layout``."""
    if not isinstance(raw, list):
        raise ProtocolError("state manifest tensors must be a list")
    out: list[Entry] = []
    total = 0
    for e in raw:
        if not isinstance(e, list) or len(e) != 3:
            raise ProtocolError("a state manifest tensor must be [name, dtype, shape]")
        name, dtype, shape = e
        if not isinstance(name, str) or not 0 < len(name) <= MAX_NAME_LEN or dtype not in DTYPES:
            raise ProtocolError("a state manifest tensor needs a name and a known dtype")
        if not isinstance(shape, list) or len(shape) > MAX_NDIM or not all(type(d) is int and 0 <= d <= size for d in shape):
            raise ProtocolError(f"state manifest tensor {name[:80]!r} has a bad shape")
        entry = (name, dtype, tuple(shape))
        total += entry_nbytes(entry)
        if total > size:
            raise ProtocolError("state manifest tensors hold more bytes than the state")
        out.append(entry)
    if total != size:
        raise ProtocolError(f"state manifest tensors hold {total} bytes, the state {size}")
    if len({n for n, _, _ in out}) != len(out):
        raise ProtocolError("state manifest names a tensor twice")
    if table_layout(out) != layout:
        raise ProtocolError("state manifest tensors do not match its layout")
    return tuple(out)


def _scalars_from_body(raw: Any) -> tuple[tuple[str, int | float], ...]:
    if not isinstance(raw, list):
        raise ProtocolError("state manifest scalars must be a list")
    out: list[tuple[str, int | float]] = []
    for e in raw:
        if not isinstance(e, list) or len(e) != 2 or not isinstance(e[0], str) or not e[0].startswith(OPTIMIZER_PREFIX):
            raise ProtocolError("a state manifest scalar must be [optimizer/<param>/<key>, number]")
        value = e[1]
        ok = (type(value) is int and -_SCALAR_LIMIT <= value < _SCALAR_LIMIT) or (type(value) is float and math.isfinite(value))
        if not ok or len(e[0]) > MAX_NAME_LEN:
            raise ProtocolError(f"state manifest scalar {e[0][:80]!r} must be a finite int or float")
        out.append((e[0], value))
    if len({n for n, _ in out}) != len(out):
        raise ProtocolError("state manifest names a scalar twice")
    return tuple(out)


@dataclass(frozen=True, eq=False)
class Snapshot:
    """A donor's state at one safe point, never written after it was taken, with its manifest."""

    data: torch.Tensor  # (size,) uint8
    manifest: Manifest

    @classmethod
    def build(
        cls,
        data: torch.Tensor,
        *,
        step: int,
        layout: str,
        chunk_bytes: int,
        tensors: tuple[Entry, ...] | None = None,
        samples: int = 0,
        scalars: tuple[tuple[str, int | float], ...] = (),
    ) -> "Snapshot":
        """Hash ``data`` chunk by chunk (one pass; hashlib releases the GIL, so this may run in a worker thread)."""
        view = memoryview(data.numpy())
        size = data.numel()
        hashes = tuple(
            hashlib.sha256(view[i * chunk_bytes : (i + 1) * chunk_bytes]).hexdigest()
            for i in range(chunk_count(size, chunk_bytes))
        )
        manifest = Manifest(size, chunk_bytes, layout, step, hashes, hash_list_digest(hashes), tensors, samples, scalars)
        return cls(data, manifest)

    def chunk(self, index: int) -> torch.Tensor:
        c = self.manifest.chunk_bytes
        return self.data[index * c : (index + 1) * c]
