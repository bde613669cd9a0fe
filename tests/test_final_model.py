"""The merged model and the end of a run.

Sans IO first (the weighted mean, the file, the stop/fin/query endpoint, the
final phase's schedule), then real processes on loopback: `gossiptrain
export` from a running swarm, and `gossiptrain stop` ending one.
"""

from __future__ import annotations

import asyncio
import json
import os
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as hs

from gossiptrain.cli.main import main
from gossiptrain.config import FinalConfig, MembershipConfig, RunConfig
from gossiptrain.errors import CheckpointError, ConfigError, ProtocolError
from gossiptrain.net.kinds import FIN, QUERY, ROSTER, STOP
from gossiptrain.net.wire import Message
from gossiptrain.protocol.finish import DONE, WRITTEN, Announce, Event, FinishEndpoint, FinNotice
from gossiptrain.protocol.member import Member
from gossiptrain.runtime.final_phase import FinalPhase, finish_event
from gossiptrain.runtime.peer import Peer
from gossiptrain.runtime.swarm_client import SwarmClient
from gossiptrain.state import merged_model as fm
from gossiptrain.testing.membership_cluster import Cluster
from gossiptrain.train.workload import load_workload

from .conftest import fast_config
from .swarm import Procs, next_host, wait_for

# -- the weighted mean ---------------------------------------------------------------------


def states(values: list[list[float]]) -> list[dict[str, torch.Tensor]]:
    return [{"w": torch.tensor(v, dtype=torch.float32)} for v in values]


