"""The live terminal: log lines above the progress line, never on it, and a line per membership change.

What a terminal shows is rebuilt from the bytes written (``screen``: a
carriage return goes back to the start of the row, a newline starts the next
one), so the tests check what a person would see. No real processes: peer
nodes run on a simulated network in virtual time, and the CLI peer's loop
runs with a small fake ``Peer``.
"""

from __future__ import annotations

import asyncio
import io
import logging
import random
import sys
from typing import Any, Callable, Iterator

import pytest

from gossiptrain.config import RunConfig
from gossiptrain.net.transport.sim import LinkProfile, SimNetwork, SimTransport
from gossiptrain.protocol.member import Member
from gossiptrain.runtime.peer_network import MEMBER_EVENTS, PeerNode
from gossiptrain.sim.vtime import LoopClock, run_virtual
from gossiptrain.train import peer_loop
from gossiptrain.train.peer_loop import PeerOptions, run_peer
from gossiptrain.train.progress import Progress


class FakeTTY(io.StringIO):
    def isatty(self) -> bool:
        return True


def screen(written: str) -> list[str]:
    """The rows a terminal shows after ``written`` (carriage returns overwrite from the start of the row)."""
    rows: list[list[str]] = [[]]
    col = 0
    for ch in written:
        if ch == "\r":
            col = 0
        elif ch == "\n":
            rows.append([])
            col = 0
        else:
            row = rows[-1]
            row.extend(" " * (col - len(row) + 1) if col >= len(row) else "")
            row[col] = ch
            col += 1
    out = ["".join(r).rstrip() for r in rows]
    return out[:-1] if out and not out[-1] else out


@pytest.fixture
def root_handler() -> Iterator[Callable[[io.StringIO], logging.StreamHandler]]:
    """A root StreamHandler on a given stream, as ``gossiptrain``'s logging set-up makes one; removed afterwards."""
    added: list[logging.Handler] = []

    def add(stream: io.StringIO) -> logging.StreamHandler:
        h = logging.StreamHandler(stream)
        h.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
        logging.getLogger().addHandler(h)
        added.append(h)
        return h

    try:
        yield add
    finally:
        for h in added:
            logging.getLogger().removeHandler(h)


def test_a_log_line_goes_above_the_live_line_which_is_drawn_again(root_handler: Any) -> None:
    tty = FakeTTY()
    handler = root_handler(tty)
    progress = Progress(tty)
    progress.update("peer p0a1 | step 10 | peers 3")
    with progress.logs_above():
        logging.getLogger("gossiptrain.runtime.peer").warning("could not announce our leave")
        progress.update("peer p0a1 | step 11 | peers 3")
    assert screen(tty.getvalue()) == [
        "WARNING gossiptrain.runtime.peer: could not announce our leave",
        "peer p0a1 | step 11 | peers 3",
    ]
    assert handler.stream is tty  # put back on the way out
    logging.getLogger("gossiptrain.runtime.peer").warning("after")
    assert tty.getvalue().endswith("after\n")


def test_member_events_of_this_peer_become_plain_lines_once(root_handler: Any) -> None:
    tty = FakeTTY()
    root_handler(tty)
    events = logging.getLogger(MEMBER_EVENTS)
    before = (events.level, events.propagate)
    progress = Progress(tty)
    progress.update("peers 2")
    with progress.logs_above(MEMBER_EVENTS, accept=lambda r: getattr(r, "peer_id", None) == "p0a1"):
        events.info("member %s joined", "p3a1", extra={"peer_id": "p0a1"})
        events.info("member %s joined", "p3a1", extra={"peer_id": "p1a1"})  # another peer in this process
        progress.update("peers 3")
    assert screen(tty.getvalue()) == ["member p3a1 joined", "peers 3"]  # not also as a log record
    assert (events.level, events.propagate) == before


def test_off_a_terminal_lines_are_plain_and_disabled_progress_prints_nothing(root_handler: Any) -> None:
    plain = io.StringIO()
    root_handler(plain)
    progress = Progress(plain)
    progress.update("peers 2")
    with progress.logs_above(MEMBER_EVENTS):
        logging.getLogger(MEMBER_EVENTS).info("member %s left", "p3a1")
        logging.getLogger("gossiptrain.x").warning("boom")
    assert plain.getvalue().splitlines() == ["peers 2", "member p3a1 left", "WARNING gossiptrain.x: boom"]
    quiet = io.StringIO()
    with Progress(quiet, enabled=False).logs_above(MEMBER_EVENTS):
        pass
    assert quiet.getvalue() == ""


