"""The testing kit itself: matchers must fail as well as pass, and the kit must report failures usefully."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from gossiptrain.config import Limits
from gossiptrain.net.kinds import ACK, PING
from gossiptrain.net.transport import Transport
from gossiptrain.net.transport.sim import SimNetwork, SimTransport
from gossiptrain.protocol.member import Member
from gossiptrain.protocol.swim.events import MemberDown, MemberUp, Send, Suspected
from gossiptrain.testing import Backend, Cluster, check_transport, match, only
from gossiptrain.testing.transport_checks import sim_backend

B = Member("b", "sim://b", 0, 1)
ACTIONS = [
    Send("sim://b", PING, (), seq=1),
    MemberUp(B),
    Send("sim://c", ACK, (), seq=2),
    MemberDown(B, "dead"),
]


def test_match_checks_the_type_and_every_named_field() -> None:
    ping = ACTIONS[0]
    assert match(ping, Send)
    assert match(ping, Send, kind=PING, addr="sim://b", seq=1)
    assert not match(ping, Send, kind=ACK)  # one field differs
    assert not match(ping, Send, kind=PING, seq=2)  # all must hold, not any
    assert not match(ping, MemberUp)  # wrong type
    assert not match(MemberUp(B), MemberDown, member=B)  # the field exists there, but the type is wrong
    assert match(MemberDown(B, "left"), MemberDown, member=B, reason="left")


def test_only_keeps_the_matching_actions_in_order() -> None:
    assert only(ACTIONS, Send) == [ACTIONS[0], ACTIONS[2]]
    assert only(ACTIONS, Send, kind=ACK) == [ACTIONS[2]]
    assert only(ACTIONS, MemberDown, reason="dead") == [ACTIONS[3]]
    assert only(ACTIONS, MemberDown, reason="left") == []
    assert only(ACTIONS, Suspected) == []
    assert only(iter(ACTIONS), MemberUp, member=B) == [ACTIONS[1]]  # any iterable
    assert only([], Send) == []


def test_fields_may_share_the_matchers_own_parameter_names() -> None:
    @dataclass(frozen=True)
    class Odd:
        action: str
        cls: str
        actions: int = 0

    assert match(Odd("a", "c"), Odd, action="a", cls="c", actions=0)
    assert not match(Odd("a", "c"), Odd, cls="a")
    assert only([Odd("a", "c"), Odd("b", "c")], Odd, action="b") == [Odd("b", "c")]


def test_a_misspelt_field_is_an_error_not_a_silent_non_match() -> None:
    with pytest.raises(TypeError, match="Send has no field 'knd'"):
        only(ACTIONS, Send, knd=PING)
    with pytest.raises(TypeError, match="'reasn'"):
        match(ACTIONS[3], MemberDown, reasn="dead")
    with pytest.raises(TypeError):
        only([], Send, knd=PING)  # even with nothing to compare, so that `assert not only(...)` cannot pass by mistake


def test_the_cluster_replays_exactly_from_its_seed() -> None:
    def history(seed: int) -> list[tuple[float, str, object]]:
        c = Cluster(5, seed, loss=0.05)
        c.run(20.0)
        return c.events

    assert history(7) == history(7)
    assert history(7) != history(8)


def test_check_transport_passes_a_conforming_backend() -> None:
    check_transport(sim_backend)


def test_check_transport_names_the_check_that_a_broken_backend_fails() -> None:
    """Every transport on a network of its own, under one name: two of them cannot even tell each other apart."""

    def make(limits: Limits | None = None) -> Transport:
        return SimTransport("sim://same:0", limits or Limits(), network=SimNetwork())

    with pytest.raises(AssertionError) as failed:
        check_transport(Backend("broken", make, lambda: "sim://nobody"))
    assert any("round_trip_keeps_frames_and_order" in note and "'broken'" in note for note in failed.value.__notes__)
