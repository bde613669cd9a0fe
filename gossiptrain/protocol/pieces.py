"""A peer's model as pieces, one per rank of its group: what each rank owns, averages and saves (issue 48).

A peer of several workers holds its model in one of three layouts:

- ``whole``: every rank holds the whole model (one worker, or DDP): the
  group's rank 0 owns the one piece, which is the model;
- ``fsdp``: FSDP2 (``torch.distributed.fsdp.fully_shard``) cut every
  parameter into one shard per rank, along one dimension: rank r's piece is
  its shard of every parameter (``DTensor.to_local()``);
- ``pipeline``: a pipeline (``torch.distributed.pipelining``) gave each rank
  a stage: rank r's piece is its stage module's parameters.

A piece is read and written through the rank's own local tensors, never
gathered: averaging a piece in place averages that part of the model.
``PieceLayout`` says what every rank holds (names, dtypes, local shapes and
the dimension a parameter is sharded along); two peers can average piece by
piece only if their layouts are equal, so the layout is what a joiner is
checked against (``mismatch`` names both). ``gather`` puts the pieces of all
ranks back into one ordinary state_dict, as a user loads it into the unsplit
model (``gossiptrain export``, the merged model).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import torch
from torch import Tensor

from gossiptrain.errors import ProtocolError
from gossiptrain.protocol.param_spec import ParamSpec
from gossiptrain.state.local_tensors import is_dtensor, local

KINDS: tuple[str, ...] = ("whole", "fsdp", "pipeline")
#: The shard dimension of a tensor a rank holds whole (not sharded).
WHOLE = -1


@dataclass(frozen=True)
class PieceEntry:
    """One tensor of a rank's piece: its name in the unsplit model, dtype, this rank's local shape, and the
    dimension it is sharded along (``WHOLE``: the rank holds all of it)."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    shard_dim: int = WHOLE

    def to_wire(self) -> list[Any]:
        return [self.name, self.dtype, list(self.shape), self.shard_dim]


@dataclass(frozen=True)
class PieceLayout:
    """What each rank of a peer holds (see the module docstring); equal layouts average piece by piece."""

    kind: str
    pieces: tuple[tuple[PieceEntry, ...], ...]  # one per rank that owns a piece, in rank order (whole: rank 0's only)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"a piece layout is one of {', '.join(KINDS)}, not {self.kind!r}")
        if not self.pieces or (self.kind == "whole" and len(self.pieces) != 1):
            raise ValueError("a piece layout holds one piece per rank that owns one (whole: exactly one, rank 0's): "
                             f"{len(self.pieces)} given")

    @classmethod
    def of_ranks(cls, pieces: tuple[tuple[PieceEntry, ...], ...]) -> PieceLayout:
        """The layout of a group whose rank r holds ``pieces[r]``: ``fsdp`` where any tensor is sharded,
        ``pipeline`` where the ranks hold different tensors, else ``whole`` (every rank the model: rank 0 owns it)."""
        if any(e.shard_dim != WHOLE for piece in pieces for e in piece):
            return cls("fsdp", pieces)
        if any(piece != pieces[0] for piece in pieces):
            return cls("pipeline", pieces)
        return cls("whole", pieces[:1])

    @property
    def ranks(self) -> int:
        return len(self.pieces)

    def describe(self) -> str:
        """One line: the kind, the ranks and what each holds (values and tensors). A peer of one worker and a DDP
        group hold the same layout (``whole``: rank 0 owns the model, whatever the group's size)."""
        held = ", ".join(
            f"rank {r}: {len(p)} tensors, {sum(_numel(e.shape) for e in p):,} values" for r, p in enumerate(self.pieces)
        )
        if self.kind == "whole":
            return f"whole on one rank ({held})"
        return f"{self.kind} over {self.ranks} ranks ({held})"

    def mismatch(self, other: PieceLayout) -> str | None:
        """None if the layouts are equal, else a sentence that names both (this peer's first)."""
        if self == other:
            return None
        return f"this peer's model is split as {self.describe()}; the swarm's as {other.describe()}"

    def to_wire(self) -> dict[str, Any]:
        return {"kind": self.kind, "pieces": [[e.to_wire() for e in p] for p in self.pieces]}

    @classmethod
    def from_wire(cls, raw: Any, *, max_ranks: int = 4096, max_entries: int = 65_536) -> PieceLayout:
        """A layout a peer sent; ProtocolError where it is malformed or past the bounds."""
        if not isinstance(raw, dict) or raw.get("kind") not in KINDS or not isinstance(raw.get("pieces"), list):
            raise ProtocolError(f"a piece layout is a map of a kind ({', '.join(KINDS)}) and its pieces")
        pieces = raw["pieces"]
        if not 1 <= len(pieces) <= max_ranks or sum(len(p) if isinstance(p, list) else 0 for p in pieces) > max_entries \
                or (raw["kind"] == "whole" and len(pieces) != 1):
            raise ProtocolError(f"a piece layout holds 1..{max_ranks} pieces (whole: 1) of at most {max_entries} tensors")
        out = []
        for piece in pieces:
            if not isinstance(piece, list):
                raise ProtocolError("a piece is a list of tensors")
            entries = []
            for e in piece:
                if not (isinstance(e, list) and len(e) == 4 and type(e[0]) is str and type(e[1]) is str
                        and isinstance(e[2], list) and all(type(d) is int and d >= 0 for d in e[2])
                        and type(e[3]) is int and WHOLE <= e[3] < max(1, len(e[2]))):
                    raise ProtocolError("a piece's tensor is [name, dtype, local shape, shard dimension or -1]")
                entries.append(PieceEntry(e[0], e[1], tuple(e[2]), e[3]))
            out.append(tuple(entries))
        return cls(raw["kind"], tuple(out))


