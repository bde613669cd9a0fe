"""What a newcomer is compared on, where it may go, and that a refused newcomer is never counted."""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch

import gossiptrain
from gossiptrain.config import RunConfig
from gossiptrain.errors import MismatchError
from gossiptrain.net.kinds import REFUSE, WELCOME
from gossiptrain.protocol.joining import JoinRequest, answer_join, set_fields_that_differ, taken_from_swarm
from gossiptrain.protocol.param_spec import ParamSpec
from gossiptrain.runtime.coordinator_process import BackgroundCoordinator
from gossiptrain.train.model_spec import workload_spec

from .conftest import fast_config
from .swarm import next_host, wait_for

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
