"""Configuration: validation names the field; TOML, flags and the wire agree; fingerprints identify runs."""

from __future__ import annotations

from pathlib import Path

import pytest

from gossiptrain.config import ALGORITHMS, GossipConfig, Limits, MembershipConfig, RunConfig, TrainConfig
from gossiptrain.errors import ConfigError


@pytest.mark.parametrize(
    "make, field",
    [
        (lambda: TrainConfig(lr=-0.1), "train.lr"),
        (lambda: TrainConfig(lr=float("nan")), "train.lr"),
        (lambda: TrainConfig(shards=0), "train.shards"),
        (lambda: TrainConfig(momentum=1.0), "train.momentum"),
        (lambda: GossipConfig(topology="nope"), "gossip.topology"),
        (lambda: GossipConfig(algorithm="nope"), "gossip.algorithm"),
        (lambda: GossipConfig(exchange_timeout_min=2, exchange_timeout_max=1), "gossip.exchange_timeout_max"),
        (lambda: MembershipConfig(heartbeat_interval=0), "membership.heartbeat_interval"),
        (lambda: Limits(max_frame_bytes=0), "limits.max_frame_bytes"),
        (lambda: Limits(max_frame_bytes=10, max_message_bytes=5), "limits.max_message_bytes"),
    ],
)
def test_invalid_values_name_their_field(make: object, field: str) -> None:
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        make()  # type: ignore[operator]


def test_dict_round_trip_and_fingerprint() -> None:
    cfg = RunConfig().with_overrides({"train.lr": "0.1", "gossip.topology": "ring", "membership.indirect_probes": 2})
    assert cfg.train.lr == 0.1 and cfg.gossip.topology == "ring"
    again = RunConfig.from_dict(cfg.to_dict())
    assert again == cfg and again.fingerprint() == cfg.fingerprint()
    assert cfg.fingerprint() != RunConfig().fingerprint()
    assert cfg.diff(RunConfig()) == [
        "train.lr: 0.1 vs 0.05",
        "gossip.topology: 'ring' vs 'auto'",
        "membership.indirect_probes: 2 vs 3",
    ]


def test_from_dict_rejects_unknown_and_ill_typed_fields() -> None:
    with pytest.raises(ConfigError, match="unknown section"):
        RunConfig.from_dict({"trian": {}})
    with pytest.raises(ConfigError, match=r"train\.lrr"):
        RunConfig.from_dict({"train": {"lrr": 1.0}})
    with pytest.raises(ConfigError, match=r"train\.batch_size must be of type int"):
        RunConfig.from_dict({"train": {"batch_size": 3.5}})
    with pytest.raises(ConfigError, match=r"train\.shards must be of type int, got bool"):
        RunConfig.from_dict({"train": {"shards": True}})
    assert RunConfig.from_dict({"train": {"lr": 1}}).train.lr == 1.0  # ints are fine where floats are expected


def test_toml_file(tmp_path: Path) -> None:
    path = tmp_path / "run.toml"
    path.write_text('[train]\nworkload = "logreg"\nmax_steps = 10\n[gossip]\ntopology = "complete"\n')
    cfg = RunConfig.from_toml(path)
    assert cfg.train.workload == "logreg" and cfg.train.max_steps == 10 and cfg.gossip.topology == "complete"
    path.write_text("[train\n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        RunConfig.from_toml(path)
    with pytest.raises(ConfigError, match="cannot read"):
        RunConfig.from_toml(tmp_path / "missing.toml")


def test_failure_detection_timeouts_grow_with_the_swarm() -> None:
    m = MembershipConfig(heartbeat_interval=0.5, suspicion_mult=4, suspicion_max_mult=6)
    assert m.suspicion_timeout(1) == pytest.approx(2.0)
    assert m.suspicion_timeout(10) == pytest.approx(2.0)
    assert m.suspicion_timeout(1000) == pytest.approx(6.0)
    assert m.suspicion_timeout_max(10) == pytest.approx(12.0)
    assert m.dead_within(1000) > m.dead_within(8) > m.suspicion_timeout_max(8)
    assert m.retransmits(8) == 4 and m.retransmits(1000) == 16


def test_a_budget_given_alone_is_the_only_budget(tmp_path: Path) -> None:
    assert (TrainConfig().max_steps, TrainConfig().max_seconds) == (2000, 0.0)  # neither given: the defaults
    assert (TrainConfig(max_seconds=150.0).max_steps, TrainConfig(max_seconds=150.0).max_seconds) == (0, 150.0)
    assert (TrainConfig(max_steps=10).max_steps, TrainConfig(max_steps=10).max_seconds) == (10, 0.0)
    both = TrainConfig(max_steps=2000, max_seconds=150.0)
    assert (both.max_steps, both.max_seconds, both.budgets_given) == (2000, 150.0, {"max_steps", "max_seconds"})
    # --set / flags (with_overrides) and TOML files mark a budget as given the same way.
    timed = RunConfig().with_overrides({"train.max_seconds": "150"})
    assert (timed.train.max_steps, timed.train.max_seconds) == (0, 150.0)
    assert timed.with_overrides({"train.lr": 0.1}).train.max_steps == 0  # a later override of something else keeps it
    assert timed.with_overrides({"train.max_steps": 500}).train.max_steps == 500  # now both are given
    assert RunConfig().with_overrides({"train.max_steps": 10}).train.max_seconds == 0.0
    assert RunConfig().with_overrides({"train.lr": 0.1}).train.max_steps == 2000
    path = tmp_path / "run.toml"
    path.write_text("[train]\nmax_seconds = 150\n")
    from_file = RunConfig.from_toml(path)
    assert (from_file.train.max_steps, from_file.train.max_seconds) == (0, 150.0)
    assert from_file.with_overrides({"train.max_steps": "100"}).train.max_steps == 100  # file + flag: both given
    # What travels (the welcome's dict) is the resolved values: the same run, the same fingerprint.
    again = RunConfig.from_dict(timed.to_dict())
    assert again == timed and again.fingerprint() == timed.fingerprint()
    assert RunConfig().to_dict()["train"]["max_steps"] == 2000 and type(RunConfig().train.max_steps) is int


def test_the_default_topology_is_each_algorithms_own() -> None:
    assert GossipConfig().topology == "auto"
    assert GossipConfig(algorithm="push-sum").topology_spec == "one-peer-exponential"
    assert {GossipConfig(algorithm=a).topology_spec for a in ALGORITHMS if a != "push-sum"} == {"exponential"}
    assert GossipConfig(algorithm="push-sum", topology="ring").topology_spec == "ring"  # a chosen graph is kept
