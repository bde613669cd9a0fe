"""Piece exchanges over real sockets (``gossiptrain.runtime.piece_link``): each rank its own TCP endpoint.

Two peers of 2 ranks each, every rank on its own 127.0.0.x address. The
group's part (the gather of statuses, the broadcast of outcomes, the safe
point that answers the requests every rank holds) is played by the test; the
messages and the leaders' word (``XPEND``) go over TCP on loopback. A rank whose socket is
gone (a dead rank) leaves both models as they were.
"""

from __future__ import annotations

import threading
import time
from typing import Iterator

import pytest
import torch

from gossiptrain.config import Limits
from gossiptrain.net.transport import listen
from gossiptrain.errors import ProtocolError
from gossiptrain.protocol.piece_exchange import Outcome, RankExchanges, Status, decide, welcome_addresses
from gossiptrain.protocol.pieces import PieceEntry, PieceLayout
from gossiptrain.protocol.staleness import StalenessPolicy
from gossiptrain.runtime.loop_thread import LoopThread
from gossiptrain.runtime.piece_link import PieceLink

from .swarm import next_host, wait_for

TIMEOUT = 1.0

class LinkedPeer:
    """A peer of 2 ranks, each with its piece, its RankExchanges and its own PieceLink."""

    def __init__(self, name: str, seed: int, loop: LoopThread, staleness: StalenessPolicy | None = None) -> None:
        g = torch.Generator().manual_seed(seed)
        self.name = name
        self.pieces = [{"w": torch.randn(3, 4, generator=g), "b": torch.randn(2, generator=g)} for _ in range(2)]
        self.locks = [threading.RLock() for _ in range(2)]
        self.ranks = [
            RankExchanges(p, tuple(PieceEntry(k, "float32", tuple(t.shape), 0) for k, t in p.items()), timeout=TIMEOUT,
                          staleness=staleness)
            for p in self.pieces
        ]
        self.links = [
            PieceLink(listen(f"tcp://{next_host()}:0", Limits()), Limits(), rank, sender=name,
                      fingerprint="run", clock=time.monotonic, lock=lock)
            for rank, lock in zip(self.ranks, self.locks)
        ]
        for link in self.links:
            loop.run(link.start(timeout=10), timeout=15)
        self.addresses = [link.transport.address for link in self.links]

    def snapshot(self) -> list[dict[str, torch.Tensor]]:
        return [{k: v.clone() for k, v in p.items()} for p in self.pieces]

    def ask(self, partner: LinkedPeer, xid: int) -> None:
        """Every rank asks the same rank of ``partner`` (the leader's decision, as broadcast to its ranks)."""
        for rank, link, lock, addr in zip(self.ranks, self.links, self.locks, partner.addresses):
            with lock:
                request = rank.start(xid, partner.name, 0.5, time.monotonic())
            link.ask(request, addr)

    def serve(self, xid: int, ranks: tuple[int, ...] = (0, 1)) -> None:
        """The group's safe point on the server's side: once each rank of ``ranks`` holds request ``xid``, every one
        answers it from its piece (``serve_waiting``) over its own link."""
        def held(r: int) -> bool:
            with self.locks[r]:
                return xid in dict(self.ranks[r].waiting(time.monotonic()))

        wait_for(lambda: all(held(r) for r in ranks), 10, f"request {xid} at every rank", interval=0.01)
        for r in ranks:
            with self.locks[r]:
                answer, addr = self.ranks[r].serve_waiting(xid, time.monotonic())
            self.links[r].answer(addr, answer)

    def decided(self, xid: int) -> Outcome:
        statuses = []
        for rank, lock in zip(self.ranks, self.locks):
            with lock:
                statuses.append(rank.status(xid, time.monotonic()))
        return decide(statuses)

    def conclude(self, xid: int, outcome: Outcome, partner: LinkedPeer) -> None:
        """Commit or abort on every rank, apply, and tell the partner's leader."""
        for rank, lock in zip(self.ranks, self.locks):
            with lock:
                rank.commit(xid) if outcome == Outcome.COMMIT else rank.abort(xid)
                rank.apply()
        self.links[0].tell(partner.addresses[0], xid, outcome)

    def settle_told(self) -> int:
        """The leader's word from partners, handed to every rank; returns how many outcomes."""
        told = self.links[0].take_outcomes()
        for rank, lock in zip(self.ranks, self.locks):
            with lock:
                for xid, (requester, outcome) in told.items():
                    rank.settle(xid, outcome, requester)
                rank.apply()
        return len(told)

    def close(self, loop: LoopThread) -> None:
        for link in self.links:
            loop.run(link.close("test over"), timeout=10)


@pytest.fixture
def loop() -> Iterator[LoopThread]:
    thread = LoopThread("piece-link-test").start()
    yield thread
    thread.stop()


