"""Two peers whose models are split across 2 ranks each average rank by rank over real sockets (issue 48).

Four processes: peers A and B, each a gloo group of 2 ranks holding the
model split by FSDP2 or as 2 pipeline stages (``tests/split_ranks.py``).
A asks B three times; nothing trains, so what the pieces must hold is
known: every exchange is applied on both ranks of both peers, the sum of
the two models is what it was, and both models are their mean. (Bit for
bit against unsplit peers is tests/test_piece_exchange.py's; here B may
refuse A's next request until A's word on the last one has come, and A
asks again; the test fixes the values, not how many tries it took.)
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from gossiptrain.net.addressing import free_loopback_port
from gossiptrain.protocol.pieces import PieceEntry, PieceLayout, gather

from .split_ranks import DOWNLOAD_STATE, STALL_AFTER, model
from .swarm import Procs

EXCHANGES = 3


def run_pair(procs: Procs, tmp_path: Path, kind: str, exchanges: int, mode: str = "") -> None:
    """Peers A and B of 2 ranks each (``tests/split_ranks.py``, 4 processes) to their end, every one exiting 0."""
    ports = {"A": free_loopback_port(), "B": free_loopback_port()}
    ranks = [
        procs.start(peer, str(rank), str(ports[peer]), kind, str(tmp_path), str(exchanges), *([mode] if mode else []),
                    name=f"{peer}{rank}", module="tests.split_ranks")
        for peer in ("A", "B") for rank in (0, 1)
    ]
    assert [p.wait(120) for p in ranks] == [0, 0, 0, 0], [p.output()[-3000:] for p in ranks]



@pytest.mark.parametrize("kind", ["fsdp", "pipeline"])
def test_split_peers_average_piece_by_piece_over_their_ranks_own_sockets(
    procs: Procs, tmp_path: Path, kind: str
) -> None:
    run_pair(procs, tmp_path, kind, EXCHANGES)
    stats = {(peer, r): json.loads((tmp_path / f"{peer}-{r}.stats.json").read_text()) for peer in "AB" for r in (0, 1)}
    assert all(stats[("A", r)]["committed"] == EXCHANGES and stats[("B", r)]["applied"] == EXCHANGES for r in (0, 1)), stats
    assert stats[("A", 0)]["aborted"] == stats[("A", 1)]["aborted"]  # all or none: every rank saw the same outcomes
    for r in (0, 1):
        a = load_file(str(tmp_path / f"A-{r}.before.safetensors"))
        b = load_file(str(tmp_path / f"B-{r}.before.safetensors"))
        got_a = load_file(str(tmp_path / f"A-{r}.after.safetensors"))
        got_b = load_file(str(tmp_path / f"B-{r}.after.safetensors"))
        for k in a:
            assert not torch.equal(a[k], b[k])  # two different models to start from
            torch.testing.assert_close(got_a[k] + got_b[k], a[k] + b[k], rtol=0, atol=1e-6)  # nothing lost
            torch.testing.assert_close(got_a[k], (a[k] + b[k]) / 2, rtol=0, atol=1e-6)  # averaged, on every rank
            torch.testing.assert_close(got_b[k], (a[k] + b[k]) / 2, rtol=0, atol=1e-6)


def test_a_rank_of_the_server_that_dies_leaves_no_half_applied_exchange(procs: Procs, tmp_path: Path) -> None:
    """B's rank 1 dies after answering A's first request; B's rank 0 fails at its next collective. A's ranks apply
    that first exchange together (both had their replies) and abort the next one together (rank 1's never comes)."""
    ports = {"A": free_loopback_port(), "B": free_loopback_port()}
    ranks = {
        (peer, rank): procs.start(peer, str(rank), str(ports[peer]), "fsdp", str(tmp_path), str(EXCHANGES), "kill",
                                  name=f"{peer}{rank}", module="tests.split_ranks")
        for peer in ("A", "B") for rank in (0, 1)
    }
    codes = {key: p.wait(120) for key, p in ranks.items()}
    assert codes[("A", 0)] == codes[("A", 1)] == 0, [p.output()[-3000:] for p in ranks.values()]
    assert codes[("B", 1)] == 3 and codes[("B", 0)] != 0  # the dead rank, and its group failing with it
    stats = [json.loads((tmp_path / f"A-{r}.stats.json").read_text()) for r in (0, 1)]
    assert stats[0] == stats[1] and stats[0]["aborted"] >= 1, stats  # every rank the same outcomes
    for r in (0, 1):
        a = load_file(str(tmp_path / f"A-{r}.before.safetensors"))
        b = load_file(str(tmp_path / f"B-{r}.before.safetensors"))
        got = load_file(str(tmp_path / f"A-{r}.after.safetensors"))
        for k in a:  # the committed exchanges (0 or 1: B died before its word on any second could come)
            want = a[k] if stats[0]["committed"] == 0 else (a[k] + b[k]) / 2
            torch.testing.assert_close(got[k], want, rtol=0, atol=1e-6)


def test_fsdp2_computes_with_the_shards_the_exchanges_wrote_while_both_peers_train(procs: Procs, tmp_path: Path) -> None:
    """Local steps between safe points, as a training loop takes them: the exchanges write each rank's shard, and
    FSDP2's next forward gathers those; the pieces, put together, are the model FSDP2 runs."""
    run_pair(procs, tmp_path, "fsdp", EXCHANGES, "train")
    stats = [json.loads((tmp_path / f"A-{r}.stats.json").read_text()) for r in (0, 1)]
    assert stats[0]["committed"] == stats[1]["committed"] == EXCHANGES, stats
    for peer in "AB":
        layout = PieceLayout("fsdp", tuple(
            tuple(PieceEntry(k, "float32", tuple(t.shape), 0) for k, t in load_file(str(tmp_path / f"{peer}-{r}.after.safetensors")).items())
            for r in (0, 1)))
        pieces = [load_file(str(tmp_path / f"{peer}-{r}.after.safetensors")) for r in (0, 1)]
        unsplit = model(1)
        unsplit.load_state_dict(gather(layout, pieces))
        probe = load_file(str(tmp_path / f"{peer}-probe.safetensors"))
        with torch.no_grad():
            torch.testing.assert_close(unsplit(probe["probe"]), probe["out"], rtol=1e-5, atol=1e-6)


def test_flow_control_holds_every_rank_of_a_peer_ahead_of_its_link(procs: Procs, tmp_path: Path) -> None:
    """A steps as fast as it can while B answers only every 200 ms (``tests/split_ranks.py flow``): A's leader's bound
    of FLOW_BOUND local steps past the last merge holds both of A's ranks alike (the same holds, the same steps
    between merges), and most merges come within the bound (a reply later than two typical round trips is not held
    for: under load a few may)."""
    from .split_ranks import FLOW_BOUND

    run_pair(procs, tmp_path, "fsdp", 6, "flow")
    a = [json.loads((tmp_path / f"A-{r}.stats.json").read_text()) for r in (0, 1)]
    assert a[0]["between"] == a[1]["between"] and a[0]["waits"] == a[1]["waits"], a  # every rank held alike
    b = [json.loads((tmp_path / f"B-{r}.stats.json").read_text()) for r in (0, 1)]
    assert a[0]["level"] == a[1]["level"] and b[0]["level"] == b[1]["level"], (a, b)  # auto: the leader's level
    assert all(x["corrections"] == x["steps"] > 0 for x in a), a  # the drift correction: once a step, holds or not
    between = sorted(a[0]["between"])
    assert len(between) >= 6 and a[0]["waits"] >= 3, a[0]
    assert between[len(between) // 2] <= FLOW_BOUND, between  # without the hold: dozens of steps a merge


def test_a_newcomer_downloads_its_pieces_in_chunks_and_resumes_where_a_donor_stalled(procs: Procs, tmp_path: Path) -> None:
    """A's leader names a donor nobody answers for and B, whose ranks each stop answering the first session they serve
    after a few chunks (``tests/split_ranks.py download``): every rank of A leaves the silent donors, asks B again for
    the chunks it lacks (none twice), and holds B's piece of its index, bit for bit; and B's rank's SGD momentum
    buffers (state.transfer_optimizer), kept until A's optimizer is bound and then loaded into it."""
    run_pair(procs, tmp_path, "fsdp", 0, "download")
    for r in (0, 1):
        stats = json.loads((tmp_path / f"A-{r}.stats.json").read_text())
        a, b = (load_file(str(tmp_path / f"{peer}-{r}.after.safetensors")) for peer in "AB")
        before = load_file(str(tmp_path / f"A-{r}.before.safetensors"))
        assert all(torch.equal(a[k], b[k]) and not torch.equal(before[k], b[k]) for k in a)
        momentum_a, momentum_b = (load_file(str(tmp_path / f"{peer}-{r}.momentum.safetensors")) for peer in "AB")
        assert set(momentum_a) == set(b) and all(torch.equal(momentum_a[k], momentum_b[k]) for k in b)  # B's, in A's SGD
        assert stats["optimizer"] == ["waiting", "installed"], stats
        nbytes = sum(t.numel() * t.element_size() for t in [*b.values(), *momentum_b.values()])  # piece, then buffers
        chunks = -(-nbytes // DOWNLOAD_STATE.chunk_bytes)
        assert chunks > STALL_AFTER + 1, chunks
        assert stats["got"] == "B" and stats["state_chunks_received"] == chunks, stats  # resumed, not started over
        assert stats["state_donors_tried"] >= 2 and stats["state_timeouts"] >= 1, stats
