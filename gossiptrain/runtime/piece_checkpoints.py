"""Checkpoints of a peer whose model is split across its ranks: one directory per rank, one model out (issue 48).

Each rank writes its own piece with the ordinary ``Checkpointer`` into
``DIR/rank-<r>/`` (atomic, hashed, pruned, locked, as any checkpoint; the
tensors are the rank's local shard or stage, and its optimizer's state
for them), and records which rank of which layout it holds
(``piece_info``). Nothing is gathered to save, and no rank waits for
another's bytes.

The ranks save at the same safe points, but one may crash mid-save, so a
peer resumes from the newest step **every** rank has a good checkpoint of
(``resume``, a collective), and ``gather`` (``gossiptrain export
--checkpoint``) puts the pieces of that step back into one ordinary
state_dict, which loads into the unsplit model.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Mapping

import torch
from torch import Tensor

from gossiptrain.errors import CheckpointError
from gossiptrain.protocol.pieces import PieceEntry, PieceLayout, gather as gather_pieces
from gossiptrain.state import storage
from gossiptrain.state.checkpoint import Checkpoint, list_checkpoints, read_checkpoint, restore
from gossiptrain.runtime.peer_group import PeerGroup

_RANK_DIR = re.compile(r"^rank-(\d+)$")


def rank_directory(directory: str | Path | storage.URL, rank: int) -> storage.Location:
    """Where rank ``rank`` of a split peer keeps its checkpoints."""
    return storage.location(directory, "checkpoint directory") / f"rank-{rank}"


def piece_info(layout: PieceLayout, rank: int) -> dict[str, Any]:
    """What a rank's checkpoint records of its piece (``Checkpointer.save(piece=...)``, ``restore(piece=...)``)."""
    return {"rank": rank, "layout": layout.to_wire()}


def good_by_step(directory: str | Path | storage.URL) -> dict[int, Checkpoint]:
    """The intact checkpoints of one rank's directory, by step (a broken one is left out, as ``latest_good`` does)."""
    out: dict[int, Checkpoint] = {}
    for path in list_checkpoints(directory):
        try:
            ckpt = read_checkpoint(path)
        except CheckpointError:
            continue
        out.setdefault(ckpt.info.step, ckpt)  # newest first: the latest save of a step
    return out


def resume(
    group: PeerGroup,
    directory: str | Path | storage.URL,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None,
    layout: PieceLayout,
    *,
    fingerprint: str | None = None,
) -> int:
    """On every rank alike: restore the newest step every rank has a good checkpoint of; returns that step.
    CheckpointError (on every rank) where no step is common to all, naming what each rank holds."""
    mine = good_by_step(rank_directory(directory, group.rank))
    every = group.all_json(sorted(mine))
    common = set(every[0]).intersection(*map(set, every[1:]))
    if not common:
        held = "; ".join(f"rank {r}: steps {steps or 'none'}" for r, steps in enumerate(every))
        raise CheckpointError(f"no step every rank of this peer has a good checkpoint of in {directory} ({held})")
    step = max(common)
    restore(mine[step], model, optimizer, fingerprint=fingerprint, piece=piece_info(layout, group.rank))
    return step


def gather(directory: str | Path | storage.URL) -> tuple[dict[str, Tensor], Checkpoint]:
    """The unsplit model's state_dict from a split peer's checkpoint directory (every ``rank-<r>``'s piece of the
    newest step all of them hold), and rank 0's checkpoint (its step, run, samples). CheckpointError names what
    does not fit: a missing rank, no common step, layouts that differ."""
    root = storage.location(directory, "checkpoint directory")
    try:
        names = storage.list_names(root)
    except OSError as e:
        raise CheckpointError(f"cannot list {root}: {e.strerror or e}") from None
    ranks = sorted(int(m.group(1)) for n in names if (m := _RANK_DIR.match(n)))
    if not ranks:
        raise CheckpointError(f"{root} holds no rank-<r> directory: not the checkpoints of a split peer")
    if ranks != list(range(len(ranks))):
        raise CheckpointError(f"{root} holds the checkpoints of ranks {ranks}: a split peer's ranks are 0..n-1")
    held = [good_by_step(rank_directory(root, r)) for r in ranks]
    common = set(held[0]).intersection(*map(set, held[1:]))
    if not common:
        raise CheckpointError(f"no step every rank has a good checkpoint of in {root} "
                              f"({'; '.join(f'rank {r}: {sorted(h) or None}' for r, h in enumerate(held))})")
    step = max(common)
    ckpts = [h[step] for h in held]
    layouts = [_layout_of(c, r) for r, c in enumerate(ckpts)]
    if any(layout != layouts[0] for layout in layouts) or layouts[0].ranks != len(ranks):
        raise CheckpointError(f"the ranks' checkpoints of step {step} in {root} do not hold one layout")
    pieces = [_params_of(c, layouts[0].pieces[r]) for r, c in enumerate(ckpts)]
    try:
        out = gather_pieces(layouts[0], pieces)
    except ValueError as e:
        raise CheckpointError(f"{root}, step {step}: {e}") from None
    for c in ckpts:  # buffers: whole on every rank (FSDP2 leaves them unsharded) or each stage's own
        for name, t in c.model.items():
            out.setdefault(name, t)
    return out, ckpts[0]


def _layout_of(ckpt: Checkpoint, rank: int) -> PieceLayout:
    piece = ckpt.info.piece
    if not piece or piece.get("rank") != rank:
        raise CheckpointError(f"{ckpt.info.path} is not rank {rank}'s piece of a split model")
    try:
        return PieceLayout.from_wire(piece.get("layout"))
    except Exception as e:  # a ProtocolError or a ValueError: a layout that does not parse
        raise CheckpointError(f"{ckpt.info.path}: its layout does not parse: {e}") from None


def _params_of(ckpt: Checkpoint, entries: tuple[PieceEntry, ...]) -> Mapping[str, Tensor]:
    """The parameters of a rank's piece (a checkpoint also holds buffers, which the layout does not name)."""
    missing = [e.name for e in entries if e.name not in ckpt.model]
    if missing:
        raise CheckpointError(f"{ckpt.info.path} lacks {missing[0]!r}, which its layout names")
    return {e.name: ckpt.model[e.name] for e in entries}
