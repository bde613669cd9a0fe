"""A model split across a peer's ranks, as pieces (issue 48): layouts, their wire form, and gathering them back."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from gossiptrain.errors import ProtocolError
from gossiptrain.net.addressing import free_loopback_port
from gossiptrain.protocol.param_spec import ParamSpec
from gossiptrain.protocol.pieces import PieceEntry, PieceLayout, gather, local_piece, piece_entries, split_spec

from .piece_ranks import model
from .swarm import Procs



@pytest.mark.parametrize("kind", ["fsdp", "pipeline"])
def test_the_pieces_of_two_ranks_gather_into_the_unsplit_models_state_dict(procs: Procs, tmp_path: Path, kind: str) -> None:
    port = free_loopback_port()
    outs = [str(tmp_path / f"rank{r}") for r in range(2)]
    ranks = [procs.start(str(r), str(port), kind, outs[r], name=f"{kind}{r}", module="tests.piece_ranks") for r in range(2)]
    assert [p.wait(90) for p in ranks] == [0, 0], [p.output()[-3000:] for p in ranks]
    entries = [tuple(PieceEntry(e[0], e[1], tuple(e[2]), e[3]) for e in json.loads(Path(f"{o}.entries.json").read_text()))
               for o in outs]
    layout = PieceLayout(kind, tuple(entries))
    pieces = [load_file(f"{o}.piece.safetensors") for o in outs]
    merged = gather(layout, pieces)
    unsplit = model()
    assert list(merged) == [n for n, _ in unsplit.named_parameters()]  # every parameter, in the model's order
    unsplit.load_state_dict(merged)  # an ordinary state_dict: it loads into the unsplit model
    if kind == "fsdp":
        assert [e.shape for e in layout.pieces[0]][:2] == [(9, 8), (9,)] and [e.shape for e in layout.pieces[1]][:2] == [(8, 8), (8,)]
        full = load_file(f"{outs[0]}.full.safetensors")  # what FSDP2's own all-gather says after training
        assert all(torch.equal(merged[n], full[n]) for n in full)
    else:
        assert [e.name for e in layout.pieces[1]] == ["2.weight", "2.bias"]
        start = dict(model().named_parameters())
        assert all(torch.equal(merged[n], start[n] + (1.0 if n.startswith("0.") else 2.0)) for n in merged)


def test_a_layout_round_trips_and_two_layouts_that_differ_are_named_both() -> None:
    one = PieceLayout("whole", (piece_entries(model()),))
    fsdp = PieceLayout("fsdp", ((PieceEntry("0.weight", "float32", (9, 8), 0),), (PieceEntry("0.weight", "float32", (8, 8), 0),)))
    assert PieceLayout.from_wire(fsdp.to_wire()) == fsdp and one.mismatch(PieceLayout.from_wire(one.to_wire())) is None
    said = fsdp.mismatch(one)
    assert said is not None and "fsdp over 2 ranks" in said and "whole on one rank" in said
    assert "rank 0: 1 tensors, 72 values" in said  # what each rank holds, so the user sees which split differs


@pytest.mark.parametrize("raw", [
    None, {"kind": "tensor-parallel", "pieces": [[]]}, {"kind": "fsdp", "pieces": []},
    {"kind": "fsdp", "pieces": [[["w", "float32", [2, -1], 0]]]}, {"kind": "fsdp", "pieces": [[["w", "float32", [2], 1]]]},
    {"kind": "whole", "pieces": [[["w", "float32", [2]]]]}, {"kind": "whole", "pieces": ["w"]},
    {"kind": "whole", "pieces": [[], []]},  # whole: rank 0's piece only
])
def test_a_malformed_layout_is_refused(raw: Any) -> None:
    with pytest.raises(ProtocolError):
        PieceLayout.from_wire(raw)


def test_gathering_refuses_a_piece_that_is_not_its_layouts() -> None:
    net = model()
    layout = PieceLayout("whole", (piece_entries(net),))
    piece = local_piece(net)
    assert gather(layout, [piece])["0.weight"].data_ptr() != piece["0.weight"].data_ptr()  # a copy, not the model
    piece["0.weight"] = torch.zeros(3, 3)
    with pytest.raises(ValueError, match="rank 0's piece holds float32 \\(3, 3\\) as '0.weight'"):
        gather(layout, [piece])
    with pytest.raises(ValueError, match="2 pieces for a layout of 1 ranks"):
        gather(layout, [piece, piece])


def test_a_split_peers_spec_is_the_unsplit_models_and_its_layout_and_the_swarm_refuses_another_layout() -> None:
    """What a split peer joins with (``split_spec``): the unsplit model's parameters (shards put back together), and
    a line for its layout that survives the spec's wire form; a spec of another layout, or of the whole model, is
    refused naming both."""
    fsdp = PieceLayout("fsdp", (
        (PieceEntry("0.weight", "float32", (9, 8), 0), PieceEntry("0.bias", "float32", (9,), 0)),
        (PieceEntry("0.weight", "float32", (8, 8), 0), PieceEntry("0.bias", "float32", (8,), 0)),
    ))
    pipeline = PieceLayout("pipeline", ((PieceEntry("0.weight", "float32", (17, 8)),),
                                        (PieceEntry("0.bias", "float32", (17,)),)))
    spec = split_spec(fsdp)
    assert spec.entries == (("0.weight", "float32", (17, 8)), ("0.bias", "float32", (17,)))
    assert ParamSpec.from_wire(json.loads(json.dumps(spec.to_wire()))) == spec
    whole = ParamSpec.of({"0.weight": torch.zeros(17, 8), "0.bias": torch.zeros(17)})
    assert whole.mismatch(ParamSpec.from_wire(whole.to_wire())) is None and split_spec(fsdp).mismatch(spec) is None
    said = whole.mismatch(spec)
    assert said is not None and "whole on one rank" in said and "split as fsdp over 2 ranks" in said
    said = split_spec(pipeline).mismatch(spec)  # the same parameters, split otherwise
    assert said is not None and "split as pipeline over 2 ranks" in said and "split as fsdp over 2 ranks" in said
    uneven = PieceLayout("fsdp", (fsdp.pieces[1], fsdp.pieces[0]))  # the same model, its shards cut otherwise
    assert split_spec(uneven).entries == spec.entries and split_spec(uneven).mismatch(spec) is not None
