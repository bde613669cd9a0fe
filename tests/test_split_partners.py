"""Which partner a split peer's leader picks, and what split peers refuse of a swarm's run (issue 48), with no
network: the piece link is a stand-in that records hellos and hands out the answers a test gives."""

from __future__ import annotations

import random
from typing import Any

import pytest

from gossiptrain.config import GossipConfig
from gossiptrain.protocol.piece_exchange import hello_answer
from gossiptrain.protocol.pieces import PieceEntry, PieceLayout
from gossiptrain.runtime.split_partners import HELLO_TIMEOUT, PartnerBook
from gossiptrain.runtime.split_peer import unbuilt

OURS = PieceLayout("fsdp", ((PieceEntry("w", "float32", (2, 3), 0),), (PieceEntry("w", "float32", (2, 3), 0),)))
OTHER = PieceLayout("pipeline", ((PieceEntry("a", "float32", (4,), -1),), (PieceEntry("b", "float32", (4,), -1),)))


class Link:
    """What PartnerBook asks of a piece link: hellos out, answers in (``answer``)."""

    def __init__(self) -> None:
        self.hellos: list[str] = []
        self.answers: dict[str, tuple[str, dict[str, Any]]] = {}

    def hello(self, addr: str, layout: PieceLayout, addresses: tuple[str, ...]) -> None:
        self.hellos.append(addr)

    def welcome_from(self, addr: str) -> tuple[str, dict[str, Any]] | None:
        return self.answers.pop(addr, None)

    def answer(self, addr: str, member: str, layout: PieceLayout) -> None:
        """``member`` at ``addr`` answers with its layout and its ranks' addresses (its leader's own, then one more)."""
        self.answers[addr] = (member, hello_answer(layout, (addr, addr + "1"), {"layout": OURS.to_wire()}))


def book(now: list[float]) -> tuple[PartnerBook, Link]:
    link = Link()
    return PartnerBook(link, OURS, ("tcp://me:1", "tcp://me:2"), clock=lambda: now[0], rng=random.Random(0)), link  # type: ignore[arg-type]


def test_partners_are_met_once_then_picked_among_the_topologys_neighbours() -> None:
    now = [0.0]
    partners, link = book(now)
    live = [("b", "tcp://b:1"), ("c", "tcp://c:1"), ("d", "tcp://d:1")]
    assert partners.pick(live) is None and sorted(link.hellos) == ["tcp://b:1", "tcp://c:1", "tcp://d:1"]
    for mid, addr in live:
        link.answer(addr, mid, OURS)
    picks = {partners.pick(live, among=["c"]).id for _ in range(20)}  # type: ignore[union-attr]
    assert picks == {"c"} and len(link.hellos) == 3  # the neighbour only; nobody asked twice
    assert {partners.pick(live).id for _ in range(50)} == {"b", "c", "d"}  # type: ignore[union-attr]
    assert partners.met["c"].addresses == ("tcp://c:1", "tcp://c:11")
    assert partners.pick(live, among=["e"]) is None  # a neighbour not met yet: no exchange this round
    partners.pick([("b", "tcp://b:1")])  # c and d left the swarm: forgotten, met again if they come back
    assert sorted(partners.met) == ["b"]


def test_a_partner_of_another_layout_is_never_asked_again_and_one_that_never_answers_is() -> None:
    now = [0.0]
    partners, link = book(now)
    live = [("b", "tcp://b:1"), ("c", "tcp://c:1")]
    partners.pick(live)
    link.answer("tcp://b:1", "b", OTHER)  # its answer names both layouts: refused
    partners.pick(live)
    assert "b" in partners.refused and "fsdp" in partners.refused["b"] and "pipeline" in partners.refused["b"]
    now[0] += HELLO_TIMEOUT + 0.1  # c never answered: asked again
    partners.pick(live)
    partners.pick(live)
    assert link.hellos.count("tcp://c:1") == 2 and link.hellos.count("tcp://b:1") == 1


@pytest.mark.parametrize(("field", "value", "refused"), [
    ("algorithm", "push-sum", True), ("robust", True, True), ("exchanges_in_flight", 2, False),
])
def test_split_peers_refuse_a_run_they_would_average_otherwise_and_name_what_they_do_not_run(
    field: str, value: object, refused: bool
) -> None:
    said = unbuilt(GossipConfig(**{field: value}))
    assert [bool(said[0]), bool(said[1])] == [refused, not refused]
    assert field.split("_")[0] in " ".join(said[0] + said[1])
    assert unbuilt(GossipConfig()) == ([], [])  # the defaults: all of them run
    assert unbuilt(GossipConfig(staleness_weighting="polynomial", staleness_bound=4)) == ([], [])  # per piece too
    assert unbuilt(GossipConfig(momentum_mode="quasi-global")) == ([], [])