members = hs.integers(1, 5).flatmap(
    lambda n: hs.tuples(
        hs.lists(
            hs.lists(hs.floats(-1e6, 1e6, allow_nan=False, width=32), min_size=4, max_size=4), min_size=n, max_size=n
        ),
        hs.lists(hs.integers(1, 10**6), min_size=n, max_size=n),
    )
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(members)
def test_the_mean_is_weighted_by_samples_and_stays_within_the_members(case: tuple[list[list[float]], list[int]]) -> None:
    values, samples = case
    mean = fm.WeightedMean()
    for s, n in zip(states(values), samples):
        mean.add(s, n)
    got = mean.result()["w"]
    assert got.dtype == torch.float32
    x = torch.tensor(values, dtype=torch.float64)  # (members, 4)
    w = torch.tensor(samples, dtype=torch.float64)
    expected = (w[:, None] * x).sum(0) / w.sum()
    torch.testing.assert_close(got.double(), expected, rtol=1e-6, atol=1e-6)
    lo, hi = torch.tensor(values, dtype=torch.float32).min(0).values, torch.tensor(values, dtype=torch.float32).max(0).values
    assert bool(((lo <= got) & (got <= hi)).all()), (got, lo, hi)


@settings(max_examples=100, deadline=None)
@given(members, hs.integers(1, 10**6))
def test_equal_samples_give_the_plain_mean(case: tuple[list[list[float]], list[int]], samples: int) -> None:
    values, _ = case
    weighted, plain = fm.WeightedMean(), fm.WeightedMean()
    for s in states(values):
        weighted.add(s, samples)
        plain.add(s, 0)  # nobody reports samples: equal weights
    expected = torch.tensor(values, dtype=torch.float64).mean(0).float()
    torch.testing.assert_close(weighted.result()["w"], expected, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(plain.result()["w"], expected, rtol=1e-6, atol=1e-6)


def test_integer_tensors_come_from_the_member_with_most_samples_and_tables_must_agree() -> None:
    mean = fm.WeightedMean()
    mean.add({"w": torch.zeros(2), "n": torch.tensor(5)}, 10)
    mean.add({"w": torch.ones(2), "n": torch.tensor(9)}, 30)
    mean.add({"w": torch.ones(2), "n": torch.tensor(7)}, 20)
    out = mean.result()
    assert list(out) == ["w", "n"] and int(out["n"]) == 9 and torch.allclose(out["w"], torch.full((2,), 50 / 60))
    for other in ({"w": torch.zeros(3), "n": torch.tensor(1)}, {"w": torch.zeros(2, dtype=torch.float64), "n": torch.tensor(1)},
                  {"w": torch.zeros(2)}):
        with pytest.raises(ValueError, match="differ"):
            mean.add(other, 1)
    with pytest.raises(ValueError):
        fm.WeightedMean().result()


# -- the file --------------------------------------------------------------------------------


def write(path: Path, value: float = 1.0) -> fm.MergedInfo:
    tensors = {"layer.weight": torch.full((3, 2), value), "layer.bias": torch.zeros(3), "count": torch.tensor(4)}
    members = [fm.MemberInfo("p1", 100, 10, "a" * 64), fm.MemberInfo("p2", 300, 12)]
    return fm.write_merged(path, tensors, members=members, skipped=[("p3", "left")], fingerprint="f" * 16, written_by="t")


def test_the_merged_model_and_its_metadata_are_written_and_read_back(tmp_path: Path) -> None:
    info = write(tmp_path / "out" / "merged.safetensors")
    assert info.metadata == tmp_path / "out" / "merged.json"
    assert sorted(os.listdir(tmp_path / "out")) == ["merged.json", "merged.safetensors"]  # no temporary file left
    tensors, meta = fm.read_merged(info.path)
    assert torch.equal(tensors["layer.weight"], torch.ones(3, 2)) and int(tensors["count"]) == 4
    assert meta["members"] == [
        {"id": "p1", "samples": 100, "step": 10, "digest": "a" * 64}, {"id": "p2", "samples": 300, "step": 12, "digest": ""},
    ]
    assert meta["skipped"] == [{"id": "p3", "reason": "left"}] and meta["samples"] == 400 and meta["fingerprint"] == "f" * 16
    assert meta["sha256"] == info.sha256 and meta["bytes"] == info.path.stat().st_size
    assert fm.metadata_path("model.bin") == Path("model.bin.json")


def test_a_corrupt_or_truncated_merged_model_is_refused(tmp_path: Path) -> None:
    info = write(tmp_path / "merged.safetensors")
    data = bytearray(info.path.read_bytes())
    data[-1] ^= 1
    info.path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="SHA-256"):
        fm.read_merged(info.path)
    info.path.write_bytes(bytes(data[:-5]))
    with pytest.raises(CheckpointError, match="truncated"):
        fm.read_merged(info.path)


def test_a_failed_write_leaves_the_previous_merged_model_whole(tmp_path: Path, monkeypatch: Any) -> None:
    path = tmp_path / "merged.safetensors"
    write(path, 1.0)
    before = (path.read_bytes(), fm.metadata_path(path).read_bytes())
    calls = []

    def failing_replace(src: Any, dst: Any) -> None:
        calls.append(dst)
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", failing_replace)
    with pytest.raises(CheckpointError, match="No space left"):
        write(path, 2.0)
    monkeypatch.undo()
    assert calls and (path.read_bytes(), fm.metadata_path(path).read_bytes()) == before
    tensors, _ = fm.read_merged(path)
    assert torch.equal(tensors["layer.weight"], torch.ones(3, 2))


def test_final_settings_name_the_field() -> None:
    with pytest.raises(ConfigError, match=r"final\.consensus_seconds"):
        FinalConfig(consensus_seconds=-1)
    with pytest.raises(ConfigError, match=r"final\.merge_seconds"):
        RunConfig().with_overrides({"final.merge_seconds": "0"})
    assert RunConfig().with_overrides({"final.wait_seconds": "3"}).final.wait_seconds == 3.0


# -- stop, fin and query, sans IO ------------------------------------------------------------


CONFIG = RunConfig()
FP = CONFIG.fingerprint()


class Driven:
    """A FinishEndpoint fed as the runtime feeds it: messages turned into events, the actions' sends collected."""

    def __init__(self, machine: FinishEndpoint, sent: list[tuple[str, str, dict[str, Any]]]) -> None:
        self.machine, self.sent = machine, sent

    def handle(self, event: Event) -> None:
        self.sent.extend((a.addr, a.kind, a.body) for a in self.machine.handle(event, 0.0))

    def on_message(self, m: Message) -> None:
        self.handle(finish_event(m))  # no frames: the source is the claimed address, as on sim://

    def announce(self, phase: str, writer: bool, everyone: bool = True) -> None:
        self.handle(Announce(phase, writer, everyone))

    @property
    def stop(self) -> Any:
        return self.machine.stop

    @property
    def stats(self) -> Any:
        return self.machine.stats

    @property
    def done(self) -> dict[str, bool]:
        return self.machine.done

    @property
    def written(self) -> set[str]:
        return self.machine.written


def endpoint(me: str, view: list[str]) -> tuple[Driven, list[tuple[str, str, dict[str, Any]]]]:
    sent: list[tuple[str, str, dict[str, Any]]] = []
    members = [Member(m, f"tcp://127.0.0.1:{1000 + i}", 0, 1) for i, m in enumerate(view)]
    return Driven(FinishEndpoint(CONFIG, me=me, members=lambda: members), sent), sent


def msg(kind: str, sender: str, body: dict[str, Any], fp: str = FP) -> Message:
    return Message(kind, sender, f"tcp://127.0.0.9:{len(sender)}", fp, 0, body)


def test_a_stop_is_forwarded_once_to_everyone_and_a_tool_gets_an_answer() -> None:
    e, sent = endpoint("a", ["a", "b", "c"])
    e.on_message(msg(STOP, "visitor-1", {"id": 7, "reason": "gossiptrain stop"}))
    assert e.stop is not None and e.stop.reason == "gossiptrain stop" and e.stop.origin == "visitor-1"
    assert [(addr, k) for addr, k, _ in sent] == [
        ("tcp://127.0.0.9:9", ROSTER), ("tcp://127.0.0.1:1001", STOP), ("tcp://127.0.0.1:1002", STOP)
    ]
    assert sent[0][2]["stopping"] is True and [m[0] for m in sent[0][2]["members"]] == ["a", "b", "c"]
    sent.clear()
    e.on_message(msg(STOP, "b", {"id": 7, "reason": "gossiptrain stop"}))  # the same stop again, from a member
    assert sent == [] and e.stats.stops_received == 2
    e2, sent2 = endpoint("b", ["a", "b", "c"])
    e2.on_message(msg(STOP, "a", {"id": 7, "reason": "x"}))
    assert [(a[-4:], k) for a, k, _ in sent2] == [("1002", STOP)]  # not back to the member it came from


def test_queries_are_answered_without_the_run_and_stops_need_it() -> None:
    e, sent = endpoint("a", ["a", "b"])
    e.on_message(msg(QUERY, "", {}, fp=""))
    ((addr, kind, body),) = sent
    assert kind == ROSTER and body["fingerprint"] == FP and body["stopping"] is False
    assert RunConfig.from_dict(body["config"]) == CONFIG
    for bad in (msg(STOP, "x", {"id": 7, "reason": "r"}, fp="other"), msg(STOP, "x", {"id": 0, "reason": "r"}),
                msg(STOP, "x", {"id": "7", "reason": "r"}), msg(FIN, "x", {"phase": "later", "writer": False}),
                msg(FIN, "x", {"phase": DONE}), msg(ROSTER, "x", {})):
        with pytest.raises(ProtocolError):
            e.on_message(bad)
    assert e.stop is None


def test_queries_are_rate_limited_per_source() -> None:
    e, sent = endpoint("a", ["a"])
    for _ in range(CONFIG.limits.join_burst + 10):
        e.on_message(msg(QUERY, "", {}, fp=""))
    assert len(sent) == CONFIG.limits.join_burst and e.stats.queries_throttled == 10


def test_fin_notices_are_recorded() -> None:
    e, _ = endpoint("a", ["a", "b", "c"])
    e.on_message(msg(FIN, "b", {"phase": DONE, "writer": True}))
    e.on_message(msg(FIN, "c", {"phase": DONE, "writer": False}))
    assert e.done == {"b": True, "c": False} and not e.written
    e.on_message(msg(FIN, "b", {"phase": WRITTEN, "writer": True}))
    assert e.written == {"b"}


def test_announcements_reach_everyone_once_then_remind_only_those_not_done() -> None:
    e, sent = endpoint("a", ["a", "b", "c"])
    e.on_message(msg(STOP, "b", {"id": 9, "reason": "r"}))
    sent.clear()
    e.announce(DONE, True)
    assert sorted((a[-4:], k) for a, k, _ in sent) == [("1001", FIN), ("1001", STOP), ("1002", FIN), ("1002", STOP)]
    assert e.done["a"] is True
    sent.clear()
    e.on_message(msg(FIN, "b", {"phase": DONE, "writer": False}))
    e.announce(DONE, True, everyone=False)
    assert sorted((a[-4:], k) for a, k, _ in sent) == [("1002", FIN), ("1002", STOP)]  # b said it is done
    sent.clear()
    e.on_message(msg(FIN, "c", {"phase": DONE, "writer": False}))
    e.announce(DONE, True, everyone=False)
    assert sent == []  # everyone done: reminders cost nothing


# -- the final phase's schedule, sans IO -----------------------------------------------------


class Schedule:
    """A FinalPhase whose idle steps advance a fake clock by 0.1 s and may deliver notices."""

    def __init__(self, view: list[str], config: FinalConfig, events: dict[float, Any] | None = None) -> None:
        self.t = 0.0
        self.view = view
        self.endpoint, self.sent = endpoint("a", view)
        self.events = dict(events or {})
        self.notices: list[tuple[float, str, bool, bool]] = []
        self.phase = FinalPhase(
            config, me="a", endpoint=self.endpoint.machine, view=lambda: self.view, idle=self.idle,
            notify=lambda p, w, e: self.notices.append((round(self.t, 3), p, w, e)), renotify_every=0.5, clock=lambda: self.t,
        )

    def idle(self) -> None:
        self.t = round(self.t + 0.1, 6)
        for at in [at for at in self.events if at <= self.t]:
            self.events.pop(at)(self)


def test_a_finished_peer_waits_for_the_others_then_averages_then_leaves() -> None:
    def b_done(s: Schedule) -> None:
        s.endpoint.on_message(msg(FIN, "b", {"phase": DONE, "writer": False}))

    s = Schedule(["a", "b"], FinalConfig(wait_seconds=10, consensus_seconds=1.0), {2.0: b_done})
    report = s.phase.run("budget")
    assert report.all_done and report.waited_seconds == pytest.approx(2.0) and report.consensus_seconds == pytest.approx(1.0)
    assert report.seconds == pytest.approx(3.0) and report.rounds == 30
    assert s.notices[0] == (0.0, DONE, False, True) and len(s.notices) >= 6  # reminded every 0.5 s
    assert {e for _, _, _, e in s.notices[1:]} == {False}  # reminders go only to those not done


def test_the_wait_is_bounded_and_a_lone_peer_does_not_wait_or_average() -> None:
    s = Schedule(["a", "b"], FinalConfig(wait_seconds=1.0, consensus_seconds=0.5))
    report = s.phase.run("budget")
    assert not report.all_done and report.seconds == pytest.approx(1.5)
    alone = Schedule(["a"], FinalConfig(wait_seconds=10, consensus_seconds=5)).phase.run("stop")
    assert alone.all_done and alone.seconds == 0 and alone.rounds == 0


def test_members_stay_until_the_writer_has_written() -> None:
    def done(s: Schedule) -> None:
        s.endpoint.on_message(msg(FIN, "w", {"phase": DONE, "writer": True}))

    def written(s: Schedule) -> None:
        s.endpoint.on_message(msg(FIN, "w", {"phase": WRITTEN, "writer": True}))

    s = Schedule(["a", "w"], FinalConfig(wait_seconds=10, consensus_seconds=1.0, merge_seconds=30), {0.5: done, 4.0: written})
    report = s.phase.run("stop")
    assert report.seconds == pytest.approx(4.0)
    left = Schedule(["a", "w"], FinalConfig(wait_seconds=10, consensus_seconds=1.0, merge_seconds=30), {0.5: done})
    left.events[3.0] = lambda s: setattr(s, "view", ["a"])  # the writer left (or died) without saying it wrote
    assert left.phase.run("stop").seconds == pytest.approx(3.0)


def test_a_writer_merges_after_the_consensus_and_says_so() -> None:
    class Job:
        def __init__(self, s: Schedule) -> None:
            self.s, self.at = s, s.t

        def done(self) -> bool:
            return self.s.t >= self.at + 0.5

        def result(self) -> tuple[list[str], list[str]]:
            return ["a", "b"], []

    s = Schedule(["a", "b"], FinalConfig(wait_seconds=10, consensus_seconds=1.0), {0.2: lambda s: s.endpoint.on_message(
        msg(FIN, "b", {"phase": DONE, "writer": False}))})
    started: list[float] = []

    def merge() -> Job:
        started.append(s.t)
        return Job(s)

    report = s.phase.run("stop", merge, "out.safetensors")
    assert started == [pytest.approx(1.2)] and report.final_model == "out.safetensors" and report.merged_members == ["a", "b"]
    assert (pytest.approx(1.7), WRITTEN, True, True) in s.notices


def test_the_wait_for_the_others_ends_when_an_unfinished_member_is_known_dead() -> None:
    """A swarm of 3 with the default settings; one member is killed as another's budget runs out.

    The final phase reads the membership's live view at every safe point: it waits
    only until the death is known (seconds), not the whole final.wait_seconds, and a
    member already known dead is not waited for at all.
    """
    run = RunConfig()
    assert run.membership == MembershipConfig()  # the defaults a new user runs with
    c = Cluster(3, seed=11, config=run.membership)
    c.run(5.0)
    node = c.nodes["m000"]
    machine = FinishEndpoint(run, me="m000", members=node.alive)
    machine.handle(FinNotice("m002", "sim://m002", run.fingerprint(), {"phase": DONE, "writer": False}), c.now)
    c.crash("m001")  # kill -9: it never says it is done

    def phase() -> FinalPhase:
        return FinalPhase(
            run.final, me="m000", endpoint=machine, view=lambda: [m.id for m in node.alive()], idle=lambda: c.run(0.05),
            notify=lambda p, w, e: None, renotify_every=run.membership.heartbeat_interval, clock=lambda: c.now,
        )

    report = phase().run("budget")
    assert report.all_done and not report.aborted
    assert report.waited_seconds <= 5.0 < run.final.wait_seconds
    assert [m.id for m in node.alive()] == ["m000", "m002"]
    again = phase().run("budget")
    assert again.all_done and again.waited_seconds == 0


def test_a_signal_cuts_the_final_phase_short() -> None:
    s = Schedule(["a", "b"], FinalConfig(wait_seconds=10, consensus_seconds=5))
    s.phase.abort = lambda: s.t >= 0.3
    report = s.phase.run("budget")
    assert report.aborted and report.seconds == pytest.approx(0.3)


# -- in process: Peer objects and the CLI tools ------------------------------------------------


class Stepper:
    """A peer's loop in a thread: steps without training (its parameters stay put), finishes when asked to stop."""

    def __init__(self, peer: Peer, samples: int, final_model: Path | None = None) -> None:
        self.peer, self.samples, self.final_model = peer, samples, final_model
        self.report: Any = None
        self.error: BaseException | None = None
        self.halt = threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()

    def run(self) -> None:
        try:
            while not self.halt.is_set() and not self.peer.finish_requested:
                self.peer.step(samples_seen=self.samples)
                time.sleep(0.005)
            if self.peer.finish_requested:
                self.report = self.peer.finish("stop", final_model=self.final_model)
        except BaseException as e:  # re-raised by the test
            self.error = e


def linear(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Linear(8, 4)


def test_export_and_stop_merge_exactly_the_members_states_weighted_by_samples(
    coordinator_factory: Any, tmp_path: Path, capsys: Any
) -> None:
    # No exchanges and no state transfer: each member keeps its own parameters, so the merge is known exactly.
    config = fast_config(**{
        "train.workload": "external", "train.shards": 2, "gossip.exchange_every_steps": 2 * 10**9, "state.enabled": False,
        "final.consensus_seconds": 0.2,
    })
    coord = coordinator_factory(config)
    join = coord.address.removeprefix("tcp://")
    final = tmp_path / "final.safetensors"
    models = [linear(1), linear(2)]
    expected = {
        name: ((100 * models[0].state_dict()[name].double() + 300 * models[1].state_dict()[name].double()) / 400).float()
        for name in models[0].state_dict()
    }
    peers = [Peer(m, join=join, bind=f"{next_host()}:0") for m in models]
    steppers = [Stepper(peers[0], 100), Stepper(peers[1], 300, final)]
    try:
        wait_for(lambda: all(p.members == 2 for p in peers), 30, "both peers to see each other")
        out = tmp_path / "export" / "merged.safetensors"
        assert main(["export", "--join", join, "--out", str(out)]) == 0
        merged, meta = fm.read_merged(out)
        assert sorted(m["samples"] for m in meta["members"]) == [100, 300]
        assert merged.keys() == expected.keys() and all(torch.equal(merged[k], expected[k]) for k in expected)
        assert all(p.members == 2 for p in peers)  # the exporter never became a member
        printed = capsys.readouterr().out
        assert "member 2/2" in printed and f"and {out.with_suffix('.json')}: 2 members" in printed, printed  # its folder too

        peer_address = peers[0].address.removeprefix("tcp://")
        assert main(["stop", "--join", peer_address, "--reason", "test over"]) == 0  # through a peer this time
        assert "stop requested" in capsys.readouterr().out
        for s in steppers:
            s.thread.join(60)
            assert not s.thread.is_alive() and s.error is None, s.error
        reader, writer = (s.report for s in steppers)
        assert reader.reason == writer.reason == "stop" and reader.all_done and writer.all_done
        assert writer.final_model == str(final) and sorted(writer.merged_members) == sorted(p.id for p in peers)
        assert reader.final_model is None and not writer.merge_error
        written, meta = fm.read_merged(final)
        assert all(torch.equal(written[k], expected[k]) for k in expected) and meta["written_by"] == peers[1].id
        assert {m["id"]: m["samples"] for m in meta["members"]} == {peers[0].id: 100, peers[1].id: 300}
    finally:
        for s in steppers:
            s.halt.set()
        for s in steppers:
            s.thread.join(30)
        for p in peers:
            p.close()


def test_a_stop_ends_with_the_swarm_it_stopped(coordinator_factory: Any, capsys: Any) -> None:
    # One member, so no flapping: a short expiry (3 s) of the coordinator's registry keeps the test short.
    config = fast_config(**{
        "train.workload": "external", "train.shards": 1, "state.enabled": False, "final.consensus_seconds": 0.2,
        "membership.suspicion_mult": 1.0, "membership.report_interval": 0.25,
    })
    coord = coordinator_factory(config)
    join = coord.address.removeprefix("tcp://")

    def stopping() -> bool:
        assert main(["status", "--join", join, "--json"]) == 0
        return bool(json.loads(capsys.readouterr().out.splitlines()[-1])["stopping"])

    assert main(["stop", "--join", join]) == 0  # nobody to stop: the coordinator was "stopping" for good
    assert "no live member: nothing to stop" in capsys.readouterr().out
    assert not stopping()

    async def stop_anyway() -> None:  # as a tool that does not look first
        async with SwarmClient(join) as client:
            await client.query()
            await client.stop("test")

    asyncio.run(stop_anyway())
    assert not stopping()

    peer = Peer(linear(1), join=join, bind=f"{next_host()}:0")
    stepper = Stepper(peer, 100)
    try:
        wait_for(lambda: coord.coordinator.member_count == 1, 30, "the member to report")
        assert main(["stop", "--join", join]) == 0 and "passes it on to the 1 live members" in capsys.readouterr().out
        assert stopping()  # while its member finishes
        stepper.thread.join(60)
        assert not stepper.thread.is_alive() and stepper.error is None and stepper.report.reason == "stop"
    finally:
        stepper.halt.set()
        stepper.thread.join(30)
        peer.close()
    wait_for(lambda: not stopping(), 30, "the coordinator to forget the stop once its member is gone")  # was for good


def test_export_with_no_live_member_is_a_clear_failure(coordinator_factory: Any, tmp_path: Path, capsys: Any) -> None:
    coord = coordinator_factory(fast_config(**{"train.workload": "external"}))
    out = tmp_path / "merged.safetensors"
    assert main(["export", "--join", coord.address.removeprefix("tcp://"), "--out", str(out)]) == 1
    assert "knows no live member" in capsys.readouterr().err and not out.exists()


# -- real processes on loopback ---------------------------------------------------------------


def accuracy_of(tensors: dict[str, torch.Tensor], workload_name: str) -> float:
    """The test accuracy of ``tensors`` as the run's own workload's model (fast_config trains digits-small)."""
    workload = load_workload(workload_name)
    model = workload.build_model(0)
    model.load_state_dict(tensors)
    return workload.evaluate(model).accuracy


@pytest.mark.slow  # about 60 s on this loaded 2-core machine; the in-process test above covers the same path
@pytest.mark.timeout(600)
def test_export_from_a_running_swarm_then_stop_ends_it_with_the_merged_model(
    procs: Procs, coordinator_factory: Any, capsys: Any
) -> None:
    """Peers are processes; `gossiptrain export` and `stop` run in this process (the same CLI, no torch start-up twice)."""
    config = fast_config(**{
        "train.shards": 3, "train.max_steps": 0, "train.max_seconds": 300, "final.consensus_seconds": 0.5,
    })
    coord = coordinator_factory(config)
    join = coord.address.removeprefix("tcp://")
    final = procs.workdir / "final" / "merged.safetensors"
    peers = [procs.peer(join, *(["--final-model", str(final)] if i == 0 else [])) for i in range(3)]
    procs.wait_for(lambda: all((p.latest() or {}).get("test_acc", 0) >= 0.85 for p in peers), 120, "3 peers to train to 0.85")

    # Export from a running swarm: every member's state is kept too, to compare with the merged one.
    out = procs.workdir / "export" / "merged.safetensors"
    assert main(["export", "--join", join, "--out", str(out), "--members-dir", str(procs.workdir / "members")]) == 0
    printed = capsys.readouterr().out
    merged, meta = fm.read_merged(out)
    assert len(meta["members"]) == 3 and not meta["skipped"] and meta["fingerprint"] == config.fingerprint(), meta
    assert all(m["samples"] > 0 for m in meta["members"]) and "member 3/3" in printed and "3 members" in printed, printed
    workload = config.train.workload
    member_acc = [accuracy_of(fm.read_merged(p)[0], workload) for p in sorted((procs.workdir / "members").glob("*.safetensors"))]
    merged_acc = accuracy_of(merged, workload)
    assert len(member_acc) == 3 and merged_acc >= sum(member_acc) / 3, (merged_acc, member_acc)
    assert all(p.alive() for p in peers)  # exporting took nothing from the swarm

    # Stop through the coordinator: every peer runs its final phase and exits 0; peer 0 writes the merged model.
    assert main(["stop", "--join", join]) == 0
    assert "stop requested" in capsys.readouterr().out
    for p in peers:
        assert p.wait(60) == 0, p.output()[-3000:]
        (done,) = p.records("done")
        assert done["finish"] == "stop" and done["final_all_done"], done
    writer = peers[0].records("done")[0]
    assert writer["final_model"] == str(final) and sorted(writer["final_merged"]) == sorted(
        p.records("done")[0]["peer"] for p in peers), writer
    tensors, meta = fm.read_merged(final)
    assert len(meta["members"]) == 3 and meta["written_by"] == writer["peer"]
    final_acc = accuracy_of(tensors, workload)
    peers_acc = [p.records("done")[0]["test_acc"] for p in peers]
    assert final_acc >= min(peers_acc) - 0.01, (final_acc, peers_acc)  # after the consensus they are nearly one model
