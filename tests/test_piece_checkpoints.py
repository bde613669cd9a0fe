"""Checkpoints of a peer whose model is split across its ranks (issue 48): a directory per rank, one model out.

On processes (``tests/piece_checkpoint_ranks.py``, 2 gloo ranks): each rank
saves its piece and its optimizer's state for it, a fresh pair resumes and
trains on exactly as the saved one did (bit for bit), and ``gossiptrain
export --checkpoint`` gathers the pieces into a file the unsplit model
loads. In this process: which step a peer resumes from when one rank's
newest save is missing, and what is refused.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from gossiptrain.cli.main import main as cli
from gossiptrain.errors import CheckpointError
from gossiptrain.net.addressing import free_loopback_port
from gossiptrain.protocol.pieces import PieceEntry, PieceLayout, piece_entries
from gossiptrain.runtime import piece_checkpoints
from gossiptrain.state.checkpoint import Checkpointer, latest_good, restore
from gossiptrain.state.merged_model import read_merged

from .split_ranks import model
from .swarm import Procs



def _run(procs: Procs, kind: str, mode: str, out: Path) -> None:
    port = free_loopback_port()
    ranks = [procs.start(str(r), str(port), kind, mode, str(out), name=f"{mode}{r}", module="tests.piece_checkpoint_ranks")
             for r in range(2)]
    assert [p.wait(120) for p in ranks] == [0, 0], [p.output()[-3000:] for p in ranks]


@pytest.mark.parametrize("kind", ["fsdp", "pipeline"])
def test_each_rank_resumes_its_piece_and_its_optimizers_state_and_export_gives_the_unsplit_model(
    procs: Procs, tmp_path: Path, kind: str
) -> None:
    _run(procs, kind, "save", tmp_path)
    _run(procs, kind, "resume", tmp_path)
    for r in range(2):
        assert json.loads((tmp_path / f"resumed-{r}.json").read_text()) == 3
        saved, resumed = load_file(str(tmp_path / f"save-{r}.safetensors")), load_file(str(tmp_path / f"resume-{r}.safetensors"))
        assert all(torch.equal(saved[k], resumed[k]) for k in saved)  # momentum restored too: the same next steps
    out = tmp_path / "model.safetensors"
    assert cli(["export", "--checkpoint", str(tmp_path / "ckpt"), "--out", str(out)]) == 0
    tensors, meta = read_merged(out)
    assert meta["members"] == [{"id": "A", "samples": 12, "step": 3, "digest": ""}]
    unsplit = model(1)
    unsplit.load_state_dict(tensors)  # an ordinary state_dict of the unsplit model
    if kind == "fsdp":
        full = load_file(str(tmp_path / "full.safetensors"))  # FSDP2's own all-gather at the save
        assert all(torch.equal(tensors[n], full[n]) for n in full)


# -- in this process: stages saved as plain modules -----------------------------------------------


def _stages() -> tuple[list[nn.Module], PieceLayout]:
    net = model(1)
    stages = [net[:2], net[2:]]
    return stages, PieceLayout("pipeline", tuple(piece_entries(s) for s in stages))


def _save(directory: Path, stages: list[nn.Module], layout: PieceLayout, step: int) -> None:
    for r, stage in enumerate(stages):
        with Checkpointer(piece_checkpoints.rank_directory(directory, r), keep=5) as ckpt:
            ckpt.save(stage, None, step=step, piece=piece_checkpoints.piece_info(layout, r))


def test_the_newest_step_every_rank_holds_is_the_one_gathered(tmp_path: Path) -> None:
    stages, layout = _stages()
    _save(tmp_path, stages, layout, 3)
    at_three = {k: v.clone() for k, v in model(1).state_dict().items()}
    with torch.no_grad():
        for stage in stages:
            for p in stage.parameters():
                p.add_(1.0)
    _save(tmp_path, stages, layout, 5)
    tensors, ckpt = piece_checkpoints.gather(tmp_path)
    assert ckpt.info.step == 5 and torch.equal(tensors["2.bias"], at_three["2.bias"] + 1.0)
    newest = piece_checkpoints.rank_directory(tmp_path, 1)
    for f in newest.iterdir():
        if "step-5" in f.name and f.suffix == ".json":
            f.unlink()  # rank 1 crashed before its save of step 5 completed
    tensors, ckpt = piece_checkpoints.gather(tmp_path)
    assert ckpt.info.step == 3 and all(torch.equal(tensors[k], at_three[k]) for k in at_three)


def test_a_piece_is_refused_by_another_rank_or_layout_and_the_whole_model_by_a_rank_naming_both(tmp_path: Path) -> None:
    stages, layout = _stages()
    _save(tmp_path, stages, layout, 3)
    ckpt = latest_good(piece_checkpoints.rank_directory(tmp_path, 0))
    with pytest.raises(CheckpointError, match=r"rank 0's piece of a pipeline layout over 2 ranks.*this is rank 1's"):
        restore(ckpt, stages[0], piece=piece_checkpoints.piece_info(layout, 1))
    other = PieceLayout("pipeline", (layout.pieces[0], (PieceEntry("2.weight", "float32", (5, 17)),)))
    with pytest.raises(CheckpointError, match="rank 0: 2 tensors, 153 values, rank 1: 2 tensors, 90 values"):
        restore(ckpt, stages[0], piece=piece_checkpoints.piece_info(other, 0))
    with pytest.raises(CheckpointError, match="this is the whole model"):
        restore(ckpt, stages[0])
    restore(ckpt, stages[0], piece=piece_checkpoints.piece_info(layout, 0))  # its own: fine


def test_a_directory_without_every_ranks_pieces_is_refused_saying_what_it_holds(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="no rank-<r> directory"):
        piece_checkpoints.gather(tmp_path)
    stages, layout = _stages()
    with Checkpointer(piece_checkpoints.rank_directory(tmp_path, 1)) as ckpt:
        ckpt.save(stages[1], None, step=3, piece=piece_checkpoints.piece_info(layout, 1))
    with pytest.raises(CheckpointError, match=r"ranks \[1\]"):
        piece_checkpoints.gather(tmp_path)