async def until(condition: Callable[[], object], what: str, timeout: float) -> None:
    """Poll ``condition`` on the loop's (virtual) clock."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not condition():
        if loop.time() > deadline:
            raise AssertionError(f"timed out after {timeout} s (virtual) waiting for {what}")
        await asyncio.sleep(0.05)


def test_peer_nodes_say_who_joined_left_and_died_on_the_terminal() -> None:
    """Three peer nodes with the default settings; one leaves, one is killed (closed without a leave)."""
    tty = FakeTTY()
    progress = Progress(tty)
    config = RunConfig()

    async def main() -> None:
        network = SimNetwork(LinkProfile(latency=0.001))
        clock = LoopClock()
        started: list[tuple[SimTransport, PeerNode]] = []

        async def start(name: str, incarnation: int, seeds: list[Member]) -> PeerNode:
            t = await SimTransport(f"sim://{name}", config.limits, network=network).start()
            n = PeerNode(
                me=Member(name, t.address, 0, incarnation), config=config, transport=t, clock=clock,
                rng=random.Random(incarnation), spec=None, seeds=seeds,
            )
            started.append((t, await n.start()))
            return n

        async def kill(n: PeerNode) -> None:
            t = next(t for t, node in started if node is n)
            await n.close("killed")
            await t.close("killed")

        try:
            a = await start("p0a1", 10, [])
            progress.update("peers 1")
            b = await start("p1a1", 20, [a.me])
            c = await start("p2a1", 30, [a.me])
            await until(lambda: all(len(n.view()) == 3 for n in (a, b, c)), "3 members everywhere", 30)
            progress.update("peers 3")
            await c.leave()
            await kill(c)
            await until(lambda: len(a.view()) == 2, "the leave", 30)
            await kill(b)
            await until(lambda: len(a.view()) == 1, "the death", 30)
            progress.update("peers 1")
        finally:
            for t, n in started:
                await n.close("test over")
                await t.close("test over")

    with progress.logs_above(MEMBER_EVENTS, accept=lambda r: getattr(r, "peer_id", None) == "p0a1"):
        run_virtual(main())
    rows = screen(tty.getvalue())
    assert rows[-1] == "peers 1"
    members = [r for r in rows[:-1] if r.startswith("member ")]
    assert sorted(members[:2]) == ["member p1a1 joined", "member p2a1 joined"]
    assert members[2:] == ["member p2a1 left", "member p1a1 died (suspected by p0a1)"]
    assert all(r == "peers 1" or r.startswith("member ") for r in rows)  # nothing else, nothing run together


class FakePeer:
    """Enough of ``Peer`` for the CLI loop: a few steps, then a final phase during which the swarm changes."""

    def __init__(self, build: Any, **kwargs: Any) -> None:
        self.config = RunConfig().with_overrides({"train.workload": "logreg", "train.max_steps": 5})
        self.id, self.shard, self.address, self.fingerprint = "p0a1", 0, "tcp://127.0.0.1:1", self.config.fingerprint()
        self.model = build(self.config, self.shard)
        self.optimizer = kwargs["optimizer"](self.config, self.model)
        self.steps = 0
        self.finish_requested = False
        self.taken_from_swarm: list[str] = []

    def __enter__(self) -> "FakePeer":
        return self

    def __exit__(self, *exc_info: Any) -> None:
        pass

    def transfer_summary(self) -> dict[str, Any]:
        return {"state_transfer": "none"}

    def stats(self) -> dict[str, Any]:
        return {"staleness_hist": [], "rtt_hist": {}, "members": 3} | {k: 0 for k in (
            "completed", "served", "timeouts", "refused", "crossed", "busy", "staleness_mean", "rtt_ms", "bytes_sent",
            "bytes_received", "bad_messages", "wrong_run", "rejected", "handshake_failures", "members_dead", "members_left",
            "waited_s", "compression_level", "gossip_refused", "messages_received", "received_over_own", "sent_over_routes",
            "received_relayed", "presumed_lost", "in_flight_most", "relayed", "relay_dropped", "suspicions",
        )}

    def step(self, samples_seen: int | None = None) -> None:
        self.steps += 1

    def report(self, **numbers: float | None) -> None:
        pass

    def agree(self, flag: bool) -> bool:
        return flag

    def finish(self, reason: str, final_model: Any = None, abort: Any = None) -> Any:
        # What the network thread logs while the live line shows the final phase.
        events = logging.getLogger(MEMBER_EVENTS)
        events.info("member %s joined", "p9a1", extra={"peer_id": self.id})
        logging.getLogger("gossiptrain.runtime.final_phase").warning("p9a1 still training after final.wait_seconds")
        events.info("member %s died (suspected by %s)", "p9a1", "p0a1", extra={"peer_id": self.id})
        events.info("member %s left", "p8a1", extra={"peer_id": "p1a1"})  # another peer's view: not ours to print

        class Report:
            def to_record(self) -> dict[str, Any]:
                return {"finish": reason}

        return Report()


def test_the_cli_peer_prints_member_lines_and_log_lines_off_its_progress_line(
    monkeypatch: pytest.MonkeyPatch, root_handler: Any
) -> None:
    tty = FakeTTY()
    monkeypatch.setattr(sys, "stderr", tty)
    root_handler(tty)  # as `gossiptrain peer` sets logging up: WARNING and above to stderr
    monkeypatch.setattr(peer_loop, "Peer", FakePeer)
    summary = run_peer(PeerOptions(join="127.0.0.1:1"))
    assert summary["event"] == "done" and summary["step"] == 5
    rows = screen(tty.getvalue())
    assert rows[:4] == [
        "member p9a1 joined",
        "WARNING gossiptrain.runtime.final_phase: p9a1 still training after final.wait_seconds",
        "member p9a1 died (suspected by p0a1)",
        rows[3],
    ]
    assert rows[3].startswith("peer p0a1 shard 0/") and "peers 3" in rows[3]  # the live line, drawn again below them
    assert rows[-1].startswith("peer p0a1 done: 5 steps")
    assert not any("p8a1" in r for r in rows)
