"""Reachability, measured when a peer joins: the answerer dials the newcomer back (gossiptrain.protocol.reachability).

The sans-IO check first (nonces, the verdict, the line people read), then
real peers on loopback, each on its own 127.0.0.x: one that listens where
it advertises is told it is reachable; one that advertises an address
where nothing listens is still answered (the welcome comes back over its
own connection) and told it is not. Behind a real NAT router:
tests/test_netns_nat.py.
"""

from __future__ import annotations

import logging
import random
from typing import Any

import pytest
import torch

from gossiptrain.errors import ConfigError, ProtocolError
from gossiptrain.protocol.joining import JoinRequest
from gossiptrain.protocol.reachability import AUTO, NO, YES, ReachCheck, Verdict, check_mode, nonce_of, probe_body
from gossiptrain.runtime.peer import Peer

from .conftest import fast_config
from .swarm import Procs, next_host, wait_for

# No exchanges and no state download: these tests are about joining. A short wait for the probe keeps them quick.
RUN = {"train.workload": "external", "gossip.exchange_every_steps": 2 * 10**9, "state.enabled": False,
       "membership.join_timeout": 1.0}


# -- the sans-IO check -------------------------------------------------------------------------------------------


def test_a_probe_with_our_nonce_within_the_wait_says_reachable_and_none_by_its_end_says_not() -> None:
    check = ReachCheck(AUTO, random.Random(1))
    assert check.nonce is not None and check.verdict("tcp://10.0.0.5:1", 0.0) is None  # not welcomed yet
    check.welcomed("tcp://10.0.0.1:7070", now=10.0, wait=2.0)
    assert check.wake_at() == 12.0
    assert not check.on_probe(check.nonce + 1)  # someone else's (or a guess): no proof
    assert check.verdict("tcp://10.0.0.5:1", 11.9) is None
    late = check.verdict("tcp://10.0.0.5:1", 12.0)
    assert late == Verdict(False, "tcp://10.0.0.5:1", "measured", "tcp://10.0.0.1:7070", 2.0)
    assert check.on_probe(check.nonce)
    assert check.verdict("tcp://10.0.0.5:1", 13.0) == Verdict(True, "tcp://10.0.0.5:1", "measured", "tcp://10.0.0.1:7070")


def test_a_probe_that_came_before_the_welcome_counts() -> None:
    check = ReachCheck(AUTO, random.Random(2))
    assert check.nonce is not None and check.on_probe(check.nonce)
    check.welcomed("tcp://10.0.0.1:7070", now=0.0, wait=2.0)
    verdict = check.verdict("tcp://10.0.0.5:1", 0.0)
    assert verdict is not None and verdict.reachable


def test_yes_and_no_take_the_users_word_without_a_probe() -> None:
    for mode, reachable in ((YES, True), (NO, False)):
        check = ReachCheck(mode, random.Random(3))
        assert check.nonce is None and not check.on_probe(12345)
        verdict = check.verdict("tcp://10.0.0.5:1", 0.0)  # at once: nothing to wait for
        assert verdict == Verdict(reachable, "tcp://10.0.0.5:1", f"--reachable {mode}")
    with pytest.raises(ConfigError, match="--reachable must be one of auto, yes, no, got 'maybe'"):
        check_mode("maybe")


def test_the_line_says_who_dialled_what_follows_and_what_to_do() -> None:
    line = Verdict(False, "tcp://10.0.0.5:4242", "measured", "tcp://198.18.0.1:7070", 2.0).line("p1")
    assert line.startswith("peer p1 at tcp://10.0.0.5:4242 is not reachable from the member that answered its join "
                           "(tcp://198.18.0.1:7070 dialled it back and nothing arrived within 2 s): it trains as a "
                           "client-mode member (its address now ends in /client)")
    assert "set --advertise to an address others can dial" in line and "\n" not in line
    assert "(--reachable no)" in Verdict(False, "tcp://10.0.0.5:4242", "--reachable no").line("p1")
    assert Verdict(True, "tcp://a:1", "measured", "tcp://b:2").line("p1") == "peer p1 at tcp://a:1 is reachable: tcp://b:2 dialled it back"


def test_a_join_request_carries_its_nonce_and_one_without_is_the_body_answerers_before_it_read() -> None:
    assert JoinRequest.from_body(JoinRequest(reach=7).to_body()) == JoinRequest(reach=7)
    assert set(JoinRequest().to_body()) == {"config", "spec", "shard"}
    assert JoinRequest.from_body({"config": None, "spec": None, "shard": -1}).reach is None
    for bad in (0, -1, 1 << 63, 1.5, "7", True):
        with pytest.raises(ProtocolError, match="reach nonce"):
            JoinRequest.from_body({"config": None, "spec": None, "shard": -1, "reach": bad})
    with pytest.raises(ProtocolError, match="exactly config, spec and shard"):
        JoinRequest.from_body({"config": None, "spec": None, "shard": -1, "reach": 1, "more": 2})
    assert nonce_of(probe_body(99)) == 99
    for body in ({}, {"nonce": 0}, {"nonce": "1"}, None):
        with pytest.raises(ProtocolError):
            nonce_of(body)


# -- real peers on loopback -------------------------------------------------------------------------------------------


def join_of(coordinator_factory: Any) -> str:
    return coordinator_factory(fast_config(**RUN)).address.removeprefix("tcp://")