@pytest.mark.parametrize("apart", [0, 8])
def test_two_split_peers_average_rank_by_rank_over_their_own_sockets(loop: LoopThread, apart: int) -> None:
    """``apart``: B's step ahead of A's, polynomial staleness weights (exponent 1/2): B serves at 1/2 times
    (1 + apart)^-1/2, says so in its reply, and A applies that."""
    policy = StalenessPolicy("polynomial", 0.5)
    a, b = LinkedPeer("A", 1, loop, policy), LinkedPeer("B", 2, loop, policy)
    for rank in b.ranks:
        rank.step = apart
    share = 0.5 * (1 + apart) ** -0.5
    try:
        before_a, before_b = a.snapshot(), b.snapshot()
        a.ask(b, 7)
        assert all(rank.held == () for rank in b.ranks)  # kept for B's next safe point, not answered on arrival
        b.serve(7)
        wait_for(lambda: a.decided(7) != Outcome.WAIT, 10, "both ranks' replies", interval=0.01)
        assert a.decided(7) == Outcome.COMMIT
        assert all(rank.held == (7,) for rank in b.ranks)  # held, not applied, until A's word comes
        a.conclude(7, Outcome.COMMIT, b)
        told = 0

        def settled() -> bool:
            nonlocal told
            told += b.settle_told()
            return told == 1

        wait_for(settled, 10, "A's word at B's leader", interval=0.01)
        for r in range(2):
            for k in ("w", "b"):
                difference = before_b[r][k] - before_a[r][k]
                torch.testing.assert_close(a.pieces[r][k], before_a[r][k] + share * difference)
                torch.testing.assert_close(b.pieces[r][k], before_b[r][k] - share * difference)
        assert [r.stats.applied for r in b.ranks] == [1, 1] and [r.stats.committed for r in a.ranks] == [1, 1]
    finally:
        a.close(loop), b.close(loop)


def test_a_dead_rank_of_the_server_leaves_both_models_as_they_were(loop: LoopThread) -> None:
    a, b = LinkedPeer("A", 3, loop), LinkedPeer("B", 4, loop)
    try:
        loop.run(b.links[1].close("rank 1 died"), timeout=10)
        before_a, before_b = a.snapshot(), b.snapshot()
        a.ask(b, 9)
        b.serve(9, ranks=(0,))  # (a real group's safe point fails once a rank is dead; its live rank answered before)
        wait_for(lambda: a.ranks[0].status(9, time.monotonic()) == Status.READY, 10, "rank 0's reply", interval=0.01)
        assert a.decided(9) == Outcome.WAIT  # rank 1 waits for a reply that will not come...
        wait_for(lambda: a.decided(9) != Outcome.WAIT, TIMEOUT + 10, "rank 1's deadline", interval=0.01)
        assert a.decided(9) == Outcome.ABORT  # ...so every rank of both peers drops the exchange
        assert b.ranks[0].held == (9,)
        a.conclude(9, Outcome.ABORT, b)
        wait_for(lambda: b.settle_told() == 1, 10, "A's word at B's leader", interval=0.01)
        assert b.ranks[0].held == () and b.ranks[0].stats.dropped == 1
        for now, then in ((a.pieces, before_a), (b.pieces, before_b)):
            for r in range(2):
                for k in ("w", "b"):
                    assert torch.equal(now[r][k], then[r][k])
    finally:
        a.close(loop)
        loop.run(b.links[0].close("test over"), timeout=10)


def test_malformed_piece_messages_are_dropped_and_counted(loop: LoopThread) -> None:
    a, b = LinkedPeer("A", 5, loop), LinkedPeer("B", 6, loop)
    try:
        send = a.links[0].send  # on the network thread, as every send
        loop.call(send, b.addresses[0], "xpreq", {"xid": "seven", "a": 0.5}, a.pieces[0], timeout=5)
        loop.call(send, b.addresses[0], "xpend", {"xid": 1, "outcome": 5}, timeout=5)
        wait_for(lambda: b.links[0].stats.bad_messages == 2, 10, "both dropped", interval=0.01)
        assert b.ranks[0].held == () and b.links[0].take_outcomes() == {}
    finally:
        a.close(loop), b.close(loop)


def test_leaders_swap_layouts_and_addresses_and_another_layout_is_refused_naming_both(loop: LoopThread) -> None:
    a, b = LinkedPeer("A", 7, loop), LinkedPeer("B", 8, loop)
    try:
        layout = PieceLayout("fsdp", tuple(r.entries for r in a.ranks))
        b.links[0].introduction = (layout, tuple(b.addresses))
        sender, body = a.links[0].greet(b.addresses[0], layout, tuple(a.addresses), timeout=10)
        assert sender == "B" and welcome_addresses(layout, body) == tuple(b.addresses)
        other = PieceLayout("fsdp", (layout.pieces[0], (PieceEntry("w", "float32", (2, 4), 0), layout.pieces[1][1])))
        _, body = a.links[0].greet(b.addresses[0], other, tuple(a.addresses), timeout=10)
        with pytest.raises(ProtocolError) as refused:
            welcome_addresses(other, body)
        words = str(refused.value)
        assert words.startswith("this peer's model is split as fsdp over 2 ranks (rank 0: 2 tensors, 14 values, "
                                "rank 1: 2 tensors, 10 values); the swarm's as fsdp over 2 ranks (rank 0: 2 tensors, "
                                "14 values, rank 1: 2 tensors, 14 values)"), words
        with pytest.raises(TimeoutError):  # a link that answers no hello (not a leader)
            a.links[0].greet(b.addresses[1], layout, tuple(a.addresses), timeout=0.5)
    finally:
        a.close(loop), b.close(loop)
