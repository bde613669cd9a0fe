"""What a newcomer is compared on, where it may go, and that a refused newcomer is never counted."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import re
from pathlib import Path
from typing import Any

import pytest
import torch

import gossiptrain
from gossiptrain.config import RunConfig
from gossiptrain.errors import MismatchError
from gossiptrain.net.kinds import REFUSE, WELCOME
from gossiptrain.net.transport import listen
from gossiptrain.protocol.joining import JoinRequest, answer_join, set_fields_that_differ, taken_from_swarm
from gossiptrain.protocol.param_spec import ParamSpec
from gossiptrain.runtime.clock import REAL_CLOCK
from gossiptrain.runtime.coordinator_process import BackgroundCoordinator
from gossiptrain.runtime.join_client import join_swarm
from gossiptrain.train.model_spec import workload_spec

from .conftest import fast_config
from .swarm import next_host, run_forked, wait_for

SWARM = RunConfig().with_overrides({"train.shards": 2, "train.max_steps": 200, "gossip.topology": "ring"})


def answer(request: JoinRequest, config: RunConfig = SWARM) -> tuple[str, dict[str, Any]]:
    return answer_join(
        request, config=config, spec=None, sample=[], pick_shard=lambda shards: 0, coordinator="", rng=random.Random(0)
    )


def test_a_newcomer_is_compared_only_on_the_fields_it_set() -> None:
    mine = RunConfig().with_overrides({"train.lr": 0.1, "gossip.topology": "ring"})  # ring: as the swarm
    kind, body = answer(JoinRequest(config=mine))
    assert kind == REFUSE
    assert "train.lr: 0.1 vs 0.05" in body["reason"]
    for untouched in ("train.shards", "train.max_steps", "gossip.topology"):
        assert untouched not in body["reason"], body["reason"]
    kind, _ = answer(JoinRequest(config=RunConfig().with_overrides({"gossip.topology": "ring"})))
    assert kind == WELCOME  # nothing it set differs: it takes the swarm's shards and budget


def test_the_fields_taken_from_the_swarm_are_named_with_the_swarms_values() -> None:
    mine = RunConfig().with_overrides({"train.lr": 0.1})
    assert set_fields_that_differ(mine, SWARM) == ["train.lr: 0.1 vs 0.05"]
    assert taken_from_swarm(mine, SWARM) == ["train.shards=2", "train.max_steps=200", "gossip.topology='ring'"]


@pytest.mark.parametrize("shard", [2, 5])
def test_a_shard_the_swarm_does_not_have_is_refused_naming_it(shard: int) -> None:
    kind, body = answer(JoinRequest(shard=shard))
    assert kind == REFUSE and f"shard {shard} does not exist: the swarm has 2 shards (0-1)" in body["reason"]


def test_a_newcomer_without_a_wish_gets_a_shard_and_one_with_a_valid_wish_gets_it() -> None:
    assert answer(JoinRequest(shard=-1))[1]["shard"] == 0
    assert answer(JoinRequest(shard=1))[1]["shard"] == 1


def test_a_coordinator_of_a_named_workload_refuses_another_model_and_counts_no_one() -> None:
    config = fast_config(**{"train.shards": 2})
    spec = workload_spec(config)
    assert spec is not None and spec == workload_spec(config)  # the same model every time
    with BackgroundCoordinator(config, bind=f"{next_host()}:0", spec=spec) as coord:
        join = coord.address.removeprefix("tcp://")
        with pytest.raises(MismatchError, match=r"model differs from the swarm's: parameter 'weight' exists here but not in the swarm's model"):
            gossiptrain.Peer(torch.nn.Linear(8, 1), join=join, bind=f"{next_host()}:0")
        assert coord.coordinator.members() == [] and coord.coordinator.stats.joins_refused == 1


def test_a_peer_that_finds_its_model_wrong_after_the_welcome_withdraws_and_is_not_counted() -> None:
    config = fast_config(**{"train.shards": 2, "train.workload": "external"})
    with BackgroundCoordinator(config, bind=f"{next_host()}:0",
                               spec=ParamSpec.of(dict(torch.nn.Linear(64, 10).named_parameters()))) as coord:
        join = coord.address.removeprefix("tcp://")
        # A model built from the welcome's configuration can only be compared after the welcome.
        with pytest.raises(MismatchError, match="model differs from the swarm's"):
            gossiptrain.Peer(lambda config, shard: torch.nn.Linear(8, 1), join=join, bind=f"{next_host()}:0")
        assert coord.coordinator.stats.joins_answered == 1
        wait_for(lambda: coord.coordinator.members() == [], 10, "the coordinator to drop the withdrawn newcomer")


# -- what a peer's run flags are compared on (issue 50) ------------------------------------

#: A swarm whose run differs from the defaults in workload, lr and step budget.
FLAGGED_SWARM = {"train.workload": "digits-small", "train.lr": 0.1, "train.max_steps": 5, "train.shards": 2}


def _cli_peer(workdir: Path, join: str, *flags: str, timeout: float = 60) -> Any:
    """``gossiptrain peer --join JOIN FLAGS`` as a process: a refused one exits before anything trains. Forked from
    the test fork server (its stdout and stderr apart, as a fresh one's): what is checked is the command's own."""
    return run_forked(
        ["peer", "--join", join, "--bind", f"{next_host()}:0", "--quiet", "--join-attempts", "2", *flags],
        timeout, f"gossiptrain peer {' '.join(flags)}", workdir,
    )


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        (["--workload", "digits"], "train.workload: 'digits' vs 'digits-small'"),  # digits is the default workload
        (["--lr", "0.05"], "train.lr: 0.05 vs 0.1"),  # 0.05 is the default lr
        (["--steps", "2000"], "train.max_steps: 2000 vs 5"),  # 2000 is the default step budget
        (["--set", "train.lr=0.05"], "train.lr: 0.05 vs 0.1"),
    ],
)
def test_a_run_flag_given_at_its_default_is_compared_and_refused_naming_the_field(
    flags: list[str], named: str, tmp_path: Path
) -> None:
    with BackgroundCoordinator(fast_config(**FLAGGED_SWARM), bind=f"{next_host()}:0") as coord:
        result = _cli_peer(tmp_path, coord.address.removeprefix("tcp://"), *flags)
        assert result.returncode == 2, result.stdout + result.stderr
        assert "run configuration differs from the swarm's" in result.stderr and named in result.stderr, result.stderr
        assert "Traceback" not in result.stderr
        assert coord.coordinator.stats.joins_refused >= 1 and coord.coordinator.members() == []


def test_a_config_file_written_by_gossiptrain_config_is_compared_key_by_key(tmp_path: Path) -> None:
    from gossiptrain.cli.main import main

    full = tmp_path / "full.toml"
    with open(full, "w") as fh, contextlib.redirect_stdout(fh):
        assert main(["config"]) == 0  # every field, at its default
    with BackgroundCoordinator(fast_config(**FLAGGED_SWARM), bind=f"{next_host()}:0") as coord:
        result = _cli_peer(tmp_path, coord.address.removeprefix("tcp://"), "--config", str(full))
    assert result.returncode == 2, result.stdout + result.stderr
    for named in ("train.workload: 'digits' vs 'digits-small'", "train.lr: 0.05 vs 0.1", "train.shards: 4 vs 2",
                  "train.max_steps: 2000 vs 5"):
        assert named in result.stderr, result.stderr


def test_run_flags_not_given_are_taken_from_the_swarm_and_named(tmp_path: Path) -> None:
    with BackgroundCoordinator(fast_config(**FLAGGED_SWARM), bind=f"{next_host()}:0") as coord:
        result = _cli_peer(tmp_path, coord.address.removeprefix("tcp://"), "--lr", "0.1")  # given, and as the swarm runs it
    assert result.returncode == 0, result.stdout + result.stderr
    taken = re.search(r"from the swarm: (.*)", result.stderr)
    assert taken, result.stderr
    assert "train.workload='digits-small'" in taken.group(1) and "train.max_steps=5" in taken.group(1), taken.group(1)
    assert "train.lr" not in taken.group(1)


def test_a_config_records_the_fields_it_was_given_whatever_their_values(tmp_path: Path) -> None:
    toml = tmp_path / "run.toml"
    toml.write_text('[train]\nworkload = "digits"\nlr = 0.05\n')
    from_file = RunConfig.from_toml(toml).with_overrides({"train.max_steps": 2000})
    assert from_file == RunConfig() and from_file.fields_given == {"train.workload", "train.lr", "train.max_steps"}
    assert set_fields_that_differ(from_file, SWARM) == ["train.max_steps: 2000 vs 200"]
    assert taken_from_swarm(from_file, SWARM) == ["train.shards=2", "gossip.topology='ring'"]
    # What travels in a join is what was given: the answerer compares exactly those.
    request = JoinRequest.from_body(JoinRequest(config=from_file).to_body())
    assert request.config is not None and request.config.fields_given == from_file.fields_given
    kind, body = answer(request)
    assert kind == REFUSE and body["reason"].endswith("train.max_steps: 2000 vs 200"), body


# -- an external swarm's model (issue 50) ---------------------------------------------------


def _external_swarm(**overrides: object) -> RunConfig:
    return fast_config(**{"train.shards": 2, "train.workload": "external", **overrides})


def test_an_external_swarm_names_whence_its_model_while_a_member_is_live_and_takes_a_new_one_once_empty(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="gossiptrain.runtime.coordinator")
    with BackgroundCoordinator(_external_swarm(), bind=f"{next_host()}:0") as coord:
        join = coord.address.removeprefix("tcp://")
        first = gossiptrain.Peer(torch.nn.Linear(64, 10), join=join, bind=f"{next_host()}:0", optimizer=None)
        try:
            with pytest.raises(MismatchError) as refused:
                gossiptrain.Peer(torch.nn.Linear(64, 20), join=join, bind=f"{next_host()}:0", optimizer=None)
            line = str(refused.value)
            assert "refused us: model differs from the swarm's: " in line and "\n" not in line, line
            assert "fixed by its first member" in line and "start a new coordinator" in line, line
        finally:
            first.close()
        wait_for(lambda: coord.coordinator.spec is None, 10, "the coordinator to forget the model of an empty swarm")
        assert "no member left: the swarm's model is forgotten" in caplog.text
        with gossiptrain.Peer(torch.nn.Linear(64, 20), join=join, bind=f"{next_host()}:0", optimizer=None) as second:
            assert second.id and coord.coordinator.spec is not None


def test_an_external_swarm_whose_only_member_crashed_takes_a_new_model() -> None:
    # Silent members expire within a second here: 3 report intervals and one suspicion timeout.
    config = _external_swarm(**{"membership.report_interval": 0.2, "membership.suspicion_mult": 1.0,
                                "membership.suspicion_max_mult": 1.0})
    with BackgroundCoordinator(config, bind=f"{next_host()}:0") as coord:
        join = coord.address.removeprefix("tcp://")

        async def join_and_crash() -> None:  # welcomed with its model, then gone without a word
            transport = listen(f"tcp://{next_host()}:0", config.limits)
            await transport.start()
            try:
                await join_swarm(
                    transport, f"tcp://{join}", JoinRequest(spec=ParamSpec.of(dict(torch.nn.Linear(64, 10).named_parameters()))),
                    advertise=transport.address, limits=config.limits, clock=REAL_CLOCK, attempts=2, attempt_timeout=2.0,
                    rng=random.Random(0),
                )
            finally:
                await transport.close()

        asyncio.run(join_and_crash())
        assert coord.coordinator.spec is not None
        wait_for(lambda: coord.coordinator.spec is None, 10, "the coordinator to forget the crashed member's model")
        with gossiptrain.Peer(torch.nn.Linear(64, 20), join=join, bind=f"{next_host()}:0", optimizer=None) as peer:
            assert peer.id


def test_a_named_workloads_model_is_kept_when_the_swarm_is_empty() -> None:
    config = fast_config(**{"train.shards": 2, "membership.report_interval": 0.2})
    with BackgroundCoordinator(config, bind=f"{next_host()}:0", spec=workload_spec(config)) as coord:
        join = coord.address.removeprefix("tcp://")
        with pytest.raises(MismatchError) as refused:
            gossiptrain.Peer(torch.nn.Linear(64, 10), join=join, bind=f"{next_host()}:0", optimizer=None)
        assert "first member" not in str(refused.value)  # the workload's own model, whoever came first
        assert coord.coordinator.spec == workload_spec(config)