def peer(join: str, **kw: Any) -> Peer:
    return Peer(torch.nn.Linear(4, 2), join=join, config=fast_config(**RUN), transfer_state=False, **kw)


@pytest.mark.timeout(60)
def test_a_peer_is_dialled_back_by_whoever_answered_its_join_the_coordinator_or_a_peer(coordinator_factory: Any) -> None:
    join = join_of(coordinator_factory)
    with peer(join, bind=f"{next_host()}:0") as first:
        assert first.reachability is not None and first.reachability.reachable, first.reachability
        assert first.reachability.how == "measured" and first.reachability.answerer == f"tcp://{join}"
        with peer(first.address.removeprefix("tcp://"), bind=f"{next_host()}:0") as second:
            assert second.reachability is not None and second.reachability.reachable, second.reachability
            assert second.reachability.answerer == first.address


@pytest.mark.timeout(60)
def test_a_peer_restarted_on_the_same_fixed_address_is_still_reachable(coordinator_factory: Any) -> None:
    """The answerer still holds a connection to the first process there, re-dialling it: the probe goes over a new one."""
    join = join_of(coordinator_factory)
    with peer(join, bind=f"{next_host()}:0") as first:  # port 0 finds a free port: the fixed one from here on
        assert first.reachability is not None and first.reachability.reachable, first.reachability
        fixed = first.address.removeprefix("tcp://")
    with peer(join, bind=fixed) as again:  # after a clean leave, as after Ctrl+C
        assert again.address == first.address
        assert again.reachability is not None and again.reachability.reachable, again.reachability
        assert again.reachability.how == "measured" and again.reachability.answerer == f"tcp://{join}"


@pytest.mark.timeout(60)
def test_a_peer_advertising_where_nothing_listens_is_still_welcomed_and_told_it_is_not_reachable(
    coordinator_factory: Any, caplog: pytest.LogCaptureFixture
) -> None:
    join = join_of(coordinator_factory)
    nobody = next_host()  # nothing listens there: we bind elsewhere
    with caplog.at_level(logging.WARNING, logger="gossiptrain.runtime.peer"):
        with peer(join, bind=f"{next_host()}:0", advertise=nobody) as p:
            assert p.address.startswith(f"tcp://{nobody}:")
            verdict = p.reachability
            assert verdict is not None and not verdict.reachable and verdict.how == "measured", verdict
            assert verdict.waited == 1.0 and verdict.answerer == f"tcp://{join}"
    lines = [r.getMessage() for r in caplog.records if "is not reachable" in r.getMessage()]
    assert lines == [verdict.line(p.id)], lines  # one line


@pytest.mark.timeout(60)
def test_reachable_yes_and_no_skip_the_probe(coordinator_factory: Any, caplog: pytest.LogCaptureFixture) -> None:
    join = join_of(coordinator_factory)
    with caplog.at_level(logging.WARNING, logger="gossiptrain.runtime.peer"):
        with peer(join, bind=f"{next_host()}:0", advertise=next_host(), reachable=YES) as p:
            assert p.reachability == Verdict(True, p.address, "--reachable yes", f"tcp://{join}")  # not checked
        with peer(join, bind=f"{next_host()}:0", reachable=NO) as q:
            assert q.reachability == Verdict(False, q.address, "--reachable no", f"tcp://{join}")
    assert [r.getMessage() for r in caplog.records if "reachable" in r.getMessage()] == [q.reachability.line(q.id)]


@pytest.mark.timeout(60)
def test_a_reachable_peer_relays_for_clients_and_a_client_asked_to_relay_says_it_cannot(
    coordinator_factory: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """``relay=True``: a reachable peer relays and its membership entry says so, and a client (here
    ``reachable=no``) takes it as its relay over the coordinator; a client asked to relay warns and does not."""
    join = join_of(coordinator_factory)
    with caplog.at_level(logging.INFO, logger="gossiptrain.runtime"):
        with peer(join, bind=f"{next_host()}:0", relay=True) as relay:
            assert relay._node is not None and relay._node.me.relay and relay._transport is not None
            assert relay._transport.relaying is not None
            with peer(join, bind=f"{next_host()}:0", reachable=NO, relay=True) as client:
                assert client._node is not None and not client._node.me.relay and client._transport is not None
                assert client._transport.relaying is None
                wait_for(lambda: client._transport.relay == relay.address, 10,  # type: ignore[union-attr]
                         "the client to take the relaying peer as its relay")
    said = [r.getMessage() for r in caplog.records]
    assert any(m.startswith("relaying between peers behind NAT (--relay)") for m in said), said
    assert any(m.startswith("not relaying (--relay): behind NAT") for m in said), said
    assert any(f"through member {relay.id}'s relay at {relay.address}" in m for m in said), said


@pytest.mark.timeout(90)
def test_the_cli_peer_prints_one_line_when_nobody_can_dial_it(procs: Procs, coordinator_factory: Any) -> None:
    join = coordinator_factory(fast_config(**{"membership.join_timeout": 1.0})).address.removeprefix("tcp://")
    nobody = next_host()
    p = procs.peer(join, "--advertise", nobody)
    procs.wait_for(lambda: "is not reachable" in p.output(), 60, "the peer to say it is not reachable")
    lines = [line for line in p.output().splitlines() if "reachable" in line]
    assert len(lines) == 1 and f"at tcp://{nobody}:" in lines[0] and "set --advertise" in lines[0], lines
