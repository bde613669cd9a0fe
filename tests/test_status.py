"""`gossiptrain status`: members answer for themselves, within a rate, with bounded answers; the table and totals."""

from __future__ import annotations

import asyncio
import json
import math
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gossiptrain.cli.main import main
from gossiptrain.cli.status import render
from gossiptrain.config import Limits
from gossiptrain.errors import ProtocolError
from gossiptrain.net.wire import Message, decode, encode
from gossiptrain.protocol.status import DONE, MAX_PARTNERS, PHASES, MemberStatus, RecentRate, StatusAnswerer
from gossiptrain.runtime.loop_thread import new_event_loop
from gossiptrain.runtime.swarm_client import SwarmClient
from gossiptrain.runtime.swarm_status import STUCK_AFTER_S, MemberRow, member_state, summarize

from .conftest import fast_config
from .swarm import Procs

ids = st.text("abcdef0123456789", min_size=1, max_size=20)
counts = st.integers(0, 2**62)
amounts = st.floats(0, 1e12, allow_nan=False)
statuses = st.builds(
    MemberStatus, ids, st.just("tcp://127.0.0.1:1"), phase=st.sampled_from(PHASES), shard=counts, step=counts,
    samples=counts, members=counts, exchanges=counts, exchanges_per_s=amounts, bytes_sent=counts, bytes_received=counts,
    staleness_mean=amounts, rtt_ms=amounts, idle_s=amounts, uptime_s=amounts,
    loss=st.none() | st.floats(-1e6, 1e6, allow_nan=False), test_loss=st.none() | amounts, test_acc=st.none() | st.floats(0, 1),
    partners=st.lists(ids, max_size=MAX_PARTNERS).map(tuple),
)


@given(statuses)
def test_a_status_survives_the_wire(status: MemberStatus) -> None:
    limits = Limits()
    frames = encode(Message("status", status.id, status.addr, "fp", 0, status.to_body()), limits)
    msg = decode(frames, limits)
    assert MemberStatus.from_body(msg.sender, status.addr, msg.body) == status


@given(statuses, st.sampled_from(["step", "bytes_sent", "idle_s", "phase", "partners", "test_acc"]),
       st.sampled_from([-1, "7", None, math.inf, math.nan, ["x"] * (MAX_PARTNERS + 1), "sleeping", True]))
def test_a_malformed_status_is_a_protocol_error(status: MemberStatus, field: str, bad: Any) -> None:
    body = status.to_body()
    if field == "test_acc" and bad is None:
        return  # None is "not reported": valid
    body[field] = bad
    with pytest.raises(ProtocolError):
        MemberStatus.from_body(status.id, status.addr, body)


def test_answers_are_rate_limited_per_source_and_carry_the_rate_and_uptime() -> None:
    limits = Limits()
    answerer = StatusAnswerer(limits, started=100.0)
    fields = {"phase": "training", "step": 5, "samples": 160, "exchanges": 20, "staleness_mean": 0.123456,
              "rtt_ms": 3.0, "idle_s": 0.0, "shard": 1, "members": 3, "bytes_sent": 10, "bytes_received": 20}
    answered = [answerer.answer("ip 127.0.0.5", 110.0, fields) for _ in range(limits.join_burst * 3)]
    assert sum(a is not None for a in answered) == limits.join_burst  # a flood from one source: the burst, no more
    assert answerer.throttled == 2 * limits.join_burst
    assert answerer.answer("ip 127.0.0.6", 110.0, fields) is not None  # another source is not starved by it
    body = answered[0]
    assert body is not None and body["uptime_s"] == 10.0 and body["exchanges_per_s"] == 2.0  # 20 in 10 s
    assert body["staleness_mean"] == 0.1235  # rounded: answers stay small


def test_the_exchange_rate_is_over_the_last_window() -> None:
    rate = RecentRate(started=0.0)
    assert rate.update(0.5, 10) == 20.0  # less than a window since the start: the mean so far
    assert rate.update(2.0, 40) == 20.0
    assert rate.update(2.5, 1000) == 20.0  # inside the window: the last value
    assert rate.update(4.0, 100) == 30.0  # (100 - 40) / 2 s


def _row(mid: str, step: int, state: str = "alive", **kw: Any) -> MemberRow:
    return MemberRow(mid, "tcp://127.0.0.1:1", 0, state, 0.0, MemberStatus(mid, "tcp://127.0.0.1:1", step=step, **kw))


def test_states_totals_and_who_lags() -> None:
    status = MemberStatus("a", "x", idle_s=STUCK_AFTER_S + 1)
    assert member_state("alive", status, answered_now=True) == "stuck"
    assert member_state("suspect", status, answered_now=True) == "suspect"
    assert member_state("alive", status, answered_now=False) == "no answer"
    assert member_state("alive", MemberStatus("a", "x", phase=DONE), answered_now=True) == "done"
    rows = (_row("a", 100, test_acc=0.9, bytes_sent=2_000_000), _row("b", 95, test_acc=0.8), _row("c", 50),
            _row("gone", 1, state="gone"))
    totals, steps = summarize(rows)
    assert totals["steps"] == 245 and totals["mean_test_acc"] == 0.85 and totals["mb_sent"] == 2.0
    assert steps == {"min": 50, "median": 95, "max": 100, "lagging": ["c"]}  # 50 < 0.8 x 95; the gone member counts not
    text = render({"run": "fp", "answered_by": "a", "stopping": False,
                   "members": [r.to_dict() for r in rows], "totals": totals, "steps": steps})
    assert "lagging: c" in text and text.count("\n") == 1 + 4 + 2
    assert totals["lease_epoch"] is None  # fixed shards: no data epoch
    leased = (_row("a", 10, lease_epoch=3, lease_chunks_done=40), _row("b", 10, lease_epoch=4, lease_chunks_done=2))
    assert summarize(leased)[0]["lease_epoch"] == 4  # the furthest member's view: epochs only advance