def split_spec(layout: PieceLayout) -> ParamSpec:
    """What a split peer joins with: the unsplit model's parameters (names, dtypes, shapes: FSDP shards put back
    together, every pipeline stage's), and the layout's line (its ``describe()`` and a digest of all of it, so that
    layouts equal in words but not in shapes still differ). A swarm's members must agree on both."""
    entries: list[tuple[str, str, tuple[int, ...]]] = []
    if layout.kind == "fsdp":
        for k, e in enumerate(layout.pieces[0]):
            shape = list(e.shape)
            if e.shard_dim != WHOLE:
                shape[e.shard_dim] = sum(layout.pieces[r][k].shape[e.shard_dim] for r in range(layout.ranks))
            entries.append((e.name, e.dtype, tuple(shape)))
    else:
        entries = [(e.name, e.dtype, e.shape) for piece in layout.pieces for e in piece]
    digest = hashlib.sha256(json.dumps(layout.to_wire(), sort_keys=True).encode()).hexdigest()[:12]
    return ParamSpec(tuple(entries), None if layout.kind == "whole" else f"{layout.describe()} [layout {digest}]")


def local_piece(model: torch.nn.Module) -> dict[str, Tensor]:
    """This rank's piece: each parameter's name and the tensor this rank holds of it (an FSDP2 shard's local
    tensor, or the parameter itself), in the model's order. Views: writing them writes the model."""
    out = {}
    for name, p in model.named_parameters():
        mine = local(p)
        out[name] = mine.data if isinstance(mine, torch.nn.Parameter) else mine
    return out


def piece_entries(model: torch.nn.Module, *, prefix: str = "") -> tuple[PieceEntry, ...]:
    """The entries of this rank's piece: names (``prefix`` + the module's own: a pipeline stage's parameters
    named as in the unsplit model), dtypes, local shapes and shard dimensions."""
    out = []
    for name, p in model.named_parameters():
        mine = local(p)
        out.append(PieceEntry(prefix + name, str(mine.dtype).removeprefix("torch."), tuple(mine.shape), _shard_dim(p)))
    return tuple(out)


def gather(layout: PieceLayout, pieces: Sequence[Mapping[str, Tensor]]) -> dict[str, Tensor]:
    """One ordinary state_dict of the unsplit model from every rank's piece (``pieces[r]``: rank r's tensors by
    the names of ``layout.pieces[r]``): shards concatenated along their dimension in rank order, whole tensors
    as they are. ValueError where a piece does not match the layout."""
    if len(pieces) != layout.ranks:
        raise ValueError(f"{len(pieces)} pieces for a layout of {layout.ranks} ranks")
    for r, (piece, entries) in enumerate(zip(pieces, layout.pieces)):
        for e in entries:
            t = piece.get(e.name)
            if t is None or tuple(t.shape) != e.shape or str(t.dtype).removeprefix("torch.") != e.dtype:
                got = "nothing" if t is None else f"{str(t.dtype).removeprefix('torch.')} {tuple(t.shape)}"
                raise ValueError(f"rank {r}'s piece holds {got} as {e.name!r}, its layout says {e.dtype} {e.shape}")
    out: dict[str, Tensor] = {}
    if layout.kind == "fsdp":
        for k, e in enumerate(layout.pieces[0]):
            parts = [pieces[r][layout.pieces[r][k].name] for r in range(layout.ranks)]
            out[e.name] = parts[0].detach().clone() if e.shard_dim == WHOLE else torch.cat(
                [p.detach() for p in parts], dim=e.shard_dim)
        return out
    for r, entries in enumerate(layout.pieces):  # whole: rank 0's; pipeline: each stage's own names
        for e in entries:
            if e.name in out:
                raise ValueError(f"{e.name!r} is in two ranks' pieces of a {layout.kind} layout")
            out[e.name] = pieces[r][e.name].detach().clone()
    return out


def _shard_dim(p: Tensor) -> int:
    """The dimension a DTensor is sharded along on a 1-D mesh (WHOLE if replicated or not a DTensor)."""
    if not is_dtensor(p):
        return WHOLE
    placements = getattr(p, "placements", ())
    if len(placements) != 1:
        raise ValueError(f"a parameter sharded over a mesh of {len(placements)} dimensions: FSDP inside a peer "
                         "shards over one dimension (HSDP's replicas are the swarm's peers)")
    dim = getattr(placements[0], "dim", None)
    return WHOLE if dim is None else int(dim)


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