def test_the_table_says_which_members_relay_and_which_are_behind_nat() -> None:
    relay = MemberRow("r", "tcp://127.0.0.2:1", 0, "alive", 0.0, None, relay=True)
    client = MemberRow("c", "tcp://127.0.0.3:1/client", 1, "alive", 0.0, None)
    plain = MemberRow("p", "tcp://127.0.0.4:1", 2, "alive", 0.0, None)
    assert [r.to_dict()["role"] for r in (relay, client, plain)] == ["relay", "client", None]
    totals, steps = summarize((relay, client, plain))
    lines = render({"run": "fp", "answered_by": "r", "stopping": False, "members": [r.to_dict() for r in (relay, client, plain)],
                    "totals": totals, "steps": steps}).splitlines()
    at = lines[1].index("ROLE")
    assert [line[at:].split()[0] for line in lines[2:5]] == ["relay", "client", "-"], lines


def _status_json(join: str, capsys: pytest.CaptureFixture[str]) -> dict[str, Any]:
    assert main(["status", "--join", join, "--json", "--timeout", "5"]) == 0
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_status_lists_every_live_member_of_a_real_swarm_with_rising_steps(
    procs: Procs, coordinator_factory: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    coord = coordinator_factory(fast_config(**{"train.shards": 3, "train.max_steps": 0, "train.max_seconds": 120}))
    join = coord.address.removeprefix("tcp://")
    for _ in range(3):
        procs.peer(join)

    def all_training() -> dict[str, Any] | None:
        got = _status_json(join, capsys)
        # each member's own view full too: one that just started may still know 2 (membership converging)
        ok = len(got["members"]) == 3 and all(m["state"] == "alive" and m["step"] > 0 and m["members"] == 3
                                              for m in got["members"])
        return got if ok else None

    first = procs.wait_for(all_training, 90, "three members training, as status shows them")
    assert {m["shard"] for m in first["members"]} == {0, 1, 2}
    assert all(m["addr"].startswith("tcp://127.") and m["members"] == 3 for m in first["members"])

    def later() -> dict[str, Any] | None:
        got = _status_json(join, capsys)
        steps = {m["id"]: m["step"] for m in got["members"]}
        evaluated = all(m.get("test_acc") is not None for m in got["members"])  # the CLI peer reports its evaluations
        return got if evaluated and all(steps.get(m["id"], 0) > m["step"] for m in first["members"]) else None

    second = procs.wait_for(later, 60, "every member's step to rise, and each to report an evaluation")
    assert second["totals"]["answered"] == 3 and second["totals"]["exchanges_per_s"] > 0
    assert 0 <= second["totals"]["mean_test_acc"] <= 1
    # Any member answers the roster query as well as the coordinator does.
    member = first["members"][0]["addr"].removeprefix("tcp://")
    assert {m["id"] for m in _status_json(member, capsys)["members"]} == {m["id"] for m in first["members"]}


def test_a_flood_of_status_asks_is_answered_within_its_rate_and_training_goes_on(
    procs: Procs, coordinator_factory: Any
) -> None:
    """500 asks in a moment from one source: a burst is answered, the peer trains on and answers later polls."""
    coord = coordinator_factory(fast_config(**{"train.shards": 1, "train.max_steps": 0, "train.max_seconds": 120}))
    join = coord.address.removeprefix("tcp://")
    peer = procs.peer(join)
    procs.wait_for(lambda: (r := peer.latest()) is not None and r.get("step", 0) > 0, 90, "the peer to train")
    limits = Limits()

    async def flood() -> tuple[int, float, int, int, str]:
        async with SwarmClient(join) as client:
            roster = await client.query()
            (member,) = roster.members
            before = (await client.statuses([member], timeout=5))[member.id].step
            answers = 0

            def count(msg: Message, frames: object) -> None:
                nonlocal answers
                answers += 1

            assert client._net is not None
            client._net.handlers["status"] = count  # a visitor that floods and counts what comes back
            loop = asyncio.get_running_loop()
            began = loop.time()
            sent = 0
            while sent < 500 and loop.time() - began < 30:  # as fast as our send queue (8 messages) lets them go
                sent += sum(client._send(member.addr, "status-ask", {}) for _ in range(8))
                await asyncio.sleep(0.002)
            while answers < 1 and loop.time() - began < 30:
                await asyncio.sleep(0.01)
            # Answers only ever add up: at any moment they are at most the burst and what the rate refilled since.
            # (Fewer may come: the peer's send queue to us holds 8, and what does not fit is dropped, not queued.)
            bound = limits.join_burst + limits.join_rate_per_source * (loop.time() - began)
            return answers, bound, sent, before, member.id

    with asyncio.Runner(loop_factory=new_event_loop) as runner:
        answers, bound, sent, before, member_id = runner.run(flood())
    assert 1 <= answers <= bound < sent / 2
    later = procs.wait_for(
        lambda: (got := [m for m in _poll(join) if m.id == member_id]) and got[0].step > before and got[0], 60,
        "the peer to answer a later poll with a higher step",
    )
    assert later.phase == "training"


def _poll(join: str) -> list[MemberStatus]:
    async def once() -> list[MemberStatus]:
        async with SwarmClient(join) as client:
            roster = await client.query()
            return list((await client.statuses(list(roster.members), timeout=5)).values())

    with asyncio.Runner(loop_factory=new_event_loop) as runner:
        return runner.run(once())
